"""tools/bench_recipe.py: the phases read from a run's stamped lines, the recipe's hours from them
(hand-computed), and one tiny run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_recipe as B  # noqa: E402

LOG = [
    (0.5, "generating synthetic occ3d scenes (700+150 scenes x 40 frames, grid 200x200x16) into /c (once)"),
    (200.0, "training: 1 rank on cuda (NVIDIA H200), bf16 (train.amp=auto)"),
    (440.0, "tokenizer: first step 236.6 s (torch.compile compiling)"),
    (450.0, "tokenizer step 10/438 loss 9.1 lr 1.00e-03 300.0 samples/s data wait 0% ETA 1m0s"),
    (460.0, "tokenizer step 20/438 loss 8.1 lr 1.00e-03 440.0 samples/s data wait 0% ETA 1m0s"),
    (470.0, "tokenizer step 30/438 loss 7.1 lr 1.00e-03 450.0 samples/s data wait 0% ETA 1m0s"),
    (480.0, "tokenizer step 40/438 loss 6.1 lr 1.00e-03 460.0 samples/s data wait 0% ETA 1m0s"),
    (490.0, "  tokenizer validation: 3000/6000 windows, 290.00 windows/s, ETA 0m10s"),
    (500.0, "  tokenizer validation: 6000/6000 windows, 300.00 windows/s, ETA 0m00s"),
    (550.0, "token cache: 34000/34000 frames encoded (500 frames/s)"),
    (700.0, "world: first step 139.4 s (torch.compile, from the run's compile cache)"),
    (710.0, "world step 10/438 loss 3.0 lr 1.00e-03 50.0 samples/s data wait 0% ETA 1m0s"),
    (720.0, "world step 20/438 loss 2.0 lr 1.00e-03 100.0 samples/s data wait 0% ETA 1m0s"),
    (730.0, "  world validation: 600/600 windows, 20.00 windows/s, ETA 0m00s"),
]


def test_phases_are_read_from_the_stamped_lines():
    p = B.phases(LOG)
    assert p["generation_s"] == 199.5 and p["wall_s"] == 730.0
    tok, world = p["tokenizer"], p["world"]
    assert tok["first_step_s"] == 236.6 and tok["cached"] is False
    assert tok["samples_per_s"] == 450.0 and tok["steps"] == 40  # the median after the first line
    assert (tok["val_windows"], tok["val_windows_per_s"], tok["val_s"]) == (6000, 300.0, 20.0)
    assert world["cached"] is True and world["samples_per_s"] == 100.0 and world["val_s"] == 30.0
    assert (p["token_cache_frames"], p["token_cache_s"]) == (34000, 68.0)


def test_the_recipe_hours_are_its_steps_at_the_measured_rates():
    from wm.config.loading import load

    cfg = load(str(ROOT / "configs" / "occworld.json"))
    measured = {"tokenizer": {"samples_per_s": 400.0, "val_s": 36.0, "first_step_s": 360.0},
                "world": {"samples_per_s": 100.0, "val_s": 18.0, "first_step_s": 180.0}}
    r = B.recipe_time(cfg, measured, {"tokenizer": 50.0, "world": 5.0})
    tok, world = r["tokenizer"], r["world"]
    # 87,500 steps x 80 frames at 400/s; 10 validations of 36 s; a 6-minute compile
    assert tok["samples"] == 7_000_000 and tok["train_h"] == round(7_000_000 / 400 / 3600, 2)
    assert tok["validations"] == 10 and tok["val_h"] == 0.1 and tok["compile_h"] == 0.1
    # 87,500 steps x 8 windows at 100/s; 20 validations of 18 s
    assert world["samples"] == 700_000 and world["train_h"] == round(700_000 / 100 / 3600, 2)
    assert world["validations"] == 20 and world["val_h"] == 0.1
    assert r["total_h"] == round(tok["total_h"] + world["total_h"], 2)
    assert tok["occworld_code_h"] == round(7_000_000 / 50 / 3600, 1) and world["occworld_code_h"] == round(700_000 / 5 / 3600, 1)


@pytest.mark.slow
def test_a_tiny_run_end_to_end(tiny, tmp_path):
    from helpers import TINY_SETTINGS

    sets = [f"{k}={v}" for k, v in {**TINY_SETTINGS, "data.root": str(tiny.data), "train.stages": "tokenizer,world",
                                     "logging.every": "1"}.items()]
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "tools/bench_recipe.py", "--cfg", "configs/demo.json", "--steps", "3",
                        "--out", str(out), "--json", str(tmp_path / "r.json"), *[x for s in sets for x in ("--set", s)]],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["compile"] is False  # the demo's schedule is shorter than compile.min_steps
    for stage in ("tokenizer", "world"):
        m = rep["measured"][stage]
        assert m["steps"] == 3 and m["samples_per_s"] > 0 and m["val_windows"] > 0
    assert rep["measured"]["token_cache_frames"] == 24  # every frame of the tiny training split
    assert "| tokenizer |" in p.stdout and "recipe total" in p.stdout
    assert (out / "train.log").is_file() and "resume" not in rep  # no --preempt-after: one process


def test_a_stage_only_the_resume_reached_has_no_resume_figure():
    # the first run was preempted in the tokenizer: the world stage's first step in the resume is its compile
    run = B.phases(LOG[:5])
    resume = B.phases([(0.0, "tokenizer: first step 35.4 s (torch.compile, from the run's compile cache)"),
                       (5.0, "tokenizer step 50/438 loss 6.1 lr 1.00e-03 460.0 samples/s data wait 0% ETA 1m0s"),
                       *LOG[10:]])
    m = B.merged({"run": run, "resume": resume})
    assert m["tokenizer"]["first_step_s"] == 236.6 and m["tokenizer"]["resume_first_step_s"] == 35.4
    assert m["world"]["first_step_s"] == 139.4 and "resume_first_step_s" not in m["world"]
