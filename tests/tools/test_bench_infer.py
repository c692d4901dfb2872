"""tools/bench_infer.py on the CPU at a tiny size (table, JSON, phases that lie within each forecast),
its one-line refusals, and the shims of tools/occworld_harness.py (OccWorld's code itself is not in
this repository: the harness test runs where OCCWORLD_PATH names a checkout)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wm.utils.errors import WMError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_infer as B  # noqa: E402
import occworld_harness as H  # noqa: E402

TINY = ["data.grid=16,16,4", "data.past=2", "data.future=2", "tokenizer.widths=8,8,8", "tokenizer.codebook_size=16",
        "tokenizer.code_dim=8", "world.widths=8,16", "world.heads=2"]


def test_cpu_rows_table_json_and_phases_within_each_forecast(trained_tiny, tiny_export, tmp_path):
    """A trained tiny run (2 past + 2 future frames): PyTorch fp32 and bf16 on the CPU and the three
    onnxruntime rows over export.py's files; every forecast's phases lie within its wall time."""
    assert tiny_export.p.returncode == 0, tiny_export.p.stderr[-2000:]
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "tools/bench_infer.py", "--run", str(trained_tiny.run_dir()), "--export",
                        str(tiny_export.out), "--device", "cpu", "--modes", "fp32,bf16,ort-fp32,ort-fp16,ort-int8",
                        "--batches", "1,2", "--ort-batches", "1", "--iters", "3", "--warmup", "1", "--ort-iters", "2",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "batch-1 ms" in line)
    assert lines[head].split()[:5] == ["mode", "batch-1", "ms", "p90", "best/s"]
    assert "inputs  encode      s1      s2  decode outputs" in lines[head]
    modes = ["fp32", "bf16", "ort-fp32", "ort-fp16", "ort-int8"]
    for mode in modes:
        cells = next(line for line in lines[head:] if line.split()[0] == mode).split()
        assert all(float(c) >= 0 for c in cells[1:4] + cells[5:11]), cells
    assert "CPU" in p.stdout and "2 past -> 2 future frames" in p.stdout and f"wrote {out}" in p.stdout

    rep = json.loads(out.read_text())
    assert rep["forecast"]["grid"] == [16, 16, 4] and rep["forecast"]["weights"].startswith("run ")
    assert rep["machine"]["cpu_cores_usable"] >= 1 and rep["onnx"]["folder"] == str(tiny_export.out)
    assert [r["mode"] for r in rep["rows"]] == modes
    phases = ["inputs", "encode", "step_1", "step_2", "decode", "outputs"]
    for r in rep["rows"]:
        batches = ["1"] if r["mode"].startswith("ort") else ["1", "2"]
        assert r["status"] == "ok" and list(r["batches"]) == batches
        assert list(r["phases_ms"]) == phases
        for b, v in r["batches"].items():
            assert len(v["total_ms"]) == len(v["phases_ms"]) == (2 if r["mode"].startswith("ort") else 3)
            for total, ph in zip(v["total_ms"], v["phases_ms"]):
                assert list(ph) == phases
                # the phases run one after another inside the forecast's wall time (rounded to 1e-4 ms)
                assert all(v >= 0 for v in ph.values()) and sum(ph.values()) <= total + 1e-3, (r["mode"], b, total, ph)
            assert v["forecasts_per_s"] == pytest.approx(int(b) * 1e3 / v["median_ms"], rel=1e-3)
        best = max(r["batches"], key=lambda b: r["batches"][b]["forecasts_per_s"])
        assert r["best_throughput"] == {"forecasts_per_s": r["batches"][best]["forecasts_per_s"], "batch": int(best)}
        assert r["latency_ms"] == {"median": r["batches"]["1"]["median_ms"], "p90": r["batches"]["1"]["p90_ms"]}


def test_a_row_whose_files_are_missing_is_skipped_with_the_reason(trained_tiny, tiny_export, tmp_path, capsys):
    folder = tmp_path / "export"
    folder.mkdir()
    for f in tiny_export.out.glob("*.onnx"):
        if ".int8" not in f.name:
            (folder / f.name).symlink_to(f)
    assert B.main(["--run", str(trained_tiny.run_dir()), "--export", str(folder), "--device", "cpu", "--modes",
                   "ort-int8", "--ort-batches", "1", "--ort-iters", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["ort-int8"])
    assert row.split()[1] == "skipped:" and "tokenizer_encode.int8-ort.onnx not in" in row and "export.py --int8" in row


@pytest.mark.parametrize("argv,msg", [
    (["--modes", "fp32,fp8"], "'fp8' is not one of"),
    (["--modes", "occworld-fp32", "--device", "cpu"], "give its checkout with --occworld PATH"),
    (["--modes", "occworld-fp32", "--device", "cpu", "--occworld", "/nonexistent"], "not a checkout of wzzheng/OccWorld"),
    (["--run", "runs/x", "--set", "data.past=2"], "with --run the run's own config is used"),
    (["--batches", "1,x"], "batch sizes separated by commas"),
    (["--modes", "ort-fp32", "--export", "/nonexistent", "--set", "data.grid=16,16,4"], "--export /nonexistent does not exist"),
])
def test_bad_arguments_are_one_line(argv, msg):
    with pytest.raises(WMError, match=msg) as e:
        B.main(argv + [a for s in TINY for a in ("--set", s)] if "--run" not in argv else argv)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("shape,pattern,sizes,ref", [
    ((6, 4, 5), "(b f) h w -> b f h w", {"b": 2}, lambda t: t.reshape(2, 3, 4, 5)),
    ((6, 4, 5, 2), "(b f) c h w -> b f c h w", {"b": 2}, lambda t: t.reshape(2, 3, 4, 5, 2)),
    ((3, 4, 5, 6), "bf h w c-> bf c h w", {}, lambda t: t.permute(0, 3, 1, 2)),
    ((2, 3, 4, 5, 6), "b f h w c -> (b h w) f c", {}, lambda t: t.permute(0, 2, 3, 1, 4).reshape(40, 3, 6)),
    ((6, 4, 5), "(b h w) f c -> (b f) c h w", {"b": 2, "h": 3, "w": 1},
     lambda t: t.reshape(2, 3, 1, 4, 5).permute(0, 3, 4, 1, 2).reshape(8, 5, 3, 1)),
    ((6, 4, 5, 2), "(b f) c h w -> (b h w) f c", {"b": 2, "f": 3},
     lambda t: t.reshape(2, 3, 4, 5, 2).permute(0, 3, 4, 1, 2).reshape(20, 3, 4)),
    ((2, 3, 7), "b f c -> (b f) 1 c", {}, lambda t: t.reshape(6, 1, 7)),
    ((6, 1, 7), "(b f) 1 c -> b f c", {"b": 2, "f": 3}, lambda t: t.reshape(2, 3, 7)),
    ((6, 7), "n d -> d n", {}, lambda t: t.t()),
])
def test_rearrange_shim_moves_axes_like_einops(shape, pattern, sizes, ref):
    """The patterns OccWorld's model uses, against the same moves written with reshape and permute."""
    t = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    assert torch.equal(H.rearrange(t, pattern, **sizes), ref(t))


def test_registry_and_base_module_shims():
    reg = H.Registry("model")

    @reg.register_module()
    class Outer(H.BaseModule):
        def __init__(self, inner, width=3, init_cfg=None):
            super().__init__(init_cfg)
            self.inner = reg.build(inner)
            self.lin = torch.nn.Linear(width, width)

    @reg.register_module()
    class Inner(H.BaseModule):
        def __init__(self, n):
            super().__init__()
            self.n = n

    m = reg.build({"type": "Outer", "inner": {"type": "Inner", "n": 4}, "width": 5})
    w = m.lin.weight.clone()
    m.init_weights()
    assert m.inner.n == 4 and m.lin.in_features == 5 and torch.equal(m.lin.weight, w)
    with pytest.raises(WMError, match="model type 'Nope'"):
        reg.build({"type": "Nope"})


@pytest.mark.skipif(not os.environ.get("OCCWORLD_PATH"), reason="OCCWORLD_PATH names no OccWorld checkout")
def test_occworld_harness_builds_and_runs_its_eval_forward_small():
    info = H.load(os.environ["OCCWORLD_PATH"])
    assert info["frames"] == (0, 5, 11)
    cfg = H.small(info["model"])
    model = H.build(cfg, "cpu")
    x, metas = H.inputs(cfg, info["frames"], 1, torch.device("cpu"))
    names = []
    out = H.forecast(model, x, metas, info["frames"], names.append)
    assert names == ["encode"] + ["step"] * 6 + ["decode", "outputs"]
    assert tuple(out["sem_pred"].shape) == (1, 6, *H.grid(cfg))


def test_a_failing_batch_ends_the_sweep_and_keeps_the_smaller_ones():
    def make(b):
        if b > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

        def run(mark):
            mark("encode")
            mark("step")
            mark("decode")
        return run

    row = B.sweep("fp32", make, [1, 2, 4, 8], B.Clock(False), 2, 0, lambda *a: None)
    assert list(row["batches"]) == ["1", "2", "4"] and row["batches"]["4"] == {"error": "out of memory"}
    assert list(row["phases_ms"]) == ["encode", "step_1", "decode"] and row["best_throughput"]["batch"] in (1, 2)
    # a row whose first batch fails is a failed row, with the reason; the run goes on
    failed = B.guarded("bf16-compile", "pytorch", lambda: B.sweep("bf16-compile", lambda b: 1 / 0, [1], B.Clock(False),
                                                                  1, 0, print), lambda *a: None)
    assert failed["status"] == "failed: ZeroDivisionError: division by zero" and "Traceback" in failed["traceback"]
