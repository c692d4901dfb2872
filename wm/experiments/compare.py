"""The regression gate behind tools/compare.py: two world models scored on the same windows, the
difference of every metric with a paired bootstrap interval over scenes, and a verdict per metric.

What can be compared (`load_model`):

- a run folder (`runs/<name>`): its best valid world-model checkpoint, as --eval-only and export
  pick it (wm.evaluation.evaluate.stage_checkpoint), and the tokenizer it was trained on (found by sha256);
- a world-model checkpoint file (`.pt`): that step, its tokenizer found the same way;
- an export folder (export.py's output, `export.json` beside the ONNX graphs): the graphs
  themselves in onnxruntime on the CPU (the host loop wm.export.deployed runs, FP32 files by
  default), i.e. what is deployed, not the weights it came from. The graphs carry no config, so the
  world checkpoint that export.json records must still be there: it gives the window, classes and
  motion setting, nothing else.

Both models are always scored here, on one set of windows of one data set (the candidate's data by
default), the PyTorch ones in one precision (ONNX files compute in their own); a run's own
summary.json is only compared with, and a line says when it was computed on other data, split or
windows. Metrics: forecast IoU and mIoU (percent) at every future step and their mean over all the
steps ("avg", what training validation and summary.json average; not the protocol's 1/2/3 s mean).
Scoring is --eval-only's: the PyTorch models go through wm.evaluation.evaluate.forecast (batch by batch), so
the per-scene counts summed over the scenes are exactly the confusion matrices --eval-only reports
on the same windows.

The interval: consecutive windows of a scene share frames, so windows are not independent draws;
scenes are. Every window's counts go to its scene's slot, (G, S, C, C) per model, and
wm.evaluation.metrics.paired_bootstrap draws scenes with replacement, the same scenes for both models, giving
the distribution of candidate - baseline per future step and averaged over the steps; the interval
is its percentile interval at `confidence`.

Verdict per metric, delta = candidate - baseline in points, interval [lo, hi], tolerance t >= 0:
worse if hi < -t (below the tolerance band, beyond doubt), better if lo > t, same if the whole
interval lies within [-t, t], inconclusive otherwise (and with fewer than two scenes, where there is
no interval). The gate fails on a gated metric that is worse, and with `strict` on one that is
inconclusive too. Two identical models differ by exactly 0 in every resample: [0, 0], same.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from wm.checkpoint.files import sha256_file
from wm.config.loading import from_saved
from wm.config.sections import Config, model_options
from wm.evaluation.metrics import ConfusionMatrix, copy_last, paired_bootstrap, step_label
from wm.utils import distributed
from wm.utils.errors import DataError, WMError

# what both models must share to be scored on the same windows against the same targets
SAME_KEYS = ("data.grid", "data.num_classes", "data.free_class", "data.past", "data.future", "data.stride",
             "train.forecast_motion")
EXPORT_ROWS = ("onnx_fp32", "onnx_fp16", "onnx_int8", "onnx_int8_ort")  # wm.export.int8_report.ROW_FILES
DEFAULT_METRICS = ("iou_avg", "miou_avg")


@dataclass
class Model:
    """One side of the comparison: where it came from, its config (the world checkpoint's), and
    `count(batch) -> (S, C, C)` confusion counts of its forecast of one batch of windows."""

    role: str
    path: Path
    kind: str  # "run", "checkpoint" or "export"
    cfg: Config
    ckpt: Path
    step: Optional[int]
    data_fingerprint: str
    engine: str
    count: Callable[[dict], torch.Tensor]
    summary: Optional[dict] = None  # a run's summary.json (its "world" figures), else None

    def describe(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "checkpoint": str(self.ckpt), "step": self.step,
                "sha256": sha256_file(self.ckpt), "data_fingerprint": self.data_fingerprint, "engine": self.engine}


# ---------------------------------------------------------------------------------------------
# the two models


def _get(cfg: Config, key: str) -> Any:
    sec, k = key.split(".")
    v = getattr(getattr(cfg, sec), k)
    return list(v) if isinstance(v, tuple) else v


def _config(ckpt_state: dict, path: Path) -> Config:
    try:
        return from_saved(ckpt_state["config"]).validate()
    except WMError as e:
        raise WMError(f"{path}: its config is refused ({e})") from None


def _torch_model(role: str, path: Path, kind: str, ckpt: Path, ckpt_state: dict, run_dir: Path, device, dtype) -> Model:
    """A world checkpoint and its tokenizer as PyTorch modules, scored by wm.evaluation.evaluate.forecast."""
    from wm.evaluation.evaluate import _build, _precision, check_config, forecast, load_stage
    from wm.checkpoint.trained import world_tokenizer
    from wm.models.tokenizer import Tokenizer
    from wm.models.world import WorldModel

    cfg = _config(ckpt_state, ckpt)
    tpath, _ = world_tokenizer(ckpt_state, ckpt, run_dir)
    tst = load_stage(tpath, "tokenizer", what=f"the tokenizer of {ckpt}")
    check_config(tst, cfg, "tokenizer", tpath)
    tok = _build(Tokenizer, tst, tpath, cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid),
                 **model_options(cfg, "tokenizer")).to(device).eval().requires_grad_(False)
    world = _build(WorldModel, ckpt_state, ckpt, cfg.world, cfg.tokenizer.codebook_size,
                   **model_options(cfg, "world")).to(device).eval()
    d, c = distributed.Dist(device=device), cfg.data
    given = cfg.train.forecast_motion == "given"

    def count(batch: dict) -> torch.Tensor:
        f = forecast(tok, world, [batch], d, device, dtype, c.past, c.future, c.num_classes, c.free_class,
                     given_motion=given)
        return f.ours.counts.cpu()

    return Model(role, path, kind, cfg, ckpt, ckpt_state.get("step"), ckpt_state.get("data_fingerprint") or "",
                 f"torch {device.type} {_precision(dtype)}", count)


def _export_model(role: str, folder: Path, row: str) -> Model:
    """An export folder's ONNX graphs of `row`, run by the deployed host loop in onnxruntime."""
    from wm.evaluation.evaluate import load_stage
    from wm.export.deployed import forecast
    from wm.export.int8_report import ROW_FILES, graph_files, ort_row

    rec_file = folder / "export.json"
    try:
        rec = json.loads(rec_file.read_text())
        ckpt = Path(rec["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WMError(f"{rec_file} is not export.py's record ({type(e).__name__}: {e}); export the run again") from None
    if not ckpt.is_file():
        raise WMError(f"--{role} {folder}: export.json records checkpoint {ckpt}, which is missing; the ONNX "
                      "graphs hold no config (window, classes, motion): restore it, or compare the run instead")
    missing = [p for p in graph_files(folder, ROW_FILES[row][0]).values() if not p.is_file()]
    if missing:
        raise WMError(f"--{role} {folder}: {missing[0].name} is missing; export it (export.py), or choose "
                      f"other files with --export-files ({', '.join(EXPORT_ROWS)})")
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise WMError(f"--{role} {folder} is an export folder, scored in onnxruntime, which is not installed; "
                      "pip install onnxruntime, or compare the run it was exported from") from None
    ckpt_state = load_stage(ckpt, "world", what=f"the checkpoint {rec_file} records")
    cfg = _config(ckpt_state, ckpt)
    run, c = ort_row(folder, row), cfg.data
    given = cfg.train.forecast_motion == "given"

    def count(batch: dict) -> torch.Tensor:
        occ, motion = batch["occ"], batch["motion"]
        pred = forecast(run, cfg, occ[:, :c.past], motion[:, :c.past], motion[:, c.past:] if given else None)
        cm = ConfusionMatrix(c.num_classes, c.free_class, c.future)
        cm.update(pred, occ[:, c.past:], batch["mask"][:, c.past:] if "mask" in batch else None)
        return cm.counts

    return Model(role, folder, "export", cfg, ckpt, ckpt_state.get("step"), ckpt_state.get("data_fingerprint") or "",
                 f"onnxruntime cpu, {row} files", count)


def load_model(path: str | os.PathLike, role: str, device: torch.device, dtype: Optional[torch.dtype],
               export_row: str = "onnx_fp32") -> Model:
    """`path` (a run folder, a world checkpoint file or an export folder) as the `role` side; every
    problem refused with one line naming the path."""
    from wm.evaluation.evaluate import load_stage, stage_checkpoint

    p = Path(path).expanduser()
    if not p.exists():
        raise WMError(f"--{role} {p} does not exist; pass a run folder (runs/<name>), a world checkpoint "
                      "(.pt) or an export folder")
    if p.is_file():
        ckpt_state = load_stage(p, "world", what=f"--{role}")
        return _torch_model(role, p, "checkpoint", p, ckpt_state, p.resolve().parent.parent.parent, device, dtype)
    if (p / "export.json").is_file():
        return _export_model(role, p, export_row)
    folder = p / "world" / "checkpoints"
    if not folder.is_dir() or not any(folder.glob("*.pt")):
        what = "a run folder with only its tokenizer stage" if (p / "tokenizer" / "checkpoints").is_dir() else \
            "neither a wm run folder (no world/checkpoints/) nor an export folder (no export.json)"
        raise WMError(f"--{role} {p} is {what}; pass a run whose world stage has trained, a world checkpoint "
                      "(.pt) or an export folder")
    ckpt, ckpt_state = stage_checkpoint(p, "world", say=lambda *a, **k: None)
    ckpt_state = load_stage(ckpt, "world", what=f"--{role}", ckpt_state=ckpt_state)
    m = _torch_model(role, p, "run", ckpt, ckpt_state, p, device, dtype)
    summary = p / "summary.json"
    try:
        m.summary = json.loads(summary.read_text()).get("world") if summary.is_file() else None
    except (OSError, ValueError, AttributeError):
        m.summary = None  # an unreadable summary only loses its note
    return m


def check_same(a: Model, b: Model) -> None:
    """Refuse two models that cannot be scored on the same windows, naming the first key they differ in."""
    for key in SAME_KEYS:
        va, vb = _get(a.cfg, key), _get(b.cfg, key)
        if va != vb:
            raise WMError(f"cannot score both on the same windows: baseline {a.path} has {key}={va!r} but "
                          f"candidate {b.path} has {key}={vb!r}; compare models of one grid, classes and window")


# ---------------------------------------------------------------------------------------------
# windows, scenes, counts


def scene_groups(ds, idx: Sequence[int]) -> tuple[list[str], list[list[int]]]:
    """The scenes of windows `idx` of `ds` (an OccWindows): their names (`<shard file>:<scene>`)
    and each one's window indices, in data order."""
    names: list[str] = []
    groups: list[list[int]] = []
    where: dict[tuple[int, int], int] = {}
    for i in idx:
        sid, first = (int(x) for x in ds.index[int(i)])
        sh = ds.shards[sid]
        j = int(np.searchsorted(sh.scene_offsets, first, side="right")) - 1  # the scene holding frame `first`
        if (sid, j) not in where:
            where[(sid, j)] = len(groups)
            names.append(f"{Path(sh.path).name}:{sh.scene_names[j]}")
            groups.append([])
        groups[where[(sid, j)]].append(int(i))
    return names, groups


def score(models: Sequence[Model], ds, groups: list[list[int]], batch: int, workers: int = 0,
          log=print) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every model's and copy-last's (G, S, C, C) confusion counts per scene. Batches never cross
    a scene, so each one's counts belong to one scene; each batch is read once for all models."""
    from wm.data.windows import ignore_stop_signals, start_workers
    from wm.utils.logs import Progress

    c = models[0].cfg.data
    shape = (len(groups), c.future, c.num_classes, c.num_classes)
    counts = {m.role: torch.zeros(shape, dtype=torch.int64) for m in models}
    base = torch.zeros(shape, dtype=torch.int64)
    plan = [(g, ids[s:s + batch]) for g, ids in enumerate(groups) for s in range(0, len(ids), batch)]
    loader = torch.utils.data.DataLoader(ds, batch_sampler=[b for _, b in plan], num_workers=min(workers, 2),
                                         worker_init_fn=ignore_stop_signals)
    bar = Progress("scoring", sum(len(b) for _, b in plan), "windows", log)
    for (g, ids), b in zip(plan, start_workers(loader)):
        for m in models:
            counts[m.role][g] += m.count(b)
        cm = ConfusionMatrix(c.num_classes, c.free_class, c.future)
        mask = b["mask"][:, c.past:] if "mask" in b else None
        cm.update(copy_last(b["occ"][:, :c.past], c.future), b["occ"][:, c.past:], mask)
        base[g] += cm.counts
        bar.step(len(ids))
    return counts, base


# ---------------------------------------------------------------------------------------------
# differences and verdicts


def metric_names(future: int) -> list[str]:
    """iou_avg, miou_avg (the mean over every future step), then iou_t1, miou_t1, ... per step."""
    return list(DEFAULT_METRICS) + [f"{m}_t{k}" for k in range(1, future + 1) for m in ("iou", "miou")]


def verdict(lo: Optional[float], hi: Optional[float], tolerance: float) -> str:
    """better / same / worse / inconclusive for an interval of candidate - baseline (module docstring)."""
    if lo is None or hi is None:
        return "inconclusive"
    if hi < -tolerance:
        return "worse"
    if lo > tolerance:
        return "better"
    if -tolerance <= lo and hi <= tolerance:
        return "same"
    return "inconclusive"


def _f(x) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def totals(counts: torch.Tensor, free: int, mode: str) -> dict:
    """The summary (wm.evaluation.metrics.ConfusionMatrix.summary: every step, averages over all of them) of
    per-scene counts summed over the scenes."""
    cm = ConfusionMatrix(counts.shape[-1], free, counts.shape[1])
    cm.counts = counts.sum(0)
    return cm.summary(mode=mode)


def differences(a: torch.Tensor, b: torch.Tensor, free: int, mode: str, tolerance: float, confidence: float,
                resamples: int, seed: int) -> dict[str, dict]:
    """{metric: baseline, candidate, delta, se, lo, hi, verdict} (points) from the two models'
    (G, S, C, C) per-scene counts `a` (baseline) and `b` (candidate)."""
    sa, sb = totals(a, free, mode), totals(b, free, mode)
    boot = paired_bootstrap(a, b, free, mode, resamples, seed)
    q = (1 - confidence) / 2
    out = {}
    for name in metric_names(a.shape[1]):
        kind, _, at = name.partition("_")
        if at == "avg":
            va, vb, dist = sa[f"{kind}_avg"], sb[f"{kind}_avg"], None if boot is None else boot[f"{kind}_avg"]
        else:
            s = int(at[1:]) - 1
            va, vb, dist = sa[kind][s], sb[kind][s], None if boot is None else boot[kind][:, s]
        delta = None if va is None or vb is None else vb - va
        se = lo = hi = None
        if dist is not None and not bool(dist.isnan().all()):
            se = _f(float(dist[~dist.isnan()].std())) if int((~dist.isnan()).sum()) > 1 else None
            lo, hi = _f(float(dist.nanquantile(q))), _f(float(dist.nanquantile(1 - q)))
        out[name] = {"baseline": _f(va), "candidate": _f(vb), "delta": _f(delta), "se": se, "lo": lo, "hi": hi,
                     "verdict": verdict(lo, hi, tolerance)}
    return out


def parse_metrics(text: str, future: int) -> list[str]:
    """--metrics: comma-separated names of metric_names(future); refused with the valid ones."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = metric_names(future)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise WMError(f"--metrics {text!r}: {'unknown ' + ', '.join(bad) if bad else 'none given'}; choose from "
                      f"{', '.join(known)}")
    return names


def _summary_of(m: Model, here: dict, counts: torch.Tensor, total_windows: int) -> tuple[bool, str]:
    """(whether a run's summary.json is for this comparison's windows, what it says about them): its
    validation scored the run's val split of the data it trained on, <world>_stage.val_windows of
    them, absent classes excluded, averaged over every future step."""
    from wm.training.stages import val_windows

    n = val_windows(m.cfg, m.cfg.world_stage)
    fp, split = m.data_fingerprint, m.cfg.data.val_split
    if not (fp == here["fingerprint"] and split == here["split"] and (n or total_windows) == here["windows"]):
        return False, f"for data {fp[:12] or '?'} split {split}, {n or 'all'} windows"
    now = totals(counts, m.cfg.data.free_class, "exclude")
    old, new = [m.summary.get("iou_avg"), m.summary.get("miou_avg")], [now["iou_avg"], now["miou_avg"]]
    same = all(v is not None and w is not None and abs(v - w) < 0.01 for v, w in zip(old, new))
    cells = ["/".join("-" if v is None else f"{v:.2f}" for v in x) for x in (old, new)]
    why = "" if same else f" (not its validation's checkpoint or precision: {m.ckpt.name} step {m.step} here)"
    return True, f"for these windows: IoU/mIoU {cells[0]} there (absent classes excluded), {cells[1]} here{why}"


def notes(models: Sequence[Model], here: dict, counts: dict, total_windows: int, scenes: int) -> list[str]:
    """One line each: how the runs' summary.json relate to these windows, data the models were not
    trained on, too few scenes for an interval."""
    out, other = [], []
    for m in models:
        if m.summary is not None:
            ours, what = _summary_of(m, here, counts[m.role], total_windows)
            (out if ours else other).append(f"{m.role}'s summary.json is {what}")
    if other:
        out.append(f"{', '.join(other)}: scoring both on data {here['fingerprint'][:12]} split {here['split']}, "
                   f"{here['windows']} windows (absent classes: {here['mode']})")
    if any(m.data_fingerprint and m.data_fingerprint != here["fingerprint"] for m in models):
        fps = {m.data_fingerprint[:12] or "?" for m in models}
        who = f"both trained on data {fps.pop()}" if len(fps) == 1 else "trained on data " + ", ".join(
            f"{m.data_fingerprint[:12] or '?'} ({m.role})" for m in models)
        out.append(f"{who}; scored on {here['fingerprint'][:12]}")
    if scenes < 2:
        out.append(f"{scenes} scene{'s' * (scenes != 1)}: no interval (the bootstrap draws scenes), every verdict "
                   "inconclusive; score on more scenes (--data, --split)")
    return out


# ---------------------------------------------------------------------------------------------
# tables


def _label(name: str, step_s: Optional[float]) -> str:
    kind, _, at = name.partition("_")
    word = "IoU" if kind == "iou" else "mIoU"
    return f"{word} avg" if at == "avg" else f"{word} {step_label(int(at[1:]), step_s)}"


def _n(v, p: int = 2) -> str:
    return "-" if v is None else f"{v:.{p}f}"


def _signed(v) -> str:
    return "-" if v is None else f"{v:+.2f}"


def rows(rep: dict) -> list[list[str]]:
    """The table's rows: metric, baseline, candidate, delta, interval, verdict (gated marked *)."""
    out = []
    for name, r in rep["metrics"].items():
        mark = " *" if name in rep["gated"] else ""
        iv = "-" if r["lo"] is None else f"[{r['lo']:+.2f}, {r['hi']:+.2f}]"
        out.append([_label(name, rep["step_s"]) + mark, _n(r["baseline"]), _n(r["candidate"]), _signed(r["delta"]),
                    iv, r["verdict"]])
    return out


HEAD = ["metric", "baseline", "candidate", "delta", "interval", "verdict"]


def _heading(rep: dict) -> tuple[str, str]:
    a, b, d = rep["baseline"], rep["candidate"], rep["data"]
    def what(m):  # an export's step is its recorded checkpoint's, the config's source
        return f"{'export of ' if m['kind'] == 'export' else ''}world step {m['step']}, {m['engine']}"

    who = f"baseline {a['path']} ({what(a)}) vs candidate {b['path']} ({what(b)})"
    how = (f"{d['windows']} windows in {d['scenes']} scene{'s' * (d['scenes'] != 1)} of {d['root']} split {d['split']} "
           f"(absent classes: {rep['mode']}, mask {rep['mask']}); delta = candidate - baseline in points, "
           f"{100 * rep['confidence']:g}% interval of a paired bootstrap over scenes ({rep['resamples']} resamples); "
           f"tolerance +-{rep['tolerance']:g}; * gated")
    return who, how


def _result(rep: dict) -> str:
    if rep["passed"]:
        return "PASS" + (f" (inconclusive: {', '.join(rep['inconclusive'])})" if rep["inconclusive"] else "")
    why = "worse or inconclusive (--strict)" if rep["strict"] else "worse"
    return f"REGRESSION: {', '.join(rep['failed'])} {why}"


def format_table(rep: dict) -> str:
    """The console table."""
    body = [HEAD] + rows(rep)
    w = [max(len(r[i]) for r in body) for i in range(len(HEAD))]
    lines = list(_heading(rep))
    for r in body:
        lines.append("  " + "  ".join(c.ljust(w[i]) if i in (0, 5) else c.rjust(w[i]) for i, c in enumerate(r)))
    cl = rep["copy_last"]
    lines.append(f"  copy-last on the same windows: IoU avg {_n(cl['iou_avg'])}, mIoU avg {_n(cl['miou_avg'])}")
    lines += [f"note: {n}" for n in rep["notes"]]
    lines.append(f"result: {_result(rep)}")
    return "\n".join(lines)


def format_markdown(rep: dict) -> str:
    """The markdown table (for a CI job's summary)."""
    who, how = _heading(rep)
    lines = [f"### wm compare: {_result(rep)}", "", who + "  ", how, "",
             "| " + " | ".join(HEAD) + " |", "|---|---:|---:|---:|---:|---|"]
    for r in rows(rep):
        r[5] = f"**{r[5]}**" if r[5] == "worse" else r[5]
        lines.append("| " + " | ".join(r) + " |")
    cl = rep["copy_last"]
    lines += ["", f"copy-last on the same windows: IoU avg {_n(cl['iou_avg'])}, mIoU avg {_n(cl['miou_avg'])}"]
    lines += [f"- note: {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# the whole comparison


def compare(a: Model, b: Model, data: Optional[str] = None, split: Optional[str] = None, windows: int = 0,
            mask: str = "none", mode: str = "occworld", tolerance: float = 0.5, confidence: float = 0.95,
            resamples: int = 2000, seed: int = 0, metrics: Sequence[str] = DEFAULT_METRICS, strict: bool = False,
            batch: int = 0, workers: int = 0, log=print) -> dict:
    """Score `a` (baseline) and `b` (candidate) on the same windows and judge every metric: the
    JSON-ready report (`passed`, `failed`, `metrics`, the per-scene counts' totals...)."""
    from wm.data.windows import OccWindows, check_against_config, resolve_root, spread
    from wm.evaluation.evaluate import _mask_field
    from wm.data.shards import load_manifest

    check_same(a, b)
    cfg = b.cfg
    root = Path(data).expanduser() if data else resolve_root(cfg, log=log)
    if not root.is_dir():
        raise DataError(f"data set folder {root} does not exist: pass a wm data set (manifest.json + shards) "
                        "with --data")
    manifest = load_manifest(root)
    info = manifest.info
    for m in (a, b):
        for key, have in (("grid", list(info.grid)), ("num_classes", info.num_classes),
                          ("free_class", info.free_class)):
            if have != _get(m.cfg, f"data.{key}"):
                raise DataError(f"--data {root} has {key} {have} but the {m.role} {m.path} forecasts data.{key}="
                                f"{_get(m.cfg, f'data.{key}')}; score on a data set of its grid and classes")
        check_against_config(manifest, m.cfg.data)
    split = split or cfg.data.val_split
    manifest.split(split)  # names the splits present when this one is not
    bits = _mask_field(mask, manifest)
    dcfg = dataclasses.replace(cfg.data, max_windows=0, use_mask=bits is not None, mask_bits=bits or 0)
    ds = OccWindows(root, split, dcfg, h5_cache_mib=cfg.loader.h5_cache_mib)
    idx = spread(len(ds), windows)
    names, groups = scene_groups(ds, idx)
    batch = batch or cfg.world_stage.batch_size or cfg.data.batch_size
    log(f"scoring baseline {a.path} and candidate {b.path} on {len(idx)} windows in {len(groups)} scenes of "
        f"{root} split {split}")
    counts, base = score((a, b), ds, groups, batch, workers, log)
    free = cfg.data.free_class
    diffs = differences(counts["baseline"], counts["candidate"], free, mode, tolerance, confidence, resamples, seed)
    here = {"fingerprint": manifest.fingerprint, "split": split, "windows": len(idx), "mode": mode}
    failing = ("worse", "inconclusive") if strict else ("worse",)
    failed = [n for n in metrics if diffs[n]["verdict"] in failing]
    rate = info.frame_rate_hz
    return {
        "passed": not failed, "failed": failed, "strict": strict, "gated": list(metrics),
        "inconclusive": [n for n in metrics if diffs[n]["verdict"] == "inconclusive"],
        "baseline": a.describe(), "candidate": b.describe(),
        "data": {"root": str(root), "fingerprint": manifest.fingerprint, "split": split, "windows": int(len(idx)),
                 "scenes": len(groups), "scene_names": names, "frame_rate_hz": rate},
        "mode": mode, "mask": mask, "unit": "percent", "tolerance": tolerance, "confidence": confidence,
        "resamples": resamples, "seed": seed, "batch": batch,
        "step_s": cfg.data.stride / rate if rate > 0 else None,
        "metrics": diffs, "notes": notes((a, b), here, counts, len(ds), len(groups)),
        "copy_last": {k: _f(v) for k, v in totals(base, free, mode).items() if k in ("iou_avg", "miou_avg")},
        "confusion": {"baseline": counts["baseline"].sum(0).tolist(), "candidate": counts["candidate"].sum(0).tolist(),
                      "copy_last": base.sum(0).tolist()},
    }
