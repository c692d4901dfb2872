"""INT8 deployment: our own entropy calibration -> Q/DQ ONNX + TensorRT calibration cache, and the
accuracy report (DESIGN.md section 6).

TensorRT 11 removed implicit INT8 calibration and 10.x deprecated it, so the thresholds are computed
here (``wm.export.calib``: pytorch-quantization's ``_compute_amax_entropy``, the public reference of
TensorRT's EntropyCalibrator2) and handed to TensorRT in the graph itself:

1. :func:`calibration_feeds`: real windows of the run's TRAINING split, evenly spread, as
   onnxruntime feeds of every graph (forecaster: past occupancy + motion [+ future motion];
   tokenizer_encode: the windows' frames; tokenizer_decode: the codes the FP32 encoder graph gives
   those frames).
2. :func:`collect_histograms`: every float tensor that feeds a Conv/ConvTranspose/MatMul/Gemm as a
   data input (not an initializer) is made an extra graph output of a copy of the model, and the
   2048-bin |x| histograms are collected over the feeds with onnxruntime (two passes: exact max
   first, then 2048 bins over [0, max], i.e. the reference's histogram of the whole calibration
   set taken as one batch; see the function).
3. Entropy thresholds (amax) -> scale = amax / 127, zero point 0; except where the range is the
   data's, not a learned activation's (:func:`exact_range_tensors`: rows of the class-embedding
   and codebook tables, the ego-motion inputs), which take their exact max: the entropy search,
   built for continuous activations, clips whole table rows and the informative motion tails.
4. :func:`quantize_qdq`: onnxruntime's ``quantize_static`` (QDQ format) does the graph work with
   every activation scale given as a ``TensorQuantOverrides`` override; weights per-channel
   symmetric int8 (its own min/max), bias left float; Softmax, normalisation, Gather/embeddings,
   Einsum, the output heads and every other op stay float: only the data inputs of the quantized
   Conv/ConvTranspose/MatMul/Gemm nodes carry a QuantizeLinear -> DequantizeLinear pair (one pair
   per consuming node, as TensorRT wants). The written graph is re-read and checked: each scale
   must equal ours bit for bit (float32), and no float op may read a dequantized tensor.
5. :func:`int8_export` writes ``<name>.int8.onnx``, ``<name>.calib.cache`` (TensorRT's text
   format, same scales, ONNX tensor names) and ``<name>.calib.json`` (per-tensor amax/max/scale).
6. :func:`accuracy_report` / :func:`format_report`: IoU/mIoU per future step on held-out windows
   (the run's VAL split) for PyTorch FP32, ONNX FP32, FP16, INT8 and copy-last, the drops against
   PyTorch FP32, and onnxruntime latency per window at batch 1.

:func:`run_int8` is the single entry point ``export.py --int8`` calls: both steps, ``report.json``
and the printed table.

onnxruntime's override format (read in onnxruntime 1.32 ``quantization/tensor_quant_overrides.py``,
``qdq_quantizer.py`` ``calc_quant_params``, ``base_quantizer.py`` ``QuantizationParams``, and tried):
``extra_options["TensorQuantOverrides"] = {tensor_name: [{"scale": np.array(s, np.float32),
"zero_point": np.array(0, np.int8)}]}``. A one-element list is a per-tensor override (a list with
"axis" is per-channel); ``scale`` and ``zero_point`` come together and exclude
``symmetric``/``reduce_range``/``rmin``/``rmax``; both must be numpy values (a Python float or int
fails with ``AttributeError: ... no attribute 'squeeze'``) and the scale float32/float16 (float64:
``ValueError: scale must a float32 or float16 numpy element``). Given both, ``calc_quant_params``
takes them as they are and ignores the calibrated range. Two more facts of that code shape what we
pass: the DQ output of an activation replaces the tensor in ALL its consumers
(``replace_input_of_all_nodes``), float ops included, unless ``DedicatedQDQPair`` is on AND the
tensor has more than one quantized consumer (the same for a weight shared with a float node), so
the graph is rewired afterwards (:func:`_float_consumers_back`); and Conv/MatMul/Gemm outputs are
quantized too unless listed in ``OpTypesToExcludeOutputQuantization``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from wm.atomic import discard, publish, tmp_path, write_bytes
from wm.errors import WMError
from wm.export.calib import (HistogramCollector, entropy_threshold, percentile_threshold, scale_from_amax,
                             trt_version_number, write_cache)

__all__ = [
    "QUANT_OP_TYPES",
    "FLOAT_OP_TYPES",
    "GRAPH_NAMES",
    "Int8Error",
    "quantizable_inputs",
    "exact_range_tensors",
    "output_heads",
    "collect_histograms",
    "calibration_feeds",
    "quantize_qdq",
    "qdq_scales",
    "int8_export",
    "accuracy_report",
    "format_report",
    "check_windows",
    "run_int8",
]

GRAPH_NAMES = ("forecaster", "tokenizer_encode", "tokenizer_decode")
QUANT_OP_TYPES = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# Ops that stay float (never read a dequantized tensor). Only QUANT_OP_TYPES are quantized at all and
# the result is checked for EVERY other node; this list is removed from op_types where they overlap.
FLOAT_OP_TYPES = ("Softmax", "LogSoftmax", "GroupNormalization", "LayerNormalization",
                  "InstanceNormalization", "BatchNormalization", "RMSNormalization", "ReduceMean",
                  "Gather", "GatherElements", "GatherND", "Einsum", "ArgMax", "ArgMin", "TopK")
# Ops where a decision is taken from float values: a quantized node from which one of these (or a
# graph output) is reachable without passing another quantized node is an output head.
_DECISION_OPS = ("ArgMax", "ArgMin", "TopK")
# Heads by module path (the exporter's name scopes): what no reachability rule sees, e.g. the
# world model's motion head, which feeds the next rollout step's pose MLP.
HEAD_SCOPES = r"(^|\.)(out_conv|motion_head|dec_out|enc_out)(\.|$)"
_FLOAT_TYPES = (1, 10, 11, 16)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16
# Ops that only move values: a tensor seen through them after a table lookup is still the table's rows.
_VIEW_OPS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity")


class Int8Error(WMError):
    """A calibration or Q/DQ step that cannot go ahead; str(e) is one line."""


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def _write_json(path: Path, obj) -> None:
    write_bytes(path, json.dumps(obj, indent=1, allow_nan=False))


def _load(path_or_model):
    import onnx

    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model
    path = Path(path_or_model)
    if not path.is_file():
        raise Int8Error(f"ONNX model {path} does not exist; run the FP32 export first (python export.py)")
    try:
        return onnx.load(str(path))
    except Exception as e:  # a truncated or foreign file
        raise Int8Error(f"cannot read ONNX model {path}: {_one_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# graph inspection


def _data_input_slots(node) -> tuple[int, ...]:
    """Which inputs of a node are data (activations) rather than weights/bias."""
    if node.op_type in ("Conv", "ConvTranspose"):
        return (0,)
    if node.op_type in ("MatMul", "Gemm"):
        return (0, 1)  # Gemm's C is a bias
    return tuple(range(len(node.input)))


def _constants(model) -> set[str]:
    out = {i.name for i in model.graph.initializer}
    out |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return out


def _elem_types(model) -> dict[str, int]:
    """tensor name -> onnx elem_type, from the graph's inputs/outputs/value_info after shape inference."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=False)
    except Exception:  # inference is best effort; unknown tensors are skipped
        inferred = model
    types = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        t = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
        if t:
            types[vi.name] = t
    for init in inferred.graph.initializer:
        types[init.name] = init.data_type
    return types


def quantizable_inputs(model, op_types: Sequence[str] = QUANT_OP_TYPES) -> dict[str, list[str]]:
    """{tensor name: [names of the op_types nodes it feeds as a data input]} for every float tensor
    that is not an initializer/Constant, in graph order. Tensors of non-float (or unknown) type are
    left out."""
    model = _load(model)
    const, types = _constants(model), _elem_types(model)
    out: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type not in op_types:
            continue
        for i in _data_input_slots(node):
            if i >= len(node.input):
                continue
            name = node.input[i]
            if not name or name in const or types.get(name) not in _FLOAT_TYPES:
                continue
            out.setdefault(name, [])
            if node.name not in out[name]:
                out[name].append(node.name)
    return out


def exact_range_tensors(model, tensors: Optional[Iterable[str]] = None) -> dict[str, str]:
    """{tensor: why} for the quantized inputs whose range is the data's, not a learned activation's;
    int8_export gives them their exact max instead of an entropy cut-off:

    - rows of a constant table: a Gather whose data is an initializer/Constant, seen through view
      ops only (the tokenizer's class embedding, the codebook lookup in front of the decoder). A few
      exact values (18 class vectors), not a continuous distribution: the entropy search cuts off
      whole rows (demo run: the class embedding's threshold came out at 0.19 of its max, every voxel
      of the clipped classes got a wrong vector, and the forecast lost 10 IoU points);
    - values of the graph's inputs, reached through no Conv/MatMul/Gemm (the ego motion, scaled and
      stacked, in front of the pose MLP at every rollout step). Their tails are measurements, and
      the informative part: a clipped displacement makes a fast ego look slow (demo run: threshold
      at 0.41 of the max, the forecast lost a further 0.7 IoU points on the last steps).

    `tensors`: the quantizable inputs when the caller has them (:func:`quantizable_inputs` runs shape
    inference over the whole graph)."""
    model = _load(model)
    const = _constants(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    inputs = {i.name for i in model.graph.input} - const
    out: dict[str, str] = {}
    sources: dict[str, Optional[frozenset]] = {}  # tensor -> graph inputs it derives from; None: learned

    def origin(t: str) -> Optional[frozenset]:
        # iterative post-order walk (graphs are thousands of nodes deep: no recursion)
        stack = [t]
        while stack:
            x = stack[-1]
            if x in sources:
                stack.pop()
                continue
            n = producer.get(x)
            if n is None:
                sources[x] = frozenset([x]) if x in inputs else frozenset()
                stack.pop()
                continue
            if n.op_type in QUANT_OP_TYPES:
                sources[x] = None
                stack.pop()
                continue
            todo = [i for i in n.input if i and i not in sources]
            if todo:
                stack.extend(todo)
                continue
            parts = [sources[i] for i in n.input if i]
            sources[x] = None if any(p is None for p in parts) else frozenset().union(*parts)
            stack.pop()
        return sources[t]

    for t in (quantizable_inputs(model) if tensors is None else tensors):
        x = t
        while x in producer and producer[x].op_type in _VIEW_OPS:
            x = producer[x].input[0]
        n = producer.get(x)
        if n is not None and n.op_type == "Gather" and n.input and n.input[0] in const:
            out[t] = f"rows of table {n.input[0]}"
            continue
        src = origin(t)
        if src:
            out[t] = f"values of input {', '.join(sorted(src))}"
    return out


def _scope(node) -> str:
    """The deepest module path the exporter recorded for a node ('' if none): the name scopes are
    ['', 'world.motion_head', 'world.motion_head.1', 'linear_3'], the last entry being the op."""
    import ast

    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return ""
            mods = [s for s in scopes[:-1] if isinstance(s, str) and s]
            return mods[-1] if mods else ""
    return ""


def output_heads(model, op_types: Sequence[str] = QUANT_OP_TYPES,
                 head_scopes: Optional[str] = HEAD_SCOPES) -> dict[str, str]:
    """{node name: why} of the op_types nodes that are output heads and stay float:

    - a node from whose output a graph output, or a decision op (ArgMax/ArgMin/TopK), is reachable
      without passing through another op_types node (the layer whose values are the answer: the
      tokenizer's dec_out before the class-embedding Einsum, the world model's out_conv before
      its argmax, the encoder's enc_out and codebook-distance Gemm before the nearest-code argmin);
    - a node whose module path (exporter name scope) matches `head_scopes` (e.g. the world model's
      motion head, whose output feeds the next rollout step)."""
    model = _load(model)
    g = model.graph
    consumers: dict[str, list] = {}
    for n in g.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    outputs = {o.name for o in g.output}
    heads: dict[str, str] = {}
    pat = re.compile(head_scopes) if head_scopes else None
    for n in g.node:
        if n.op_type not in op_types:
            continue
        if pat is not None:
            sc = _scope(n)
            if sc and pat.search(sc):
                heads[n.name] = f"output head ({sc})"
                continue
        seen, stack, why = set(), list(n.output), None
        while stack and why is None:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if t in outputs:
                why = f"output head (feeds graph output {t!r})"
                break
            for c in consumers.get(t, []):
                if c.op_type in op_types:
                    continue
                if c.op_type in _DECISION_OPS:
                    why = f"output head (feeds {c.op_type} {c.name!r})"
                    break
                stack.extend(c.output)
        if why:
            heads[n.name] = why
    return heads


# ---------------------------------------------------------------------------------------------
# 1. histograms


def collect_histograms(onnx_path, feeds_iter: Iterable[Mapping[str, np.ndarray]],
                       op_types: Sequence[str] = QUANT_OP_TYPES,
                       collector: Optional[HistogramCollector] = None,
                       two_pass: bool = True, threads: int = 0) -> HistogramCollector:
    """Histograms of every float tensor feeding an `op_types` node as data input, over the feeds.

    A copy of the model exposes those tensors as extra graph outputs (types from onnx shape
    inference), onnxruntime runs it on each feed, and `collector.update(tensor name, value)` adds
    each batch. Returns the collector (a new HistogramCollector unless one is given).

    two_pass (default): a first pass over the feeds finds each tensor's exact max |x|, and the
    histograms then cover [0, max] in the collector's 2048 bins from the first batch on
    (``set_range``): exactly the histogram pytorch-quantization's collect() builds when the whole
    calibration set is one batch, as TensorRT's guide advises ("calibrate with as large a single
    batch as possible": its histograms otherwise depend on the batch order). Without it the range
    grows batch by batch as the reference's streaming collect() does, which fails (max_bins) when a
    later batch's max is many times the first's. `feeds_iter` is read twice: pass a list."""
    import onnx
    import onnxruntime as ort

    model = _load(onnx_path)
    tensors = quantizable_inputs(model, op_types)
    types = _elem_types(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in tensors:
        if name not in have:
            m.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name], None))
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise Int8Error(f"{onnx_path}: onnxruntime cannot load the calibration copy: {_one_line(e)}") from None
    names = list(tensors)
    what = Path(str(onnx_path)).name

    def batches():
        n = 0
        for feed in feeds_iter:
            n += 1
            try:
                yield n, sess.run(names, dict(feed))
            except Exception as e:
                raise Int8Error(f"{what}: calibration batch {n} failed in onnxruntime: {_one_line(e)}") from None
        if n == 0:
            raise Int8Error(f"{what}: no calibration batches were given")

    col = collector if collector is not None else HistogramCollector()
    if two_pass:
        if iter(feeds_iter) is feeds_iter:
            feeds_iter = list(feeds_iter)  # an iterator: keep its batches for the second pass
        top = dict.fromkeys(names, 0.0)
        for n, values in batches():
            for name, v in zip(names, values):
                m_ = float(np.max(np.abs(v))) if v.size else 0.0
                if not math.isfinite(m_):
                    raise Int8Error(f"{what}: tensor {name!r}: calibration batch {n} holds NaN or inf values")
                top[name] = max(top[name], m_)
        for name, amax in top.items():
            if amax > 0:
                try:
                    col.set_range(name, amax)
                except ValueError:  # the given collector already holds this tensor: it grows as it must
                    pass
    for n, values in batches():
        for name, v in zip(names, values):
            try:
                col.update(name, v)
            except ValueError as e:
                raise Int8Error(f"{what}: {e}") from None
    return col


# ---------------------------------------------------------------------------------------------
# 2. calibration / evaluation windows


def _windows(trained, root, split: str, n: int, what: str):
    """OccWindows of `split` (the run's config, max_windows lifted) and `n` evenly spread indices."""
    from wm.data import OccWindows, resolve_root

    cfg = trained.cfg
    root = Path(root) if root else resolve_root(cfg, log=lambda *a, **k: None)
    dcfg = dataclasses.replace(cfg.data, max_windows=0, num_workers=0)
    ds = OccWindows(root, split, dcfg)  # DataError (one line) for a missing split or a data/config mismatch
    total = len(ds)
    if n is None or n <= 0:
        n = total
    if n > total:
        raise Int8Error(f"{what} {n} but split {split!r} has only {total} windows ({root}); "
                        f"ask for at most {total}")
    idx = np.unique(np.linspace(0, total - 1, n).round().astype(np.int64))
    return ds, idx, root


def _batches(ds, idx: np.ndarray, batch: int) -> Iterable[dict]:
    """Stacked numpy batches of windows: occ uint8 (B, T, X, Y, Z), motion float32 (B, T, 3)[, mask]."""
    for s in range(0, len(idx), batch):
        items = [ds[int(i)] for i in idx[s:s + batch]]
        out = {k: np.stack([it[k].numpy() for it in items]) for k in items[0] if k != "index"}
        yield out


def _forecaster_feed(cfg, occ: np.ndarray, motion: np.ndarray) -> dict[str, np.ndarray]:
    p = cfg.data.past
    feed = {"past_occ": np.ascontiguousarray(occ[:, :p]),
            "past_motion": np.ascontiguousarray(motion[:, :p], dtype=np.float32)}
    if cfg.train.forecast_motion == "given":
        feed["future_motion"] = np.ascontiguousarray(motion[:, p:], dtype=np.float32)
    return feed


def calibration_feeds(trained, root=None, split: Optional[str] = None, n_windows: int = 256,
                      batch: int = 4, encoder_onnx=None,
                      graphs: Sequence[str] = GRAPH_NAMES) -> dict[str, list[dict[str, np.ndarray]]]:
    """onnxruntime feeds of each graph from `n_windows` real windows of `split` (default: the run's
    training split), evenly spread over it, `batch` windows per feed:

    - forecaster: past_occ (B, P, X, Y, Z) uint8, past_motion (B, P, 3)[, future_motion (B, S, 3)];
    - tokenizer_encode: occ (B*T, X, Y, Z): every frame of the batch's windows;
    - tokenizer_decode: codes (B*T, h, w) int64, what the FP32 encoder graph `encoder_onnx` gives
      those frames (PyTorch's tokenizer.encode when no graph is named).

    `root`: the data set (default: the checkpoint config's data.root, or the synthetic cache). Too
    few windows -> Int8Error "--calib-windows N but split X has only M windows"."""
    import torch

    cfg = trained.cfg
    split = split or cfg.data.train_split
    if int(batch) < 1:
        raise Int8Error(f"calibration batch must be >= 1, got {batch}")
    ds, idx, _ = _windows(trained, root, split, n_windows, "--calib-windows")
    unknown = [g for g in graphs if g not in GRAPH_NAMES]
    if unknown:
        raise Int8Error(f"unknown graph(s) {unknown}; choose from {list(GRAPH_NAMES)}")
    enc_sess = None
    if "tokenizer_decode" in graphs and encoder_onnx is not None:
        from wm.export.onnx import session

        enc_sess = session(Path(encoder_onnx))
    out: dict[str, list] = {g: [] for g in graphs}
    for b in _batches(ds, idx, int(batch)):
        occ, motion = b["occ"], b["motion"]
        frames = occ.reshape(-1, *occ.shape[2:])
        if "forecaster" in graphs:
            out["forecaster"].append(_forecaster_feed(cfg, occ, motion))
        if "tokenizer_encode" in graphs:
            out["tokenizer_encode"].append({"occ": frames})
        if "tokenizer_decode" in graphs:
            if enc_sess is not None:
                codes = enc_sess.run(None, {"occ": frames})[0]
            else:
                with torch.no_grad():
                    codes = trained.tokenizer.encode(torch.from_numpy(frames)).numpy()
            out["tokenizer_decode"].append({"codes": codes.astype(np.int64)})
    return out


# ---------------------------------------------------------------------------------------------
# 3. Q/DQ graph


class _Reader:
    """onnxruntime CalibrationDataReader over a list of feeds (its ranges are never used: every
    quantized activation has a scale override)."""

    def __init__(self, feeds):
        self.feeds = list(feeds)
        self.it = iter(self.feeds)

    def get_next(self):
        return next(self.it, None)

    def rewind(self):
        self.it = iter(self.feeds)


def _zero_feed(model) -> dict[str, np.ndarray]:
    """One all-zero feed (dynamic dims = 1) of the model's inputs: valid class ids, codes, motion."""
    import onnx

    const = {i.name for i in model.graph.initializer}
    feed = {}
    for i in model.graph.input:
        if i.name in const:
            continue
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in tt.shape.dim]
        feed[i.name] = np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    return feed


def _float_consumers_back(model, original, quantized_nodes: set[str]) -> int:
    """Give every node that is not a quantized node its float input back where onnxruntime wired a
    DequantizeLinear output into it (``replace_input_of_all_nodes``: an activation with one
    quantized consumer, or a weight shared with a float node): the input becomes the tensor the
    same node (same name) reads in the float graph, its float initializer copied back if the
    quantizer removed it. Then Q/DQ nodes and initializers nothing reads any more are dropped.
    Returns how many inputs were rewired."""
    g = model.graph
    orig_nodes = {n.name: n for n in original.graph.node}
    orig_inits = {i.name: i for i in original.graph.initializer}
    have = {i.name for i in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    rewired = 0
    for n in g.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") or n.name in quantized_nodes:
            continue
        for k, t in enumerate(n.input):
            dq = prod.get(t)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            o = orig_nodes.get(n.name)
            if o is None or k >= len(o.input):
                raise Int8Error(f"float node {n.name!r} reads dequantized {t!r} and its float input is unknown")
            src = o.input[k]
            if src in orig_inits and src not in have:
                g.initializer.append(orig_inits[src])
                have.add(src)
            n.input[k] = src
            rewired += 1
    for o in g.output:  # a graph output read through a DQ would be a quantized output
        p = prod.get(o.name)
        if p is not None and p.op_type == "DequantizeLinear":
            raise Int8Error(f"graph output {o.name!r} would be quantized; keep its producer in float")
    while True:  # remove dead Q/DQ chains
        used = {t for n in g.node for t in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {t for n in g.node for t in n.input}
    for init in [i for i in g.initializer if i.name not in used]:
        g.initializer.remove(init)
    return rewired


def qdq_scales(model) -> dict[str, dict]:
    """Read a Q/DQ graph back: {float tensor name: {"scale": float32, "zero_point": int,
    "dtype": str, "consumers": [node names that read its DQ output]}} for every activation that
    goes through QuantizeLinear -> DequantizeLinear, and {weight: {"axis", "scales", ...}} for
    weights stored as int8 initializers behind a DequantizeLinear (key "weights")."""
    from onnx import numpy_helper

    model = _load(model)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[str]] = {}
    for n in g.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n.name)

    def val(name):
        return numpy_helper.to_array(inits[name]) if name in inits else None

    acts: dict[str, dict] = {}
    weights: dict[str, dict] = {}
    for dq in g.node:
        if dq.op_type != "DequantizeLinear":
            continue
        src = dq.input[0]
        scale, zp = val(dq.input[1]), val(dq.input[2]) if len(dq.input) > 2 else None
        axis = next((a.i for a in dq.attribute if a.name == "axis"), None)
        q = prod.get(src)
        if q is not None and q.op_type == "QuantizeLinear":
            qs, qz = val(q.input[1]), val(q.input[2]) if len(q.input) > 2 else None
            e = acts.setdefault(q.input[0], {"scale": float(np.float32(qs).reshape(-1)[0]),
                                             "q_scale": float(np.float32(qs).reshape(-1)[0]),
                                             "zero_point": int(np.asarray(qz).reshape(-1)[0]) if qz is not None else 0,
                                             "dtype": str(np.asarray(qz).dtype) if qz is not None else "uint8",
                                             "scale_size": int(np.asarray(qs).size),
                                             "consumers": []})
            e["dq_scale_matches"] = e.get("dq_scale_matches", True) and bool(
                np.array_equal(np.asarray(scale, np.float32), np.asarray(qs, np.float32)))
            e["consumers"] += consumers.get(dq.output[0], [])
        elif src in inits:
            w = val(src)
            weights[src] = {"dtype": str(w.dtype), "shape": list(w.shape), "axis": axis,
                            "scales": np.asarray(scale, np.float32).reshape(-1).tolist(),
                            "zero_points": np.asarray(zp).reshape(-1).tolist() if zp is not None else [],
                            "consumers": consumers.get(dq.output[0], [])}
    return {"activations": acts, "weights": weights}


def quantize_qdq(onnx_path, out_path, thresholds: Mapping[str, float],
                 exclude_op_types: Sequence[str] = FLOAT_OP_TYPES,
                 op_types: Sequence[str] = QUANT_OP_TYPES,
                 calib_feeds: Optional[Sequence[Mapping[str, np.ndarray]]] = None,
                 nodes_to_exclude: Sequence[str] = (), exclude_heads: bool = True) -> dict:
    """Write a Q/DQ ONNX of `onnx_path` to `out_path` with OUR activation scales.

    Activations: per-tensor symmetric int8, scale = thresholds[name] / 127, zero point 0, for every
    data input of every `op_types` node that is quantized. Weights: per-channel symmetric int8.
    Bias: float. Stay float (no Q/DQ on any of their inputs): `exclude_op_types` and every other
    op, the output heads (:func:`output_heads`, if `exclude_heads`), `nodes_to_exclude`, and any
    op_types node with a data input that has no positive finite threshold. onnxruntime's
    quantize_static does the graph work; the result is re-read and checked (scales equal ours as
    float32, no float op reads a DQ output), checked with onnx.checker and written atomically.

    Returns {"quantized_nodes": [...], "float_nodes": {name: why}, "scales": {tensor: scale},
    "weights": n, "rewired": n}."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    onnx_path, out_path = Path(onnx_path), Path(out_path)
    model = _load(onnx_path)
    op_types = tuple(t for t in op_types if t not in set(exclude_op_types))
    tensors = quantizable_inputs(model, op_types)
    nodes_by_name = {n.name: n for n in model.graph.node}
    if len(nodes_by_name) != len(model.graph.node) or "" in nodes_by_name:
        raise Int8Error(f"{onnx_path.name}: nodes without unique names; the quantizer selects nodes by name")
    candidates = [n.name for n in model.graph.node if n.op_type in op_types]
    float_nodes: dict[str, str] = {}
    if exclude_heads:
        float_nodes.update(output_heads(model, op_types))
    for name in nodes_to_exclude:
        float_nodes.setdefault(name, "excluded by the caller")
    node_inputs: dict[str, list[str]] = {}
    for t, users in tensors.items():
        for u in users:
            node_inputs.setdefault(u, []).append(t)
    for name in candidates:
        if name in float_nodes:
            continue
        ins = node_inputs.get(name, [])
        bad = [t for t in ins if not (t in thresholds and math.isfinite(thresholds[t]) and thresholds[t] > 0)]
        if bad:
            float_nodes[name] = f"no calibrated range for input {bad[0]!r}"
        elif not ins:
            float_nodes[name] = "no float data input"
    quantized = [n for n in candidates if n not in float_nodes]
    qset = set(quantized)
    scales = {}
    for n in quantized:
        for t in node_inputs[n]:
            scales[t] = np.float32(scale_from_amax(thresholds[t]))
    overrides = {t: [{"scale": np.array(s, dtype=np.float32), "zero_point": np.array(0, dtype=np.int8)}]
                 for t, s in scales.items()}
    extra = {
        "ActivationSymmetric": True,
        "WeightSymmetric": True,
        "TensorQuantOverrides": overrides,
        "DedicatedQDQPair": True,  # one Q/DQ pair per quantized consumer (TensorRT)
        "OpTypesToExcludeOutputQuantization": list(op_types),  # Q/DQ on inputs only
        "QuantizeBias": False,  # bias stays float: TensorRT fuses it, an int32 DQ it does not take
        "AddQDQPairToWeight": False,  # weights as int8 initializers -> DequantizeLinear
    }
    feeds = list(calib_feeds)[:2] if calib_feeds else [_zero_feed(model)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(out_path)
    ort_log = logging.getLogger()
    level = ort_log.level
    try:
        ort_log.setLevel(logging.ERROR)  # quantize_static warns about pre-processing on every call
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            quantize_static(str(onnx_path), str(tmp), _Reader(feeds), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=list(op_types), per_channel=True, reduce_range=False,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            nodes_to_quantize=quantized, nodes_to_exclude=sorted(float_nodes),
                            calibrate_method=CalibrationMethod.MinMax, extra_options=extra)
        q = onnx.load(str(tmp))
        rewired = _float_consumers_back(q, model, qset)
        _check_qdq(q, model, qset, scales, tensors, op_types, exclude_op_types, out_path.name)
        onnx.save(q, str(tmp))
        onnx.checker.check_model(str(tmp), full_check=True)
        publish(tmp, out_path)
    except OSError as e:
        discard(tmp)
        raise Int8Error(f"cannot write {out_path}: {e}") from None
    except Exception as e:
        discard(tmp)
        if isinstance(e, WMError):
            raise
        raise Int8Error(f"quantizing {onnx_path.name} failed: {_one_line(e)}") from e
    finally:
        ort_log.setLevel(level)
    n_weights = len(qdq_scales(q)["weights"])
    return {"quantized_nodes": quantized, "float_nodes": float_nodes,
            "scales": {t: float(s) for t, s in scales.items()}, "weights": n_weights, "rewired": rewired}


def _check_qdq(q, original, qset: set[str], scales: Mapping[str, np.float32],
               tensors: Mapping[str, list[str]], op_types, float_op_types, what: str) -> None:
    """The Q/DQ graph is what we asked for, else Int8Error (a quantizer behaving differently)."""
    info = qdq_scales(q)
    acts, weights = info["activations"], info["weights"]
    prod = {o: n for n in q.graph.node for o in n.output}
    nodes = {n.name: n for n in q.graph.node}
    for t, s in scales.items():
        a = acts.get(t)
        if a is None:
            raise Int8Error(f"{what}: tensor {t!r} has no QuantizeLinear/DequantizeLinear pair")
        if np.float32(a["scale"]) != s or not a.get("dq_scale_matches", False) or a["scale_size"] != 1:
            raise Int8Error(f"{what}: tensor {t!r} got scale {a['scale']!r}, ours is {float(s)!r}")
        if a["zero_point"] != 0 or a["dtype"] != "int8":
            raise Int8Error(f"{what}: tensor {t!r} got zero point {a['zero_point']} ({a['dtype']}), want 0 (int8)")
    extra = sorted(set(acts) - set(scales))
    if extra:
        raise Int8Error(f"{what}: onnxruntime quantized tensors we gave no scale: {extra[:3]}")
    for name in qset:  # every data input of every quantized node reads a DQ of the right tensor
        n = nodes.get(name)
        if n is None:
            raise Int8Error(f"{what}: quantized node {name!r} is missing from the Q/DQ graph")
        for i in _data_input_slots(n):
            if i >= len(n.input) or not n.input[i]:
                continue
            dq = prod.get(n.input[i])
            if dq is None or dq.op_type != "DequantizeLinear":
                orig = next(x for x in original.graph.node if x.name == name).input[i]
                if orig in scales:
                    raise Int8Error(f"{what}: node {name!r} input {i} ({orig!r}) is not dequantized")
        if n.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm") and len(n.input) > 1:
            dq = prod.get(n.input[1])
            w = dq.input[0] if dq is not None and dq.op_type == "DequantizeLinear" else None
            if w in weights and weights[w]["dtype"] != "int8":
                raise Int8Error(f"{what}: weight {w!r} of {name!r} is {weights[w]['dtype']}, want int8")
    for n in q.graph.node:  # nothing else reads a dequantized activation
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") or n.name in qset:
            continue
        for t in n.input:
            p = prod.get(t)
            if p is not None and p.op_type == "DequantizeLinear":
                raise Int8Error(f"{what}: float node {n.name!r} ({n.op_type}) reads dequantized {t!r}")


# ---------------------------------------------------------------------------------------------
# 4. export


def _summary(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0}
    v = np.asarray(values, np.float64)
    return {"n": int(v.size), "min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}


def _threshold_one(args) -> float:
    counts, edges, method = args
    if method == "entropy":
        return entropy_threshold(counts, edges)
    return percentile_threshold(counts, edges, 99.99)


def _thresholds(hists: Mapping[str, tuple[np.ndarray, np.ndarray]], method: str, workers: int = 0) -> dict[str, float]:
    """{tensor: amax} by `method` for every histogram. The entropy search costs ~0.1 s per 2048-bin
    histogram, so many tensors are spread over worker processes: fresh interpreters that import only
    this module (numpy), never a fork of a process holding onnxruntime/torch threads, never a
    re-import of the caller's main script. Same function on the same arrays: the same numbers as
    the serial loop, which is also the fallback if a worker cannot be started."""
    names = list(hists)
    jobs = [(np.asarray(hists[t][0]), np.asarray(hists[t][1]), method) for t in names]
    workers = int(workers) if workers else min(os.cpu_count() or 1, 16)
    workers = max(1, min(workers, len(jobs) // 8))
    if workers > 1:
        try:
            return dict(zip(names, _in_workers(jobs, workers)))
        except (OSError, RuntimeError, EOFError, ValueError, TypeError):
            pass  # below: the same computation here, where a real error shows with its message
    return {t: _threshold_one(j) for t, j in zip(names, jobs)}


def _in_workers(jobs: list, workers: int) -> list[float]:
    import pickle
    import subprocess
    import sys

    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    chunks = [list(range(w, len(jobs), workers)) for w in range(workers)]
    code = "from wm.export.int8 import _worker_main; _worker_main()"
    procs = []
    try:
        for idx in chunks:
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env=env, cwd=pkg_root)
            procs.append(p)
            p.stdin.write(pickle.dumps([jobs[i] for i in idx], protocol=pickle.HIGHEST_PROTOCOL))
            p.stdin.close()
        out: list = [None] * len(jobs)
        for p, idx in zip(procs, chunks):
            data = p.stdout.read()
            if p.wait() != 0:
                raise RuntimeError(f"threshold worker exited with {p.returncode}")
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


def _worker_main() -> None:
    """Threshold worker: a pickled list of (counts, edges, method) on stdin -> amaxes on stdout."""
    import pickle
    import sys

    jobs = pickle.load(sys.stdin.buffer)
    pickle.dump([_threshold_one(j) for j in jobs], sys.stdout.buffer)
    sys.stdout.flush()


def int8_export(trained, out_dir, calib_windows: int = 256, batch: int = 4, trt_version: str = "10.3.0",
                graphs: Sequence[str] = GRAPH_NAMES, root=None, split: Optional[str] = None,
                method: str = "entropy", exclude_scopes: Optional[str] = None, workers: int = 0,
                log: Callable[[str], None] = print) -> dict:
    """For each graph `<name>.onnx` in `out_dir` (written by the FP32 export): collect histograms on
    `calib_windows` training windows, pick the thresholds (`method`: "entropy" = TensorRT's
    EntropyCalibrator2; "percentile" 99.99; "max"), write `<name>.int8.onnx` (Q/DQ),
    `<name>.calib.cache` (TensorRT `TRT-<ver>-EntropyCalibration2` text) and `<name>.calib.json`
    (amax, exact max and scale per tensor). Tensors whose range is the data's
    (:func:`exact_range_tensors`: table lookups, the ego-motion inputs) take their exact max
    whatever the method. Returns a JSON-ready dict of what was written.

    `exclude_scopes`: a regex on module paths (e.g. r"\\.temporal\\.") whose Conv/MatMul nodes stay
    float as well. `workers`: processes for the threshold search (0: one per CPU, at most 16)."""
    out_dir = Path(out_dir)
    if method not in ("entropy", "percentile", "max"):
        raise Int8Error(f"unknown calibration method {method!r} (entropy, percentile, max)")
    try:
        version = trt_version_number(trt_version)
    except ValueError as e:
        raise Int8Error(str(e)) from None
    for g in graphs:
        if g not in GRAPH_NAMES:
            raise Int8Error(f"unknown graph {g!r}; choose from {list(GRAPH_NAMES)}")
        if not (out_dir / f"{g}.onnx").is_file():
            raise Int8Error(f"{out_dir / (g + '.onnx')} does not exist; the INT8 step quantizes the FP32 "
                            "export (python export.py writes it first)")
    cfg = trained.cfg
    split = split or cfg.data.train_split
    t0 = time.perf_counter()
    enc = out_dir / "tokenizer_encode.onnx"
    feeds = calibration_feeds(trained, root, split, calib_windows, batch,
                              encoder_onnx=enc if enc.is_file() else None, graphs=graphs)
    res = {"calibration": {"split": split, "windows": int(calib_windows), "batch": int(batch),
                           "batches": len(feeds[graphs[0]]), "method": method,
                           "algorithm": "TensorRT EntropyCalibrator2 (pytorch-quantization _compute_amax_entropy)"
                           if method == "entropy" else method,
                           "trt_version": str(trt_version), "cache_header": f"TRT-{version}-EntropyCalibration2",
                           "feeds_seconds": round(time.perf_counter() - t0, 2)},
           "graphs": {}}
    for g in graphs:
        t1 = time.perf_counter()
        src = out_dir / f"{g}.onnx"
        col = collect_histograms(src, feeds[g])
        t2 = time.perf_counter()
        model = _load(src)
        heads = output_heads(model)
        tensors = quantizable_inputs(model)
        wanted = sorted({t for t, users in tensors.items() if any(u not in heads for u in users)},
                        key=list(tensors).index)
        hists = col.histograms()
        todo = {t: hists[t] for t in wanted if t in hists}  # absent: zero in every batch, stays float
        exact = {t: why for t, why in exact_range_tensors(model, tensors).items() if t in todo}
        if method == "max":
            thresholds = {t: col.amax(t) for t in todo}
        else:
            thresholds = _thresholds({t: h for t, h in todo.items() if t not in exact}, method, workers)
            thresholds.update({t: col.amax(t) for t in exact})
        t3 = time.perf_counter()
        skip = [n.name for n in model.graph.node if exclude_scopes and re.search(exclude_scopes, _scope(n))]
        info = quantize_qdq(src, out_dir / f"{g}.int8.onnx", thresholds, calib_feeds=feeds[g][:1],
                            nodes_to_exclude=skip)
        scales = info["scales"]
        cache = out_dir / f"{g}.calib.cache"
        write_cache(cache, {t: scales[t] for t in tensors if t in scales}, version)
        detail = {t: {"amax": thresholds[t], "max": col.amax(t), "scale": scales[t],
                      "rule": f"max ({exact[t]})" if t in exact else method}
                  for t in tensors if t in scales}
        _write_json(out_dir / f"{g}.calib.json", {"method": method, "trt_version": str(trt_version),
                                                  "tensors": detail})
        clipped = [thresholds[t] / col.amax(t) for t in scales if col.amax(t) > 0]
        res["graphs"][g] = {
            "file": f"{g}.int8.onnx", "bytes": (out_dir / f"{g}.int8.onnx").stat().st_size,
            "cache": cache.name, "thresholds_file": f"{g}.calib.json",
            "tensors_collected": len(col.names()), "tensors_quantized": len(scales),
            "exact_range_at_max": {t: exact[t] for t in scales if t in exact},
            "zero_tensors": col.zero_tensors(),
            "nodes_quantized": len(info["quantized_nodes"]), "weights_quantized": info["weights"],
            "nodes_float": info["float_nodes"],
            "amax": _summary([thresholds[t] for t in scales]),
            "amax_over_max": _summary(clipped),
            "seconds": {"histograms": round(t2 - t1, 2), "thresholds": round(t3 - t2, 2),
                        "qdq": round(time.perf_counter() - t3, 2)},
        }
        log(f"{g + '.int8':<22}{len(scales):4d} activations, {info['weights']:3d} weights int8, "
            f"{len(info['float_nodes'])} heads/nodes float   cache {cache.name}   "
            f"{time.perf_counter() - t1:5.1f} s")
    return res


# ---------------------------------------------------------------------------------------------
# 5. accuracy report


VARIANTS = ("pytorch_fp32", "onnx_fp32", "onnx_fp16", "onnx_int8", "copy_last")
_FILES = {"onnx_fp32": "forecaster.onnx", "onnx_fp16": "forecaster.fp16.onnx", "onnx_int8": "forecaster.int8.onnx"}


def _latency_ms(sess, feed: Mapping[str, np.ndarray], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        sess.run(None, dict(feed))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, dict(feed))
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def accuracy_report(trained, out_dir, held_out_windows: int = 64, batch: int = 4, root=None,
                    split: Optional[str] = None, latency_repeats: int = 10) -> dict:
    """IoU / mIoU (percent) per future step on `held_out_windows` windows (0: all) of the run's VAL
    split, evenly spread, for PyTorch FP32, ONNX FP32, FP16 (if forecaster.fp16.onnx exists), INT8
    (forecaster.int8.onnx) and copy-last; drops against PyTorch FP32 (positive = worse) per step and
    averaged; agreement of each model's voxels with PyTorch FP32; onnxruntime latency (ms per
    window at batch 1, median of `latency_repeats` runs) of each ONNX model. JSON-ready."""
    import torch

    from wm.export.onnx import graphs as make_graphs, session
    from wm.metrics import ConfusionMatrix, copy_last

    out_dir = Path(out_dir)
    cfg = trained.cfg
    split = split or cfg.data.val_split
    files = {k: out_dir / f for k, f in _FILES.items()}
    if not files["onnx_fp32"].is_file():
        raise Int8Error(f"{files['onnx_fp32']} does not exist; run the FP32 export first")
    if not files["onnx_int8"].is_file():
        raise Int8Error(f"{files['onnx_int8']} does not exist; run the INT8 step (int8_export) first")
    variants = [v for v in VARIANTS if v not in files or files[v].is_file()]
    ds, idx, root = _windows(trained, root, split, held_out_windows, "--eval-windows")
    S, C, free = cfg.data.future, cfg.data.num_classes, cfg.data.free_class
    cms = {v: ConfusionMatrix(C, free, S) for v in variants}
    agree = {v: [0, 0] for v in variants}
    sessions = {v: session(files[v]) for v in variants if v in files}
    module = make_graphs(trained)["forecaster"][0]
    first_feed = None
    with torch.no_grad():
        for b in _batches(ds, idx, int(batch)):
            occ, motion = b["occ"], b["motion"]
            P = cfg.data.past
            target = torch.from_numpy(occ[:, P:])
            mask = torch.from_numpy(b["mask"][:, P:]) if "mask" in b else None
            feed = _forecaster_feed(cfg, occ, motion)
            if first_feed is None:
                first_feed = {k: v[:1] for k, v in feed.items()}
            preds = {"pytorch_fp32": module(*(torch.from_numpy(x) for x in feed.values()))}
            for v, s in sessions.items():
                preds[v] = torch.from_numpy(s.run(None, feed)[0])
            preds["copy_last"] = copy_last(torch.from_numpy(occ[:, :P]), S)
            ref = preds["pytorch_fp32"]
            for v in variants:
                p = preds[v]
                if tuple(p.shape) != tuple(target.shape):
                    raise Int8Error(f"{v}: forecast shape {tuple(p.shape)}, expected {tuple(target.shape)}")
                cms[v].update(p, target, mask)
                agree[v][0] += int((p == ref).sum())
                agree[v][1] += p.numel()
    rows = {}
    for v in variants:
        s = cms[v].summary()
        rows[v] = {"iou": [_num(x) for x in s["iou"]], "miou": [_num(x) for x in s["miou"]],
                   "iou_avg": _num(s["iou_avg"]), "miou_avg": _num(s["miou_avg"]),
                   "agreement_vs_pytorch": agree[v][0] / max(agree[v][1], 1)}
        if v in files:
            rows[v]["file"] = files[v].name
    ref = rows["pytorch_fp32"]

    def drop(a, b):
        return None if a is None or b is None else float(a - b)

    for v in variants:
        r = rows[v]
        r["drop_iou"] = [drop(a, b) for a, b in zip(ref["iou"], r["iou"])]
        r["drop_miou"] = [drop(a, b) for a, b in zip(ref["miou"], r["miou"])]
        r["drop_iou_avg"] = drop(ref["iou_avg"], r["iou_avg"])
        r["drop_miou_avg"] = drop(ref["miou_avg"], r["miou_avg"])
    for v, s in sessions.items():
        rows[v]["latency_ms"] = round(_latency_ms(s, first_feed, latency_repeats), 3)
    fp = trained.data_fingerprint
    return {"split": split, "windows": int(len(idx)), "data_root": str(root), "future_steps": S,
            "data_fingerprint_matches_checkpoint": (ds.fingerprint == fp) if fp else None,
            "unit": "percent", "metric_mode": "exclude", "batch": int(batch),
            "latency": {"batch": 1, "repeats": int(latency_repeats), "statistic": "median",
                        "runtime": "onnxruntime CPUExecutionProvider", "cpu_threads": os.cpu_count()},
            "models": rows}


def format_report(d: Mapping) -> str:
    """The report as a printable table: IoU and mIoU per future step and averaged, the drops of the
    averages against PyTorch FP32, voxel agreement with it, and latency."""
    S = d["future_steps"]

    def f(x, w=6, p=2):
        return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"

    steps = " ".join(f"{'s' + str(s + 1):>6}" for s in range(S))
    head = (f"{'model':<14} IoU  {steps} {'avg':>6} | mIoU {steps} {'avg':>6} | "
            f"{'dIoU':>6} {'dmIoU':>6} | {'agree':>6} | {'ms/win':>7}")
    lines = [f"held-out: {d['windows']} windows of split {d['split']!r}, IoU/mIoU in percent per future step; "
             f"d = drop vs pytorch_fp32; latency = onnxruntime CPU, batch 1, median",
             head, "-" * len(head)]
    for v, r in d["models"].items():
        iou = " ".join(f(x) for x in r["iou"])
        miou = " ".join(f(x) for x in r["miou"])
        lat = f"{r['latency_ms']:7.2f}" if "latency_ms" in r else f"{'-':>7}"
        lines.append(f"{v:<14}      {iou} {f(r['iou_avg'])} |      {miou} {f(r['miou_avg'])} | "
                     f"{f(r['drop_iou_avg'])} {f(r['drop_miou_avg'])} | {f(r['agreement_vs_pytorch'], 6, 4)} | {lat}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 6. the entry point of export.py --int8


def check_windows(trained, calib_windows: int, eval_windows: int, root=None,
                  split: Optional[str] = None) -> tuple[int, int]:
    """Refuse, in one line (Int8Error), calibration or evaluation window counts the run's splits
    cannot give, before anything long runs (export.py calls it right after loading the run).
    Returns (calibration windows, evaluation windows) that will be used (0 = all of the split)."""
    cfg = trained.cfg
    _, ci, _ = _windows(trained, root, split or cfg.data.train_split, calib_windows, "--calib-windows")
    _, ei, _ = _windows(trained, root, cfg.data.val_split, eval_windows, "--eval-windows")
    return len(ci), len(ei)


def run_int8(trained, out_dir, calib_windows: int = 256, eval_windows: int = 64, batch: int = 4,
             trt_version: str = "10.3.0", log: Callable[[str], None] = print, **kw) -> dict:
    """`export.py --int8` after the FP32 (and FP16) export into `out_dir`: int8_export (Q/DQ ONNX +
    calibration caches of every graph), accuracy_report on the VAL split, `report.json` written
    atomically, the table printed through `log`. Both window counts are checked against their
    splits before the long calibration starts. Returns what report.json holds: {"checkpoint",
    "data_fingerprint", "int8": int8_export's dict, "accuracy": accuracy_report's dict}.

    `kw` goes to int8_export (graphs, root, split, method, exclude_scopes, workers)."""
    out_dir = Path(out_dir)
    check_windows(trained, calib_windows, eval_windows, root=kw.get("root"), split=kw.get("split"))
    q = int8_export(trained, out_dir, calib_windows, batch=batch, trt_version=trt_version, log=log, **kw)
    rep = accuracy_report(trained, out_dir, eval_windows, batch=batch, root=kw.get("root"))
    full = {"checkpoint": str(trained.ckpt), "data_fingerprint": trained.data_fingerprint,
            "int8": q, "accuracy": rep}
    _write_json(out_dir / "report.json", full)
    log(format_report(rep))
    log(f"wrote {out_dir / 'report.json'}")
    return full
