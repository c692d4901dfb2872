"""The INT8 accuracy report: past occupancy -> future occupancy on held-out windows (the run's VAL
split), end to end through the deployed host loop (wm.export.forecast), for each precision.

Rows (IoU / mIoU in percent per future step, averaged; drops against PyTorch FP32):

- ``pytorch_fp32``: the PyTorch modules (on the GPU where the torch engine runs);
- ``onnx_fp32`` / ``onnx_fp16``: the ONNX graphs; ``onnx_int8``: TensorRT's Q/DQ files
  (``.int8.onnx``) as their ONNX semantics define them (float ops on dequantized values, what
  TensorRT computes); ``onnx_int8_ort``: onnxruntime's copies (``.int8-ort.onnx``) in onnxruntime's
  integer kernels, exact on every x86 CPU (wm.export.qdq.cpu_copy). Engine ``onnxruntime``: the
  files themselves in onnxruntime on the CPU (``onnx_int8`` with its Q/DQ fusion off, so that no
  CPU's integer kernel stands in for TensorRT's). Engine ``torch`` (the default where a GPU is
  present, so that the report at the `occworld` size takes minutes): each INT8 row is its Q/DQ
  file's quantization applied to the exported program on the GPU (its scales bit for bit, its int8
  weights; wm.export.forecast.QdqPlan), FP16 the modules under float16 autocast, and ``parity`` runs
  onnxruntime on the first `parity_windows` windows and gives its voxel agreement with the torch
  rows (FP32 and both INT8 files);
- ``copy_last``: the last past frame repeated, the floor beside every number.

Each row also has its voxel agreement with PyTorch FP32 and its time per window in its engine, and
each drop its standard error (``drop_iou_avg_se``, ``drop_miou_avg_se``): a paired bootstrap over the
held-out windows. The forecast is an argmax rollout, so a perturbation of any kind (INT8, FP16, or
only another FP32 kernel) flips near-tied tokens and the futures that follow; the drop measured on
64 windows then moves by about this much from one run to the next, with no change in the quantizer.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from wm.export.qdq import Int8Error

VARIANTS = ("pytorch_fp32", "onnx_fp32", "onnx_fp16", "onnx_int8", "onnx_int8_ort", "copy_last")
GRAPHS = ("tokenizer_encode", "world_step", "tokenizer_decode")
CPU_INT8 = ".int8-ort"  # onnxruntime's INT8 copies (wm.export.qdq.cpu_copy)
# row -> (file kind, onnxruntime runs its Q/DQ as float ops)
ROW_FILES = {"onnx_fp32": ("", False), "onnx_fp16": (".fp16", False), "onnx_int8": (".int8", True),
             "onnx_int8_ort": (CPU_INT8, False)}


def graph_files(out_dir: Path, kind: str = "") -> dict[str, Path]:
    """{graph: <out_dir>/<graph><kind>.onnx}, kind '' (FP32), '.fp16', '.int8' or CPU_INT8."""
    return {g: Path(out_dir) / f"{g}{kind}.onnx" for g in GRAPHS}


def ort_row(out_dir: Path, row: str):
    """A row's files in onnxruntime, run as the row defines them (ROW_FILES)."""
    from wm.export.forecast import OrtGraphs

    kind, qdq_in_float = ROW_FILES[row]
    return OrtGraphs(graph_files(out_dir, kind), qdq_in_float=qdq_in_float)


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def _engines(trained, out_dir: Path, engine: str, device, programs) -> dict[str, tuple[Callable, str]]:
    """{row: (run_graph, what runs it)} for the rows this engine computes."""
    from wm.export.forecast import ProgramGraphs, QdqPlan, TorchGraphs
    from wm.export.onnx import graphs
    from wm.export.qdq import _load

    files = {row: graph_files(out_dir, kind) for row, (kind, _) in ROW_FILES.items()}
    dev = torch.device(device)
    rows = {"pytorch_fp32": (TorchGraphs(graphs(trained), dev), f"torch {dev.type}")}
    if engine == "onnxruntime":
        what = {"onnx_int8": "onnxruntime cpu, Q/DQ as float ops (the file's ONNX semantics, as TensorRT)",
                "onnx_int8_ort": "onnxruntime cpu int8 kernels"}
        for v, f in files.items():
            if all(p.is_file() for p in f.values()):
                rows[v] = (ort_row(out_dir, v), what.get(v, "onnxruntime cpu"))
        return rows
    if all(p.is_file() for p in files["onnx_fp16"].values()):
        rows["onnx_fp16"] = (TorchGraphs(graphs(trained), dev, fp16=True), f"torch {dev.type} float16 autocast")
    for v in ("onnx_int8", "onnx_int8_ort"):
        plans = {g: QdqPlan(_load(p)) for g, p in files[v].items()}
        unmapped = {g: p.unmapped for g, p in plans.items() if p.unmapped}
        if unmapped:
            g, names = next(iter(unmapped.items()))
            raise Int8Error(f"{files[v][g].name}: quantized nodes {names[:3]} have no exported-program node to "
                            "emulate them on; use --engine onnxruntime")
        rows[v] = (ProgramGraphs(programs, dev, plans=plans),
                   f"torch {dev.type} (Q/DQ of the {ROW_FILES[v][0]}.onnx files emulated)")
    return rows


def accuracy_report(trained, out_dir, held_out_windows: int = 64, batch: int = 4, root=None,
                    split: Optional[str] = None, engine: str = "onnxruntime", device="cpu",
                    programs: Optional[Mapping] = None, parity_windows: int = 2,
                    log: Callable[[str], None] = print) -> dict:
    """IoU / mIoU (percent) per future step on `held_out_windows` windows (0: all) of the run's VAL
    split, evenly spread; see the module docstring for the rows. `programs` ({graph:
    ExportedProgram}, what export_graph returned) is needed by engine "torch". JSON-ready."""
    from wm.export.collect import Progress, batches, windows
    from wm.export.forecast import forecast
    from wm.metrics import ConfusionMatrix, copy_last

    out_dir = Path(out_dir)
    cfg = trained.cfg
    split = split or cfg.data.val_split
    for g, f in graph_files(out_dir).items():
        if not f.is_file():
            raise Int8Error(f"{f} does not exist; run the FP32 export first")
    for kind in (".int8", CPU_INT8):
        for g, f in graph_files(out_dir, kind).items():
            if not f.is_file():
                raise Int8Error(f"{f} does not exist; run the INT8 step (export.py --int8) first")
    if engine == "torch" and not programs:
        raise Int8Error("the torch engine needs the exported programs of this export (export.py passes them)")
    rows = _engines(trained, out_dir, engine, device, programs)
    variants = [v for v in VARIANTS if v in rows or v == "copy_last"]
    ds, idx, root = windows(trained, root, split, held_out_windows, "--eval-windows", log)
    P, S, C, free = cfg.data.past, cfg.data.future, cfg.data.num_classes, cfg.data.free_class
    given = cfg.train.forecast_motion == "given"
    per_window = {v: [] for v in variants}  # (S, C, C) counts of each window: the bootstrap resamples them
    agree = {v: [0, 0] for v in variants}
    secs = dict.fromkeys(rows, 0.0)
    parity = {"windows": 0}
    ort = {v: ort_row(out_dir, v) for v in ("onnx_fp32", "onnx_int8", "onnx_int8_ort")} \
        if engine == "torch" and parity_windows > 0 else {}
    par = {v: [0, 0] for v in ort}
    prog = Progress("report", len(idx), "windows", log)
    for b in batches(ds, idx, int(batch)):
        occ, motion = b["occ"], b["motion"]
        target = occ[:, P:]
        mask = b["mask"][:, P:] if "mask" in b else None
        args = (occ[:, :P], motion[:, :P], motion[:, P:] if given else None)
        preds = {}
        for v, (run, _) in rows.items():
            t0 = time.perf_counter()
            preds[v] = forecast(run, cfg, *args).cpu()
            secs[v] += time.perf_counter() - t0
        preds["copy_last"] = copy_last(occ[:, :P], S)
        ref = preds["pytorch_fp32"]
        for v in variants:
            p = preds[v]
            if tuple(p.shape) != tuple(target.shape):
                raise Int8Error(f"{v}: forecast shape {tuple(p.shape)}, expected {tuple(target.shape)}")
            for i in range(len(p)):
                cm = ConfusionMatrix(C, free, S)
                cm.update(p[i:i + 1], target[i:i + 1], None if mask is None else mask[i:i + 1])
                per_window[v].append(cm.counts)
            agree[v][0] += int((p == ref).sum())
            agree[v][1] += p.numel()
        n = min(len(occ), parity_windows - parity["windows"])
        if ort and n > 0:
            for v, run in ort.items():
                got = forecast(run, cfg, *(a[:n] if a is not None else None for a in args))
                par[v][0] += int((got == preds["pytorch_fp32" if v == "onnx_fp32" else v][:n]).sum())
                par[v][1] += got.numel()
            parity["windows"] += n
        prog.step(len(occ))
    out = {}
    per_window = {v: torch.stack(c) for v, c in per_window.items()}
    for v in variants:
        cm = ConfusionMatrix(C, free, S)
        cm.counts = per_window[v].sum(0)
        s = cm.summary()
        out[v] = {"iou": [_num(x) for x in s["iou"]], "miou": [_num(x) for x in s["miou"]],
                  "iou_avg": _num(s["iou_avg"]), "miou_avg": _num(s["miou_avg"]),
                  "agreement_vs_pytorch": agree[v][0] / max(agree[v][1], 1)}
        if v in rows:
            out[v]["engine"] = rows[v][1]
            out[v]["ms_per_window"] = round(1e3 * secs[v] / max(len(idx), 1), 2)
    ref = out["pytorch_fp32"]

    def drop(a, b):
        return None if a is None or b is None else float(a - b)

    for v in variants:
        r = out[v]
        r["drop_iou"] = [drop(a, b) for a, b in zip(ref["iou"], r["iou"])]
        r["drop_miou"] = [drop(a, b) for a, b in zip(ref["miou"], r["miou"])]
        r["drop_iou_avg"] = drop(ref["iou_avg"], r["iou_avg"])
        r["drop_miou_avg"] = drop(ref["miou_avg"], r["miou_avg"])
    for v, se in drop_se(per_window, free).items():
        out[v]["drop_iou_avg_se"], out[v]["drop_miou_avg_se"] = se
    if ort:  # onnxruntime on the files vs the torch rows, voxel by voxel
        parity["onnx_fp32_vs_pytorch_fp32"] = par["onnx_fp32"][0] / max(par["onnx_fp32"][1], 1)
        parity["onnx_int8_vs_emulated_int8"] = par["onnx_int8"][0] / max(par["onnx_int8"][1], 1)
        parity["onnx_int8_ort_vs_emulated_int8_ort"] = par["onnx_int8_ort"][0] / max(par["onnx_int8_ort"][1], 1)
    fp = trained.data_fingerprint
    res = {"split": split, "windows": int(len(idx)), "data_root": str(root), "future_steps": S,
           "data_fingerprint_matches_checkpoint": (ds.fingerprint == fp) if fp else None,
           "unit": "percent", "metric_mode": "exclude", "batch": int(batch), "engine": engine,
           "device": str(device), "cpu_threads": os.cpu_count(), "seconds": round(prog.seconds, 2),
           "models": out}
    if ort:
        res["parity"] = parity
    rate = ds.manifest.info.frame_rate_hz
    res["step_s"] = cfg.data.stride / rate if rate > 0 else None  # seconds per forecast step, for the table
    return res


def drop_se(per_window: Mapping[str, torch.Tensor], free: int, ref: str = "pytorch_fp32",
            resamples: int = 1000, seed: int = 0) -> dict[str, tuple[Optional[float], Optional[float]]]:
    """{row: (standard error of drop_iou_avg, of drop_miou_avg)} in points, by a paired bootstrap:
    the same resampled windows for the reference and the row, so what both get wrong alike cancels.
    per_window: {row: (W, S, C, C) confusion counts of each held-out window}."""
    from wm.metrics import binary_iou, miou

    counts = per_window[ref]
    w, s, c = counts.shape[0], counts.shape[1], counts.shape[-1]
    if w < 2:
        return {v: (None, None) for v in per_window}
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(w, (resamples, w), generator=g)
    weight = torch.zeros(resamples, w, dtype=torch.float64).scatter_add_(1, pick, torch.ones(resamples, w, dtype=torch.float64))

    def avgs(cnt):  # (W, S, C, C) -> two (resamples,) tensors: IoU and mIoU averaged over the steps
        boot = torch.einsum("bw,wx->bx", weight, cnt.reshape(w, -1).double()).reshape(resamples * s, c, c)
        return (binary_iou(boot, free).view(resamples, s).nanmean(1),
                miou(boot, free).view(resamples, s).nanmean(1))

    r_iou, r_miou = avgs(counts)
    out = {ref: (0.0, 0.0)}
    for v, cnt in per_window.items():
        if v == ref:
            continue
        v_iou, v_miou = avgs(cnt)
        out[v] = tuple(_num(float((a - b).std())) for a, b in ((r_iou, v_iou), (r_miou, v_miou)))
    return out


def format_report(d: Mapping) -> str:
    """The report as a printable table: IoU and mIoU per future step and averaged, the drops of the
    averages against PyTorch FP32, voxel agreement with it, and time per window."""
    S = d["future_steps"]

    def f(x, w=6, p=2):
        return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"

    def pm(r, k):  # "0.31 ± 0.12"; reports written before the standard errors: the drop alone
        se = r.get(f"drop_{k}_avg_se")
        return f(r[f"drop_{k}_avg"]) + (f" ± {se:4.2f}" if se is not None else " " * 7)

    steps = " ".join(f"{'t+' + str(s + 1):>6}" for s in range(S))
    head = (f"{'model':<14} IoU  {steps} {'avg':>6} | mIoU {steps} {'avg':>6} | "
            f"{'dIoU':>13} {'dmIoU':>13} | {'agree':>6} | {'ms/win':>8}")
    lines = [f"held-out: {d['windows']} windows of split {d['split']!r}, IoU/mIoU in percent per future step; "
             f"d = drop vs pytorch_fp32 (± its standard error over the windows); ms/win = time per window in the row's engine (engine {d['engine']})",
             head]
    if d.get("step_s"):  # each step's time after the last past frame (data.stride / frame rate)
        secs = " ".join(f"{round((s + 1) * d['step_s'], 6):>5g}s" for s in range(S))
        lines.append(f"{'(seconds)':<14}      {secs}        |      {secs}")
    lines.append("-" * len(head))
    for v, r in d["models"].items():
        iou = " ".join(f(x) for x in r["iou"])
        miou = " ".join(f(x) for x in r["miou"])
        ms = f"{r['ms_per_window']:8.1f}" if "ms_per_window" in r else f"{'-':>8}"
        lines.append(f"{v:<14}      {iou} {f(r['iou_avg'])} |      {miou} {f(r['miou_avg'])} | "
                     f"{pm(r, 'iou')} {pm(r, 'miou')} | {f(r['agreement_vs_pytorch'], 6, 4)} | {ms}")
    lines.append("computed by: " + "; ".join(f"{v} {r['engine']}" for v, r in d["models"].items() if "engine" in r))
    if "parity" in d:
        p = d["parity"]
        lines.append(f"parity on {p['windows']} windows (voxels equal): " +
                     ", ".join(f"{k} {v:.4f}" for k, v in p.items() if k != "windows"))
    return "\n".join(lines)
