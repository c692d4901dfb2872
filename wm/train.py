"""The training loop: stages, AMP, accumulation, DDP, validation, checkpoints, resume, preemption.

    python train.py                                   # the demo: synthetic scenes, both stages, a table
    torchrun --nproc_per_node 8 train.py --cfg cfg.json [--set train.amp=fp16 ...]

A run lives in `<run.out_dir>/<run.name>/`: `config.json` (resolved, with the data fingerprint and
versions), `<stage>/checkpoints/`, `tb/`, `metrics.jsonl`. Stages run in order: the tokenizer
(VQ-VAE on single frames), then the world model on the frozen tokenizer, trained from a token cache
(every training frame encoded once) and validated by decoding its rollouts against the real
occupancy, beside the copy-last-frame baseline. Re-running the same command resumes from the newest
complete checkpoint; `--fresh` starts over (the old run folder is moved aside, never deleted).

The loop itself (`fit`) reads top to bottom: per optimizer step, `grad_accum` micro-batches
(DDP syncs gradients only on the last), one all-reduced check that loss and gradients are finite
(a non-finite step is skipped on the device and counted; too many in a row stops the run, the last
good checkpoint intact), clip, step, schedule; then logging, validation, checkpointing, and the
preemption check (SIGTERM/SIGINT: every rank agrees at a step boundary, saves, exits 0). The host
reads a step's outcome one step late, once the next step is queued, so it never leaves the GPU idle
waiting for it; steps that log, validate or save read every outcome first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

import wm
from wm import distributed as D, runlock
from wm.checkpoint import (Checkpointer, latest_checkpoint, load_checked, newest_valid, rng_state,
                           set_rng_state, sha256_file, write_hashed)
from wm.config import (Config, DataConfig, StageConfig, from_saved, load as load_config, resolve_batch_sizes,
                       save as save_config, stage_batch, to_dict)
from wm.data import (CodeWindows, OccWindows, ResumableSampler, check_against_config, ignore_stop_signals, make_loader,
                     resolve_root, start_workers)
from wm.atomic import clean_temps, fsync_dir, require_space, write_bytes
from wm.ckpt_checks import EVAL_KEYS, all_finite, checker, checkpoint_bytes, first_nonfinite, meta_model, shapes
from wm.datastats import moving_classes, sample_counts
from wm.errors import ConfigError, DataError, WMError, first_line
from wm.logs import Logger, eta
from wm.evaluate import autocast, eval_batches, evaluate_run, forecast, frames_config, reconstruction
from wm.horizons import check_config_reaches, print_plan
from wm.metrics import step_label
from wm.layers import count_parameters
from wm.tokenizer import Tokenizer
from wm.viz import figure
from wm.world import WorldModel

# ---------------------------------------------------------------------------------------------
# preemption: a signal only sets a flag; the loop acts on it at a step boundary, on every rank

_STOP = {"flag": False, "count": 0}


def _on_signal(signum, frame):
    _STOP["flag"] = True
    _STOP["count"] += 1
    if _STOP["count"] >= 3:  # a user pressing Ctrl-C again and again wants out now
        raise KeyboardInterrupt


def install_signal_handlers() -> None:
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)


# ---------------------------------------------------------------------------------------------
# small pieces


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (Intel AMX tiles: Sapphire Rapids and later)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def amp_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype, or None for fp32. "auto": bf16 on CUDA, and on a CPU with AMX, where the
    demo takes a quarter less time in bf16 (BENCHMARKS.md, 10.6 -> 7.9 min on 2 cores); fp32 on other
    CPUs, whose bf16 is emulated and slower."""
    amp = cfg.train.amp
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_amx()) else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[amp]


def device_line(cfg: Config, d: D.Dist, device: torch.device, dtype) -> str:
    """What trains and in which precision, for the log's first lines: '1 rank on cpu (2 threads), fp32
    (train.amp=auto: no AMX on this CPU)'."""
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}")
    prec = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    why = cfg.train.amp
    if why == "auto":
        why = "auto" if device.type == "cuda" else f"auto: {'AMX' if cpu_has_amx() else 'no AMX'} on this CPU"
    return (f"{d.world_size} rank{'s' if d.world_size != 1 else ''} on {device.type} ({where}), {prec} "
            f"(train.amp={why})")


def lr_factor(step: int, total: int, s: StageConfig) -> float:
    """Linear warm-up to lr, then cosine to min_lr at `total` steps (as a multiple of lr)."""
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    p = min(1.0, (step - s.warmup_steps) / span)
    lo = s.min_lr / s.lr
    return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p))


def make_optimizer(model: nn.Module, s: StageConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and kernels only (not on norms, biases, embeddings of 1 dim)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=tuple(s.betas),
                             fused=device.type == "cuda")


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and/or torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def seed_all(seed: int) -> None:
    """torch, numpy's global and Python's RNGs: all of them are checkpointed, so all of them start
    from run.seed (a fresh run's streams would otherwise differ from run to run)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# the run folder


class Run:
    """Everything both stages share: config, ranks, data root and fingerprint, folder, logger."""

    def __init__(self, cfg: Config, d: D.Dist, fresh: bool = False, allow_new_data: bool = False,
                 allow_changed: tuple[str, ...] = ()):
        self.cfg, self.d = cfg, d
        self.locked = False
        self.dir = Path(cfg.run.out_dir) / cfg.run.name
        say = print if d.is_main else (lambda *a, **k: None)
        self.say = say
        # data: the synthetic set is generated by rank 0 first, the others then find it
        if d.is_main or cfg.data.root:
            self.root = resolve_root(cfg, log=say)
        D.barrier(d)
        if not d.is_main and not cfg.data.root:
            self.root = resolve_root(cfg, log=say)
        from wm.shards import load_manifest

        self.manifest = load_manifest(self.root)
        self.fingerprint = self.manifest.fingerprint
        # a data set that does not fit the config refuses to start before the run folder is made,
        # so the corrected command is not then refused as "another config"
        check_against_config(self.manifest, cfg.data)
        # the run folder: resume the same run, refuse a different one, start over only when asked
        meta = {"data_fingerprint": self.fingerprint, "data_root": str(self.root),
                "wm_version": wm.__version__, "torch_version": torch.__version__,
                "git_commit": git_commit(), "world_size": d.world_size,
                "shards": {s["path"]: s["sha256"] for s in self.manifest.shards}}  # what it trained on
        self.resuming, self.fingerprints = False, {self.fingerprint}  # the data its checkpoints may name
        error = None
        if d.is_main:
            try:
                self._open_folder(fresh, allow_new_data, allow_changed, meta)
            except WMError as e:
                error = e
        failure = D.broadcast_object(None if error is None else str(error), d)  # every rank stops with it
        if failure is not None:
            raise error or WMError(failure)
        self.resuming, self.fingerprints = D.broadcast_object((self.resuming, self.fingerprints), d)
        D.barrier(d)
        self.log = Logger(self.dir, enabled=d.is_main, tensorboard=cfg.train.tensorboard)

    def _open_folder(self, fresh: bool, allow_new_data: bool, allow_changed: tuple[str, ...], meta: dict) -> None:
        """Rank 0: take the folder's lock (before anything is written), then resume the same run,
        refuse a different one, or move it aside (--fresh); write config.json."""
        say = self.say
        todo = [s for s in self.cfg.train.stages if not (self.dir / s / "done.json").is_file()]
        if todo:  # a full disk is said before anything is written, not at the first save
            need, stage = max((checkpoint_bytes(meta_model(self.cfg, s)), s) for s in todo)
            require_space(self.dir, need + (1 << 20), f"the run folder with a {stage} checkpoint")
        runlock.acquire(self.dir, say)
        self.locked = True
        try:
            prev = self.dir / "config.json"
            history = []
            if prev.is_file() and fresh:
                base = f"{self.dir.name}.{time.strftime('%Y%m%d-%H%M%S')}"
                aside, n = self.dir.with_name(base), 1
                while aside.exists():  # two --fresh in one second: never onto an older run
                    aside, n = self.dir.with_name(f"{base}-{n}"), n + 1
                os.replace(self.dir, aside)
                runlock.move_held(self.dir, aside)
                self.locked = False
                runlock.acquire(self.dir, say)  # the new folder's own lock, then the old one's goes
                self.locked = True
                runlock.release(aside)
                say(f"--fresh: moved the previous run to {aside}")
            elif prev.is_file():
                history = self._check_same_run(prev, allow_new_data, allow_changed)
                self.resuming = True
            elif allow_changed:
                raise WMError(f"--allow-changed resumes a run, but {self.dir} holds none yet; leave it out")
            if history:
                meta["history"] = history
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                save_config(self.cfg, self.dir / "config.json", meta)
            except OSError as e:
                raise WMError(f"cannot write the run folder {self.dir} ({e}); set run.out_dir to a "
                              "writable folder") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the run folder's lock back (rank 0)."""
        if self.locked:
            runlock.release(self.dir)
            self.locked = False

    def _check_same_run(self, prev: Path, allow_new_data: bool, allow_changed: tuple[str, ...] = ()) -> list:
        """Refuse a run folder that holds another run; returns the config history to write (the
        earlier entries, plus this resume's --allow-changed changes)."""
        try:
            old = json.loads(prev.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise WMError(f"{prev} is unreadable ({e}); use --fresh to start over") from None
        meta = old.pop("meta", {}) or {}
        fp = meta.get("data_fingerprint")
        if fp and fp != self.fingerprint and not allow_new_data:
            raise WMError(f"{self.dir} was trained on data {fp[:16]} but {self.root} is "
                          f"{self.fingerprint[:16]}; pass --allow-new-data to resume on it anyway, or "
                          "--fresh / another run.name to start over")
        try:
            old_cfg = from_saved(old)
        except ConfigError as e:
            raise WMError(f"{prev}: {e}; use --fresh to start over") from None
        a, b = resolve_batch_sizes(to_dict(old_cfg)), resolve_batch_sizes(to_dict(self.cfg))
        # a stage that has not saved anything yet may still be configured freely
        free = {sec for stage, secs in STAGE_SECTIONS.items()
                if not latest_checkpoint(self.dir / stage / "checkpoints") for sec in secs}
        changed = {f"{sec}.{k}": [a[sec][k], b[sec][k]] for sec in a if sec not in free for k in a[sec]
                   if a[sec][k] != b[sec][k] and k not in RESUME_MAY_CHANGE.get(sec, ())}
        history = list(meta.get("history") or [])
        self.fingerprints |= {f for h in history for f in h.get("data_fingerprint", ())}
        for key in allow_changed:
            sec, _, k = key.partition(".")
            if sec not in a or k not in a[sec]:
                raise ConfigError(key, "unknown key given to --allow-changed")
            if not (sec.endswith("_stage") and k in SAFE_TO_CHANGE):
                raise WMError(f"--allow-changed {key}: {key} changes the data or the model, so a run cannot "
                              f"resume with it changed (keys that may change: <stage>_stage."
                              f"{{{','.join(SAFE_TO_CHANGE)}}}); use --fresh or another run.name")
        refused = [k for k in changed if k not in allow_changed]
        if refused:
            diffs = [f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused]
            safe = [k for k in refused if k.partition(".")[0].endswith("_stage") and k.partition(".")[2] in SAFE_TO_CHANGE]
            hint = (f"; to resume with it, pass --allow-changed {','.join(safe)}" if len(safe) == len(refused)
                    else "")
            raise WMError(f"{self.dir} holds a run with another config ({'; '.join(diffs[:3])}"
                          f"{'...' if len(diffs) > 3 else ''}){hint}; use --fresh to start over or another run.name")
        steps = {}
        for stage in STAGE_SECTIONS:
            d = _read_json_quiet(self.dir / stage / "checkpoints" / "latest")
            if d and isinstance(d.get("step"), int):
                steps[stage] = d["step"]
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if fp and fp != self.fingerprint:  # --allow-new-data: the older checkpoints stay this run's
            history.append({"time": now, "step": steps, "data_fingerprint": [fp, self.fingerprint]})
            self.fingerprints.add(fp)
        if changed:
            history.append({"time": now, "step": steps, "changed": changed})
            self.say("resuming with changed hyperparameters (recorded in config.json's meta.history): " +
                     ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in changed.items()))
            for stage in STAGE_SECTIONS:
                for k in (f"{stage}_stage.max_steps", f"{stage}_stage.epochs"):
                    if k in changed:
                        self._reopen(stage, k, changed[k][1])
                        break
        return history

    def _reopen(self, stage: str, key: str, new: int) -> None:
        """A finished stage given more steps (or epochs) goes on from its last checkpoint: its
        done.json goes before config.json records the change, so a kill between the two leaves a
        stage that the rerun resumes at its last step and marks finished again."""
        done = self.dir / stage / "done.json"
        d = _read_json_quiet(done)
        if d is None:
            return
        if d.get("reason", "finished") != "finished":
            self.say(f"note: the {stage} stage ended at step {d.get('step')} ({d.get('reason')}); it stays finished")
            return
        if key.endswith("max_steps") and 0 < new <= d.get("step", 0):
            return
        os.unlink(done)
        fsync_dir(done.parent)
        self.say(f"{stage} stage: finished at step {d.get('step')}; with {key}={new} it goes on from its "
                 "last checkpoint")

    def stage_dir(self, stage: str) -> Path:
        return self.dir / stage


STAGE_SECTIONS = {"tokenizer": ("tokenizer", "tokenizer_stage"), "world": ("world", "world_stage")}

# keys of a <stage>_stage section that `--allow-changed` may change on resume: optimisation only,
# never the data, the model's shape, the batch (the sampler's position) or the seed
SAFE_TO_CHANGE = ("lr", "min_lr", "clip", "warmup_steps", "weight_decay", "betas", "epochs", "max_steps",
                  "eval_every", "early_stop")


def _read_json_quiet(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None

# keys a resumed run may change without being another run (they do not change what is computed)
RESUME_MAY_CHANGE = {
    "data": ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "h5_cache_mib", "root"),
    "train": ("stages", "log_every", "ckpt_every", "keep_last", "async_ckpt", "timeout_s", "tensorboard", "images",
              "peak_tflops", "max_nonfinite", "compile", "compile_mode"),
    "synthetic": ("cache_dir",),
    # the same functions by other kernels or layouts (float rounding apart): a run may switch them on resume
    "tokenizer": ("fused_head", "channels_last", "compile_channels_last", "compile_tuning"),
    "world": ("fused_attention", "channels_last"),
}


def run_identity(cfg: dict, stage: str, sections: tuple = ()) -> dict:
    """The config keys a checkpoint of `stage` must share with this run to be its own: those a
    resume refuses to change (not RESUME_MAY_CHANGE, SAFE_TO_CHANGE, nor where the folder is), of
    the sections the stage trains with (or `sections`). ConfigError for a config this wm cannot read."""
    d = resolve_batch_sizes(to_dict(from_saved(cfg)))
    secs = sections or ("run", "data", "synthetic", "train", "tokenizer", f"{stage}_stage") + (
        ("world",) if stage == "world" else ())
    return {f"{sec}.{k}": v for sec in secs for k, v in d[sec].items()
            if k not in RESUME_MAY_CHANGE.get(sec, ()) and not (sec.endswith("_stage") and k in SAFE_TO_CHANGE)
            and f"{sec}.{k}" not in ("run.name", "run.out_dir")}


def belongs(run: "Run", stage: str, tok_sha: Optional[str] = None, sections: tuple = ()):
    """wm.ckpt_checks' `belongs` for this run: why a checkpoint is another run's (config, data, or
    for the world stage the tokenizer it trained on), or None. `sections`: see run_identity."""
    mine = run_identity(to_dict(run.cfg), stage, sections)

    def why(st: dict) -> Optional[str]:
        try:
            theirs = run_identity(st["config"], stage, sections)
        except (ConfigError, TypeError, KeyError):
            return "holds a config this wm cannot read, so it is another program's or another run's"
        k = next((k for k in mine if theirs.get(k) != mine[k]), None)
        if k:
            return f"was saved by another run ({k} is {theirs.get(k)!r:.40}, this run's {mine[k]!r:.40})"
        fp = st.get("data_fingerprint")
        if fp not in run.fingerprints:
            return f"was trained on other data (fingerprint {str(fp)[:16]}, this run's {run.fingerprint[:16]})"
        got = st["tokenizer"].get("sha256") if isinstance(st.get("tokenizer"), dict) else None
        if tok_sha and got != tok_sha:
            return f"was trained on another tokenizer (sha256 {str(got)[:12]}, this world stage's is {tok_sha[:12]})"
        return None
    return why


# ---------------------------------------------------------------------------------------------
# what the stages train on, checked for all of them before the first one starts


def stage_data(cfg: Config, name: str) -> DataConfig:
    """The windows a stage trains and validates on: single frames for the tokenizer, data.past +
    data.future frames every data.stride-th for the world model; with the mask where data.use_mask."""
    return frames_config(cfg.data, use_mask=cfg.data.use_mask) if name == "tokenizer" else cfg.data


def batches_per_rank(name: str, samples: int, world_size: int, batch: int, grad_accum: int) -> int:
    """Full batches of `batch` each rank draws from `samples` training samples per epoch; fewer
    than one optimizer step's worth is refused."""
    n = samples // world_size // batch
    if n < grad_accum:
        raise WMError(f"{name} stage: {samples} training samples give {n} batches of {batch} per rank, "
                      f"fewer than grad_accum={grad_accum}; use a smaller {name}_stage.batch_size or more data")
    return n


def val_metrics(name: str, future: int, class_names=(), free_class: int = -1, moving=()) -> list[str]:
    """The validation metrics a stage reports (TokenizerStage.evaluate, WorldStage.evaluate); with
    the data set's class names also the per-class IoUs (class_scalars), per step for the `moving` ones."""
    per_class = [n for c, n in enumerate(class_names) if c != free_class]
    if name == "tokenizer":
        return ["val/iou", "val/miou", "val/code_usage", "val/perplexity"] + [f"val/class_iou/{n}" for n in per_class]
    steps = [f"_t{t + 1}" for t in range(future)]
    return ["val/iou", "val/miou", "val/copy_last_iou", "val/copy_last_miou"] + [
        f"val/{pre}{m}_t{t + 1}" for pre in ("", "copy_last_") for m in ("iou", "miou") for t in range(future)] + [
        f"val/{pre}class_iou/{n}{t}" for pre in ("", "copy_last_") for n in per_class
        for t in [""] + (steps if n in moving else [])]


def check_stages(run: Run) -> None:
    """Every check that can fail a stage, for each stage still to run, before the first step of the
    first one (a world stage that cannot start must not wait for hours of tokenizer training): both
    splits present with windows at the stage's settings (window length at data.stride), the batch
    against the training windows, the best_metric; and data.horizons_s against the windows. Window
    indexes come from scene offsets alone, so this reads no frames. Also says whether training uses
    the visibility mask."""
    cfg, d = run.cfg, run.d
    if "world" in cfg.train.stages:  # first: the setting that reaches data.horizons_s, not "shorten the window"
        check_config_reaches(cfg, run.root, run.manifest.info.frame_rate_hz)
    for name in cfg.train.stages:
        if (run.stage_dir(name) / "done.json").is_file():
            continue
        s = getattr(cfg, f"{name}_stage")
        data = stage_data(cfg, name)
        try:
            samples = len(OccWindows(run.root, cfg.data.train_split, data))
            OccWindows(run.root, cfg.data.val_split, data)
        except DataError as e:
            raise DataError(f"{name} stage: {e}") from None
        batches_per_rank(name, samples, d.world_size, s.batch_size or cfg.data.batch_size, s.grad_accum)
        metrics = val_metrics(name, cfg.data.future, run.manifest.info.class_names, cfg.data.free_class,
                              moving_classes(run.manifest.info, cfg.data.moving_classes))
        if s.best_metric not in metrics:
            raise ConfigError(f"{name}_stage.best_metric", f"{s.best_metric!r} is not a validation metric of "
                              f"the {name} stage; choose one of {', '.join(metrics)}")
    if cfg.data.use_mask:
        bits = f"mask bits {cfg.data.mask_bits}" if cfg.data.mask_bits else "any nonzero mask value"
        run.say(f"masks: training and validation use only visible voxels (data.use_mask, {bits}): masked "
                "cross-entropy and Lovasz in the tokenizer stage, masked cross-entropy over token cells "
                "that see a visible voxel in the world stage")
    elif run.manifest.info.has_mask:
        run.say("masks: the data set has visibility masks; training uses every voxel (OccWorld's protocol). "
                "data.use_mask=true trains and validates on visible voxels only")


# ---------------------------------------------------------------------------------------------
# stages: what differs between the tokenizer and the world model


class TokenizerStage:
    name = "tokenizer"

    def __init__(self, run: Run):
        cfg = run.cfg
        self.run, self.cfg, self.scfg = run, cfg, cfg.tokenizer_stage
        fc = stage_data(cfg, self.name)
        self.train_ds = OccWindows(run.root, cfg.data.train_split, fc)
        self.val_ds = OccWindows(run.root, cfg.data.val_split,
                                 dataclasses.replace(fc, max_windows=cfg.data.max_windows))
        torch.manual_seed(cfg.run.seed)  # the initial weights follow run.seed (torch seeds randomly)
        self.model = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid))
        if cfg.tokenizer.compile_channels_last and compiles(cfg, run.d.device):
            # Inductor runs every convolution NHWC: weights laid out so, their gradients come so (no copy)
            self.model.to(memory_format=torch.channels_last)
        self.class_names = run.manifest.info.class_names
        if cfg.tokenizer.class_weight_power > 0:  # from the training data, the same on every resume
            counts = sample_counts(self.train_ds.shards, self.train_ds.manifest.info, CLASS_COUNT_FRAMES)
            w = self.model.set_class_frequencies(counts["classes"])
            run.say("tokenizer: class weights " + ", ".join(
                f"{n} {float(v):.1f}" for n, v in zip(self.class_names, w) if float(v) > 1.05))

    def inductor_options(self) -> dict:
        """torch.compile settings of this stage's model (tokenizer.compile_channels_last, compile_tuning)."""
        t = self.cfg.tokenizer
        return {**({"force_layout_optimization": True} if t.compile_channels_last else {}),
                **({"coordinate_descent_tuning": True} if t.compile_tuning else {})}

    def loss(self, model: nn.Module, batch: dict) -> dict:
        # the mask is in the batch only with data.use_mask (stage_data)
        # no logits: training reads only the losses (on CUDA the fused head then never writes them)
        return model(batch["occ"][:, 0], mask=batch["mask"][:, 0] if "mask" in batch else None, logits=False)

    def samples(self, batch: dict) -> int:
        return batch["occ"].shape[0]

    def after_step(self, model: nn.Module, d: D.Dist, skipped: torch.Tensor) -> None:
        """Dead-code reset: rank 0 decides from its encoder outputs, every rank gets its codebook
        (DDP does not sync in-place parameter edits). Not after a skipped step (`skipped`, a bool on
        the device): its encoder outputs may be non-finite. A code's age is the youngest rank's (each
        rank ages the codes its own batch did not use), so a code in use anywhere is not dead."""
        m = unwrap(model)
        if d.active and m.quantizer.dead_code_steps > 0:
            D.all_reduce_(m.quantizer.code_age, d, op="min")
        if d.is_main:
            m.reset_dead_codes(skip=skipped)
        if d.active:
            torch.distributed.broadcast(m.quantizer.codebook.weight.data, 0)
            torch.distributed.broadcast(m.quantizer.code_age, 0)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, d: D.Dist, dtype, device) -> tuple[dict, list]:
        cfg = self.cfg
        batches = eval_batches(self.val_ds, d, self.scfg.batch_size or cfg.data.batch_size,
                               cfg.data.num_workers, cfg.data.pin_memory, "tokenizer validation", self.run.say)
        r = reconstruction(unwrap(model), batches, d, device, dtype, cfg.data.num_classes, cfg.data.free_class,
                           keep_first=d.is_main and cfg.train.images)
        pics = [("val/recon_gt_top_pred_bottom", r.first, None)] if r.first else []
        s = r.cm.summary()
        out = {"val/iou": s["iou"][0], "val/miou": s["miou"][0],
               "val/code_usage": r.code_usage, "val/perplexity": r.perplexity}
        out.update(class_scalars(s, self.class_names, cfg.data.free_class, "val/class_iou/"))
        return out, pics


class WorldStage:
    name = "world"

    def __init__(self, run: Run, device: torch.device, dtype):
        cfg = run.cfg
        self.run, self.cfg, self.scfg = run, cfg, cfg.world_stage
        tok_ckpt, st = tokenizer_checkpoint(run)
        self.tok_path, self.tok_sha = tok_ckpt, sha256_file(tok_ckpt)
        retire_stale_world(run, tok_ckpt, self.tok_sha)
        self.tokenizer = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid))
        self.tokenizer.load_state_dict(st["model"])
        self.tokenizer.eval().requires_grad_(False).to(device)
        run.say(f"world stage: frozen tokenizer {tok_ckpt} (sha256 {self.tok_sha[:12]})")
        self.windows = OccWindows(run.root, cfg.data.train_split, cfg.data)
        self.val_ds = OccWindows(run.root, cfg.data.val_split, cfg.data)
        codes = build_token_cache(run, self.tokenizer, self.tok_sha, device, dtype)
        self.train_ds = CodeWindows(self.windows, codes, codes.with_name(CELL_MASK) if cfg.data.use_mask else None)
        torch.manual_seed(cfg.run.seed)  # here: whether the cache was built must not change them
        self.model = WorldModel(cfg.world, cfg.tokenizer.codebook_size)
        if cfg.world.widths[0] == cfg.tokenizer.code_dim:  # OccWorld feeds the codebook vectors
            self.model.init_code_embedding(self.tokenizer.codebook)

    def loss(self, model: nn.Module, batch: dict) -> dict:
        # forward through the wrapper (DDP hooks it, torch.compile traces it), the loss inside it
        codes, motion = batch["codes"].long(), batch["motion"]
        mask = batch["mask"] if "mask" in batch else None  # token cells, with data.use_mask
        c = self.cfg.train.world_crop
        if c and c < max(codes.shape[-2:]):  # one random square of the map (torch RNG: resumes exactly)
            (h, w) = codes.shape[-2:]
            ch, cw = min(c, h), min(c, w)
            i, j = int(torch.randint(0, h - ch + 1, ())), int(torch.randint(0, w - cw + 1, ()))
            codes = codes[..., i:i + ch, j:j + cw]
            mask = None if mask is None else mask[..., i:i + ch, j:j + cw]
        # with the targets, WorldModel.forward returns the loss terms: one compiled graph with the model
        res = model(codes[:, :-1], motion[:, :-1], codes[:, 1:], motion[:, 1:], None if mask is None else mask[:, 1:])
        res["copy_last_acc"] = (codes[:, 1:] == codes[:, :-1]).float().mean()
        return res

    def samples(self, batch: dict) -> int:
        return batch["codes"].shape[0]

    def inductor_options(self) -> dict:
        """torch.compile settings of this stage's model: Inductor's own. (Its layout optimisation
        forced on, as the tokenizer's, ended the compiled occworld step in an illegal memory access
        on an H200; issue 15.)"""
        return {}

    def after_step(self, model: nn.Module, d: D.Dist, skipped: torch.Tensor) -> None:
        pass

    @torch.no_grad()
    def evaluate(self, model: nn.Module, d: D.Dist, dtype, device) -> tuple[dict, list]:
        """Roll out the future from the past frames' codes, decode, and score against the real
        occupancy per future step; the copy-last baseline on the same windows beside it."""

        cfg = self.cfg
        S = cfg.data.future
        batches = eval_batches(self.val_ds, d, self.scfg.batch_size or cfg.data.batch_size,
                               cfg.data.num_workers, cfg.data.pin_memory, "world validation", self.run.say)
        f = forecast(self.tokenizer, unwrap(model), batches, d, device, dtype, cfg.data.past, S,
                     cfg.data.num_classes, cfg.data.free_class,
                     given_motion=cfg.train.forecast_motion == "given", keep_first=d.is_main and cfg.train.images)
        step_s = step_seconds(cfg, self.run.manifest.info)
        pics = [("val/forecast_gt_top_pred_bottom", f.first, [step_label(t + 1, step_s) for t in range(S)])] \
            if f.first else []
        a, b = f.ours.summary(), f.base.summary()
        out = {"val/iou": a["iou_avg"], "val/miou": a["miou_avg"],
               "val/copy_last_iou": b["iou_avg"], "val/copy_last_miou": b["miou_avg"]}
        names, free = self.run.manifest.info.class_names, cfg.data.free_class
        moving = moving_classes(self.run.manifest.info, cfg.data.moving_classes)
        out.update(class_scalars(a, names, free, "val/class_iou/", per_step=moving))
        out.update(class_scalars(b, names, free, "val/copy_last_class_iou/", per_step=moving))
        for t in range(S):
            out[f"val/iou_t{t + 1}"] = a["iou"][t]
            out[f"val/miou_t{t + 1}"] = a["miou"][t]
            out[f"val/copy_last_iou_t{t + 1}"] = b["iou"][t]
            out[f"val/copy_last_miou_t{t + 1}"] = b["miou"][t]
        return out, pics


CLASS_COUNT_FRAMES = 256  # training frames read for the class frequencies behind the CE weights


def class_scalars(summary: dict, names, free: int, prefix: str, per_step=()) -> dict:
    """Per-class IoU scalars from a ConfusionMatrix summary: <prefix><class> (averaged over the
    steps) for every non-free class, and <prefix><class>_t<k> per future step for the classes in
    `per_step`. Classes with no ground truth and no prediction are None (not logged)."""
    out = {f"{prefix}{n}": summary["per_class_avg"][c] for c, n in enumerate(names) if c != free}
    for c, n in enumerate(names):
        if n in per_step:
            out.update({f"{prefix}{n}_t{t + 1}": row[c] for t, row in enumerate(summary["per_class"])})
    return out


def tokenizer_checkpoint(run: Run) -> tuple[Path, dict]:
    """The tokenizer the world stage builds on, checksum-checked, and its state: its stage's best
    checkpoint, else (named) its newest valid one."""
    folder = run.stage_dir("tokenizer") / "checkpoints"
    # what the world stage needs of it: a finite model of this run's tokenizer config and data (how it
    # was trained is its own stage's business: a tokenizer brought from another run folder is fine)
    found = newest_valid(folder, say=run.say, best=True, check=checker(
        "tokenizer", model=shapes(meta_model(run.cfg, "tokenizer").state_dict()), keys=EVAL_KEYS,
        belongs=belongs(run, "tokenizer", sections=("tokenizer",))))
    if found is None:
        raise WMError(f"the world stage needs a trained tokenizer but {folder} holds no checkpoint; "
                      "run the tokenizer stage first (train.stages)")
    return found


def retire_stale_world(run: Run, tok: Path, sha: str) -> None:
    """The world stage belongs to the tokenizer it trained on. When the tokenizer stage went on and
    its best checkpoint changed, the world stage's folder is moved aside (said) and the stage
    starts over; when the best was skipped as damaged, the run stops instead (restore it)."""
    error, folder = None, run.stage_dir("world")
    last = latest_checkpoint(folder / "checkpoints") if run.d.is_main else None
    try:  # one small field: the file itself is checked when it is loaded
        old = torch.load(last, map_location="cpu", weights_only=True, mmap=True)["tokenizer"]["sha256"] if last else sha
    except Exception:
        old = sha
    if old != sha and tok.name != "best.pt" and (tok.parent / "best.pt").exists():
        error = (f"the world stage was trained on tokenizer {old[:12]}, but the tokenizer's best.pt was "
                 f"skipped (above) for {tok.name} ({sha[:12]}); restore best.pt, or start over with --fresh")
    elif old != sha:
        aside, n = folder.with_name(f"world.{time.strftime('%Y%m%d-%H%M%S')}"), 1
        while aside.exists():
            aside, n = folder.with_name(f"world.{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
        os.replace(folder, aside)
        fsync_dir(folder.parent)
        run.say(f"world stage: its checkpoints were trained on tokenizer {old[:12]}, the tokenizer's best is now "
                f"{sha[:12]}; moved them to {aside}: the world stage starts over")
    failure = D.broadcast_object(error, run.d)
    if failure:
        raise WMError(failure)


CELL_MASK = "cell_mask.npy"


@torch.no_grad()
def build_token_cache(run: Run, tok: Tokenizer, tok_sha: str, device, dtype) -> Path:
    """Encode every training frame once into <run>/token_cache/<key>/codes.npy (int16), keyed by
    the tokenizer checkpoint and the data fingerprint: a cache that does not match is rebuilt,
    never silently used. With data.use_mask also cell_mask.npy (uint8, Tokenizer.token_mask of
    each frame's mask; the mask bits are part of the key). Rank 0 builds; the others wait at the
    barrier."""
    cfg, d = run.cfg, run.d
    use_mask = cfg.data.use_mask
    keyed = {"tokenizer": tok_sha, "data": run.fingerprint, "split": cfg.data.train_split}
    if use_mask:  # only then: the caches of runs without masks keep their keys
        keyed["mask_bits"] = cfg.data.mask_bits
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    folder = run.dir / "token_cache" / key
    path = folder / "codes.npy"
    why = _token_cache_problem(folder, tok_sha, run.fingerprint, use_mask) if d.is_main else None
    if why and not why.startswith("missing"):
        run.say(f"note: the token cache {why}; encoding the training frames again")
    if why:  # rank 0 builds: the run folder is shared by all ranks
        frames = OccWindows(run.root, cfg.data.train_split, frames_config(cfg.data, use_mask=use_mask))
        h, w = tok.token_shape
        clean_temps(folder)  # the half-written codes of a killed build
        # codes are gathered in memory (int16 50x50 per frame: 140 MB for nuScenes' 28k train frames),
        # then written like a checkpoint: no memory map that a full disk would turn into SIGBUS
        out = np.empty((frames.num_frames, h, w), dtype=np.int16)
        cells = np.empty((frames.num_frames, h, w), dtype=np.uint8) if use_mask else None
        # frames in shard order: the OccWindows index of single frames is exactly frame_base order
        loader = torch.utils.data.DataLoader(frames, batch_size=max(8, cfg.data.batch_size), shuffle=False,
                                             num_workers=cfg.data.num_workers, worker_init_fn=ignore_stop_signals)
        t0, done = time.time(), 0
        for batch in start_workers(loader):
            occ = batch["occ"].to(device)[:, 0]
            with autocast(device, dtype):
                codes = tok.encode(occ)
            out[done:done + len(occ)] = codes.to(torch.int16).cpu().numpy()
            if cells is not None:
                cells[done:done + len(occ)] = tok.token_mask(batch["mask"][:, 0]).numpy()
            done += len(occ)
            tty = sys.stdout.isatty()  # a log file gets a line per 10 %, not a line per batch
            if d.is_main and (tty or done == frames.num_frames or
                              done * 10 // frames.num_frames != (done - len(occ)) * 10 // frames.num_frames):
                print(("\r" if tty else "") + f"token cache: {done}/{frames.num_frames} frames encoded "
                      f"({done / max(1e-9, time.time() - t0):.0f} frames/s)", end="" if tty else "\n", flush=True)
        if d.is_main and sys.stdout.isatty():
            print()
        write_token_cache(folder, out, {"tokenizer_sha256": tok_sha, "data_fingerprint": run.fingerprint,
                                        "split": cfg.data.train_split, "frames": frames.num_frames}, cells)
        run.say(f"token cache written: {path}")
    D.barrier(d)
    return path


def write_token_cache(folder: Path, codes: np.ndarray, meta: dict, cells: np.ndarray | None = None) -> None:
    """codes.npy (and cell_mask.npy), then meta.json with their sha256 (the cache counts only once
    meta.json is there), each through the checkpoints' atomic write: a failure (a full disk) is one
    line and leaves no partial cache."""
    try:
        if (folder / "meta.json").exists():
            (folder / "meta.json").unlink()  # a cache being replaced stops counting first
        folder.mkdir(parents=True, exist_ok=True)
        size, sha = write_hashed(folder / "codes.npy", lambda f: np.lib.format.write_array(f, codes))
        meta = dict(meta, codes_bytes=size, codes_sha256=sha)
        if cells is not None:
            meta["cell_mask_sha256"] = write_hashed(folder / CELL_MASK, lambda f: np.lib.format.write_array(f, cells))[1]
        write_bytes(folder / "meta.json", json.dumps(meta, indent=1))
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise WMError(f"cannot write the token cache {folder}: {e.strerror or first_line(e)}; nothing was kept "
                      f"(the tokenizer checkpoints are intact): free space under {folder.parent} and rerun") from None


def _token_cache_problem(folder: Path, tok_sha: str, fingerprint: str, use_mask: bool = False) -> Optional[str]:
    """None for a complete cache of this tokenizer and data whose codes (and cell mask) match their
    recorded sha256; else why not: "missing", or which file is damaged and how."""
    if not (folder / "meta.json").exists():
        return "missing"
    m = _read_json_quiet(folder / "meta.json")
    if not m or m.get("tokenizer_sha256") != tok_sha or m.get("data_fingerprint") != fingerprint:
        return f"{folder / 'meta.json'} is damaged (unreadable, or naming another tokenizer or data)"
    for name, key in (("codes.npy", "codes_sha256"),) + (((CELL_MASK, "cell_mask_sha256"),) if use_mask else ()):
        try:
            got = sha256_file(folder / name)
        except OSError as e:
            return f"{folder / name} cannot be read ({e.strerror or first_line(e)})"
        if got != m.get(key):
            return f"{folder / name} is damaged (its sha256 is {got[:12]}..., meta.json records {str(m.get(key))[:12]}...)"
    return None


# ---------------------------------------------------------------------------------------------
# the loop


class BatchStream:
    """The loader as an endless stream of batches in the resumable sampler's order: where the loader
    runs dry the next epoch starts, and a batch counts as consumed (`sampler.advance`) once it is
    handed out, so at a step boundary the sampler's state is exactly where a resumed run continues."""

    def __init__(self, loader, sampler: ResumableSampler, global_batch: int):
        self.loader, self.sampler, self.global_batch = loader, sampler, global_batch
        self.it = self._new_iter()

    def _new_iter(self):
        # a DataLoader iterator draws its workers' base seed from the global torch RNG; that draw
        # must not shift the training RNG stream, or a resumed run (one more iterator, made at a
        # point the uninterrupted run made none) would diverge from an uninterrupted one
        with torch.random.fork_rng(devices=[]):
            return start_workers(self.loader)

    def __call__(self) -> dict:
        while True:
            try:
                b = next(self.it)
                break
            except StopIteration:
                if self.sampler.consumed:  # the loader's drop_last left a tail: that epoch is over
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                self.it = self._new_iter()
        self.sampler.advance(self.global_batch)
        return b


@dataclasses.dataclass
class StepResult:
    """What one optimizer step tells the loop. Tensors stay on the device (no host sync for them)."""

    terms: dict  # the loss terms (0-dim tensors), averaged over the micro-batches
    grad_norm: torch.Tensor  # before clipping
    flags: "HostCopy"  # all ranks': [loss or gradient non-finite, SIGTERM/SIGINT received]
    fp16: bool  # under fp16 the GradScaler, not the flag, skips non-finite steps
    data_wait_s: float  # host seconds spent waiting for batches (loader + copy to the device)
    samples: int  # samples trained on in this step, all ranks together
    batch: dict  # the last micro-batch, on the device (count_flops measures with it)

    def outcome(self) -> tuple[bool, bool]:
        """(skipped: nothing was updated, preempt: stop at a step boundary), the same on every rank.
        Waits for this step's work on the GPU, not for what was queued after it."""
        bad, stop = (bool(x) for x in self.flags.read())
        return bad and not self.fp16, stop


class HostCopy:
    """A small device tensor copied to pinned host memory as soon as the stream reaches it: `read()`
    then waits for the work queued before the copy, not for the work queued since (the next step)."""

    def __init__(self, t: torch.Tensor):
        self.ready = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:  # CPU ops are synchronous: the value is there
            self.host = t

    def read(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def step_unless(opt: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`opt.step()` unless `skip` (0-dim float32 on the device, 1 = skip). Fused AdamW (CUDA) decides
    on the device: it takes the flag the way torch.amp.GradScaler hands it its inf check, as the
    `found_inf` attribute, and leaves parameters, moments and step counts as they were; so the host
    never waits for the GPU here. Other optimizers: the host reads the flag (on a CPU, where every
    op is synchronous, that costs nothing)."""
    if getattr(opt, "_step_supports_amp_scaling", False):
        opt.found_inf = skip
        try:
            opt.step()
        finally:
            del opt.found_inf
    elif not bool(skip):
        opt.step()


def train_step(stage, model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               next_batch, s: StageConfig, device: torch.device, dtype, d: D.Dist,
               ddp: Optional[nn.Module] = None, fwd: Optional[nn.Module] = None) -> StepResult:
    """One optimizer step: the body of fit's loop, and what tools/bench_train.py times.

    `s.grad_accum` micro-batches from `next_batch()` under autocast, the loss scaled by the
    (fp16-only) GradScaler; DDP syncs gradients on the last micro-batch only. Then unscale, clip,
    and one all-reduced flag pair [non-finite loss or gradient, stop signal] (one collective, no
    host sync: the caller reads the flags when it needs them, `StepResult.outcome`). A non-finite
    step updates nothing (decided on the device, `step_unless`); under fp16 the GradScaler skips
    inf steps itself and lowers its scale. Then the stage's after_step (the tokenizer's dead-code
    reset, also skipped on a non-finite step).

    `model` is the plain module, `ddp` its DistributedDataParallel wrapper (when world > 1), `fwd`
    what the forward goes through (ddp, or torch.compile of it). The caller sets the learning rate."""
    ddp = model if ddp is None else ddp
    fwd = ddp if fwd is None else fwd
    terms: dict[str, torch.Tensor] = {}
    wait, samples = 0.0, 0
    for micro in range(s.grad_accum):
        t0 = time.perf_counter()
        b = to_device(next_batch(), device)
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
                         torch.full((), float(_STOP["flag"]), device=device)])
    D.all_reduce_(flags, d, op="max")  # every rank skips, and stops at, the same steps
    if dtype == torch.float16:
        scaler.step(opt)
        scaler.update()
    else:
        step_unless(opt, flags[0])
    opt.zero_grad(set_to_none=True)
    stage.after_step(model, d, flags[0] > 0)
    return StepResult(terms, gnorm, HostCopy(flags), dtype == torch.float16, wait, samples, b)


def wrap_ddp(model: nn.Module, cfg: Config, device: torch.device, d: D.Dist) -> nn.Module:
    """The model under DistributedDataParallel when there is more than one rank, else the model.
    Gradients are views into DDP's buckets (no copy in or out of them); bucket size and wire dtype
    from train.ddp_bucket_mib / train.ddp_grad_dtype."""
    if not d.active:
        return model
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.train.ddp_bucket_mib, gradient_as_bucket_view=True)
    if cfg.train.ddp_grad_dtype == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp


@dataclasses.dataclass
class StageParts:
    """What one stage trains with: the model on its device, AdamW, the GradScaler, the resumable
    sampler and its DataLoader, and the step counts."""

    model: nn.Module
    batch: int  # per rank
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    loader: torch.utils.data.DataLoader
    steps_per_epoch: int
    total: int  # optimizer steps of the whole stage


def compiles(cfg: Config, device: torch.device) -> bool:
    """Whether training runs torch.compile'd: train.compile, "auto" meaning on CUDA only."""
    return device.type == "cuda" if cfg.train.compile == "auto" else bool(cfg.train.compile)


def compiled(ddp: nn.Module, cfg: Config, inductor: Optional[dict] = None) -> nn.Module:
    """What the training forward goes through: the (DDP-wrapped) model, torch.compile'd when
    train.compile (`compiles`), in train.compile_mode, with the stage's Inductor settings (`inductor`,
    the stage's `inductor_options()`; they hold for this model's compilation only)."""
    if not compiles(cfg, next(unwrap(ddp).parameters()).device):
        return ddp
    if isinstance(ddp, nn.parallel.DistributedDataParallel):
        # one graph, the one a single GPU runs: Dynamo's DDP graph splitting hands each piece
        # layouts its neighbours do not produce, and one piece's backward read out of bounds
        torch._dynamo.config.optimize_ddp = False
    if not inductor:
        return torch.compile(ddp, mode=cfg.train.compile_mode)
    # torch.compile takes a mode or options, not both: a mode is a set of options
    from torch._inductor import list_mode_options

    return torch.compile(ddp, options={**list_mode_options(cfg.train.compile_mode), **inductor})


def stage_parts(stage, cfg: Config, d: D.Dist, device: torch.device, dtype) -> StageParts:
    """fit's set-up of a stage (also tools/bench_train.py's, so the bench times what fit runs)."""
    s = stage.scfg
    model = stage.model.to(device)
    batch, _ = stage_batch(cfg, stage.name)
    opt = make_optimizer(model, s, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = ResumableSampler(len(stage.train_ds), d.world_size, d.rank, seed=cfg.run.seed, drop_last=True)
    loader = make_loader(stage.train_ds, sampler, cfg.data, drop_last=True, batch_size=batch)
    per_rank_batches = batches_per_rank(stage.name, len(stage.train_ds), d.world_size, batch, s.grad_accum)
    steps_per_epoch = per_rank_batches // s.grad_accum
    return StageParts(model, batch, opt, scaler, sampler, loader, steps_per_epoch, stage_total(s, 0, sampler, batch))


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


def batch_words(cfg: Config, stage: str, world_size: int) -> str:
    """Where a stage's batch comes from, for the log: 'batch 8 from data.batch_size [tokenizer_stage.batch_size
    is 0] x grad_accum 1 x 1 rank'."""
    batch, key = stage_batch(cfg, stage)
    unset = f" [{stage}_stage.batch_size is 0]" if key == "data.batch_size" else ""
    return (f"batch {batch} from {key}{unset} x grad_accum {getattr(cfg, f'{stage}_stage').grad_accum} "
            f"x {world_size} rank{'s' if world_size != 1 else ''}")


def fit(run: Run, stage, device: torch.device, dtype) -> dict:
    """Train one stage to its end (or to preemption / early stop). Returns its last validation."""
    cfg, d, s, log = run.cfg, run.d, stage.scfg, run.log
    sdir = run.stage_dir(stage.name)
    done_file = sdir / "done.json"
    if done_file.is_file():
        res = _read_json_quiet(done_file)
        if res is not None and isinstance(res.get("step"), int):
            run.say(f"{stage.name} stage already finished at step {res['step']}; using it")
            return res.get("metrics", {})
        # written atomically by this version: damage came from elsewhere (or an older wm)
        run.say(f"note: {done_file} is damaged; checking the stage again from its checkpoints")

    parts = stage_parts(stage, cfg, d, device, dtype)
    model, batch, opt, scaler, sampler, loader = (parts.model, parts.batch, parts.opt, parts.scaler,
                                                  parts.sampler, parts.loader)
    steps_per_epoch, total = parts.steps_per_epoch, parts.total
    ckpt = Checkpointer(sdir / "checkpoints", cfg.train.keep_last, s.best_metric, s.best_mode,
                        cfg.train.async_ckpt) if d.is_main else None

    # resume: every rank loads the same file (the run folder is on a shared filesystem)
    step, best, stale, last_val = 0, None, 0, {}
    params = [p for g in opt.param_groups for p in g["params"]]
    pname = {id(p): n for n, p in model.named_parameters()}
    names = {i: pname.get(id(p), "?") for i, p in enumerate(params)}  # optimizer index -> parameter
    check = checker(stage.name, model=shapes(model.state_dict()), optimizer=[tuple(p.shape) for p in params],
                    belongs=belongs(run, stage.name, getattr(stage, "tok_sha", None)), names=names)
    # rank 0 checks the disk has room for a save, then picks the newest checkpoint that is intact,
    # this run's, of this model and finite (naming any it skips); a failure stops every rank
    found, failure = None, None
    if ckpt:
        try:
            require_space(ckpt.folder, checkpoint_bytes(model), f"a {stage.name} checkpoint")
            found = newest_valid(ckpt.folder, say=run.say, check=check)
        except WMError as e:
            failure = str(e)
    path, failure = D.broadcast_object((str(found[0]) if found else None, failure), d)
    if failure:
        raise WMError(failure)
    resumed = path
    if path:
        st = found[1] if found else load_checked(path)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        scaler.load_state_dict(st["scaler"])
        sampler.load_state_dict(st["sampler"])
        step, best, stale, last_val = st["step"], st.get("best"), st.get("stale", 0), st.get("metrics", {})
        total = stage_total(s, step, sampler, batch)
        rngs = st["rng"]
        run.say(f"{stage.name}: resumed from {path} at step {step}/{total} (epoch {sampler.epoch})")
        if len(rngs) == d.world_size:
            set_rng_state(rngs[d.rank])
        else:  # the data order is global; the RNG streams are per rank and cannot be split or merged
            seed_all(cfg.run.seed * 1000 + d.rank + step)
            g = batch * s.grad_accum
            run.say(f"note: resumed on {d.world_size} rank{'s' if d.world_size != 1 else ''} from {len(rngs)}: a "
                    f"step now takes {g * d.world_size} samples (it took {g * len(rngs)}); the data order goes on "
                    f"at sample {sampler.consumed} of epoch {sampler.epoch}; RNG streams re-seeded")
    run.say(f"{stage.name}: {count_parameters(model) / 1e6:.2f} M parameters, {len(stage.train_ds)} "
            f"training samples, {total} steps of {batch * d.world_size * s.grad_accum} samples "
            f"({batch_words(cfg, stage.name, d.world_size)})")
    if not path:
        seed_all(cfg.run.seed * 1000 + d.rank)
    eval_every = total if s.eval_every < 0 else (s.eval_every or steps_per_epoch)  # -1: only at the end

    ddp = wrap_ddp(model, cfg, device, d)
    fwd = compiled(ddp, cfg, stage.inductor_options())

    def last_good() -> str:
        """The newest checkpoint known complete and finite: the last one saved, else the one resumed from."""
        if ckpt:
            ckpt.close()  # first: the save in flight is part of what is on disk
        good = (ckpt.last_path or resumed) if ckpt else "on rank 0"
        return f"The last good checkpoint is {good}" if good else "No checkpoint was saved"

    def save(metrics: Optional[dict] = None) -> None:
        rng = D.gather_objects(rng_state(), d)  # every rank reaches these collectives
        # a state with NaN or inf is never saved nor called good: one reduction on the device
        ok = all_finite([*model.state_dict().values(), *(t for v in opt.state.values() for t in v.values()
                                                           if torch.is_tensor(t))]).float()
        D.all_reduce_(ok, d, op="min")
        if not ok:
            bad = first_nonfinite({"model": model.state_dict(), "optimizer": opt.state_dict()}, names=names)
            raise WMError(f"{stage.name}: the state at step {step} holds non-finite values (first: {bad}); it was "
                          f"not saved. {last_good()}; lower {stage.name}_stage.lr, check the data, or try train.amp=fp32")
        if ckpt is None:
            return
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                 "sampler": sampler.state_dict(), "step": step, "epoch": sampler.epoch, "rng": rng,
                 "best": best, "stale": stale, "metrics": metrics or last_val, "stage": stage.name,
                 "config": to_dict(cfg), "data_fingerprint": run.fingerprint}
        if stage.name == "world":
            state["tokenizer"] = {"path": str(stage.tok_path), "sha256": stage.tok_sha}
        ckpt.save(state, step, metrics)

    next_batch = BatchStream(loader, sampler, batch * d.world_size)

    nonfinite, t_last, samples_since, wait_since = 0, time.perf_counter(), 0, 0.0
    t_start, step_start, flops_per_sample = time.perf_counter(), step, None
    stop_reason, preempt, unread = None, False, []
    model.train()
    while step < total:
        # ---- one optimizer step (train_step: grad_accum micro-batches, the all-ranks finite
        # check that also carries the stop signal, clip, update); the schedule is the loop's
        for g in opt.param_groups:
            g["lr"] = s.lr * lr_factor(step, total, s)
        r = train_step(stage, model, opt, scaler, next_batch, s, device, dtype, d, ddp=ddp, fwd=fwd)
        terms, gnorm, b = r.terms, r.grad_norm, r.batch
        wait_since += r.data_wait_s
        samples_since += r.samples
        step += 1
        unread.append((step, r))

        # ---- the outcome of the steps so far: skipped? stop signal? Read one step late (the
        # previous step's, finished or nearly, while this one runs) so the GPU's queue never runs
        # dry; a step that logs, validates or saves reads every outcome first, as does a stop
        log_now, eval_now = step % cfg.train.log_every == 0 or step == total, step % eval_every == 0 or step == total
        save_now = step % cfg.train.ckpt_every == 0 or step == total
        if step == step_start + 1:  # it compiles (train.compile) and starts the loader: its time apart
            run.say(f"{stage.name}: first step {time.perf_counter() - t_last:.1f} s"
                    + (" (torch.compile compiling)" if fwd is not ddp else ""))
            if not log_now:  # the next logged rate is the steady one, of the steps after it
                t_last, samples_since, wait_since = time.perf_counter(), 0, 0.0
        while unread and (log_now or eval_now or save_now or preempt or len(unread) > 1):
            j, rj = unread.pop(0)
            skipped, stop = rj.outcome()
            preempt = preempt or stop
            if not skipped:
                nonfinite = 0
                continue
            nonfinite += 1  # nothing was updated; too many in a row and the run stops here
            log.scalars(j, {"train/nonfinite_steps": nonfinite}, kind=f"{stage.name}/skip")
            run.say(f"{stage.name} step {j}: non-finite loss or gradient, step skipped ({nonfinite} in a row)")
            if nonfinite >= cfg.train.max_nonfinite:
                raise WMError(f"{stage.name}: {nonfinite} non-finite steps in a row at step {j}; stopped. "
                              f"{last_good()}; lower {stage.name}_stage.lr, check the data, or try train.amp=fp32")

        # ---- logging
        if log_now:
            dt = time.perf_counter() - t_last
            vals = D.mean_scalars({k: float(v) for k, v in terms.items()}, d)
            rec = {f"loss/{k}" if k in ("loss", "ce", "lovasz", "vq", "motion_l2") else f"train/{k}": v
                   for k, v in vals.items()}
            rec.update({"train/lr": opt.param_groups[0]["lr"], "train/grad_norm": float(gnorm),
                        "perf/samples_per_s": samples_since / dt, "perf/data_wait_frac": wait_since / dt,
                        "perf/device_hours": (time.perf_counter() - t_start) * d.world_size / 3600,
                        "train/epoch": sampler.epoch})
            if device.type == "cuda":
                rec["mem/max_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if flops_per_sample:
                achieved = flops_per_sample * samples_since / dt  # all ranks together
                rec["perf/tflops_per_s"] = achieved / 1e12
                if cfg.train.peak_tflops > 0:
                    rec["perf/mfu"] = achieved / (cfg.train.peak_tflops * 1e12 * d.world_size)
            if ckpt is not None and ckpt.last_blocked_s:
                rec["perf/ckpt_blocked_s"] = ckpt.last_blocked_s
            log.scalars(step, rec, kind=f"{stage.name}/train")
            rate = (step - step_start) / max(1e-9, time.perf_counter() - t_start)
            log.console(f"{stage.name} step {step}/{total} loss {vals['loss']:.4f} "
                        f"lr {rec['train/lr']:.2e} {rec['perf/samples_per_s']:.1f} samples/s "
                        f"data wait {100 * rec['perf/data_wait_frac']:.0f}% ETA {eta((total - step) / max(rate, 1e-9))}")
            t_last, samples_since, wait_since = time.perf_counter(), 0, 0.0

        # ---- validation, best checkpoint, early stop
        evaluated = False
        if eval_now:
            model.eval()
            t_eval = time.perf_counter()
            last_val, pics = stage.evaluate(model, d, dtype, device)
            t_last += time.perf_counter() - t_eval  # the next logged samples/s is of training steps only
            model.train()
            evaluated = True
            log.scalars(step, last_val, kind=f"{stage.name}/val")
            for tag, frames, labels in pics:  # BEV pictures in the data set's colours, with a legend
                log.image(f"{stage.name}/{tag}", step, bev_pair(frames, run.manifest.info,
                                                                moving_classes(run.manifest.info, cfg.data.moving_classes), labels))
            v = last_val.get(s.best_metric)
            if v is None:
                raise WMError(f"{stage.name}_stage.best_metric {s.best_metric!r} is not a validation "
                              f"metric; choose one of {sorted(last_val)}")
            better = best is None or (v > best if s.best_mode == "max" else v < best)
            best, stale = (v, 0) if better else (best, stale + 1)
            log.console(f"{stage.name} step {step} validation: " + ", ".join(
                f"{k[4:]} {last_val[k]:.2f}" for k in sorted(last_val) if "_t" not in k and "class_iou" not in k))
            if s.early_stop and stale >= s.early_stop:
                stop_reason = f"early stop: {s.best_metric} did not improve for {stale} validations"

        # ---- checkpoint, preemption
        if preempt and not stop_reason:
            stop_reason = "preempted (SIGTERM/SIGINT)"
        if evaluated or save_now or stop_reason:
            save(last_val if evaluated else None)
        if flops_per_sample is None:  # once per process, after the first step
            flops_per_sample = count_flops(stage, model, b, device, dtype) \
                if cfg.train.peak_tflops > 0 or device.type == "cuda" else 0.0
        if stop_reason:
            break

    if ckpt:
        ckpt.close()
    D.barrier(d)
    log.flush()
    if stop_reason and stop_reason.startswith("preempted"):
        run.say(f"{stage.name}: {stop_reason}; saved step {step}. Run the same command to resume.")
        raise Preempted()
    if d.is_main:  # after ckpt.close(): a finished stage is marked only once its last save is on disk
        write_bytes(sdir / "done.json", json.dumps({"step": step, "metrics": last_val,
                                                    "reason": stop_reason or "finished"}, indent=1))
    D.barrier(d)
    if stop_reason:
        run.say(f"{stage.name}: {stop_reason}")
    return last_val


def bev_pair(frames: list, info, moving=None, labels=None) -> np.ndarray:
    """Ground truth above, model below: BEV pictures (wm.viz.figure) with a legend, the `moving`
    classes (default: the data set's) drawn over whatever is above them (a car under a tree shows as
    the car); `labels` over the frames (the forecast's steps)."""
    moving = moving_classes(info) if moving is None else moving
    dyn = [c for c, n in enumerate(info.class_names) if n in moving]
    return figure([list(frames[0]), list(frames[1])], info.class_names, info.free_class, info.class_colors,
                  titles=["ground truth", "prediction"], prefer=dyn, labels=labels)


def step_seconds(cfg: Config, info) -> Optional[float]:
    """Seconds per forecast step (data.stride / the data set's frame rate), None where the rate is unknown."""
    return cfg.data.stride / info.frame_rate_hz if info.frame_rate_hz > 0 else None


class Preempted(Exception):
    pass


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


# ---------------------------------------------------------------------------------------------
# entry point


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="train.py", description="Train an occupancy world model (wm).")
    ap.add_argument("--cfg", help="config JSON (default: the built-in demo)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.amp=fp16 (repeatable)")
    ap.add_argument("--fresh", action="store_true", help="start over: move the existing run folder aside")
    ap.add_argument("--allow-new-data", action="store_true",
                    help="resume even though the data set's fingerprint changed")
    ap.add_argument("--allow-changed", default="", metavar="KEY,...",
                    help="resume with these optimisation keys changed, e.g. tokenizer_stage.lr,tokenizer_stage.clip "
                         "(recorded in config.json's meta.history; data and model keys stay refused)")
    ap.add_argument("--help-config", action="store_true",
                    help="print every config key with its type, default and meaning (docs/CONFIG.md), and exit")
    ev = ap.add_argument_group("evaluation (--eval-only: OccWorld's protocol, see wm/evaluate.py)")
    ev.add_argument("--eval-only", action="store_true",
                    help="train nothing: evaluate the run's best (else newest) checkpoints, print a table, write JSON")
    ev.add_argument("--ckpt", help="evaluate this checkpoint (a world-model one brings its tokenizer, hash-checked)")
    ev.add_argument("--stage", choices=("tokenizer", "world", "all"),
                    help="which stages to evaluate (default: train.stages, or the stage of --ckpt)")
    ev.add_argument("--split", help="the split to evaluate (default: data.val_split)")
    ev.add_argument("--mask",
                    help="visibility mask: none (default, OccWorld's protocol) or a mask the data set has (mask)")
    ev.add_argument("--mode", choices=("occworld", "exclude"),
                    help="classes absent from the ground truth: occworld (default: IoU 100%%, OccWorld's) or exclude")
    ev.add_argument("--horizons", help="forecast horizons in seconds, reported with their average (default: "
                    "data.horizons_s, else 1,2,3 where the windows reach them); without --eval-only: print a "
                    "setting of data.past, data.future, data.stride, world.max_frames that reaches them, train nothing")
    ev.add_argument("--json", help="where to write the report (default: <run>/eval/<stages>_<split>_<mode>"
                    "[_mask-<mask>][_h<horizons>].json)")
    return ap.parse_args(argv)


def final_table(cfg: Config, results: dict, moving=(), step_s: Optional[float] = None) -> str:
    """The table printed when training ends: reconstruction, the forecast and copy-last per future
    step (labelled in seconds where `step_s` is known), the `moving` classes' IoU per step."""
    lines = []
    if "tokenizer" in results:
        r = results["tokenizer"]
        lines.append(f"tokenizer reconstruction (val): IoU {r.get('val/iou', float('nan')):.2f}  "
                     f"mIoU {r.get('val/miou', float('nan')):.2f}  codes used {100 * r.get('val/code_usage', 0):.0f}%")
    if "world" in results:
        r = results["world"]
        S = cfg.data.future
        head = f"{'step':<10}" + "".join(f"{step_label(t + 1, step_s):>14}" for t in range(S)) + f"{'avg':>14}"
        lines.append(f"world-model forecast (val, {cfg.train.forecast_motion} ego motion), IoU / mIoU per future step:")
        lines.append(head)
        for name, pre in (("forecast", "val/"), ("copy-last", "val/copy_last_")):
            cells = "".join(f"{r.get(f'{pre}iou_t{t + 1}', float('nan')):>7.2f}/{r.get(f'{pre}miou_t{t + 1}', float('nan')):<6.2f}"
                            for t in range(S))
            lines.append(f"{name:<10}{cells}{r.get(pre + 'iou', float('nan')):>7.2f}/{r.get(pre + 'miou', float('nan')):<6.2f}")
        lines += moving_table(r, S, moving, head) if moving else [
            "(no moving classes: the data set declares none and has no nuScenes-named ones; set "
            "data.moving_classes, or moving_classes in classes.json at conversion)"]
    return "\n".join(lines)


def moving_table(r: dict, S: int, moving, head: str) -> list[str]:
    """Rows of the moving classes' forecast IoU per future step, forecast / copy-last, under `head`
    (widened to the longest name; the classes the validation windows hold; '-' where a step has none)."""
    def cell(v):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"

    w = max([10] + [len(n) + 1 for n in moving])
    rows = []
    for n in moving:
        vals = [(r.get(f"val/class_iou/{n}_t{t + 1}"), r.get(f"val/copy_last_class_iou/{n}_t{t + 1}")) for t in range(S)]
        if all(a is None and b is None for a, b in vals):
            continue
        avg = (r.get(f"val/class_iou/{n}"), r.get(f"val/copy_last_class_iou/{n}"))
        rows.append(f"{n:<{w}}" + "".join(f"{cell(a) + ' / ' + cell(b):>14}" for a, b in vals + [avg]))
    if rows:
        rows[:0] = ["moving classes, IoU per future step, forecast / copy-last:", f"{'step':<{w}}{head[10:]}"]
    return rows


def _collective_failure(e: BaseException) -> bool:
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "connection closed", "connection reset",
                                   "broken pipe", "watchdog"))


def make_summary(cfg: Config, results: dict, moving=(), step_s: Optional[float] = None) -> dict:
    """The figures of the final table, for scripts: summary.json in the run folder."""
    out: dict[str, Any] = {}
    if "tokenizer" in results:
        r = results["tokenizer"]
        out["tokenizer"] = {"recon_iou": r.get("val/iou"), "recon_miou": r.get("val/miou"),
                            "code_usage": r.get("val/code_usage"),
                            "recon_class_iou": {k[len("val/class_iou/"):]: v for k, v in r.items()
                                                if k.startswith("val/class_iou/")}}
    if "world" in results:
        r, S = results["world"], cfg.data.future
        out["world"] = {"forecast_motion": cfg.train.forecast_motion,
                        "steps": [f"t+{t + 1}" for t in range(S)],
                        "seconds": [round((t + 1) * step_s, 6) for t in range(S)] if step_s else None,
                        "iou": [r.get(f"val/iou_t{t + 1}") for t in range(S)],
                        "miou": [r.get(f"val/miou_t{t + 1}") for t in range(S)],
                        "copy_last_iou": [r.get(f"val/copy_last_iou_t{t + 1}") for t in range(S)],
                        "copy_last_miou": [r.get(f"val/copy_last_miou_t{t + 1}") for t in range(S)],
                        "iou_avg": r.get("val/iou"), "miou_avg": r.get("val/miou"),
                        "copy_last_iou_avg": r.get("val/copy_last_iou"),
                        "copy_last_miou_avg": r.get("val/copy_last_miou"),
                        "class_iou": {n: [r.get(f"val/class_iou/{n}_t{t + 1}") for t in range(S)]
                                      for n in moving},
                        "copy_last_class_iou": {n: [r.get(f"val/copy_last_class_iou/{n}_t{t + 1}")
                                                for t in range(S)] for n in moving}}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.help_config:
        from wm.config_ref import reference

        print(reference())
        return 0
    stray = [f for f in ("ckpt", "stage", "split", "mask", "mode", "json") if getattr(args, f) is not None]
    if stray and not args.eval_only:
        raise WMError(f"--{stray[0]} belongs to evaluation; add --eval-only (training ignores it)")
    cfg = load_config(args.cfg, args.set)
    if args.horizons is not None and not args.eval_only:  # plan: a window setting that reaches them
        return print_plan(cfg, args.horizons, resolve_root(cfg))
    if not args.eval_only:  # evaluation keeps the default Ctrl-C: nothing to save
        install_signal_handlers()
    d = D.init(cfg.train.device, cfg.train.timeout_s)
    broken, run = False, None
    try:
        device = d.device
        dtype = amp_dtype(cfg, device)
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise WMError("train.amp is bf16 but this GPU has no bf16; use --set train.amp=fp16")
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if args.eval_only:

            return evaluate_run(cfg, d, device, dtype, args)
        run = Run(cfg, d, fresh=args.fresh, allow_new_data=args.allow_new_data,
                  allow_changed=tuple(k.strip() for k in args.allow_changed.split(",") if k.strip()))
        if run.resuming:
            run.say(f"resuming run {run.dir}")
        run.say(f"training: {device_line(cfg, d, device, dtype)}")
        check_stages(run)
        t0 = time.time()
        results = {}
        try:
            for name in cfg.train.stages:
                stage = TokenizerStage(run) if name == "tokenizer" else WorldStage(run, device, dtype)
                results[name] = fit(run, stage, device, dtype)
            # hparams with the final metrics (rank 0's logger only; a failure warns)
            run.log.hparams({f"{sec}.{k}": v for sec, kv in to_dict(cfg).items() for k, v in kv.items()},
                            {f"{n}/{k}": v for n, r in results.items() for k, v in r.items()})
        except Preempted:
            return 0
        except (torch.distributed.DistError, RuntimeError) as e:
            if not d.active or not _collective_failure(e):
                raise
            broken = True  # destroying a group whose peer is gone can block: leave it to exit
            raise WMError(f"rank {d.rank}: a collective failed ({str(e).strip().splitlines()[0][:200]}); "
                          "another rank died or hung (see its log). Checkpoints are intact: rerun the "
                          "same command to resume") from None
        finally:
            run.log.close()
        if d.is_main:
            moving = moving_classes(run.manifest.info, cfg.data.moving_classes)
            step_s = step_seconds(cfg, run.manifest.info)
            table = final_table(cfg, results, moving, step_s)
            minutes = (time.time() - t0) / 60
            print(f"\nrun {run.dir} finished in {minutes:.1f} min\n{table}")
            summary = make_summary(cfg, results, moving, step_s)
            summary["minutes"] = round(minutes, 2)
            write_bytes(run.dir / "summary.json", json.dumps(summary, indent=1))
        return 0
    finally:
        if run is not None:
            run.close()  # the lock goes last: nothing of this run is written after it
        if not broken:
            D.close(d)
