"""OccWorld's training step in tools/occworld_harness.py (where OCCWORLD_PATH names a checkout of
wzzheng/OccWorld: its code is not in this repository) and tools/bench_recipe.py's --occworld: its
one-line refusals before any run, and the table's note on where the OccWorld rates came from."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wm.utils.errors import WMError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_recipe as B  # noqa: E402
import occworld_harness as H  # noqa: E402

OCCWORLD = os.environ.get("OCCWORLD_PATH")
needs_checkout = pytest.mark.skipif(not OCCWORLD, reason="OCCWORLD_PATH names no OccWorld checkout")


@needs_checkout
@pytest.mark.parametrize("stage,per_step,unit", [("tokenizer", 10, "frames"), ("world", 1, "windows")])
def test_its_training_step_small_trains_and_its_rate_is_the_timed_steps(stage, per_step, unit, one_thread):
    r = H.train_rate(OCCWORLD, stage, "cpu", steps=2, warmup=1, small=True)
    assert r["size"] == "small (harness check)" and r["batch_size"] == 1 and r["unit"] == unit
    assert r["per_step"] == per_step and r["frames_per_sample"] == (10 if stage == "tokenizer" else 16)
    assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"]) and r["losses_finite"]
    # the rate is the per-step units over the timed steps' mean wall time
    assert len(r["step_ms_each"]) == 2
    assert r["ms_per_step"] == pytest.approx(sum(r["step_ms_each"]) / 2, abs=1e-2)
    assert r["samples_per_s"] == pytest.approx(per_step * 1e3 / r["ms_per_step"], rel=1e-9)
    if stage == "world":
        assert r["window_frames"] == 16 and r["frozen"] == ["vae"] and 0 < r["params_trained"] < r["params"]
    else:
        assert r["frozen"] == [] and r["params_trained"] == r["params"]
    assert r["optimizer"] == {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01} and r["grad_max_norm"] == 35
    assert r["peak_mem_gib"] is None  # CPU


@needs_checkout
@pytest.mark.parametrize("stage", ["tokenizer", "world"])
def test_a_step_moves_the_trained_parameters_and_not_the_frozen_ones(stage, one_thread):
    info = H.load_train(OCCWORLD, stage)
    step = H.TrainStep(info, "cpu", small_size=True)
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    assert math.isfinite(step())
    params = dict(step.model.named_parameters())
    frozen = [n for n in params if n.split(".")[0] in step.frozen]
    trained = [n for n, p in params.items() if p.requires_grad]
    assert set(frozen).isdisjoint(trained) and len(frozen) + len(trained) == len(params)
    assert all(not params[n].requires_grad and params[n].grad is None for n in frozen)
    assert all(params[n].equal(before[n]) for n in frozen)
    moved = [n for n in trained if not params[n].equal(before[n])]
    # AdamW moves every parameter its loss reached (the few it does not reach keep no grad)
    assert moved and moved == [n for n in trained if params[n].grad is not None]
    if stage == "world":
        assert frozen and all(n.startswith("vae.") for n in frozen) and any(n.startswith("transformer.") for n in moved)
    else:
        assert not frozen and len(moved) == len(trained)


def test_a_missing_checkout_is_one_line_before_anything_runs(tmp_path):
    out = tmp_path / "recipe"
    p = subprocess.run([sys.executable, "tools/bench_recipe.py", "--occworld", "/nonexistent", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "--occworld /nonexistent: not a checkout of wzzheng/OccWorld" in p.stderr
    assert not out.exists()  # no run folder, no train.py


def test_measured_and_typed_in_rates_are_refused_together(tmp_path):
    with pytest.raises(WMError, match="give one") as e:
        B.main(["--occworld", "/nonexistent", "--occworld-rates", "50,5", "--out", str(tmp_path / "o")])
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


def test_the_table_says_the_occworld_rates_were_measured_in_this_run():
    rep = {"measured": {"tokenizer": {"samples_per_s": 400.0}, "world": {"samples_per_s": 100.0}},
           "recipe": {"tokenizer": {"total_h": 5.0, "train_h": 4.9, "val_h": 0.1, "compile_h": 0.0,
                                    "occworld_code_h": 28.8},
                      "world": {"total_h": 2.0, "train_h": 1.9, "val_h": 0.1, "compile_h": 0.0,
                                "occworld_code_h": 38.9},
                      "total_h": 7.0, "occworld_code_total_h": 67.7},
           "occworld_rates": {"tokenizer": 67.5, "world": 5.0},
           "occworld_code": {"device": "cuda", "steps": 30, "warmup": 5, "wm_window_frames": 11, "root": "/x/OccWorld",
                             "commit": "1ee7f77" + "0" * 33,
                             "tokenizer": {"samples_per_s": 67.5, "frames_per_sample": 10},
                             "world": {"samples_per_s": 5.0, "window_frames": 16}}}
    t = B.table(rep)
    assert "| OccWorld's code h |" in t and "| 28.8 |" in t and "(OccWorld's code 67.7 h)" in t
    note = t.splitlines()[-1]
    assert note.startswith("OccWorld's code h: its own training step measured in this run on cuda")
    assert "1ee7f7700000" in note and "tokenizer 67.50 frames/s (10-frame samples)" in note
    assert "world 5.00 windows/s (its 16-frame windows; wm's preset trains on 11-frame windows)" in note
    typed = {k: v for k, v in rep.items() if k != "occworld_code"}
    assert B.table(typed).splitlines()[-1].startswith("OccWorld's code h: rates typed in (--occworld-rates)")
