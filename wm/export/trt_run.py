"""Running TensorRT engines with torch CUDA tensors as their buffers, and export.py's TensorRT step
(build each graph's engine, compare it with onnxruntime, time it; or print what to run elsewhere).
Building: wm/export/trt.py. `tensorrt` is imported lazily, inside the functions.

Written against the TensorRT 10.x and 11.x Python APIs:
``Runtime.deserialize_cuda_engine``, the name-based I/O API (``num_io_tensors``,
  ``get_tensor_name``, ``get_tensor_mode``, ``get_tensor_dtype``), ``context.set_input_shape``,
  ``context.get_tensor_shape``, ``context.set_tensor_address`` and
  ``context.execute_async_v3(torch.cuda.current_stream().cuda_stream)``. Buffers are torch tensors:
  torch owns the CUDA context (pycuda's own context clashes with it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from wm.export.trt import (TrtError, available, build_engine, import_trt, make_logger, messages_tail,
    onnx_profile_shapes, trt_version, trtexec_command)

__all__ = ["TrtRunner", "torch_dtype", "deploy"]


def torch_dtype(trt, dt):
    """The torch dtype for a `trt.DataType` (FLOAT, HALF, BF16, INT8, INT32, INT64, BOOL, UINT8, FP8
    where the installed TensorRT and torch have them); TrtError for types torch cannot hold."""
    import torch

    table = (
        ("FLOAT", torch.float32),
        ("HALF", torch.float16),
        ("BF16", torch.bfloat16),
        ("INT8", torch.int8),
        ("INT32", torch.int32),
        ("INT64", torch.int64),
        ("BOOL", torch.bool),
        ("UINT8", torch.uint8),
        ("FP8", getattr(torch, "float8_e4m3fn", None)),  # TensorRT FP8 is E4M3
    )
    for name, tdt in table:
        member = getattr(trt.DataType, name, None)
        if member is not None and tdt is not None and dt == member:
            return tdt
    raise TrtError(f"TensorRT data type {dt} has no torch equivalent (INT4/FP4 I/O is not supported)")


def _device():
    """The CUDA device the engine runs on. (Tests replace this.)"""
    import torch

    if not torch.cuda.is_available():
        raise TrtError("TensorRT needs a CUDA device and torch sees none")
    return torch.device("cuda", torch.cuda.current_device())


def _stream(device) -> tuple[int, Callable[[], None]]:
    """(handle for execute_async_v3, wait-for-it) on torch's current stream. (Tests replace this.)"""
    import torch

    s = torch.cuda.current_stream(device)
    return int(s.cuda_stream), s.synchronize


class TrtRunner:
    """Run a serialized engine with torch tensors as its buffers.

    ``runner(**inputs)`` -> {output name: tensor}; inputs go to the engine's device and dtypes, shapes
    are set per call (dynamic batch within the engine's profile), outputs are fresh torch tensors.
    """

    def __init__(self, engine_path, *, verbose: bool = False):
        self.path = Path(engine_path)
        trt = self._trt = import_trt()
        self.version = trt_version(trt)
        try:
            blob = self.path.read_bytes()
        except OSError as e:
            raise TrtError(f"cannot read the engine {self.path}: {e.strerror or e}") from None
        self.device = _device()
        self._logger = make_logger(trt, echo_warnings=verbose)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise TrtError(f"TensorRT {self.version} could not load the engine {self.path} (built by "
                           f"another TensorRT version or for another GPU?): {messages_tail(self._logger.errors())}")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise TrtError(f"TensorRT {self.version} could not create an execution context for "
                           f"{self.path}: {messages_tail(self._logger.errors())}")
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.dtypes: dict[str, Any] = {}
        for i in range(int(self.engine.num_io_tensors)):
            name = self.engine.get_tensor_name(i)
            mode = self.engine.get_tensor_mode(name)
            self.dtypes[name] = torch_dtype(trt, self.engine.get_tensor_dtype(name))
            if mode == trt.TensorIOMode.INPUT:
                self.inputs.append(name)
            elif mode == trt.TensorIOMode.OUTPUT:
                self.outputs.append(name)

    def _launch(self, inputs: Mapping[str, Any]):
        """Bind and enqueue; returns (outputs, keep-alive inputs, wait). Caller must wait()."""
        import torch

        missing = [n for n in self.inputs if n not in inputs]
        extra = [n for n in inputs if n not in self.inputs]
        if missing or extra:
            raise TrtError(f"engine {self.path} takes inputs {self.inputs}; missing {missing}, "
                           f"unexpected {extra}")
        ctx = self.context
        bound = []
        for name in self.inputs:
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                raise TrtError(f"input '{name}' of engine {self.path} must be a torch.Tensor, "
                               f"got {type(t).__name__}")
            t = t.to(device=self.device, dtype=self.dtypes[name]).contiguous()
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise TrtError(f"input '{name}' shape {list(t.shape)} is outside the optimization "
                               f"profile of engine {self.path}: {messages_tail(self._logger.errors())}")
            ctx.set_tensor_address(name, t.data_ptr())
            bound.append(t)
        outs = {}
        for name in self.outputs:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise TrtError(f"output '{name}' of engine {self.path} has a data-dependent shape "
                               f"{list(shape)}, which this runner does not support")
            out = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            ctx.set_tensor_address(name, out.data_ptr())
            outs[name] = out
        handle, wait = _stream(self.device)
        if not ctx.execute_async_v3(handle):
            raise TrtError(f"TensorRT {self.version} failed to run engine {self.path}: "
                           f"{messages_tail(self._logger.errors())}")
        return outs, bound, wait

    def __call__(self, **inputs) -> dict:
        outs, bound, wait = self._launch(inputs)
        wait()
        del bound  # inputs stay alive until the engine is done with them
        return outs

    def time(self, inputs: Mapping[str, Any], iters: int = 50, warmup: int = 5) -> float:
        """Mean milliseconds per run over `iters` back-to-back runs on the current stream (after
        `warmup` runs); the host->device copy of the inputs is done once, outside the timing."""
        if iters < 1:
            raise TrtError(f"iters must be >= 1, got {iters}")
        staged = {n: t.to(device=self.device, dtype=self.dtypes.get(n, t.dtype)).contiguous()
                  for n, t in inputs.items()}
        keep = []
        for _ in range(max(0, warmup)):
            keep.append(self._launch(staged))
        if keep:
            keep[-1][2]()
        keep.clear()
        t0 = time.perf_counter()
        last = None
        for _ in range(iters):
            last = self._launch(staged)
        last[2]()
        return (time.perf_counter() - t0) * 1000.0 / iters


# ---------------------------------------------------------------------------------------------
# export.py's TensorRT step: build, compare with onnxruntime, time; or say what to run elsewhere


def _agreement(got, ref) -> dict:
    """Integer outputs (classes, codes): fraction equal. Float outputs: max |difference|."""
    import numpy as np

    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return {"agreement": 0.0, "shape": list(got.shape), "expected_shape": list(ref.shape)}
    if ref.dtype.kind in "iub":
        return {"agreement": float((got.astype(np.int64) == ref.astype(np.int64)).mean())}
    return {"max_abs_diff": float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max())}


def deploy(onnx_files: Mapping[str, Path], feeds: Mapping[str, Mapping[str, Any]], *, max_batch: int,
           opt_batch: int = 1, log: Callable[[str], None] = print, timing_iters: int = 50,
           dims: Mapping[str, Sequence[int]] | None = None,
           max_batches: Mapping[str, int] | None = None) -> dict:
    """`export.py`'s TensorRT step for each `{graph name: ONNX file}` (the Q/DQ ONNX for INT8).

    Where TensorRT and a GPU are here: build a strongly typed engine `<file stem>.engine` next to the
    ONNX (batch profile 1 / `opt_batch` / `max_batch`, or `max_batches[name]` where given), run it
    on `feeds[name]` (numpy arrays, as onnxruntime takes them; no more windows than the profile
    takes) with torch CUDA tensors as buffers, compare every output with
    onnxruntime running the same ONNX, and time it at batch 1 and at the feed's batch. Otherwise log
    one line saying why and the `trtexec` line of each graph for the target machine. Returns a
    JSON-ready dict; a build or run that fails raises TrtError (one line)."""
    import numpy as np
    import torch

    ok, why = available()
    res: dict[str, Any] = {"available": ok, "why": why, "graphs": {}}
    if not ok:
        log(f"TensorRT engines not built: {why}. On the target machine run:")
        for name, path in onnx_files.items():
            engine = Path(path).with_suffix(".engine")
            top = (max_batches or {}).get(name, max_batch)
            cmd = trtexec_command(path, engine, onnx_profile_shapes(path, 1, min(opt_batch, top), top, dims))
            res["graphs"][name] = {"onnx": Path(path).name, "trtexec": cmd}
            log(f"  {cmd}")
        return res
    from wm.export.onnx import session

    log(f"TensorRT engines ({why}):")
    for name, path in onnx_files.items():
        path = Path(path)
        engine = path.with_suffix(".engine")
        top = (max_batches or {}).get(name, max_batch)
        info = build_engine(path, engine, min_batch=1, opt_batch=min(opt_batch, top), max_batch=top, dims=dims)
        runner = TrtRunner(engine)
        feed = {k: np.ascontiguousarray(v[:top]) for k, v in feeds[name].items()}
        full = {k: torch.from_numpy(v) for k, v in feed.items()}
        got = runner(**full)
        # a Q/DQ file's reference is its ONNX semantics, not a CPU's integer kernels
        sess = session(path, qdq_in_float=True)
        names = [o.name for o in sess.get_outputs()]
        if sorted(names) != sorted(runner.outputs):
            raise TrtError(f"engine {engine} has outputs {runner.outputs}, onnxruntime gives {names} for {path}")
        # by name: TensorRT documents no order for an engine's I/O tensors
        vs = {o: _agreement(got[o].cpu().numpy(), r) for o, r in zip(names, sess.run(None, feed))}
        one = {k: v[:1] for k, v in full.items()}
        batch = int(next(iter(feed.values())).shape[0])
        ms1, msb = runner.time(one, timing_iters), runner.time(full, timing_iters)
        res["graphs"][name] = {"onnx": path.name, "engine": engine.name, "bytes": info["bytes"],
                               "build_s": info["build_s"], "tensorrt": info["tensorrt"],
                               "vs_onnxruntime": vs, "latency_ms": {"batch1": round(ms1, 3),
                                                                   f"batch{batch}": round(msb, 3)}}
        agree = " ".join(f"{o} {v.get('agreement', v.get('max_abs_diff')):.4g}" for o, v in vs.items())
        log(f"  {engine.name:<28}{info['bytes'] / 2**20:7.1f} MiB  build {info['build_s']:6.1f} s  "
            f"vs onnxruntime: {agree}  {ms1:.2f} ms (batch 1), {msb:.2f} ms (batch {batch})")
    return res
