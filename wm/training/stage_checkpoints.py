"""A stage's checkpoints as the loop sees them, on every rank: what a checkpoint carries besides the
tensors (Progress), when to save (every checkpoint.every steps and at the last step; also when the
caller forces it: after a validation, when stopping), the every-rank part of a save (the RNG states
gathered, the finite check all-reduced) and of a resume (rank 0 picks the file, every rank loads it).
Rank 0's wm.checkpoint.checkpointer.Checkpointer writes the files.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from wm.checkpoint.checkpointer import Checkpointer
from wm.checkpoint.checks import all_finite, checker, checkpoint_bytes, first_nonfinite, shapes
from wm.checkpoint.files import load_checked, newest_valid, rng_state
from wm.checkpoint.run_folder import Run, belongs
from wm.config.loading import to_dict
from wm.training.step_graph import plain_optimizer_state
from wm.utils import distributed
from wm.utils.atomic import require_space
from wm.utils.errors import WMError


@dataclasses.dataclass
class Progress:
    """Where a stage stands between steps: the step and the stage's last, the best validation and the
    validations since it, the last validation, the file resumed from, and its training time (this
    process's start `t0`, time.perf_counter(); earlier processes' (wall s, device s) in `before_s`)."""

    t0: float
    world_size: int
    step: int = 0
    total: int = 0
    best: Optional[float] = None
    stale: int = 0
    metrics: dict = dataclasses.field(default_factory=dict)
    resumed: Optional[str] = None
    before_s: tuple = (0.0, 0.0)

    def times(self, raw: bool = False) -> dict:
        """The stage's training time over its processes (each from its start to now; the gaps between
        a stop and the resume are in none): wall seconds and device hours (seconds x world size). `raw`:
        device seconds, as checkpoints carry it (a resume may run on another number of ranks)."""
        now = time.perf_counter() - self.t0
        wall, dev = self.before_s[0] + now, self.before_s[1] + now * self.world_size
        return {"wall_s": wall, "device_s": dev} if raw else {"wall_s": round(wall, 3), "gpu_hours": dev / 3600}


class StageCheckpoints:
    """The checkpoints of one stage (`parts`: wm.training.loop.StageParts). `ckpt` is rank 0's
    Checkpointer (None on the other ranks); `save` is called every step and saves when due."""

    def __init__(self, run: Run, stage, parts, progress: Progress):
        cfg, self.dist = run.cfg, run.dist
        self.run, self.stage, self.parts, self.progress, self.every = run, stage, parts, progress, cfg.checkpoint.every
        s = parts.scfg
        self.ckpt = Checkpointer(run.stage_dir(stage.name) / "checkpoints", cfg.checkpoint.keep_last,
                                 s.best_metric, s.best_mode, cfg.checkpoint.async_save) if self.dist.is_main else None
        params = [p for g in parts.opt.param_groups for p in g["params"]]
        pname = {id(p): n for n, p in parts.model.named_parameters()}
        self.names = {i: pname.get(id(p), "?") for i, p in enumerate(params)}  # optimizer index -> parameter
        self.check = checker(stage.name, model=shapes(parts.model.state_dict()),
                             optimizer=[tuple(p.shape) for p in params],
                             belongs=belongs(run, stage.name, stage.built_on), names=self.names)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.progress.total

    def find(self) -> tuple[Optional[str], Optional[dict]]:
        """The newest checkpoint that is intact, this run's, of this model and finite, and its state
        (rank 0 checks the disk has room for a save, then picks it, naming any it skips; every rank
        loads the same file: the run folder is on a shared filesystem). A failure stops every rank."""
        found, failure = None, None
        if self.ckpt:
            try:
                require_space(self.ckpt.folder, checkpoint_bytes(self.parts.model), f"a {self.stage.name} checkpoint")
                found = newest_valid(self.ckpt.folder, say=self.run.say, check=self.check)
            except WMError as e:
                failure = str(e)
        path, failure = distributed.broadcast_object((str(found[0]) if found else None, failure), self.dist)
        if failure:
            raise WMError(failure)
        if not path:
            return None, None
        return path, found[1] if found else load_checked(path)

    def save(self, step: int, force: bool = False, metrics: Optional[dict] = None) -> None:
        """Save step `step` when due or `force`d (`metrics`: a validation of this step, which may make it the best)."""
        if force or self.due(step):
            self.write(metrics)

    def write(self, metrics: Optional[dict] = None) -> None:
        """A checkpoint of this step (rank 0 writes; every rank takes part: RNG states are gathered).
        A state with NaN or inf is never saved nor called good: one reduction on the device."""
        dist, model, opt, name, p = self.dist, self.parts.model, self.parts.opt, self.stage.name, self.progress
        rng = distributed.gather_objects(rng_state(), dist)  # every rank reaches these collectives
        ok = all_finite([*model.state_dict().values(), *(t for v in opt.state.values() for t in v.values()
                                                           if torch.is_tensor(t))]).float()
        distributed.all_reduce_(ok, dist, op="min")
        if not ok:
            bad = first_nonfinite({"model": model.state_dict(), "optimizer": opt.state_dict()}, names=self.names)
            raise WMError(f"{name}: the state at step {p.step} holds non-finite values (first: {bad}); it was "
                          f"not saved. {self.last_good()}; lower {name}_stage.lr, check the data, or try train.amp=fp32")
        if self.ckpt is None:
            return
        sampler = self.parts.sampler
        state = {"model": model.state_dict(), "optimizer": plain_optimizer_state(opt),
                 "scaler": self.parts.scaler.state_dict(), "sampler": sampler.state_dict(), "step": p.step,
                 "epoch": sampler.epoch, "rng": rng, "best": p.best, "stale": p.stale, "metrics": metrics or p.metrics,
                 "stage": name, "config": to_dict(self.run.cfg), "data_fingerprint": self.run.fingerprint,
                 "class_names": list(self.run.manifest.info.class_names), "init": self.stage.init_source,
                 "time": p.times(raw=True), **self.stage.checkpoint_extra()}
        self.ckpt.save(state, p.step, metrics)

    def blocked_s(self) -> float:
        """How long the latest save held the loop (rank 0; 0 elsewhere)."""
        return self.ckpt.last_blocked_s if self.ckpt is not None else 0.0

    def last_good(self) -> str:
        """The newest checkpoint known complete and finite: the last one saved, else the one resumed from."""
        if self.ckpt:
            self.ckpt.close()  # first: the save in flight is part of what is on disk
        good = (self.ckpt.last_path or self.progress.resumed) if self.ckpt else "on rank 0"
        return f"The last good checkpoint is {good}" if good else "No checkpoint was saved"

    def close(self) -> None:
        """Wait for the save in flight."""
        if self.ckpt:
            self.ckpt.close()
