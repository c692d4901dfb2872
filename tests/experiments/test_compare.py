"""tools/compare.py, the regression gate: a run against itself is `same`, a run trained for fewer
steps is `worse`, the per-scene counts add up to --eval-only's, the scene bootstrap by hand, and
every refusal in one line.

The tiny data set has one val scene, too few for an interval over scenes; the comparisons score on
a second tiny data set of the same grid and classes with six val scenes (`--data`). On it the
2 + 2-step run (trained_tiny) forecasts about 9 points of IoU below a 30 + 30-step run of the same
config, far outside the tolerance: that pair is the deliberately worse candidate."""

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from wm.utils.errors import WMError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import compare as cli  # noqa: E402


@pytest.fixture(scope="module")
def runs(trained_tiny, tiny_factory, one_thread):
    """short: trained_tiny (2 + 2 steps); long: the same config for 30 + 30 steps; multi: a data set
    like theirs with six val scenes of 9 windows each."""
    import wm.training.main as T
    from wm.data.synthetic.generate import write_synthetic

    t = tiny_factory()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert T.main(t.args(name="long", train__stages="tokenizer,world", tokenizer_stage__max_steps=30,
                             world_stage__max_steps=30)) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    multi = t.base / "multi"
    write_synthetic(multi, train_scenes=1, val_scenes=6, frames=12, grid=(16, 16, 4), seed=7)
    return SimpleNamespace(short=trained_tiny.run_dir(), long=t.run_dir(name="long"), multi=multi, t=t,
                           tiny=trained_tiny)


def gate(runs, tmp_path, baseline, candidate, *flags):
    """compare's main in this process: (exit status, JSON report)."""
    out = tmp_path / "cmp.json"
    rc = cli.main(["--baseline", str(baseline), "--candidate", str(candidate), "--data", str(runs.multi),
                   "--amp", "fp32", "--json", str(out), *flags])
    return rc, json.loads(out.read_text())


def test_a_run_against_itself_is_same_and_every_output_is_written(runs, tmp_path, monkeypatch, capsys):
    step_summary = tmp_path / "step_summary.md"
    step_summary.write_text("earlier job step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    md = tmp_path / "cmp.md"
    rc, rep = gate(runs, tmp_path, runs.short, runs.short, "--markdown", str(md), "--tolerance", "0")
    assert rc == 0 and rep["passed"] and rep["failed"] == []
    assert torch.is_grad_enabled()  # the caller's grad mode is left as it was (tests train after it)
    assert rep["data"]["windows"] == 54 and rep["data"]["scenes"] == 6
    for name, m in rep["metrics"].items():  # identical forecasts: 0 in every resample
        assert (m["delta"], m["lo"], m["hi"], m["se"], m["verdict"]) == (0.0, 0.0, 0.0, 0.0, "same"), name
    assert set(rep["metrics"]) == {"iou_avg", "miou_avg", "iou_t1", "miou_t1", "iou_t2", "miou_t2"}
    table = md.read_text()
    assert table.startswith("### wm compare: PASS") and "| IoU avg * |" in table and "| same |" in table
    assert step_summary.read_text() == "earlier job step\n" + table + "\n"  # appended, not replaced
    out = capsys.readouterr().out
    assert "result: PASS" in out
    # its summary.json was validated on the tiny set's one val scene: said, and both scored here
    assert any("summary.json is for data" in n and "scoring both on data" in n for n in rep["notes"])


def test_a_run_trained_for_fewer_steps_is_worse(runs, tmp_path):
    rc, rep = gate(runs, tmp_path, runs.long, runs.short)
    assert rc == 1 and not rep["passed"] and rep["failed"] == ["iou_avg", "miou_avg"]
    for name in ("iou_avg", "miou_avg"):
        m = rep["metrics"][name]
        assert m["verdict"] == "worse" and m["hi"] < -rep["tolerance"] and m["lo"] <= m["delta"] <= m["hi"]
        assert m["delta"] == pytest.approx(m["candidate"] - m["baseline"])
    assert rep["baseline"]["step"] == 30 and rep["candidate"]["step"] == 2
    # the other way round it is better, and the gate passes
    rc, rep = gate(runs, tmp_path, runs.short, runs.long, "--metrics", "iou_avg,miou_t2")
    assert rc == 0 and rep["metrics"]["iou_avg"]["verdict"] == "better" and rep["gated"] == ["iou_avg", "miou_t2"]


def test_one_scene_gives_no_interval_and_strict_fails_on_it(runs, tmp_path):
    """The tiny set's own val split: one scene, so no interval; its summary.json is for these very
    windows (the run's validation) and agrees with the fresh score."""
    out = tmp_path / "one.json"
    args = ["--baseline", str(runs.short), "--candidate", str(runs.short), "--amp", "fp32", "--json", str(out)]
    assert cli.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["data"]["scenes"] == 1 and rep["inconclusive"] == ["iou_avg", "miou_avg"]
    assert all(m["lo"] is None and m["verdict"] == "inconclusive" for m in rep["metrics"].values())
    assert any(n.startswith("1 scene: no interval") for n in rep["notes"])
    mine = [n for n in rep["notes"] if n.startswith("baseline's summary.json is for these windows")]
    assert mine and "(not its validation's" not in mine[0]
    assert cli.main(args + ["--strict"]) == 1
    assert json.loads(out.read_text())["failed"] == ["iou_avg", "miou_avg"]


def test_summed_scene_counts_are_eval_only_s_counts(runs, tmp_path):
    """The same windows scored by train.py --eval-only and by compare: the same confusion matrices
    (batches of 3: a scene's 9 windows are 3 of them, so both see the very same batches)."""
    import wm.training.main as T

    ev = tmp_path / "eval.json"
    args = runs.tiny.args(train__stages="tokenizer,world", data__root=str(runs.multi), world_stage__batch_size=3)
    assert T.main(args + ["--eval-only", "--stage", "world", "--json", str(ev)]) == 0
    ev = json.loads(ev.read_text())["world"]
    _, rep = gate(runs, tmp_path, runs.long, runs.short, "--batch", "3", "--mode", "occworld")
    assert rep["confusion"]["candidate"] == ev["forecast"]["confusion"]
    assert rep["confusion"]["copy_last"] == ev["copy_last"]["confusion"]
    assert rep["metrics"]["iou_avg"]["candidate"] == ev["forecast"]["iou_all_steps_avg"]
    assert rep["metrics"]["miou_t2"]["candidate"] == ev["forecast"]["miou_all_steps"][1]


def test_an_export_folder_is_scored_by_its_onnx_graphs(runs, tiny_export, tmp_path):
    """The FP32 graphs in onnxruntime forecast what the run's PyTorch modules do: the same; its
    INT8 files are scored too (--export-files), whatever they lose."""
    assert tiny_export.p.returncode == 0, tiny_export.p.stderr[-2000:]
    rc, rep = gate(runs, tmp_path, runs.short, tiny_export.out)
    assert rc == 0 and rep["candidate"]["kind"] == "export" and "onnxruntime" in rep["candidate"]["engine"]
    assert all(m["verdict"] == "same" for m in rep["metrics"].values())
    rc, rep = gate(runs, tmp_path, runs.short, tiny_export.out, "--export-files", "onnx_int8_ort", "--windows", "18")
    assert "onnx_int8_ort" in rep["candidate"]["engine"] and rep["data"]["windows"] == 18


def test_the_scene_bootstrap_by_hand():
    from wm.experiments.compare import verdict
    from wm.evaluation.metrics import binary_iou, miou, paired_bootstrap, resample_weights, resampled_ious

    # two classes (free 0), one step; scene g: 10 occupied voxels, the model finds 10 - g of them
    G = 4
    cnt = torch.zeros(G, 1, 2, 2, dtype=torch.int64)
    cnt[:, 0, 1, 1] = 10 - torch.arange(G)
    cnt[:, 0, 1, 0] = torch.arange(G)
    # every scene once: the totals' IoU, exactly
    iou, mi = resampled_ious(cnt, torch.ones(1, G, dtype=torch.float64), free=0)
    assert torch.equal(iou[0], binary_iou(cnt.sum(0), 0)) and torch.equal(mi[0], miou(cnt.sum(0), 0))
    # scene 0 twice and scene 3 twice: tp 2 * 10 + 2 * 7 of 40 voxels
    iou, _ = resampled_ious(cnt, torch.tensor([[2.0, 0, 0, 2]], dtype=torch.float64), free=0)
    assert iou[0, 0].item() == pytest.approx(100 * 34 / 40)
    w = resample_weights(G, 50, seed=3)
    assert torch.equal(w.sum(1), torch.full((50,), float(G), dtype=torch.float64))  # G draws each
    assert torch.equal(w, resample_weights(G, 50, seed=3))  # seeded
    assert paired_bootstrap(cnt[:1], cnt[:1], free=0) is None  # one scene: no spread to draw
    same = paired_bootstrap(cnt, cnt, free=0, resamples=200)
    assert all(bool((v == 0).all()) for v in same.values())

    # windows of a scene move together (they share frames): 5 windows per scene, each the same;
    # resampling the 20 windows as if independent understates the spread that scenes show
    per_window = cnt.repeat_interleave(5, 0)
    ref = per_window.clone()
    ref[:, 0, 1, 1], ref[:, 0, 1, 0] = 10, 0
    by_window = paired_bootstrap(ref, per_window, free=0, resamples=4000)["iou"].std()
    scenes = lambda x: x.view(G, 5, 1, 2, 2).sum(1)  # noqa: E731
    by_scene = paired_bootstrap(scenes(ref), scenes(per_window), free=0, resamples=4000)["iou"].std()
    assert by_scene > 1.8 * by_window  # sqrt(5) in expectation

    t = 0.5
    assert [verdict(lo, hi, t) for lo, hi in ((-3, -1), (1, 3), (-0.4, 0.5), (-1, 0.2), (0, 0), (None, None))] == \
        ["worse", "better", "same", "inconclusive", "same", "inconclusive"]


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def test_refusals_are_one_line(runs, tmp_path):
    base = ["--data", str(runs.multi), "--amp", "fp32"]
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(tmp_path / "nope"), "--candidate", str(runs.short)])
    assert "--baseline" in one_line(e) and "does not exist" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(runs.short), "--candidate", str(tmp_path / "empty"), *base])
    assert "is neither a wm run folder" in one_line(e)
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(runs.short), "--candidate", str(runs.short), "--metrics", "iou_t9", *base])
    assert "iou_t9" in one_line(e) and "miou_t2" in str(e.value)
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(runs.short)])
    assert "--candidate" in one_line(e)
    tok = sorted((runs.short / "tokenizer" / "checkpoints").glob("step_*.pt"))[-1]
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(tok), "--candidate", str(runs.short), *base])
    assert "tokenizer checkpoint" in one_line(e)
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "export.json").write_text(json.dumps({"checkpoint": str(tmp_path / "gone.pt")}))
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(runs.short), "--candidate", str(tmp_path / "export"), *base])
    assert "gone.pt, which is missing" in one_line(e)
    # another grid: its data set refused, naming the key
    from wm.data.synthetic.generate import write_synthetic

    write_synthetic(tmp_path / "tall", train_scenes=1, val_scenes=2, frames=6, grid=(16, 16, 8))
    with pytest.raises(WMError) as e:
        cli.main(["--baseline", str(runs.short), "--candidate", str(runs.short), "--data", str(tmp_path / "tall")])
    assert "grid" in one_line(e) and "data.grid" in str(e.value)


def test_models_of_another_window_are_refused(runs):
    import dataclasses

    from wm.experiments.compare import check_same, load_model

    a = load_model(runs.short, "baseline", torch.device("cpu"), None)
    b = load_model(runs.long, "candidate", torch.device("cpu"), None)
    check_same(a, b)
    b.cfg = dataclasses.replace(b.cfg, data=dataclasses.replace(b.cfg.data, future=3))
    with pytest.raises(WMError) as e:
        check_same(a, b)
    assert "data.future=2" in one_line(e) and "data.future=3" in str(e.value)


def test_the_cli_exits_2_with_one_line(runs, tmp_path):
    p = subprocess.run([sys.executable, "tools/compare.py", "--baseline", str(tmp_path / "missing"),
                        "--candidate", str(runs.short)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: --baseline")
