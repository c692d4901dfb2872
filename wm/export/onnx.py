"""ONNX export of a trained run: the three graphs a deployment runs, checked against PyTorch.

Graphs (batch dimension dynamic in all of them):

- `tokenizer_encode.onnx`: occupancy uint8 (B, X, Y, Z) -> codes int64 (B, X/d, Y/d), d =
  tokenizer.downsample (OccWorld's 4).
- `world_step.onnx`: ONE world-model step against a key/value cache (WorldModel.cached_step):
  codes int64 (B, N, h, w) of the frames not yet cached + ego motion float32 (B, T, 3) of every
  frame so far + the cache float32 (B, L, F) -> the next frame's codes (B, h, w), predicted ego
  motion (B, 3) and the new frames' cache rows (B, N, F) (N, T, L dynamic, 1..world.max_frames).
- `tokenizer_decode.onnx`: codes int64 (B, X/d, Y/d) -> logits float32 (B, C, X, Y, Z).

The forecast (past occupancy + motion -> future occupancy) is the host loop of
:mod:`wm.export.deployed` over them: encode the past frames, call `world_step` on them and then once
per further future frame on the frame just predicted (appending its codes and motion, or the given
future motion; the host keeps the cache), decode. Why not one unrolled graph:
at the `occworld` size the encoder + 6 world-model steps + decoder unrolled into one graph took
880 s to export on 2 CPU cores (and > 9 minutes on a 32-core host) and 268 MiB, while the step graph
exports in under a minute (measured in BENCHMARKS.md); the horizon becomes a runtime choice, and
TensorRT builds three small engines instead of one huge one. ONNX `Loop` would keep one file but
hides the step from TensorRT's optimizer and from our INT8 calibration.

Attention is exported in its explicit form (``softmax(q k^T * s) v``: see :func:`explicit_attention`),
what the ONNX exporter decomposes SDPA into anyway, so every tensor that feeds a MatMul is an FX
node of the exported program with the same name: INT8 calibration can then run the PyTorch
program (on the GPU where there is one) and find each ONNX tensor by name.

Every file is written to a temporary name, checked with `onnx.checker`, then renamed: nothing
half-written ever sits under a final name.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from wm.checkpoint.trained import Trained
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.utils.atomic import discard, publish, tmp_path
from wm.utils.errors import WMError


class ExportError(WMError):
    pass


# ---------------------------------------------------------------------------------------------
# what to export


# ---------------------------------------------------------------------------------------------
# graph wrappers: plain modules whose forward is exactly what the graph computes


class Encode(nn.Module):
    def __init__(self, tok: Tokenizer):
        super().__init__()
        self.tok = tok

    def forward(self, occ):
        return self.tok.encode(occ)


class Decode(nn.Module):
    def __init__(self, tok: Tokenizer):
        super().__init__()
        self.tok = tok

    def forward(self, codes):
        return self.tok.decode(codes)


class WorldStep(nn.Module):
    def __init__(self, world: WorldModel):
        super().__init__()
        self.world = world

    def forward(self, codes, motion, kv):
        return self.world.cached_step(codes, motion, kv)


GRAPH_NAMES = ("tokenizer_encode", "world_step", "tokenizer_decode")
OUTPUTS = {"tokenizer_encode": ["codes"], "world_step": ["next_codes", "next_motion", "new_kv"],
           "tokenizer_decode": ["logits"]}
# world_step's dynamic axes, beside the batch: the new frames (N), every frame so far (T), the cache's slots (L)
WORLD_DIMS = {"codes": "new", "motion": "frames", "kv": "slots"}


def example_inputs(t: Trained, batch: int, seed: int = 0, frames: Optional[int] = None,
                   new: Optional[int] = None) -> dict[str, dict[str, torch.Tensor]]:
    """Random but valid inputs of every graph (class ids and codes in range, motion of driving
    size); world_step gets `frames` frames so far (default 4), the last `new` of them (default:
    frames - 2) as codes, the others in its cache of frames - 1 slots (random values: the graph must
    ignore the unwritten one). Three different sizes, so that torch.export ties none of the three
    axes to another, and few slots: a slot is 65 MB a window at the occworld size."""
    cfg, g = t.cfg, torch.Generator().manual_seed(seed)
    X, Y, Z = cfg.data.grid
    C, K = cfg.data.num_classes, cfg.tokenizer.codebook_size
    T = frames or min(4, cfg.world.max_frames)
    N = new or max(1, T - 2)
    h, w = X // cfg.tokenizer.downsample, Y // cfg.tokenizer.downsample
    occ = torch.randint(0, C, (batch, X, Y, Z), generator=g).to(torch.uint8)
    motion = torch.randn(batch, T, 3, generator=g) * torch.tensor([5.0, 0.5, 0.05])
    kv = torch.randn(batch, max(1, T - 1), t.world.kv_width(h, w), generator=g)
    return {"tokenizer_encode": {"occ": occ},
            "world_step": {"codes": torch.randint(0, K, (batch, N, h, w), generator=g), "motion": motion, "kv": kv},
            "tokenizer_decode": {"codes": torch.randint(0, K, (batch, h, w), generator=g)}}


def world_profile(cfg) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of world_step's WORLD_DIMS for a TensorRT profile: tuned for the steps after
    the first (one new frame, a whole forecast's frames and cache)."""
    M = cfg.world.max_frames
    span = min(M, cfg.data.past + cfg.data.future - 1)
    return {"new": (1, 1, M), "frames": (1, span, M), "slots": (1, span, M)}


def world_max_batch(cfg, h: int, w: int, max_batch: int, cache_gib: float = 8.0) -> int:
    """The largest batch of world_step's TensorRT profile: `max_batch`, less where the key/value
    cache at max_frames frames, read (kv) and returned (new_kv), each (B, max_frames, F) float32,
    would pass `cache_gib`: TensorRT sizes an engine's memory for its profile's largest shapes, and
    at the `occworld` size one window's cache is 1 GiB (at 64 windows an engine no GPU holds)."""
    from wm.models.world import kv_row_width

    per_window = 2 * cfg.world.max_frames * kv_row_width(cfg.world, cfg.tokenizer.codebook_size, h, w) * 4
    return max(1, min(int(max_batch), int(cache_gib * 2**30 // per_window)))


def graphs(t: Trained) -> dict[str, nn.Module]:
    """{graph name: the module whose forward is exactly what the graph computes}."""
    return {"tokenizer_encode": Encode(t.tokenizer).eval(), "world_step": WorldStep(t.world).eval(),
            "tokenizer_decode": Decode(t.tokenizer).eval()}


def dynamic_shapes(t: Trained, name: str, inputs: dict, max_batch: int) -> tuple:
    """torch.export dims of a graph's inputs: the batch everywhere, WORLD_DIMS on world_step's axis 1."""
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    if name == "world_step":
        return tuple({0: batch, 1: torch.export.Dim(WORLD_DIMS[k], min=1, max=t.cfg.world.max_frames)}
                     for k in inputs)
    return tuple({0: batch} for _ in inputs)


# ---------------------------------------------------------------------------------------------
# export, check, compare


@contextlib.contextmanager
def _exporter_quiet():
    """Silence the exporter's chatter that says nothing about our graphs (torchvision ops it skips,
    pytree deprecations, a dynamic-axis naming note); real errors still raise."""
    import logging
    import warnings

    lg = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=r".*axis name.*will not be used")
            yield
    finally:
        lg.setLevel(level)


@contextlib.contextmanager
def explicit_attention():
    """While exporting, F.scaled_dot_product_attention is traced as ``softmax(q k^T * s + mask) v``:
    the same math the ONNX exporter decomposes SDPA into, but as FX nodes, so the tensors feeding
    its two MatMuls (q * s, k^T, the softmax) carry FX names in the ONNX graph and the PyTorch
    calibration path finds them (wm.export.collect). Restored on exit."""
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        s = q.shape[-1] ** -0.5 if scale is None else scale
        a = (q * s) @ k.transpose(-2, -1)
        if is_causal:
            L, S = q.shape[-2], k.shape[-2]
            a = a.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if attn_mask is not None:
            a = a.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else a + attn_mask
        return a.softmax(-1) @ v

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def save_checked(model, path: Path, full_check: bool = True) -> None:
    """Write an ONNX model to `path` atomically, after onnx.checker's check (with shape and type
    inference where `full_check`) of the written file; on any failure nothing is left at `path` or
    beside it (the caller words the error)."""
    import onnx

    tmp = tmp_path(Path(path))
    try:
        onnx.save(model, str(tmp))
        onnx.checker.check_model(str(tmp), full_check=full_check)
        publish(tmp, path)
    finally:
        discard(tmp)


def export_graph(module: nn.Module, inputs: dict[str, torch.Tensor], outputs: list[str], path: Path,
                 dynamic: tuple, quiet: bool = True):
    """torch.onnx.export (dynamo) with the `dynamic` dims (:func:`dynamic_shapes`), checked, written
    atomically. Returns (seconds, the torch.export program the graph was translated from: its FX
    node names are the ONNX tensor names, see wm.export.collect)."""
    path = Path(path)
    t0 = time.perf_counter()
    sink = io.StringIO()
    try:
        with torch.no_grad(), explicit_attention(), \
                contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext(), \
                _exporter_quiet() if quiet else contextlib.nullcontext():
            prog = torch.onnx.export(module, tuple(inputs.values()), input_names=list(inputs),
                                     output_names=outputs, dynamic_shapes=dynamic, dynamo=True,
                                     external_data=False, optimize=True)
        model = prog.model_proto
        fold_weight_transposes(model)
        save_checked(model, path)
    except OSError as e:
        raise ExportError(f"cannot write {path}: {e}") from None
    except Exception as e:
        if isinstance(e, WMError):
            raise
        raise ExportError(f"exporting {path.name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    return time.perf_counter() - t0, prog.exported_program


def fold_weight_transposes(model) -> int:
    """Replace every Transpose of an initializer by the transposed initializer, in place; returns
    how many. The exporter leaves `Transpose(W)` in front of a MatMul where W is large (onnxscript's
    constant folding skips big tensors), e.g. every linear layer the rollout reuses. Downstream that
    would make W an activation: the INT8 step would calibrate it per tensor like data (clipping
    weights) instead of quantizing it per channel as a weight. TensorRT would fold it anyway."""
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    folded = []
    for n in g.node:
        if n.op_type == "Transpose" and len(n.input) == 1 and n.input[0] in inits:
            w = numpy_helper.to_array(inits[n.input[0]])
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(np.transpose(w, perm)), n.output[0]))
            folded.append(n)
    if not folded:
        return 0
    for n in folded:
        g.node.remove(n)
    done = {n.output[0] for n in folded}
    keep_vi = [vi for vi in g.value_info if vi.name not in done]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    used = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    unused = [i for i in g.initializer if i.name not in used]
    for i in unused:
        g.initializer.remove(i)
    return len(folded)


def fp16_model(model):
    """The FP16 copy of a float ONNX model, inputs and outputs in their own types: onnxruntime's
    converter, then two repairs. Before onnxruntime 1.31 the converter adds one Cast per use when a
    float16 tensor feeds several ops it keeps in float32, all writing the same `<x>_cast_to_fp32`:
    a graph that is not SSA, which the checker and onnxruntime refuse (seen with 1.30). Identical
    duplicates are dropped here. It also appends those casts at the end, so the nodes are sorted."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    m = convert_float_to_float16(model, keep_io_types=True)
    dedupe_nodes(m)
    om = OnnxModel(m)
    om.topological_sort()
    return om.model


def dedupe_nodes(model) -> int:
    """Drop each node that writes an output an earlier node already writes, where both are the same
    op on the same inputs with the same attributes (so the copy computes the same value); returns
    how many nodes went. Two *different* writers of one name are a broken graph that is left for
    the checker to name. value_info keeps one entry per tensor that a node writes: the 1.30
    converter also leaves entries for initializers, some typed float16 where the initializer
    stayed float32, which the full checker refuses (value_info is only a hint; onnxruntime and
    TensorRT infer those types anyway)."""
    g = model.graph
    seen: dict[str, tuple] = {}
    keep_nodes = []
    for n in g.node:
        key = (n.op_type, n.domain, tuple(n.input), tuple(a.SerializeToString() for a in n.attribute))
        outs = [o for o in n.output if o]
        if outs and all(o in seen and seen[o] == key for o in outs):
            continue
        for o in outs:
            seen.setdefault(o, key)
        keep_nodes.append(n)
    dropped = len(g.node) - len(keep_nodes)
    if dropped:  # by position: RepeatedField.remove would drop the first *equal* node, the original
        keep_nodes = [type(n).FromString(n.SerializeToString()) for n in keep_nodes]
        del g.node[:]
        g.node.extend(keep_nodes)
    names, keep = set(), []
    for vi in g.value_info:
        if vi.name not in names and vi.name in seen:
            names.add(vi.name)
            keep.append(vi)
    if len(keep) != len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(keep)
    return dropped


def session(path: Path, threads: int = 0, qdq_in_float: bool = False):
    """An onnxruntime CPU session. Its memory arena is off: with it, each session keeps the largest
    activations it ever held, and the report holds a session per graph and row (FP32, FP16, INT8),
    which at the occworld size reached 17.9 GiB of host memory (BENCHMARKS.md). Without it the
    memory of a run is freed when the run ends. `qdq_in_float`: no Q/DQ fusion into integer kernels,
    so a Q/DQ graph computes its ONNX semantics (float ops on dequantized values), what TensorRT
    computes from it, on every CPU."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = False
    so.log_severity_level = 3  # its notes on its own graph optimisations (constant folding) are not the user's
    if qdq_in_float:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def compare(module: nn.Module, path: Path, inputs: dict[str, torch.Tensor]) -> dict:
    """Run the graph in onnxruntime and the module in PyTorch on the same inputs: class agreement
    (integer outputs: fraction equal; logits: fraction of equal argmax over classes; the lowest over
    the outputs) and the max absolute difference of float outputs (None if there are none)."""
    sess = session(path)
    got = sess.run(None, {k: v.numpy() for k, v in inputs.items()})
    with torch.no_grad():
        ref = module(*inputs.values())
    ref = [r.numpy() for r in (ref if isinstance(ref, (tuple, list)) else (ref,))]
    agree, diff = 1.0, None
    for g, r in zip(got, ref):
        if g.shape != r.shape:
            raise ExportError(f"{path.name}: onnxruntime gives shape {g.shape}, PyTorch {r.shape}")
        if np.issubdtype(r.dtype, np.floating):
            d = float(np.abs(g.astype(np.float64) - r).max())
            diff = d if diff is None else max(diff, d)
            if r.ndim >= 2 and r.shape[1] > 1 and r.ndim > 2:  # logits: classes on axis 1
                agree = min(agree, float((g.argmax(1) == r.argmax(1)).mean()))
        else:
            agree = min(agree, float((g == r).mean()))
    return {"class_agreement": agree, "max_abs_diff": diff}
