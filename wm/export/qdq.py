"""Q/DQ graph work: which tensors an INT8 graph quantizes, which nodes stay float, and the Q/DQ ONNX
itself (docs/ARCHITECTURE.md).

- :func:`quantizable_inputs`: every float tensor that feeds a Conv/ConvTranspose/MatMul/Gemm as a
  data input; :func:`output_heads`: the nodes that stay float because their values are the answer;
  :func:`exact_range_tensors`: the inputs whose range is the data's (they take their exact max).
- :func:`quantize_qdq`: onnxruntime's Q/DQ quantizer (``quantize_static``'s, without its calibration
  run) does the graph work with
  every activation scale given as a ``TensorQuantOverrides`` override; weights per-channel
  symmetric int8 (its own min/max), bias left float; Softmax, normalisation, Gather/embeddings,
  Einsum, the output heads and every other op stay float: only the data inputs of the quantized
  Conv/ConvTranspose/MatMul/Gemm nodes carry a QuantizeLinear -> DequantizeLinear pair (one pair
  per consuming node, as TensorRT wants). The written graph is re-read and checked: each scale
  must equal ours bit for bit (float32), and no float op may read a dequantized tensor.

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
import re
from collections.abc import Iterable, Sequence, Mapping
from pathlib import Path
from typing import Optional

import numpy as np

from wm.errors import WMError
from wm.export.calib import scale_from_amax
from wm.export.onnx import save_checked

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
      at 0.41 of the max, the forecast lost a further 0.7 IoU points on the last steps);
    - outputs of a Softmax (attention weights), seen through view ops: probabilities, whose range is
      [0, 1] by construction. Most of them are near 0, so an entropy cut-off lands far below the
      largest weight and saturates every sharp one: the attention the world model forecasts with.

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
        if n is not None and n.op_type == "Softmax":
            out[t] = f"probabilities of {n.name or 'a Softmax'}"
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
# 3. Q/DQ graph


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
                 nodes_to_exclude: Sequence[str] = (), exclude_heads: bool = True) -> dict:
    """Write a Q/DQ ONNX of `onnx_path` to `out_path` with OUR activation scales.

    Activations: per-tensor symmetric int8, scale = thresholds[name] / 127, zero point 0, for every
    data input of every `op_types` node that is quantized. Weights: per-channel symmetric int8.
    Bias: float. Stay float (no Q/DQ on any of their inputs): `exclude_op_types` and every other
    op, the output heads (:func:`output_heads`, if `exclude_heads`), `nodes_to_exclude`, and any
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
