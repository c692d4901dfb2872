"""The training log of one stage: every logging.every steps and at the last, the step's losses
(averaged over ranks), learning rate, gradient norm, speed and memory, and a console line with the
ETA; the first step's time said apart (it compiles and starts the loader, so the rates logged after
it are the steady ones), with what torch's compile caches did. Rates count training steps only: a
validation's time is taken out (`untimed`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from wm.training import compile_cache
from wm.training.memory_plan import first_step_line, memory_scalars
from wm.training.optim import lr_factor
from wm.training.step_outcome import StepResult
from wm.utils import distributed
from wm.utils.atomic import write_bytes
from wm.utils.logs import eta

LOSS_TERMS = ("loss", "ce", "lovasz", "vq", "motion_l2")  # logged as loss/<term>; the other terms as train/<term>


def compile_report() -> str:
    """Where a first step's seconds went (Dynamo's per-phase times) and what torch's caches did
    (graphs traced, AOTAutograd and Inductor cache hits, misses and bypasses): a cached resume that
    is still slow names the cache that missed."""
    from torch._dynamo.utils import compile_times, counters

    lines = [compile_times(repr="str", aggregate=True), "", "cache counters:"]
    for group, prefix in (("stats", "unique_graphs"), ("aot_autograd", "autograd_cache"), ("inductor", "fxgraph_cache")):
        got = {k: v for k, v in counters[group].items() if k.startswith(prefix)}
        lines += [f"  {group}.{k} {v}" for k, v in sorted(got.items())]
    return "\n".join(lines) + "\n"


class StepLog:
    """`took` and `log` are called every step; `log` writes when due. `blocked_s()`: how long the
    latest checkpoint save held the loop; `count_flops(batch)`: one sample's forward + backward
    FLOPs, measured once (`measure`) for the throughput and MFU. `start` once the step is built."""

    def __init__(self, run, stage_name: str, parts, progress, device, blocked_s: Callable[[], float],
                 count_flops: Callable[[dict], float]):
        self.run, self.name, self.parts, self.progress, self.device = run, stage_name, parts, progress, device
        self.cfg, self.dist, self.logger = run.cfg, run.dist, run.log
        self.every = self.cfg.logging.every
        self.blocked_s, self.count_flops = blocked_s, count_flops
        self.flops_per_sample: Optional[float] = None
        self.compiling, self.cached, self.misses = False, False, 0

    def start(self, compiling: bool, cached: bool) -> None:
        """The clocks start now. `compiling`: the step runs torch.compile'd; `cached`: the run's
        compile cache was loaded for it."""
        self.compiling, self.cached = compiling, cached
        self.misses = compile_cache.misses()  # a loaded cache may hold none of this stage's graphs
        self.t_last, self.samples_since, self.wait_since = time.perf_counter(), 0, 0.0
        self.t_start, self.step_start = time.perf_counter(), self.progress.step
        # from the end of the first step, for the ETA
        self.t_steady, self.step_steady = self.t_start, self.progress.step

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.progress.total

    def untimed(self, seconds: float) -> None:
        """Leave `seconds` (a validation) out of the next logged rates."""
        self.t_last += seconds

    def took(self, step: int, r: StepResult) -> None:
        """Count step `step`'s samples and data wait; the first step of this process is said apart."""
        self.wait_since += r.data_wait_s
        self.samples_since += r.samples
        if step != self.step_start + 1:
            return
        first = time.perf_counter() - self.t_last
        self.cached = self.cached and compile_cache.misses() == self.misses
        self.run.say(f"{self.name}: first step {first:.1f} s" + (
            "" if not self.compiling else " (torch.compile, from the run's compile cache)" if self.cached
            else " (torch.compile compiling)"))
        self.run.say(first_step_line(getattr(self.run, "memory_plan", None), self.name, self.device))
        if self.compiling:
            self.logger.scalars(step, {"perf/first_step_s": first, "perf/compile_cache_hit": float(self.cached)},
                                kind=f"{self.name}/compile")
            if self.dist.is_main:
                compile_cache.save(self.run.dir, self.device, self.run.say)
                write_bytes(self.run.stage_dir(self.name) / "compile_times.txt", compile_report().encode())
        self.t_steady, self.step_steady = time.perf_counter(), step  # a compilation is no guide to the rest
        if not self.due(step):
            self.t_last, self.samples_since, self.wait_since = time.perf_counter(), 0, 0.0

    def measure(self, r: StepResult) -> None:
        """FLOPs per sample, once per process (after the first step: on its last micro-batch); only
        where they are logged (a peak to divide by, or CUDA)."""
        if self.flops_per_sample is None:
            wanted = self.cfg.logging.peak_tflops > 0 or self.device.type == "cuda"
            self.flops_per_sample = self.count_flops(r.batch) if wanted else 0.0

    def log(self, step: int, r: StepResult) -> None:
        """The step's losses (averaged over ranks), learning rate, gradient norm and speed, when due."""
        if not self.due(step):
            return
        cfg, dist, s, total = self.cfg, self.dist, self.parts.scfg, self.progress.total
        dt = time.perf_counter() - self.t_last
        vals = distributed.mean_scalars({k: float(v) for k, v in r.terms.items()}, dist)
        rec = {f"loss/{k}" if k in LOSS_TERMS else f"train/{k}": v for k, v in vals.items()}
        rec.update({"train/lr": s.lr * lr_factor(step - 1, total, s),  # the base rate (lr_mult 1)
                    "train/grad_norm": float(r.grad_norm),
                    "perf/samples_per_s": self.samples_since / dt, "perf/data_wait_frac": self.wait_since / dt,
                    "perf/device_hours": (time.perf_counter() - self.t_start) * dist.world_size / 3600,
                    "train/epoch": self.parts.sampler.epoch})
        rec.update(memory_scalars(getattr(self.run, "memory_plan", None), self.name, self.device))
        if self.flops_per_sample:
            achieved = self.flops_per_sample * self.samples_since / dt  # all ranks together
            rec["perf/tflops_per_s"] = achieved / 1e12
            if cfg.logging.peak_tflops > 0:
                rec["perf/mfu"] = achieved / (cfg.logging.peak_tflops * 1e12 * dist.world_size)
        if self.blocked_s():
            rec["perf/ckpt_blocked_s"] = self.blocked_s()
        self.logger.scalars(step, rec, kind=f"{self.name}/train")
        done, t0 = ((step - self.step_steady, self.t_steady) if step > self.step_steady
                    else (step - self.step_start, self.t_start))
        rate = done / max(1e-9, time.perf_counter() - t0)
        self.logger.console(f"{self.name} step {step}/{total} loss {vals['loss']:.4f} "
                            f"lr {rec['train/lr']:.2e} {rec['perf/samples_per_s']:.1f} samples/s "
                            f"data wait {100 * rec['perf/data_wait_frac']:.0f}% "
                            f"ETA {eta((total - step) / max(rate, 1e-9))}")
        self.t_last, self.samples_since, self.wait_since = time.perf_counter(), 0, 0.0
