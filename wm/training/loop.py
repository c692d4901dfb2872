"""The training loop of one stage (`fit`), and its step (`train_step`).

fit reads top to bottom, as nanoGPT's loop: per optimizer step, the learning rate, `grad_accum`
micro-batches (DDP syncs gradients only on the last), one all-reduced check that loss and gradients
are finite (a non-finite step is skipped on the device and counted; too many in a row stops the run,
the last good checkpoint intact), clip, step; then the log, the validation, the checkpoint and the
preemption check (SIGTERM/SIGINT: every rank agrees at a step boundary, saves, exits 0). Each
component is called every step and decides its own cadence: the log (wm.training.step_log), the
validation (Validator), the checkpoints (wm.training.stage_checkpoints). What differs between
stages is the stage's (wm.training.stages.Stage). The host reads a step's outcome one step late,
once the next step is queued, so it never leaves the GPU idle waiting for it; steps that log,
validate or save read every outcome first (wm.training.step_outcome.Outcomes).
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

from wm.checkpoint.files import read_json, set_rng_state
from wm.checkpoint.run_folder import Run
from wm.config.sections import Config, StageConfig
from wm.data.stats import moving_classes
from wm.data.viz import bev_pair
from wm.data.windows import ResumableSampler, make_loader, start_workers
from wm.models.layers import count_parameters
from wm.training import compile_cache
from wm.training.batching import resolved, samples_a_step, stage_batch, stage_total, steps_per_epoch
from wm.training.host_gc import StepGC
from wm.training.optim import lr_factor, make_optimizer
from wm.training.stage_checkpoints import Progress, StageCheckpoints
from wm.training.stages import Stage
from wm.training.step_graph import GraphedStep, set_lr, use_graphs
from wm.training.step_log import StepLog
from wm.training.step_outcome import HostCopy, Outcomes, StepResult, step_unless
from wm.training.wrappers import compiled, wrap_ddp
from wm.utils import distributed
from wm.utils.atomic import write_bytes
from wm.utils.errors import WMError
from wm.utils.precision import autocast


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


@dataclasses.dataclass
class Handles:
    """One model as a step reaches it."""

    model: nn.Module  # the plain module: its parameters are clipped, after_step edits it
    ddp: nn.Module  # DistributedDataParallel of it on several ranks (its no_sync), else the model
    fwd: nn.Module  # what the forward goes through: ddp, or torch.compile of it


@dataclasses.dataclass(frozen=True)
class Env:
    """Where a step runs: the device, the autocast dtype (None: fp32), the ranks."""

    device: torch.device
    dtype: Optional[torch.dtype]
    dist: distributed.Dist


@dataclasses.dataclass
class StageParts:
    """What one stage trains with: the model on its device, AdamW, the GradScaler, the resumable
    sampler and its DataLoader, the step counts, and the stage's config as this world size runs it
    (`scfg`: batch_size the micro-batch, grad_accum the micro-steps; wm.training.batching.resolved)."""

    model: nn.Module
    batch: int  # per rank and micro-step
    scfg: StageConfig
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    loader: torch.utils.data.DataLoader
    steps_per_epoch: int
    total: int  # optimizer steps of the whole stage


def train_step(stage: Stage, net: Handles, parts: StageParts, env: Env, next_batch,
               stop: Optional[Preemption] = None) -> StepResult:
    """One optimizer step: the body of fit's loop, and what tools/bench_train.py times.

    `s.grad_accum` micro-batches from `next_batch()` under autocast, the loss scaled by the
    (fp16-only) GradScaler; DDP syncs gradients on the last micro-batch only. Then unscale, clip,
    and one all-reduced flag pair [non-finite loss or gradient, stop signal] (one collective, no
    host sync: the caller reads the flags when it needs them, `StepResult.outcome`). A non-finite
    step updates nothing (decided on the device, `step_unless`); under fp16 the GradScaler skips
    inf steps itself and lowers its scale. Then the stage's after_step (the tokenizer's dead-code
    reset, also skipped on a non-finite step).

    `net`: the model's handles (`net.model` is `parts.model`); of `parts` the step uses the optimizer,
    the scaler and the config (`s`); `stop`: the preemption flag (None: never set). The caller sets
    the learning rate."""
    s, opt, scaler, device, dtype, dist = parts.scfg, parts.opt, parts.scaler, env.device, env.dtype, env.dist
    terms: dict[str, torch.Tensor] = {}
    wait, samples = 0.0, 0
    for micro in range(s.grad_accum):
        t0 = time.perf_counter()
        b = next_batch()
        # stand-in stages (a bench's, a test's) may have no prepare
        b = to_device(stage.prepare(b), device)
        wait += time.perf_counter() - t0
        sync = micro == s.grad_accum - 1
        with (net.ddp.no_sync() if dist.active and not sync else contextlib.nullcontext()):
            with autocast(device, dtype):
                out = stage.loss(net.fwd, b)
            scaler.scale(out["loss"] / s.grad_accum).backward()
        for k, v in out.items():  # kept on the device: no host sync per micro-step
            if v.ndim == 0:
                terms[k] = terms.get(k, 0) + v.detach().float() / s.grad_accum
        samples += stage.samples(b) * dist.world_size
    scaler.unscale_(opt)
    gnorm = torch.nn.utils.clip_grad_norm_(net.model.parameters(), s.clip if s.clip > 0 else float("inf"))
    # torch.full, not torch.tensor: a host value copied to the GPU would wait for the queue
    flags = torch.stack([(~torch.isfinite(terms["loss"]) | ~torch.isfinite(gnorm)).float(),
                         torch.full((), float(stop is not None and stop.requested), device=device)])
    distributed.all_reduce_(flags, dist, op="max")  # every rank skips, and stops at, the same steps
    if dtype == torch.float16:
        scaler.step(opt)
        scaler.update()
    else:
        step_unless(opt, flags[0])
    opt.zero_grad(set_to_none=True)
    stage.after_step(net.model, dist, flags[0] > 0)
    return StepResult(terms, gnorm, HostCopy(flags), dtype == torch.float16, wait, samples, b)


def stage_parts(stage: Stage, cfg: Config, dist: distributed.Dist, device: torch.device, dtype) -> StageParts:
    """fit's set-up of a stage (also tools/bench_train.py's, so the bench times what fit runs)."""
    s = resolved(cfg, stage.name, dist.world_size)
    model = stage.model.to(device)
    batch = s.batch_size
    opt = make_optimizer(model, s, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = ResumableSampler(len(stage.train_ds), dist.world_size, dist.rank, seed=cfg.run.seed, drop_last=True)
    loader = make_loader(stage.train_ds, sampler, cfg.loader, batch, endless=True)
    per_epoch = steps_per_epoch(stage.name, len(stage.train_ds), dist.world_size, batch, s.grad_accum)
    return StageParts(model, batch, s, opt, scaler, sampler, loader, per_epoch, stage_total(s, 0, sampler, batch))


def make_step(stage: Stage, parts: StageParts, cfg: Config, device: torch.device, dtype, dist: distributed.Dist, say):
    """The step fit and the bench call, `step(next_batch, stop) -> StepResult`, and whether the
    forward is torch.compile'd (for the log): train_step under DDP (several ranks) and torch.compile,
    or the step captured as CUDA graphs (compile.cuda_graphs; wm.training.step_graph), the same
    computation."""
    if use_graphs(cfg, device, dtype, say):
        fwd = compiled(parts.model, cfg, stage.inductor_options(), parts.total)
        return GraphedStep(stage, parts.model, parts.opt, parts.scfg, device, dtype, dist, fwd,
                           grad_dtype=cfg.ddp.grad_dtype, say=say), fwd is not parts.model
    ddp = wrap_ddp(parts.model, cfg, device, dist)
    net = Handles(parts.model, ddp, compiled(ddp, cfg, stage.inductor_options(), parts.total))
    env = Env(device, dtype, dist)

    def step(next_batch, stop=None) -> StepResult:
        return train_step(stage, net, parts, env, next_batch, stop=stop)
    return step, net.fwd is not ddp


def schedule(parts: StageParts, step: int, total: int) -> None:
    """The learning rate of the next step (`step` taken so far): warm-up, then cosine, times each group's lr_mult."""
    for g in parts.opt.param_groups:
        set_lr(g, parts.scfg.lr * lr_factor(step, total, parts.scfg) * g.get("lr_mult", 1.0))


def fit(run: Run, stage: Stage, device: torch.device, dtype, stop: Preemption, t0: Optional[float] = None) -> dict:
    """Train one stage to its end (or to preemption / early stop). Returns its last validation.
    `t0`: when this process began the stage (time.perf_counter(); default now), its time's start."""
    done = finished(run, stage.name)
    if done is not None:
        return done
    lp = StageLoop(run, stage, device, dtype, t0)
    lp.resume()
    lp.validator.before()
    step_fn, next_batch = lp.start()
    p, log, val, ckpts, outcomes = lp.progress, lp.log, lp.validator, lp.ckpts, lp.outcomes
    with StepGC(run.cfg.ddp.gc_every) as collector:
        while p.step < p.total:
            schedule(lp.parts, p.step, p.total)
            r = step_fn(next_batch, stop)
            p.step += 1
            log.took(p.step, r)
            collector.step(p.step)
            outcomes.read(p.step, r, everything=log.due(p.step) or val.due(p.step) or ckpts.due(p.step))
            log.log(p.step, r)
            metrics = val.validate(p.step)
            if metrics is not None:
                collector.full()
            ckpts.save(p.step, force=metrics is not None or lp.stopping() is not None, metrics=metrics)
            log.measure(r)
            if lp.stopping():
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


class StageLoop:
    """One stage's training: what it trains with (StageParts), where it stands (Progress), and the
    components fit calls every step, each deciding its own cadence: the reading of step outcomes,
    the log, the validation and the checkpoints."""

    def __init__(self, run: Run, stage: Stage, device: torch.device, dtype, t0: Optional[float] = None):
        t0 = time.perf_counter() if t0 is None else t0
        self.run, self.stage, self.env = run, stage, Env(device, dtype, run.dist)
        self.parts = stage_parts(stage, run.cfg, run.dist, device, dtype)
        self.model, self.opt, self.sampler = self.parts.model, self.parts.opt, self.parts.sampler
        self.progress = Progress(t0, run.dist.world_size, total=self.parts.total)
        self.ckpts = StageCheckpoints(run, stage, self.parts, self.progress)
        self.ckpt = self.ckpts.ckpt  # rank 0's Checkpointer, None on the others
        model = self.model  # not self: a cycle through the loop would keep its DataLoader workers past fit
        self.log = StepLog(run, stage.name, self.parts, self.progress, device, self.ckpts.blocked_s,
                           lambda batch: count_flops(stage, model, batch, device, dtype))
        self.validator = Validator(run, stage, self.parts, self.progress, self.env, self.log)
        self.outcomes = Outcomes(stage.name, run.cfg.train.max_nonfinite, run.log, run.say, self.ckpts.last_good)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def best(self) -> Optional[float]:
        return self.progress.best

    @property
    def resumed(self) -> Optional[str]:
        return self.progress.resumed

    def resume(self) -> None:
        """Go on from the newest good checkpoint, if any (StageCheckpoints.find): the model, AdamW, the
        scaler, the data order, the best validation, the time so far, and the RNG streams (re-seeded
        when the number of ranks changed: they are per rank and cannot be split or merged)."""
        path, ckpt_state = self.ckpts.find()
        p, parts, dist, cfg, name = self.progress, self.parts, self.run.dist, self.run.cfg, self.stage.name
        p.resumed = path
        if not path:
            return
        parts.model.load_state_dict(ckpt_state["model"])
        parts.opt.load_state_dict(ckpt_state["optimizer"])
        parts.scaler.load_state_dict(ckpt_state["scaler"])
        parts.sampler.load_state_dict(ckpt_state["sampler"])
        self.stage.init_source = ckpt_state.get("init")  # the fine-tune's source, in every checkpoint after
        p.step, p.best, p.stale, p.metrics = ckpt_state["step"], ckpt_state.get("best"), ckpt_state.get("stale", 0), ckpt_state.get("metrics", {})
        took = ckpt_state.get("time") or {}
        p.before_s = (float(took.get("wall_s", 0.0)), float(took.get("device_s", 0.0)))
        p.total = stage_total(parts.scfg, p.step, parts.sampler, parts.batch)
        rngs, sampler = ckpt_state["rng"], parts.sampler
        self.run.say(f"{name}: resumed from {path} at step {p.step}/{p.total} (epoch {sampler.epoch})")
        if len(rngs) == dist.world_size:
            set_rng_state(rngs[dist.rank])
            return
        seed_all(cfg.run.seed * 1000 + dist.rank + p.step)
        self.run.say(f"note: resumed on {dist.world_size} rank{'s' if dist.world_size != 1 else ''} from "
                     f"{len(rngs)}: a step now takes {samples_a_step(cfg, name, dist.world_size)} samples (it took "
                     f"{samples_a_step(cfg, name, len(rngs))}); the data order goes on at sample "
                     f"{sampler.consumed} of epoch {sampler.epoch}; RNG streams re-seeded")

    def start(self):
        """Say what trains, seed a fresh stage, build the step (DDP, torch.compile, CUDA graphs), start
        the data and the log's clocks. Returns the step and the stream of batches it takes."""
        run, dist, stage, parts, env = self.run, self.run.dist, self.stage, self.parts, self.env
        b = stage_batch(run.cfg, stage.name, dist.world_size)
        run.say(f"{stage.name}: {count_parameters(parts.model) / 1e6:.2f} M parameters, "
                f"{len(stage.train_ds)} training samples, {self.progress.total} steps of {b.per_step} samples "
                f"({b.words})")
        if not self.progress.resumed:
            seed_all(run.cfg.run.seed * 1000 + dist.rank)
        step_fn, compiling = make_step(stage, parts, run.cfg, env.device, env.dtype, dist, run.say)
        # a resume on a fresh machine of this kind reuses what the first process compiled
        cached = compiling and compile_cache.load(run.dir, env.device, run.say)
        next_batch = BatchStream(parts.loader, parts.sampler, parts.batch * dist.world_size)
        self.log.start(compiling, cached)
        parts.model.train()
        return step_fn, next_batch

    def stopping(self) -> Optional[str]:
        """Why the stage stops before its end (an early stop, a preemption), else None."""
        if self.validator.stop_reason:
            return self.validator.stop_reason
        return "preempted (SIGTERM/SIGINT)" if self.outcomes.preempt else None

    def finish(self) -> dict:
        """Wait for the last save; a preempted stage raises Preempted, a finished one is marked done
        (once its last save is on disk). Returns the last validation."""
        dist, name, reason, p = self.run.dist, self.stage.name, self.stopping(), self.progress
        self.ckpts.close()
        distributed.barrier(dist)
        self.run.log.flush()
        if reason and reason.startswith("preempted"):
            self.run.say(f"{name}: {reason}; saved step {p.step}. Run the same command to resume.")
            raise Preempted()
        if dist.is_main:
            write_bytes(self.run.stage_dir(name) / "done.json", json.dumps(
                {"step": p.step, "metrics": p.metrics, "reason": reason or "finished", **p.times()}, indent=1))
        distributed.barrier(dist)
        if reason:
            self.run.say(f"{name}: {reason}")
        return p.metrics


class Validator:
    """The stage's validation: once before a fine-tune's first step, then every eval_every steps
    (0: once an epoch; < 0: at the end only) and at the last; the metrics and pictures logged, the
    best and the validations since it tracked, the early stop decided (`stop_reason`)."""

    def __init__(self, run: Run, stage: Stage, parts: StageParts, progress: Progress, env: Env, log: StepLog):
        self.run, self.stage, self.parts, self.progress, self.env, self.log = run, stage, parts, progress, env, log
        self.stop_reason: Optional[str] = None

    def due(self, step: int) -> bool:
        s, total = self.parts.scfg, self.progress.total
        every = total if s.eval_every < 0 else (s.eval_every or self.parts.steps_per_epoch)
        return step % every == 0 or step == total

    def _evaluate(self) -> tuple[dict, list]:
        model, env = self.parts.model, self.env
        model.eval()
        out = self.stage.evaluate(model, env.dist, env.dtype, env.device)
        model.train()
        return out

    def before(self) -> None:
        """A stage initialised from another run (init.from) is validated once before its first step:
        the source model on this run's data, where the fine-tune starts (beside copy-last)."""
        applied, name = self.stage.init, self.stage.name
        if applied is None or self.progress.resumed:
            return
        metrics, _ = self._evaluate()
        self.run.log.scalars(0, metrics, kind=f"{name}/before")
        if self.run.dist.is_main:
            write_bytes(self.run.stage_dir(name) / "before.json", json.dumps(
                {"step": 0, "metrics": metrics, "source": applied.source.provenance()}, indent=1))
        self.run.log.console(f"{name} before fine-tuning (the source model on this run's validation): "
                             + summary(metrics))

    def validate(self, step: int) -> Optional[dict]:
        """When due: validate; log the metrics and pictures; track the best and the early stop.
        Returns the metrics (None: not due)."""
        if not self.due(step):
            return None
        name, s, p, logger, info = self.stage.name, self.parts.scfg, self.progress, self.run.log, self.run.manifest.info
        t_eval = time.perf_counter()
        p.metrics, pics = self._evaluate()
        self.log.untimed(time.perf_counter() - t_eval)  # the next logged samples/s is of training steps only
        logger.scalars(step, p.metrics, kind=f"{name}/val")
        for tag, frames, labels in pics:  # BEV pictures in the data set's colours, with a legend
            logger.image(f"{name}/{tag}", step, bev_pair(
                frames, info, moving_classes(info, self.run.cfg.data.moving_classes), labels))
        v = p.metrics.get(s.best_metric)
        if v is None:
            raise WMError(f"{name}_stage.best_metric {s.best_metric!r} is not a validation "
                          f"metric; choose one of {sorted(p.metrics)}")
        better = p.best is None or (v > p.best if s.best_mode == "max" else v < p.best)
        p.best, p.stale = (v, 0) if better else (p.best, p.stale + 1)
        logger.console(f"{name} step {step} validation: " + summary(p.metrics))
        if s.early_stop and p.stale >= s.early_stop:
            self.stop_reason = f"early stop: {s.best_metric} did not improve for {p.stale} validations"
        return p.metrics


def summary(metrics: dict) -> str:
    """The console's validation line: every metric but the per-step and per-class ones."""
    return ", ".join(f"{k[4:]} {metrics[k]:.2f}" for k in sorted(metrics) if "_t" not in k and "class_iou" not in k)


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
