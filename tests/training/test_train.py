"""Training (wm/training/loop.py, wm/checkpoint/run_folder.py, wm/training/stages.py, train.py): exact resume after SIGTERM, kill -9 at random moments, failed
saves, non-finite steps, refusals (new data, changed config, grid/class mismatch), TensorBoard and
metrics.jsonl, summary.json. Everything runs on a tiny synthetic data set and tiny models (see
conftest.py: `tiny`)."""

import dataclasses
import errno
import json
import math
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import wm.checkpoint.files as ck
from wm.checkpoint.files import latest_checkpoint, load
from wm.checkpoint.run_folder import Run
from wm.config.sections import Config
from wm.data.shards import OCC3D_CLASSES
from wm.data.stats import NUSCENES_MOVING
from wm.data.windows import CodeWindows
from wm.evaluation.final_report import final_table
import wm.training.loop as L
from wm.training.loop import Preemption
import wm.training.main as T
from wm.training.stages import TokenizerStage, WorldStage
import wm.training.wrappers as W
import wm.utils.distributed as D
from wm.utils.errors import DataError, WMError, run_cli

from helpers import assert_same  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")





# ---------------------------------------------------------------------------------------------
# helpers





def ckpt_dir(run_dir: Path, stage: str = "tokenizer") -> Path:
    return run_dir / stage / "checkpoints"


def final_state(run_dir: Path, stage: str = "tokenizer") -> dict:
    path = latest_checkpoint(ckpt_dir(run_dir, stage))
    assert path is not None, f"no checkpoint in {ckpt_dir(run_dir, stage)}"
    return load(path)


def assert_same_training_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")
    assert_same(a["scaler"], b["scaler"], "scaler")
    assert_same(a["sampler"], b["sampler"], "sampler")
    assert_same(a["rng"], b["rng"], "rng")


def straight(tiny, **kw) -> None:
    """An uninterrupted reference run: train.py's main in this process (one intra-op thread, as the
    subprocesses), sparing the process start; with DataLoader workers, a train.py process."""
    if int(kw.get("loader__num_workers", 0)):
        p = tiny.spawn(**kw)
        assert p.finish(240) == 0, p.output
    else:
        assert T.main(tiny.args(**kw)) == 0


def straight_then_interrupted(tiny, stage, n, k, **over):
    """N steps straight in one folder; k steps, SIGTERM, and the same command again in another.
    Returns (straight final state, resumed final state, stopped step)."""
    key = f"{stage}_stage__max_steps"
    straight(tiny, out="straight", **{key: n}, **over)
    ref = final_state(tiny.run_dir("straight"), stage)
    assert ref["step"] == n

    p = tiny.spawn(out="cut", **{key: n}, **over)
    assert p.wait_for(rf"^{stage} step {k}/{n} ", 120), p.output
    p.p.send_signal(signal.SIGTERM)
    rc = p.finish(120)
    assert rc == 0, f"exit code {rc} after SIGTERM:\n{p.output}"
    m = re.search(rf"{stage}: preempted \(SIGTERM/SIGINT\); saved step (\d+)", p.output)
    assert m, p.output
    stopped = int(m.group(1))
    assert k < stopped < n, f"stopped at {stopped}, wanted a step in ({k}, {n}):\n{p.output}"
    cdir = ckpt_dir(tiny.run_dir("cut"), stage)
    assert (cdir / ck.checkpoint_name(stopped)).is_file()
    assert load(latest_checkpoint(cdir))["step"] == stopped
    assert not (tiny.run_dir("cut") / stage / "done.json").exists()

    p = tiny.spawn(out="cut", **{key: n}, **over)
    assert p.finish(240) == 0, p.output
    assert "resumed from" in p.output and f"at step {stopped}/{n}" in p.output, p.output
    got = final_state(tiny.run_dir("cut"), stage)
    return ref, got, stopped


# ---------------------------------------------------------------------------------------------
# 1. exact resume after SIGTERM


@pytest.mark.slow
def test_sigterm_resume_is_bitwise_exact_mid_epoch(tiny):
    # 24 frames, batch 2: 12 steps per epoch; the stop lands mid-epoch, the resumed run crosses
    # an epoch boundary (new permutation, validation, best checkpoint) and dead-code resets
    ref, got, stopped = straight_then_interrupted(tiny, "tokenizer", n=16, k=2)
    assert stopped % 12 != 0
    ckpt_state = load(ckpt_dir(tiny.run_dir("cut")) / ck.checkpoint_name(stopped))
    assert ckpt_state["sampler"]["consumed"] != 0, "the stop was meant to land mid-epoch"
    assert_same_training_state(ref, got)


@pytest.mark.slow
def test_sigterm_resume_is_bitwise_exact_with_two_workers(tiny):
    ref, got, stopped = straight_then_interrupted(tiny, "tokenizer", n=16, k=2, loader__num_workers=2)
    assert_same_training_state(ref, got)


@pytest.mark.slow
def test_sigterm_resume_is_bitwise_exact_world_stage(tiny, capsys):
    # the tokenizer stage first, once; both world runs build on the very same tokenizer folder
    straight(tiny, out="runs", tokenizer_stage__max_steps=3, world_stage__max_steps=12)
    shutil.copytree(tiny.run_dir(), tiny.base / "tok_only")
    both = dict(train__stages="tokenizer,world", tokenizer_stage__max_steps=3, world_stage__max_steps=12)

    capsys.readouterr()
    straight(tiny, **both)
    assert "tokenizer stage already finished" in capsys.readouterr().out
    ref = final_state(tiny.run_dir(), "world")
    assert ref["step"] == 12
    assert ref["tokenizer"]["sha256"] == ck.sha256_file(Path(ref["tokenizer"]["path"]))

    shutil.rmtree(tiny.run_dir())
    shutil.copytree(tiny.base / "tok_only", tiny.run_dir())
    p = tiny.spawn(**both)
    assert p.wait_for(r"^world step 2/12 ", 120), p.output
    p.p.send_signal(signal.SIGTERM)
    assert p.finish(120) == 0, p.output
    m = re.search(r"world: preempted \(SIGTERM/SIGINT\); saved step (\d+)", p.output)
    assert m, p.output
    stopped = int(m.group(1))
    assert 2 < stopped < 12
    assert (ckpt_dir(tiny.run_dir(), "world") / ck.checkpoint_name(stopped)).is_file()

    p = tiny.spawn(**both)
    assert p.finish(240) == 0, p.output
    assert f"at step {stopped}/12" in p.output, p.output
    got = final_state(tiny.run_dir(), "world")
    assert_same_training_state(ref, got)
    assert got["tokenizer"] == ref["tokenizer"]


def test_a_signal_only_sets_the_stop_flag_and_a_third_one_interrupts():
    import os

    stop = Preemption()
    stop.install()  # the restore_signals fixture puts the old handlers back
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested and stop.signals == 1
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signals == 2
    with pytest.raises(KeyboardInterrupt):  # a user pressing Ctrl-C again and again wants out now
        os.kill(os.getpid(), signal.SIGINT)
    assert not Preemption().requested  # a fresh flag per run: nothing carries over


# ---------------------------------------------------------------------------------------------
# 2. kill -9 at random moments


# train.py with slow checkpoint writes: each step file's first write waits 0.1 s with the temp file
# open, so that most kills land in the middle of a save
SLOW_SAVES = """
import sys, time
import wm.checkpoint.files as c
write = c._HashingWriter.write
def slow(self, b):
    if self.size == 0 and ".step_" in str(getattr(self.f, "name", "")):
        time.sleep(0.1)
    return write(self, b)
c._HashingWriter.write = slow
from wm.utils.errors import run_cli
from wm.training.main import main
run_cli(main)
"""


@pytest.mark.slow
def test_kill9_at_random_moments_leaves_loadable_checkpoint_and_same_result(tiny):
    from helpers import Proc

    n = 24
    over = dict(tokenizer_stage__max_steps=n, checkpoint__every=1, checkpoint__keep_last=2)
    straight(tiny, out="straight", **over)
    ref = final_state(tiny.run_dir("straight"))

    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    cdir = ckpt_dir(tiny.run_dir("killed"))
    cmd = [sys.executable, "-c", SLOW_SAVES, *tiny.args(out="killed", **over)]
    kills, temps_seen, finished, newest = [], 0, False, None
    for attempt in range(5):
        p = Proc(cmd)
        # kill after the 1st-3rd step line of this attempt: at once (that step's save is starting)
        # or a random moment later (training and the background write of the previous step)
        target = rnd.randint(1, 3)
        seen = 0
        while seen < target and p.wait_for(r"^tokenizer step \d+/", 120):
            seen += 1
        if seen < target:  # it ran to the end first
            assert p.finish(60) == 0, p.output
            finished = True
            break
        if newest is not None:  # it resumed from the newest complete checkpoint
            assert f"resumed from {newest} at step" in p.output, p.output
        delay = rnd.choice([0.0, rnd.uniform(0.0, 0.3)])
        time.sleep(delay)
        p.p.send_signal(signal.SIGKILL)
        rc = p.finish(60)
        if rc == 0:  # it finished before the kill landed
            finished = True
            break
        assert rc == -signal.SIGKILL, p.output
        temps = [f.name for f in cdir.iterdir() if ".tmp-" in f.name]
        temps_seen += bool(temps)
        before, newest = newest, latest_checkpoint(cdir)
        if newest is None:  # killed before the first save completed
            assert before is None
            kills.append((attempt, target, round(delay, 3), None, temps))
            continue
        ckpt_state = load(newest)  # the newest complete checkpoint loads (weights_only=True)
        assert ckpt_state["step"] == int(newest.stem.split("_")[1])
        assert set(ckpt_state) >= {"model", "optimizer", "sampler", "rng", "step"}
        if before is not None:  # a kill never loses the checkpoint a run resumed from
            assert ckpt_state["step"] >= int(before.stem.split("_")[1])
        kills.append((attempt, target, round(delay, 3), ckpt_state["step"], temps))
    print(f"kill -9 seed {seed}: (attempt, after line, delay, newest step, temp files) {kills}")
    assert len(kills) >= 3, f"fewer than 3 kills landed (seed {seed}): {kills}"
    assert temps_seen >= 1, f"no kill landed during a checkpoint write (seed {seed}): {kills}"
    if not finished:
        p = Proc(cmd)
        assert p.finish(240) == 0, p.output
    got = final_state(tiny.run_dir("killed"))
    assert_same_training_state(ref, got)
    # rotation: keep_last=2 step files, plus best.pt kept apart; the killed writers' temp files gone
    assert len(list(cdir.glob("step_*.pt"))) == 2
    assert (cdir / "best.pt").is_file()
    assert not [f for f in cdir.iterdir() if ".tmp-" in f.name]


# ---------------------------------------------------------------------------------------------
# 3. a failed save


def test_failed_save_is_one_clear_error_and_keeps_earlier_checkpoints(tiny, monkeypatch, capsys):
    real_write = ck._HashingWriter.write

    class FullDisk:
        """The file of the step-3 checkpoint: the disk fills up after its first 512 bytes."""

        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, k):
            return getattr(self.f, k)

    def write(self, b):
        if "step_000000003" in str(getattr(self.f, "name", "")) and self.size > 512:
            self.f = FullDisk(self.f)
        return real_write(self, b)

    monkeypatch.setattr(ck._HashingWriter, "write", write)
    args = tiny.args(tokenizer_stage__max_steps=6, checkpoint__every=1, checkpoint__keep_last=5)
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: T.main(args))
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    msg = lines[0]
    assert "step_000000003.pt" in msg and "No space left" in msg, msg
    assert err.rstrip().endswith(msg)  # the last thing said, no traceback after it
    assert "Traceback" not in err
    cdir = ckpt_dir(tiny.run_dir())
    names = sorted(f.name for f in cdir.iterdir())
    assert "step_000000003.pt" not in names and not [n for n in names if ".tmp-" in n], names
    assert not [n for n in names if n.startswith("step_") and int(n[5:14]) > 3], names
    for s in (1, 2):
        assert load(cdir / ck.checkpoint_name(s))["step"] == s
    assert load(latest_checkpoint(cdir))["step"] == 2
    assert not (tiny.run_dir() / "tokenizer" / "done.json").exists()

    # and the same command, with the disk back, resumes from step 2 and finishes
    monkeypatch.setattr(ck._HashingWriter, "write", real_write)
    assert T.main(args) == 0
    assert "resumed from" in capsys.readouterr().out
    assert load(latest_checkpoint(cdir))["step"] == 6


# ---------------------------------------------------------------------------------------------
# 5. non-finite steps


def metrics_records(run_dir: Path) -> list[dict]:
    def no_constants(c):
        raise ValueError(f"non-JSON constant {c}")

    return [json.loads(ln, parse_constant=no_constants)
            for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def nan_in_window(monkeypatch, index: int) -> None:
    """Token-cache window `index` comes with a NaN in its motion (one batch of each epoch)."""
    real = CodeWindows.__getitem__

    def getitem(self, i):
        out = real(self, i)
        if i == index:
            out["motion"] = out["motion"].clone()
            out["motion"][0, 0] = float("nan")
        return out

    monkeypatch.setattr(CodeWindows, "__getitem__", getitem)


def test_nan_batch_is_skipped_and_counted(tiny, monkeypatch, capsys):
    nan_in_window(monkeypatch, 5)
    args = tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                     world_stage__max_steps=9, checkpoint__every=1, checkpoint__keep_last=20)
    assert T.main(args) == 0
    rd = tiny.run_dir()
    assert json.loads((rd / "world" / "done.json").read_text())["step"] == 9
    skips = [r for r in metrics_records(rd) if "train/nonfinite_steps" in r]
    assert len(skips) == 1, skips  # window 5 is in exactly one batch of the one epoch
    assert skips[0]["kind"] == "world/skip" and skips[0]["train/nonfinite_steps"] == 1
    bad = skips[0]["step"]
    assert f"world step {bad}: non-finite loss or gradient, step skipped" in capsys.readouterr().out
    train_rec = [r for r in metrics_records(rd) if r["kind"] == "world/train" and r["step"] == bad]
    assert train_rec and train_rec[0]["loss/loss"] is None  # NaN went to JSON as null
    cdir = ckpt_dir(rd, "world")
    before = load(cdir / ck.checkpoint_name(bad - 1)) if bad > 1 else None
    after = load(cdir / ck.checkpoint_name(bad))
    for v in after["model"].values():
        assert torch.isfinite(v.float()).all()
    if before is not None:  # the skipped step changed nothing
        assert_same(before["model"], after["model"], "model")
        assert_same(before["optimizer"]["state"], after["optimizer"]["state"], "optimizer")
    if bad < 9:  # and training went on
        nxt = load(cdir / ck.checkpoint_name(bad + 1))
        assert not all(torch.equal(nxt["model"][k], after["model"][k]) for k in after["model"])


def test_outcomes_read_a_step_late_change_nothing(tiny, monkeypatch, capsys):
    """fit reads a step's outcome (skipped? stop?) once the next step is queued, except on steps that
    log or save: the same NaN window read late (log and save only at the end) skips the same step,
    logs it under the same number, and ends in the same state as reading every step at once."""
    nan_in_window(monkeypatch, 5)
    runs = {}
    for out, every in (("each", 1), ("late", 100)):
        capsys.readouterr()
        assert T.main(tiny.args(out=out, train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                                world_stage__max_steps=9, checkpoint__every=every, logging__every=every)) == 0
        rd = tiny.run_dir(out)
        skips = [(r["step"], r["train/nonfinite_steps"]) for r in metrics_records(rd) if r["kind"] == "world/skip"]
        said = [ln for ln in capsys.readouterr().out.splitlines() if "step skipped" in ln]
        runs[out] = skips, said, final_state(rd, "world")
    (skips, said, each), (skips_late, said_late, late) = runs["each"], runs["late"]
    assert len(skips) == 1 and skips == skips_late and said == said_late, (skips, skips_late, said, said_late)
    assert each["step"] == late["step"] == 9
    assert_same(each["model"], late["model"], "model")
    assert_same(each["optimizer"], late["optimizer"], "optimizer")


@pytest.mark.parametrize("fused", [True, False])
def test_step_unless_skips_on_the_device_and_changes_nothing(fused):
    """A skipped AdamW step (fused: decided on the device through found_inf; else by the host) leaves
    parameters, moments and step counts exactly as they were: steps on g1, (g2 skipped), g3 equal
    steps on g1, g3."""
    torch.manual_seed(0)
    grads = [[torch.randn(3, 4), torch.randn(3)] for _ in range(3)]
    states = []
    for order in ((0, 1, 2), (0, 2)):
        torch.manual_seed(1)
        m = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1, fused=fused)
        for i in order:
            for p, g in zip(m.parameters(), grads[i]):
                p.grad = g.clone()
            L.step_unless(opt, torch.tensor(float(i == 1)))
            assert not hasattr(opt, "found_inf")
        states.append((m.state_dict(), opt.state_dict()))
    assert_same(states[0][0], states[1][0], "model")
    assert_same(states[0][1], states[1][1], "optimizer")
    assert states[0][1]["state"][0]["step"] == 2


def test_too_many_nonfinite_steps_stop_with_clear_error(tiny, monkeypatch):
    real = CodeWindows.__getitem__
    calls = {"n": 0}

    def getitem(self, i):
        out = real(self, i)
        calls["n"] += 1
        if calls["n"] > 8:  # batch 2, no workers: steps 1-4 are clean, every later one is NaN
            out["motion"] = torch.full_like(out["motion"], float("nan"))
        return out

    monkeypatch.setattr(CodeWindows, "__getitem__", getitem)
    args = tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                     world_stage__max_steps=9, checkpoint__every=1, checkpoint__keep_last=20,
                     train__max_nonfinite=3)
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = str(e.value)
    assert "\n" not in msg
    assert "3 non-finite steps in a row" in msg and "checkpoint" in msg, msg
    cdir = ckpt_dir(tiny.run_dir(), "world")
    newest = latest_checkpoint(cdir)
    assert newest is not None and str(newest) in msg, msg
    good = load(cdir / ck.checkpoint_name(4))
    last = load(newest)
    assert last["step"] < 7  # the failing step was not saved
    assert not (cdir / ck.checkpoint_name(7)).exists()
    for v in last["model"].values():
        assert torch.isfinite(v.float()).all()
    assert_same(good["model"], last["model"], "model")  # skipped steps left the model as it was
    assert not (tiny.run_dir() / "world" / "done.json").exists()


# ---------------------------------------------------------------------------------------------
# 6. refusals: new data, another config, a data set that does not fit the config


def test_changed_data_refuses_to_resume_unless_allowed(tiny):
    args = tiny.args(tokenizer_stage__max_steps=3)
    assert T.main(args, stop=Preemption(requested=True)) == 0  # as if SIGTERM came at once: stops after step 1, saved
    assert load(latest_checkpoint(ckpt_dir(tiny.run_dir())))["step"] == 1
    old_fp = json.loads((tiny.run_dir() / "config.json").read_text())["meta"]["data_fingerprint"]

    tiny.regenerate(seed=1)  # same root, same shapes, other content
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = str(e.value)
    assert "--allow-new-data" in msg and str(tiny.data) in msg and old_fp[:16] in msg, msg
    assert load(latest_checkpoint(ckpt_dir(tiny.run_dir())))["step"] == 1

    assert T.main(args + ["--allow-new-data"]) == 0
    assert load(latest_checkpoint(ckpt_dir(tiny.run_dir())))["step"] == 3
    new_fp = json.loads((tiny.run_dir() / "config.json").read_text())["meta"]["data_fingerprint"]
    assert new_fp != old_fp
    assert T.main(args) == 0  # the run now belongs to the new data


def test_changed_config_refuses_unless_fresh_which_moves_the_old_run_aside(tiny, capsys):
    args = tiny.args(tokenizer_stage__max_steps=2)
    assert T.main(args) == 0
    rd = tiny.run_dir()
    old_ckpt = latest_checkpoint(ckpt_dir(rd))
    old_bytes = old_ckpt.read_bytes()

    changed = tiny.args(tokenizer_stage__max_steps=2, tokenizer_stage__lr=5e-3)
    with pytest.raises(WMError) as e:
        T.main(changed)
    msg = str(e.value)
    assert "tokenizer_stage.lr" in msg and "--fresh" in msg and "\n" not in msg, msg

    capsys.readouterr()
    assert T.main(changed + ["--fresh"]) == 0
    out = capsys.readouterr().out
    asides = [p for p in rd.parent.iterdir() if p.name.startswith(rd.name + ".")]
    assert len(asides) == 1, list(rd.parent.iterdir())
    assert str(asides[0]) in out
    kept = asides[0] / "tokenizer" / "checkpoints" / old_ckpt.name
    assert kept.read_bytes() == old_bytes  # moved, never deleted
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["tokenizer_stage"]["lr"] == 5e-3
    assert load(latest_checkpoint(ckpt_dir(rd)))["config"]["tokenizer_stage"]["lr"] == 5e-3


def test_resume_may_switch_kernels_and_layouts_which_compute_the_same_function(tiny):
    # kernels.tokenizer_head (and kernels.temporal_attention, by the same rule; the world section is free
    # here anyway, its stage has saved nothing): other kernels or layouts for the same model
    # as if SIGTERM came at once: stops after step 1, saved
    assert T.main(tiny.args(tokenizer_stage__max_steps=3), stop=Preemption(requested=True)) == 0
    assert load(latest_checkpoint(ckpt_dir(tiny.run_dir())))["step"] == 1
    with pytest.raises(WMError, match="tokenizer.embed_dim"):  # a key that changes the model refuses
        T.main(tiny.args(tokenizer_stage__max_steps=3, tokenizer__embed_dim=4))
    assert T.main(tiny.args(tokenizer_stage__max_steps=3, kernels__tokenizer_head=False,
                            kernels__temporal_attention=False)) == 0
    assert load(latest_checkpoint(ckpt_dir(tiny.run_dir())))["step"] == 3


def test_fresh_twice_in_one_second_keeps_both_old_runs(tiny):
    args = tiny.args(tokenizer_stage__max_steps=1)
    assert T.main(args) == 0
    assert T.main(args + ["--fresh"]) == 0
    assert T.main(args + ["--fresh"]) == 0
    rd = tiny.run_dir()
    asides = [p for p in rd.parent.iterdir() if p.name.startswith(rd.name + ".")]
    assert len(asides) == 2
    for a in asides:
        assert latest_checkpoint(ckpt_dir(a)) is not None


@pytest.mark.parametrize("over, key", [
    ({"data__grid": "16,16,8"}, "data.grid"),
    ({"data__num_classes": 10, "data__free_class": 9}, "data.num_classes"),
])
def test_data_that_does_not_fit_the_config_refuses_to_start(tiny, over, key):
    with pytest.raises(DataError) as e:
        T.main(tiny.args(**over))
    msg = str(e.value)
    assert str(tiny.data / "manifest.json") in msg and key in msg and "\n" not in msg, msg
    cdir = ckpt_dir(tiny.run_dir())
    assert not cdir.is_dir() or latest_checkpoint(cdir) is None
    # nothing was started: the corrected command runs without --fresh
    assert T.main(tiny.args()) == 0


# ---------------------------------------------------------------------------------------------
# 7, 8. TensorBoard, metrics.jsonl, summary.json


@pytest.fixture(scope="module")
def logged_run(tiny_factory, one_thread):
    """Both stages, with TensorBoard and images, validating every 2 steps."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    tiny = tiny_factory()
    args = tiny.args(train__stages="tokenizer,world", logging__tensorboard=True,
                     tokenizer_stage__max_steps=4, world_stage__max_steps=4,
                     tokenizer_stage__eval_every=2, world_stage__eval_every=2)
    try:
        assert T.main(args) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return tiny.run_dir()


def test_tensorboard_events_hold_the_expected_tags(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logged_run / "tb"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    tags = ea.Tags()
    for stage in ("tokenizer", "world"):  # each stage's curves under its name: both count steps from 1
        for t in ("loss/loss", "train/lr", "perf/samples_per_s", "perf/data_wait_frac", "train/grad_norm",
                  "val/iou", "val/miou"):
            assert f"{stage}/{t}" in tags["scalars"], (stage, t, tags["scalars"])
    for t in ("val/copy_last_iou", "val/iou_t1", "val/miou_t2"):
        assert f"world/{t}" in tags["scalars"], (t, tags["scalars"])
    assert all(t.split("/")[0] in ("tokenizer", "world", "run") for t in tags["scalars"]), tags["scalars"]
    for t in tags["scalars"]:  # one stage per curve: its steps only rise
        steps = [e.step for e in ea.Scalars(t)]
        assert steps == sorted(set(steps)), (t, steps)
    assert "tokenizer/val/recon_gt_top_pred_bottom" in tags["images"], tags["images"]
    assert "world/val/forecast_gt_top_pred_bottom" in tags["images"], tags["images"]
    lr = ea.Scalars("tokenizer/train/lr") + ea.Scalars("world/train/lr")
    assert len(lr) == 8 and all(math.isfinite(e.value) and e.value > 0 for e in lr)  # 4 + 4 steps
    img = ea.Images("tokenizer/val/recon_gt_top_pred_bottom")[0]
    assert img.width > 0 and img.height > 0 and img.encoded_image_string[:4] == b"\x89PNG"


def test_tensorboard_hparams_hold_the_config_and_final_metrics(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    assert not (logged_run / "tb" / "hparams").exists()  # the run's own event file holds them
    ea = EventAccumulator(str(logged_run / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    content = ea.PluginTagToContent("hparams")
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metrics = [m.name.tag for m in exp.metric_infos]
    assert metrics == ["tokenizer/val/iou", "tokenizer/val/miou", "world/val/iou", "world/val/miou",
                       "world/val/iou_t1", "world/val/miou_t1", "world/val/iou_t2", "world/val/miou_t2",
                       "run/gpu_hours"]
    assert set(metrics) <= set(ea.Tags()["scalars"])  # each has a value in the run
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert start.session_start_info.group_name == "r"
    assert hp["tokenizer_stage.lr"].number_value == pytest.approx(Config().tokenizer_stage.lr)
    assert hp["train.stages"].string_value  # lists as text
    assert hp["logging.tensorboard"].WhichOneof("kind") == "bool_value" and hp["logging.tensorboard"].bool_value
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == api_pb2.STATUS_SUCCESS
    s = json.loads((logged_run / "summary.json").read_text())
    assert ea.Scalars("run/gpu_hours")[-1].value == pytest.approx(s["gpu_hours"], rel=1e-5)


def test_metrics_jsonl_is_strict_json(logged_run):
    recs = metrics_records(logged_run)
    kinds = {r["kind"] for r in recs}
    assert {"tokenizer/train", "tokenizer/val", "world/train", "world/val"} <= kinds, kinds
    for r in recs:
        assert isinstance(r["step"], int)
    train = [r for r in recs if r["kind"] == "tokenizer/train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(isinstance(r["loss/loss"], float) for r in train)
    val = [r for r in recs if r["kind"] == "world/val"]
    assert [r["step"] for r in val] == [2, 4]
    assert all("val/copy_last_iou_t2" in r for r in val)


def test_summary_json_has_the_final_figures(logged_run):
    s = json.loads((logged_run / "summary.json").read_text())
    tok = s["tokenizer"]
    assert all(isinstance(tok[k], float) for k in ("recon_iou", "recon_miou"))
    w = s["world"]
    assert w["steps"] == ["t+1", "t+2"]
    for k in ("iou", "miou", "copy_last_iou", "copy_last_miou"):
        assert len(w[k]) == 2 and all(isinstance(v, float) and 0 <= v <= 100 for v in w[k]), (k, w[k])
    done = json.loads((logged_run / "world" / "done.json").read_text())
    assert w["iou"] == [done["metrics"]["val/iou_t1"], done["metrics"]["val/iou_t2"]]
    assert w["copy_last_miou"][1] == done["metrics"]["val/copy_last_miou_t2"]
    # per-class figures: reconstruction for every class, the forecast per step for the moving ones
    assert set(tok["recon_class_iou"]) == set(OCC3D_CLASSES) - {"free"}
    tdone = json.loads((logged_run / "tokenizer" / "done.json").read_text())
    assert tok["recon_class_iou"]["driveable_surface"] == tdone["metrics"]["val/class_iou/driveable_surface"]
    assert set(w["class_iou"]) == set(NUSCENES_MOVING) and all(len(v) == 2 for v in w["class_iou"].values())
    assert w["class_iou"]["car"] == [done["metrics"]["val/class_iou/car_t1"], done["metrics"]["val/class_iou/car_t2"]]
    assert w["copy_last_class_iou"]["car"][1] == done["metrics"]["val/copy_last_class_iou/car_t2"]


def test_final_table_lists_the_moving_classes():
    cfg = Config()
    cfg.data.future = 2
    r = {"val/iou_t1": 50.0, "val/miou_t1": 20.0, "val/iou_t2": 40.0, "val/miou_t2": 10.0,
         "val/class_iou/car_t1": 31.25, "val/class_iou/car_t2": None, "val/class_iou/car": 31.25,
         "val/copy_last_class_iou/car_t1": 12.5, "val/copy_last_class_iou/car_t2": 3.0,
         "val/copy_last_class_iou/car": 7.75}
    lines = final_table(cfg, {"world": r}, moving=NUSCENES_MOVING).splitlines()
    assert lines[-3].startswith("moving classes") and lines[-2].split() == ["step", "t+1", "t+2", "avg"]
    assert lines[-1].split() == ["car", "31.2", "/", "12.5", "-", "/", "3.0", "31.2", "/", "7.8"]
    assert not any(ln.startswith("pedestrian") for ln in lines)  # no figures: no row


def test_broken_summary_writer_warns_once_and_training_finishes(tiny, monkeypatch):
    import torch.utils.tensorboard as tb

    class Broken:
        def __init__(self, *a, **k):
            raise OSError("tensorboard is broken")

    monkeypatch.setattr(tb, "SummaryWriter", Broken)
    with pytest.warns(RuntimeWarning) as rec:
        assert T.main(tiny.args(logging__tensorboard=True, tokenizer_stage__max_steps=3,
                                tokenizer_stage__eval_every=1)) == 0
    ours = [w for w in rec if "logging to tensorboard failed" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in rec]
    assert (tiny.run_dir() / "tokenizer" / "done.json").is_file()
    assert len([r for r in metrics_records(tiny.run_dir()) if r["kind"] == "tokenizer/train"]) == 3


def test_tb_folder_that_is_a_file_warns_once_and_training_finishes(tiny):
    rd = tiny.run_dir()
    rd.mkdir(parents=True)
    (rd / "tb").write_text("not a folder")
    with pytest.warns(RuntimeWarning) as rec:
        assert T.main(tiny.args(logging__tensorboard=True, tokenizer_stage__max_steps=3,
                                tokenizer_stage__eval_every=1)) == 0
    ours = [w for w in rec if "logging to tensorboard failed" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in rec]
    assert (rd / "tokenizer" / "done.json").is_file()
    assert (rd / "tb").read_text() == "not a folder"


def test_logger_failing_mid_run_warns_once_and_training_finishes(tiny, monkeypatch):
    import torch.utils.tensorboard as tb

    real = tb.SummaryWriter

    class Flaky(real):
        calls = 0

        def add_scalar(self, *a, **k):
            Flaky.calls += 1
            if Flaky.calls > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().add_scalar(*a, **k)

    monkeypatch.setattr(tb, "SummaryWriter", Flaky)
    with pytest.warns(RuntimeWarning) as rec:
        assert T.main(tiny.args(logging__tensorboard=True, tokenizer_stage__max_steps=4)) == 0
    ours = [w for w in rec if "logging to tensorboard failed" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in rec]
    assert (tiny.run_dir() / "tokenizer" / "done.json").is_file()
    recs = [r for r in metrics_records(tiny.run_dir()) if r["kind"] == "tokenizer/train"]
    assert len(recs) == 4  # metrics.jsonl kept working


def test_world_crop_trains_on_one_random_square_of_the_token_map():
    """train.world_crop: every batch's codes (and cell mask) are cut on the host (WorldStage.prepare,
    before the copy to the device) to one crop x crop square, the same for all its frames, at offsets
    drawn from the torch RNG (so resume replays them); 0 keeps the whole map. The loss is the world
    model's loss on that square."""
    from types import SimpleNamespace

    from wm.config.models import WorldConfig
    from wm.models.world import WorldModel
    torch.manual_seed(0)
    model = WorldModel(WorldConfig(widths=(8, 16), heads=2), 16)
    codes = torch.randint(0, 16, (2, 4, 8, 6))
    motion = torch.randn(2, 4, 3)
    mask = torch.rand(2, 4, 8, 6) < 0.5
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    batch = {"codes": codes, "motion": motion, "mask": mask}

    def stage(crop):
        return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(world_crop=crop)))

    torch.manual_seed(5)
    cut = WorldStage.prepare(stage(4), batch)
    assert cut["motion"] is motion and cut["codes"].is_contiguous()
    res = WorldStage.loss(stage(4), model, cut)
    torch.manual_seed(5)  # the offsets the stage drew
    i, j = int(torch.randint(0, 8 - 4 + 1, ())), int(torch.randint(0, 6 - 4 + 1, ()))
    sq = codes[..., i:i + 4, j:j + 4]
    assert torch.equal(seen[-1], sq[:, :-1])
    ref = model.loss(model(sq[:, :-1], motion[:, :-1]), sq[:, 1:], motion[:, 1:],
                     mask=mask[..., i:i + 4, j:j + 4][:, 1:])
    assert torch.equal(res["loss"], ref["loss"])
    assert WorldStage.prepare(stage(0), batch) is batch  # 0: the whole map
    assert WorldStage.prepare(stage(8), batch) is batch  # a crop no smaller than the map keeps it whole
    WorldStage.loss(stage(0), model, batch)
    assert seen[-1].shape == (2, 3, 8, 6)


def test_logged_rate_leaves_out_the_validation_time(tiny, restore_signals, one_thread, monkeypatch):
    """perf/samples_per_s after a validation counts the training steps only: a validation that
    takes 2 s must not show up as a slow training interval (the clock moves on 2 s in each; nothing sleeps)."""
    import time

    evaluations = []
    real, clock = TokenizerStage.evaluate, time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + 2.0 * len(evaluations))

    def slow_evaluate(self, *a, **kw):
        evaluations.append(True)
        return real(self, *a, **kw)

    monkeypatch.setattr(TokenizerStage, "evaluate", slow_evaluate)
    args = tiny.args(tokenizer_stage__max_steps=4, tokenizer_stage__eval_every=2, logging__every=1)
    assert T.main(args) == 0
    assert len(evaluations) == 2  # after steps 2 and 4
    recs = [json.loads(ln) for ln in (tiny.run_dir() / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rates = {r["step"]: r["perf/samples_per_s"] for r in recs if "perf/samples_per_s" in r}
    batch = 2  # tiny's data.batch_size
    # step 3's interval holds the step 2 validation if the timer is not paused: then < batch / 2 s
    assert rates[3] > batch / 1.0, rates


def test_training_log_states_device_and_precision(tiny, restore_signals, capsys, monkeypatch):
    """The log's first lines say where the run trains and in which precision, and why (amp=auto)."""
    assert T.main(tiny.args(tokenizer_stage__max_steps=1)) == 0
    assert f"training: 1 rank on cpu ({torch.get_num_threads()} thread" in capsys.readouterr().out
    assert "), fp32 (train.amp=fp32)" in T.device_line(Config(train=dataclasses.replace(
        Config().train, amp="fp32")), D.Dist(), torch.device("cpu"), None)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert T.device_line(Config(), D.Dist(), torch.device("cpu"), None).endswith(
        "fp32 (train.amp=auto: no AMX on this CPU)")


def test_auto_precision_is_bf16_on_cuda_and_on_cpus_with_amx(monkeypatch):
    """train.amp=auto: bf16 on CUDA; on a CPU bf16 only where AMX multiplies bf16 natively."""
    cfg = Config()
    assert cfg.train.amp == "auto"
    assert T.amp_dtype(cfg, torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert T.amp_dtype(cfg, torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert T.amp_dtype(cfg, torch.device("cpu")) is None
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)  # an older torch
    assert T.amp_dtype(cfg, torch.device("cpu")) is None
    cfg.train.amp = "fp32"
    assert T.amp_dtype(cfg, torch.device("cuda")) is None


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_compiled_passes_the_stage_inductor_options_with_the_mode(mode, monkeypatch):
    # torch.compile refuses a mode and options together: the mode's own options go in with the
    # stage's (the tokenizer's forced layout optimisation and kernel tuning), and torch accepts the names
    from types import SimpleNamespace

    cfg = Config()
    cfg.compile.enable, cfg.compile.mode = True, mode
    model = torch.nn.Linear(2, 2)
    opts = TokenizerStage.inductor_options(SimpleNamespace(cfg=cfg))
    assert opts == {"force_layout_optimization": True, "coordinate_descent_tuning": True}
    cfg.compile.tokenizer_tuning = cfg.compile.tokenizer_channels_last = False
    assert TokenizerStage.inductor_options(SimpleNamespace(cfg=cfg)) == {}
    W.compiled(model, cfg, opts)  # the real torch.compile checks the option names (it compiles on first call)
    seen = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.append(kw) or m)
    W.compiled(model, cfg, opts)
    W.compiled(model, cfg, {})
    cfg.compile.enable = False
    assert W.compiled(model, cfg, opts) is model
    want = {"default": {}, "reduce-overhead": {"triton.cudagraphs": True},
            "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
            "max-autotune": {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True}}[mode]
    assert seen == [{"options": {**want, **opts}}, {"mode": mode}], seen


def test_compile_auto_is_on_for_cuda_only_and_the_gpu_presets_use_it(monkeypatch):
    from wm.config.loading import load as load_config
    from wm.utils.errors import ConfigError

    cfg = Config()
    assert cfg.compile.enable == "auto"
    assert W.compiles(cfg, torch.device("cuda")) and not W.compiles(cfg, torch.device("cpu"))
    for value, want in (("true", True), ("false", False), ("auto", "auto")):
        assert load_config(None, [f"compile.enable={value}"]).compile.enable == want
    assert W.compiles(load_config(None, ["compile.enable=true"]), torch.device("cpu"))
    assert not W.compiles(load_config(None, ["compile.enable=false"]), torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"compile\.enable.*'maybe' must be true, false or auto"):
        load_config(None, ["compile.enable=maybe"])
    for preset in ("occworld", "occworld_20min", "occworld_nuscenes"):
        c = load_config(str(Path(__file__).resolve().parents[2] / "configs" / f"{preset}.json"))
        assert W.compiles(c, torch.device("cuda")) and not W.compiles(c, torch.device("cpu")), preset
    seen = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.append(kw) or m)
    model = torch.nn.Linear(2, 2)  # on the CPU: "auto" leaves it eager
    assert W.compiled(model, cfg, {}) is model and seen == []


def test_the_compiled_tokenizer_has_channels_last_weights_as_inductor_runs_its_convolutions(tiny):
    # Inductor's layout optimisation (compile.tokenizer_channels_last) runs every convolution NHWC and
    # hands back NHWC weight gradients: NCHW weights would be converted each step and their gradients copied
    from wm.config.loading import load as load_config
    from wm.utils.distributed import Dist

    def weights(**over):
        a = tiny.args(**over)
        cfg = load_config(None, [v for k, v in zip(a, a[1:]) if k == "--set"])
        run = Run(cfg, Dist())
        try:
            return {n: p for n, p in TokenizerStage(run).model.named_parameters() if p.ndim == 4}
        finally:
            run.log.close()
            run.close()

    cl = torch.channels_last
    on = weights(compile__enable="true")
    assert on and all(p.stride() == torch.empty(p.shape, memory_format=cl).stride() for p in on.values())
    eager = weights(compile__enable="auto")  # on the CPU: eager; the decoder alone runs channels-last
    assert eager["enc_in.weight"].is_contiguous() and not eager["enc_in.weight"].is_contiguous(memory_format=cl)
    assert eager["decoder.0.conv1.weight"].is_contiguous(memory_format=cl)
    off = weights(compile__enable="true", compile__tokenizer_channels_last="false")
    assert off["enc_in.weight"].is_contiguous()
    for n in on:  # the same values either way
        assert torch.equal(on[n], eager[n]) and torch.equal(on[n], off[n]), n


def test_the_first_steps_time_is_logged_apart_and_the_rate_after_it_is_the_steady_one(tiny, monkeypatch, capsys,
                                                                                        restore_signals):
    real, calls, clock = L.train_step, [], time.perf_counter
    # the first step takes 2 s more, as a compilation would: the clock moves on 2 s during it
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + 2.0 * bool(calls))

    def slow_first(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(L, "train_step", slow_first)
    assert T.main(tiny.args(tokenizer_stage__max_steps=9, logging__every=3)) == 0
    out = capsys.readouterr().out
    m = re.search(r"^tokenizer: first step (\d+\.\d) s$", out, re.M)
    assert m and float(m.group(1)) >= 2.0, out
    recs = [json.loads(ln) for ln in (tiny.run_dir() / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rate = [r["perf/samples_per_s"] for r in recs if "perf/samples_per_s" in r]
    assert len(rate) == 3 and rate[0] > 2 * 2 / 1.0, rate  # steps 2 and 3 of batch 2: not the 2 s of the first
    # the ETA at step 3 is of 6 steps at the steady rate; with the first step's 2 s in the rate it said >= 4 s
    eta = re.search(r"^tokenizer step 3/9 .* ETA (\d+)m(\d\d)s$", out, re.M)
    assert eta and 60 * int(eta.group(1)) + int(eta.group(2)) < 3, out


def test_a_finished_stage_leaves_no_dataloader_worker_behind(tiny, restore_signals, monkeypatch):
    """fit's DataLoader workers end when fit returns, not at some later garbage collection: a
    reference cycle through the loop kept them (idle, holding memory) into the next stage and then
    cost seconds of worker shutdown at the run's end. The collector is off, so only references count."""
    import gc
    import multiprocessing

    import wm.training.main as T

    real, alive = T.fit, []

    def fit_and_count(*a, **kw):
        out = real(*a, **kw)
        alive.append(len(multiprocessing.active_children()))
        return out

    monkeypatch.setattr(T, "fit", fit_and_count)
    gc.collect()
    gc.disable()
    try:
        assert T.main(tiny.args(loader__num_workers=1, tokenizer_stage__max_steps=2)) == 0
    finally:
        gc.enable()
    assert alive == [0], alive
