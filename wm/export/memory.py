"""Peak host memory per phase of an export, for export.json.

``ru_maxrss`` only ever grows, so it names the process's peak but not the phase that set it. On
Linux the kernel keeps the same high-water mark as ``VmHWM`` in /proc/self/status and resets it to
the current resident size when "5" is written to /proc/self/clear_refs (Linux >= 4.0): read it at
the end of each phase, reset, and each phase gets its own peak. Where that file cannot be written
(not Linux, a locked-down container) each phase gets the running peak instead, said in "method".

At each phase end the C heap's free pages also go back to the system (glibc ``malloc_trim``): the
CPU tensors of a phase are freed into glibc's per-thread arenas, which otherwise keep them
resident, so the next phase would start several GiB higher than it needs to.

:class:`MemoryGate` runs jobs side by side only as far as a host memory budget allows (the report's
INT8 rollouts: each onnxruntime session holds a window's key/value cache and the graph's copies of
it, about 2 GiB at the occworld size).
"""

from __future__ import annotations

import resource
import threading
from pathlib import Path
from typing import Callable, Optional

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _status_gib(key: str) -> Optional[float]:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


# a high-water mark read before a reset inside a phase (MemoryGate's measurement): still that phase's
_carried = [0.0]


def _raw_hwm_gib() -> float:
    gib = _status_gib("VmHWM")
    return gib if gib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _hwm_gib() -> float:
    return max(_raw_hwm_gib(), _carried[0])


def _rss_gib() -> Optional[float]:
    return _status_gib("VmRSS")


def release_free_memory() -> None:
    """glibc's malloc_trim(0) where there is glibc; nothing elsewhere."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset(carry: bool = False) -> bool:
    """The high-water mark back to the resident size; `carry`: the mark so far kept for the phase."""
    _carried[0] = max(_carried[0], _raw_hwm_gib()) if carry else 0.0
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """`mark(phase)` at the end of each phase; `as_dict()` for export.json."""

    def __init__(self):
        self.start_gib = _hwm_gib()
        self.per_phase = _reset()
        self.peaks: dict[str, float] = {}

    def mark(self, phase: str) -> float:
        gib = _hwm_gib()
        self.peaks[phase] = round(max(gib, self.peaks.get(phase, 0.0)), 2)
        release_free_memory()
        if self.per_phase:
            _reset()
        return gib

    def peak_gib(self) -> float:
        return round(max([self.start_gib, *self.peaks.values()]), 2)

    def as_dict(self) -> dict:
        return {"host_peak_gib": self.peak_gib(), "phase_peak_gib": dict(self.peaks),
                "method": "VmHWM per phase (reset through /proc/self/clear_refs)" if self.per_phase
                else "running peak (ru_maxrss); per-phase reset unavailable here"}


class MemoryGate:
    """`run(fn, *args)` from several threads: at most `allowed` jobs at once. The first job runs
    alone; its peak above the resident size it started from (VmHWM, reset for it, the phase's peak
    so far kept for PhasePeaks) and the resident size after it set `allowed` from then on: as many
    jobs as fit under `budget_gib` beside that, at least 1, at most `most`. What the process does
    meanwhile counts in the job's peak, so the figure errs large. Where /proc/self/status is
    missing (not Linux) it lets `most` run, unmeasured. `on_measured(gate)` is called once, after
    the first job."""

    def __init__(self, most: int, budget_gib: float, on_measured: Optional[Callable[["MemoryGate"], None]] = None):
        self.most, self.budget_gib, self.on_measured = max(1, int(most)), float(budget_gib), on_measured
        measure = self.most > 1 and _rss_gib() is not None
        self.allowed = 1 if measure else self.most
        self.job_gib: Optional[float] = None  # the first job's peak above its start
        self.base_gib: Optional[float] = None  # the resident size after it
        self._running, self._probe_taken = 0, not measure
        self._cv = threading.Condition()

    def run(self, fn: Callable, *args):
        with self._cv:
            while self._running >= self.allowed:
                self._cv.wait()
            self._running += 1
            probe = not self._probe_taken
            self._probe_taken = True
            if probe:
                release_free_memory()
                _reset(carry=True)  # where it cannot be reset, an earlier peak only makes the figure larger
                start = _rss_gib()
        try:
            return fn(*args)
        finally:
            with self._cv:
                self._running -= 1
                if probe:
                    self.job_gib = max(0.0, _raw_hwm_gib() - start)
                    release_free_memory()
                    self.base_gib = _rss_gib()
                    room = self.budget_gib - self.base_gib
                    fit = int(room // self.job_gib) if self.job_gib > 0 else (self.most if room > 0 else 1)
                    self.allowed = max(1, min(self.most, fit))
                self._cv.notify_all()
            if probe and self.on_measured is not None:
                self.on_measured(self)
