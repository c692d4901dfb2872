"""A trained run's forecast as one Python call: past occupancy + poses -> future occupancy.

    from wm import Forecaster
    f = Forecaster.from_run("runs/demo", device="cuda", dtype="bf16")
    pred = f(past_occ, past_poses)        # (B, P, X, Y, Z) class ids, (B, P, 4, 4) ego->global poses
    pred.occ                              # (B, S, X, Y, Z) uint8, S = data.future

It computes what --eval-only scores (wm.evaluation.evaluate.forecast): the past frames encoded by the frozen
tokenizer, the world model rolled out with its key/value cache (WorldModel.rollout), the codes
decoded and the argmax taken, under the same autocast. Poses become the model's ego motion the way
the training windows get it (wm.data.windows.relative_motion: x, y, yaw in the last past frame's axes).
Given future poses (a planned trajectory) are used as the future ego motion, as --eval-only does
with train.forecast_motion=given; without them the model predicts it.

`cuda_graph=True` (CUDA only) records the whole forecast (encode, every world step with its
key/value cache, decode, argmax) as one CUDA graph per input shape on its first call, and replays
it after: at batch 1 the forecast is bound by kernel launches (hundreds per world step), which a
replay skips. Each call's inputs are copied into the graph's own buffers and its outputs copied out,
so results stay valid across calls.

The run is loaded by wm.checkpoint.trained.load_trained (as evaluation and export load it): the best valid world checkpoint,
its tokenizer found by sha256, the two checkpoints' configs checked against each other as
--eval-only checks them. Every input a caller can get wrong is refused with one line (WMError).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

from wm.checkpoint.trained import load_trained
from wm.config.runtime import COMPILE_MODES
from wm.config.sections import Config
from wm.data.windows import relative_motion
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.training import compile_cache
from wm.training.wrappers import compile_args
from wm.utils.errors import WMError
from wm.utils.precision import cast_for_inference

__all__ = ["Forecaster", "Prediction", "DTYPES", "prepare_inputs"]

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # name -> autocast dtype


@dataclass
class Prediction:
    """One forecast, numpy arrays if the occupancy came as numpy, else torch tensors on the
    forecaster's device; no batch dimension if the input had none.

    occ (B, S, X, Y, Z) uint8 class ids; motion (B, S, 3) x, y, yaw of each future frame in the last
    past frame's axes (predicted, or from the given future poses); codes (B, S, h, w) int64 tokens;
    logits (B, S, C, X, Y, Z) float, only when asked for."""

    occ: Any
    motion: Any
    codes: Any
    logits: Any = None


def _dtype(dtype) -> tuple[str, Optional[torch.dtype]]:
    names = {v: k for k, v in DTYPES.items() if v is not None} | {torch.float32: "fp32", None: "fp32"}
    name = names.get(dtype, dtype)
    if name not in DTYPES:
        raise WMError(f"Forecaster dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    return name, DTYPES[name]


def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise WMError(f"Forecaster device {device!r} is not a torch device; use 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise WMError(f"Forecaster device {device!r}: no CUDA device here (torch {torch.__version__}); use device='cpu'")
    return dev


def _compile(mode: Optional[str]) -> Optional[str]:
    if mode is not None and mode not in COMPILE_MODES:
        raise WMError(f"Forecaster compile {mode!r} must be one of None, {', '.join(COMPILE_MODES)}")
    return mode


def _graph_ok(cuda_graph: bool, device: torch.device, compile: Optional[str]) -> bool:
    if cuda_graph and device.type != "cuda":
        raise WMError(f"Forecaster cuda_graph=True needs a CUDA device, not {device}; leave it off on the CPU")
    if cuda_graph and compile not in (None, "default"):
        raise WMError(f"Forecaster cuda_graph=True records its own graph: use compile=None or 'default', "
                      f"not {compile!r}")
    return bool(cuda_graph)


def _array(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise WMError(f"{what} must be a numpy array or torch tensor, got {type(x).__name__}")
    return x


def _poses(p: np.ndarray, what: str, batched: bool, B: int, n: int, per: str) -> np.ndarray:
    """(B, n, 4, 4) float64 from (B, n, 4, 4) or, unbatched, (n, 4, 4); one pose per `per`."""
    if p.shape[-2:] != (4, 4) or p.ndim != (4 if batched else 3):
        lead = "(B, N, 4, 4)" if batched else "(N, 4, 4)"
        raise WMError(f"{what} must be 4x4 ego->global matrices {lead} like the occupancy's batch, "
                      f"got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.number) or np.iscomplexobj(p):
        raise WMError(f"{what} must be real numbers, got dtype {p.dtype}")
    p = p.astype(np.float64, copy=False)
    if not batched:
        p = p[None]
    if p.shape[0] != B:
        raise WMError(f"{what} are for {p.shape[0]} windows but the occupancy holds {B}")
    if p.shape[1] != n:
        raise WMError(f"{p.shape[1]} {what} for {n} {per}s; give one 4x4 pose per {per}")
    if not np.isfinite(p).all():
        raise WMError(f"{what} are not finite (NaN or inf)")
    return p


def prepare_inputs(cfg: Config, device: torch.device, past_occ, past_poses, future_poses=None,
                   steps: Optional[int] = None):
    """Forecaster's inputs checked (one-line WMError) and on `device`: occupancy uint8 (B, P, X, Y, Z),
    past motion (B, P, 3), future motion (B, S, 3) or None, S, and whether the input was batched /
    numpy. Motion from the poses as the training windows get it (wm.data.windows.relative_motion)."""
    as_numpy = isinstance(past_occ, np.ndarray)
    occ = torch.from_numpy(past_occ) if as_numpy else past_occ
    if not isinstance(occ, torch.Tensor):
        raise WMError(f"past occupancy must be a numpy array or torch tensor, got {type(past_occ).__name__}")
    grid = tuple(cfg.data.grid)
    if occ.dim() not in (4, 5) or tuple(occ.shape[-3:]) != grid:
        g = ", ".join(map(str, grid))
        raise WMError(f"past occupancy must be (B, P, {g}) or (P, {g}) class ids, got shape {tuple(occ.shape)}")
    if occ.is_floating_point() or occ.is_complex() or occ.dtype == torch.bool:
        raise WMError(f"past occupancy must hold integer class ids (uint8 or another integer type), got {occ.dtype}")
    batched = occ.dim() == 5
    occ = occ if batched else occ[None]
    B, P = occ.shape[:2]
    if P < 1 or B < 1:
        raise WMError(f"past occupancy of shape {tuple(occ.shape)}: give at least one past frame of one window")
    if P > cfg.world.max_frames:
        raise WMError(f"{P} past frames exceed this model's world.max_frames={cfg.world.max_frames}")
    occ = occ.to(device)
    lo, hi = (int(v) for v in torch.aminmax(occ))
    C = cfg.data.num_classes
    if hi >= C:
        raise WMError(f"past occupancy holds class ids up to {hi}, but this model knows {C} classes (0..{C - 1})")
    if lo < 0:
        raise WMError(f"past occupancy holds class ids down to {lo}; class ids are 0..{C - 1}")
    poses = _poses(_array(past_poses, "past poses"), "past poses", batched, B, P, "occupancy frame")
    fut = None if future_poses is None else _array(future_poses, "future poses")
    S = steps if steps is not None else cfg.data.future if fut is None else fut.shape[-3] if fut.ndim > 2 else 0
    if not isinstance(S, (int, np.integer)) or isinstance(S, bool) or S < 1:
        raise WMError(f"steps={S!r}: forecast at least one future frame (an integer >= 1)")
    S = int(S)
    if fut is not None:
        poses = np.concatenate([poses, _poses(fut, "future poses", batched, B, S, "step")], 1)
    motion = np.stack([relative_motion(p, P - 1) for p in poses])  # as the windows' motion (wm.data.windows)
    motion = torch.from_numpy(motion).to(device)
    fut_motion = motion[:, P:] if fut is not None else None
    return occ.to(torch.uint8), motion[:, :P], fut_motion, S, batched, as_numpy


class _Graph:
    """One forecast recorded as a CUDA graph: static input buffers, the recorded outputs."""

    def __init__(self, fn: Callable, inputs: list, pool):
        self.inputs = [None if x is None else x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: cuDNN's choices, compiles, lazy inits
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def __call__(self, inputs: list) -> list:
        for buf, x in zip(self.inputs, inputs):
            if buf is not None:
                buf.copy_(x)
        self.graph.replay()
        return self.outputs


class Forecaster:
    """past occupancy + poses -> future occupancy with a trained tokenizer and world model.

    `Forecaster.from_run(run)` loads a run folder; the constructor takes the models themselves (e.g.
    randomly initialised ones of a config, for timing). `dtype`: fp32 | bf16 | fp16 (autocast);
    `compile`: None or a torch.compile mode (wm.config.runtime.COMPILE_MODES; reduce-overhead = CUDA graphs)
    for the tokenizer's encode and decode and the world model's step; `cuda_graph`: the whole forecast
    as one CUDA graph per input shape (see the module's docstring; with compile None or default).
    `cache_dir`: with compile, a folder whose compile cache (wm.training.compile_cache, kind "forecast") is
    loaded before the first compile and written after each input shape that compiled, so the next
    process on the same kind of machine does not compile again (from_run: the run folder).
    `inductor`: with compile, Inductor options on top of the mode's (e.g. the tokenizer stage's
    {"coordinate_descent_tuning": True, "force_layout_optimization": True}: minutes more of
    compilation for tuned kernels).
    `aoti_dir`: a folder of AOTInductor packages (export.py --aoti, wm.export.aoti): each call runs
    the package of its batch, past length, horizon and dtype, loaded on first use (seconds, nothing
    compiled or tuned); with cuda_graph its call is recorded as one CUDA graph."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, world: WorldModel, device="cpu", dtype="fp32",
                 compile: Optional[str] = None, checkpoint: Optional[Path] = None,
                 tokenizer_checkpoint: Optional[Path] = None, cuda_graph: bool = False,
                 cache_dir: Optional[Path] = None, say: Callable[[str], Any] = lambda m: print(m, file=sys.stderr),
                 aoti_dir: Optional[Path] = None, inductor: Optional[dict] = None):
        self.dtype, self.amp = _dtype(dtype)
        self.device = _device(device)
        self.cfg, self.compile = cfg, _compile(compile)
        self.cuda_graph = _graph_ok(cuda_graph, self.device, self.compile)
        self._graphs: dict = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self.checkpoint, self.tokenizer_checkpoint = checkpoint, tokenizer_checkpoint
        # the matmul weights in the autocast dtype once (copies: the caller's models keep theirs)
        self.tokenizer = cast_for_inference(tokenizer.to(self.device).eval().requires_grad_(False), self.amp)
        self.world = cast_for_inference(world.to(self.device).eval().requires_grad_(False), self.amp)
        self._encode, self._step, self._decode = self.tokenizer.encode, self.world.step, self.tokenizer.decode
        self.cache_dir, self.say, self._compiled_shapes = cache_dir, say, set()
        if aoti_dir is not None and compile is not None:
            raise WMError("Forecaster aoti_dir runs packages compiled ahead: leave compile=None")
        self.aoti_dir, self._packages, self.package_load_s = aoti_dir, {}, {}
        if compile is not None:
            if cache_dir is not None:  # before anything compiles
                compile_cache.load(cache_dir, self.device, say, kind="forecast")
            compile_cache.prepare()
            # static shapes: one graph per batch size, and a rollout's steps after the first share one
            how = compile_args(compile, inductor)
            self._encode, self._step, self._decode = (torch.compile(fn, dynamic=False, **how)
                                                      for fn in (self._encode, self._step, self._decode))

    @classmethod
    def from_run(cls, run: str | os.PathLike, ckpt: Optional[str | os.PathLike] = None, device="cpu",
                 dtype="fp32", compile: Optional[str] = None, cuda_graph: bool = False,
                 aoti: bool = False) -> "Forecaster":
        """The run's best world-model checkpoint (or `ckpt`) and the tokenizer it was trained on;
        `aoti`: run the AOTInductor packages export.py --aoti wrote into <run>/export."""

        _dtype(dtype), _graph_ok(cuda_graph, _device(device), _compile(compile))  # refuse before reading
        t = load_trained(run, ckpt)
        return cls(t.cfg, t.tokenizer, t.world, device, dtype, compile, t.ckpt, t.tokenizer_ckpt, cuda_graph,
                   cache_dir=Path(run), aoti_dir=Path(run) / "export" if aoti else None)

    def _package(self, occ: Tensor, fut: Optional[Tensor], S: int, logits: bool):
        """The AOTInductor package of this call's shape and dtype, loaded once (checked against
        this forecaster's checkpoint when it has one)."""
        from wm.export.aoti import find_package, load_package

        if logits:
            raise WMError("an AOTInductor package returns no logits: call with logits=False, or use a "
                          "Forecaster without aoti")
        B, P = occ.shape[:2]
        key = (B, P, S, fut is not None)
        if key not in self._packages:
            path = find_package(self.aoti_dir, self.device, B, P, S, self.dtype, given=fut is not None)
            self._packages[key], self.package_load_s[key] = load_package(path, self.device, self.checkpoint,
                                                                         graph=self.cuda_graph)
            self.say(f"AOTInductor package {path.name}: loaded in {self.package_load_s[key]:.2f} s")
        return self._packages[key]

    def _forecast(self, occ: Tensor, motion: Tensor, fut: Optional[Tensor], S: int, mark: Callable) -> list:
        """[occupancy, motion, codes, logits] of the future frames; what a CUDA graph records."""

        def step(*a):
            out = self._step(*a)
            mark("step")
            return out

        # autocast's cache of cast weights would outlive a graph's capture: off when recording
        amp = (torch.autocast(self.device.type, dtype=self.amp, cache_enabled=not self.cuda_graph)
               if self.amp is not None else contextlib.nullcontext())
        with torch.no_grad(), amp:
            past_codes = self._encode(occ)
            mark("encode")
            codes, motion_out = self.world.rollout(past_codes, motion, S, future_motion=fut, step=step)
            lg = self._decode(codes)
            pred = lg.argmax(2).to(torch.uint8)
            mark("decode")
        return [pred, motion_out, codes, lg]

    def _replay(self, occ: Tensor, motion: Tensor, fut: Optional[Tensor], S: int, logits: bool) -> list:
        """The forecast through this input shape's CUDA graph (recorded on its first call); the
        outputs copied out of the graph's memory, which the next replay overwrites."""
        key = (tuple(occ.shape), fut is None, S)
        with torch.cuda.device(self.device):  # a graph records and replays on its tensors' device
            g = self._graphs.get(key)
            if g is None:
                g = self._graphs[key] = _Graph(lambda o, m, f: self._forecast(o, m, f, S, lambda name: None),
                                               [occ, motion, fut], self._pool)
            out = g([occ, motion, fut])
            return [x.clone() for x in out[:3]] + [out[3].clone() if logits else None]

    def __call__(self, past_occ, past_poses, future_poses=None, steps: Optional[int] = None,
                 logits: bool = False, on_phase: Optional[Callable[[str], Any]] = None) -> Prediction:
        """Forecast `steps` (default data.future) frames after the past ones.

        past_occ (B, P, X, Y, Z) or (P, X, Y, Z) integer class ids, numpy or torch (any device);
        past_poses (B, P, 4, 4) ego->global, as the shards store them; future_poses (B, S, 4, 4) to
        use as the future ego motion; `logits`: also return the decoder's logits. `on_phase(name)`
        is called at the end of each phase ("inputs", "encode", "step" once per future frame,
        "decode", "outputs"; tools/bench_infer.py times them)."""
        mark = on_phase or (lambda name: None)
        occ, motion, fut, S, batched, as_numpy = prepare_inputs(self.cfg, self.device, past_occ, past_poses,
                                                                future_poses, steps)
        mark("inputs")
        if self.aoti_dir is not None:
            run = self._package(occ, fut, S, logits)
            motion, fut = motion.float(), None if fut is None else fut.float()  # the package's input types
            if self.cuda_graph:
                key = ("aoti", tuple(occ.shape), fut is None, S)
                call = (lambda o, m, f: list(run(o, m))) if fut is None else (lambda o, m, f: list(run(o, m, f)))
                with torch.cuda.device(self.device):
                    g = self._graphs.get(key)
                    if g is None:
                        g = self._graphs[key] = _Graph(call, [occ, motion, fut], self._pool)
                    out = [x.clone() for x in g([occ, motion, fut])] + [None]
            else:
                with torch.no_grad():
                    out = list(run(occ, motion) if fut is None else run(occ, motion, fut)) + [None]
            mark("forecast")
        elif self.cuda_graph:
            out = self._replay(occ, motion, fut, S, logits)
            mark("forecast")  # one graph: its phases are not marked apart
        else:
            if self.compile == "reduce-overhead":  # a new forecast: the last one's CUDA-graph outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            out = self._forecast(occ, motion, fut, S, mark)
            if logits and self.compile == "reduce-overhead":
                out[3] = out[3].clone()  # CUDA-graph memory: the next forecast would overwrite it
            if not logits:
                out[3] = None
        shape = (tuple(occ.shape), fut is None, S)
        if self.compile is not None and self.cache_dir is not None and shape not in self._compiled_shapes:
            self._compiled_shapes.add(shape)  # this shape compiled (or came from the cache): keep it
            try:
                compile_cache.save(self.cache_dir, self.device, self.say, kind="forecast")
            except OSError as e:  # a read-only run folder: the next process compiles again, nothing more
                self.say(f"compile cache: not written ({e.strerror or e}); the next process compiles again")
        if not batched:
            out = [None if x is None else x[0] for x in out]
        if as_numpy:
            out = [None if x is None else (x.float() if x.is_floating_point() else x).cpu().numpy() for x in out]
        mark("outputs")
        return Prediction(*out)
