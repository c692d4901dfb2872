"""wm.checkpoint.files: atomic writes, the `latest` pointer and its fallback, rotation and best-by-metric,
asynchronous saves that never alias live tensors, failures that keep what was there, kill -9
mid-write, and RNG/optimizer state that round-trips bitwise through torch.load(weights_only=True).
"""

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from helpers import assert_same, one_line
from wm.checkpoint.checkpointer import Checkpointer
import wm.checkpoint.files as ck
from wm.checkpoint.files import CheckpointError
from wm.utils import atomic
from wm.utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def resume_state(folder: Path) -> dict | None:
    """The state a resume starts from: the newest valid checkpoint's, or None."""
    found = ck.newest_valid(folder, say=lambda m: warnings.warn(m, stacklevel=2))
    return None if found is None else found[1]


def dir_snapshot(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def temps(folder: Path) -> list:
    return sorted(n for n in os.listdir(folder) if ".tmp-" in n)


def small_state(step: int, **extra) -> dict:
    return {"step": step, "w": torch.full((64,), float(step)), **extra}


# --------------------------------------------------------------------------------------------------
# a realistic state round-trips bitwise


def make_training(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=3),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)], milestones=[3])
    return model, opt, sched


def train_step(model, opt, sched, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()


def full_state(model, opt, sched, step):
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        "step": step, "epoch": 1, "sampler": {"epoch": 1, "consumed": 128, "seed": 7},
        "rng": ck.rng_state(),
        "config": {"train": {"lr": 1e-2, "betas": [0.9, 0.95]}, "run": {"name": "exp", "seed": 7}},
        "data_fingerprint": "sha256:abc123", "metrics": {"loss": np.float32(0.25), "iou": 0.5},
    }


def test_realistic_state_round_trips_bitwise_with_weights_only(tmp_path):
    model, opt, sched = make_training()
    x = torch.randn(32, 8)
    for _ in range(2):
        train_step(model, opt, sched, x)
    state = full_state(model, opt, sched, step=2)
    c = Checkpointer(tmp_path / "ckpt", keep_last=2)
    c.save(state, 2)
    c.wait()
    path = c.latest()
    assert path == tmp_path / "ckpt" / "step_000000002.pt"
    loaded = ck.load(path)  # weights_only=True inside
    torch.load(path, weights_only=True)  # and directly
    assert loaded["metrics"]["loss"] == 0.25 and type(loaded["metrics"]["loss"]) is float
    expected = dict(state, metrics={"loss": 0.25, "iou": 0.5})
    assert_same(expected, loaded, ordered=True)
    assert resume_state(tmp_path / "ckpt")["step"] == 2

    # restored objects continue exactly as the originals do
    model2, opt2, sched2 = make_training(seed=1)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    for _ in range(2):
        train_step(model, opt, sched, x)
        train_step(model2, opt2, sched2, x)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_rng_helpers_restore_every_generator_exactly(tmp_path):
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()  # and in numpy's (has_gauss)
    torch.save(ck.rng_state(), tmp_path / "rng.pt")

    def draw():
        return (torch.rand(5).tolist(), torch.randn(3).tolist(), np.random.rand(5).tolist(),
                [np.random.standard_normal() for _ in range(3)], [random.random() for _ in range(5)],
                [random.gauss(0, 1) for _ in range(3)])

    first = draw()
    second = draw()
    assert first != second
    ck.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draw() == first


def test_state_weights_only_would_refuse_is_rejected_at_save(tmp_path):
    c = Checkpointer(tmp_path, async_save=True)
    with pytest.raises(TypeError, match=r"extra\.bad"):
        c.save({"extra": {"bad": object()}}, 1)
    assert c.list() == [] and temps(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# async: no aliasing, timings, failure at the next call


def test_async_copy_does_not_alias_live_tensors(tmp_path, monkeypatch):
    model, opt, sched = make_training()
    x = torch.randn(16, 8)
    train_step(model, opt, sched, x)
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    before_avg = {i: s["exp_avg"].clone() for i, s in opt.state_dict()["state"].items()}

    gate = threading.Event()
    real_save = torch.save

    def gated_save(obj, f, *a, **kw):  # hold the writer until the caller has mutated everything
        assert gate.wait(10)
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", gated_save)
    c = Checkpointer(tmp_path, keep_last=2)
    c.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, 1)
    assert c.last_blocked_s > 0
    with torch.no_grad():  # training goes on, in place
        for p in model.parameters():
            p.add_(100.0)
        for b in model.buffers():
            b.add_(7)
    train_step(model, opt, sched, x)
    gate.set()
    c.wait()
    loaded = ck.load(c.latest())
    for k, v in before_model.items():
        assert torch.equal(loaded["model"][k], v), k
        assert not torch.equal(model.state_dict()[k], v), k  # the live one did change
    for i, v in before_avg.items():
        assert torch.equal(loaded["optimizer"]["state"][i]["exp_avg"], v)


def test_async_timings_recorded_and_failure_raised_by_next_save(tmp_path, monkeypatch):
    c = Checkpointer(tmp_path, keep_last=3)
    c.save(small_state(1), 1)
    assert isinstance(c.last_blocked_s, float) and c.last_blocked_s > 0
    c.wait()
    assert c.last_write_s > 0
    snap = dir_snapshot(tmp_path)

    real_save = torch.save
    calls = []

    def failing_once(obj, f, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_once)
    c.save(small_state(2), 2)  # returns: the failure happens in the background
    with pytest.raises(CheckpointError) as ei:
        c.save(small_state(3), 3)
    msg = one_line(ei.value)
    assert "step_000000002.pt" in msg and "No space left on device" in msg and "intact" in msg
    assert dir_snapshot(tmp_path) == snap  # step 3 was not started either
    c.save(small_state(3), 3)  # the failure was reported once; saving works again
    c.close()
    assert [p.name for p in c.list()] == ["step_000000001.pt", "step_000000003.pt"]
    with pytest.raises(RuntimeError):
        c.save(small_state(4), 4)


def test_async_failure_raised_by_wait_and_close(tmp_path, monkeypatch):
    def boom(obj, f, *a, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(torch, "save", boom)
    c = Checkpointer(tmp_path)
    c.save(small_state(1), 1)
    with pytest.raises(CheckpointError, match="step_000000001.pt.*Permission denied"):
        c.close()
    assert c.list() == [] and temps(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# rotation and best


def test_keep_last_below_two_refused(tmp_path):
    for bad in (1, 0, -3):
        with pytest.raises(ConfigError) as ei:
            Checkpointer(tmp_path, keep_last=bad)
        assert "keep_last" in one_line(ei.value) and ">= 2" in str(ei.value)
    with pytest.raises(ConfigError, match="best_mode"):
        Checkpointer(tmp_path, best_metric="iou", best_mode="biggest")


@pytest.mark.parametrize("mode,best_step", [("max", 1), ("min", 2)])
def test_rotation_keeps_last_n_and_best_survives(tmp_path, mode, best_step):
    values = [0.5, 0.1, 0.3, 0.2, 0.4, 0.45, 0.35]
    c = Checkpointer(tmp_path, keep_last=3, best_metric="iou", best_mode=mode)
    for step, v in enumerate(values, start=1):
        c.save(small_state(step, iou=v), step, metrics={"iou": v, "loss": 1.0})
        c.wait()
        assert len(c.list()) == min(step, 3)
        if step == best_step:  # best.pt is a hard link to its step file (no copy)
            assert os.stat(tmp_path / "best.pt").st_ino == os.stat(c.latest()).st_ino
    c.save(small_state(8), 8)  # no metric: best untouched
    c.close()
    assert [p.name for p in c.list()] == ["step_000000006.pt", "step_000000007.pt", "step_000000008.pt"]
    assert not (tmp_path / f"step_{best_step:09d}.pt").exists()  # its step file was rotated away
    best = ck.load(tmp_path / "best.pt")
    assert best["step"] == best_step and best["iou"] == values[best_step - 1]
    assert torch.equal(best["w"], torch.full((64,), float(best_step)))
    info = json.loads((tmp_path / "best.json").read_text())
    assert info["step"] == best_step and info["value"] == values[best_step - 1]
    assert info["metric"] == "iou" and info["mode"] == mode
    assert ck.latest_checkpoint(tmp_path).name == "step_000000008.pt"

    # a new Checkpointer (a resumed run) knows the best so far
    c2 = Checkpointer(tmp_path, keep_last=3, best_metric="iou", best_mode=mode)
    worse, better = (0.2, 0.9) if mode == "max" else (0.3, 0.01)
    c2.save(small_state(9), 9, metrics={"iou": worse})
    c2.wait()
    assert ck.load(tmp_path / "best.pt")["step"] == best_step
    c2.save(small_state(10), 10, metrics={"iou": better})
    c2.save(small_state(11), 11, metrics={"iou": float("nan")})  # never "better"
    c2.close()
    assert ck.load(tmp_path / "best.pt")["step"] == 10
    assert json.loads((tmp_path / "best.json").read_text())["value"] == better
    assert len(c2.list()) == 3 and (tmp_path / "best.pt").exists()


def test_stale_temp_files_cleaned_on_start_and_never_listed(tmp_path):
    c = Checkpointer(tmp_path)
    c.save(small_state(1), 1)
    c.close()
    stale = [".step_000000002.pt.tmp-99999", ".latest.tmp-4242", ".best.pt.tmp-7"]
    keep = [".hidden", "notes.tmp-3", "step_000000002.pt.partial"]
    for n in stale + keep:
        (tmp_path / n).write_bytes(b"half a checkpoint")
    assert [p.name for p in c.list()] == ["step_000000001.pt"]
    assert ck.latest_checkpoint(tmp_path).name == "step_000000001.pt"
    Checkpointer(tmp_path)
    names = set(os.listdir(tmp_path))
    assert not names & set(stale) and set(keep) <= names


# --------------------------------------------------------------------------------------------------
# the pointer and the fallback


def test_pointer_replaced_only_after_checkpoint_is_complete(tmp_path, monkeypatch):
    c = Checkpointer(tmp_path, keep_last=3)
    c.save(small_state(1), 1)
    c.wait()
    seen = {}
    real_save = torch.save

    def watching_save(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)  # the bytes are written, the file is not yet renamed
        seen["pointer"] = json.loads((tmp_path / "latest").read_text())["file"]
        seen["final_exists"] = (tmp_path / "step_000000002.pt").exists()
        seen["temps"] = temps(tmp_path)
        seen["latest"] = ck.latest_checkpoint(tmp_path).name

    monkeypatch.setattr(torch, "save", watching_save)
    c.save(small_state(2), 2)
    c.wait()
    assert seen == {"pointer": "step_000000001.pt", "final_exists": False,
                    "temps": [f".step_000000002.pt.tmp-{os.getpid()}"], "latest": "step_000000001.pt"}
    p = json.loads((tmp_path / "latest").read_text())
    assert p["file"] == "step_000000002.pt" and p["step"] == 2
    assert p["size"] == (tmp_path / p["file"]).stat().st_size
    assert p["sha256"] == hashlib.sha256((tmp_path / p["file"]).read_bytes()).hexdigest()
    assert temps(tmp_path) == []


def test_latest_follows_a_healthy_pointer(tmp_path):
    c = saved_three(tmp_path)
    ptr = json.loads((tmp_path / "latest").read_text())
    assert ptr["file"] == "step_000000003.pt"
    # a pointer that names an older complete checkpoint is followed (no scan, no load)
    p2 = tmp_path / "step_000000002.pt"
    (tmp_path / "latest").write_text(json.dumps({"file": p2.name, "step": 2, "size": p2.stat().st_size}))
    assert c.latest() == p2 and resume_state(tmp_path)["step"] == 2


def saved_three(folder: Path) -> Checkpointer:
    c = Checkpointer(folder, keep_last=5)
    for s in (1, 2, 3):
        c.save(small_state(s), s)
    c.wait()
    return c


@pytest.mark.parametrize("damage", ["deleted", "garbage", "not-a-dict", "names-missing-file", "names-temp",
                                    "wrong-size"])
def test_damaged_pointer_falls_back_to_newest_loadable(tmp_path, damage):
    c = saved_three(tmp_path)
    ptr = tmp_path / "latest"
    old = json.loads(ptr.read_text())
    if damage == "deleted":
        ptr.unlink()
    elif damage == "garbage":
        ptr.write_bytes(b"\x00{not json")
    elif damage == "not-a-dict":
        ptr.write_text("[1, 2]")
    elif damage == "names-missing-file":
        ptr.write_text(json.dumps({"file": "step_000000009.pt", "step": 9}))
    elif damage == "names-temp":
        (tmp_path / ".step_000000009.pt.tmp-1").write_bytes(b"x")
        ptr.write_text(json.dumps({"file": ".step_000000009.pt.tmp-1", "step": 9}))
    elif damage == "wrong-size":
        ptr.write_text(json.dumps(dict(old, size=old["size"] + 1)))
    assert c.latest() == tmp_path / "step_000000003.pt"
    assert resume_state(tmp_path)["step"] == 3


def test_truncated_newest_is_skipped_and_its_load_error_names_it(tmp_path):
    c = saved_three(tmp_path)
    newest = tmp_path / "step_000000003.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # the pointer still names it, with the old size
    assert c.latest() == tmp_path / "step_000000002.pt"
    (tmp_path / "latest").unlink()  # and with no pointer at all
    assert c.latest() == tmp_path / "step_000000002.pt"
    assert resume_state(tmp_path)["step"] == 2
    with pytest.raises(CheckpointError) as ei:
        ck.load(newest)
    msg = one_line(ei.value)
    assert str(newest) in msg and "truncated or corrupt" in msg
    assert f"the previous checkpoint is {tmp_path / 'step_000000002.pt'}" in msg

    with pytest.raises(CheckpointError) as ei:
        ck.load(tmp_path / "step_000000001.pt.gone")
    assert "does not exist" in one_line(ei.value) and "step_000000001.pt.gone" in str(ei.value)
    (tmp_path / "step_000000001.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    with pytest.raises(CheckpointError) as ei:
        ck.load(tmp_path / "step_000000001.pt")
    assert "truncated or corrupt" in one_line(ei.value) and "no earlier checkpoint" in str(ei.value)


def test_empty_or_missing_folder_has_no_latest(tmp_path):
    assert ck.latest_checkpoint(tmp_path / "nope") is None
    assert resume_state(tmp_path) is None
    assert Checkpointer(tmp_path / "new").latest() is None


def test_a_first_save_killed_before_its_sha256_resumes_from_it(tmp_path):
    c = Checkpointer(tmp_path)
    c.save(small_state(1), 1)
    c.close()
    (tmp_path / "step_000000001.pt.sha256").unlink()  # what a kill between steps 1 and 4 leaves
    (tmp_path / "latest").unlink()
    assert resume_state(tmp_path)["step"] == 1
    (tmp_path / "step_000000001.pt").write_bytes(b"PK\x03\x04 damaged")
    with pytest.raises(CheckpointError):
        resume_state(tmp_path)


# --------------------------------------------------------------------------------------------------
# failures keep everything that was there


class FailingFile:
    """A real file whose writes fail with `err` once `limit` bytes went through (a disk filling up)."""

    def __init__(self, path, mode, err, limit):
        self.f, self.err, self.limit, self.n = open(path, mode), err, limit, 0

    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if self.n + n > self.limit:
            raise OSError(self.err, os.strerror(self.err))
        self.n += n
        return self.f.write(b)

    def __getattr__(self, k):
        return getattr(self.f, k)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES, errno.EIO])
@pytest.mark.parametrize("where", ["torch.save", "file-write", "pointer"])
@pytest.mark.parametrize("async_save", [True, False])
def test_failed_save_keeps_previous_checkpoints_and_pointer(tmp_path, monkeypatch, err, where, async_save):
    c = Checkpointer(tmp_path, keep_last=2, best_metric="iou", async_save=async_save)
    c.save(small_state(1), 1, metrics={"iou": 0.1})
    c.save(small_state(2), 2, metrics={"iou": 0.2})
    c.wait()
    snap = dir_snapshot(tmp_path)
    real_open = open

    if where == "torch.save":
        def bad_save(obj, f, *a, **kw):  # part of the file is written, then the disk fails
            f.write(b"PK\x03\x04" + b"\0" * 1000)
            raise OSError(err, os.strerror(err))
        monkeypatch.setattr(torch, "save", bad_save)
    else:
        victim = ".step_000000003.pt.tmp-" if where == "file-write" else ".latest.tmp-"

        def bad_open(path, mode="r", *a, **kw):
            if Path(path).name.startswith(victim):
                return FailingFile(path, mode, err, limit=4096 if where == "file-write" else 0)
            return real_open(path, mode, *a, **kw)
        monkeypatch.setattr(atomic, "open", bad_open, raising=False)

    with pytest.raises(CheckpointError) as ei:
        c.save(small_state(3, big=torch.zeros(10_000)), 3, metrics={"iou": 0.9})
        c.wait()
    msg = one_line(ei.value)
    assert os.strerror(err) in msg and "intact" in msg and "step_000000002.pt" in msg
    named = "latest" if where == "pointer" else "step_000000003.pt"
    assert str(tmp_path / named) in msg
    got = dir_snapshot(tmp_path)
    if where == "pointer":  # best is updated before a step counts (wm/checkpoint/files.py's ordering): it
        # may be ahead of the committed steps, never behind; the replayed step rewrites the same
        assert json.loads((tmp_path / "best.json").read_text())["step"] == 3
        assert ck.load_checked(tmp_path / "best.pt")["step"] == 3
        got = {k: v for k, v in got.items() if not k.startswith("best")}
        snap = {k: v for k, v in snap.items() if not k.startswith("best")}
    assert got == snap  # same files, same bytes: no new name, no temp, best unchanged
    assert c.latest() == tmp_path / "step_000000002.pt"
    monkeypatch.undo()
    c.save(small_state(3), 3, metrics={"iou": 0.9})  # and the next save works
    c.close()
    assert ck.load(tmp_path / "best.pt")["step"] == 3 and len(c.list()) == 2


def test_read_only_folder(tmp_path):
    c = Checkpointer(tmp_path, keep_last=2)
    c.save(small_state(1), 1)
    c.wait()
    snap = dir_snapshot(tmp_path)
    os.chmod(tmp_path, 0o500)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (the monkeypatch tests cover it)")
        with pytest.raises(CheckpointError) as ei:
            c.save(small_state(2), 2)
            c.wait()
        msg = one_line(ei.value)
        assert "step_000000002.pt" in msg and "Permission denied" in msg and "intact" in msg
    finally:
        os.chmod(tmp_path, 0o700)
    assert dir_snapshot(tmp_path) == snap


# --------------------------------------------------------------------------------------------------
# kill -9 in the middle of a write

CHILD = """
import sys
import torch
from wm.checkpoint.checkpointer import Checkpointer

c = Checkpointer(sys.argv[1], keep_last=5)
for step in range(1, 6):
    print("writing", step, flush=True)
    c.save({"step": step, "x": torch.full((%d,), float(step))}, step)
    c.wait()
print("done", flush=True)
"""
N_KILL = 12_000_000  # 48 MB of float32


def test_kill_9_mid_write_leaves_only_complete_checkpoints(tmp_path):
    folder = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(CHILD % N_KILL)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        seen = 0
        for line in proc.stdout:  # the 2nd "writing": step 1 is complete, step 2 about to be written
            if line.startswith("writing"):
                seen += 1
                if seen == 2:
                    break
        assert seen == 2, "child exited early"
        tmp = folder / f".step_000000002.pt.tmp-{proc.pid}"
        final = folder / "step_000000002.pt"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # kill as soon as the write has begun
            try:
                if tmp.stat().st_size > 0 or final.exists():
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.0002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    left = temps(folder)
    assert left == [tmp.name], f"the kill did not land mid-write: {sorted(os.listdir(folder))}"
    steps = [p for p in ck.list_checkpoints(folder)]
    assert steps and steps[0].name == "step_000000001.pt"
    for p in steps:  # every file under a checkpoint name is complete and holds what was saved
        s = torch.load(p, weights_only=True)
        step = int(p.name[5:14])
        assert s["step"] == step and s["x"].shape == (N_KILL,)
        assert torch.equal(s["x"], torch.full((N_KILL,), float(step)))
    latest = ck.latest_checkpoint(folder)
    assert latest is not None and latest in steps
    assert ck.load(latest)["step"] == int(latest.name[5:14])

    c = Checkpointer(folder, keep_last=5)  # a restarted run cleans the stale temp file
    assert temps(folder) == []
    assert c.latest() == latest


@pytest.mark.cuda
def test_cuda_state_copied_through_pinned_memory_without_aliasing(tmp_path, monkeypatch):
    dev = torch.device("cuda")
    model = nn.Linear(256, 256).to(dev)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device=dev)).sum().backward()
    opt.step()
    before = {k: v.cpu() for k, v in model.state_dict().items()}
    gate = threading.Event()
    real_save = torch.save
    seen = {}

    def gated_save(obj, f, *a, **kw):
        seen["device"] = obj["model"]["weight"].device.type
        seen["pinned"] = obj["model"]["weight"].is_pinned()
        assert gate.wait(10)
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", gated_save)
    c = Checkpointer(tmp_path)
    c.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": ck.rng_state()}, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    gate.set()
    c.close()
    assert seen == {"device": "cpu", "pinned": True}
    loaded = ck.load(c.latest())
    for k, v in before.items():
        assert torch.equal(loaded["model"][k], v), k
    ck.set_rng_state(loaded["rng"])
