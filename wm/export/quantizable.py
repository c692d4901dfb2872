"""Which nodes and tensors an INT8 graph quantizes, read from the float ONNX graph alone
(docs/EXPORT.md, INT8):

- :func:`quantizable_inputs`: every float tensor that feeds a Conv/ConvTranspose/MatMul/Gemm as a
  data input;
- :func:`output_heads`: the nodes that stay float because their values are the answer;
- :func:`activation_products`: the matrix products of two activations (attention), float by default;
- :func:`pose_path`: the layers of the world model's ego-motion tokens, one vector per frame, float by default;
- :func:`exact_range_tensors`: the inputs whose range is the data's (they take their exact max).

wm.export.qdq writes the Q/DQ graph from these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

from wm.utils.errors import WMError


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
# The world model's pose-token path (by module path): layers that see one vector per frame, not one per
# cell (the pose MLPs, each level's conditioning, the pose layers but for their keys/values of the cells).
POSE_SCOPES = (r"(^|\.)(pose_in|enc_pose|mid_pose|dec_pose|pose_ups|cond)(\.|$)"
               r"|(^|\.)pose\.\d+\.(qkv|proj1|q|proj2|ffn)(\.|$)")
STATE_OUTPUTS = ("new_kv",)  # graph outputs that are state for the next call, not answers (output_heads)
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
            if n.op_type in ("Shape", "Size"):  # a shape, not values (the step's frame counts)
                sources[x] = frozenset()
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
        n = producer.get(_through(t, producer, _VIEW_OPS))
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


def _through(t: str, producer: dict, ops: Sequence[str]) -> str:
    """The tensor `t` is a view of: followed back through producers of the `ops` kinds."""
    while t in producer and producer[t].op_type in ops:
        t = producer[t].input[0]
    return t


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
      motion head, whose output feeds the next rollout step).

    The STATE_OUTPUTS (the world step's key/value cache rows) are not answers but the state the
    next call's attention reads, as the same graph without a cache reads them within one call:
    reaching them makes no head."""
    model = _load(model)
    g = model.graph
    consumers: dict[str, list] = {}
    for n in g.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    outputs = {o.name for o in g.output} - set(STATE_OUTPUTS)
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


def activation_products(model, op_types: Sequence[str] = QUANT_OP_TYPES) -> dict[str, str]:
    """{node name: why} of the MatMul/Gemm nodes none of whose inputs is a weight (an initializer or
    Constant, seen through view ops and Casts): products of two activations, attention's scores
    (Q Kt) and weighted values (A V). They stay float unless asked for: their operands have no
    learned range, and one int8 scale for the attention weights (1/127 at their max, 1.0) rounds
    every weight under 1/254 to zero, which over a cross-attention to thousands of cells can be
    most of them."""
    model = _load(model)
    const = _constants(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    out: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type in ("MatMul", "Gemm") and n.op_type in op_types and \
                not any(_through(t, producer, (*_VIEW_OPS, "Cast")) in const for t in n.input[:2] if t):
            out[n.name] = "product of two activations (attention)"
    return out


def pose_path(model, op_types: Sequence[str] = QUANT_OP_TYPES, scopes: str = POSE_SCOPES) -> dict[str, str]:
    """{node name: why} of the op_types nodes on the world model's pose-token path (module path
    matches `scopes`). They stay float unless asked for: they work on one vector per frame, about
    1/(h*w) of a step's arithmetic, so their INT8 saves no time, while their error reaches every
    cell of the frame alike (each level's conditioning adds the pose tokens to every cell) and does
    not average out over the cells as a per-cell error does."""
    model = _load(model)
    pat = re.compile(scopes)
    out: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type in op_types:
            sc = _scope(n)
            if sc and pat.search(sc):
                out[n.name] = f"ego-motion path, one vector per frame ({sc})"
    return out
