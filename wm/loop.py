"""The training loop of one stage (`fit`), and its step (`train_step`).

fit reads top to bottom: per optimizer step, `grad_accum` micro-batches (DDP syncs gradients only
on the last), one all-reduced check that loss and gradients are finite (a non-finite step is skipped
on the device and counted; too many in a row stops the run, the last good checkpoint intact), clip,
step, schedule; then logging, validation, checkpointing, and the preemption check (SIGTERM/SIGINT:
every rank agrees at a step boundary, saves, exits 0). The host reads a step's outcome one step
late, once the next step is queued, so it never leaves the GPU idle waiting for it; steps that log,
validate or save read every outcome first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import signal
import time
from typing import Optional

import numpy as np
import torch
from torch import nn

from wm import compile_cache, distributed as D
from wm.atomic import require_space, write_bytes
from wm.checkpoint import load_checked, newest_valid, read_json, rng_state, set_rng_state
from wm.checkpointer import Checkpointer
from wm.ckpt_checks import all_finite, checker, checkpoint_bytes, first_nonfinite, shapes
from wm.batching import batches_per_rank, resolved, stage_batch
from wm.config import Config, StageConfig, to_dict
from wm.optim import lr_factor, make_optimizer
from wm.data import ResumableSampler, make_loader, start_workers
from wm.datastats import moving_classes
from wm.errors import WMError
from wm.evaluate import autocast
from wm.host_gc import StepGC
from wm.logs import eta
from wm.memory_plan import first_step_line, memory_scalars
from wm.run import Run, belongs
from wm.step_graph import GraphedStep, plain_optimizer_state, set_lr, use_graphs
from wm.step_outcome import HostCopy, StepResult, step_unless
from wm.layers import count_parameters
from wm.viz import bev_pair
from wm.wrappers import compiled, wrap_ddp


class Preemption:
    """SIGTERM/SIGINT only set this flag; the loop acts on it at a step boundary, on every rank
    (train_step all-reduces it with the step's finite check)."""

    def __init__(self, requested: bool = False):
        self.requested, self.signals = requested, 0

    def __call__(self, signum, frame) -> None:
        self.requested = True
        self.signals += 1
        if self.signals >= 3:  # a user pressing Ctrl-C again and again wants out now
            raise KeyboardInterrupt

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self)


class Preempted(Exception):
    pass


def seed_all(seed: int) -> None:
    """torch, numpy's global and Python's RNGs: all of them are checkpointed, so all of them start
    from run.seed (a fresh run's streams would otherwise differ from run to run)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class BatchStream:
    """The loader (make_loader(..., endless=True): every epoch in one iterator) as a stream of
    batches in the resumable sampler's order. A batch counts as consumed (`sampler.advance`) once it
    is handed out, and once an epoch's whole batches are out the sampler moves to the next epoch
    (past the tail its drop_last left), so at a step boundary the sampler's state is exactly where a
    resumed run continues. A loader that does end (a finite one) is started again."""

    def __init__(self, loader, sampler: ResumableSampler, global_batch: int):
        self.loader, self.sampler, self.global_batch = loader, sampler, global_batch
        self.rank_batch = global_batch // sampler.world_size
        self.it = self._new_iter()

    def _new_iter(self):
        # a DataLoader iterator draws its workers' base seed from the global torch RNG; that draw
        # must not shift the training RNG stream, or a resumed run (one more iterator, made at a
        # point the uninterrupted run made none) would diverge from an uninterrupted one
        with torch.random.fork_rng(devices=[]):
            return start_workers(self.loader)

    def __call__(self) -> dict:
        if len(self.sampler) < self.rank_batch:  # the epoch's whole batches are out: drop_last left a tail
            self.sampler.set_epoch(self.sampler.epoch + 1)
        try:
            b = next(self.it)
        except StopIteration:  # a finite loader: its next pass
            self.it = self._new_iter()
            b = next(self.it)
        self.sampler.advance(self.global_batch)
        return b


def train_step(stage, model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               next_batch, s: StageConfig, device: torch.device, dtype, d: D.Dist,
               ddp: Optional[nn.Module] = None, fwd: Optional[nn.Module] = None,
               stop: Optional[Preemption] = None) -> StepResult:
    """One optimizer step: the body of fit's loop, and what tools/bench_train.py times.

    `s.grad_accum` micro-batches from `next_batch()` under autocast, the loss scaled by the
    (fp16-only) GradScaler; DDP syncs gradients on the last micro-batch only. Then unscale, clip,
    and one all-reduced flag pair [non-finite loss or gradient, stop signal] (one collective, no
    host sync: the caller reads the flags when it needs them, `StepResult.outcome`). A non-finite
    step updates nothing (decided on the device, `step_unless`); under fp16 the GradScaler skips
    inf steps itself and lowers its scale. Then the stage's after_step (the tokenizer's dead-code
    reset, also skipped on a non-finite step).

    `model` is the plain module, `ddp` its DistributedDataParallel wrapper (when world > 1), `fwd`
    what the forward goes through (ddp, or torch.compile of it), `stop` the preemption flag (None:
    never set). The caller sets the learning rate."""
    ddp = model if ddp is None else ddp
    fwd = ddp if fwd is None else fwd
    terms: dict[str, torch.Tensor] = {}
    wait, samples = 0.0, 0
    for micro in range(s.grad_accum):
        t0 = time.perf_counter()
        b = next_batch()
        b = to_device(stage.prepare(b) if hasattr(stage, "prepare") else b, device)
        wait += time.perf_counter() - t0
        sync = micro == s.grad_accum - 1
        with (ddp.no_sync() if d.active and not sync else contextlib.nullcontext()):
            with autocast(device, dtype):
                out = stage.loss(fwd, b)
            scaler.scale(out["loss"] / s.grad_accum).backward()
        for k, v in out.items():  # kept on the device: no host sync per micro-step
            if v.ndim == 0:
                terms[k] = terms.get(k, 0) + v.detach().float() / s.grad_accum
        samples += stage.samples(b) * d.world_size
    scaler.unscale_(opt)
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip if s.clip > 0 else float("inf"))
    # torch.full, not torch.tensor: a host value copied to the GPU would wait for the queue
    flags = torch.stack([(~torch.isfinite(terms["loss"]) | ~torch.isfinite(gnorm)).float(),
                         torch.full((), float(stop is not None and stop.requested), device=device)])
    D.all_reduce_(flags, d, op="max")  # every rank skips, and stops at, the same steps
    if dtype == torch.float16:
        scaler.step(opt)
        scaler.update()
    else:
        step_unless(opt, flags[0])
    opt.zero_grad(set_to_none=True)
    stage.after_step(model, d, flags[0] > 0)
    return StepResult(terms, gnorm, HostCopy(flags), dtype == torch.float16, wait, samples, b)


@dataclasses.dataclass
class StageParts:
    """What one stage trains with: the model on its device, AdamW, the GradScaler, the resumable
    sampler and its DataLoader, the step counts, and the stage's config as this world size runs it
    (`s`: batch_size the micro-batch, grad_accum the micro-steps; wm.batching.resolved)."""

    model: nn.Module
    batch: int  # per rank and micro-step
    s: StageConfig
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    loader: torch.utils.data.DataLoader
    steps_per_epoch: int
    total: int  # optimizer steps of the whole stage


def stage_parts(stage, cfg: Config, d: D.Dist, device: torch.device, dtype) -> StageParts:
    """fit's set-up of a stage (also tools/bench_train.py's, so the bench times what fit runs)."""
    s = resolved(cfg, stage.name, d.world_size)
    model = stage.model.to(device)
    batch = s.batch_size
    opt = make_optimizer(model, s, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = ResumableSampler(len(stage.train_ds), d.world_size, d.rank, seed=cfg.run.seed, drop_last=True)
    loader = make_loader(stage.train_ds, sampler, cfg.loader, batch, endless=True)
    per_rank_batches = batches_per_rank(stage.name, len(stage.train_ds), d.world_size, batch, s.grad_accum)
    steps_per_epoch = per_rank_batches // s.grad_accum
    return StageParts(model, batch, s, opt, scaler, sampler, loader, steps_per_epoch, stage_total(s, 0, sampler, batch))


def make_step(stage, parts: StageParts, cfg: Config, device: torch.device, dtype, d: D.Dist, say):
    """The step fit and the bench call, `step(next_batch, stop) -> StepResult`, and what the forward
    goes through (for the log): train_step under DDP (several ranks) and torch.compile, or the step
    captured as CUDA graphs (compile.cuda_graphs; wm.step_graph), the same computation."""
    if use_graphs(cfg, device, dtype, say):
        fwd = compiled(parts.model, cfg, stage.inductor_options(), parts.total)
        return GraphedStep(stage, parts.model, parts.opt, parts.s, device, dtype, d, fwd,
                           grad_dtype=cfg.ddp.grad_dtype, say=say), fwd is not parts.model
    ddp = wrap_ddp(parts.model, cfg, device, d)
    fwd = compiled(ddp, cfg, stage.inductor_options(), parts.total)

    def step(next_batch, stop=None) -> StepResult:
        return train_step(stage, parts.model, parts.opt, parts.scaler, next_batch, parts.s, device, dtype, d,
                          ddp=ddp, fwd=fwd, stop=stop)
    return step, fwd is not ddp


def stage_total(s: StageConfig, step: int, sampler: ResumableSampler, batch: int) -> int:
    """The stage's last step: max_steps, else the end of epoch `epochs` from the sampler's position
    (the rest of its epoch at this world size, then whole epochs, in micro-batches of `batch` a rank,
    grad_accum to a step). The same from every resume point at one world size; after a change of
    world size the stage still ends after `epochs` passes over the data."""
    if s.max_steps:
        return s.max_steps
    per_epoch = sampler.n // sampler.world_size // batch
    left = (sampler.n - sampler.consumed) // sampler.world_size // batch + (s.epochs - sampler.epoch - 1) * per_epoch
    return step + max(0, left) // s.grad_accum


def fit(run: Run, stage, device: torch.device, dtype, stop: Preemption, t0: Optional[float] = None) -> dict:
    """Train one stage to its end (or to preemption / early stop). Returns its last validation.
    `t0`: when this process began the stage (time.perf_counter(); default now), its time's start."""
    done = finished(run, stage.name)
    if done is not None:
        return done
    lp = StageLoop(run, stage, device, dtype, time.perf_counter() if t0 is None else t0)
    lp.resume()
    lp.before()
    lp.start()
    with StepGC(run.cfg.ddp.gc_every) as collector:
        while lp.step < lp.total:
            lp.schedule()
            r = lp.step_fn(lp.next_batch, stop)
            due = lp.took(r)
            collector.step(lp.step)
            lp.read_outcomes(due)
            if due.log:
                lp.log(r)
            if due.eval:
                lp.validate()
                collector.full()
            if lp.save_or_stop(due, r):
                break
    return lp.finish()


def finished(run: Run, name: str) -> Optional[dict]:
    """The last validation of a stage that finished (its done.json), else None."""
    done_file = run.stage_dir(name) / "done.json"
    if not done_file.is_file():
        return None
    res = read_json(done_file)
    if res is not None and isinstance(res.get("step"), int):
        run.say(f"{name} stage already finished at step {res['step']}; using it")
        return res.get("metrics", {})
    run.say(f"note: {done_file} is damaged; checking the stage again from its checkpoints")
    return None


@dataclasses.dataclass
class Due:
    """What the step just taken is for, besides training."""

    log: bool
    eval: bool
    save: bool


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


class StageLoop:
    """One stage's training state between steps: the parts it trains with (StageParts), the step,
    the best validation and the steps since it, what is still to be logged, the stop reason."""

    def __init__(self, run: Run, stage, device: torch.device, dtype, t0: Optional[float] = None):
        self.run, self.stage, self.device, self.dtype = run, stage, device, dtype
        self.t0, self.before_s = time.perf_counter() if t0 is None else t0, (0.0, 0.0)  # this process's start; earlier processes' (wall s, device s)
        self.cfg, self.d, self.logger = run.cfg, run.d, run.log
        parts = stage_parts(stage, self.cfg, self.d, device, dtype)
        self.parts, self.s = parts, parts.s
        self.model, self.batch, self.opt, self.scaler = parts.model, parts.batch, parts.opt, parts.scaler
        self.sampler, self.loader = parts.sampler, parts.loader
        self.steps_per_epoch, self.total = parts.steps_per_epoch, parts.total
        self.ckpt = Checkpointer(run.stage_dir(stage.name) / "checkpoints", self.cfg.checkpoint.keep_last,
                                 self.s.best_metric, self.s.best_mode, self.cfg.checkpoint.async_save) \
            if self.d.is_main else None
        self.step, self.best, self.stale, self.last_val, self.resumed = 0, None, 0, {}, None
        params = [p for g in self.opt.param_groups for p in g["params"]]
        pname = {id(p): n for n, p in self.model.named_parameters()}
        self.names = {i: pname.get(id(p), "?") for i, p in enumerate(params)}  # optimizer index -> parameter
        self.check = checker(stage.name, model=shapes(self.model.state_dict()),
                             optimizer=[tuple(p.shape) for p in params],
                             belongs=belongs(run, stage.name, getattr(stage, "tok_sha", None)), names=self.names)
        self.nonfinite, self.unread, self.preempt, self.stop_reason = 0, [], False, None
        self.flops_per_sample, self.evaluated = None, False

    def resume(self) -> None:
        """Load the newest checkpoint that is intact, this run's, of this model and finite (rank 0
        checks the disk has room for a save, then picks it, naming any it skips; every rank loads the
        same file: the run folder is on a shared filesystem). A failure stops every rank."""
        found, failure, d = None, None, self.d
        if self.ckpt:
            try:
                require_space(self.ckpt.folder, checkpoint_bytes(self.model), f"a {self.stage.name} checkpoint")
                found = newest_valid(self.ckpt.folder, say=self.run.say, check=self.check)
            except WMError as e:
                failure = str(e)
        path, failure = D.broadcast_object((str(found[0]) if found else None, failure), d)
        if failure:
            raise WMError(failure)
        self.resumed = path
        if not path:
            return
        st = found[1] if found else load_checked(path)
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["optimizer"])
        self.scaler.load_state_dict(st["scaler"])
        self.sampler.load_state_dict(st["sampler"])
        self.stage.init_source = st.get("init")  # the fine-tune's source, in every checkpoint after
        self.step, self.best, self.stale, self.last_val = st["step"], st.get("best"), st.get("stale", 0), \
            st.get("metrics", {})
        took = st.get("time") or {}
        self.before_s = (float(took.get("wall_s", 0.0)), float(took.get("device_s", 0.0)))
        self.total = stage_total(self.s, self.step, self.sampler, self.batch)
        rngs = st["rng"]
        self.run.say(f"{self.stage.name}: resumed from {path} at step {self.step}/{self.total} "
                     f"(epoch {self.sampler.epoch})")
        if len(rngs) == d.world_size:
            set_rng_state(rngs[d.rank])
        else:  # the data order is global; the RNG streams are per rank and cannot be split or merged
            seed_all(self.cfg.run.seed * 1000 + d.rank + self.step)
            g, glob = self.batch * self.s.grad_accum, getattr(self.cfg, f"{self.stage.name}_stage").global_batch
            took = glob or g * len(rngs)  # a global batch is the same on any number of ranks
            self.run.say(f"note: resumed on {d.world_size} rank{'s' if d.world_size != 1 else ''} from "
                         f"{len(rngs)}: a step now takes {g * d.world_size} samples (it took {took}); "
                         f"the data order goes on at sample {self.sampler.consumed} of epoch "
                         f"{self.sampler.epoch}; RNG streams re-seeded")

    def before(self) -> None:
        """A stage initialised from another run (init.from) is validated once before its first step:
        the source model on this run's data, where the fine-tune starts (beside copy-last)."""
        applied = getattr(self.stage, "init", None)
        if applied is None or self.resumed:
            return
        name = self.stage.name
        self.model.eval()
        metrics, _ = self.stage.evaluate(self.model, self.d, self.dtype, self.device)
        self.model.train()
        self.logger.scalars(0, metrics, kind=f"{name}/before")
        if self.d.is_main:
            write_bytes(self.run.stage_dir(name) / "before.json", json.dumps(
                {"step": 0, "metrics": metrics, "source": applied.source.provenance()}, indent=1))
        self.logger.console(f"{name} before fine-tuning (the source model on this run's validation): " + ", ".join(
            f"{k[4:]} {metrics[k]:.2f}" for k in sorted(metrics) if "_t" not in k and "class_iou" not in k))

    def start(self) -> None:
        """Say what trains, seed a fresh stage, wrap the model (DDP, torch.compile), start the data."""
        cfg, d, s, stage = self.cfg, self.d, self.s, self.stage
        self.run.say(f"{stage.name}: {count_parameters(self.model) / 1e6:.2f} M parameters, "
                     f"{len(stage.train_ds)} training samples, {self.total} steps of "
                     f"{self.batch * d.world_size * s.grad_accum} samples "
                     f"({stage_batch(cfg, stage.name, d.world_size).words})")
        if not self.resumed:
            seed_all(cfg.run.seed * 1000 + d.rank)
        self.eval_every = self.total if s.eval_every < 0 else (s.eval_every or self.steps_per_epoch)
        self.step_fn, self.compiling = make_step(stage, self.parts, cfg, self.device, self.dtype, d, self.run.say)
        # a resume on a fresh machine of this kind reuses what the first process compiled
        self.cached = self.compiling and compile_cache.load(self.run.dir, self.device, self.run.say)
        self.misses = compile_cache.misses()  # a loaded cache may hold none of this stage's graphs
        self.next_batch = BatchStream(self.loader, self.sampler, self.batch * d.world_size)
        self.t_last, self.samples_since, self.wait_since = time.perf_counter(), 0, 0.0
        self.t_start, self.step_start = time.perf_counter(), self.step
        self.t_steady, self.step_steady = self.t_start, self.step  # from the end of the first step, for the ETA
        self.model.train()

    def schedule(self) -> None:
        """The learning rate of the step to take: warm-up, then cosine."""
        for g in self.opt.param_groups:
            set_lr(g, self.s.lr * lr_factor(self.step, self.total, self.s) * g.get("lr_mult", 1.0))

    def took(self, r: StepResult) -> Due:
        """Count a step taken; what it is due for. The first step's time is said apart: it compiles
        (compile.enable) and starts the loader, so the rates logged after it are the steady ones."""
        self.wait_since += r.data_wait_s
        self.samples_since += r.samples
        self.step += 1
        self.unread.append((self.step, r))
        step, total, cfg = self.step, self.total, self.cfg
        due = Due(log=step % cfg.logging.every == 0 or step == total, eval=step % self.eval_every == 0 or step == total,
                  save=step % cfg.checkpoint.every == 0 or step == total)
        if step == self.step_start + 1:
            first = time.perf_counter() - self.t_last
            self.cached = self.cached and compile_cache.misses() == self.misses
            self.run.say(f"{self.stage.name}: first step {first:.1f} s" + (
                "" if not self.compiling else " (torch.compile, from the run's compile cache)" if self.cached
                else " (torch.compile compiling)"))
            self.run.say(first_step_line(getattr(self.run, "memory_plan", None), self.stage.name, self.device))
            if self.compiling:
                self.logger.scalars(step, {"perf/first_step_s": first, "perf/compile_cache_hit": float(self.cached)},
                                    kind=f"{self.stage.name}/compile")
                if self.d.is_main:
                    compile_cache.save(self.run.dir, self.device, self.run.say)
                    write_bytes(self.run.stage_dir(self.stage.name) / "compile_times.txt", compile_report().encode())
            self.t_steady, self.step_steady = time.perf_counter(), step  # a compilation is no guide to the rest
            if not due.log:
                self.t_last, self.samples_since, self.wait_since = time.perf_counter(), 0, 0.0
        return due

    def read_outcomes(self, due: Due) -> None:
        """Skipped? stop signal? Read one step late (the previous step's, finished or nearly, while this
        one runs) so the GPU's queue never runs dry; a step that logs, validates or saves reads every
        outcome first, as does a stop. Too many non-finite steps in a row stop the run here."""
        name = self.stage.name
        while self.unread and (due.log or due.eval or due.save or self.preempt or len(self.unread) > 1):
            j, rj = self.unread.pop(0)
            skipped, stop = rj.outcome()
            self.preempt = self.preempt or stop
            if not skipped:
                self.nonfinite = 0
                continue
            self.nonfinite += 1  # nothing was updated
            self.logger.scalars(j, {"train/nonfinite_steps": self.nonfinite}, kind=f"{name}/skip")
            self.run.say(f"{name} step {j}: non-finite loss or gradient, step skipped ({self.nonfinite} in a row)")
            if self.nonfinite >= self.cfg.train.max_nonfinite:
                raise WMError(f"{name}: {self.nonfinite} non-finite steps in a row at step {j}; stopped. "
                              f"{self.last_good()}; lower {name}_stage.lr, check the data, or try train.amp=fp32")

    def log(self, r: StepResult) -> None:
        """The step's losses (averaged over ranks), learning rate, gradient norm and speed."""
        cfg, d, device = self.cfg, self.d, self.device
        dt = time.perf_counter() - self.t_last
        vals = D.mean_scalars({k: float(v) for k, v in r.terms.items()}, d)
        rec = {f"loss/{k}" if k in ("loss", "ce", "lovasz", "vq", "motion_l2") else f"train/{k}": v
               for k, v in vals.items()}
        rec.update({"train/lr": self.s.lr * lr_factor(self.step - 1, self.total, self.s),  # the base rate (lr_mult 1)
                    "train/grad_norm": float(r.grad_norm),
                    "perf/samples_per_s": self.samples_since / dt, "perf/data_wait_frac": self.wait_since / dt,
                    "perf/device_hours": (time.perf_counter() - self.t_start) * d.world_size / 3600,
                    "train/epoch": self.sampler.epoch})
        rec.update(memory_scalars(getattr(self.run, "memory_plan", None), self.stage.name, device))
        if self.flops_per_sample:
            achieved = self.flops_per_sample * self.samples_since / dt  # all ranks together
            rec["perf/tflops_per_s"] = achieved / 1e12
            if cfg.logging.peak_tflops > 0:
                rec["perf/mfu"] = achieved / (cfg.logging.peak_tflops * 1e12 * d.world_size)
        if self.ckpt is not None and self.ckpt.last_blocked_s:
            rec["perf/ckpt_blocked_s"] = self.ckpt.last_blocked_s
        self.logger.scalars(self.step, rec, kind=f"{self.stage.name}/train")
        done, t0 = ((self.step - self.step_steady, self.t_steady) if self.step > self.step_steady
                    else (self.step - self.step_start, self.t_start))
        rate = done / max(1e-9, time.perf_counter() - t0)
        self.logger.console(f"{self.stage.name} step {self.step}/{self.total} loss {vals['loss']:.4f} "
                          f"lr {rec['train/lr']:.2e} {rec['perf/samples_per_s']:.1f} samples/s "
                          f"data wait {100 * rec['perf/data_wait_frac']:.0f}% "
                          f"ETA {eta((self.total - self.step) / max(rate, 1e-9))}")
        self.t_last, self.samples_since, self.wait_since = time.perf_counter(), 0, 0.0

    def validate(self) -> None:
        """Validate; log the metrics and pictures; track the best and the early stop."""
        name, s, info = self.stage.name, self.s, self.run.manifest.info
        self.model.eval()
        t_eval = time.perf_counter()
        self.last_val, pics = self.stage.evaluate(self.model, self.d, self.dtype, self.device)
        self.t_last += time.perf_counter() - t_eval  # the next logged samples/s is of training steps only
        self.model.train()
        self.evaluated = True
        self.logger.scalars(self.step, self.last_val, kind=f"{name}/val")
        for tag, frames, labels in pics:  # BEV pictures in the data set's colours, with a legend
            self.logger.image(f"{name}/{tag}", self.step, bev_pair(
                frames, info, moving_classes(info, self.cfg.data.moving_classes), labels))
        v = self.last_val.get(s.best_metric)
        if v is None:
            raise WMError(f"{name}_stage.best_metric {s.best_metric!r} is not a validation "
                          f"metric; choose one of {sorted(self.last_val)}")
        better = self.best is None or (v > self.best if s.best_mode == "max" else v < self.best)
        self.best, self.stale = (v, 0) if better else (self.best, self.stale + 1)
        self.logger.console(f"{name} step {self.step} validation: " + ", ".join(
            f"{k[4:]} {self.last_val[k]:.2f}" for k in sorted(self.last_val) if "_t" not in k and "class_iou" not in k))
        if s.early_stop and self.stale >= s.early_stop:
            self.stop_reason = f"early stop: {s.best_metric} did not improve for {self.stale} validations"

    def save_or_stop(self, due: Due, r: StepResult) -> bool:
        """Save when validated, due or stopping (preemption, early stop); whether to stop."""
        if self.preempt and not self.stop_reason:
            self.stop_reason = "preempted (SIGTERM/SIGINT)"
        evaluated, self.evaluated = self.evaluated, False
        if evaluated or due.save or self.stop_reason:
            self.save(self.last_val if evaluated else None)
        if self.flops_per_sample is None:  # once per process, after the first step
            self.flops_per_sample = count_flops(self.stage, self.model, r.batch, self.device, self.dtype) \
                if self.cfg.logging.peak_tflops > 0 or self.device.type == "cuda" else 0.0
        return self.stop_reason is not None

    def save(self, metrics: Optional[dict] = None) -> None:
        """A checkpoint of this step (rank 0 writes; every rank takes part: RNG states are gathered).
        A state with NaN or inf is never saved nor called good: one reduction on the device."""
        d, model, opt, name = self.d, self.model, self.opt, self.stage.name
        rng = D.gather_objects(rng_state(), d)  # every rank reaches these collectives
        ok = all_finite([*model.state_dict().values(), *(t for v in opt.state.values() for t in v.values()
                                                           if torch.is_tensor(t))]).float()
        D.all_reduce_(ok, d, op="min")
        if not ok:
            bad = first_nonfinite({"model": model.state_dict(), "optimizer": opt.state_dict()}, names=self.names)
            raise WMError(f"{name}: the state at step {self.step} holds non-finite values (first: {bad}); it was "
                          f"not saved. {self.last_good()}; lower {name}_stage.lr, check the data, or try train.amp=fp32")
        if self.ckpt is None:
            return
        state = {"model": model.state_dict(), "optimizer": plain_optimizer_state(opt), "scaler": self.scaler.state_dict(),
                 "sampler": self.sampler.state_dict(), "step": self.step, "epoch": self.sampler.epoch, "rng": rng,
                 "best": self.best, "stale": self.stale, "metrics": metrics or self.last_val, "stage": name,
                 "config": to_dict(self.cfg), "data_fingerprint": self.run.fingerprint,
                 "class_names": list(self.run.manifest.info.class_names),
                 "init": getattr(self.stage, "init_source", None), "time": self.times(raw=True)}
        if name == "world":
            state["tokenizer"] = {"path": str(self.stage.tok_path), "sha256": self.stage.tok_sha}
        self.ckpt.save(state, self.step, metrics)

    def times(self, raw: bool = False) -> dict:
        """The stage's training time over its processes (each from its start to now; the gaps between
        a stop and the resume are in none): wall seconds and device hours (seconds x world size). `raw`:
        device seconds, as checkpoints carry it (a resume may run on another number of ranks)."""
        now = time.perf_counter() - self.t0
        wall, dev = self.before_s[0] + now, self.before_s[1] + now * self.d.world_size
        return {"wall_s": wall, "device_s": dev} if raw else {"wall_s": round(wall, 3), "gpu_hours": dev / 3600}

    def last_good(self) -> str:
        """The newest checkpoint known complete and finite: the last one saved, else the one resumed from."""
        if self.ckpt:
            self.ckpt.close()  # first: the save in flight is part of what is on disk
        good = (self.ckpt.last_path or self.resumed) if self.ckpt else "on rank 0"
        return f"The last good checkpoint is {good}" if good else "No checkpoint was saved"

    def finish(self) -> dict:
        """Wait for the last save; a preempted stage raises Preempted, a finished one is marked done
        (once its last save is on disk). Returns the last validation."""
        d, name, reason = self.d, self.stage.name, self.stop_reason
        if self.ckpt:
            self.ckpt.close()
        D.barrier(d)
        self.logger.flush()
        if reason and reason.startswith("preempted"):
            self.run.say(f"{name}: {reason}; saved step {self.step}. Run the same command to resume.")
            raise Preempted()
        if d.is_main:
            write_bytes(self.run.stage_dir(name) / "done.json", json.dumps(
                {"step": self.step, "metrics": self.last_val, "reason": reason or "finished", **self.times()}, indent=1))
        D.barrier(d)
        if reason:
            self.run.say(f"{name}: {reason}")
        return self.last_val


def count_flops(stage, model, batch, device, dtype) -> float:
    """FLOPs of one training sample's forward + backward (torch.utils.flop_counter), for MFU."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    model.eval()  # training-mode forwards update state (codebook ages): leave no trace
    try:
        with counter:
            with autocast(device, dtype):
                out = stage.loss(model, batch)
            out["loss"].backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train()
    return counter.get_total_flops() / stage.samples(batch)
