"""The INT8 accuracy report: past occupancy -> future occupancy on held-out windows (the run's VAL
split), end to end through the deployed host loop (wm.export.deployed), for each precision.

Rows (IoU / mIoU in percent per future step, averaged; drops against PyTorch FP32):

- ``pytorch_fp32``: the PyTorch modules (on the GPU where the torch engine runs);
- ``onnx_fp32`` / ``onnx_fp16``: the ONNX graphs; ``onnx_int8``: TensorRT's Q/DQ files
  (``.int8.onnx``) as their ONNX semantics define them (float ops on dequantized values);
  ``onnx_int8_ort``: onnxruntime's copies (``.int8-ort.onnx``: the same values as uint8 with zero
  point 128, wm.export.qdq.cpu_copy) in onnxruntime's integer kernels, exact on every x86 CPU.
  Engine ``onnxruntime``: every row but pytorch_fp32 is its files in onnxruntime on the CPU
  (``onnx_int8`` with its Q/DQ fusion off, so that no CPU's integer kernel stands in for
  TensorRT's). Engine ``torch`` (the default where a GPU is present): FP16 is the modules under
  float16 autocast, and the INT8 rows are still the files' own results: each graph that holds
  quantized nodes runs as its ``.int8-ort.onnx`` file in onnxruntime on the CPU, and a graph that
  holds none (kept float by ``export.py --int8-float``, by default the tokenizer's) is the FP32
  graph, run by PyTorch FP32 on the GPU. Those rollouts go window by window to `workers` threads,
  each with its own onnxruntime sessions on its share of the cores (one session's many threads
  scale badly), while the GPU computes the other rows; the first rollout runs alone, and its
  measured peak sets how many run side by side within the host memory budget (`memory_gib`,
  wm.export.memory.MemoryGate). Where both INT8 files hold the same values (export.py
  writes them so), one rollout serves both rows: summing int8 products exactly, as TensorRT's
  int8 kernels do. ``parity`` runs the FP32 files in onnxruntime on the first `parity_windows`
  windows, after the report's windows, and gives their voxel agreement with PyTorch FP32;
- ``int8_tokenizer`` / ``int8_world`` (engine torch, and only where both parts hold quantized
  nodes): ``onnx_int8_ort`` for the tokenizer's two graphs alone or the world step alone, the other
  graphs FP32: which part an INT8 drop comes from, so that part can be kept float
  (``export.py --int8-float``) or in FP16;
- ``copy_last``: the last past frame repeated, the floor beside every number.

Each row also has its voxel agreement with PyTorch FP32 and its time per window in its engine, and
each drop, averaged and per future step, its standard error (``drop_iou_avg_se``, ``drop_miou_se``…):
a paired bootstrap over the held-out windows. The forecast is an argmax rollout, so a perturbation of
any kind (INT8, FP16, or only another FP32 kernel) flips near-tied tokens and the futures that
follow; the drop measured on 64 windows then moves by about this much from one run to the next,
with no change in the quantizer. For the same reason no two INT8 engines agree voxel for voxel: a
quantized network turns a last-bit difference of a float sum into a whole quantizer step, and the
steps that follow move with it, so an INT8 row is only ever the accuracy of the files that computed
it, and the report computes it from the files.

``parity`` also holds each graph's agreement on the same inputs (``graphs``: PyTorch FP32's own
inputs to each call handed to onnxruntime too, its integer codes or its decoded classes compared)
and scores the files' rollouts and PyTorch's on those windows alike (``accuracy``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from wm.export.quantizable import Int8Error

VARIANTS = ("pytorch_fp32", "onnx_fp32", "onnx_fp16", "onnx_int8", "onnx_int8_ort", "int8_tokenizer", "int8_world",
            "copy_last")
# the breakdown rows: the graphs each one runs as onnx_int8 (the others as pytorch_fp32)
INT8_PARTS = {"int8_tokenizer": ("tokenizer_encode", "tokenizer_decode"), "int8_world": ("world_step",)}
GRAPHS = ("tokenizer_encode", "world_step", "tokenizer_decode")
CPU_INT8 = ".int8-ort"  # onnxruntime's INT8 copies (wm.export.qdq.cpu_copy)
# row -> (file kind, onnxruntime runs its Q/DQ as float ops)
ROW_FILES = {"onnx_fp32": ("", False), "onnx_fp16": (".fp16", False), "onnx_int8": (".int8", True),
             "onnx_int8_ort": (CPU_INT8, False)}


def graph_files(out_dir: Path, kind: str = "") -> dict[str, Path]:
    """{graph: <out_dir>/<graph><kind>.onnx}, kind '' (FP32), '.fp16', '.int8' or CPU_INT8."""
    return {g: Path(out_dir) / f"{g}{kind}.onnx" for g in GRAPHS}


def ort_row(out_dir: Path, row: str, threads: int = 0):
    """A row's files in onnxruntime, run as the row defines them (ROW_FILES)."""
    from wm.export.deployed import OrtGraphs

    kind, qdq_in_float = ROW_FILES[row]
    return OrtGraphs(graph_files(out_dir, kind), threads, qdq_in_float=qdq_in_float)


def rollout_workers(cpus: Optional[int] = None) -> int:
    """The most onnxruntime sessions that roll out the INT8 files side by side (engine torch), each
    on its share of the cores: one per 4 cores (one session's 32 threads ran the occworld world step
    at less than half the rate of 8 sessions of 4), at most 3; fewer where the host memory budget
    holds fewer (MemoryGate: at the occworld size one rollout holds about 2 GiB)."""
    return max(1, min(3, (cpus or os.cpu_count() or 1) // 4))


class PerThread:
    """A RunGraph made anew, by `make()`, in each thread that calls it: onnxruntime sessions that
    run side by side, each on its own threads, where one session's many threads scale badly. Made
    anew too when `key()` changes (the sessions' thread count, once the memory gate has measured)."""

    def __init__(self, make: Callable[[], Callable], key: Callable[[], object] = lambda: None):
        self.make, self.key, self.local = make, key, threading.local()

    def __call__(self, name: str, *inputs: torch.Tensor) -> tuple:
        key = self.key()
        if getattr(self.local, "key", None) != key or getattr(self.local, "run", None) is None:
            self.local.run, self.local.key = None, key  # the old sessions go before the new ones are made
            self.local.run = self.make()
        return self.local.run(name, *inputs)


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


class Mixed:
    """A RunGraph that runs the graphs named in `these` on `run` and every other graph on `rest`,
    with every output on `device` where one is given (onnxruntime's come back on the CPU), but the
    world step's key/value cache rows: the host loop hands them back to the engine that made them,
    and an occworld cache is 0.6 GB a window (a copy to the GPU and back at every step)."""

    def __init__(self, run: Callable, rest: Callable, these, device=None):
        self.run, self.rest, self.these, self.device = run, rest, frozenset(these), device

    def __call__(self, name: str, *inputs: torch.Tensor) -> tuple:
        out = (self.run if name in self.these else self.rest)(name, *inputs)
        if self.device is None:
            return out
        stay = len(out) - 1 if name == "world_step" else len(out)
        return tuple(x.to(self.device) if i < stay else x for i, x in enumerate(out))


class GraphParity:
    """A RunGraph that runs `main` and hands the very same inputs to `other`: it returns main's
    outputs (so the rollout is main's) and counts, per graph, the output elements both agree on:
    integer outputs (codes) as they are, float ones of tokenizer_decode (class logits) by their argmax
    over the classes; the world step's float motion is left out (it is no class)."""

    def __init__(self, main: Callable, other: Callable):
        self.main, self.other = main, other
        self.counts: dict[str, list[int]] = {g: [0, 0] for g in GRAPHS}

    def __call__(self, name: str, *inputs: torch.Tensor) -> tuple:
        a = self.main(name, *inputs)
        b = self.other(name, *inputs)
        for x, y in zip(a, b):
            if x.is_floating_point():
                if name != "tokenizer_decode":
                    continue
                x, y = x.argmax(1), y.argmax(1)  # before any copy: the logits of 8 occworld frames are 368 MB
            x, y = x.cpu(), y.cpu()
            self.counts[name][0] += int((x == y.to(x.dtype)).sum())
            self.counts[name][1] += x.numel()
        return a

    def agreement(self) -> dict[str, Optional[float]]:
        return {g: (n / t if t else None) for g, (n, t) in self.counts.items()}


def _rollout(run: Callable, cfg, args) -> tuple[torch.Tensor, float]:
    """One batch's forecast by `run`, moved to the CPU, and its seconds."""
    from wm.export.deployed import forecast

    t0 = time.perf_counter()
    return forecast(run, cfg, *args).cpu(), time.perf_counter() - t0


SIDE = "<side>"  # in a row's description: how many sessions ran side by side, filled in at the end


def this_cpu() -> tuple[str, list[str]]:
    """This CPU's model name and which of the instruction sets that pick onnxruntime's kernels it
    has: its float kernels differ by that class in the last bits, so an INT8 row names it."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name, sorted(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags)


def _session_threads(side_by_side: int) -> int:
    """onnxruntime threads of each of `side_by_side` sessions: the cores shared out (0, one session:
    onnxruntime's own choice, every core)."""
    return max(1, (os.cpu_count() or 1) // side_by_side) if side_by_side > 1 else 0


def _engines(trained, out_dir: Path, engine: str, device, gate=None) -> dict[str, tuple[Callable, str]]:
    """{row: (run_graph, what runs it)} for the rows this engine computes; with engine torch the
    INT8 files' rollouts are PerThread, as many side by side as `gate` (a MemoryGate) lets run, each
    session on cores / that many threads."""
    from wm.export.deployed import TorchGraphs
    from wm.export.onnx import graphs
    from wm.export.qdq import same_values
    from wm.export.quantizable import _load

    files = {row: graph_files(out_dir, kind) for row, (kind, _) in ROW_FILES.items()}
    dev = torch.device(device)
    fp32 = TorchGraphs(graphs(trained), dev)
    rows = {"pytorch_fp32": (fp32, f"torch {dev.type}")}
    if engine == "onnxruntime":
        what = {"onnx_int8": "onnxruntime cpu, Q/DQ as float ops (the file's ONNX semantics, as TensorRT)",
                "onnx_int8_ort": "onnxruntime cpu int8 kernels"}
        for v, f in files.items():
            if all(p.is_file() for p in f.values()):
                rows[v] = (ort_row(out_dir, v), what.get(v, "onnxruntime cpu"))
        return rows
    if all(p.is_file() for p in files["onnx_fp16"].values()):
        rows["onnx_fp16"] = (TorchGraphs(graphs(trained), dev, fp16=True), f"torch {dev.type} float16 autocast")
    # INT8: every graph that holds quantized nodes is its file in onnxruntime (the file's own integer
    # results); a graph kept wholly float is the FP32 graph, so PyTorch FP32 runs it on the GPU
    models = {v: {g: _load(p) for g, p in files[v].items()} for v in ("onnx_int8", "onnx_int8_ort")}  # read once

    def is_quantized(m) -> bool:  # a graph kept wholly float by --int8-float holds no Q/DQ node
        return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in m.graph.node)

    quantized = [g for g in GRAPHS if is_quantized(models["onnx_int8_ort"][g])]
    rest = [g for g in GRAPHS if g not in quantized]
    where = (f"; {', '.join(rest)} (no quantized node) torch {dev.type} FP32" if rest else "")
    side = SIDE if gate is not None and gate.most > 1 else ""

    def threads() -> int:
        return _session_threads(gate.allowed if gate is not None else 1)

    def files_of(row, these):  # each thread its own sessions of the row's files, PyTorch FP32 for the rest
        return PerThread(lambda: Mixed(ort_row(out_dir, row, threads()), fp32, these, dev), key=threads)

    rows["onnx_int8_ort"] = (files_of("onnx_int8_ort", quantized),
                             f"onnxruntime cpu int8 kernels{side} on the {CPU_INT8}.onnx files of "
                             f"{', '.join(quantized)}{where}")
    if all(same_values(models["onnx_int8"][g], models["onnx_int8_ort"][g]) for g in GRAPHS):
        # the copy holds TensorRT's values (uint8, zero point 128): its rollout serves both rows, in
        # integer arithmetic as TensorRT's int8 kernels do it
        rows["onnx_int8"] = (rows["onnx_int8_ort"][0], f"the onnx_int8_ort rollout (its {CPU_INT8}.onnx files hold "
                                                       "these files' values)")
    else:
        q8 = [g for g in GRAPHS if is_quantized(models["onnx_int8"][g])]
        rows["onnx_int8"] = (files_of("onnx_int8", q8),
                             f"onnxruntime cpu, Q/DQ as float ops{side}, on the .int8.onnx files of {', '.join(q8)}; "
                             f"the rest torch {dev.type} FP32")
    for v, these in INT8_PARTS.items():
        if not set(quantized) & set(these) or not set(quantized) - set(these):
            continue  # every quantized node in one part: the row would repeat pytorch_fp32 or onnx_int8_ort
        rows[v] = (Mixed(rows["onnx_int8_ort"][0], fp32, these, dev),
                   f"{', '.join(these)} as onnx_int8_ort, the rest as pytorch_fp32")
    return rows


def accuracy_report(trained, out_dir, held_out_windows: int = 64, batch: int = 4, root=None,
                    split: Optional[str] = None, engine: str = "onnxruntime", device="cpu",
                    parity_windows: int = 2, log: Callable[[str], None] = print,
                    rows: Optional[Sequence[str]] = None, workers: int = 0, memory_gib: float = 8.0) -> dict:
    """IoU / mIoU (percent) per future step on `held_out_windows` windows (0: all) of the run's VAL
    split, evenly spread; see the module docstring for the rows. `rows`: only these
    rows besides pytorch_fp32 and copy_last (default: every row the engine has files for). `workers`:
    with engine torch, the most INT8 rollouts side by side (0: rollout_workers()), as many as fit
    beside the process in `memory_gib` of host memory once the first has been measured. JSON-ready."""
    from wm.export.collect import Progress, batches, windows
    from wm.export.deployed import TorchGraphs, forecast
    from wm.export.memory import MemoryGate
    from wm.evaluation.metrics import ConfusionMatrix, copy_last

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
    only = rows
    workers = max(1, int(workers or rollout_workers()))

    def measured(g) -> None:
        if g.allowed < g.most:
            log(f"report: one INT8 rollout held {g.job_gib:.1f} GiB beside the process's {g.base_gib:.1f} GiB: "
                f"{g.allowed} side by side (not {g.most}) to stay within {g.budget_gib:g} GiB of host memory")

    gate = MemoryGate(workers, memory_gib, measured) if engine == "torch" else None
    rows = _engines(trained, out_dir, engine, device, gate)
    if only is not None:
        bad = sorted(set(only) - set(rows) - {"pytorch_fp32"})
        if bad:
            raise Int8Error(f"no row {', '.join(bad)} with engine {engine} here; rows are "
                            f"{', '.join(v for v in rows if v != 'pytorch_fp32')}")
        rows = {v: r for v, r in rows.items() if v == "pytorch_fp32" or v in only}
    variants = [v for v in VARIANTS if v in rows or v == "copy_last"]
    ds, idx, root = windows(trained, root, split, held_out_windows, "--eval-windows", log)
    P, S, C, free = cfg.data.past, cfg.data.future, cfg.data.num_classes, cfg.data.free_class
    given = cfg.train.forecast_motion == "given"
    per_window = {v: [] for v in variants}  # (S, C, C) counts of each window: the bootstrap resamples them
    agree = {v: [0, 0] for v in variants}
    secs = dict.fromkeys(rows, 0.0)
    parity = {"windows": 0}
    # the torch row each onnxruntime row is held against (the INT8 rows are the files' own already)
    par_src = {"onnx_fp32": "pytorch_fp32"}
    ort = {v: ort_row(out_dir, v) for v, src in par_src.items() if src in rows} \
        if engine == "torch" and parity_windows > 0 else {}
    par = {v: [0, 0] for v in ort}
    tees = {v: GraphParity(rows[par_src[v]][0], run) for v, run in ort.items()}
    kept = []  # the first parity_windows windows: inputs, the torch rows' forecasts, targets and masks
    prog = Progress("report", len(idx), "windows", log)
    # with a GPU the INT8 rollouts (onnxruntime on the CPU) run window by window in `workers` threads,
    # while the GPU computes the other rows of the next batches; batches are scored in order
    pool = ThreadPoolExecutor(workers) if gate is not None else None
    runs = {id(run): run for run, _ in rows.values()}  # rows that share one engine share its rollout
    cpu_side = {k for k, r in runs.items() if pool and not isinstance(r, TorchGraphs)}
    pending: deque = deque()
    ahead = 1 + -(-2 * workers // max(int(batch), 1))  # batches in flight: enough windows for every worker

    def score(occ, target, mask, args, done, later):
        for k, fs in later.items():
            got = [f.result() for f in fs]
            done[k] = (torch.cat([g[0] for g in got]), sum(g[1] for g in got))
        preds = {}
        for v, (run, _) in rows.items():
            preds[v] = done[id(run)][0]
            secs[v] += done[id(run)][1]
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
        if ort and n > 0:  # kept for the parity phase, apart: its CPU minutes would make this ETA no guide
            kept.append(([a[:n].clone() if a is not None else None for a in args],
                         {v: preds[par_src[v]][:n].clone() for v in ort}, target[:n].clone(),
                         None if mask is None else mask[:n].clone()))
            parity["windows"] += n
        prog.step(len(occ))

    try:
        for b in batches(ds, idx, int(batch)):
            occ, motion = b["occ"], b["motion"]
            args = (occ[:, :P], motion[:, :P], motion[:, P:] if given else None)
            one = [[a[i:i + 1] if a is not None else None for a in args] for i in range(len(occ))]
            later = {k: [pool.submit(gate.run, _rollout, runs[k], cfg, w) for w in one] for k in cpu_side}
            done = {k: _rollout(r, cfg, args) for k, r in runs.items() if k not in later}
            pending.append((occ, occ[:, P:], b["mask"][:, P:] if "mask" in b else None, args, done, later))
            while len(pending) > ahead:
                score(*pending.popleft())
        while pending:
            score(*pending.popleft())
    finally:
        if pool:  # a failed batch leaves no rollout running
            pool.shutdown(cancel_futures=True)
    report_s = prog.seconds
    if kept:
        log(f"parity: onnxruntime runs the files of {', '.join(ort)} on the CPU ({os.cpu_count()} CPU threads) on the "
            f"first {parity['windows']} windows, as rollouts and graph by graph")
        pp = Progress("parity", len(ort) * parity["windows"], "windows x files", log)
        # a flipped near-tie moves voxels, not the accuracy: the files' rollouts are scored too
        scored = {v: ConfusionMatrix(C, free, S) for v in ort}
        for first, torch_preds, tgt, msk in kept:
            for v, run in ort.items():
                got = forecast(run, cfg, *first)
                par[v][0] += int((got == torch_preds[v]).sum())
                par[v][1] += got.numel()
                scored[v].update(got, tgt, msk)
                forecast(tees[v], cfg, *first)  # the torch row's rollout, each call also in onnxruntime
                pp.step(len(got))
        parity["seconds"] = round(pp.seconds, 2)
    out = {}
    side = ""
    if gate is not None and gate.most > 1:
        n, t = gate.allowed, _session_threads(gate.allowed)
        side = (f" ({n} sessions side by side, {t} thread{'s' * (t > 1)} each)" if n > 1 else
                " (one session at a time: the host memory budget held no second)")
    per_window = {v: torch.stack(c) for v, c in per_window.items()}
    for v in variants:
        cm = ConfusionMatrix(C, free, S)
        cm.counts = per_window[v].sum(0)
        s = cm.summary()
        out[v] = {"iou": [_num(x) for x in s["iou"]], "miou": [_num(x) for x in s["miou"]],
                  "iou_avg": _num(s["iou_avg"]), "miou_avg": _num(s["miou_avg"]),
                  "agreement_vs_pytorch": agree[v][0] / max(agree[v][1], 1)}
        if v in rows:
            out[v]["engine"] = rows[v][1].replace(SIDE, side)
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
        out[v].update(se)
    if ort:  # onnxruntime on the files vs the torch rows, voxel by voxel
        names = {"onnx_fp32": "onnx_fp32_vs_pytorch_fp32"}
        for v in ort:
            parity[names[v]] = par[v][0] / max(par[v][1], 1)
        parity["graphs"] = {names[v]: t.agreement() for v, t in tees.items()}
        parity["accuracy"] = {}
        for v, cm in scored.items():
            row = ConfusionMatrix(C, free, S)  # the torch row on the same windows: the report's first ones
            row.counts = per_window[par_src[v]][:parity["windows"]].sum(0)
            f, t = cm.summary(), row.summary()
            parity["accuracy"][names[v]] = {"file_iou_avg": _num(f["iou_avg"]), "file_miou_avg": _num(f["miou_avg"]),
                                           "torch_iou_avg": _num(t["iou_avg"]), "torch_miou_avg": _num(t["miou_avg"])}
    fp = trained.data_fingerprint
    res = {"split": split, "windows": int(len(idx)), "data_root": str(root), "future_steps": S,
           "data_fingerprint_matches_checkpoint": (ds.fingerprint == fp) if fp else None,
           "unit": "percent", "metric_mode": "exclude", "batch": int(batch), "engine": engine,
           "device": str(device), "cpu_threads": os.cpu_count(), "cpu": dict(zip(("name", "flags"), this_cpu())),
           "seconds": round(report_s, 2),
           "models": out}
    if ort:
        res["parity"] = parity
    if gate is not None:  # how the INT8 rollouts shared the host's memory
        res["int8_sessions"] = {"side_by_side": gate.allowed, "most": gate.most, "budget_gib": gate.budget_gib,
                                "one_rollout_gib": None if gate.job_gib is None else round(gate.job_gib, 2),
                                "process_gib": None if gate.base_gib is None else round(gate.base_gib, 2)}
    rate = ds.manifest.info.frame_rate_hz
    res["step_s"] = cfg.data.stride / rate if rate > 0 else None  # seconds per forecast step, for the table
    return res


def drop_se(per_window: Mapping[str, torch.Tensor], free: int, ref: str = "pytorch_fp32",
            resamples: int = 1000, seed: int = 0) -> dict[str, dict]:
    """{row: {"drop_iou_avg_se", "drop_miou_avg_se": standard error of the averaged drop,
    "drop_iou_se", "drop_miou_se": [one per future step]}} in points (None with fewer than two
    windows), by a paired bootstrap (wm.evaluation.metrics.paired_bootstrap): the same resampled windows for
    the reference and the row, so what both get wrong alike cancels. per_window: {row: (W, S, C, C)
    confusion counts of each held-out window}."""
    from wm.evaluation.metrics import paired_bootstrap

    out = {}
    for v, cnt in per_window.items():
        d = paired_bootstrap(cnt, per_window[ref], free, resamples=resamples, seed=seed)  # ref - row
        if d is None:
            s = cnt.shape[1]
            out[v] = {"drop_iou_avg_se": None, "drop_miou_avg_se": None, "drop_iou_se": [None] * s,
                      "drop_miou_se": [None] * s}
            continue
        out[v] = {"drop_iou_avg_se": _num(float(d["iou_avg"].std())),
                  "drop_miou_avg_se": _num(float(d["miou_avg"].std())),
                  "drop_iou_se": [_num(float(x)) for x in d["iou"].std(0)],
                  "drop_miou_se": [_num(float(x)) for x in d["miou"].std(0)]}
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
    cpu = d.get("cpu") or {"name": "?", "flags": []}
    lines.append(f"computed by (cpu: {cpu['name']}, {', '.join(cpu['flags']) or 'no AVX2'}): "
                 + "; ".join(f"{v} {r['engine']}" for v, r in d["models"].items() if "engine" in r))
    per_step = [(v, r) for v, r in d["models"].items() if v not in ("pytorch_fp32", "copy_last") and "drop_miou_se" in r]
    if per_step:  # the drops of every step with their errors: a target holds at each step, not on average
        lines.append("drop per future step vs pytorch_fp32, IoU / mIoU (± standard error):")
        for v, r in per_step:
            cells = [f"t+{s + 1} {f(r['drop_iou'][s], 5)}±{f(r['drop_iou_se'][s], 4)} / "
                     f"{f(r['drop_miou'][s], 5)}±{f(r['drop_miou_se'][s], 4)}" for s in range(S)]
            lines.append(f"  {v:<14} " + "  ".join(cells))
    if "parity" in d:
        p = d["parity"]
        lines.append(f"parity on {p['windows']} windows (voxels equal): " +
                     ", ".join(f"{k} {v:.4f}" for k, v in p.items() if k not in ("windows", "seconds", "graphs", "accuracy")))
        for k, g in p.get("graphs", {}).items():
            lines.append(f"  each graph on the same inputs, {k}: " +
                         ", ".join(f"{n} {f(x, 6, 4)}" for n, x in g.items()))
        for k, a in p.get("accuracy", {}).items():
            lines.append(f"  IoU / mIoU on these windows, the file in onnxruntime | its torch row, {k}: "
                         f"{f(a['file_iou_avg'])} / {f(a['file_miou_avg'])} | {f(a['torch_iou_avg'])} / "
                         f"{f(a['torch_miou_avg'])}")
    return "\n".join(lines)
