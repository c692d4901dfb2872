"""TensorRT engines from our Q/DQ ONNX: build and save them (docs/ARCHITECTURE.md, Export); running
them and export.py's TensorRT step: wm/export/trt_run.py.

`tensorrt` is imported lazily, inside the functions, so that this module (and ``export.py``) loads
where TensorRT is absent; :func:`available` says whether it can be used here and, if not, why, and
:func:`trtexec_command` prints what to run on the target machine instead.

Written against the TensorRT 10.x and 11.x Python APIs:

- The network is created **strongly typed** (``1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)``):
  precision comes from the graph (our Q/DQ nodes and float types), not from builder flags. On 10.x
  this is opt-in; on 11.x every network is strongly typed and the flag is kept but ignored. The flag's
  bit is always taken from the enum, never written as a literal (with EXPLICIT_BATCH gone, the 11.x
  headers number it differently from 10.x). ``EXPLICIT_BATCH`` is never used: 10.0 made every
  network explicit batch and deprecated the flag, 11.x removed it.
- Dynamic batch: one optimization profile; for every network input, dim 0 gets min/opt/max batch,
  another dynamic axis (world_step's "frames") the range the caller gives its ONNX name (``dims``),
  and the other dims are taken from the parsed network.
- ``builder.build_serialized_network(network, config)`` (an ``IHostMemory``, or ``None`` when the
  build fails: the reason is only in the logger, which we capture); the workspace limit goes through
  ``config.set_memory_pool_limit(MemoryPoolType.WORKSPACE, bytes)``.
- Legacy implicit INT8 (``implicit_int8=True``), **TensorRT 10.x only**: a weakly typed network,
  ``BuilderFlag.INT8`` and an ``IInt8EntropyCalibrator2`` that only hands TensorRT our own calibration
  cache (``read_calibration_cache`` returns its bytes, ``get_batch`` returns ``None``). 10.1 deprecated
  all of this; 11.x removed ``BuilderFlag.INT8``/``FP16``, ``IBuilderConfig.int8_calibrator`` and the
  calibrator classes, so on 11.x it is refused with one line before any of them is touched.

Every failure a user can cause is a :class:`wm.utils.errors.WMError` with one line that names the file
and carries TensorRT's own parser/builder messages.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path
from typing import Mapping, Sequence

from wm.utils.atomic import write_bytes
from wm.utils.errors import WMError

__all__ = [
    "TrtError",
    "available",
    "build_engine",
    "trtexec_command",
    "onnx_profile_shapes",
]


class TrtError(WMError):
    """A TensorRT build or run that cannot go ahead; str(e) is one line."""


def _one_line(s: str) -> str:
    return " ".join(str(s).split())


# ---------------------------------------------------------------------------------------------
# import, version, CUDA


def import_trt():
    """`import tensorrt`, or a TrtError that says why not."""
    try:
        import tensorrt as trt  # noqa: PLC0415 (lazy on purpose)
    except Exception as e:  # ImportError, or a broken install failing to load its libraries
        raise TrtError(f"TensorRT is not available here (import tensorrt failed: "
                       f"{type(e).__name__}: {_one_line(e)})") from None
    return trt


def trt_version(trt) -> str:
    return str(getattr(trt, "__version__", "unknown"))


def _major(trt) -> int:
    m = re.match(r"\s*(\d+)", trt_version(trt))
    return int(m.group(1)) if m else 0


def _cuda_device() -> str | None:
    """The name of the CUDA device torch sees, or None. (Tests replace this.)"""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def available() -> tuple[bool, str]:
    """(True, "TensorRT <ver> on <gpu>") where an engine can be built and run here, else
    (False, one line saying why: TensorRT missing, too old, or no CUDA device)."""
    try:
        trt = import_trt()
    except TrtError as e:
        return False, str(e)
    ver, major = trt_version(trt), _major(trt)
    if major < 10:
        return False, f"TensorRT {ver} is too old: this code is written for TensorRT 10.x and 11.x"
    try:
        gpu = _cuda_device()
    except Exception as e:
        return False, f"TensorRT {ver} imports, but the CUDA check through torch failed: {_one_line(e)}"
    if gpu is None:
        return False, f"TensorRT {ver} imports, but torch sees no CUDA device"
    return True, f"TensorRT {ver} on {gpu}"


# ---------------------------------------------------------------------------------------------
# logger that keeps TensorRT's messages (a failed build returns None; the reason is only logged)


def make_logger(trt, echo_warnings: bool = False):
    """An `ILogger` subclass that records every message at WARNING or worse; `errors()` gives the
    ERROR / INTERNAL_ERROR ones for our one-line failures."""
    sev = trt.ILogger.Severity
    error_levels = {int(sev.INTERNAL_ERROR), int(sev.ERROR)}
    keep_levels = error_levels | {int(sev.WARNING)}

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[int, str]] = []

        def log(self, severity, msg):  # called by TensorRT, possibly from its own threads
            level = int(severity)
            if level in keep_levels:
                self.messages.append((level, _one_line(msg)))
                if echo_warnings:
                    print(f"[TensorRT] {_one_line(msg)}", flush=True)

        def errors(self) -> list[str]:
            return [m for lv, m in self.messages if lv in error_levels]

    return _Logger()


def messages_tail(msgs: Sequence[str], n: int = 3) -> str:
    msgs = [m for m in msgs if m]
    if not msgs:
        return "TensorRT gave no error message"
    more = f" (+{len(msgs) - n} earlier)" if len(msgs) > n else ""
    return "; ".join(msgs[-n:]) + more


# ---------------------------------------------------------------------------------------------
# build


def _parser_errors(parser) -> list[str]:
    out = []
    for i in range(int(parser.num_errors)):
        e = parser.get_error(i)
        desc = e.desc() if hasattr(e, "desc") else str(e)
        where = []
        for attr in ("node_name", "node_operator"):  # 10.x ParserError; absent on older builds
            fn = getattr(e, attr, None)
            if callable(fn):
                try:
                    v = fn()
                except Exception:
                    v = ""
                if v:
                    where.append(str(v))
        out.append(_one_line(f"{desc} [{' '.join(where)}]" if where else desc))
    return out


def _read_cache(path: Path) -> bytes:
    """Our TensorRT calibration cache, checked just enough to fail early with a clear line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TrtError(f"cannot read the INT8 calibration cache {path}: {e.strerror or e}") from None
    first = data.split(b"\n", 1)[0].decode("ascii", "replace").strip()
    if not re.fullmatch(r"TRT-\w+-EntropyCalibration2", first):
        raise TrtError(f"INT8 calibration cache {path} does not start with a "
                       f"'TRT-<version>-EntropyCalibration2' header (got {first[:60]!r})")
    if len(data.splitlines()) < 2:
        raise TrtError(f"INT8 calibration cache {path} holds a header but no tensor scales")
    return data


def _cache_only_calibrator(trt, cache: bytes):
    """TensorRT 10.x legacy path: a calibrator that never calibrates, it only hands back `cache`.

    `get_batch` returning None tells TensorRT there is no calibration data; if TensorRT rejected the
    cache (e.g. a version header that does not match), the build then fails and the logged reason
    ends up in our error line. `write_calibration_cache` is a no-op so our file is never replaced.
    """

    class _CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.cache = cache
            self.reads = 0

        def get_batch_size(self):  # implicit batch is gone since 10.0; TensorRT ignores it
            return 1

        def get_batch(self, names):
            return None

        def read_calibration_cache(self):
            self.reads += 1
            return self.cache

        def write_calibration_cache(self, cache):
            return None

    return _CacheCalibrator()


def _network_inputs(network) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for i in range(int(network.num_inputs)):
        t = network.get_input(i)
        out.append((str(t.name), tuple(int(d) for d in t.shape)))
    return out


def _onnx_dim_names(onnx_path: Path) -> dict[str, list]:
    """{input: [dim_param name or None per axis]} of an ONNX file's inputs ({} if unreadable)."""
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:
        return {}
    return {vi.name: [d.dim_param or None for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}


def _profile_shapes(inputs, onnx_path: Path, min_batch: int, opt_batch: int, max_batch: int,
                    dims: Mapping[str, Sequence[int]] | None = None):
    """{name: (min, opt, max)}: dim 0 is the batch; another dynamic axis takes the (min, opt, max)
    that `dims` gives its ONNX name (e.g. world_step's "frames"), else the network is refused."""
    dims = dict(dims or {})
    names = _onnx_dim_names(onnx_path) if any(d < 0 for _, s in inputs for d in s[1:]) else {}
    shapes = {}
    for name, shape in inputs:
        if len(shape) == 0:
            raise TrtError(f"input '{name}' of {onnx_path} is a scalar: every input needs a leading "
                           "batch axis")
        if shape[0] >= 0 and not (min_batch == opt_batch == max_batch == shape[0]):
            raise TrtError(f"input '{name}' of {onnx_path} has a fixed batch of {shape[0]}, but the "
                           f"profile asks for {min_batch}/{opt_batch}/{max_batch}; export it with a "
                           "dynamic batch axis")
        lo, mid, hi = [min_batch], [opt_batch], [max_batch]
        for ax, d in enumerate(shape[1:], 1):
            dn = (names.get(name) or [None] * len(shape))[ax] if d < 0 else None
            if d >= 0:
                rng = (d, d, d)
            elif dn in dims:
                rng = tuple(int(x) for x in dims[dn])
            else:
                raise TrtError(f"input '{name}' of {onnx_path} has shape {list(shape)}: axis {ax} "
                               f"({dn or 'unnamed'}) is dynamic and no range was given for it; pass "
                               f"dims={{'{dn or 'name'}': (min, opt, max)}}")
            lo.append(rng[0])
            mid.append(rng[1])
            hi.append(rng[2])
        shapes[name] = (tuple(lo), tuple(mid), tuple(hi))
    return shapes


def _write_atomic(path: Path, data) -> int:
    """Write `data` (bytes-like) to `path` through `.<name>.tmp-<pid>` + fsync + os.replace."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrtError(f"cannot create the folder for the engine {path}: {e.strerror or e}") from None
    try:
        return write_bytes(path, data)
    except OSError as e:
        raise TrtError(f"cannot write the engine {path}: {e.strerror or e}") from None


def build_engine(onnx_path, engine_path, *, min_batch: int, opt_batch: int, max_batch: int,
                 strongly_typed: bool = True, fp16_fallback: bool = False, workspace_gib: float = 4,
                 int8_cache=None, implicit_int8: bool = False, verbose: bool = False,
                 dims: Mapping[str, Sequence[int]] | None = None) -> dict:
    """Build a TensorRT engine from `onnx_path` and save it atomically at `engine_path`.

    Default (10.x and 11.x): a strongly typed network from the Q/DQ ONNX; precision is what the
    graph says. `int8_cache` is then not used (the scales are in the Q/DQ nodes).

    `strongly_typed=False` (10.x only; 11.x removed weak typing) builds a weakly typed network from
    a *float* ONNX; `fp16_fallback=True` (10.x only, needs a weakly typed network) sets
    ``BuilderFlag.FP16`` so TensorRT may run float layers in FP16. With strong typing, put FP16 in
    the graph instead (the ``--fp16`` export). A Q/DQ ONNX belongs on the strongly typed path: NVIDIA
    documents explicit quantization with strong typing and no precision flags.

    `implicit_int8=True` (10.x only, deprecated there): the legacy implicit-quantization path for
    the *float* ONNX: weakly typed network, ``BuilderFlag.INT8`` and a calibrator that only reads
    `int8_cache` (our ``TRT-<ver>-EntropyCalibration2`` file). On 11.x it raises TrtError.

    Returns {"tensorrt", "engine", "onnx", "bytes", "build_s", "strongly_typed", "implicit_int8",
    "fp16_fallback", "profile": {input: [min, opt, max shapes]}, ...}.
    """
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    for k, v in (("min_batch", min_batch), ("opt_batch", opt_batch), ("max_batch", max_batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise TrtError(f"{k} must be a positive integer, got {v!r}")
    if not min_batch <= opt_batch <= max_batch:
        raise TrtError(f"batch profile must satisfy min <= opt <= max, got "
                       f"{min_batch}/{opt_batch}/{max_batch}")
    if not workspace_gib > 0:
        raise TrtError(f"workspace_gib must be > 0, got {workspace_gib!r}")
    if not onnx_path.is_file():
        raise TrtError(f"ONNX model {onnx_path} does not exist")

    trt = import_trt()
    ver, major = trt_version(trt), _major(trt)
    if major < 10:
        raise TrtError(f"TensorRT {ver} is too old: this code is written for TensorRT 10.x and 11.x")
    weak = implicit_int8 or not strongly_typed

    # Refuse what 11.x removed *before* touching any of it (no BuilderFlag.INT8/FP16, no calibrator).
    if major >= 11 and implicit_int8:
        raise TrtError(f"implicit INT8 calibration (cache {int8_cache}) was removed in TensorRT {ver}; "
                       f"build {onnx_path} as a strongly typed network from the Q/DQ ONNX instead "
                       "(implicit_int8=False)")
    if major >= 11 and weak:
        raise TrtError(f"TensorRT {ver} builds strongly typed networks only (weak typing was removed); "
                       f"call build_engine on {onnx_path} with strongly_typed=True")
    if fp16_fallback and not weak:
        raise TrtError(f"fp16_fallback sets BuilderFlag.FP16, which a strongly typed network refuses "
                       f"(and TensorRT 11 removed); put FP16 in the graph of {onnx_path} instead")
    cache_bytes = None
    if implicit_int8:
        if int8_cache is None:
            raise TrtError(f"implicit_int8 needs int8_cache (our TensorRT calibration cache) to build "
                           f"{onnx_path}")
        cache_bytes = _read_cache(Path(int8_cache))

    ok, why = available()
    if not ok:
        raise TrtError(f"cannot build {engine_path}: {why}")

    logger = make_logger(trt, echo_warnings=verbose)
    try:
        builder = trt.Builder(logger)
    except Exception as e:
        raise TrtError(f"TensorRT {ver} could not create a builder: {_one_line(e)}; "
                       f"{messages_tail(logger.errors())}") from None

    flags = 0
    if not weak:
        flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        if flag is not None:
            # 11.x keeps the flag (deprecated, ignored: strong typing is always on). If a later 11.x
            # drops the member, 0 is still a strongly typed network there; on 10.x it is required.
            flags |= 1 << int(flag)
        elif major < 11:
            raise TrtError(f"TensorRT {ver} has no NetworkDefinitionCreationFlag.STRONGLY_TYPED")
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file (not parse(bytes)) so weights stored next to the model as external data load
    if not parser.parse_from_file(str(onnx_path)):
        msgs = _parser_errors(parser) or logger.errors()
        raise TrtError(f"TensorRT {ver} could not parse {onnx_path}: {messages_tail(msgs)}")

    inputs = _network_inputs(network)
    if not inputs:
        raise TrtError(f"{onnx_path} has no inputs after parsing")
    shapes = _profile_shapes(inputs, onnx_path, min_batch, opt_batch, max_batch, dims)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    profile = builder.create_optimization_profile()
    for name, (lo, mid, hi) in shapes.items():
        profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(profile)

    calibrator = None
    if weak:  # 10.x only (checked above)
        if fp16_fallback:
            config.set_flag(trt.BuilderFlag.FP16)
        if implicit_int8:
            config.set_flag(trt.BuilderFlag.INT8)
            calibrator = _cache_only_calibrator(trt, cache_bytes)
            config.int8_calibrator = calibrator
            # Deprecated in 10.1 but present in 10.x; feature-detected rather than assumed, since
            # whether every 10.x build exposes it could not be confirmed. With a cache, no batch
            # is ever run, but a dynamic-shape network still wants a calibration profile.
            if hasattr(config, "set_calibration_profile"):
                config.set_calibration_profile(profile)

    t0 = time.perf_counter()
    try:
        serialized = builder.build_serialized_network(network, config)
    except Exception as e:  # the bindings raise on some failures instead of returning None
        raise TrtError(f"TensorRT {ver} failed to build an engine from {onnx_path}: "
                       f"{_one_line(e)}; {messages_tail(logger.errors())}") from None
    build_s = time.perf_counter() - t0
    if serialized is None:
        raise TrtError(f"TensorRT {ver} could not build an engine from {onnx_path}: "
                       f"{messages_tail(logger.errors())}")
    if memoryview(serialized).nbytes == 0:
        raise TrtError(f"TensorRT {ver} returned an empty engine for {onnx_path}: "
                       f"{messages_tail(logger.errors())}")
    nbytes = _write_atomic(engine_path, serialized)
    return {
        "tensorrt": ver,
        "tensorrt_major": major,
        "onnx": str(onnx_path),
        "engine": str(engine_path),
        "bytes": nbytes,
        "build_s": round(build_s, 3),
        "strongly_typed": not weak,
        "implicit_int8": bool(implicit_int8),
        "fp16_fallback": bool(fp16_fallback),
        "int8_cache": str(int8_cache) if implicit_int8 else None,
        "calibration_cache_reads": getattr(calibrator, "reads", None),
        "network_flags": flags,
        "workspace_bytes": int(workspace_gib * (1 << 30)),
        "profile": {n: [list(s) for s in v] for n, v in shapes.items()},
        "warnings": len(logger.messages) - len(logger.errors()),
    }


# ---------------------------------------------------------------------------------------------
# where TensorRT is absent: the command for the target machine


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)


def trtexec_command(onnx_path, engine_path, shapes: Mapping[str, Sequence[Sequence[int]]], *,
                    fp16: bool = False, workspace_gib: float | None = None,
                    strongly_typed: bool = True) -> str:
    """The ``trtexec`` line that builds the same engine on the target machine.

    `shapes` maps each input name to its (min, opt, max) shapes (see :func:`onnx_profile_shapes`).
    ``--stronglyTyped`` is what 10.x needs for a Q/DQ ONNX built strongly typed; 11.x always builds
    strongly typed and documents the flag as no longer needed (pass ``strongly_typed=False`` to
    leave it out). `fp16=True` emits ``--fp16`` instead: a weakly typed 10.x build of a float ONNX
    (11.x removed ``--fp16``; a Q/DQ ONNX should stay on ``--stronglyTyped``).
    """
    if not shapes:
        raise TrtError("trtexec_command needs the min/opt/max shape of at least one input")
    parts = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
    if fp16:
        parts.append("--fp16")
    elif strongly_typed:
        parts.append("--stronglyTyped")
    for i, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
        items = []
        for name, mmm in shapes.items():
            if len(mmm) != 3:
                raise TrtError(f"input '{name}': expected (min, opt, max) shapes, got {mmm!r}")
            items.append(f"{name}:{_dims(mmm[i])}")
        parts.append(f"{flag}={','.join(items)}")
    if workspace_gib is not None:
        parts.append(f"--memPoolSize=workspace:{int(workspace_gib * 1024)}")  # MiB (trtexec default unit)
    return " ".join(shlex.quote(p) for p in parts)


def onnx_profile_shapes(onnx_path, min_batch: int, opt_batch: int, max_batch: int,
                        dims: Mapping[str, Sequence[int]] | None = None) -> dict:
    """{input: (min, opt, max)} from the ONNX file itself (for :func:`trtexec_command` where
    TensorRT is absent): dim 0 is the batch, another dynamic axis takes its range from `dims` by
    its ONNX name, every other dim must be a fixed number."""
    import onnx

    onnx_path = Path(onnx_path)
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:
        raise TrtError(f"cannot read ONNX model {onnx_path}: {_one_line(e)}") from None
    inits = {i.name for i in model.graph.initializer}
    inputs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [int(d.dim_value) if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]
        inputs.append((vi.name, tuple(shape)))
    return _profile_shapes(inputs, onnx_path, min_batch, opt_batch, max_batch, dims)
