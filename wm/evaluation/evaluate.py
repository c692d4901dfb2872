"""Evaluation under OccWorld's protocol: `python train.py --cfg cfg.json --eval-only [...]`.

One implementation of "run the models over evaluation windows and fill confusion matrices", used by
the training-time validation (wm/training/stages.py: TokenizerStage.evaluate, WorldStage.evaluate) and by
`--eval-only`, so the two always agree on the same checkpoint, data and settings:

- `reconstruction(tokenizer, batches, ...)`: every frame encoded and decoded, scored against itself
  (one confusion matrix) plus the code histogram (usage, perplexity).
- `forecast(tokenizer, world, batches, ...)`: past frames encoded, the world model rolled out
  `future` steps (ego motion given or predicted), decoded, scored per future step against the real
  occupancy; the copy-last-frame baseline on the very same windows and voxels beside it.

Both all-reduce their counts (every rank calls them with its share of the windows). Summaries are
pure functions of the counts (`recon_report`, `forecast_report`), so a fabricated case can be
checked by hand through the same code the CLI runs.

The protocol (OccWorld eval_metric_stp3.py with config/occworld.py): 5 past frames
(2 s at 2 Hz) -> 6 future frames; report the future frames at 1 s, 2 s and 3 s and their average;
no visibility mask; classes absent from the ground truth count as IoU 100 % (`--mode occworld`, the
default here; `--mode exclude` leaves them out, as the training-time validation does). The future
step of a horizon follows from the data's frame rate (manifest `frame_rate_hz`) and `data.stride`:
at 2 Hz and stride 1, 1 s / 2 s / 3 s are 0-based steps 1, 3, 5 (= metrics.OCCWORLD_STEPS).
**Decision:** a horizon the windows do not reach (or that falls between two frames) is refused with
one line saying which `data.future` would reach it; nothing is averaged over a shorter horizon
under the protocol's name. `--horizons 0.5,1` asks for other horizons explicitly. The windows are
`data.past + data.future` frames, as in training (so the numbers equal the training-time
validation); a run trained on longer windows may be evaluated with `--set data.future=6`.

Masks (`--mask`): "none" (default, OccWorld's protocol) or the name of a visibility mask the data
set carries ("mask": the shard's uint8 `mask` field, voxels where it is 0 are not scored, in the
forecast, the copy-last baseline and the reconstruction alike; "camera" / "lidar": the bits of that
field the manifest names, as tools/convert_occ3d.py stores Occ3D's two masks, read through
data.mask_bits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from wm.checkpoint.checks import EVAL_KEYS, checker, first_nonfinite, own_model_problem
from wm.checkpoint.files import load_checked as load_ckpt, newest_valid, sha256_file
from wm.checkpoint.run_folder import shared_root, unwritable
from wm.checkpoint.trained import config_diffs, more_keys, world_tokenizer
from wm.config.loading import to_dict
from wm.config.sections import Config, DataConfig, model_options
from wm.data.horizons import PROTOCOL_HORIZONS, default_horizons, horizon_label, horizon_steps, parse_horizons
from wm.data.stats import moving_classes
from wm.data.windows import OccWindows, check_against_config, ignore_stop_signals, start_workers
from wm.evaluation.metrics import MODES, OCCWORLD_STEPS, ConfusionMatrix, copy_last
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.utils import distributed
from wm.utils.atomic import write_bytes
from wm.utils.errors import DataError, WMError
from wm.utils.logs import Progress
from wm.utils.precision import autocast
from wm.version import __version__

__all__ = ["MASK_FIELDS", "PROTOCOL_HORIZONS", "Recon", "Forecast", "reconstruction", "forecast",
           "horizon_steps", "recon_report", "forecast_report", "format_table", "evaluate_run"]

# --mask name -> bits of the shard's uint8 `mask` that mean "scored" (data.mask_bits; 0 = any nonzero).
# "none" scores every voxel. "camera" / "lidar" are offered where the manifest's shards record
# mask_bits (tools/convert_occ3d.py: camera = 1, lidar = 2).
MASK_FIELDS = {"mask": 0, "camera": None, "lidar": None}
STAGE_WORDS = {"tokenizer": "tokenizer", "world": "world-model"}


# ---------------------------------------------------------------------------------------------
# the shared evaluation loops (training-time validation and --eval-only)


def eval_batches(ds, dist: distributed.Dist, batch_size: int, num_workers: int = 0, pin_memory: bool = False,
                 progress: str = "", log=print):
    """This rank's share of the evaluation windows (every world_size-th, no padding: the counts
    are all-reduced after, so every window is scored exactly once). With `progress` (what is
    evaluated), rank 0 logs a line with its rate and ETA at most every 10 s."""
    idx = list(range(dist.rank, len(ds), dist.world_size))
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=idx,
                                         num_workers=min(num_workers, 2), worker_init_fn=ignore_stop_signals,
                                         pin_memory=pin_memory and torch.cuda.is_available())
    bar = Progress(progress, len(idx), "windows", log) if progress and dist.is_main else None
    for batch in start_workers(loader):
        yield batch
        if bar is not None:
            bar.step(len(next(iter(batch.values()))))


def frames_config(data: DataConfig, use_mask: bool = False) -> DataConfig:
    """The data config for single frames (tokenizer evaluation), with or without the mask."""
    return dataclasses.replace(data, past=1, future=0, stride=1, window_step=1, use_mask=use_mask)


@dataclass
class Recon:
    """Reconstruction counts over all ranks: `cm` (one step) and the code histogram `used`."""

    cm: ConfusionMatrix
    used: torch.Tensor
    first: Optional[list] = None  # [ground truth, prediction] of the first batch's first 4 frames

    @property
    def code_usage(self) -> float:
        return float((self.used > 0).float().mean())

    @property
    def perplexity(self) -> float:
        p = self.used / self.used.sum().clamp_min(1)
        ent = -(p[p > 0] * p[p > 0].log()).sum()
        return float(ent.exp())


@dataclass
class Forecast:
    """Per-future-step counts over all ranks: the model's (`ours`) and copy-last's (`base`)."""

    ours: ConfusionMatrix
    base: ConfusionMatrix
    first: Optional[list] = None  # [ground truth, forecast] of the first window's future frames


@torch.no_grad()
def reconstruction(tokenizer: Tokenizer, batches: Iterable[dict], dist: distributed.Dist, device: torch.device,
                   dtype: Optional[torch.dtype], num_classes: int, free: int,
                   keep_first: bool = False) -> Recon:
    """Encode and decode every frame of `batches` (items with `occ` (B, 1, X, Y, Z) and optionally
    `mask`), score the argmax against the input; all-reduced over ranks."""
    cm = ConfusionMatrix(num_classes, free, 1, device=device)
    used = torch.zeros(tokenizer.quantizer.size, device=device)
    first = None
    for batch in batches:
        occ = batch["occ"].to(device)[:, 0]
        with autocast(device, dtype):
            codes = tokenizer.encode(occ)
            logits = tokenizer.decode(codes)
        pred = logits.argmax(1)
        mask = batch["mask"].to(device)[:, 0] if "mask" in batch else None
        cm.update(pred, occ, mask)
        used += torch.bincount(codes.flatten(), minlength=used.numel()).float()
        if keep_first and first is None:
            first = [occ[:4].cpu().numpy(), pred[:4].cpu().numpy()]
    cm.reduce_(lambda t: distributed.all_reduce_(t, dist))
    distributed.all_reduce_(used, dist)
    return Recon(cm, used, first)


@torch.no_grad()
def forecast(tokenizer: Tokenizer, world: WorldModel, batches: Iterable[dict], dist: distributed.Dist,
             device: torch.device, dtype: Optional[torch.dtype], past: int, future: int,
             num_classes: int, free: int, given_motion: bool = True, keep_first: bool = False) -> Forecast:
    """Roll the world model out `future` steps from each window's `past` frames (codes from the
    frozen tokenizer; future ego motion given, or predicted when `given_motion` is False), decode,
    and score per future step against the real occupancy; copy-last on the same windows and voxels
    (same mask). Items: `occ` (B, past + future, X, Y, Z), `motion` (B, past + future, 3), optional
    `mask`. All-reduced over ranks."""
    ours = ConfusionMatrix(num_classes, free, future, device=device)
    base = ConfusionMatrix(num_classes, free, future, device=device)
    first = None
    for batch in batches:
        occ, motion = batch["occ"].to(device), batch["motion"].to(device)
        with autocast(device, dtype):
            past_codes = tokenizer.encode(occ[:, :past])
            given = motion[:, past:] if given_motion else None
            codes, _ = world.rollout(past_codes, motion[:, :past], future, future_motion=given)
            pred = tokenizer.decode(codes).argmax(2)  # (B, S, X, Y, Z)
        mask = batch["mask"].to(device)[:, past:] if "mask" in batch else None
        ours.update(pred, occ[:, past:], mask)
        base.update(copy_last(occ[:, :past], future), occ[:, past:], mask)
        if keep_first and first is None:
            first = [occ[0, past:].cpu().numpy(), pred[0].cpu().numpy()]
    for cm in (ours, base):
        cm.reduce_(lambda t: distributed.all_reduce_(t, dist))
    return Forecast(ours, base, first)


# ---------------------------------------------------------------------------------------------
# horizons, summaries, the table


def _per_class(values: Sequence, names: Sequence[str]) -> dict:
    return {n: values[c] for c, n in enumerate(names)}


def recon_report(r: Recon, mode: str, class_names: Sequence[str]) -> dict:
    """The reconstruction's figures (percent; undefined values None): iou, miou, per_class
    {name: value} (the free class included for information; never part of mIoU), code_usage
    (fraction of codes used), perplexity, confusion [target][pred]."""
    s = r.cm.summary(mode=mode)
    return {"iou": s["iou"][0], "miou": s["miou"][0], "per_class": _per_class(s["per_class"][0], class_names),
            "code_usage": r.code_usage, "perplexity": r.perplexity,
            "confusion": r.cm.counts[0].cpu().tolist()}


def _block(cm: ConfusionMatrix, steps: Sequence[int], mode: str, class_names: Sequence[str]) -> dict:
    s = cm.summary(steps=steps, mode=mode)
    every = cm.summary(mode=mode)  # averages over all future steps (what training validation reports)
    return {
        "iou": [s["iou"][i] for i in steps], "miou": [s["miou"][i] for i in steps],
        "iou_avg": s["iou_avg"], "miou_avg": s["miou_avg"],
        "per_class": {n: [s["per_class"][i][c] for i in steps] for c, n in enumerate(class_names)},
        "per_class_avg": _per_class(s["per_class_avg"], class_names),
        "iou_all_steps": s["iou"], "miou_all_steps": s["miou"],
        "iou_all_steps_avg": every["iou_avg"], "miou_all_steps_avg": every["miou_avg"],
        "confusion": cm.counts.cpu().tolist(),
    }


def forecast_report(f: Forecast, steps: Sequence[int], horizons: Sequence[float], mode: str,
                    class_names: Sequence[str]) -> dict:
    """The forecast's and copy-last's figures (percent; undefined values None).

    For `forecast` and `copy_last` alike: iou / miou [one per horizon], iou_avg / miou_avg (mean of
    the horizons' values, OccWorld's "avg"), per_class {name: [per horizon]}, per_class_avg
    {name: value}, iou_all_steps / miou_all_steps [every future step t+1..t+S], *_all_steps_avg
    (their mean: the training-time val/iou, val/miou), confusion [step][target][pred]."""
    return {"horizons": [horizon_label(h) for h in horizons], "steps": list(steps),
            "forecast": _block(f.ours, steps, mode, class_names),
            "copy_last": _block(f.base, steps, mode, class_names)}


def _num(v, width: int = 7) -> str:
    return f"{'-':>{width}}" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:>{width}.2f}"


def _pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def format_table(rep: dict) -> str:
    """The report as the table --eval-only prints."""
    lines = [f"evaluation ({rep['split']} split, mask {rep['mask']}, absent classes: {rep['mode']}; IoU and "
             f"mIoU in %), {rep['world_size']} rank{'s' if rep['world_size'] > 1 else ''} on {rep['device']} "
             f"{rep['precision']}"]
    tok, wor = rep.get("tokenizer"), rep.get("world")
    if tok:
        lines.append(f"tokenizer {tok['checkpoint']} (step {tok['step']}), {tok['frames']} frames")
        lines.append(f"  reconstruction   IoU {_num(tok['iou'], 0)}  mIoU {_num(tok['miou'], 0)}  "
                     f"codes used {100 * tok['code_usage']:.0f}%  perplexity {tok['perplexity']:.1f}")
    if wor:
        lines.append(f"world model {wor['checkpoint']} (step {wor['step']}), tokenizer {wor['tokenizer_checkpoint']} "
                     f"(sha256 {wor['tokenizer_sha256'][:12]}, verified)")
        at = ", ".join(f"t+{s + 1}" for s in wor["steps"])
        lines.append(f"  {wor['windows']} windows of {wor['past']} past + {wor['future']} future frames, "
                     f"{wor['forecast_motion']} ego motion; horizons at future steps {at}")
        if wor.get("horizons_why"):
            lines.append(f"  horizons {', '.join(wor['horizons'])}: {wor['horizons_why']}")
        cols = [f"{h} (t+{s + 1})" for h, s in zip(wor["horizons"], wor["steps"])] + ["avg"]
        cw = max(9, max(len(c) for c in cols) + 2)
        head = "".join(f"{c:>{cw}}" for c in cols)
        lines.append(f"  {'':<16}{head}")
        for metric in ("iou", "miou"):
            for name, key in (("forecast", "forecast"), ("copy-last", "copy_last")):
                b = wor[key]
                cells = "".join(_num(v, cw) for v in b[metric] + [b[metric + "_avg"]])
                label = ("IoU" if metric == "iou" else "mIoU") if name == "forecast" else ""
                lines.append(f"  {label:<5}{name:<11}{cells}")
        moving = [n for n in rep.get("moving_classes", ()) if n in wor["forecast"]["per_class"]]
        if moving:
            w, mw = max(16, max(len(n) + 1 for n in moving)), max(cw, 15)  # a cell: "100.0 / 100.0"
            lines.append("  moving classes, IoU per horizon, forecast / copy-last:")
            lines.append(f"  {'':<{w}}" + "".join(f"{c:>{mw}}" for c in cols))
            for n in moving:
                pairs = list(zip(wor["forecast"]["per_class"][n], wor["copy_last"]["per_class"][n]))
                pairs.append((wor["forecast"]["per_class_avg"][n], wor["copy_last"]["per_class_avg"][n]))
                lines.append(f"  {n:<{w}}" + "".join(f"{_pct(a) + ' / ' + _pct(b):>{mw}}" for a, b in pairs))
    names = rep["class_names"]
    cols = []
    if tok:
        cols.append(("recon", tok["per_class"]))
    if wor:  # averages over the horizons, labelled so (per horizon: per_class in the JSON report)
        cols += [("forecast avg", wor["forecast"]["per_class_avg"]),
                 ("copy-last avg", wor["copy_last"]["per_class_avg"])]
    if cols:
        w = max(len(n) for n in names) + 16
        if wor:
            lines.append(f"  (forecast avg, copy-last avg: the mean over {', '.join(wor['horizons'])}; per "
                         "horizon in the JSON report's per_class)")
        lines.append("  per-class IoU" + " " * max(0, w - 13) + "".join(f"{c:>{max(9, len(c) + 2)}}" for c, _ in cols))
        for cid, n in enumerate(names):
            tag = n + (" (not in mIoU)" if cid == rep["free_class"] else "")
            lines.append(f"  {tag:<{w}}" + "".join(f"{_num(v[n], max(9, len(c) + 2))}" for c, v in cols))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# checkpoints


def stage_checkpoint(run_dir: Path, stage: str, say=print) -> tuple[Path, dict]:
    """A run's checkpoint of `stage` and its state, checksum-checked: best.pt, else (each one skipped
    named through `say`) the newest valid one."""
    folder = run_dir / stage / "checkpoints"
    # CheckpointError (one line) if none is intact, of this stage, fitting its config and finite
    found = newest_valid(folder, say=say, best=True, check=checker(stage, model="own", keys=EVAL_KEYS))
    if found is None:
        raise WMError(f"no {STAGE_WORDS[stage]} checkpoint in {folder}: train that stage first, point "
                      "--cfg / --set run.name=... at the run that has one, pass --ckpt, or choose --stage")
    return found


def load_stage(path: Path, stage: Optional[str] = None, what: str = "--ckpt", ckpt_state: Optional[dict] = None) -> dict:
    """A wm training checkpoint (`ckpt_state`: already loaded from `path`), refused with one line when
    missing, damaged, not wm's, or of another stage than `stage`."""
    if not path.is_file():
        raise WMError(f"{what} {path} does not exist")
    if ckpt_state is None:
        ckpt_state = load_ckpt(path)  # checksum first; CheckpointError (one line) for a damaged file
    got = ckpt_state.get("stage") if isinstance(ckpt_state, dict) else None
    if not isinstance(got, str) or got not in STAGE_WORDS or "model" not in ckpt_state or "config" not in ckpt_state:
        raise WMError(f"{path} is not a wm training checkpoint (no stage, model and config in it)")
    if stage is not None and got != stage:
        raise WMError(f"{path} is a {STAGE_WORDS[got]} checkpoint, but a {STAGE_WORDS[stage]} checkpoint "
                      f"is needed here ({what}); {stage} checkpoints live in runs/<name>/{stage}/checkpoints/")
    why = own_model_problem(ckpt_state, got)  # its config readable, its weights the model that config describes
    if why:
        raise WMError(f"{path} {why}; it is not a checkpoint wm can use")
    bad = first_nonfinite(ckpt_state, ("model",))
    if bad:
        raise WMError(f"{path} holds non-finite values (first: {bad}); evaluate a checkpoint saved before them")
    return ckpt_state


def check_config(ckpt_state: dict, cfg: Config, stage: str, path: Path) -> None:
    """The config given for evaluation must describe the model the checkpoint holds: the same
    model sections (training-only keys aside) and the same grid and classes."""
    diffs = config_diffs(ckpt_state["config"], to_dict(cfg), stage)
    if diffs:
        key, a, b = diffs[0]
        raise WMError(f"config mismatch: {path} was trained with {key}={a!r} but the config has {b!r}"
                      f"{more_keys(diffs)}; evaluate with the config of the run that trained it (its config.json)")


def _build(cls, ckpt_state: dict, path: Path, *a, **kw):
    m = cls(*a, **kw)
    try:
        m.load_state_dict(ckpt_state["model"])
    except (RuntimeError, KeyError) as e:
        raise WMError(f"{path}: the weights do not fit the model the config describes "
                      f"({str(e).strip().splitlines()[0][:200]})") from None
    return m


# ---------------------------------------------------------------------------------------------
# --eval-only


def check_stride(plan: list, cfg: Config, frame_rate_hz: float) -> None:
    """A world model forecasts steps of the data.stride it was trained with; scoring it at another
    stride compares its forecast with frames at other times. Refused with the right value."""
    for s, p, ckpt_state in plan:
        trained = ((ckpt_state.get("config") or {}).get("data") or {}).get("stride")
        if s == "world" and trained is not None and trained != cfg.data.stride:
            step = f" (one forecast step = {trained / frame_rate_hz:g} s at {frame_rate_hz:g} Hz)" if frame_rate_hz > 0 else ""
            raise WMError(f"{p} was trained with data.stride={trained}{step} but the config has "
                          f"data.stride={cfg.data.stride}; evaluate with --set data.stride={trained}")


def _data_root(cfg: Config, dist: distributed.Dist, say) -> Path:
    """data.root, or the synthetic set (rank 0 generates it first), as the training run does."""
    root = shared_root(cfg, dist, say)
    if cfg.data.root and not Path(root).is_dir():
        raise DataError(f"data.root {root} does not exist: set it to a wm data set folder (manifest.json + "
                        "shards) with --set data.root=/path/to/it")
    return Path(root)


def _mask_field(name: str, manifest) -> Optional[int]:
    """--mask name -> data.mask_bits (0: the whole mask), or None for no mask."""
    if name == "none":
        return None
    info = manifest.info
    named: dict[str, int] = {}
    for e in manifest.shards:
        named.update({k: int(v) for k, v in (e.get("mask_bits") or {}).items()})
    have = ["none"] + (["mask"] if info.has_mask else []) + sorted(named)
    if name not in MASK_FIELDS and name not in named:
        raise WMError(f"--mask {name!r} is not known; this data set offers: {', '.join(have)}")
    if not info.has_mask:
        raise WMError(f"--mask {name}: the data set has no visibility mask (manifest has_mask is false); "
                      f"use --mask none (OccWorld's protocol)")
    if name == "mask":
        return 0
    if name not in named:
        raise WMError(f"--mask {name}: the data set's manifest names no {name} mask bits; it offers: "
                      f"{', '.join(have)}")
    return named[name]


def _parse_horizons(text: Optional[str]) -> tuple[float, ...]:
    return parse_horizons(text) if text else PROTOCOL_HORIZONS


def _precision(dtype) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def default_json(run_dir: Path, stages: Sequence[str], split: str, mode: str, mask: str,
                 ckpt: Optional[Path], horizons: Sequence[float] = PROTOCOL_HORIZONS) -> Path:
    """<run>/eval/<stages>_<split>_<mode>[_mask-<mask>][_h<h1>-<h2>...].json: the horizons where a
    forecast is scored at others than the protocol's, so no custom report takes the protocol's
    name; with --ckpt the file's stem leads."""
    lead = "+".join(stages) if ckpt is None else f"{stages[0]}-{ckpt.stem}"
    hs = "_h" + "-".join(horizon_label(h) for h in horizons) \
        if "world" in stages and tuple(horizons) != PROTOCOL_HORIZONS else ""
    return run_dir / "eval" / (f"{lead}_{split}_{mode}" + (f"_mask-{mask}" if mask != "none" else "") + hs + ".json")


def evaluate_run(cfg: Config, dist: distributed.Dist, device: torch.device, dtype: Optional[torch.dtype], args) -> int:
    """`train.py --eval-only`: evaluate a run's checkpoints under OccWorld's protocol, print the
    table (rank 0) and write the JSON report (rank 0, atomically). Every bad input is refused with
    one line (WMError) before any model runs."""
    say = print if dist.is_main else (lambda *a, **k: None)
    for flag in ("fresh", "allow_new_data"):
        if getattr(args, flag, False):
            raise WMError(f"--{flag.replace('_', '-')} belongs to training; it has no meaning with --eval-only")
    mode = args.mode or "occworld"
    if mode not in MODES:
        raise WMError(f"--mode {mode!r} must be one of {', '.join(MODES)}")
    mask = args.mask or "none"
    run_dir = Path(cfg.run.out_dir) / cfg.run.name

    # ---- which checkpoints: all refusals before any data is read or model run
    ckpt = Path(args.ckpt).expanduser() if args.ckpt else None
    if ckpt is not None:
        if args.stage == "all":
            raise WMError("--stage all evaluates a run's checkpoints; with --ckpt only that checkpoint's "
                          "stage is evaluated")
        ckpt_state = load_stage(ckpt, args.stage)
        plan = [(ckpt_state["stage"], ckpt, ckpt_state)]
    else:
        stages = list(cfg.train.stages) if args.stage is None else (
            ["tokenizer", "world"] if args.stage == "all" else [args.stage])
        plan = []
        for s in stages:
            p, ckpt_state = stage_checkpoint(run_dir, s, say)
            plan.append((s, p, load_stage(p, s, what="checkpoint", ckpt_state=ckpt_state)))
    stages = [s for s, _, _ in plan]
    for s, p, ckpt_state in plan:
        check_config(ckpt_state, cfg, s, p)
    tok_for_world = None
    if "world" in stages:
        _, wp, wst = next(x for x in plan if x[0] == "world")
        tpath, tsha = world_tokenizer(wst, wp, run_dir)
        tst = load_stage(tpath, "tokenizer", what=f"the tokenizer of {wp}")
        check_config(tst, cfg, "tokenizer", tpath)
        tok_for_world = (tpath, tsha, tst)

    # ---- data
    root = _data_root(cfg, dist, say)
    from wm.data.shards import load_manifest

    manifest = load_manifest(root)
    check_against_config(manifest, cfg.data)
    info = manifest.info
    split = args.split or cfg.data.val_split
    manifest.split(split)  # names the splits present when this one is not
    bits = _mask_field(mask, manifest)  # OccWindows reads the `mask` field, these bits of it
    field = None if bits is None else "mask"
    if bits is not None:
        cfg.data = dataclasses.replace(cfg.data, mask_bits=bits)
    asked = getattr(args, "horizons", None)
    horizons, why = _parse_horizons(asked), "--horizons" if asked else ""
    steps = None
    if "world" in stages:
        check_stride(plan, cfg, info.frame_rate_hz)
        if not asked and cfg.data.horizons_s:  # the horizons this run is for
            horizons, why = tuple(cfg.data.horizons_s), "data.horizons_s"
        elif not asked:
            horizons, why = default_horizons(info.frame_rate_hz, cfg.data.stride, cfg.data.future)
        steps = horizon_steps(horizons, info.frame_rate_hz, cfg.data.stride, cfg.data.future,
                              longest=cfg.world.max_frames + 1 - cfg.data.past)
    for s, p, ckpt_state in plan:
        fp = ckpt_state.get("data_fingerprint")
        if fp and fp != manifest.fingerprint:
            say(f"note: {p} was trained on data {fp[:16]}, evaluating on {root} ({manifest.fingerprint[:16]})")

    out = Path(args.json).expanduser() if args.json else default_json(run_dir, stages, split, mode, mask, ckpt, horizons)
    failure = distributed.broadcast_object(unwritable(out.parent) if dist.is_main else None, dist)  # before the evaluation
    if failure:
        raise WMError(f"cannot write the evaluation report {out} ({failure}); choose another path with --json")
    names = list(info.class_names)
    bs = {s: getattr(cfg, f"{s}_stage").batch_size or cfg.data.batch_size for s in ("tokenizer", "world")}
    rep: dict[str, Any] = {
        "protocol": "occworld" if (mode == "occworld" and mask == "none" and steps == list(OCCWORLD_STEPS)
                                   and tuple(horizons) == PROTOCOL_HORIZONS) else "custom",
        "split": split, "mask": mask, "mode": mode, "unit": "percent",
        "data": {"root": str(root), "fingerprint": manifest.fingerprint, "frame_rate_hz": info.frame_rate_hz},
        "class_names": names, "free_class": info.free_class,
        "moving_classes": list(moving_classes(info, cfg.data.moving_classes)),
        "world_size": dist.world_size, "device": str(device), "precision": _precision(dtype),
        "wm_version": __version__, "torch_version": torch.__version__, "argv": list(sys.argv),
    }

    # ---- tokenizer reconstruction
    if "tokenizer" in stages:
        _, p, ckpt_state = next(x for x in plan if x[0] == "tokenizer")
        tok = _build(Tokenizer, ckpt_state, p, cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid),
                     **model_options(cfg, "tokenizer")).to(device).eval()
        ds = OccWindows(root, split, frames_config(cfg.data, use_mask=field is not None),
                        h5_cache_mib=cfg.loader.h5_cache_mib)
        batches = eval_batches(ds, dist, bs["tokenizer"], cfg.loader.num_workers, cfg.loader.pin_memory, "tokenizer", say)
        r = reconstruction(tok, batches,
                           dist, device, dtype, cfg.data.num_classes, cfg.data.free_class)
        rep["tokenizer"] = {"checkpoint": str(p), "step": ckpt_state.get("step"), "sha256": sha256_file(p),
                            "data_fingerprint": ckpt_state.get("data_fingerprint"), "frames": len(ds),
                            **recon_report(r, mode, names)}
        del tok

    # ---- world-model forecast and copy-last
    if "world" in stages:
        _, p, ckpt_state = next(x for x in plan if x[0] == "world")
        tpath, tsha, tst = tok_for_world
        tok = _build(Tokenizer, tst, tpath, cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid),
                     **model_options(cfg, "tokenizer"))
        tok = tok.to(device).eval().requires_grad_(False)
        world = _build(WorldModel, ckpt_state, p, cfg.world, cfg.tokenizer.codebook_size,
                       **model_options(cfg, "world")).to(device).eval()
        ds = OccWindows(root, split, dataclasses.replace(cfg.data, use_mask=field is not None),
                        h5_cache_mib=cfg.loader.h5_cache_mib)
        batches = eval_batches(ds, dist, bs["world"], cfg.loader.num_workers, cfg.loader.pin_memory, "world", say)
        f = forecast(tok, world, batches,
                     dist, device, dtype, cfg.data.past, cfg.data.future, cfg.data.num_classes, cfg.data.free_class,
                     given_motion=cfg.train.forecast_motion == "given")
        rep["world"] = {"checkpoint": str(p), "step": ckpt_state.get("step"), "sha256": sha256_file(p),
                        "data_fingerprint": ckpt_state.get("data_fingerprint"),
                        "tokenizer_checkpoint": str(tpath), "tokenizer_sha256": tsha,
                        "windows": len(ds), "past": cfg.data.past, "future": cfg.data.future,
                        "stride": cfg.data.stride, "forecast_motion": cfg.train.forecast_motion,
                        "horizons_why": why or "OccWorld's protocol",
                        **forecast_report(f, steps, horizons, mode, names)}

    if dist.is_main:
        print(format_table(rep))
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(out, json.dumps(rep, indent=1, allow_nan=False) + "\n")
        except OSError as e:
            raise WMError(f"cannot write the evaluation report {out} ({e}); choose another path with --json") from None
        print(f"wrote {out}")
    return 0
