"""wm.export.trt against stand-ins for the TensorRT 10.x and 11.x Python modules.

TensorRT cannot be installed here, so `FakeTRT10` / `FakeTRT11` are injected as
``sys.modules["tensorrt"]``. They carry the real names (Builder, OnnxParser, BuilderFlag,
NetworkDefinitionCreationFlag, IInt8EntropyCalibrator2, Runtime, TensorIOMode, DataType, ...), record
every call, and behave like the real module where it matters to our code:

- 11.x has no EXPLICIT_BATCH, no precision BuilderFlags, no calibrator classes, no
  ``IBuilderConfig.int8_calibrator``/``set_calibration_profile``: reading them raises AttributeError
  (as a pybind module does) and is recorded in ``fake.touched``; setting them is refused.
- STRONGLY_TYPED is bit 1 on 10.x and bit 0 on 11.x (as in the 11.x headers), so code that writes
  the bit as a literal is caught.
- A failed build returns None with the reason only in the logger; parser errors are ParserError
  objects; engines are serialized to bytes and deserialized by ``Runtime``.
- ``execute_async_v3`` reads every input buffer at the address it was given (CPU tensors here) and
  fills every output buffer with 0x01 bytes, so the tests can tell which memory was bound.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import wm.export.trt as T
from wm.errors import WMError


@pytest.fixture
def tmp_path(tmp_path_factory):
    """A neutral folder name (pytest's embeds the test name, which could satisfy a message check)."""
    return tmp_path_factory.mktemp("t")


def one_line(e: BaseException) -> str:
    assert isinstance(e, WMError), type(e)
    s = str(e)
    assert s and "\n" not in s, f"not one line: {s!r}"
    return s


# =============================================================================================
# the stand-in modules

REMOVED_IN_10 = {
    "build_engine", "build_cuda_engine", "max_workspace_size", "max_batch_size", "execute",
    "execute_async", "execute_async_v2", "get_binding_shape", "get_binding_dtype", "binding_is_input",
    "num_bindings", "set_binding_shape", "has_implicit_batch_dimension", "EXPLICIT_PRECISION",
}
REMOVED_IN_11 = {
    # BuilderFlag
    "FP16", "INT8", "BF16", "FP8", "INT4", "FP4", "OBEY_PRECISION_CONSTRAINTS",
    "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO",
    # NetworkDefinitionCreationFlag
    "EXPLICIT_BATCH",
    # IBuilderConfig
    "int8_calibrator", "set_calibration_profile", "get_calibration_profile", "set_quantization_flag",
    "get_quantization_flag", "quantization_flags", "clear_quantization_flag",
    # module
    "IInt8Calibrator", "IInt8LegacyCalibrator", "IInt8EntropyCalibrator", "IInt8EntropyCalibrator2",
    "IInt8MinMaxCalibrator", "CalibrationAlgoType", "QuantizationFlag",
    # Builder / ICudaEngine / ITensor / IExecutionContext (execute_v2: we do not rely on it anywhere)
    "platform_has_fast_fp16", "platform_has_fast_int8", "device_memory_size", "dynamic_range",
    "set_dynamic_range", "execute_v2",
}
ITEMSIZE = {"FLOAT": 4, "HALF": 2, "BF16": 2, "INT8": 1, "INT32": 4, "INT64": 8, "BOOL": 1,
            "UINT8": 1, "FP8": 1}
ONNX_TO_TRT = {TensorProto.FLOAT: "FLOAT", TensorProto.FLOAT16: "HALF", TensorProto.BFLOAT16: "BF16",
               TensorProto.INT8: "INT8", TensorProto.INT32: "INT32", TensorProto.INT64: "INT64",
               TensorProto.BOOL: "BOOL", TensorProto.UINT8: "UINT8"}
SUPPORTED_OPS = {"Identity", "Cast", "QuantizeLinear", "DequantizeLinear", "Conv", "MatMul", "Add",
                 "Relu", "Softmax", "Gather"}
MAGIC = "FAKE-TRT-ENGINE:"


class EnumValue:
    def __init__(self, owner: str, name: str, value: int):
        self.owner, self.name, self.value = owner, name, value

    def __int__(self):
        return self.value

    def __index__(self):
        return self.value

    def __eq__(self, other):
        return isinstance(other, EnumValue) and (self.owner, self.value) == (other.owner, other.value)

    def __hash__(self):
        return hash((self.owner, self.value))

    def __repr__(self):
        return f"<{self.owner}.{self.name}: {self.value}>"


class _EnumMeta(type):
    def __getattr__(cls, name):  # only reached for names the enum lacks
        if name in cls._removed:
            cls._api.touched.append(f"{cls.__name__}.{name}")
        raise AttributeError(f"type object '{cls.__name__}' has no attribute '{name}'")


def make_enum(api, name: str, members: dict, removed=()):
    cls = _EnumMeta(name, (), {"_removed": set(removed), "_api": api})
    for k, v in members.items():
        setattr(cls, k, EnumValue(name, k, v))
    cls.__members__ = dict(members)
    return cls


class FakeModule(types.ModuleType):
    """`import tensorrt` stand-in: missing names raise AttributeError, removed ones are recorded."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self.removed:
            self.touched.append(name)
        raise AttributeError(f"module 'tensorrt' has no attribute '{name}'")

    def called(self, method: str) -> list:
        return [c[1:] for c in self.calls if c[0] == method]


def make_fake(major: int, *, strongly_typed_member: bool = True) -> FakeModule:
    api = FakeModule("tensorrt")
    api.__version__ = {10: "10.13.3.9", 11: "11.1.0.4"}.get(major, f"{major}.0.0")
    api.major = major
    api.removed = set(REMOVED_IN_10) | (set(REMOVED_IN_11) if major >= 11 else set())
    api.calls, api.touched, api.deprecated = [], [], []
    api.fail_build = None          # a message: build_serialized_network logs it and returns None
    api.fail_execute = False
    api.engines_built = []

    # ---- enums
    api.ILogger = None  # set below
    api.DataType = make_enum(api, "DataType", {
        "FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "UINT8": 5, "FP8": 6, "BF16": 7,
        "INT64": 8, "INT4": 9, "FP4": 10})
    api.TensorIOMode = make_enum(api, "TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
    api.MemoryPoolType = make_enum(api, "MemoryPoolType", {
        "WORKSPACE": 0, "DLA_MANAGED_SRAM": 1, "DLA_LOCAL_DRAM": 2, "DLA_GLOBAL_DRAM": 3,
        "TACTIC_DRAM": 4, "TACTIC_SHARED_MEMORY": 5})
    if major >= 11:
        ndf = {"STRONGLY_TYPED": 0, "PREFER_AOT_PYTHON_PLUGINS": 1, "PREFER_JIT_PYTHON_PLUGINS": 2}
        if not strongly_typed_member:
            ndf = {"PREFER_AOT_PYTHON_PLUGINS": 1, "PREFER_JIT_PYTHON_PLUGINS": 2}
        bflags = {"DEBUG": 0, "GPU_FALLBACK": 1, "REFIT": 2, "DISABLE_TIMING_CACHE": 3, "TF32": 4,
                  "SPARSE_WEIGHTS": 5, "VERSION_COMPATIBLE": 6}
    else:
        ndf = {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1, "PREFER_AOT_PYTHON_PLUGINS": 2,
               "PREFER_JIT_PYTHON_PLUGINS": 3}
        bflags = {"FP16": 0, "INT8": 1, "DEBUG": 2, "GPU_FALLBACK": 3, "REFIT": 4,
                  "DISABLE_TIMING_CACHE": 5, "TF32": 6, "SPARSE_WEIGHTS": 7,
                  "OBEY_PRECISION_CONSTRAINTS": 8, "PREFER_PRECISION_CONSTRAINTS": 9, "DIRECT_IO": 10,
                  "FP8": 11, "BF16": 12, "INT4": 13, "VERSION_COMPATIBLE": 14, "FP4": 15}
    api.NetworkDefinitionCreationFlag = make_enum(api, "NetworkDefinitionCreationFlag", ndf,
                                                  removed=api.removed)
    api.BuilderFlag = make_enum(api, "BuilderFlag", bflags, removed=api.removed)
    precision_flags = {getattr(api.BuilderFlag, n) for n in ("FP16", "INT8", "BF16", "FP8")
                       if n in bflags}

    def dt(name):
        return getattr(api.DataType, name)

    # ---- strict objects: pybind-like attribute behaviour
    class Strict:
        _settable: frozenset = frozenset()

        def __getattr__(self, name):
            if name in api.removed:
                api.touched.append(f"{type(self).__name__}.{name}")
            raise AttributeError(f"'tensorrt.{type(self).__name__}' object has no attribute '{name}'")

        def __setattr__(self, name, value):
            if name.startswith("_") or name in type(self)._settable:
                object.__setattr__(self, name, value)
                return
            if name in api.removed:
                api.touched.append(f"{type(self).__name__}.{name}=")
            raise AttributeError(f"'tensorrt.{type(self).__name__}' object has no attribute '{name}'")

    # ---- logger
    Severity = make_enum(api, "Severity", {"INTERNAL_ERROR": 0, "ERROR": 1, "WARNING": 2, "INFO": 3,
                                           "VERBOSE": 4})

    class ILogger:
        pass

    ILogger.Severity = Severity

    def _ilogger_init(self, *a):
        api.calls.append(("ILogger.__init__",))

    def _ilogger_log(self, severity, msg):
        pass

    ILogger.__init__ = _ilogger_init
    ILogger.log = _ilogger_log
    api.ILogger = ILogger

    class Logger(ILogger):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = (Severity.INTERNAL_ERROR, Severity.ERROR,
                                                         Severity.WARNING, Severity.INFO,
                                                         Severity.VERBOSE)

        def __init__(self, min_severity=None):
            ILogger.__init__(self)

    api.Logger = Logger

    def need_logger(logger, who):
        if not isinstance(logger, ILogger):
            raise TypeError(f"{who}(): incompatible constructor arguments (logger: {type(logger)})")

    def log(logger, sev, msg):
        logger.log(getattr(Severity, sev), msg)

    # ---- network, parser
    class ITensor(Strict):
        def __init__(self, name, shape, dtype):
            self._name, self._shape, self._dtype = name, tuple(shape), dtype

        name = property(lambda s: s._name)
        shape = property(lambda s: s._shape)
        dtype = property(lambda s: s._dtype)

    class INetworkDefinition(Strict):
        def __init__(self, flags, strongly_typed):
            self._flags, self._strongly_typed = flags, strongly_typed
            self._inputs, self._outputs = [], []

        num_inputs = property(lambda s: len(s._inputs))
        num_outputs = property(lambda s: len(s._outputs))

        def get_input(self, i):
            return self._inputs[i]

        def get_output(self, i):
            return self._outputs[i]

    class ParserError(Strict):
        def __init__(self, desc, node_name="", op=""):
            self._desc, self._node, self._op = desc, node_name, op

        def desc(self):
            return self._desc

        def node_name(self):
            return self._node

        def node_operator(self):
            return self._op

        def code(self):
            return "UNSUPPORTED_NODE" if self._op else "MODEL_DESERIALIZE_FAILED"

        def __str__(self):
            return f"In node (name: {self._node} operator: {self._op}): {self._desc}"

    class OnnxParser(Strict):
        def __init__(self, network, logger):
            need_logger(logger, "OnnxParser")
            self._network, self._logger, self._errors = network, logger, []
            api.calls.append(("OnnxParser.__init__",))

        num_errors = property(lambda s: len(s._errors))

        def get_error(self, i):
            return self._errors[i]

        def clear_errors(self):
            self._errors.clear()

        def _load(self, model):
            for node in model.graph.node:
                if node.op_type not in SUPPORTED_OPS:
                    self._errors.append(ParserError(
                        f"No importer registered for op: {node.op_type}. Attempting to import as "
                        "plugin.\nPlugin not found", node.name, node.op_type))
                    log(self._logger, "ERROR", f"ModelImporter: failed to import {node.name}")
                    return False
            inits = {i.name for i in model.graph.initializer}

            def tensors(vis):
                out = []
                for vi in vis:
                    if vi.name in inits:
                        continue
                    tt = vi.type.tensor_type
                    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
                    out.append(ITensor(vi.name, dims, dt(ONNX_TO_TRT[tt.elem_type])))
                return out

            self._network._inputs = tensors(model.graph.input)
            self._network._outputs = tensors(model.graph.output)
            return True

        def parse_from_file(self, path):
            api.calls.append(("OnnxParser.parse_from_file", path))
            try:
                model = onnx.load(path)
            except Exception:
                self._errors.append(ParserError(f"Failed to parse ONNX model from file: {path}!"))
                return False
            return self._load(model)

        def parse(self, model, path=None):
            api.calls.append(("OnnxParser.parse", len(model)))
            try:
                m = onnx.load_from_string(bytes(model))
            except Exception:
                self._errors.append(ParserError("Failed to parse ONNX model"))
                return False
            return self._load(m)

    api.OnnxParser = OnnxParser

    # ---- builder
    class IOptimizationProfile(Strict):
        def __init__(self):
            self._shapes = {}

        def set_shape(self, name, min, opt, max):  # noqa: A002 (real parameter names)
            api.calls.append(("IOptimizationProfile.set_shape", name, tuple(min), tuple(opt), tuple(max)))
            self._shapes[name] = (tuple(min), tuple(opt), tuple(max))

        def get_shape(self, name):
            return self._shapes.get(name)

    class IBuilderConfig(Strict):
        _settable = frozenset({"int8_calibrator", "profiling_verbosity", "builder_optimization_level"}
                              if major < 11 else {"profiling_verbosity", "builder_optimization_level"})

        def __init__(self):
            self._flags, self._profiles, self._pools = set(), [], {}
            self._calibration_profile = None
            if major < 11:
                object.__setattr__(self, "int8_calibrator", None)

        def set_memory_pool_limit(self, pool, size):
            assert pool in (api.MemoryPoolType.WORKSPACE, api.MemoryPoolType.TACTIC_DRAM), pool
            api.calls.append(("IBuilderConfig.set_memory_pool_limit", pool.name, int(size)))
            self._pools[pool.name] = int(size)

        def set_flag(self, flag):
            if not (isinstance(flag, EnumValue) and flag.owner == "BuilderFlag"):
                raise TypeError(f"set_flag(): incompatible function arguments ({flag!r})")
            api.calls.append(("IBuilderConfig.set_flag", flag.name))
            self._flags.add(flag)

        def get_flag(self, flag):
            return flag in self._flags

        def clear_flag(self, flag):
            self._flags.discard(flag)

        def add_optimization_profile(self, profile):
            api.calls.append(("IBuilderConfig.add_optimization_profile",))
            self._profiles.append(profile)
            return len(self._profiles) - 1

    if major < 11:
        def set_calibration_profile(self, profile):
            api.calls.append(("IBuilderConfig.set_calibration_profile",))
            self._calibration_profile = profile

        IBuilderConfig.set_calibration_profile = set_calibration_profile

    class Builder(Strict):
        def __init__(self, logger):
            need_logger(logger, "Builder")
            self._logger = logger
            api.calls.append(("Builder.__init__",))

        def create_network(self, flags=0):
            api.calls.append(("Builder.create_network", int(flags)))
            members = api.NetworkDefinitionCreationFlag.__members__
            valid = 0
            for v in members.values():
                valid |= 1 << v
            if int(flags) & ~valid:
                raise ValueError(f"invalid NetworkDefinitionCreationFlags {flags:#x}")
            st_bit = members.get("STRONGLY_TYPED")
            strongly = major >= 11 or (st_bit is not None and bool(flags & (1 << st_bit)))
            if major < 11 and flags & (1 << members["EXPLICIT_BATCH"]):
                api.deprecated.append("EXPLICIT_BATCH")
            if major >= 11 and st_bit is not None and flags & (1 << st_bit):
                api.deprecated.append("STRONGLY_TYPED (ignored in 11.x)")
            net = INetworkDefinition(int(flags), strongly)
            api.network = net
            return net

        def create_builder_config(self):
            api.calls.append(("Builder.create_builder_config",))
            api.config = IBuilderConfig()
            return api.config

        def create_optimization_profile(self):
            api.calls.append(("Builder.create_optimization_profile",))
            return IOptimizationProfile()

        def build_serialized_network(self, network, config):
            api.calls.append(("Builder.build_serialized_network",))
            lg = self._logger
            if api.fail_build:
                log(lg, "ERROR", api.fail_build)
                return None
            flags_set = config._flags
            if network._strongly_typed and flags_set & precision_flags:
                log(lg, "ERROR", "IBuilder::buildSerializedNetwork: Error Code 4: API Usage Error "
                    "(precision builder flags are not allowed with a strongly typed network)")
                return None
            for t in network._inputs:
                if all(d >= 0 for d in t.shape):
                    continue
                prof = next((p for p in config._profiles if t.name in p._shapes), None)
                if prof is None:
                    log(lg, "ERROR", "Network has dynamic or shape inputs, but no optimization "
                        f"profile has been defined (input {t.name}).")
                    return None
                lo, mid, hi = prof._shapes[t.name]
                for s in (lo, mid, hi):
                    if len(s) != len(t.shape) or any(d >= 0 and d != x for d, x in zip(t.shape, s)):
                        log(lg, "ERROR", f"IOptimizationProfile::setDimensions: {t.name} "
                            f"dimensions {s} mismatch the network's {t.shape}")
                        return None
                if not all(a <= b <= c for a, b, c in zip(lo, mid, hi)):
                    log(lg, "ERROR", f"profile for {t.name} violates min <= opt <= max")
                    return None
            if api.major < 11 and api.BuilderFlag.INT8 in flags_set and not network._strongly_typed:
                cal = config.int8_calibrator
                if cal is None or not isinstance(cal, api.IInt8EntropyCalibrator2):
                    log(lg, "ERROR", "Int8 requested but no calibrator and no Q/DQ scales")
                    return None
                cache = cal.read_calibration_cache()
                api.cache_seen = cache
                if not cache or not bytes(cache).startswith(b"TRT-"):
                    if cal.get_batch([t.name for t in network._inputs]) is None:
                        log(lg, "ERROR", "Calibration failure occurred with no scaling factors detected")
                        return None
            prof = config._profiles[0]._shapes if config._profiles else {}
            desc = {
                "io": [[t.name, "INPUT", t.dtype.name, list(t.shape)] for t in network._inputs]
                + [[t.name, "OUTPUT", t.dtype.name, list(t.shape)] for t in network._outputs],
                "profile": {k: [list(x) for x in v] for k, v in prof.items()},
                "strongly_typed": network._strongly_typed,
                "flags": sorted(f.name for f in flags_set),
            }
            api.engines_built.append(desc)
            return HostMemory((MAGIC + json.dumps(desc)).encode())

    class HostMemory(bytes):
        @property
        def nbytes(self):
            return len(self)

        @property
        def dtype(self):
            return api.DataType.UINT8

    api.Builder = Builder
    api.IHostMemory = HostMemory

    # ---- calibrators (10.x only)
    if major < 11:
        api.CalibrationAlgoType = make_enum(api, "CalibrationAlgoType", {
            "LEGACY_CALIBRATION": 0, "ENTROPY_CALIBRATION": 1, "ENTROPY_CALIBRATION_2": 2,
            "MINMAX_CALIBRATION": 3})

        class IInt8Calibrator:
            def __init__(self):
                api.calls.append((f"{type(self).__mro__[1].__name__}.__init__",))

        class IInt8EntropyCalibrator2(IInt8Calibrator):
            def get_algorithm(self):
                return api.CalibrationAlgoType.ENTROPY_CALIBRATION_2

        api.IInt8Calibrator = IInt8Calibrator
        api.IInt8EntropyCalibrator2 = IInt8EntropyCalibrator2

    # ---- runtime
    class IExecutionContext(Strict):
        def __init__(self, engine):
            self._engine, self._shapes, self._addr = engine, {}, {}

        def set_input_shape(self, name, shape):
            shape = tuple(int(d) for d in shape)
            api.calls.append(("IExecutionContext.set_input_shape", name, shape))
            e = self._engine
            if e._io.get(name, (None,))[0] != "INPUT":
                return False
            lo, _, hi = e._profile.get(name, [e._io[name][2]] * 3)
            ok = len(shape) == len(lo) and all(a <= x <= b for a, x, b in zip(lo, shape, hi))
            if not ok:
                log(e._logger, "ERROR", f"IExecutionContext::setInputShape: Error Code 3: {name} "
                    f"shape {shape} is outside the optimization profile [{lo}, {hi}]")
                return False
            self._shapes[name] = shape
            return True

        def get_tensor_shape(self, name):
            e = self._engine
            mode, _, shape = e._io[name]
            if mode == "INPUT":
                return self._shapes.get(name, tuple(shape))
            inputs = [n for n, v in e._io.items() if v[0] == "INPUT"]
            if any(n not in self._shapes for n in inputs):
                return tuple(shape)
            batch = self._shapes[inputs[0]][0]
            return tuple(batch if d < 0 else d for d in shape)

        def set_tensor_address(self, name, ptr):
            api.calls.append(("IExecutionContext.set_tensor_address", name, int(ptr)))
            self._addr[name] = int(ptr)
            return True

        def execute_async_v3(self, stream_handle):
            api.calls.append(("IExecutionContext.execute_async_v3", int(stream_handle)))
            if api.fail_execute:
                log(self._engine._logger, "ERROR", "IExecutionContext::enqueueV3: Error Code 1: "
                    "Cuda Runtime (an illegal memory access was encountered)")
                return False
            seen = {}
            for name, (mode, dtname, _) in self._engine._io.items():
                if name not in self._addr:
                    log(self._engine._logger, "ERROR", f"Address of {name} was not set")
                    return False
                shape = self.get_tensor_shape(name)
                n = ITEMSIZE[dtname]
                for d in shape:
                    n *= d
                if mode == "INPUT":
                    seen[name] = ctypes.string_at(self._addr[name], n) if n else b""
                elif n:
                    ctypes.memset(self._addr[name], 1, n)
            api.inputs_seen = seen
            return True

    class ICudaEngine(Strict):
        def __init__(self, desc, logger):
            self._logger = logger
            self._io = {n: (m, d, s) for n, m, d, s in desc["io"]}
            self._names = [r[0] for r in desc["io"]]
            self._profile = {k: [tuple(x) for x in v] for k, v in desc["profile"].items()}

        num_io_tensors = property(lambda s: len(s._names))

        def get_tensor_name(self, i):
            return self._names[i]

        def get_tensor_mode(self, name):
            return getattr(api.TensorIOMode, self._io[name][0])

        def get_tensor_dtype(self, name):
            return dt(self._io[name][1])

        def get_tensor_shape(self, name):
            return tuple(self._io[name][2])

        def create_execution_context(self, *a):
            api.calls.append(("ICudaEngine.create_execution_context",))
            api.context = IExecutionContext(self)
            return api.context

    class Runtime(Strict):
        def __init__(self, logger):
            need_logger(logger, "Runtime")
            self._logger = logger
            api.calls.append(("Runtime.__init__",))

        def deserialize_cuda_engine(self, blob):
            api.calls.append(("Runtime.deserialize_cuda_engine", len(blob)))
            s = bytes(blob).decode("utf-8", "replace")
            if not s.startswith(MAGIC):
                log(self._logger, "ERROR", "IRuntime::deserializeCudaEngine: Error Code 1: "
                    "Serialization (Serialization assertion magicTagRead == kMAGIC_TAG failed.)")
                return None
            return ICudaEngine(json.loads(s[len(MAGIC):]), self._logger)

    api.Runtime = Runtime

    if major < 11:  # present (deprecated) in 10.x; our code must not use it
        def execute_v2(self, bindings):
            api.calls.append(("IExecutionContext.execute_v2",))
            return True

        IExecutionContext.execute_v2 = execute_v2

    api.nptype = lambda t: None
    return api


def FakeTRT10(**kw):
    return make_fake(10, **kw)


def FakeTRT11(**kw):
    return make_fake(11, **kw)


# =============================================================================================
# fixtures

STREAM = 4242


@pytest.fixture
def use_fake(monkeypatch):
    """Install a fake as `tensorrt`, a fake CUDA device (CPU tensors, a recorded stream)."""
    waits = []

    def install(fake):
        monkeypatch.setitem(sys.modules, "tensorrt", fake)
        monkeypatch.setattr(T, "_cuda_device", lambda: "Fake GPU")
        monkeypatch.setattr(T, "_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(T, "_stream", lambda device: (STREAM, lambda: waits.append(device)))
        fake.waits = waits
        return fake

    return install


def make_model(path: Path, inputs, outputs, ops=("Identity",)) -> Path:
    """An ONNX file with the given (name, elem_type, dims) inputs/outputs; dims of None -> 'batch'."""

    def vi(name, et, dims):
        return helper.make_tensor_value_info(name, et, ["batch" if d is None else d for d in dims])

    nodes = [helper.make_node(op, [inputs[0][0]], [f"t{i}"], name=f"{op.lower()}_{i}")
             for i, op in enumerate(ops)]
    nodes += [helper.make_node("Cast", [inputs[0][0]], [o[0]], name=f"cast_{o[0]}", to=o[1])
              for o in outputs]
    graph = helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


@pytest.fixture
def qdq_onnx(tmp_path) -> Path:
    return make_model(
        tmp_path / "forecaster.int8.onnx",
        inputs=[("occ", TensorProto.FLOAT, [None, 2, 4, 4]), ("ego", TensorProto.FLOAT, [None, 2, 3])],
        outputs=[("logits", TensorProto.FLOAT16, [None, 3, 4, 4]),
                 ("classes", TensorProto.INT64, [None, 4, 4]),
                 ("valid", TensorProto.BOOL, [None]),
                 ("codes", TensorProto.INT32, [None, 5]),
                 ("q", TensorProto.INT8, [None, 6]),
                 ("bf", TensorProto.BFLOAT16, [None, 2]),
                 ("u8", TensorProto.UINT8, [None, 3]),
                 ("score", TensorProto.FLOAT, [None])],
        ops=("QuantizeLinear", "DequantizeLinear", "Conv"))


def build(onnx_path, engine_path, **kw):
    kw = {"min_batch": 1, "opt_batch": 4, "max_batch": 8, **kw}
    return T.build_engine(onnx_path, engine_path, **kw)


CACHE = (b"TRT-101303-EntropyCalibration2\n"
         b"occ: 3c010a14\n"
         b"ego: 3d4ccccd\n")


# =============================================================================================
# build: typing, flags, profile


@pytest.mark.parametrize("fake_cls", [FakeTRT10, FakeTRT11])
def test_strongly_typed_network_without_explicit_batch(use_fake, qdq_onnx, tmp_path, fake_cls):
    fake = use_fake(fake_cls())
    info = build(qdq_onnx, tmp_path / "e.plan")
    ndf = fake.NetworkDefinitionCreationFlag
    want = 1 << int(ndf.STRONGLY_TYPED)          # bit 1 on 10.x, bit 0 on 11.x
    assert fake.called("Builder.create_network") == [(want,)]
    assert fake.network._strongly_typed
    assert info["network_flags"] == want and info["strongly_typed"] is True
    if fake.major == 10:
        assert not want & (1 << int(ndf.EXPLICIT_BATCH))
        assert "EXPLICIT_BATCH" not in fake.deprecated
    else:
        with pytest.raises(AttributeError):
            ndf.EXPLICIT_BATCH  # noqa: B018 (the 11.x stand-in really lacks it)
        fake.touched.clear()
    # precision comes from the graph: no builder precision flag, no calibrator
    assert fake.called("IBuilderConfig.set_flag") == []
    assert fake.engines_built[-1]["flags"] == []
    assert fake.touched == []
    assert info["tensorrt"] == fake.__version__ and info["tensorrt_major"] == fake.major
    assert info["bytes"] == (tmp_path / "e.plan").stat().st_size > 0
    assert fake.called("OnnxParser.parse_from_file") == [(str(qdq_onnx),)]


def test_11_without_strongly_typed_member_builds_with_no_flags(use_fake, qdq_onnx, tmp_path):
    """If a later 11.x drops the (ignored) STRONGLY_TYPED member, flags 0 is still strongly typed."""
    fake = use_fake(FakeTRT11(strongly_typed_member=False))
    info = build(qdq_onnx, tmp_path / "e.plan")
    assert fake.called("Builder.create_network") == [(0,)]
    assert info["strongly_typed"] and fake.network._strongly_typed
    assert fake.touched == []


def test_profile_has_min_opt_max_batch_and_network_dims(use_fake, qdq_onnx, tmp_path):
    fake = use_fake(FakeTRT10())
    info = build(qdq_onnx, tmp_path / "e.plan", min_batch=2, opt_batch=3, max_batch=16,
                 workspace_gib=0.5)
    assert fake.called("IOptimizationProfile.set_shape") == [
        ("occ", (2, 2, 4, 4), (3, 2, 4, 4), (16, 2, 4, 4)),
        ("ego", (2, 2, 3), (3, 2, 3), (16, 2, 3)),
    ]
    assert len(fake.called("IBuilderConfig.add_optimization_profile")) == 1
    assert fake.called("IBuilderConfig.set_memory_pool_limit") == [("WORKSPACE", 1 << 29)]
    assert info["profile"]["ego"] == [[2, 2, 3], [3, 2, 3], [16, 2, 3]]
    assert fake.engines_built[-1]["profile"]["occ"] == [[2, 2, 4, 4], [3, 2, 4, 4], [16, 2, 4, 4]]


def test_profile_refusals_name_the_file(use_fake, tmp_path):
    use_fake(FakeTRT10())
    static = make_model(tmp_path / "static.onnx", [("x", TensorProto.FLOAT, [1, 3])],
                        [("y", TensorProto.FLOAT, [1, 3])])
    with pytest.raises(WMError) as ei:
        build(static, tmp_path / "e.plan")
    s = one_line(ei.value)
    assert str(static) in s and "'x'" in s and "fixed batch of 1" in s
    assert build(static, tmp_path / "e.plan", min_batch=1, opt_batch=1, max_batch=1)["bytes"] > 0

    dyn = make_model(tmp_path / "dyn.onnx", [("x", TensorProto.FLOAT, [None, "w"])],
                     [("y", TensorProto.FLOAT, [None, "w"])])
    with pytest.raises(WMError) as ei:
        build(dyn, tmp_path / "e2.plan")
    s = one_line(ei.value)
    assert str(dyn) in s and "axis 1 (w) is dynamic and no range was given" in s
    assert not (tmp_path / "e2.plan").exists()
    # a named dynamic axis with its range (world_step's frames): min/opt/max on that axis too
    info = build(dyn, tmp_path / "e3.plan", dims={"w": (2, 5, 16)})
    assert info["profile"]["x"] == [[1, 2], [4, 5], [8, 16]]

    for lo, mid, hi in ((4, 2, 8), (1, 9, 8), (0, 1, 2)):
        with pytest.raises(WMError):
            build(static, tmp_path / "e3.plan", min_batch=lo, opt_batch=mid, max_batch=hi)
    with pytest.raises(WMError) as ei:
        build(tmp_path / "missing.onnx", tmp_path / "e4.plan")
    assert "missing.onnx" in one_line(ei.value)


# =============================================================================================
# build: the legacy implicit INT8 path and what 11.x removed


def test_implicit_int8_on_10_reads_our_cache_only(use_fake, qdq_onnx, tmp_path):
    fake = use_fake(FakeTRT10())
    cache = tmp_path / "calib.cache"
    cache.write_bytes(CACHE)
    info = build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=cache,
                 fp16_fallback=True)
    assert fake.called("Builder.create_network") == [(0,)]          # weakly typed
    assert not fake.network._strongly_typed
    assert sorted(c[0] for c in fake.called("IBuilderConfig.set_flag")) == ["FP16", "INT8"]
    cal = fake.config.int8_calibrator
    assert isinstance(cal, fake.IInt8EntropyCalibrator2)
    assert fake.called("IInt8EntropyCalibrator2.__init__") == [()]
    assert bytes(fake.cache_seen) == CACHE                           # TensorRT got our bytes
    assert cal.get_batch(["occ", "ego"]) is None                     # never calibrates itself
    assert cal.write_calibration_cache(b"other") is None
    assert cache.read_bytes() == CACHE
    assert len(fake.called("IBuilderConfig.set_calibration_profile")) == 1
    assert info["implicit_int8"] and not info["strongly_typed"]
    assert info["calibration_cache_reads"] == 1
    assert fake.engines_built[-1]["flags"] == ["FP16", "INT8"]
    # the same float path on 10.x, weakly typed without INT8
    fake.calls.clear()
    info = build(qdq_onnx, tmp_path / "w.plan", strongly_typed=False, fp16_fallback=True)
    assert fake.called("Builder.create_network") == [(0,)]
    assert fake.called("IBuilderConfig.set_flag") == [("FP16",)]


def test_implicit_int8_cache_problems_are_one_line(use_fake, qdq_onnx, tmp_path):
    use_fake(FakeTRT10())
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True)
    assert "int8_cache" in one_line(ei.value)
    bad = tmp_path / "bad.cache"
    bad.write_bytes(b"occ: 3c010a14\n")
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=bad)
    s = one_line(ei.value)
    assert str(bad) in s and "EntropyCalibration2" in s
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=tmp_path / "nope.cache")
    assert "nope.cache" in one_line(ei.value)
    assert not (tmp_path / "e.plan").exists()


def test_implicit_int8_refused_on_11_without_touching_removed_api(use_fake, qdq_onnx, tmp_path):
    fake = use_fake(FakeTRT11())
    cache = tmp_path / "calib.cache"
    cache.write_bytes(CACHE)
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=cache)
    s = one_line(ei.value)
    assert "removed in TensorRT 11.1.0.4" in s and str(cache) in s and "strongly typed" in s
    assert fake.touched == [] and fake.calls == []                   # refused before any builder
    assert not (tmp_path / "e.plan").exists()
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", strongly_typed=False)
    assert "strongly typed networks only" in one_line(ei.value)
    assert fake.touched == [] and fake.calls == []


@pytest.mark.parametrize("fake_cls", [FakeTRT10, FakeTRT11])
def test_fp16_flag_refused_with_strong_typing(use_fake, qdq_onnx, tmp_path, fake_cls):
    fake = use_fake(fake_cls())
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", fp16_fallback=True)
    assert "fp16_fallback" in one_line(ei.value) and str(qdq_onnx) in str(ei.value)
    assert fake.touched == [] and fake.called("IBuilderConfig.set_flag") == []


def test_the_11_stand_in_rejects_removed_calls():
    """The checks above mean something only if the 11.x stand-in refuses what 11.x removed."""
    fake = FakeTRT11()
    for get in (lambda: fake.BuilderFlag.INT8, lambda: fake.BuilderFlag.FP16,
                lambda: fake.NetworkDefinitionCreationFlag.EXPLICIT_BATCH,
                lambda: fake.IInt8EntropyCalibrator2, lambda: fake.CalibrationAlgoType):
        with pytest.raises(AttributeError):
            get()
    cfg = fake.Builder(fake.Logger()).create_builder_config()
    with pytest.raises(AttributeError):
        cfg.int8_calibrator = object()
    with pytest.raises(AttributeError):
        cfg.set_calibration_profile(None)
    with pytest.raises(AttributeError):
        cfg.max_workspace_size = 1 << 30
    with pytest.raises(ValueError):   # the old EXPLICIT_BATCH bit pattern is not a valid 11.x flag
        fake.Builder(fake.Logger()).create_network(1 << 3)
    assert fake.touched == ["BuilderFlag.INT8", "BuilderFlag.FP16",
                            "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "IInt8EntropyCalibrator2",
                            "CalibrationAlgoType", "IBuilderConfig.int8_calibrator=",
                            "IBuilderConfig.set_calibration_profile",
                            "IBuilderConfig.max_workspace_size="]
    ten = FakeTRT10()
    assert ten.BuilderFlag.INT8 and ten.IInt8EntropyCalibrator2 and ten.touched == []


# =============================================================================================
# build: failures


def test_parser_errors_are_one_line_naming_the_file(use_fake, tmp_path):
    fake = use_fake(FakeTRT11())
    bad = make_model(tmp_path / "bad.onnx", [("x", TensorProto.FLOAT, [None, 3])],
                     [("y", TensorProto.FLOAT, [None, 3])], ops=("Identity", "NotARealOp"))
    with pytest.raises(WMError) as ei:
        build(bad, tmp_path / "e.plan")
    s = one_line(ei.value)
    assert str(bad) in s and "could not parse" in s
    assert "No importer registered for op: NotARealOp" in s and "notarealop_1" in s
    assert fake.called("Builder.build_serialized_network") == []

    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not an onnx model\xff" * 8)
    with pytest.raises(WMError) as ei:
        build(junk, tmp_path / "e.plan")
    s = one_line(ei.value)
    assert str(junk) in s and "Failed to parse ONNX model" in s
    assert not (tmp_path / "e.plan").exists()
    assert fake.touched == []


@pytest.mark.parametrize("fake_cls", [FakeTRT10, FakeTRT11])
def test_failed_build_leaves_no_file_and_keeps_the_old_engine(use_fake, qdq_onnx, tmp_path, fake_cls):
    fake = use_fake(fake_cls())
    engine = tmp_path / "out" / "e.plan"
    engine.parent.mkdir()
    engine.write_bytes(b"OLD ENGINE")
    fake.fail_build = "Error Code 2: OutOfMemory (Requested size was 9000000000 bytes.)\nmore"
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, engine)
    s = one_line(ei.value)
    assert str(qdq_onnx) in s and "OutOfMemory (Requested size was 9000000000 bytes.) more" in s
    assert engine.read_bytes() == b"OLD ENGINE"
    assert sorted(p.name for p in engine.parent.iterdir()) == ["e.plan"]
    assert len(fake.called("Builder.build_serialized_network")) == 1


def test_engine_written_atomically(use_fake, qdq_onnx, tmp_path, monkeypatch):
    fake = use_fake(FakeTRT10())
    engine = tmp_path / "sub" / "forecaster.plan"
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((Path(src), Path(dst), Path(src).read_bytes()))
        assert not Path(dst).exists()  # nothing under the final name before the rename
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)  # what wm.atomic calls
    info = build(qdq_onnx, engine)
    (src, dst, data), = replaced
    assert dst == engine and src.parent == engine.parent
    assert src.name == f".forecaster.plan.tmp-{os.getpid()}" and not src.exists()
    assert engine.read_bytes() == data and data.startswith(b"FAKE-TRT-ENGINE:")
    assert info["bytes"] == len(data) and info["engine"] == str(engine)
    assert json.loads(data[len(b"FAKE-TRT-ENGINE:"):])["strongly_typed"] is True

    # a write that fails half way: one line, no engine, no temp file
    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    other = tmp_path / "sub" / "other.plan"
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, other)
    s = one_line(ei.value)
    assert str(other) in s and "No space left on device" in s
    assert sorted(p.name for p in other.parent.iterdir()) == ["forecaster.plan"]
    assert fake.touched == []


def test_build_without_cuda_is_one_line(use_fake, qdq_onnx, tmp_path, monkeypatch):
    fake = use_fake(FakeTRT10())
    monkeypatch.setattr(T, "_cuda_device", lambda: None)
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan")
    assert "no CUDA device" in one_line(ei.value)
    assert fake.called("Builder.__init__") == []


# =============================================================================================
# run


def _runner(use_fake, fake, qdq_onnx, tmp_path):
    use_fake(fake)
    engine = tmp_path / "e.plan"
    build(qdq_onnx, engine)
    fake.calls.clear()
    return T.TrtRunner(engine)


@pytest.mark.parametrize("fake_cls", [FakeTRT10, FakeTRT11])
def test_runner_binds_torch_tensors_and_maps_dtypes(use_fake, qdq_onnx, tmp_path, fake_cls):
    fake = fake_cls()
    r = _runner(use_fake, fake, qdq_onnx, tmp_path)
    assert r.inputs == ["occ", "ego"]
    assert r.outputs == ["logits", "classes", "valid", "codes", "q", "bf", "u8", "score"]
    assert r.dtypes == {"occ": torch.float32, "ego": torch.float32, "logits": torch.float16,
                        "classes": torch.int64, "valid": torch.bool, "codes": torch.int32,
                        "q": torch.int8, "bf": torch.bfloat16, "u8": torch.uint8,
                        "score": torch.float32}
    occ = torch.randn(3, 2, 4, 4)
    ego64 = torch.randn(3, 2, 3, dtype=torch.float64)              # converted to the engine's FLOAT
    out = r(occ=occ, ego=ego64)

    assert fake.called("IExecutionContext.set_input_shape") == [("occ", (3, 2, 4, 4)),
                                                                ("ego", (3, 2, 3))]
    addr = dict(fake.called("IExecutionContext.set_tensor_address"))
    assert list(addr) == ["occ", "ego", *r.outputs]
    assert addr["occ"] == occ.data_ptr()                           # the caller's tensor itself
    assert addr["ego"] != ego64.data_ptr()
    assert fake.inputs_seen["occ"] == occ.numpy().tobytes()        # what the engine read
    assert fake.inputs_seen["ego"] == ego64.float().numpy().tobytes()
    assert fake.called("IExecutionContext.execute_async_v3") == [(STREAM,)]
    assert fake.waits == [torch.device("cpu")]

    want_shapes = {"logits": (3, 3, 4, 4), "classes": (3, 4, 4), "valid": (3,), "codes": (3, 5),
                   "q": (3, 6), "bf": (3, 2), "u8": (3, 3), "score": (3,)}
    assert list(out) == r.outputs
    for name, t in out.items():
        assert t.dtype == r.dtypes[name] and tuple(t.shape) == want_shapes[name], name
        assert addr[name] == t.data_ptr(), name                    # the engine wrote into it
        raw = t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
        assert bool((raw == 1).all()), name
    assert fake.called("IExecutionContext.execute_v2") == []
    assert fake.touched == []


def test_runner_refusals(use_fake, qdq_onnx, tmp_path):
    fake = FakeTRT11()
    r = _runner(use_fake, fake, qdq_onnx, tmp_path)
    with pytest.raises(WMError) as ei:
        r(occ=torch.zeros(9, 2, 4, 4), ego=torch.zeros(9, 2, 3))   # batch 9 > max 8
    s = one_line(ei.value)
    assert "'occ'" in s and "outside the optimization profile" in s and "[9, 2, 4, 4]" in s
    with pytest.raises(WMError) as ei:
        r(occ=torch.zeros(1, 2, 4, 4))
    assert "missing ['ego']" in one_line(ei.value)
    with pytest.raises(WMError) as ei:
        r(occ=torch.zeros(1, 2, 4, 4), ego=torch.zeros(1, 2, 3), extra=torch.zeros(1))
    assert "unexpected ['extra']" in one_line(ei.value)
    fake.fail_execute = True
    with pytest.raises(WMError) as ei:
        r(occ=torch.zeros(1, 2, 4, 4), ego=torch.zeros(1, 2, 3))
    assert "illegal memory access" in one_line(ei.value)
    assert fake.touched == []


def test_runner_bad_engine_files(use_fake, tmp_path):
    use_fake(FakeTRT10())
    junk = tmp_path / "junk.plan"
    junk.write_bytes(b"\x01\x02 not an engine")
    with pytest.raises(WMError) as ei:
        T.TrtRunner(junk)
    s = one_line(ei.value)
    assert str(junk) in s and "magicTagRead" in s
    with pytest.raises(WMError) as ei:
        T.TrtRunner(tmp_path / "none.plan")
    assert "none.plan" in one_line(ei.value)


def test_runner_time(use_fake, qdq_onnx, tmp_path):
    fake = FakeTRT10()
    r = _runner(use_fake, fake, qdq_onnx, tmp_path)
    ms = r.time({"occ": torch.zeros(2, 2, 4, 4), "ego": torch.zeros(2, 2, 3)}, iters=7, warmup=2)
    assert isinstance(ms, float) and ms > 0
    assert len(fake.called("IExecutionContext.execute_async_v3")) == 9


def test_torch_dtype_without_equivalent():
    fake = FakeTRT11()
    assert T.torch_dtype(fake, fake.DataType.BF16) is torch.bfloat16
    with pytest.raises(WMError) as ei:
        T.torch_dtype(fake, fake.DataType.INT4)
    assert "INT4" in one_line(ei.value)


# =============================================================================================
# availability


def test_available_says_why_when_tensorrt_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)     # import of a blocked module fails
    ok, why = T.available()
    assert not ok and why.startswith("TensorRT is not available here (import tensorrt failed:")
    assert "\n" not in why


def test_available_with_the_real_import(monkeypatch):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    ok, why = T.available()
    assert (ok, why) == (False, "TensorRT is not available here (import tensorrt failed: "
                                "ModuleNotFoundError: No module named 'tensorrt')")


def test_available_with_fakes(use_fake, monkeypatch):
    use_fake(FakeTRT11())
    assert T.available() == (True, "TensorRT 11.1.0.4 on Fake GPU")
    monkeypatch.setattr(T, "_cuda_device", lambda: None)
    assert T.available() == (False, "TensorRT 11.1.0.4 imports, but torch sees no CUDA device")
    old = make_fake(8)
    monkeypatch.setitem(sys.modules, "tensorrt", old)
    ok, why = T.available()
    assert not ok and "8.0.0 is too old" in why


# =============================================================================================
# trtexec


def test_trtexec_command(tmp_path, qdq_onnx):
    shapes = T.onnx_profile_shapes(qdq_onnx, 1, 4, 8)
    assert shapes == {"occ": ((1, 2, 4, 4), (4, 2, 4, 4), (8, 2, 4, 4)),
                      "ego": ((1, 2, 3), (4, 2, 3), (8, 2, 3))}
    cmd = T.trtexec_command("run/export/f.onnx", "run/export/f.plan", shapes, workspace_gib=4)
    assert cmd == ("trtexec --onnx=run/export/f.onnx --saveEngine=run/export/f.plan --stronglyTyped "
                   "--minShapes=occ:1x2x4x4,ego:1x2x3 --optShapes=occ:4x2x4x4,ego:4x2x3 "
                   "--maxShapes=occ:8x2x4x4,ego:8x2x3 --memPoolSize=workspace:4096")
    fp16 = T.trtexec_command("a b/f.onnx", "f.plan", {"x": ((1, 3), (2, 3), (4, 3))}, fp16=True)
    assert fp16 == ("trtexec '--onnx=a b/f.onnx' --saveEngine=f.plan --fp16 --minShapes=x:1x3 "
                    "--optShapes=x:2x3 --maxShapes=x:4x3")
    with pytest.raises(WMError):
        T.trtexec_command("f.onnx", "f.plan", {})
    with pytest.raises(WMError):
        T.trtexec_command("f.onnx", "f.plan", {"x": ((1, 3), (2, 3))})
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"nope")
    with pytest.raises(WMError) as ei:
        T.onnx_profile_shapes(junk, 1, 2, 3)
    assert str(junk) in one_line(ei.value)


# =============================================================================================
# export.py's TensorRT step


import torch._dynamo  # noqa: E402,F401 (loaded before a stand-in `tensorrt`: its import probes find_spec("tensorrt"))

import wm.export.onnx  # noqa: E402,F401


@pytest.fixture
def runnable_onnx(tmp_path) -> Path:
    """A graph onnxruntime can run: classes (uint8) = occ, score (float) = x + x."""
    nodes = [helper.make_node("Identity", ["occ"], ["classes"], name="identity_0"),
             helper.make_node("Add", ["x", "x"], ["score"], name="add_0")]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("occ", TensorProto.UINT8, ["batch", 3]),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
                          [helper.make_tensor_value_info("classes", TensorProto.UINT8, ["batch", 3]),
                           helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 2])])
    path = tmp_path / "forecaster.int8.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _feed():
    import numpy as np

    return {"occ": np.array([[1, 1, 2], [1, 3, 1]], np.uint8),
            "x": np.array([[0.5, 0.25], [1.0, -1.0]], np.float32)}


def test_deploy_without_tensorrt_prints_why_and_trtexec(monkeypatch, runnable_onnx):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    lines = []
    res = T.deploy({"forecaster": runnable_onnx}, {"forecaster": _feed()}, max_batch=8, log=lines.append)
    assert res["available"] is False
    assert lines[0].startswith("TensorRT engines not built: TensorRT is not available here (import")
    engine = runnable_onnx.with_suffix(".engine")
    want = (f"trtexec --onnx={runnable_onnx} --saveEngine={engine} --stronglyTyped "
            "--minShapes=occ:1x3,x:1x2 --optShapes=occ:1x3,x:1x2 --maxShapes=occ:8x3,x:8x2")
    assert lines[1] == f"  {want}" and res["graphs"]["forecaster"]["trtexec"] == want
    assert not engine.exists()


@pytest.mark.parametrize("fake_cls", [FakeTRT10, FakeTRT11])
def test_deploy_builds_runs_compares_and_times(use_fake, runnable_onnx, fake_cls):
    fake = use_fake(fake_cls())
    lines = []
    res = T.deploy({"forecaster": runnable_onnx}, {"forecaster": _feed()}, max_batch=8, opt_batch=2,
                   log=lines.append, timing_iters=3)
    g = res["graphs"]["forecaster"]
    engine = runnable_onnx.with_suffix(".engine")
    assert res["available"] and engine.is_file() and g["engine"] == "forecaster.int8.engine"
    # the stand-in engine writes 0x01 into every output byte: 4 of the 6 classes are 1 in onnxruntime
    assert g["vs_onnxruntime"]["classes"] == {"agreement": pytest.approx(4 / 6)}
    one = float(torch.tensor([1], dtype=torch.uint8).repeat(4).view(torch.float32))
    assert g["vs_onnxruntime"]["score"]["max_abs_diff"] == pytest.approx(abs(one - (-2.0)))
    assert set(g["latency_ms"]) == {"batch1", "batch2"}
    assert fake.called("IOptimizationProfile.set_shape")[0][1:] == ((1, 3), (2, 3), (8, 3))
    assert len(fake.called("IExecutionContext.execute_async_v3")) == 1 + 2 * (5 + 3)
    assert fake.touched == []
    assert "forecaster.int8.engine" in lines[1] and "classes 0.6667" in lines[1]
