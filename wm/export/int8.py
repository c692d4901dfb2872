"""INT8 deployment: our own entropy calibration -> Q/DQ ONNX + TensorRT calibration cache, and the
accuracy report (docs/ARCHITECTURE.md). The steps live in their own modules; this one runs them.

TensorRT 11 removed implicit INT8 calibration and 10.x deprecated it, so the thresholds are computed
here (``wm.export.calib``: pytorch-quantization's ``_compute_amax_entropy``, the public reference of
TensorRT's EntropyCalibrator2) and handed to TensorRT in the graph itself:

1. ``wm.export.collect``: real windows of the run's TRAINING split, evenly spread across its scenes,
   streamed through the three graphs; the 2048-bin |x| histogram of every float tensor that feeds a
   Conv/ConvTranspose/MatMul/Gemm that will be quantized (``wm.export.quantizable``: not an output
   head, not a product of two activations) as a data input. By default the exported programs run node by
   node in PyTorch (on the GPU where there is one), so memory stays one forward pass; onnxruntime
   is the fallback (``engine="onnxruntime"``).
2. Entropy thresholds (amax) -> scale = amax / 127, zero point 0; except where the range is the
   data's, not a learned activation's (``exact_range_tensors``: rows of the class-embedding and
   codebook tables, the ego-motion inputs), which take their exact max: the entropy search, built
   for continuous activations, clips whole table rows and the informative motion tails.
3. ``wm.export.qdq.quantize_qdq``: the Q/DQ ONNX (onnxruntime's quantizer with our scales as
   overrides), checked scale by scale.
4. :func:`int8_export` writes ``<name>.int8.onnx`` (TensorRT's: int8 weights per channel over the
   full range), ``<name>.int8-ort.onnx`` (onnxruntime's copy, ``wm.export.qdq.cpu_copy``: the same
   values as uint8 with zero point 128, which onnxruntime's CPU integer kernels compute exactly on
   every x86 CPU),
   ``<name>.calib.cache`` (TensorRT's text format, same scales, ONNX tensor names) and
   ``<name>.calib.json`` (per-tensor amax/max/scale/rule).
5. ``wm.export.int8_report``: IoU/mIoU per future step on held-out windows (the run's VAL split) end to
   end through the host loop, for PyTorch FP32, FP16, INT8 and copy-last.

:func:`run_int8` is the single entry point ``export.py --int8`` calls: every step, ``report.json``
and the printed table.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from wm.export.calib import threshold_job, trt_version_number, write_cache
from wm.export.collect import TappedOrt, collect, windows
from wm.export.int8_report import CPU_INT8, GRAPHS as GRAPH_NAMES, accuracy_report, format_report, graph_files  # noqa: F401
from wm.export.qdq import cpu_copy, qdq_scales, quantize_qdq  # noqa: F401
from wm.export.quantizable import (FLOAT_OP_TYPES, HEAD_SCOPES, QUANT_OP_TYPES, Int8Error, _load, _scope,
    activation_products, exact_range_tensors, output_heads, pose_path, quantizable_inputs)
from wm.utils.atomic import write_bytes


__all__ = ["FLOAT_OP_TYPES", "HEAD_SCOPES", "QUANT_OP_TYPES", "GRAPH_NAMES", "Int8Error", "quantizable_inputs",
           "exact_range_tensors", "output_heads", "activation_products", "pose_path", "quantize_qdq", "qdq_scales", "int8_export",
           "accuracy_report", "format_report", "check_windows", "pick_engine", "run_int8"]


def _write_json(path: Path, obj) -> None:
    write_bytes(path, json.dumps(obj, indent=1, allow_nan=False))


# ---------------------------------------------------------------------------------------------
# thresholds


def _summary(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0}
    v = np.asarray(values, np.float64)
    return {"n": int(v.size), "min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}


def _thresholds(hists: Mapping[str, tuple[np.ndarray, np.ndarray]], method: str, workers: int = 0,
                log: Callable[[str], None] = print) -> dict[str, float]:
    """{tensor: amax} by `method` for every histogram. The entropy search costs ~0.1 s per 2048-bin
    histogram, so many tensors are spread over worker processes: fresh interpreters that import only
    wm.export.calib (numpy only: a worker starts in well under a second), never a fork of a process
    holding onnxruntime/torch threads, never a re-import of the caller's main script. Same function
    on the same arrays: the same numbers as the serial loop, which is also the fallback if a worker
    fails (said in one line, with the worker's last line of stderr)."""
    names = list(hists)
    jobs = [(np.asarray(hists[t][0]), np.asarray(hists[t][1]), method) for t in names]
    workers = int(workers) if workers else min(os.cpu_count() or 1, 16)
    workers = max(1, min(workers, len(jobs) // 8))
    if workers > 1:
        try:
            return dict(zip(names, _in_workers(jobs, workers)))
        except (OSError, RuntimeError, EOFError, ValueError, TypeError) as e:
            # below: the same computation here, where a real error shows with its message
            log(f"note: threshold workers failed ({str(e)[:200]}); computing the thresholds in this process")
    return {t: threshold_job(j) for t, j in zip(names, jobs)}


def _in_workers(jobs: list, workers: int) -> list[float]:
    import pickle
    import subprocess
    import sys

    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    chunks = [list(range(w, len(jobs), workers)) for w in range(workers)]
    code = "from wm.export.calib import worker_main; worker_main()"
    procs = []
    try:
        for idx in chunks:
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env, cwd=pkg_root)
            procs.append(p)
            p.stdin.write(pickle.dumps([jobs[i] for i in idx], protocol=pickle.HIGHEST_PROTOCOL))
            p.stdin.close()
        out: list = [None] * len(jobs)
        for p, idx in zip(procs, chunks):
            data = p.stdout.read()
            err = p.stderr.read().decode(errors="replace").strip().splitlines()
            if p.wait() != 0:
                raise RuntimeError(f"threshold worker exited with {p.returncode}: {err[-1] if err else ''}")
            vals = pickle.loads(data)
            if len(vals) != len(idx):
                raise RuntimeError("threshold worker returned a wrong count")
            for i, v in zip(idx, vals):
                out[i] = float(v)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def pick_engine(engine: str = "auto", phase: str = "report") -> tuple[str, str]:
    """(engine, device) for `phase` ("calibration" or "report").

    "auto": calibration always runs on the torch engine (the exported programs, node by node), on
    CUDA where a GPU is present, else on the CPU: it streams, so each activation is freed after its
    last use and the histograms see it on the way. onnxruntime can only show a tensor by making it
    a graph output, which keeps every tapped tensor of a window alive at once (17.3 GiB at the
    occworld size for 357 world_step tensors). The report runs on the torch engine on a GPU and on
    onnxruntime, the files themselves, on a CPU-only host. "torch" asked for without a GPU runs on
    the CPU; "onnxruntime" runs both phases there."""
    import torch

    if engine not in ("auto", "torch", "onnxruntime"):
        raise Int8Error(f"unknown engine {engine!r} (auto, torch, onnxruntime)")
    if phase not in ("calibration", "report"):
        raise ValueError(f"unknown phase {phase!r}")
    cuda = torch.cuda.is_available()
    if engine == "auto":
        engine = "torch" if cuda or phase == "calibration" else "onnxruntime"
    return engine, ("cuda" if engine == "torch" and cuda else "cpu")


def int8_export(trained, out_dir, calib_windows: int = 128, batch: int = 2, trt_version: str = "10.3.0",
                root=None, split: Optional[str] = None, method: str = "entropy",
                exclude_scopes: Optional[str] = None, products: bool = False, pose: bool = False,
                workers: int = 0,
                engine: str = "auto",
                programs: Optional[Mapping] = None, log: Callable[[str], None] = print,
                mark: Optional[Callable[[str], object]] = None,
                first_window: Optional[Callable[[int, float], None]] = None) -> dict:
    """For each graph `<name>.onnx` in `out_dir` (written by the FP32 export): collect histograms on
    `calib_windows` training windows (engine: see :func:`pick_engine`; "torch" needs `programs`,
    the exported programs export_graph returned), pick the thresholds (`method`: "entropy" =
    TensorRT's EntropyCalibrator2; "percentile" 99.99; "max"), write `<name>.int8.onnx` (Q/DQ,
    TensorRT's), `<name>.int8-ort.onnx` (onnxruntime's copy, qdq.cpu_copy), `<name>.calib.cache` (TensorRT `TRT-<ver>-EntropyCalibration2` text) and `<name>.calib.json`
    (amax, exact max and scale per tensor). Tensors whose range is the data's
    (exact_range_tensors: table lookups, the ego-motion inputs) take their exact max whatever the
    method. Returns a JSON-ready dict of what was written, with the seconds of each phase.

    `exclude_scopes`: a regex on module paths (e.g. r"\\.temporal\\.") whose Conv/MatMul nodes stay
    float as well. `products`: quantize the products of two activations (attention) too; by default
    they stay float (quantizable.activation_products). `pose`: quantize the world model's pose-token
    path too (quantizable.pose_path; float by default). `workers`: processes for the threshold search
    (0: one per CPU, at most 16).
    `mark(phase)` is called at the end of each phase (export.py's per-phase memory peaks);
    `first_window(windows, seconds per window)` once the first calibration batch has run."""
    out_dir = Path(out_dir)
    mark = mark or (lambda phase: None)
    if method not in ("entropy", "percentile", "max"):
        raise Int8Error(f"unknown calibration method {method!r} (entropy, percentile, max)")
    try:
        version = trt_version_number(trt_version)
    except ValueError as e:
        raise Int8Error(str(e)) from None
    for g in GRAPH_NAMES:
        if not (out_dir / f"{g}.onnx").is_file():
            raise Int8Error(f"{out_dir / (g + '.onnx')} does not exist; the INT8 step quantizes the FP32 "
                            "export (python export.py writes it first)")
    engine, device = pick_engine(engine, "calibration")
    cfg = trained.cfg
    split = split or cfg.data.train_split
    t0 = time.perf_counter()
    models = {g: _load(out_dir / f"{g}.onnx") for g in GRAPH_NAMES}
    kept = kept_float(models, exclude_scopes)  # before the calibration's minutes: a wrong pattern is one line
    tensors = {g: quantizable_inputs(m) for g, m in models.items()}
    floats = {g: {*output_heads(m), *kept[g], *(() if products else activation_products(m)),
                  *(() if pose else pose_path(m))} for g, m in models.items()}
    # only the inputs of nodes that will be quantized are calibrated
    wanted = {g: [t for t, users in tensors[g].items() if any(u not in floats[g] for u in users)] for g in GRAPH_NAMES}
    ds, idx, _ = windows(trained, root, split, calib_windows, "--calib-windows", log)
    if engine == "torch":
        from wm.export.deployed import ProgramGraphs

        if not programs:
            raise Int8Error("the torch calibration engine needs the exported programs of this export; "
                            "run it through export.py, or use engine='onnxruntime'")
        pg = ProgramGraphs(programs, device)
        miss = {g: [t for t in names if t not in pg.node_names(g)] for g, names in wanted.items()}
        miss = {g: m for g, m in miss.items() if m}
        if miss:
            g, m = next(iter(miss.items()))
            log(f"note: {g}: {len(m)} tensors (e.g. {m[0]!r}) are no node of the exported program; "
                "calibrating on onnxruntime instead")
            engine, device = "onnxruntime", "cpu"
    log(f"calibration: {len(idx)} windows of split {split!r}, batches of {batch}, engine {engine} ({device})")
    if engine == "torch":
        def make(taps):
            pg.taps = taps
            return pg
    else:
        def make(taps):
            return TappedOrt({g: out_dir / f"{g}.onnx" for g in GRAPH_NAMES}, wanted, taps)
    t1 = time.perf_counter()
    cols = collect(make, wanted, cfg, ds, idx, int(batch), log,
                   first=(lambda sec: first_window(len(idx), sec)) if first_window else None)
    t_hist = time.perf_counter() - t1
    mark("int8_histograms")
    res = {"calibration": {"split": split, "windows": int(len(idx)), "batch": int(batch), "method": method,
                           "engine": engine, "device": device,
                           "algorithm": "TensorRT EntropyCalibrator2 (pytorch-quantization _compute_amax_entropy)"
                           if method == "entropy" else method,
                           "trt_version": str(trt_version), "cache_header": f"TRT-{version}-EntropyCalibration2",
                           "kept_float": exclude_scopes or None,
                           "activation_products": "int8" if products else "float",
                           "pose_path": "int8" if pose else "float"},
           "graphs": {}, "seconds": {"histograms": round(t_hist, 2)}}
    t_thr = t_qdq = 0.0
    for g in GRAPH_NAMES:
        t2 = time.perf_counter()
        col, model, tens = cols[g], models[g], tensors[g]
        hists = col.histograms()
        todo = {t: hists[t] for t in wanted[g] if t in hists}  # absent: zero in every batch, stays float
        exact = {t: why for t, why in exact_range_tensors(model, tens).items() if t in todo}
        if method == "max":
            thresholds = {t: col.amax(t) for t in todo}
        else:
            thresholds = _thresholds({t: h for t, h in todo.items() if t not in exact}, method, workers, log)
            thresholds.update({t: col.amax(t) for t in exact})
        t3 = time.perf_counter()
        mark("int8_thresholds")
        info = quantize_qdq(out_dir / f"{g}.onnx", out_dir / f"{g}.int8.onnx", thresholds, nodes_to_exclude=kept[g],
                            exclude_products=not products, exclude_pose=not pose)
        converted = cpu_copy(out_dir / f"{g}.int8.onnx", out_dir / f"{g}{CPU_INT8}.onnx")
        scales = info["scales"]
        cache = out_dir / f"{g}.calib.cache"
        write_cache(cache, {t: scales[t] for t in tens if t in scales}, version)
        detail = {t: {"amax": thresholds[t], "max": col.amax(t), "scale": scales[t],
                      "rule": f"max ({exact[t]})" if t in exact else method}
                  for t in tens if t in scales}
        _write_json(out_dir / f"{g}.calib.json", {"method": method, "trt_version": str(trt_version),
                                                  "tensors": detail})
        t4 = time.perf_counter()
        mark("int8_qdq")
        t_thr += t3 - t2
        t_qdq += t4 - t3
        clipped = [thresholds[t] / col.amax(t) for t in scales if col.amax(t) > 0]
        res["graphs"][g] = {
            "file": f"{g}.int8.onnx", "bytes": (out_dir / f"{g}.int8.onnx").stat().st_size,
            "onnxruntime_file": f"{g}{CPU_INT8}.onnx", "onnxruntime_zero_point": 128,
            "onnxruntime_weights_uint8": converted,
            "cache": cache.name, "thresholds_file": f"{g}.calib.json",
            "tensors_collected": len(col.names()), "tensors_quantized": len(scales),
            "exact_range_at_max": {t: exact[t] for t in scales if t in exact},
            "zero_tensors": col.zero_tensors(),
            "nodes_quantized": len(info["quantized_nodes"]), "weights_quantized": info["weights"],
            "nodes_float": info["float_nodes"],
            "amax": _summary([thresholds[t] for t in scales]),
            "amax_over_max": _summary(clipped),
            "seconds": {"thresholds": round(t3 - t2, 2), "qdq": round(t4 - t3, 2)},
        }
        log(f"{g + '.int8':<22}{len(scales):4d} activations, {info['weights']:3d} weights int8, "
            f"{len(info['float_nodes'])} heads/nodes float (as uint8 in {g}{CPU_INT8}.onnx)   "
            f"cache {cache.name}   "
            f"thresholds {t3 - t2:5.1f} s, Q/DQ {t4 - t3:5.1f} s")
    res["seconds"].update({"thresholds": round(t_thr, 2), "qdq": round(t_qdq, 2),
                           "total": round(time.perf_counter() - t0, 2)})
    return res


def check_windows(trained, calib_windows: int, eval_windows: int, root=None, split: Optional[str] = None,
                  log: Callable[[str], None] = print) -> tuple[int, int]:
    """The calibration and evaluation windows that will be used (a count larger than its split uses
    every window of it, said in one line), checked before anything long runs: a missing split or
    data that does not fit the run is one line (DataError/Int8Error)."""
    cfg = trained.cfg
    _, ci, _ = windows(trained, root, split or cfg.data.train_split, calib_windows, "--calib-windows", log)
    _, ei, _ = windows(trained, root, cfg.data.val_split, eval_windows, "--eval-windows", log)
    return len(ci), len(ei)


def time_estimate(calib: int, evals: int, rows: int, sec: float, budget_s: float = 0.0, parity: int = 0,
                  int8_on_cpu: bool = False) -> str:
    """The INT8 step's time from one calibration window's seconds: two calibration passes over
    `calib` windows, then `rows` report rows over `evals` windows, each about a calibration window's
    work; the INT8 files' quantized graphs in onnxruntime on the CPU beside a GPU's rows
    (`int8_on_cpu`) and `parity` windows of onnxruntime after them are named, not estimated (no GPU
    window tells their time). With a budget it is exceeded, Int8Error naming the window counts that fit it."""
    def fmt(x: float) -> str:
        return f"{x / 60:.0f} min" if x >= 120 else f"{x:.0f} s"

    cal_s, rep_s = 2 * calib * sec, rows * evals * sec
    line = (f"estimate from the first window ({sec:.1f} s each): calibration about {fmt(cal_s)} "
            f"({calib} windows, 2 passes), report about {fmt(rep_s)} ({evals} windows x {rows} rows)"
            + (" plus the INT8 files' quantized graphs in onnxruntime on the CPU (the report's own ETA)"
               if int8_on_cpu else "")
            + (f", then the parity of {parity} windows in onnxruntime on the CPU (its own ETA)" if parity else ""))
    if budget_s > 0 and cal_s + rep_s > budget_s:
        f = budget_s / (cal_s + rep_s)
        raise Int8Error(f"the INT8 step would take about {fmt(cal_s + rep_s)}, over --time-budget "
                        f"{fmt(budget_s)}: rerun with --calib-windows {max(1, int(calib * f))} "
                        f"--eval-windows {max(1, int(evals * f))} (about that long), or a larger budget")
    return line


def kept_float(models: Mapping, exclude_scopes: Optional[str], require_match: bool = True) -> dict[str, list[str]]:
    """{graph: names of its Conv/MatMul/Gemm nodes whose module path matches `exclude_scopes`} (they
    stay float). A pattern that is no regular expression, or (with `require_match`) that matches none
    of those nodes in any graph, is refused with the module paths there are."""
    if not exclude_scopes:
        return {g: [] for g in models}
    try:
        pat = re.compile(exclude_scopes)
    except re.error as e:
        raise Int8Error(f"--int8-float {exclude_scopes!r} is no regular expression ({e})") from None
    ops = {g: [n for n in m.graph.node if n.op_type in QUANT_OP_TYPES] for g, m in models.items()}
    kept = {g: [n.name for n in nodes if pat.search(_scope(n))] for g, nodes in ops.items()}
    if require_match and not any(kept.values()):
        paths = sorted({_scope(n) for nodes in ops.values() for n in nodes} - {""})
        raise Int8Error(f"--int8-float {exclude_scopes!r} matches no convolution or matrix product; module "
                        f"paths are e.g. {', '.join(paths[:6])} ({len(paths)} in all)")
    return kept


def run_int8(trained, out_dir, calib_windows: int = 128, eval_windows: int = 64, batch: int = 2,
             trt_version: str = "10.3.0", log: Callable[[str], None] = print, engine: str = "auto",
             programs: Optional[Mapping] = None, parity_windows: int = 2,
             mark: Optional[Callable[[str], object]] = None, budget_s: float = 0.0, memory_gib: float = 8.0,
             **kw) -> dict:
    """`export.py --int8` after the FP32 (and FP16) export into `out_dir`: int8_export (Q/DQ ONNX +
    calibration caches of every graph), accuracy_report on the VAL split, `report.json` written
    atomically, the table printed through `log`. Returns what report.json holds: {"checkpoint",
    "data_fingerprint", "int8": int8_export's dict, "accuracy": accuracy_report's dict}.

    `budget_s` (> 0): stop after the first calibration batch, with the window counts that fit,
    when the estimate is over it. `memory_gib`: the report's host memory budget (accuracy_report).
    `kw` goes to int8_export (root, split, method, exclude_scopes,
    workers)."""
    out_dir = Path(out_dir)
    _, ev, _ = windows(trained, kw.get("root"), trained.cfg.data.val_split, eval_windows, "--eval-windows",
                       lambda s: None)
    fp16 = int(all(p.is_file() for p in graph_files(out_dir, ".fp16").values()))
    on_torch = pick_engine(engine, "report")[0] == "torch"
    # torch: PyTorch FP32, FP16 under autocast, the INT8 rollout's float graphs; onnxruntime: every file kind
    rows = 2 + fp16 if on_torch else 3 + fp16 + int(all(p.is_file() for p in graph_files(out_dir).values()))

    def estimate(calib: int, sec: float) -> None:
        log(time_estimate(calib, len(ev), rows, sec, budget_s, parity=min(parity_windows, len(ev)) if on_torch else 0,
                          int8_on_cpu=on_torch))

    q = int8_export(trained, out_dir, calib_windows, batch=batch, trt_version=trt_version, log=log,
                    engine=engine, programs=programs, mark=mark, first_window=estimate, **kw)
    eng, dev = pick_engine(engine, "report")
    t0 = time.perf_counter()
    rep = accuracy_report(trained, out_dir, eval_windows, batch=batch, root=kw.get("root"), engine=eng,
                          device=dev, parity_windows=parity_windows, log=log, memory_gib=memory_gib)
    parity_s = rep.get("parity", {}).get("seconds", 0.0)  # onnxruntime on the CPU: its own phase
    q["seconds"]["report"] = round(time.perf_counter() - t0 - parity_s, 2)
    if parity_s:
        q["seconds"]["parity"] = parity_s
    if mark:
        mark("int8_report")
    full = {"checkpoint": str(trained.ckpt), "data_fingerprint": trained.data_fingerprint,
            "int8": q, "accuracy": rep}
    _write_json(out_dir / "report.json", full)
    log(format_report(rep))
    log(f"wrote {out_dir / 'report.json'}")
    return full
