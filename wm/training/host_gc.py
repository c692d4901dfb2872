"""Python's garbage collector at chosen steps, the same ones on every rank.

Left automatic, a full collection (long, with the many objects a training process keeps) starts
whenever one process's allocation counts say so: one rank's host stalls, its GPU runs out of
queued work, and every other rank waits for it at the next all-reduce, a pause that grows with the
number of ranks. Off while a stage trains, with the young generations collected every `every` steps
and everything at each validation (where the ranks wait for each other anyway), the pauses are
short and happen on all ranks at once. What the process imported (torch's modules, for the life of
the process) is frozen out of the collector's sight first: a full collection then scans what
training made, not the import graph."""

from __future__ import annotations

import gc
import time


def freeze_imports() -> None:
    """Move every object alive now into the collector's permanent generation (import leaves little
    garbage, so no collection first): called once, after the imports, by the entry point, never by
    a library call, which would freeze its caller's objects for good."""
    gc.freeze()


class StepGC:
    """`with StepGC(every) as g:` automatic collection off inside; `g.step(n)` after step n,
    `g.full()` at a validation. every = 0: the collector is left as it is."""

    def __init__(self, every: int):
        self.every = int(every)

    def __enter__(self) -> "StepGC":
        if self.every:
            self.was_enabled = gc.isenabled()
            gc.collect()  # start from nothing left over from the setup
            gc.disable()
        return self

    def step(self, n: int) -> None:
        if self.every and n % self.every == 0:
            gc.collect(1)

    def full(self) -> None:
        if self.every:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.every and self.was_enabled:
            gc.enable()


class GCPauses:
    """`with GCPauses() as p:` the milliseconds this process spends in the garbage collector;
    `p.take()` says how many since the last take (a benchmark's per-step figure)."""

    def __init__(self):
        self.ms, self._t0 = 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += 1e3 * (time.perf_counter() - self._t0)
            self._t0 = None

    def take(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms

    def __enter__(self) -> "GCPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
