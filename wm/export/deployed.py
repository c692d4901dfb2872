"""The deployed forecast: past occupancy + ego motion -> future occupancy, as a host loop over the
three exported graphs (``tokenizer_encode``, ``world_step``, ``tokenizer_decode``; see
wm.export.onnx), and the engines that run those graphs.

:func:`forecast` is the loop a deployment runs: encode the P past frames, roll ``world_step`` over
the future frames (:func:`world_steps`: the past frames in the first call, then each predicted
frame against the key/value cache the loop keeps), append its codes and motion (or the given future
motion), then decode the forecast codes and take the argmax. It is the
same computation as ``WorldModel.rollout`` (tested equal), whatever runs the graphs:

- :class:`TorchGraphs`: the PyTorch modules themselves (the FP32 reference; FP16 under autocast), on
  any device;
- :class:`OrtGraphs`: the ONNX files in onnxruntime (CPU): FP32, FP16 and the Q/DQ INT8 graphs as
  they are;
- :class:`ProgramGraphs`: the torch.export programs the ONNX files were translated from, run node by
  node (torch.fx.Interpreter) on any device, with a hook, ``taps``, that sees the value of every
  named node that an ONNX tensor of interest has the name of (INT8 calibration at GPU speed,
  wm.export.collect).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from wm.models.world import kv_row_width

# graph name -> run(graph name, *inputs) -> tuple of outputs (torch tensors on the engine's device)
RunGraph = Callable[..., tuple]


def world_steps(run: RunGraph, cfg, codes: Tensor, motion: Tensor, steps: int,
                future_motion: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The world model's rollout over ``world_step`` calls: codes (B, P, h, w), motion (B, P, 3) of
    the past frames -> (codes (B, P + steps, h, w), motion (B, P + steps, 3)), the past frames first.

    The graph takes the frames not yet in its key/value cache and returns their cache rows
    (wm.models.world.PackedCache): the first call runs the P past frames, each later call only the frame
    the one before predicted (P + steps - 1 frame passes, not P + (P + 1) + ...). The host keeps the
    cache, one (B, L, F) tensor, L = the frames it must hold, and writes each call's rows at their
    slots. Past max_frames frames the window slides, every frame's position changes, and each step
    runs the last max_frames frames on an empty cache instead (what WorldModel.rollout does then)."""
    B, P, h, w = codes.shape
    maxf = cfg.world.max_frames
    slots = max(1, min(maxf, P + steps - 2))  # the last call's rows are never read
    kv_width = kv_row_width(cfg.world, cfg.tokenizer.codebook_size, h, w)
    kv = torch.zeros(B, 1, kv_width, device=codes.device)  # the first call reads no slot
    codes, motion, new, pos = codes.long(), motion.float(), codes.long(), 0
    for s in range(steps):
        if motion.shape[1] > maxf:  # slid: no frame keeps its position, nothing cached holds
            new, pos = codes[:, -maxf:], 0
        nxt, m, rows = run("world_step", new, motion[:, -maxf:], kv)
        if kv.shape[1] < slots:  # the cache lives where the graph's engine put its rows: no copy a step
            kv = torch.zeros(B, slots, kv_width, device=rows.device)
        n = new.shape[1]
        if pos + n <= kv.shape[1]:
            kv[:, pos:pos + n] = rows
        pos += n
        if future_motion is not None:
            m = future_motion[:, s]
        new = nxt.long().to(codes.device)[:, None]
        codes = torch.cat([codes, new], 1)
        motion = torch.cat([motion, m.float().to(motion.device)[:, None]], 1)
    return codes, motion


def forecast(run: RunGraph, cfg, past_occ: Tensor, past_motion: Tensor, future_motion: Optional[Tensor] = None,
             decode_chunk: int = 8) -> Tensor:
    """past_occ uint8 (B, P, X, Y, Z), past_motion (B, P, 3)[, future_motion (B, S, 3) when the run
    forecasts with given motion] -> future occupancy uint8 (B, S, X, Y, Z), S = data.future.
    Frames are decoded `decode_chunk` at a time (the logits of one occworld frame are 46 MB)."""
    B, P = past_occ.shape[:2]
    S = cfg.data.future
    codes = run("tokenizer_encode", past_occ.reshape(B * P, *past_occ.shape[2:]))[0]
    codes = codes.reshape(B, P, *codes.shape[1:]).long()
    codes, _ = world_steps(run, cfg, codes, past_motion, S, future_motion)
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


class _Interpreter(torch.fx.Interpreter):
    def __init__(self, gm, device, taps=None):
        super().__init__(gm, garbage_collect_values=True)
        self.device, self.taps = device, taps

    def call_function(self, target, args, kwargs):
        if "device" in kwargs:  # tensors the program creates (masks, ranges) follow the run's device
            kwargs = {**kwargs, "device": self.device}
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        out = super().run_node(n)
        if self.taps is not None and isinstance(out, Tensor):
            self.taps(n.name, out)
        return out


class ProgramGraphs:
    """The exported programs ({graph name: torch.export.ExportedProgram}, as export_graph returned
    them) run node by node on `device`. `taps(graph, node name, value)` is called with every node's
    output."""

    def __init__(self, programs: Mapping, device="cpu", taps: Optional[Callable] = None):
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
        self.taps = taps

    def node_names(self, name: str) -> set[str]:
        return {n.name for n in self.gms[name].graph.nodes}

    @torch.no_grad()
    def __call__(self, name: str, *inputs: Tensor) -> tuple:
        tap = (lambda n, v: self.taps(name, n, v)) if self.taps is not None else None
        it = _Interpreter(self.gms[name], self.device, tap)
        out = it.run(*(x.to(self.device) for x in inputs))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
