"""The deployed forecast: past occupancy + ego motion -> future occupancy, as a host loop over the
three exported graphs (``tokenizer_encode``, ``world_step``, ``tokenizer_decode``; see
wm.export.onnx), and the engines that run those graphs.

:func:`forecast` is the loop a deployment runs: encode the P past frames, call ``world_step`` once per
future frame on the frames so far (the last ``world.max_frames`` of them), append its codes and
motion (or the given future motion), then decode the forecast codes and take the argmax. It is the
same computation as ``WorldModel.rollout`` (tested equal), whatever runs the graphs:

- :class:`TorchGraphs`: the PyTorch modules themselves (the FP32 reference; FP16 under autocast), on
  any device;
- :class:`OrtGraphs`: the ONNX files in onnxruntime (CPU): FP32, FP16 and the Q/DQ INT8 graphs as
  they are;
- :class:`ProgramGraphs`: the torch.export programs the ONNX files were translated from, run node by
  node (torch.fx.Interpreter) on any device, with two hooks: ``taps`` sees the value of every named
  node that an ONNX tensor of interest has the name of (INT8 calibration at GPU speed,
  wm.export.collect), and ``qdq`` applies a Q/DQ graph's quantization to the inputs and weights of
  the nodes it quantizes (INT8 accuracy at GPU speed, checked against onnxruntime running the Q/DQ
  file itself).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from torch import Tensor

# graph name -> run(graph name, *inputs) -> tuple of outputs (torch tensors on the engine's device)
RunGraph = Callable[..., tuple]


def forecast(run: RunGraph, cfg, past_occ: Tensor, past_motion: Tensor, future_motion: Optional[Tensor] = None,
             decode_chunk: int = 8) -> Tensor:
    """past_occ uint8 (B, P, X, Y, Z), past_motion (B, P, 3)[, future_motion (B, S, 3) when the run
    forecasts with given motion] -> future occupancy uint8 (B, S, X, Y, Z), S = data.future.
    Frames are decoded `decode_chunk` at a time (the logits of one occworld frame are 46 MB)."""
    B, P = past_occ.shape[:2]
    S, maxf = cfg.data.future, cfg.world.max_frames
    codes = run("tokenizer_encode", past_occ.reshape(B * P, *past_occ.shape[2:]))[0]
    codes = codes.reshape(B, P, *codes.shape[1:]).long()
    motion = past_motion.float()
    for s in range(S):
        nxt, m = run("world_step", codes[:, -maxf:], motion[:, -maxf:])
        if future_motion is not None:
            m = future_motion[:, s]
        codes = torch.cat([codes, nxt.long()[:, None]], 1)
        motion = torch.cat([motion, m.float().to(motion.device)[:, None]], 1)
    fut = codes[:, P:].reshape(B * S, *codes.shape[2:])
    out = [run("tokenizer_decode", fut[i:i + decode_chunk])[0].argmax(1).to(torch.uint8)
           for i in range(0, len(fut), decode_chunk)]
    occ = torch.cat(out)
    return occ.reshape(B, S, *occ.shape[1:])


class TorchGraphs:
    """The graphs as their PyTorch modules (wm.export.onnx.graphs) on `device`; `fp16=True` runs
    them under float16 autocast (what an FP16 engine computes, up to which ops stay float)."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], device="cpu", fp16: bool = False):
        self.device = torch.device(device)
        self.modules = {k: m.to(self.device) for k, m in modules.items()}
        self.fp16 = fp16

    @torch.no_grad()
    def __call__(self, name: str, *inputs: Tensor) -> tuple:
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.fp16):
            out = self.modules[name](*(x.to(self.device) for x in inputs))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class OrtGraphs:
    """The graphs as ONNX files in onnxruntime: {graph name: path}; inputs and outputs as CPU torch
    tensors. One session per file, made on first use. `qdq_in_float`: Q/DQ graphs run as their ONNX
    semantics, not onnxruntime's integer kernels (wm.export.onnx.session)."""

    def __init__(self, files: Mapping[str, Path], threads: int = 0, qdq_in_float: bool = False):
        self.files, self.threads, self.sessions = dict(files), threads, {}
        self.qdq_in_float = qdq_in_float

    def session(self, name: str):
        if name not in self.sessions:
            from wm.export.onnx import session

            self.sessions[name] = session(self.files[name], self.threads, self.qdq_in_float)
        return self.sessions[name]

    def __call__(self, name: str, *inputs: Tensor) -> tuple:
        s = self.session(name)
        feed = {i.name: x.detach().cpu().numpy() for i, x in zip(s.get_inputs(), inputs)}
        return tuple(torch.from_numpy(np.ascontiguousarray(o)) for o in s.run(None, feed))


# ---------------------------------------------------------------------------------------------
# the exported programs, node by node


def fx_name(onnx_node) -> Optional[str]:
    """The FX node an ONNX node was translated from (the exporter's ``pkg.torch.onnx.fx_node``
    metadata, '%name : ...'), or None."""
    for p in onnx_node.metadata_props:
        if p.key == "pkg.torch.onnx.fx_node":
            m = re.match(r"%(\S+) :", p.value)
            return m.group(1) if m else None
    return None


# the zero point of the symmetric grid [-128, 127] in each integer type
_SYMMETRIC = {"int8": 0, "uint8": 128}


def fake_quant(x: Tensor, scale: float) -> Tensor:
    """ONNX QuantizeLinear -> DequantizeLinear, int8 with zero point 0 (or uint8 with 128, the same
    grid): round half to even, saturate."""
    return torch.clamp(torch.round(x.float() / scale), -128, 127).mul_(scale).to(x.dtype)


class QdqPlan:
    """What a Q/DQ ONNX graph quantizes, in the exported program's terms: for each quantized node
    (by FX name) the activation scales of its data inputs (by FX name) and its dequantized weight.
    Built from the Q/DQ file itself, so the emulation is of that file (scales bit for bit, weights
    the file's int8 values times its scales)."""

    def __init__(self, qdq_model):
        from onnx import numpy_helper

        g = qdq_model.graph
        inits = {i.name: i for i in g.initializer}
        prod = {o: n for n in g.node for o in n.output}
        self.acts: dict[str, dict[str, float]] = {}  # fx node -> {input fx name: scale}
        self.weights: dict[str, np.ndarray] = {}  # fx node -> dequantized weight (ONNX layout)
        self.unmapped: list[str] = []

        def arr(name):
            return numpy_helper.to_array(inits[name]) if name in inits else None

        for n in g.node:
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                continue
            acts, weight = {}, None
            for k, t in enumerate(n.input):
                dq = prod.get(t)
                if dq is None or dq.op_type != "DequantizeLinear":
                    continue
                q = prod.get(dq.input[0])
                if q is not None and q.op_type == "QuantizeLinear":  # an activation
                    z = arr(q.input[2]) if len(q.input) > 2 else None
                    if z is None or int(np.asarray(z).reshape(-1)[0]) != _SYMMETRIC.get(np.asarray(z).dtype.name):
                        raise ValueError(f"activation {q.input[0]!r}: zero point {z}, not the symmetric int8 grid "
                                         "(int8 0 or uint8 128) that fake_quant emulates")
                    acts[q.input[0]] = float(np.float32(arr(q.input[1])).reshape(-1)[0])
                elif dq.input[0] in inits and k == 1:  # an int8 (or uint8, zero point 128) weight, per channel
                    w, s = arr(dq.input[0]).astype(np.float32), np.asarray(arr(dq.input[1]), np.float32)
                    z = np.asarray(arr(dq.input[2]), np.float32) if len(dq.input) > 2 else np.zeros(1, np.float32)
                    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
                    shape = [1] * w.ndim
                    shape[axis] = -1
                    weight = (w - (z.reshape(shape) if z.size > 1 else z)) * (s.reshape(shape) if s.size > 1 else s)
            if not acts and weight is None:
                continue
            fx = fx_name(n)
            if fx is None:
                self.unmapped.append(n.name)
                continue
            self.acts[fx] = acts
            if weight is not None:
                self.weights[fx] = weight

    def same_values(self, other: "QdqPlan") -> bool:
        """Whether both plans quantize the same nodes with the same scales and dequantized weights
        (then their emulations compute the same, bit for bit)."""
        return (self.acts == other.acts and self.weights.keys() == other.weights.keys()
                and all(np.array_equal(w, other.weights[k]) for k, w in self.weights.items()))


class _Interpreter(torch.fx.Interpreter):
    def __init__(self, gm, device, taps=None, plan: Optional[QdqPlan] = None, wcache=None):
        super().__init__(gm, garbage_collect_values=True)
        self.device, self.taps, self.plan, self.wcache = device, taps, plan, wcache

    def call_function(self, target, args, kwargs):
        if "device" in kwargs:  # tensors the program creates (masks, ranges) follow the run's device
            kwargs = {**kwargs, "device": self.device}
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        if self.plan is not None and n.name in self.plan.acts:
            return self._quantized(n)
        out = super().run_node(n)
        if self.taps is not None and isinstance(out, Tensor):
            self.taps(n.name, out)
        return out

    def _quantized(self, n):
        """Run node n on fake-quantized data inputs and its dequantized weight, as the Q/DQ graph does."""
        scales = self.plan.acts[n.name]
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args = list(args)
            for i, a in enumerate(n.args):
                if isinstance(a, torch.fx.Node) and a.name in scales:
                    args[i] = fake_quant(args[i], scales[a.name])
            if n.name in self.plan.weights:
                args[1] = self._weight(n, args[1])
            out = getattr(self, n.op)(n.target, tuple(args), kwargs)
        if self.taps is not None and isinstance(out, Tensor):
            self.taps(n.name, out)
        return out

    def _weight(self, n, w: Tensor) -> Tensor:
        """The Q/DQ file's dequantized weight in the layout node n takes: aten.linear holds W where
        the ONNX MatMul holds W^T (square ones too); convolutions hold the same layout."""
        if n.name not in self.wcache:
            q = torch.from_numpy(self.plan.weights[n.name])
            target = str(n.target)
            if "linear" in target:
                q = q.T
            elif "convolution" not in target and "conv" not in target:
                raise ValueError(f"no rule for the quantized weight of {n.name} ({target})")
            if tuple(q.shape) != tuple(w.shape):
                raise ValueError(f"quantized weight of {n.name} has shape {tuple(q.shape)}, its tensor {tuple(w.shape)}")
            self.wcache[n.name] = q.contiguous().to(w.device, w.dtype)
        return self.wcache[n.name]


class ProgramGraphs:
    """The exported programs ({graph name: torch.export.ExportedProgram}, as export_graph returned
    them) run node by node on `device`. `taps(graph, node name, value)` is called with every node's
    output; `plans` ({graph name: QdqPlan}) fake-quantizes what that graph's Q/DQ file quantizes."""

    def __init__(self, programs: Mapping, device="cpu", taps: Optional[Callable] = None,
                 plans: Optional[Mapping[str, QdqPlan]] = None):
        self.device = torch.device(device)
        self.gms = {}
        for k, ep in programs.items():
            gm = ep.module().to(self.device)
            for n in gm.graph.nodes:  # lifted constants (e.g. new_tensor([...])) are plain attributes
                if n.op == "get_attr":
                    *path, leaf = n.target.split(".")
                    owner = gm.get_submodule(".".join(path)) if path else gm
                    v = getattr(owner, leaf)
                    if isinstance(v, torch.Tensor) and v.device != self.device:
                        setattr(owner, leaf, v.to(self.device))
            self.gms[k] = gm
        self.taps, self.plans = taps, dict(plans or {})
        self.wcache: dict[str, dict] = {k: {} for k in self.gms}

    def node_names(self, name: str) -> set[str]:
        return {n.name for n in self.gms[name].graph.nodes}

    @torch.no_grad()
    def __call__(self, name: str, *inputs: Tensor) -> tuple:
        tap = (lambda n, v: self.taps(name, n, v)) if self.taps is not None else None
        it = _Interpreter(self.gms[name], self.device, tap, self.plans.get(name), self.wcache[name])
        out = it.run(*(x.to(self.device) for x in inputs))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
