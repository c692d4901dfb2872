"""The two stages, what differs between them: the tokenizer (a VQ-VAE on single frames) and the
world model on the frozen tokenizer, trained from its token cache and validated by decoding its
rollouts against the real occupancy, beside the copy-last-frame baseline. Each stage holds its
model, data sets and optimisation section, and says what it provides to the generic loop (`Stage`:
its loss, what to do to a batch before and after a step, how to validate, what its checkpoints carry
besides the loop's state); `check_stages` runs every check that can fail one before the first starts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from wm.checkpoint import init_from
from wm.checkpoint.checks import EVAL_KEYS, checker, meta_model, shapes
from wm.checkpoint.files import (POINTER, list_checkpoints, newest_valid, read_json, sha256_file, step_of, sums_file,
    write_json_atomic)
from wm.checkpoint.run_folder import Run, belongs
from wm.config.sections import Config, DataConfig, model_options
from wm.data.horizons import check_config_reaches
from wm.data.stats import moving_classes, sample_counts
from wm.data.windows import CodeWindows, OccWindows
from wm.evaluation.evaluate import eval_batches, forecast, frames_config, reconstruction
from wm.evaluation.metrics import step_label
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.training.batching import batches_per_rank, planned_steps, stage_batch
from wm.training.token_cache import CELL_MASK, build_token_cache
from wm.training.wrappers import compiles, unwrap
from wm.utils import distributed
from wm.utils.atomic import fsync_dir
from wm.utils.errors import ConfigError, DataError, WMError


def stage_data(cfg: Config, name: str) -> DataConfig:
    """The windows a stage trains and validates on: single frames for the tokenizer, data.past +
    data.future frames every data.stride-th for the world model; with the mask where data.use_mask."""
    return frames_config(cfg.data, use_mask=cfg.data.use_mask) if name == "tokenizer" else cfg.data


def val_windows(cfg: Config, s) -> int:
    """How many val windows a stage validates on (0: all): <stage>_stage.val_windows, within
    data.max_windows (a smoke run's cap on every split)."""
    return min([n for n in (s.val_windows, cfg.data.max_windows) if n], default=0)


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
    cfg, dist = run.cfg, run.dist
    run.init_plan = init_from.plan(run)  # a source that cannot be used stops the run now
    if "world" in cfg.train.stages:  # first: the setting that reaches data.horizons_s, not "shorten the window"
        check_config_reaches(cfg, run.root, run.manifest.info.frame_rate_hz)
    for name in cfg.train.stages:
        if (run.stage_dir(name) / "done.json").is_file():
            continue
        s = getattr(cfg, f"{name}_stage")
        data = stage_data(cfg, name)
        try:
            samples = len(OccWindows(run.root, cfg.data.train_split, data, h5_cache_mib=cfg.loader.h5_cache_mib))
            OccWindows(run.root, cfg.data.val_split, data, h5_cache_mib=cfg.loader.h5_cache_mib)
        except DataError as e:
            raise DataError(f"{name} stage: {e}") from None
        b = stage_batch(cfg, name, dist.world_size)  # a global batch that does not split over the ranks stops here
        batches_per_rank(name, samples, dist.world_size, b.micro, b.accum)
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


class Stage:
    """What the loop (wm.training.loop) asks of a stage. A stage sets `name`, `model`, `train_ds` and
    `val_ds` and defines `loss`, `samples` and `evaluate`; the other hooks default to doing nothing."""

    name: str
    model: nn.Module
    train_ds: torch.utils.data.Dataset
    init = None  # init.from applied to this stage (wm.checkpoint.init_from.apply): validated before step 1
    init_source: Optional[dict] = None  # where init.from came from, carried in every checkpoint
    built_on: Optional[str] = None  # sha256 of the checkpoint the stage trains on: its checkpoints must name it

    def loss(self, model: nn.Module, batch: dict) -> dict:
        """The loss terms (0-dim tensors, "loss" the one to minimise) of `batch` through `model`."""
        raise NotImplementedError

    def samples(self, batch: dict) -> int:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, dist: distributed.Dist, dtype, device) -> tuple[dict, list]:
        """The validation metrics, and the pictures to log: (tag, frames, labels)."""
        raise NotImplementedError

    def prepare(self, batch: dict) -> dict:
        """The host batch as the step trains on it."""
        return batch

    def after_step(self, model: nn.Module, dist: distributed.Dist, skipped: torch.Tensor) -> None:
        """What follows an optimizer step (`skipped`: a bool on the device, the step updated nothing)."""

    def inductor_options(self) -> dict:
        """torch.compile settings of this stage's model."""
        return {}

    def checkpoint_extra(self) -> dict:
        """What this stage's checkpoints carry besides the loop's state."""
        return {}


class TokenizerStage(Stage):
    name = "tokenizer"

    def __init__(self, run: Run):
        cfg = run.cfg
        self.run, self.cfg, self.scfg = run, cfg, cfg.tokenizer_stage
        fc = stage_data(cfg, self.name)
        cache = cfg.loader.h5_cache_mib
        self.train_ds = OccWindows(run.root, cfg.data.train_split, fc, h5_cache_mib=cache)
        self.val_ds = OccWindows(run.root, cfg.data.val_split, dataclasses.replace(
            fc, max_windows=val_windows(cfg, self.scfg)), h5_cache_mib=cache)
        torch.manual_seed(cfg.run.seed)  # the initial weights follow run.seed (torch seeds randomly)
        self.model = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid),
                               **model_options(cfg, self.name))
        self.init = init_from.apply(run, self.name, self.model)  # init.from, while the stage has no checkpoint
        self.init_source = self.init.source.provenance() if self.init else None
        init_from.freeze(run, self.name, self.model, self.init)
        steps = planned_steps(cfg, self.name, len(self.train_ds), run.dist.world_size)
        if cfg.compile.tokenizer_channels_last and compiles(cfg, run.dist.device, steps):
            # Inductor runs every convolution NHWC: weights laid out so, their gradients come so (no copy)
            self.model.to(memory_format=torch.channels_last)
        self.class_names = run.manifest.info.class_names
        if cfg.tokenizer.class_weight_power > 0:  # from the training data, the same on every resume
            counts = sample_counts(self.train_ds.shards, self.train_ds.manifest.info, CLASS_COUNT_FRAMES)
            w = self.model.set_class_frequencies(counts["classes"])
            run.say("tokenizer: class weights " + ", ".join(
                f"{n} {float(v):.1f}" for n, v in zip(self.class_names, w) if float(v) > 1.05))

    def inductor_options(self) -> dict:
        """torch.compile settings of this stage's model (compile.tokenizer_channels_last, tokenizer_tuning)."""
        c = self.cfg.compile
        return {**({"force_layout_optimization": True} if c.tokenizer_channels_last else {}),
                **({"coordinate_descent_tuning": True} if c.tokenizer_tuning else {})}

    def loss(self, model: nn.Module, batch: dict) -> dict:
        # the mask is in the batch only with data.use_mask (stage_data)
        # no logits: training reads only the losses (on CUDA the fused head then never writes them)
        return model(batch["occ"][:, 0], mask=batch["mask"][:, 0] if "mask" in batch else None, logits=False)

    def samples(self, batch: dict) -> int:
        return batch["occ"].shape[0]

    def after_step(self, model: nn.Module, dist: distributed.Dist, skipped: torch.Tensor) -> None:
        """Dead-code reset: rank 0 decides from its encoder outputs, every rank gets its codebook
        (DDP does not sync in-place parameter edits). Not after a skipped step (`skipped`, a bool on
        the device): its encoder outputs may be non-finite. A code's age is the youngest rank's (each
        rank ages the codes its own batch did not use), so a code in use anywhere is not dead."""
        m = unwrap(model)
        if not m.quantizer.codebook.weight.requires_grad:  # a frozen codebook (tokenizer_stage.freeze) stays as loaded
            return
        if dist.active and m.quantizer.dead_code_steps > 0:
            distributed.all_reduce_(m.quantizer.code_age, dist, op="min")
        if dist.is_main:
            m.reset_dead_codes(skip=skipped)
        if dist.active:
            torch.distributed.broadcast(m.quantizer.codebook.weight.data, 0)
            torch.distributed.broadcast(m.quantizer.code_age, 0)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dist: distributed.Dist, dtype, device) -> tuple[dict, list]:
        cfg = self.cfg
        batches = eval_batches(self.val_ds, dist, self.scfg.batch_size or cfg.data.batch_size,
                               cfg.loader.num_workers, cfg.loader.pin_memory, "tokenizer validation", self.run.say)
        r = reconstruction(unwrap(model), batches, dist, device, dtype, cfg.data.num_classes, cfg.data.free_class,
                           keep_first=dist.is_main and cfg.logging.images)
        pics = [("val/recon_gt_top_pred_bottom", r.first, None)] if r.first else []
        s = r.cm.summary()
        out = {"val/iou": s["iou"][0], "val/miou": s["miou"][0],
               "val/code_usage": r.code_usage, "val/perplexity": r.perplexity}
        out.update(class_scalars(s, self.class_names, cfg.data.free_class, "val/class_iou/"))
        return out, pics


class WorldStage(Stage):
    name = "world"

    def __init__(self, run: Run, device: torch.device, dtype):
        cfg = run.cfg
        self.run, self.cfg, self.scfg = run, cfg, cfg.world_stage
        if "tokenizer" not in cfg.train.stages:  # init.from's tokenizer, as it is, becomes this run's
            torch.manual_seed(cfg.run.seed)
            init_from.adopt_tokenizer(run, Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid)))
        tok_ckpt, ckpt_state = tokenizer_checkpoint(run)
        self.tok_path, self.tok_sha = tok_ckpt, sha256_file(tok_ckpt)
        self.built_on = self.tok_sha
        retire_stale_world(run, tok_ckpt, self.tok_sha)
        self.tokenizer = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid),
                                   **model_options(cfg, "tokenizer"))
        self.tokenizer.load_state_dict(ckpt_state["model"])
        self.tokenizer.eval().requires_grad_(False).to(device)
        run.say(f"world stage: frozen tokenizer {tok_ckpt} (sha256 {self.tok_sha[:12]})")
        cache = cfg.loader.h5_cache_mib
        self.windows = OccWindows(run.root, cfg.data.train_split, cfg.data, h5_cache_mib=cache)
        self.val_ds = OccWindows(run.root, cfg.data.val_split, dataclasses.replace(
            cfg.data, max_windows=val_windows(cfg, self.scfg)), h5_cache_mib=cache)
        codes = build_token_cache(run, self.tokenizer, self.tok_sha, device, dtype)
        self.train_ds = CodeWindows(self.windows, codes, codes.with_name(CELL_MASK) if cfg.data.use_mask else None)
        torch.manual_seed(cfg.run.seed)  # here: whether the cache was built must not change them
        self.model = WorldModel(cfg.world, cfg.tokenizer.codebook_size, **model_options(cfg, self.name))
        if cfg.world.widths[0] == cfg.tokenizer.code_dim:  # OccWorld feeds the codebook vectors
            self.model.init_code_embedding(self.tokenizer.codebook)
        self.init = init_from.apply(run, self.name, self.model)
        self.init_source = self.init.source.provenance() if self.init else None
        init_from.freeze(run, self.name, self.model, self.init)

    def prepare(self, batch: dict) -> dict:
        """The host batch as the step trains on it: with train.world_crop, one random square of the
        token map (the same for all its frames; torch's CPU RNG, so a resume draws the same), cut
        before the copy to the device (fewer bytes, and the step's shapes stay fixed)."""
        c = self.cfg.train.world_crop
        h, w = batch["codes"].shape[-2:]
        if not c or c >= max(h, w):
            return batch
        ch, cw = min(c, h), min(c, w)
        i, j = int(torch.randint(0, h - ch + 1, ())), int(torch.randint(0, w - cw + 1, ()))
        return {k: v[..., i:i + ch, j:j + cw].contiguous() if k in ("codes", "mask") else v for k, v in batch.items()}

    def loss(self, model: nn.Module, batch: dict) -> dict:
        # forward through the wrapper (DDP hooks it, torch.compile traces it), the loss inside it
        codes, motion = batch["codes"].long(), batch["motion"]
        mask = batch["mask"] if "mask" in batch else None  # token cells, with data.use_mask
        # with the targets, WorldModel.forward returns the loss terms: one compiled graph with the model
        res = model(codes[:, :-1], motion[:, :-1], codes[:, 1:], motion[:, 1:], None if mask is None else mask[:, 1:])
        res["copy_last_acc"] = (codes[:, 1:] == codes[:, :-1]).float().mean()
        return res

    def samples(self, batch: dict) -> int:
        return batch["codes"].shape[0]

    def inductor_options(self) -> dict:
        """torch.compile settings of this stage's model: Inductor's own. (Its layout optimisation
        forced on, as the tokenizer's, ends the compiled occworld step in an illegal memory access
        on an H200.)"""
        return {}

    def checkpoint_extra(self) -> dict:
        """The frozen tokenizer it trained on (retire_stale_world and belongs read it back)."""
        return {"tokenizer": {"path": str(self.tok_path), "sha256": self.tok_sha}}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dist: distributed.Dist, dtype, device) -> tuple[dict, list]:
        """Roll out the future from the past frames' codes, decode, and score against the real
        occupancy per future step; the copy-last baseline on the same windows beside it."""

        cfg = self.cfg
        S = cfg.data.future
        batches = eval_batches(self.val_ds, dist, self.scfg.batch_size or cfg.data.batch_size,
                               cfg.loader.num_workers, cfg.loader.pin_memory, "world validation", self.run.say)
        f = forecast(self.tokenizer, unwrap(model), batches, dist, device, dtype, cfg.data.past, S,
                     cfg.data.num_classes, cfg.data.free_class,
                     given_motion=cfg.train.forecast_motion == "given", keep_first=dist.is_main and cfg.logging.images)
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
    its best checkpoint changed, every checkpoint of the stage's own names the old one: the world
    stage's folder is moved aside (said) and the stage starts over; when the best was skipped as
    damaged, the run stops instead (restore it). A step file that is not the stage's own (another
    run's config or data, or another tokenizer than its own checkpoints') is named and moved into
    <world>/foreign-<date>/, never resumed from, overwritten or rotated away."""
    error, folder = None, run.stage_dir("world")
    found = world_checkpoints(run, folder / "checkpoints", sha) if run.dist.is_main else []
    own = [(p, s) for p, s, why, _ in found if why is None]
    if own and all(s != sha for _, s in own):
        old = own[0][1]
        if tok.name != "best.pt" and (tok.parent / "best.pt").exists():
            error = (f"the world stage was trained on tokenizer {old[:12]}, but the tokenizer's best.pt was "
                     f"skipped (above) for {tok.name} ({sha[:12]}); restore best.pt, or start over with --fresh")
        else:
            aside = _aside(folder, ".")
            os.replace(folder, aside)
            fsync_dir(folder.parent)
            run.say(f"world stage: its checkpoints were trained on tokenizer {old[:12]}, the tokenizer's best is now "
                    f"{sha[:12]}; moved them to {aside}: the world stage starts over")
    else:
        strays = [(p, why or theirs) for p, s, why, theirs in found if why or s != sha]
        if strays:
            aside = _aside(folder / "foreign", "-")
            aside.mkdir()
            then = ("the stage goes on from its own checkpoints" if any(s == sha for _, s in own) else
                    "the stage has none of its own: it starts at step 0")
            for p, why in strays:
                for f in (p, sums_file(p)):
                    if f.exists():
                        os.replace(f, aside / f.name)
                run.say(f"warning: {p} is not this run's world checkpoint: it {why}; moved it to {aside} ({then})")
            pointer = folder / "checkpoints" / POINTER
            if (read_json(pointer) or {}).get("file") in {p.name for p, _ in strays}:  # it named a moved file
                _point_at_own(pointer, [p for p, s in own if s == sha])
            fsync_dir(folder / "checkpoints")
    failure = distributed.broadcast_object(error, run.dist)
    if failure:
        raise WMError(failure)


def world_checkpoints(run: Run, folder: Path, sha: str) -> list[tuple[Path, Optional[str], Optional[str], str]]:
    """Each world step file of `folder` that opens, newest first: (file, the tokenizer sha256 it
    trained on, why it is not this run's by stage, config or data (None: it is), why not with
    tokenizer `sha`). Only the pickle is read (tensors memory-mapped); a file that does not open is
    the loop's to name when it resumes."""
    ident, full, out = belongs(run, "world"), belongs(run, "world", sha), []
    for p in reversed(list_checkpoints(folder)):
        try:
            ckpt_state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            continue
        if not isinstance(ckpt_state, dict):
            continue
        tok = ckpt_state.get("tokenizer")
        got = tok.get("sha256") if isinstance(tok, dict) and isinstance(tok.get("sha256"), str) else None
        why = (f"is a {ckpt_state.get('stage')!s:.20} checkpoint" if ckpt_state.get("stage") != "world" else None) or ident(ckpt_state) or (
            None if got else "names no tokenizer it was trained on")
        out.append((p, got, why, why or full(ckpt_state) or ""))
    return out


def _point_at_own(pointer: Path, own: list[Path]) -> None:
    """`latest` names the newest of `own` that is committed (its .sha256 recorded), as a save writes
    it; without one, it goes: the newest committed step file is found without it."""
    for p in own:
        parts = sums_file(p).read_text().split() if sums_file(p).is_file() else []
        if parts and parts[-1].lstrip("*") == p.name:
            write_json_atomic(pointer, {"file": p.name, "step": step_of(p.name), "size": p.stat().st_size,
                                        "sha256": parts[0]})
            return
    os.unlink(pointer)


def _aside(path: Path, sep: str) -> Path:
    """<path><sep><date>, with -1, -2... while that is taken: a folder set aside never lands on an older one."""
    base = path.with_name(f"{path.name}{sep}{time.strftime('%Y%m%d-%H%M%S')}")
    aside, n = base, 1
    while aside.exists():
        aside, n = base.with_name(f"{base.name}-{n}"), n + 1
    return aside


def step_seconds(cfg: Config, info) -> Optional[float]:
    """Seconds per forecast step (data.stride / the data set's frame rate), None where the rate is unknown."""
    return cfg.data.stride / info.frame_rate_hz if info.frame_rate_hz > 0 else None
