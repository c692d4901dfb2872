"""ONNX export of a trained run (export.py, wm/export/onnx.py): parity with PyTorch and bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from wm.checkpoint.trained import TrainedRunError, load_trained

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(trained_tiny):
    return trained_tiny


def export(*args):
    return subprocess.run([sys.executable, "export.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def export_here(*args):
    """export.py's refusals in this process (helpers.cli_in_process): the same main and one-line
    error, without the seconds of a process start; test_bad_input_... keeps a real process call."""
    from helpers import cli_in_process

    return cli_in_process("export.py", *args)


@pytest.fixture(scope="module")
def cli(tiny_export):
    return tiny_export


def test_export_matches_pytorch_at_batch_1_and_2(trained, cli):
    p, tmp_path = cli.p, cli.out
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((tmp_path / "export.json").read_text())
    assert set(rep["graphs"]) == {"tokenizer_encode", "world_step", "tokenizer_decode"}
    for name, g in rep["graphs"].items():
        for b in ("batch1", "batch2"):  # dynamic batch: the same graph runs both
            assert g["vs_pytorch"][b]["class_agreement"] == 1.0, (name, b, g)
        onnx.checker.check_model(str(tmp_path / g["file"]), full_check=True)
        assert (tmp_path / g["fp16"]["file"]).is_file() and g["fp16"]["vs_pytorch"]["batch2"]["class_agreement"] > 0.9
    assert rep["graphs"]["tokenizer_decode"]["vs_pytorch"]["batch2"]["max_abs_diff"] < 1e-3
    # the step graph's interface: the new frames' codes, every frame's motion, the key/value cache;
    # the batch and the three frame counts dynamic, the cache row as wide as the model's layers need
    m = onnx.load(str(tmp_path / "world_step.onnx"), load_external_data=False)
    ins = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    outs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in m.graph.output}
    F = load_trained(trained.run_dir()).world.kv_width(4, 4)
    assert ins == {"codes": ["batch", "new", 4, 4], "motion": ["batch", "frames", 3], "kv": ["batch", "slots", F]}
    assert outs["next_codes"][1:] == [4, 4] and outs["next_motion"][1:] == [3]
    assert outs["new_kv"][0] == "batch" and outs["new_kv"][2] == F
    assert rep["graphs"]["world_step"]["inputs"]["kv"] == ["float32", ["batch", "slots", F]]
    assert set(rep["seconds"]) >= {"export_fp32_fp16", "total"} and rep["memory"]["host_peak_gib"] > 0
    phases = rep["memory"]["phase_peak_gib"]
    assert set(phases) >= {f"{k}_{g}" for k in ("export", "fp16") for g in ("tokenizer_encode", "world_step",
                                                                           "tokenizer_decode")}
    assert rep["memory"]["host_peak_gib"] >= max(phases.values()) > 0
    assert not list(tmp_path.glob(".*tmp*"))
    # --int8-float's default: the tokenizer (encoder and decoder) stays float, the world step is INT8
    q = rep["int8"]
    assert q["calibration"]["kept_float"] == r"tok\."
    assert q["calibration"]["activation_products"] == "float"  # without --int8-attention
    for g in ("tokenizer_encode", "tokenizer_decode"):
        assert q["graphs"][g]["nodes_quantized"] == 0 and q["graphs"][g]["nodes_float"], g
    assert q["graphs"]["world_step"]["nodes_quantized"] > 0
    # so the tokenizer's TensorRT engines are built from its FP16 files, the world step's from its INT8 file
    out = p.stdout
    for g in ("tokenizer_encode", "tokenizer_decode"):
        assert f"--onnx={tmp_path / (g + '.fp16.onnx')}" in out, out[-2000:]
    assert f"--onnx={tmp_path / 'world_step.int8.onnx'}" in out


def test_host_loop_over_the_graphs_is_the_rollout(trained, cli):
    """wm.export.deployed.forecast over the modules is WorldModel.rollout exactly; over the ONNX
    files that export.py wrote (onnxruntime) the same forecast, for every frame count the step graph sees."""
    import torch

    from wm.export.deployed import OrtGraphs, TorchGraphs, forecast
    from wm.export.onnx import graphs

    t = load_trained(trained.run_dir())
    cfg = t.cfg
    g = torch.Generator().manual_seed(3)
    P, S = cfg.data.past, cfg.data.future
    occ = torch.randint(0, cfg.data.num_classes, (3, P, *cfg.data.grid), generator=g).to(torch.uint8)
    motion = torch.randn(3, P + S, 3, generator=g)
    with torch.no_grad():
        codes, _ = t.world.rollout(t.tokenizer.encode(occ), motion[:, :P], S, future_motion=motion[:, P:])
        ref = t.tokenizer.decode(codes).argmax(2).to(torch.uint8)
        mods = graphs(t)
        assert torch.equal(forecast(TorchGraphs(mods), cfg, occ, motion[:, :P], motion[:, P:]), ref)
        got = forecast(OrtGraphs({k: cli.out / f"{k}.onnx" for k in mods}), cfg, occ, motion[:, :P], motion[:, P:])
    assert float((got == ref).float().mean()) > 0.999


def test_default_run_is_the_newest_world_run(trained, tmp_path):
    from wm.checkpoint.trained import find_run

    assert find_run(trained.run_dir().parent) == trained.run_dir()
    with pytest.raises(TrainedRunError, match="no world-model run under"):
        find_run(tmp_path)


def one_line_error(p):
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and "Traceback" not in p.stderr, p.stderr
    return lines[-1]


def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path):
    run = trained.run_dir()
    assert "does not exist" in one_line_error(export("--run", str(tmp_path / "nope")))  # a real process
    # a run with the tokenizer stage only
    tok_only = tmp_path / "tok_only"
    shutil.copytree(run, tok_only)
    shutil.rmtree(tok_only / "world")
    assert "only the tokenizer stage" in one_line_error(export_here("--run", str(tok_only), "--out",
                                                                    str(tmp_path / "o1")))
    # a truncated checkpoint
    ck = tmp_path / "cut.pt"
    data = (run / "world" / "checkpoints" / "best.pt").read_bytes()
    ck.write_bytes(data[: len(data) // 2])
    msg = one_line_error(export_here("--run", str(run), "--ckpt", str(ck), "--out", str(tmp_path / "o2")))
    assert "cut.pt" in msg
    # a tokenizer-stage checkpoint given as --ckpt
    tck = next((run / "tokenizer" / "checkpoints").glob("step_*.pt"))
    assert "tokenizer-stage checkpoint" in one_line_error(export_here("--run", str(run), "--ckpt", str(tck)))
    # an output folder that cannot be written (a file is in the way)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "cannot write the export folder" in one_line_error(export_here("--run", str(run), "--out",
                                                                          str(blocker / "sub")))
    # a host memory budget of nothing
    assert "--host-memory-gib must be > 0" in one_line_error(export_here("--run", str(run), "--host-memory-gib", "0",
                                                                         "--out", str(tmp_path / "o3")))
    for d in ("o1", "o2", "o3"):
        assert not (tmp_path / d).exists() or not list((tmp_path / d).glob("*.onnx"))


def test_checkpoint_whose_config_does_not_fit_its_weights(trained, tmp_path):
    import torch

    from wm.checkpoint.files import load

    st = load(trained.run_dir() / "world" / "checkpoints" / "best.pt")
    st["config"]["world"]["widths"] = [16, 32]
    bad = tmp_path / "mismatch.pt"
    torch.save(st, bad)
    with pytest.raises(TrainedRunError, match="do not fit the model its config describes"):
        load_trained(trained.run_dir(), bad)


def test_cli_int8_writes_qdq_graphs_caches_and_report(cli):
    p, tmp_path = cli.p, cli.out
    assert p.returncode == 0, p.stderr[-3000:]
    # more eval windows than the val split has: all of them, said in one line
    assert "note: --eval-windows 100 but split 'val' has 9 windows" in p.stdout
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["accuracy"]["windows"] == 9 and rep["accuracy"]["engine"] == "onnxruntime"
    assert "onnx_int8" in rep["accuracy"]["models"] and "copy_last" in rep["accuracy"]["models"]
    for name in ("tokenizer_encode", "world_step", "tokenizer_decode"):
        assert (tmp_path / f"{name}.int8.onnx").is_file()
        assert (tmp_path / f"{name}.calib.cache").read_text().startswith("TRT-100300-EntropyCalibration2\n")
    ex = json.loads((tmp_path / "export.json").read_text())
    assert "int8" in ex and {"int8_histograms", "int8_thresholds", "int8_qdq", "int8_report"} <= set(ex["seconds"])
    assert "calibration pass 2/2 (histograms): 8/8 windows" in p.stdout and "ETA" in p.stdout


def test_world_checkpoint_on_another_tokenizer_is_refused(trained, tmp_path):
    """The tokenizer on disk is not the one the world stage trained on (retrained or replaced): one
    line, nothing exported."""
    import torch

    run = trained.run_dir()
    st = torch.load(run / "world" / "checkpoints" / "best.pt", weights_only=True)
    st["tokenizer"]["sha256"] = "0" * 64  # trained on a tokenizer that is no longer there
    ck = tmp_path / "other.pt"
    torch.save(st, ck)
    msg = one_line_error(export_here("--run", str(run), "--ckpt", str(ck), "--out", str(tmp_path / "o")))
    assert "tokenizer hash mismatch" in msg
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.onnx"))


def test_fold_weight_transposes_keeps_the_function(tmp_path):
    """Transpose(initializer) -> MatMul becomes a transposed initializer; same outputs in onnxruntime;
    an initializer still read elsewhere stays."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from wm.export.onnx import fold_weight_transposes, session

    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    v = rng.standard_normal((3, 2)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], name="t0", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Wt"], ["y"], name="m0"),
             helper.make_node("Transpose", ["V"], ["Vt"], name="t1", perm=[1, 0]),
             helper.make_node("MatMul", ["y", "V"], ["z"], name="m1"),
             helper.make_node("Add", ["Vt", "Vt"], ["u"], name="a0")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 2]),
                           helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 3])],
                          initializer=[numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(m, str(a))
    assert fold_weight_transposes(m) == 2
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(b))
    assert [n.op_type for n in m.graph.node] == ["MatMul", "MatMul", "Add"]
    ini = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    assert set(ini) == {"Wt", "V", "Vt"}  # W was read only by its Transpose; V also by m1
    np.testing.assert_array_equal(ini["Wt"], w.T)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    for p, q in zip(session(a).run(None, {"x": x}), session(b).run(None, {"x": x})):
        np.testing.assert_array_equal(p, q)


def test_damaged_best_checkpoint_is_named_and_skipped(trained, tmp_path, capsys):
    """Export checks the checksum of what it loads (load_trained, export.py's loader): a best.pt with
    bytes flipped (same size) is named and the newest valid step checkpoint is loaded instead. (In
    process: the whole export of that checkpoint is what the other tests run.)"""
    run = tmp_path / "run"
    shutil.copytree(trained.run_dir(), run)
    best = run / "world" / "checkpoints" / "best.pt"
    data = bytearray(best.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = bytes(8)
    best.write_bytes(bytes(data))
    t = load_trained(run)
    assert f"warning: skipped {best}" in capsys.readouterr().out
    assert t.ckpt.name.startswith("step_") and t.ckpt.parent == best.parent


def test_fp16_copy_repairs_the_duplicate_casts_of_older_onnxruntime(tmp_path):
    """onnxruntime < 1.31's float16 converter writes one Cast per use of a float16 tensor that two
    kept-float ops read, all to the same name (seen as a non-SSA tokenizer_decode with 1.30), and
    leaves float16 value_info on initializers that stayed float32. That graph, built by hand, is
    refused by the checker; dedupe_nodes makes it valid and runnable with the same outputs. A
    second writer that computes something else is not dropped."""
    import numpy as np
    import onnx
    import pytest
    from onnx import TensorProto, helper

    from wm.export.onnx import dedupe_nodes, fp16_model, session

    def model(second_cast_to=TensorProto.FLOAT):
        nodes = [helper.make_node("Cast", ["x"], ["h"], name="c0", to=TensorProto.FLOAT16),
                 helper.make_node("Cast", ["h"], ["h_cast_to_fp32"], name="h_cast_to_fp32_node", to=TensorProto.FLOAT),
                 helper.make_node("Softmax", ["h_cast_to_fp32"], ["s"], name="s0", axis=-1),
                 helper.make_node("Cast", ["h"], ["h_cast_to_fp32"], name="h_cast_to_fp32_node",
                                  to=second_cast_to),
                 helper.make_node("ReduceMax", ["h_cast_to_fp32"], ["r"], name="r0", keepdims=1),
                 helper.make_node("Add", ["s", "r"], ["y"], name="a0")]
        vi = [helper.make_tensor_value_info("h_cast_to_fp32", TensorProto.FLOAT, ["b", 4])] * 2
        vi.append(helper.make_tensor_value_info("w", TensorProto.FLOAT16, [1]))  # stale: w stayed float32
        nodes.append(helper.make_node("Mul", ["y0", "w"], ["y"], name="m0"))
        nodes[-2].output[0] = "y0"
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], value_info=vi,
                              initializer=[helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    m = model()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(m, full_check=True)
    assert dedupe_nodes(m) == 1
    onnx.checker.check_model(m, full_check=True)
    assert [n.name for n in m.graph.node].count("h_cast_to_fp32_node") == 1
    assert [v.name for v in m.graph.value_info] == ["h_cast_to_fp32"]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    onnx.save(m, str(tmp_path / "m.onnx"))
    h = x.astype(np.float16).astype(np.float32)
    e = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(session(tmp_path / "m.onnx").run(None, {"x": x})[0],
                               e / e.sum(-1, keepdims=True) + h.max(), rtol=1e-6)  # ReduceMax: all axes
    other = model(second_cast_to=TensorProto.DOUBLE)
    assert dedupe_nodes(other) == 0  # not the same computation: left for the checker to refuse

    # and the converter path end to end: a float16 copy that the checker accepts and that runs
    g = helper.make_graph([helper.make_node("Softmax", ["x"], ["s"], axis=-1),
                           helper.make_node("ReduceMax", ["x"], ["r"], keepdims=1),
                           helper.make_node("Add", ["s", "r"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])])
    f = fp16_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.checker.check_model(f, full_check=True)
    onnx.save(f, str(tmp_path / "f.onnx"))
    assert session(tmp_path / "f.onnx").run(None, {"x": x})[0].dtype == np.float32


def test_phase_peaks_name_the_phase_that_used_the_memory():
    """A phase that held 1 GiB and a later one that held little: each gets its own peak (Linux:
    VmHWM reset between phases), the overall peak is the larger."""
    import numpy as np

    from wm.export.memory import PhasePeaks

    p = PhasePeaks()
    big = np.ones(2**27)  # 1 GiB, touched
    del big
    p.mark("big")
    small = np.ones(2**20)
    del small
    p.mark("small")
    d = p.as_dict()
    assert d["phase_peak_gib"]["big"] >= 1.0 and d["host_peak_gib"] == d["phase_peak_gib"]["big"]
    if d["method"].startswith("VmHWM"):
        assert d["phase_peak_gib"]["small"] < d["phase_peak_gib"]["big"] - 0.5


def test_memory_gate_runs_side_by_side_only_what_fits_the_budget():
    """Jobs that each hold 256 MiB: the first runs alone and is measured; then as many run at once as
    fit beside the process in the budget (the gate's floor of room / one job, hand-checked), never
    more, and at least one where even one does not fit. Its resets of the high-water mark keep the
    phase's peak for PhasePeaks."""
    import threading
    import time

    import numpy as np

    from wm.export.memory import MemoryGate, PhasePeaks, _rss_gib

    if _rss_gib() is None:
        pytest.skip("no /proc/self/status here: the gate lets every job run, unmeasured")
    lock, now, most_seen, order = threading.Lock(), [0], [0], []

    def job(i):
        with lock:
            now[0] += 1
            most_seen[0] = max(most_seen[0], now[0])
            order.append((i, now[0]))
        a = np.ones(2**25)  # 256 MiB, touched
        time.sleep(0.2)
        del a
        with lock:
            now[0] -= 1
        return i

    peaks, start = PhasePeaks(), _rss_gib()
    for room_jobs, want in ((100, 4), (2.5, 2), (0.2, 1)):
        base = _rss_gib()
        gate = MemoryGate(4, base + room_jobs * 0.25)
        seen = []
        threads = [threading.Thread(target=lambda i=i: seen.append(gate.run(job, i))) for i in range(8)]
        now[0], most_seen[0] = 0, 0
        order.clear()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(seen) == list(range(8))
        assert 0.24 <= gate.job_gib < 0.35, gate.job_gib
        assert gate.allowed == max(1, min(4, int((gate.budget_gib - gate.base_gib) // gate.job_gib)))
        assert gate.allowed == want, (room_jobs, gate.job_gib, gate.base_gib, gate.allowed)
        assert order[0][1] == 1 and most_seen[0] <= gate.allowed  # the first alone, then never more than allowed
    if peaks.per_phase:  # four jobs at once (the first round), before the later rounds' resets
        assert peaks.mark("gated") >= start + 4 * 0.25 - 0.02
    # a job that takes nothing new: all of them where the process leaves room, one where it does not
    for budget, want in ((_rss_gib() + 1, 4), (0.01, 1)):
        gate = MemoryGate(4, budget)
        assert gate.run(lambda: 7) == 7 and gate.job_gib < 0.01 and gate.allowed == want, (budget, gate.job_gib)


@pytest.mark.slow
def test_sigterm_during_int8_ends_with_one_line_saying_what_was_finished(trained, tmp_path):
    """SIGTERM to the process group (a scheduler's stop) during INT8 calibration: one line naming the
    graphs finished and that a rerun starts over, the status of a SIGTERM, no partial file."""
    import os
    import signal

    from helpers import Proc

    out = tmp_path / "o"
    p = Proc([sys.executable, "export.py", "--run", str(trained.run_dir()), "--out", str(out), "--int8",
              "--calib-windows", "8", "--eval-windows", "4", "--no-trt"])
    try:
        assert p.wait_for(r"^calibration: ", 300), p.output
        os.killpg(p.pid, signal.SIGTERM)
        rc = p.finish(120)
    finally:
        p.kill_group()
    lines = p.output.strip().splitlines()
    assert rc == 128 + signal.SIGTERM and "Traceback" not in p.output, p.output[-3000:]
    assert lines[-1].startswith("stopped: export got SIGTERM during INT8 calibration"), lines[-1]
    assert ("finished: tokenizer_encode.onnx, world_step.onnx, tokenizer_decode.onnx" in lines[-1]
            and "a rerun starts over" in lines[-1]), lines[-1]
    assert sorted(f.name for f in out.iterdir()) == ["tokenizer_decode.onnx", "tokenizer_encode.onnx", "world_step.onnx"]
