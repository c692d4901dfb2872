"""wm.export.trt against the TensorRT 10.x and 11.x Python APIs, through a stand-in module.

TensorRT cannot be installed here, so `fake_trt(major)` goes in as ``sys.modules["tensorrt"]``. It has
only what wm calls, under the names and parameters of NVIDIA/TensorRT's Python bindings (release/10.13
and 11.1), so any other call fails; its 11.x lacks what 11.x removed (EXPLICIT_BATCH, BuilderFlag.FP16
and INT8, the calibrators, IBuilderConfig.int8_calibrator). Its engine file is JSON of what the
builder was given, so the tests read what the engine on disk was built with. It lists I/O tensors in
an order unlike the ONNX file's (TensorRT documents none). Running reads every input buffer and writes
0x01 into every output byte; CPU tensors stand in for CUDA ones.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
import types
from enum import IntEnum
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch._dynamo  # noqa: F401 (imported before a stand-in `tensorrt`: its import probes find_spec("tensorrt"))
from onnx import TensorProto, helper

from wm.export.calib import trt_version_number, write_cache
import wm.export.onnx  # noqa: F401 (the same)
import wm.export.trt as T
import wm.export.trt_run as R
from wm.utils.errors import WMError

# =============================================================================================
# the stand-in

DTYPES = {TensorProto.FLOAT: "FLOAT", TensorProto.FLOAT16: "HALF", TensorProto.BFLOAT16: "BF16",
          TensorProto.INT8: "INT8", TensorProto.INT32: "INT32", TensorProto.INT64: "INT64",
          TensorProto.BOOL: "BOOL", TensorProto.UINT8: "UINT8"}
ITEMSIZE = {"FLOAT": 4, "HALF": 2, "BF16": 2, "INT8": 1, "INT32": 4, "INT64": 8, "BOOL": 1, "UINT8": 1}
MAGIC = b"FAKE-TRT-ENGINE\n"


def fake_trt(major: int, drop=()) -> types.ModuleType:
    """`tensorrt` of `major` (10 or 11; another number for a version wm refuses). `drop`: flag names
    a later release might remove. Knobs: fail_build (a logged reason), reject_cache, fail_execute."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = {10: "10.13.3.9", 11: "11.1.0.4"}.get(major, f"{major}.0.0")
    trt.fail_build = trt.reject_cache = trt.fail_execute = None
    trt.ran = []  # ("execute", stream handle, {input: bytes read}) and "wait", in order
    trt.DataType = IntEnum("DataType", "FLOAT HALF INT8 INT32 BOOL UINT8 FP8 BF16 INT64 INT4 FP4", start=0)
    trt.TensorIOMode = IntEnum("TensorIOMode", "NONE INPUT OUTPUT", start=0)
    trt.MemoryPoolType = IntEnum("MemoryPoolType", "WORKSPACE", start=0)
    ndf = {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1} if major < 11 else {"STRONGLY_TYPED": 0}
    trt.NetworkDefinitionCreationFlag = IntEnum("NetworkDefinitionCreationFlag",
                                                {k: v for k, v in ndf.items() if k not in drop})
    trt.BuilderFlag = IntEnum("BuilderFlag", {"FP16": 0, "INT8": 1} if major < 11 else {"DEBUG": 0})
    if major < 11:
        trt.IInt8EntropyCalibrator2 = type("IInt8EntropyCalibrator2", (), {})

    class ILogger:
        Severity = IntEnum("Severity", "INTERNAL_ERROR ERROR WARNING INFO VERBOSE", start=0)

    def error_log(logger):
        if not isinstance(logger, ILogger):
            raise TypeError(f"incompatible function arguments: {type(logger)} is not a tensorrt.ILogger")
        return lambda msg: logger.log(ILogger.Severity.ERROR, msg)  # returns None, as a failed call does

    def parser_error(desc, name="", op=""):
        return types.SimpleNamespace(desc=lambda: desc, node_name=lambda: name, node_operator=lambda: op)

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.errors = network, []
            error_log(logger)

        num_errors = property(lambda self: len(self.errors))
        get_error = lambda self, index: self.errors[index]  # noqa: E731

        def parse_from_file(self, model):
            try:
                m = onnx.load(model)
            except Exception:
                self.errors.append(parser_error(f"Failed to parse ONNX model from file: {model}"))
                return False
            for node in m.graph.node:
                if node.op_type not in ("Identity", "Add", "Cast", "QuantizeLinear", "DequantizeLinear", "Conv"):
                    self.errors.append(parser_error(f"No importer registered for op: {node.op_type}",
                                                    node.name, node.op_type))
                    return False
            for mode, vis in (("INPUT", m.graph.input), ("OUTPUT", m.graph.output)):
                for vi in vis:
                    t = vi.type.tensor_type
                    shape = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
                    self.network.io.append((vi.name, mode, DTYPES[t.elem_type], shape))
            return True

    class Network:
        def __init__(self, flags):
            self.flags, self.io = flags, []

        inputs = property(lambda self: [t for t in self.io if t[1] == "INPUT"])
        num_inputs = property(lambda self: len(self.inputs))

        def get_input(self, index):
            return types.SimpleNamespace(name=self.inputs[index][0], shape=self.inputs[index][3])

    class Config:  # slots: setting anything else (11.x: int8_calibrator) raises AttributeError
        __slots__ = ("flags", "profiles", "pools", "calibration_profile") + ("int8_calibrator",) * (major < 11)

        def __init__(self):
            self.flags, self.profiles, self.pools, self.calibration_profile = [], [], {}, None

        def set_memory_pool_limit(self, pool, pool_size):
            self.pools[trt.MemoryPoolType(pool).name] = pool_size

        add_optimization_profile = lambda self, profile: self.profiles.append(profile)  # noqa: E731
        set_flag = lambda self, flag: self.flags.append(trt.BuilderFlag(flag).name)  # noqa: E731
        if major < 11:
            def set_calibration_profile(self, profile):
                self.calibration_profile = profile

    class Profile(dict):
        def set_shape(self, input, min, opt, max):  # noqa: A002 (the binding's names)
            self[input] = [list(min), list(opt), list(max)]

    class Builder:
        def __init__(self, logger):
            self.error = error_log(logger)

        def create_network(self, flags=0):
            if flags & ~sum(1 << f for f in trt.NetworkDefinitionCreationFlag):
                raise ValueError(f"invalid NetworkDefinitionCreationFlags {flags:#x}")
            return Network(flags)

        create_builder_config = lambda self: Config()  # noqa: E731
        create_optimization_profile = lambda self: Profile()  # noqa: E731

        def build_serialized_network(self, network, config):
            if trt.fail_build:
                return self.error(trt.fail_build)
            for name, _, _, shape in network.inputs:
                if -1 in shape and not (config.profiles and name in config.profiles[0]):
                    return self.error(f"Network has dynamic inputs, but no optimization profile for {name}")
            cache = None
            if "INT8" in config.flags:
                cal = config.int8_calibrator
                if not isinstance(cal, trt.IInt8EntropyCalibrator2):
                    raise TypeError(f"int8_calibrator: {type(cal)} is not a tensorrt.IInt8Calibrator")
                cache = None if trt.reject_cache else bytes(cal.read_calibration_cache()).decode()
                if cache is None and cal.get_batch([t[0] for t in network.inputs]) is None:
                    return self.error("Calibration failure occurred with no scaling factors detected")
            outputs = [t for t in network.io if t[1] == "OUTPUT"]
            return MAGIC + json.dumps({
                "network_flags": network.flags, "builder_flags": config.flags, "pools": config.pools,
                "profiles": config.profiles, "calibration_profile": config.calibration_profile is not None,
                "calibration_cache": cache, "io": outputs[::-1] + network.inputs}).encode()

    class Context:
        def __init__(self, engine, error):
            self.io, self.profile, self.error = {t[0]: t[1:] for t in engine["io"]}, engine["profiles"][0], error
            self.shapes, self.addr = {}, {}

        def set_input_shape(self, name, shape):
            lo, _, hi = self.profile[name]
            if len(shape) != len(lo) or not all(a <= x <= b for a, x, b in zip(lo, shape, hi)):
                return self.error(f"IExecutionContext::setInputShape: {name} {tuple(shape)} outside the profile")
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            batch = next(iter(self.shapes.values()))[0]
            return tuple(batch if d < 0 else d for d in self.io[name][2])

        def set_tensor_address(self, name, memory):
            self.addr[name] = memory

        def execute_async_v3(self, stream_handle):
            if trt.fail_execute:
                return self.error("Cuda Runtime (an illegal memory access was encountered)")
            seen = {}
            for name, (mode, dt, _) in self.io.items():
                n = int(np.prod(self.get_tensor_shape(name))) * ITEMSIZE[dt]
                if mode == "INPUT":
                    seen[name] = ctypes.string_at(self.addr[name], n)
                else:
                    ctypes.memset(self.addr[name], 1, n)
            trt.ran.append(("execute", stream_handle, seen))
            return True

    class Runtime:
        def __init__(self, logger):
            self.error = error_log(logger)

        def deserialize_cuda_engine(self, serialized_engine):
            blob = bytes(serialized_engine)
            if not blob.startswith(MAGIC):
                return self.error("Serialization assertion magicTagRead == kMAGIC_TAG failed.")
            e = json.loads(blob[len(MAGIC):])
            io = {t[0]: t[1:] for t in e["io"]}
            return types.SimpleNamespace(
                num_io_tensors=len(io), get_tensor_name=lambda index: e["io"][index][0],
                get_tensor_mode=lambda name: trt.TensorIOMode[io[name][0]],
                get_tensor_dtype=lambda name: trt.DataType[io[name][1]],
                create_execution_context=lambda: Context(e, self.error))

    trt.ILogger, trt.OnnxParser, trt.Builder, trt.Runtime = ILogger, OnnxParser, Builder, Runtime
    return trt


def engine_json(path) -> dict:
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    return json.loads(data[len(MAGIC):])


STREAM = 4242


@pytest.fixture
def use(monkeypatch):
    """Install fake_trt(major) as `tensorrt`, with a fake GPU: CPU tensors and a stream handle that
    records when the runner waits for it."""

    def install(major, **kw):
        trt = fake_trt(major, **kw)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setattr(T, "_cuda_device", lambda: "Fake GPU")
        monkeypatch.setattr(R, "_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(R, "_stream", lambda device: (STREAM, lambda: trt.ran.append("wait")))
        return trt

    return install


@pytest.fixture(params=[10, 11])
def trt(request, use):
    return use(request.param)


def one_line(e: BaseException) -> str:
    assert isinstance(e, WMError) and str(e) and "\n" not in str(e), repr(e)
    return str(e)


def make_model(path, inputs, outputs, ops=("Identity",)):
    """An ONNX file with (name, elem_type, dims) inputs/outputs, None dims named 'batch'."""
    def vi(name, elem_type, dims):
        return helper.make_tensor_value_info(name, elem_type, ["batch" if d is None else d for d in dims])

    nodes = [helper.make_node(op, [inputs[0][0]], [f"t{i}"], name=f"{op.lower()}_{i}") for i, op in enumerate(ops)]
    nodes += [helper.make_node("Cast", [inputs[0][0]], [o[0]], to=o[1]) for o in outputs]
    g = helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.fixture
def qdq_onnx(tmp_path):
    return make_model(
        tmp_path / "forecaster.int8.onnx",
        [("occ", TensorProto.FLOAT, [None, 2, 4, 4]), ("ego", TensorProto.FLOAT, [None, 2, 3])],
        [("logits", TensorProto.FLOAT16, [None, 3, 4, 4]), ("classes", TensorProto.INT64, [None, 4, 4]),
         ("valid", TensorProto.BOOL, [None]), ("codes", TensorProto.INT32, [None, 5]),
         ("q", TensorProto.INT8, [None, 6]), ("bf", TensorProto.BFLOAT16, [None, 2]),
         ("u8", TensorProto.UINT8, [None, 3]), ("score", TensorProto.FLOAT, [None])],
        ops=("QuantizeLinear", "DequantizeLinear", "Conv"))


def build(onnx_path, engine_path, **kw):
    return T.build_engine(onnx_path, engine_path, **{"min_batch": 1, "opt_batch": 4, "max_batch": 8, **kw})


# =============================================================================================
# build: the engine file


def test_engine_is_a_strongly_typed_network_with_one_batch_profile(trt, qdq_onnx, tmp_path):
    engine = tmp_path / "out" / "e.plan"
    info = build(qdq_onnx, engine, min_batch=2, opt_batch=3, max_batch=16, workspace_gib=0.5)
    e = engine_json(engine)
    # the bit comes from the enum: 1 << 1 on 10.x (no EXPLICIT_BATCH), 1 << 0 on 11.x
    assert e["network_flags"] == info["network_flags"] == (2 if trt.__version__.startswith("10.") else 1)
    assert e["builder_flags"] == [] and e["calibration_cache"] is None  # precision is the graph's
    assert e["pools"] == {"WORKSPACE": 1 << 29}
    assert e["profiles"] == [{"occ": [[2, 2, 4, 4], [3, 2, 4, 4], [16, 2, 4, 4]],
                              "ego": [[2, 2, 3], [3, 2, 3], [16, 2, 3]]}]
    assert info["profile"] == e["profiles"][0] and info["strongly_typed"] is True
    assert (info["tensorrt"], info["tensorrt_major"]) == (trt.__version__, int(trt.__version__[:2]))
    assert info["bytes"] == engine.stat().st_size and info["engine"] == str(engine)
    assert os.listdir(engine.parent) == ["e.plan"]


def test_an_11_without_the_strongly_typed_member_builds_with_flags_0(use, qdq_onnx, tmp_path):
    use(11, drop=("STRONGLY_TYPED",))
    info = build(qdq_onnx, tmp_path / "e.plan")
    assert engine_json(tmp_path / "e.plan")["network_flags"] == 0 and info["strongly_typed"]


def test_profile_refusals_name_the_file(use, tmp_path):
    use(10)
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
    build(dyn, tmp_path / "e3.plan", dims={"w": (2, 5, 16)})
    assert engine_json(tmp_path / "e3.plan")["profiles"] == [{"x": [[1, 2], [4, 5], [8, 16]]}]

    for lo, mid, hi in ((4, 2, 8), (1, 9, 8), (0, 1, 2)):
        with pytest.raises(WMError):
            build(static, tmp_path / "e4.plan", min_batch=lo, opt_batch=mid, max_batch=hi)
    with pytest.raises(WMError) as ei:
        build(tmp_path / "missing.onnx", tmp_path / "e4.plan")
    assert "missing.onnx" in one_line(ei.value) and not (tmp_path / "e4.plan").exists()


# =============================================================================================
# build: the legacy implicit INT8 path (10.x) and what 11.x removed


def test_implicit_int8_on_10_hands_tensorrt_the_cache_the_int8_export_wrote(use, qdq_onnx, tmp_path):
    use(10)
    cache = tmp_path / "forecaster.calib.cache"
    write_cache(cache, {"occ": 0.0079, "ego": 0.05}, trt_version_number("10.13.3"))
    before = cache.read_bytes()
    info = build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=cache, fp16_fallback=True)
    e = engine_json(tmp_path / "e.plan")
    assert e["network_flags"] == 0 and e["builder_flags"] == ["FP16", "INT8"]  # weakly typed
    assert e["calibration_cache"].encode() == before == cache.read_bytes()
    assert e["calibration_profile"] is True
    assert (info["implicit_int8"], info["strongly_typed"], info["calibration_cache_reads"]) == (True, False, 1)
    # the float path on 10.x, weakly typed without INT8
    build(qdq_onnx, tmp_path / "w.plan", strongly_typed=False, fp16_fallback=True)
    assert engine_json(tmp_path / "w.plan")["builder_flags"] == ["FP16"]


def test_implicit_int8_cache_problems_are_one_line(use, qdq_onnx, tmp_path):
    trt = use(10)
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True)
    assert "int8_cache" in one_line(ei.value)
    bad = tmp_path / "bad.cache"
    bad.write_bytes(b"occ: 3c010a14\n")
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=bad)
    assert str(bad) in one_line(ei.value) and "EntropyCalibration2" in str(ei.value)
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=tmp_path / "nope.cache")
    assert "nope.cache" in one_line(ei.value)
    # a cache TensorRT does not take: it asks the calibrator for data, gets none, and says so
    good = tmp_path / "good.cache"
    write_cache(good, {"occ": 0.01}, trt_version_number("10.13.3"))
    trt.reject_cache = True
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=good)
    assert "Calibration failure occurred with no scaling factors detected" in one_line(ei.value)
    assert not (tmp_path / "e.plan").exists()


def test_11_refuses_what_it_removed_in_one_line(use, qdq_onnx, tmp_path):
    use(11)
    cache = tmp_path / "calib.cache"
    write_cache(cache, {"occ": 0.01}, trt_version_number("11.1.0"))
    with pytest.raises(WMError) as ei:  # an AttributeError if BuilderFlag.INT8 etc. were touched
        build(qdq_onnx, tmp_path / "e.plan", implicit_int8=True, int8_cache=cache)
    s = one_line(ei.value)
    assert "removed in TensorRT 11.1.0.4" in s and str(cache) in s and "strongly typed" in s
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", strongly_typed=False)
    assert "strongly typed networks only" in one_line(ei.value)
    assert not (tmp_path / "e.plan").exists()


def test_fp16_flag_refused_with_strong_typing(trt, qdq_onnx, tmp_path):
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan", fp16_fallback=True)
    assert "fp16_fallback" in one_line(ei.value) and str(qdq_onnx) in str(ei.value)


def test_the_11_stand_in_lacks_what_11_removed():
    ten, eleven = fake_trt(10), fake_trt(11)
    assert ten.BuilderFlag.INT8 is not None and ten.NetworkDefinitionCreationFlag.EXPLICIT_BATCH == 0
    assert not hasattr(eleven, "IInt8EntropyCalibrator2") and not hasattr(eleven.BuilderFlag, "FP16")
    assert not hasattr(eleven.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH")
    assert not hasattr(eleven.Builder(eleven.ILogger()).create_builder_config(), "int8_calibrator")


# =============================================================================================
# build: failures


def test_parser_errors_are_one_line_naming_the_file(use, tmp_path):
    use(11)
    bad = make_model(tmp_path / "bad.onnx", [("x", TensorProto.FLOAT, [None, 3])],
                     [("y", TensorProto.FLOAT, [None, 3])], ops=("Identity", "NotARealOp"))
    with pytest.raises(WMError) as ei:
        build(bad, tmp_path / "e.plan")
    s = one_line(ei.value)
    assert str(bad) in s and "could not parse" in s
    assert "No importer registered for op: NotARealOp [notarealop_1 NotARealOp]" in s
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not an onnx model\xff" * 8)
    with pytest.raises(WMError) as ei:
        build(junk, tmp_path / "e.plan")
    assert str(junk) in one_line(ei.value) and "Failed to parse ONNX model" in str(ei.value)
    assert not (tmp_path / "e.plan").exists()


def test_failed_build_keeps_the_old_engine(trt, qdq_onnx, tmp_path):
    engine = tmp_path / "e.plan"
    engine.write_bytes(b"OLD ENGINE")
    trt.fail_build = "Error Code 2: OutOfMemory (Requested size was 9000000000 bytes.)\nmore"
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, engine)
    s = one_line(ei.value)
    assert str(qdq_onnx) in s and "OutOfMemory (Requested size was 9000000000 bytes.) more" in s
    assert engine.read_bytes() == b"OLD ENGINE"
    assert sorted(os.listdir(tmp_path)) == ["e.plan", "forecaster.int8.onnx"]


def test_engine_write_that_fails_keeps_the_old_engine(use, qdq_onnx, tmp_path, monkeypatch):
    use(10)
    engine = tmp_path / "sub" / "e.plan"
    engine.parent.mkdir()
    engine.write_bytes(b"OLD ENGINE")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, engine)
    assert str(engine) in one_line(ei.value) and "No space left on device" in str(ei.value)
    assert engine.read_bytes() == b"OLD ENGINE" and os.listdir(engine.parent) == ["e.plan"]


def test_build_without_cuda_is_one_line(use, qdq_onnx, tmp_path, monkeypatch):
    use(10)
    monkeypatch.setattr(T, "_cuda_device", lambda: None)
    with pytest.raises(WMError) as ei:
        build(qdq_onnx, tmp_path / "e.plan")
    assert "no CUDA device" in one_line(ei.value) and not (tmp_path / "e.plan").exists()


# =============================================================================================
# run


@pytest.fixture
def runner(trt, qdq_onnx, tmp_path):
    build(qdq_onnx, tmp_path / "e.plan")
    return R.TrtRunner(tmp_path / "e.plan")


def test_runner_binds_torch_tensors_and_maps_dtypes(trt, runner):
    r = runner
    assert sorted(r.inputs) == ["ego", "occ"]
    assert r.dtypes == {"occ": torch.float32, "ego": torch.float32, "logits": torch.float16,
                        "classes": torch.int64, "valid": torch.bool, "codes": torch.int32,
                        "q": torch.int8, "bf": torch.bfloat16, "u8": torch.uint8, "score": torch.float32}
    occ, ego64 = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 3, dtype=torch.float64)
    out = r(occ=occ, ego=ego64)
    (_, stream, seen), wait = trt.ran
    assert (stream, wait) == (STREAM, "wait")  # run on torch's stream, finished before returning
    assert seen == {"occ": occ.numpy().tobytes(), "ego": ego64.float().numpy().tobytes()}
    shapes = {"logits": (3, 3, 4, 4), "classes": (3, 4, 4), "valid": (3,), "codes": (3, 5),
              "q": (3, 6), "bf": (3, 2), "u8": (3, 3), "score": (3,)}
    assert {n: (tuple(t.shape), t.dtype) for n, t in out.items()} == {n: (s, r.dtypes[n])
                                                                      for n, s in shapes.items()}
    for name, t in out.items():  # the engine wrote into the tensors handed back
        raw = t.to(torch.uint8) if t.dtype == torch.bool else t.view(torch.uint8)
        assert bool((raw == 1).all()), name


def test_runner_refusals(trt, runner):
    with pytest.raises(WMError) as ei:
        runner(occ=torch.zeros(9, 2, 4, 4), ego=torch.zeros(9, 2, 3))  # batch 9 > max 8
    s = one_line(ei.value)
    assert "'occ'" in s and "outside the optimization profile" in s and "[9, 2, 4, 4]" in s
    with pytest.raises(WMError) as ei:
        runner(occ=torch.zeros(1, 2, 4, 4))
    assert "missing ['ego']" in one_line(ei.value)
    with pytest.raises(WMError) as ei:
        runner(occ=torch.zeros(1, 2, 4, 4), ego=torch.zeros(1, 2, 3), extra=torch.zeros(1))
    assert "unexpected ['extra']" in one_line(ei.value)
    trt.fail_execute = True
    with pytest.raises(WMError) as ei:
        runner(occ=torch.zeros(1, 2, 4, 4), ego=torch.zeros(1, 2, 3))
    assert "illegal memory access" in one_line(ei.value)


def test_runner_bad_engine_files(use, tmp_path):
    use(10)
    junk = tmp_path / "junk.plan"
    junk.write_bytes(b"\x01\x02 not an engine")
    with pytest.raises(WMError) as ei:
        R.TrtRunner(junk)
    assert str(junk) in one_line(ei.value) and "magicTagRead" in str(ei.value)
    with pytest.raises(WMError) as ei:
        R.TrtRunner(tmp_path / "none.plan")
    assert "none.plan" in one_line(ei.value)


def test_runner_time(trt, runner):
    ms = runner.time({"occ": torch.zeros(2, 2, 4, 4), "ego": torch.zeros(2, 2, 3)}, iters=7, warmup=2)
    assert isinstance(ms, float) and ms > 0
    assert [x if x == "wait" else x[0] for x in trt.ran] == ["execute"] * 2 + ["wait"] + ["execute"] * 7 + ["wait"]


def test_torch_dtype_without_equivalent():
    trt = fake_trt(11)
    assert R.torch_dtype(trt, trt.DataType.BF16) is torch.bfloat16
    with pytest.raises(WMError) as ei:
        R.torch_dtype(trt, trt.DataType.INT4)
    assert "INT4" in one_line(ei.value)


# =============================================================================================
# availability


def test_available_says_why_when_tensorrt_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import of a blocked module fails
    ok, why = T.available()
    assert not ok and why.startswith("TensorRT is not available here (import tensorrt failed:") and "\n" not in why


def test_available_with_the_real_import(monkeypatch):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    assert T.available() == (False, "TensorRT is not available here (import tensorrt failed: "
                                    "ModuleNotFoundError: No module named 'tensorrt')")


def test_available_with_fakes(use, monkeypatch):
    use(11)
    assert T.available() == (True, "TensorRT 11.1.0.4 on Fake GPU")
    monkeypatch.setattr(T, "_cuda_device", lambda: None)
    assert T.available() == (False, "TensorRT 11.1.0.4 imports, but torch sees no CUDA device")
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt(8))
    assert T.available() == (False, "TensorRT 8.0.0 is too old: this code is written for TensorRT 10.x and 11.x")


# =============================================================================================
# trtexec


def test_trtexec_command(tmp_path, qdq_onnx):
    shapes = T.onnx_profile_shapes(qdq_onnx, 1, 4, 8)
    assert shapes == {"occ": ((1, 2, 4, 4), (4, 2, 4, 4), (8, 2, 4, 4)), "ego": ((1, 2, 3), (4, 2, 3), (8, 2, 3))}
    cmd = T.trtexec_command("run/export/f.onnx", "run/export/f.plan", shapes, workspace_gib=4)
    assert cmd == ("trtexec --onnx=run/export/f.onnx --saveEngine=run/export/f.plan --stronglyTyped "
                   "--minShapes=occ:1x2x4x4,ego:1x2x3 --optShapes=occ:4x2x4x4,ego:4x2x3 "
                   "--maxShapes=occ:8x2x4x4,ego:8x2x3 --memPoolSize=workspace:4096")
    fp16 = T.trtexec_command("a b/f.onnx", "f.plan", {"x": ((1, 3), (2, 3), (4, 3))}, fp16=True)
    assert fp16 == ("trtexec '--onnx=a b/f.onnx' --saveEngine=f.plan --fp16 --minShapes=x:1x3 "
                    "--optShapes=x:2x3 --maxShapes=x:4x3")
    for bad in ({}, {"x": ((1, 3), (2, 3))}):
        with pytest.raises(WMError):
            T.trtexec_command("f.onnx", "f.plan", bad)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"nope")
    with pytest.raises(WMError) as ei:
        T.onnx_profile_shapes(junk, 1, 2, 3)
    assert str(junk) in one_line(ei.value)


# =============================================================================================
# export.py's TensorRT step


@pytest.fixture
def runnable_onnx(tmp_path):
    """A graph onnxruntime can run: classes (uint8) = occ, score (float) = x + x."""
    nodes = [helper.make_node("Identity", ["occ"], ["classes"]), helper.make_node("Add", ["x", "x"], ["score"])]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("occ", TensorProto.UINT8, ["batch", 3]),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
                          [helper.make_tensor_value_info("classes", TensorProto.UINT8, ["batch", 3]),
                           helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 2])])
    path = tmp_path / "forecaster.int8.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


FEED = {"occ": np.array([[1, 1, 2], [1, 3, 1]], np.uint8), "x": np.array([[0.5, 0.25], [1.0, -1.0]], np.float32)}


def test_deploy_without_tensorrt_prints_why_and_trtexec(monkeypatch, runnable_onnx):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    lines = []
    res = R.deploy({"forecaster": runnable_onnx}, {"forecaster": FEED}, max_batch=8, log=lines.append)
    engine = runnable_onnx.with_suffix(".engine")
    want = (f"trtexec --onnx={runnable_onnx} --saveEngine={engine} --stronglyTyped "
            "--minShapes=occ:1x3,x:1x2 --optShapes=occ:1x3,x:1x2 --maxShapes=occ:8x3,x:8x2")
    assert res["available"] is False
    assert res["graphs"]["forecaster"] == {"onnx": runnable_onnx.name, "trtexec": want}
    assert lines == [f"TensorRT engines not built: {res['why']}. On the target machine run:", f"  {want}"]
    assert not engine.exists()
    # a graph's own largest batch (world_step's, for its cache): its profile stops there
    res = R.deploy({"forecaster": runnable_onnx}, {"forecaster": FEED}, max_batch=8, log=lines.append,
                   max_batches={"forecaster": 3, "other": 1})
    assert res["graphs"]["forecaster"]["trtexec"].endswith("--maxShapes=occ:3x3,x:3x2")


def test_world_step_profile_batch_stops_where_its_cache_passes_8_gib():
    """occworld: one window's cache rows are F = 16,324,096 float32 at each of max_frames = 16 slots,
    read and returned: 2 * 16 * 16324096 * 4 B = 1.95 GiB, so 8 GiB holds 4 windows; the demo's
    279,040-wide rows (35.7 MB a window) leave --max-batch 64 as it is."""
    from wm.config.loading import load
    from wm.export.onnx import world_max_batch

    c = load(str(Path(__file__).resolve().parents[2] / "configs" / "occworld.json"), [])
    assert world_max_batch(c, 50, 50, 64) == 4 == int(8 * 2**30 // (2 * 16 * 16324096 * 4))
    assert world_max_batch(c, 50, 50, 2) == 2 and world_max_batch(c, 50, 50, 64, cache_gib=1.0) == 1
    demo = load(str(Path(__file__).resolve().parents[2] / "configs" / "demo.json"), [])
    assert world_max_batch(demo, 32, 32, 64) == 64


def test_deploy_builds_runs_compares_by_name_and_times(trt, runnable_onnx):
    lines = []
    res = R.deploy({"forecaster": runnable_onnx}, {"forecaster": FEED}, max_batch=8, opt_batch=2,
                   log=lines.append, timing_iters=3)
    g = res["graphs"]["forecaster"]
    engine = runnable_onnx.with_suffix(".engine")
    assert res["available"] and g["engine"] == "forecaster.int8.engine" and g["bytes"] == engine.stat().st_size
    assert engine_json(engine)["profiles"] == [{"occ": [[1, 3], [2, 3], [8, 3]], "x": [[1, 2], [2, 2], [8, 2]]}]
    # the engine writes 0x01 into every output byte: 4 of the 6 classes are 1 in onnxruntime
    one = float(torch.tensor([1], dtype=torch.uint8).repeat(4).view(torch.float32))
    assert g["vs_onnxruntime"] == {"classes": {"agreement": pytest.approx(4 / 6)},
                                   "score": {"max_abs_diff": pytest.approx(abs(one - (-2.0)))}}
    assert set(g["latency_ms"]) == {"batch1", "batch2"}
    assert lines[0] == f"TensorRT engines ({res['why']}):"
    assert "forecaster.int8.engine" in lines[1] and "classes 0.6667" in lines[1]
    # a graph's own largest batch under the feed's: the profile and the check stop there
    res = R.deploy({"forecaster": runnable_onnx}, {"forecaster": FEED}, max_batch=8, opt_batch=2,
                   log=lines.append, timing_iters=3, max_batches={"forecaster": 1})
    assert engine_json(engine)["profiles"] == [{"occ": [[1, 3], [1, 3], [1, 3]], "x": [[1, 2], [1, 2], [1, 2]]}]
    assert set(res["graphs"]["forecaster"]["latency_ms"]) == {"batch1"}


def test_export_cli_without_tensorrt_prints_the_trtexec_line_of_each_graph(tiny_export):
    """The tiny run: 16x16x4 grids, 4x4 codes, data.past 2, world.max_frames 16; export.py's
    --max-batch 64 and opt batch 1. world_step's axes: new frames 1 / 1 / max_frames (the steps
    after the first run one), frames so far and cache slots 1 / past + future - 1 (a whole
    forecast: 3) / max_frames; the cache rows F wide. The tokenizer's graphs, left float by
    --int8-float's default, build from their FP16 files."""
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    out = tiny_export.out
    F = onnx.load(str(out / "world_step.onnx"), load_external_data=False).graph.input[2].type.tensor_type.shape.dim[2].dim_value
    kind = {"tokenizer_encode": "fp16", "world_step": "int8", "tokenizer_decode": "fp16"}
    want = {g: f"trtexec --onnx={out}/{g}.{kind[g]}.onnx --saveEngine={out}/{g}.{kind[g]}.engine --stronglyTyped {shapes}"
            for g, shapes in (
                ("tokenizer_encode", "--minShapes=occ:1x16x16x4 --optShapes=occ:1x16x16x4 "
                                     "--maxShapes=occ:64x16x16x4"),
                ("world_step", f"--minShapes=codes:1x1x4x4,motion:1x1x3,kv:1x1x{F} "
                               f"--optShapes=codes:1x1x4x4,motion:1x3x3,kv:1x3x{F} "
                               f"--maxShapes=codes:64x16x4x4,motion:64x16x3,kv:64x16x{F}"),
                ("tokenizer_decode", "--minShapes=codes:1x4x4 --optShapes=codes:1x4x4 --maxShapes=codes:64x4x4"))}
    why = ("TensorRT is not available here (import tensorrt failed: ModuleNotFoundError: "
           "No module named 'tensorrt')")
    lines = tiny_export.p.stdout.splitlines()
    i = lines.index(f"TensorRT engines not built: {why}. On the target machine run:")
    assert lines[i + 1:i + 4] == [f"  {cmd}" for cmd in want.values()]
    rep = json.loads((out / "export.json").read_text())["tensorrt"]
    assert rep == {"available": False, "why": why,
                   "graphs": {g: {"onnx": f"{g}.{kind[g]}.onnx", "trtexec": cmd} for g, cmd in want.items()}}
