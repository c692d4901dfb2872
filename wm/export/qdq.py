"""The Q/DQ ONNX of a float graph, with the nodes and tensors wm.export.quantizable chose
(docs/ARCHITECTURE.md).

- :func:`quantize_qdq`: onnxruntime's Q/DQ quantizer (``quantize_static``'s, without its calibration
  run) does the graph work with every activation scale given as a ``TensorQuantOverrides``
  override; weights per-channel symmetric int8 (its own min/max), bias left float; Softmax,
  normalisation, Gather/embeddings, Einsum, the output heads, the products of two activations and
  every other op stay float: only the data inputs of the quantized Conv/ConvTranspose/MatMul/Gemm
  nodes carry a QuantizeLinear -> DequantizeLinear pair (one pair per consuming node, as TensorRT
  wants). The written graph is re-read and checked: each scale must equal ours bit for bit
  (float32), and no float op may read a dequantized tensor.
- :func:`cpu_copy`: onnxruntime's copy of a Q/DQ graph, its int8 tensors held as uint8.

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
import logging
import math
import os
from collections.abc import Sequence, Mapping
from pathlib import Path

import numpy as np

from wm.export.calib import scale_from_amax
from wm.export.onnx import save_checked
from wm.export.quantizable import (FLOAT_OP_TYPES, QUANT_OP_TYPES, Int8Error, _data_input_slots, _load, _one_line,
    activation_products, output_heads, pose_path, quantizable_inputs)
from wm.utils.errors import WMError


# ---------------------------------------------------------------------------------------------
# the Q/DQ graph


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
                 nodes_to_exclude: Sequence[str] = (), exclude_heads: bool = True,
                 exclude_products: bool = True, exclude_pose: bool = True) -> dict:
    """Write a Q/DQ ONNX of `onnx_path` to `out_path` with OUR activation scales.

    Activations: per-tensor symmetric int8, scale = thresholds[name] / 127, zero point 0, for every
    data input of every `op_types` node that is quantized. Weights: per-channel symmetric int8.
    Bias: float. Stay float (no Q/DQ on any of their inputs): `exclude_op_types` and every other
    op, the output heads (:func:`output_heads`, if `exclude_heads`), the products of two activations
    (:func:`activation_products`, if `exclude_products`), the pose-token path (:func:`pose_path`, if
    `exclude_pose`), `nodes_to_exclude`, and any
    op_types node with a data input that has no positive finite threshold. onnxruntime's
    quantizer does the graph work (:func:`_ort_qdq`); the result is re-read and checked (scales equal ours as
    float32, no float op reads a DQ output), checked with onnx.checker and written atomically.

    Returns {"quantized_nodes": [...], "float_nodes": {name: why}, "scales": {tensor: scale},
    "weights": n, "rewired": n}."""
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
    if exclude_products:
        for name, why in activation_products(model, op_types).items():
            float_nodes.setdefault(name, why)
    if exclude_pose:
        for name, why in pose_path(model, op_types).items():
            float_nodes.setdefault(name, why)
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
    try:
        q = _ort_qdq(onnx_path, scales, quantized, sorted(float_nodes), op_types, extra)
        rewired = _float_consumers_back(q, model, qset)
        _check_qdq(q, model, qset, scales, tensors, op_types, exclude_op_types, out_path.name)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        save_checked(q, out_path)
    except OSError as e:
        raise Int8Error(f"cannot write {out_path}: {e}") from None
    except Exception as e:
        if isinstance(e, WMError):
            raise
        raise Int8Error(f"quantizing {onnx_path.name} failed: {_one_line(e)}") from e
    n_weights = len(qdq_scales(q)["weights"])
    return {"quantized_nodes": quantized, "float_nodes": float_nodes,
            "scales": {t: float(s) for t, s in scales.items()}, "weights": n_weights, "rewired": rewired}


def cpu_copy(qdq_path, out_path) -> int:
    """Write the onnxruntime copy of a Q/DQ graph to `out_path`: the same graph, scales and values,
    with every int8 tensor held as uint8 with zero point 128 (u = q + 128: the same grid, so the same
    ONNX semantics, bit for bit after dequantization). onnxruntime fuses DequantizeLinear -> MatMul
    into its integer kernels; its u8 x s8 form (what int8 x int8 runs as) on x86 CPUs without VNNI
    adds pairs of products in int16 and saturates, its u8 x u8 form widens before it multiplies and
    is exact on every x86 CPU. Returns the number of weights converted."""
    from onnx import TensorProto, numpy_helper

    q = _load(qdq_path)
    g = q.graph
    inits = {i.name: i for i in g.initializer}
    name = Path(qdq_path).name
    zps, weights = set(), set()
    for n in g.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if len(n.input) < 3 or n.input[2] not in inits:
            raise Int8Error(f"{name}: {n.op_type} {n.name!r} has no zero point initializer; "
                            "not a Q/DQ graph of export.py --int8")
        zps.add(n.input[2])
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            weights.add(n.input[0])
    for n in g.node:  # a tensor read as int8 by another op would change meaning
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        shared = [t for t in n.input if t in zps or t in weights]
        if shared:
            raise Int8Error(f"{name}: {n.op_type} {n.name!r} reads the quantized tensor {shared[0]!r} directly")
    for t in sorted(zps):
        z = numpy_helper.to_array(inits[t])
        if z.dtype != np.int8 or z.any():
            raise Int8Error(f"{name}: zero point {t!r} is {z.dtype} {z.reshape(-1)[:3].tolist()}, want int8 0 "
                            "(symmetric); not a Q/DQ graph of export.py --int8")
        inits[t].CopyFrom(numpy_helper.from_array(np.full(z.shape, 128, np.uint8), t))
    for t in sorted(weights):
        w = numpy_helper.to_array(inits[t])
        if w.dtype != np.int8:
            raise Int8Error(f"{name}: weight {t!r} is {w.dtype}, want int8")
        inits[t].CopyFrom(numpy_helper.from_array((w.astype(np.int16) + 128).astype(np.uint8), t))
    for v in g.value_info:  # the quantized activations' declared type follows
        if v.type.tensor_type.elem_type == TensorProto.INT8:
            v.type.tensor_type.elem_type = TensorProto.UINT8
    try:
        save_checked(q, Path(out_path))
    except OSError as e:
        raise Int8Error(f"cannot write {out_path}: {e}") from None
    return len(weights)


def _on_int8_grid(x: np.ndarray) -> np.ndarray:
    # int8 q and uint8 q + 128 (cpu_copy's form) read alike, so the two files compare value by value
    return x.astype(np.int16) - (128 if x.dtype == np.uint8 else 0) if x.dtype in (np.uint8, np.int8) else x


def same_values(a, b) -> bool:
    """Whether two Q/DQ graphs compute the same: the same nodes (types, wiring, attributes) and every
    initializer equal once int8 tensors and uint8 ones with zero point 128 are both read on the int8
    grid (a TensorRT file and its cpu_copy: True)."""
    from onnx import numpy_helper

    ga, gb = _load(a).graph, _load(b).graph

    def nodes(g):
        return [(n.op_type, list(n.input), list(n.output), [x.SerializeToString() for x in n.attribute]) for n in g.node]

    ia, ib = {i.name: i for i in ga.initializer}, {i.name: i for i in gb.initializer}
    if nodes(ga) != nodes(gb) or ia.keys() != ib.keys():
        return False
    return all(np.array_equal(_on_int8_grid(numpy_helper.to_array(ia[k])), _on_int8_grid(numpy_helper.to_array(ib[k])))
               for k in ia)


def _ort_qdq(onnx_path: Path, scales: Mapping[str, np.float32], nodes: Sequence[str], float_nodes: Sequence[str],
             op_types: Sequence[str], extra: dict):
    """onnxruntime's Q/DQ quantizer (what quantize_static runs) on the graph, with every activation
    range given: quantize_static would first run the graph with every tensor to quantize as an
    output, only to compute ranges that our scale overrides replace (3 of the 4.4 GiB peak at the
    occworld size)."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

    ranges = TensorsData(CalibrationMethod.MinMax, {t: TensorData(lowest=np.float32(-127 * s), highest=np.float32(127 * s))
                                                   for t, s in scales.items()})
    ort_log = logging.getLogger()
    level = ort_log.level
    try:
        ort_log.setLevel(logging.ERROR)  # the quantizer warns about pre-processing
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            qz = QDQQuantizer(load_model_with_shape_infer(Path(onnx_path)), True, False, QuantType.QInt8,
                              QuantType.QInt8, ranges, list(nodes), list(float_nodes), list(op_types), extra)
            qz.quantize_model()
            qz.model.topological_sort()  # as quantize_static's save does
    finally:
        ort_log.setLevel(level)
    return qz.model.model


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
