"""tools/bench_finetune.py on hand-made run folders: the curves it reads, the two targets' figures,
the config layering, the table and the plot. Nothing trains here."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import read_png  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_finetune", ROOT / "tools" / "bench_finetune.py")
B = importlib.util.module_from_spec(spec)
sys.modules["bench_finetune"] = B
spec.loader.exec_module(B)




def write_run(run: Path, vals: dict, before: dict = None, steps: dict = None, extra_lines=()):
    """A run folder: metrics.jsonl with <stage>/val records {stage: [(step, miou, iou)]} (the world
    ones with copy-last 20/40), <stage>/before records, train records between, done.json per stage."""
    run.mkdir(parents=True)
    lines = []
    for st, rows in vals.items():
        if before and st in before:
            m, i = before[st]
            lines.append({"kind": f"{st}/before", "step": 0, "time": 1.0, "val/miou": m, "val/iou": i,
                          **({"val/copy_last_miou": 20.0, "val/copy_last_iou": 40.0} if st == "world" else {})})
        for step, m, i in rows:
            lines.append({"kind": f"{st}/train", "step": step, "time": 2.0, "loss/loss": 1.0})
            rec = {"kind": f"{st}/val", "step": step, "time": 3.0, "val/miou": m, "val/iou": i}
            if st == "world":
                rec.update({"val/copy_last_miou": 20.0, "val/copy_last_iou": 40.0, "val/miou_t1": m + 5})
            lines.append(rec)
        (run / st).mkdir()
        (run / st / "done.json").write_text(json.dumps(
            {"step": (steps or {}).get(st, rows[-1][0]), "metrics": {}, "reason": "finished"}))
    (run / "metrics.jsonl").write_text("\n".join([json.dumps(x) for x in lines] + list(extra_lines)) + "\n")


@pytest.fixture
def arms(tmp_path):
    out = tmp_path / "bench"
    write_run(out / "scratch", {"tokenizer": [(25, 20.0, 40.0), (50, 25.0, 45.0), (75, 28.0, 47.0), (100, 30.0, 50.0)],
                                "world": [(50, 10.0, 30.0), (100, 14.0, 33.0)]})
    write_run(out / "finetune", {"tokenizer": [(25, 26.0, 46.0), (50, 29.0, 48.0), (75, 30.2, 49.0), (100, 33.0, 52.0)],
                                 "world": [(50, 12.0, 31.0), (100, 13.5, 32.0)]},
              before={"tokenizer": (15.0, 35.0), "world": (8.0, 25.0)})
    return out


def test_curves_read_val_before_and_done_and_keep_the_last_record_of_a_step(tmp_path):
    run = tmp_path / "r"
    write_run(run, {"tokenizer": [(40, 1.0, 2.0), (80, 3.0, 4.0)], "world": [(80, 5.0, 6.0)]},
              before={"world": (0.5, 0.7)}, steps={"tokenizer": 80, "world": 90},
              extra_lines=['{"kind": "tokenizer/val", "step": 40, "val/miou": 1.5, "val/iou": 2.5}',
                           '{"kind": "tokenizer/va'])  # a resumed step validated again; a cut line
    c = B.read_curves(run)
    assert c["tokenizer"]["val"] == [{"step": 40, "miou": 1.5, "iou": 2.5}, {"step": 80, "miou": 3.0, "iou": 4.0}]
    assert c["tokenizer"]["before"] is None and c["tokenizer"]["steps"] == 80
    assert c["world"]["val"] == [{"step": 80, "miou": 5.0, "iou": 6.0, "copy_last_miou": 20.0, "copy_last_iou": 40.0}]
    assert c["world"]["before"]["step"] == 0 and c["world"]["before"]["miou"] == 0.5
    assert c["world"]["steps"] == 90


def test_targets_against_hand_computed_figures(arms):
    curves = {a: B.read_curves(arms / a) for a in B.ARMS}
    t = B.targets(curves)
    tok_a, tok_b = t["tokenizer"]["ahead_every_validation"], t["tokenizer"]["steps_to_scratch_final"]
    assert tok_a["met"] and tok_a["steps"] == [25, 50, 75, 100] and tok_a["ahead"] == 4
    assert tok_a["margins"] == [6.0, 4.0, 2.2, 3.0] and tok_a["min_margin"] == pytest.approx(2.2)
    # scratch ends at 30.0 (step 100); the fine-tuned arm is at 30.2 at step 75: 75 %, missed
    assert tok_b["scratch_final"] == 30.0 and tok_b["s_ft"] == 75 and tok_b["fraction"] == 0.75
    assert not tok_b["met"]
    w_a, w_b = t["world"]["ahead_every_validation"], t["world"]["steps_to_scratch_final"]
    assert not w_a["met"] and w_a["ahead"] == 1 and w_a["of"] == 2 and w_a["min_margin"] == pytest.approx(-0.5)
    assert w_b["s_ft"] is None and not w_b["met"] and w_b["ft_best"] == 13.5 and w_b["ft_best_step"] == 100
    text = "\n".join(B.target_lines(t))
    assert "target (a) tokenizer: fine-tune ahead of scratch at every validation: met (4/4" in text
    assert "75 %" in text and "never reached" in text


def test_steps_to_reach_the_briefs_example_and_the_before_point():
    scratch = [{"step": 50, "miou": 20.0}, {"step": 100, "miou": 30.0}]
    ft = [{"step": 20, "miou": 25.0}, {"step": 40, "miou": 30.5}, {"step": 60, "miou": 31.0}]
    r = B.steps_to_reach(scratch, 100, ft, None)
    assert r["s_ft"] == 40 and r["fraction"] == 0.4 and r["met"] and r["ft_miou"] == 30.5
    # scratch's steps come from done.json, not its last validation
    assert B.steps_to_reach(scratch, 200, ft, None)["fraction"] == 0.2
    # the source model already there before a step: S_ft = 0
    r0 = B.steps_to_reach(scratch, 100, ft, {"step": 0, "miou": 31.0})
    assert r0["s_ft"] == 0 and r0["fraction"] == 0.0 and r0["met"]
    # exactly at 50 % is met, past it missed
    assert B.steps_to_reach(scratch, 100, [{"step": 50, "miou": 30.0}], None)["met"]
    assert not B.steps_to_reach(scratch, 100, [{"step": 60, "miou": 30.0}], None)["met"]
    # ahead needs the same steps: none in common is not met
    assert not B.ahead(scratch, [{"step": 40, "miou": 99.0}])["met"]


def test_layering_takes_the_models_from_the_base_and_the_rest_from_the_airside_preset(tmp_path):
    base = {"run": {"name": "road"}, "data": {"grid": [200, 200, 16], "num_classes": 18, "free_class": 17,
                                               "batch_size": 16},
            "synthetic": {"style": "occ3d", "train_scenes": 64},
            "tokenizer": {"widths": [64, 128, 256], "codebook_size": 512}, "world": {"widths": [128, 256, 512]},
            "kernels": {"lovasz_impl": "histogram"}, "loader": {"num_workers": 8},
            "tokenizer_stage": {"max_steps": 2000, "lr": 0.001}}
    preset = {"run": {"name": "airside_finetune"},
              "data": {"grid": [64, 64, 8], "num_classes": 17, "free_class": 16, "batch_size": 8},
              "synthetic": {"style": "airside", "train_scenes": 24},
              "tokenizer": {"codebook_size": 64}, "loader": {"num_workers": 2},
              "tokenizer_stage": {"lr": 0.002, "epochs": 3}, "world_stage": {"lr": 0.003},
              "init": {"from": "runs/demo", "class_map": {"apron": "driveable_surface"}}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "ft.json").write_text(json.dumps(preset))
    steps = {"tokenizer": 240, "world": 120}
    cfg, dropped = B.arm_config("finetune", B.read_json(tmp_path / "base.json"), B.read_json(tmp_path / "ft.json"),
                                tmp_path / "out", steps, {"tokenizer": 4, "world": 4}, "out/pretrain", "/cache")
    # the models and how they run: the base's, whole (the preset's codebook_size is dropped)
    assert cfg["tokenizer"] == {"widths": [64, 128, 256], "codebook_size": 512}
    assert cfg["world"] == {"widths": [128, 256, 512]} and cfg["kernels"] == {"lovasz_impl": "histogram"}
    assert cfg["loader"] == {"num_workers": 8} and cfg["data"]["grid"] == [200, 200, 16]
    assert set(dropped) == {"tokenizer.codebook_size", "loader.num_workers", "data.grid"}
    # a key the base gives the same value is not said to be dropped
    same, dropped = B.layer({"data": {"grid": [64, 64, 8]}, "loader": {"num_workers": 2}},
                            {"data": {"grid": [64, 64, 8]}, "loader": {"num_workers": 2}})
    assert dropped == [] and same == {"data": {"grid": [64, 64, 8]}, "loader": {"num_workers": 2}}
    # the data and the schedule: the airside preset's
    assert cfg["data"]["num_classes"] == 17 and cfg["data"]["free_class"] == 16 and cfg["data"]["batch_size"] == 8
    assert cfg["synthetic"]["style"] == "airside" and cfg["synthetic"]["train_scenes"] == 24
    assert cfg["tokenizer_stage"]["lr"] == 0.002 and cfg["tokenizer_stage"]["epochs"] == 3
    assert cfg["init"]["class_map"] == {"apron": "driveable_surface"}
    # the bench's own keys on top
    assert cfg["run"] == {"name": "finetune", "out_dir": str(tmp_path / "out")}
    assert cfg["init"]["from"] == "out/pretrain" and cfg["synthetic"]["cache_dir"] == "/cache"
    assert cfg["tokenizer_stage"]["max_steps"] == 240 and cfg["tokenizer_stage"]["eval_every"] == 60
    assert cfg["world_stage"] == {"lr": 0.003, "max_steps": 120, "eval_every": 30}
    # the scratch arm gets no init.from; a base without a section leaves the defaults (the demo's)
    sc, _ = B.arm_config("scratch", {"data": {"grid": [64, 64, 8]}}, {"data": {"num_classes": 17}},
                         tmp_path / "out", steps, {"tokenizer": 1, "world": 2}, None, None)
    assert "init" not in sc and "tokenizer" not in sc and sc["data"] == {"num_classes": 17, "grid": [64, 64, 8]}
    assert sc["tokenizer_stage"]["eval_every"] == -1  # one validation: at the end
    assert sc["world_stage"]["eval_every"] == 60
    assert B.eval_every(100, 3) == 33


def test_set_passthrough_is_typed_as_train_py_types_it():
    d = B.apply_sets({"data": {"grid": [64, 64, 8]}}, ["train.stages=world", "data.batch_size=4",
                                                     "synthetic.with_mask=off", "data.grid=32,32,4"])
    assert d["train"]["stages"] == ["world"] and d["data"]["batch_size"] == 4
    assert d["synthetic"]["with_mask"] is False and d["data"]["grid"] == [32, 32, 4]


def test_table_and_plot(arms, tmp_path):
    curves = {a: B.read_curves(arms / a) for a in B.ARMS}
    t = B.table(curves)
    assert t.splitlines()[0].startswith("| stage | step | scratch mIoU | fine-tune mIoU")
    assert "| tokenizer | 0 (before) | - | 15.00 |" in t and "| tokenizer | 75 | 28.00 | 30.20 | +2.20 |" in t
    assert "| world | 100 | 14.00 | 13.50 | -0.50 | 33.00 | 32.00 | 20.00 |" in t
    png = tmp_path / "plot.png"
    from wm.data.viz import write_png

    write_png(png, B.plot(curves, width=400, height=300))
    img = read_png(png)
    assert img.shape == (300 + 30, 800, 3)
    colours = {tuple(c) for c in img.reshape(-1, 3)}
    for arm in B.ARMS:
        assert B.COLOURS[arm] in colours
        # each arm's colour is in both panels
        for half in (img[:300, :400], img[:300, 400:]):
            assert (half == np.array(B.COLOURS[arm], np.uint8)).all(-1).any()
    # copy-last (20 mIoU) is drawn in the world panel only
    grey = (img == np.array(B.COPY_LAST, np.uint8)).all(-1)
    assert grey[:300, 400:].any() and not grey[:300, :400].any()


def test_report_only_writes_the_json_and_the_png(arms, tmp_path, capsys):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    assert B.main(["--out", str(arms), "--report-only", "--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("| world | 100 |")  # the table comes last
    rep = json.loads(js.read_text())
    assert rep["targets"]["tokenizer"]["ahead_every_validation"]["met"] is True
    assert rep["curves"]["finetune"]["world"]["before"]["miou"] == 8.0 and rep["copy_last_miou"] == 20.0
    assert {"cpu", "cpu_count", "torch"} <= set(rep["machine"])
    assert read_png(png).shape == (390, 1120, 3)


def test_nice_ticks():
    assert B.nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert B.nice_ticks(12.3, 31.7) == [10, 15, 20, 25, 30, 35]
    assert B.nice_ticks(0, 240)[-1] >= 240


def test_arguments_validations_per_stage_and_arms():
    a = B.parse_args([])
    assert a.evals == B.DEFAULT_EVALS and a.arms == ["scratch", "finetune"]
    assert B.parse_args(["--evals", "4"]).evals == {"tokenizer": 4, "world": 4}
    assert B.parse_args(["--evals", "4", "--evals-world", "2"]).evals == {"tokenizer": 4, "world": 2}
    assert B.parse_args(["--arms", "pretrain"]).arms == ["pretrain"]
    for bad in (["--arms", "scratch,bogus"], ["--arms", "pretrain", "--pretrained", "runs/demo"], ["--evals", "0"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)
