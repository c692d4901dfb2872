"""Reliability: the ten failures found by attacking a clone as a cluster and its users
would, each reproduced here, plus a kill at every instant between two renames of a save.

1 SIGTERM to the whole process group (2 DataLoader workers)   6 a torn done.json
2 a corrupted newest checkpoint (same size)                   7 two runs in one run folder (the lock)
3 a garbage / foreign file as the newest checkpoint           8 a full disk while building the token cache
4 every checkpoint corrupt: a one-line stop, no restart       9 a damaged HDF5 chunk; shard hashes recorded
5 a kill between best and latest loses the best checkpoint    10 resume with a lower lr (--allow-changed)
"""

import builtins
import errno
import io
import json
import os
import signal
import socket
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from attack import flip_tensor_bytes  # tools/attack.py: the damage the attack suite does

from wm.checkpoint.checkpointer import Checkpointer
import wm.checkpoint.files as ck
from wm.config.sections import Config
from wm.training.loop import Preemption
import wm.training.main as T
from wm.utils.errors import DataError, WMError

from helpers import assert_same, cdir, flip_chunk, stop_after  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")


def state_of(run_dir: Path, stage: str = "tokenizer") -> dict:
    return ck.load(ck.latest_checkpoint(cdir(run_dir, stage)))


def same_training_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for k in ("model", "optimizer", "scaler", "sampler", "rng"):
        assert_same(a[k], b[k], k)


@pytest.fixture(scope="module")
def straight4(tiny_factory):
    """A tiny tokenizer run of 4 steps, uninterrupted: the reference final state."""
    t = tiny_factory()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert T.main(t.args(out="straight", tokenizer_stage__max_steps=4, checkpoint__every=1)) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return t, state_of(t.run_dir("straight"))


# ---------------------------------------------------------------------------------------------
# 1. SIGTERM to the whole process group


@pytest.mark.slow
def test_1_sigterm_to_the_process_group_with_two_workers_saves_and_exits_0(tiny):
    p = tiny.spawn(tokenizer_stage__max_steps=40, loader__num_workers=2)
    assert p.wait_for(r"^tokenizer step 2/40 ", 120), p.output
    os.killpg(p.pid, signal.SIGTERM)  # what SLURM and `timeout` do: the trainer and its workers
    rc = p.finish(120)
    assert rc == 0, f"exit {rc}:\n{p.output}"
    assert "Traceback" not in p.output and "killed by signal" not in p.output, p.output
    assert "preempted (SIGTERM/SIGINT); saved step" in p.output, p.output
    st = state_of(tiny.run_dir())
    assert 2 <= st["step"] < 40


def test_1b_a_stop_read_a_step_late_saves_the_next_step_and_the_resume_is_exact(tiny, monkeypatch, capsys):
    # between logs and saves fit reads a step's flags once the next step is queued: SIGTERM during
    # step 2 is seen there, step 3 runs, is saved, and the resumed run ends where a straight one does
    over = dict(tokenizer_stage__max_steps=6, logging__every=100, checkpoint__every=100)
    assert T.main(tiny.args(out="straight", **over)) == 0
    stop_after(monkeypatch, 2)
    assert T.main(tiny.args(out="cut", **over)) == 0
    assert "tokenizer: preempted (SIGTERM/SIGINT); saved step 3." in capsys.readouterr().out
    monkeypatch.undo()
    assert T.main(tiny.args(out="cut", **over)) == 0
    assert "resumed from" in capsys.readouterr().out
    same_training_state(state_of(tiny.run_dir("straight")), state_of(tiny.run_dir("cut")))


# ---------------------------------------------------------------------------------------------
# 2-4. checkpoint integrity: checked on every load, fall back to the newest valid one


def test_2_corrupted_newest_checkpoint_is_named_skipped_and_the_resume_is_exact(straight4, monkeypatch, capsys):
    t, ref = straight4
    args = t.args(out="cut", tokenizer_stage__max_steps=4, checkpoint__every=1)
    stop_after(monkeypatch, 3)
    assert T.main(args) == 0  # steps 1, 2, 3 saved
    monkeypatch.undo()
    newest = ck.latest_checkpoint(cdir(t.run_dir("cut")))
    assert newest.name == ck.checkpoint_name(3)
    size = newest.stat().st_size
    flip_tensor_bytes(newest)  # 8 bytes, same size
    assert newest.stat().st_size == size
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_checked(newest)
    assert newest.name in str(e.value) and "sha256" in str(e.value) and "\n" not in str(e.value)
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"skipped {newest}" in out and "at step 2/4" in out, out
    same_training_state(ref, state_of(t.run_dir("cut")))


@pytest.mark.parametrize("garbage", ["same-size", "foreign-pickle"])
def test_3_garbage_newest_never_suggests_weights_only_false_and_falls_back(tiny, monkeypatch, capsys, garbage):
    args = tiny.args(tokenizer_stage__max_steps=3, checkpoint__every=1)
    stop_after(monkeypatch, 2)
    assert T.main(args) == 0  # steps 1, 2 saved
    monkeypatch.undo()
    newest = ck.latest_checkpoint(cdir(tiny.run_dir()))
    if garbage == "same-size":
        newest.write_bytes(os.urandom(newest.stat().st_size))
    else:  # a pickle of a class: torch.load(weights_only=True) refuses it with its own advice
        torch.save({"x": zipfile.ZipInfo("x")}, newest)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_checked(newest)
    msg = str(e.value)
    assert "weights_only" not in msg and newest.name in msg and "\n" not in msg, msg
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert "weights_only" not in out
    assert f"skipped {newest}" in out and "at step 1/3" in out, out


def test_4_every_checkpoint_corrupt_is_a_one_line_stop_never_a_restart(tiny, capsys):
    args = tiny.args(tokenizer_stage__max_steps=4, checkpoint__every=1)
    assert T.main(args, stop=Preemption(requested=True)) == 0  # step 1 saved
    folder = cdir(tiny.run_dir())
    files = ck.list_checkpoints(folder)
    assert files
    for f in files + [folder / "best.pt"]:
        if f.is_file():
            flip_tensor_bytes(f)
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    capsys.readouterr()
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = str(e.value)
    assert "\n" not in msg and str(folder) in msg and "no valid checkpoint" in msg, msg
    assert "step 0" not in capsys.readouterr().out
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before  # nothing rotated away


# ---------------------------------------------------------------------------------------------
# 5. a kill at every instant between two renames of a save (best, latest, rotation)


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "step": int(v)}


def _ops_of_a_save(folder: Path) -> int:
    """How many renames/links/unlinks the save of step 4 (a new best, with rotation) makes."""
    n = {"ops": 0}
    real = {k: getattr(os, k) for k in ("replace", "link", "unlink")}

    def counting(k):
        def f(*a, **kw):
            n["ops"] += 1
            return real[k](*a, **kw)
        return f

    c = Checkpointer(folder, keep_last=2, best_metric="iou", async_save=False)
    for s, v in ((1, 0.1), (2, 0.3), (3, 0.2)):
        c.save(_state(s), s, {"iou": v})
    try:
        for k in real:
            setattr(os, k, counting(k))
        c.save(_state(4), 4, {"iou": 0.9})
    finally:
        for k, f in real.items():
            setattr(os, k, f)
    return n["ops"]


def test_5_a_kill_at_every_instant_of_a_save_keeps_best_and_latest(tmp_path):
    total = _ops_of_a_save(tmp_path / "count")
    assert total >= 5
    for kill_at in range(total + 1):
        folder = tmp_path / f"k{kill_at}"
        c = Checkpointer(folder, keep_last=2, best_metric="iou", async_save=False)
        for s, v in ((1, 0.1), (2, 0.3), (3, 0.2)):
            c.save(_state(s), s, {"iou": v})
        pid = os.fork()
        if pid == 0:  # the child saves step 4 (a new best) and is killed before its kill_at-th op
            try:
                n = {"ops": 0}

                def dying(real):
                    def f(*a, **kw):
                        if n["ops"] == kill_at:
                            os._exit(9)
                        n["ops"] += 1
                        return real(*a, **kw)
                    return f

                os.replace, os.link, os.unlink = dying(os.replace), dying(os.link), dying(os.unlink)
                c.save(_state(4), 4, {"iou": 0.9})
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == (9 if kill_at < total else 0)
        # the restart: the newest valid checkpoint, and best as the loop's state says
        c = Checkpointer(folder, keep_last=2, best_metric="iou", async_save=False)
        found = ck.newest_valid(folder, say=lambda *a: None)
        assert found is not None, kill_at
        path, st = found
        assert st["step"] in (3, 4), (kill_at, path)
        if st["step"] == 3:  # step 4 was not committed: the loop replays it
            c.save(_state(4), 4, {"iou": 0.9})
        c.save(_state(5), 5, {"iou": 0.5})  # worse than step 4, better than every older one
        best = json.loads((folder / "best.json").read_text())
        assert best["step"] == 4, (kill_at, best)
        assert_same(ck.load_checked(folder / "best.pt")["model"], _state(4)["model"])
        assert ck.load_checked(ck.latest_checkpoint(folder))["step"] == 5
        assert sorted(p.name for p in ck.list_checkpoints(folder)) == [ck.checkpoint_name(4), ck.checkpoint_name(5)]


# ---------------------------------------------------------------------------------------------
# 6. done.json


def test_6_torn_done_json_does_not_break_reruns(tiny, capsys):
    args = tiny.args(tokenizer_stage__max_steps=2)
    assert T.main(args) == 0
    done = tiny.run_dir() / "tokenizer" / "done.json"
    good = json.loads(done.read_text())
    done.write_text(done.read_text()[:7])  # torn
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert str(done) in out, out
    assert json.loads(done.read_text())["step"] == good["step"] == 2


def test_6_done_json_is_written_atomically(tiny, monkeypatch):
    seen = []
    real = os.replace

    def watch(a, b, *r, **kw):
        seen.append(Path(b).name)
        return real(a, b, *r, **kw)

    monkeypatch.setattr(os, "replace", watch)
    assert T.main(tiny.args(tokenizer_stage__max_steps=1)) == 0
    assert "done.json" in seen


# ---------------------------------------------------------------------------------------------
# 7. one run per folder


@pytest.mark.slow
def test_7_second_run_in_the_same_folder_is_refused_naming_the_holder(tiny):
    p = tiny.spawn(tokenizer_stage__max_steps=400)
    try:
        assert p.wait_for(r"^tokenizer step 1/400 ", 120), p.output
        cfg_before = (tiny.run_dir() / "config.json").read_bytes()
        with pytest.raises(WMError) as e:
            T.main(tiny.args(tokenizer_stage__max_steps=400, tokenizer_stage__lr=1e-4))
        msg = str(e.value)
        assert f"pid {p.pid}" in msg and socket.gethostname() in msg and "\n" not in msg, msg
        assert (tiny.run_dir() / "config.json").read_bytes() == cfg_before
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        assert p.finish(120) == 0, p.output
    assert T.main(tiny.args(tokenizer_stage__max_steps=1) + ["--fresh"]) == 0  # the lock was released


def test_7_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tiny, capsys):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    rd = tiny.run_dir()
    rd.mkdir(parents=True)
    (rd / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead),
                                             "start": "2026-01-01T00:00:00Z"}))
    capsys.readouterr()
    assert T.main(tiny.args(tokenizer_stage__max_steps=1)) == 0
    out = capsys.readouterr().out
    assert f"pid {dead}" in out and "no longer running" in out, out
    assert (rd / "run.lock").read_text() == ""  # released


# ---------------------------------------------------------------------------------------------
# 8. a full disk while building the token cache


def test_8_full_disk_while_building_the_token_cache_is_one_line_and_leaves_nothing(tiny, monkeypatch):
    assert T.main(tiny.args(tokenizer_stage__max_steps=2)) == 0
    cache = tiny.run_dir() / "token_cache"

    real_open, real_io_open = builtins.open, io.open

    def full_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        if "token_cache" in str(file) and ("w" in mode or "+" in mode):
            def write(b, _f=f):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = write
        return f

    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)
    with pytest.raises(WMError) as e:
        T.main(tiny.args(tokenizer_stage__max_steps=2, train__stages="tokenizer,world"))
    monkeypatch.undo()
    msg = str(e.value)
    assert "token cache" in msg and "No space left" in msg and "\n" not in msg, msg
    left = [p for p in cache.rglob("*")] if cache.exists() else []
    assert not [p for p in left if p.is_file()], left


# ---------------------------------------------------------------------------------------------
# 9. data integrity


def test_9_damaged_hdf5_chunk_is_an_error_naming_shard_field_and_frame(tmp_path):
    from wm.data.shards import load_manifest, open_split
    from wm.data.synthetic.generate import write_synthetic

    write_synthetic(tmp_path / "d", train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4))
    m = load_manifest(tmp_path / "d")
    entry = m.split("train")[0]
    shard = tmp_path / "d" / entry["path"]
    flip_chunk(shard, "occ", 5)
    _, shards = open_split(tmp_path / "d", "train")
    sh = [s for s in shards if s.path == shard][0]
    sh.read("occ", 0, 4)  # other frames read fine
    with pytest.raises(DataError) as e:
        sh.read("occ", 3, 8)
    msg = str(e.value)
    assert str(shard) in msg and "'occ'" in msg and "frame 5" in msg and "\n" not in msg, msg


def test_9_the_run_records_the_shard_hashes_it_trained_on(tiny):
    from wm.data.shards import load_manifest

    assert T.main(tiny.args(tokenizer_stage__max_steps=1)) == 0
    meta = json.loads((tiny.run_dir() / "config.json").read_text())["meta"]
    want = {s["path"]: s["sha256"] for s in load_manifest(tiny.data).shards}
    assert meta["shards"] == want


def test_9_inspect_data_verify_catches_a_flipped_byte_in_a_memmap_shard(tmp_path):
    import subprocess
    import sys

    from wm.data.shards import load_manifest
    from wm.data.synthetic.generate import write_synthetic

    write_synthetic(tmp_path / "d", train_scenes=1, val_scenes=1, frames=6, grid=(16, 16, 4), kind="memmap")
    entry = load_manifest(tmp_path / "d").shards[0]
    occ = tmp_path / "d" / entry["path"] / "occ.npy"
    b = bytearray(occ.read_bytes())
    b[len(b) // 2] ^= 1
    occ.write_bytes(bytes(b))
    p = subprocess.run([sys.executable, "tools/inspect_data.py", str(tmp_path / "d"), "--verify"],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True)
    assert p.returncode != 0 and entry["path"] in p.stdout + p.stderr, p.stdout + p.stderr


# ---------------------------------------------------------------------------------------------
# 10. resume with changed hyperparameters


def test_10_resume_with_a_lower_lr_through_allow_changed_is_recorded(tiny, monkeypatch, capsys):
    args = tiny.args(tokenizer_stage__max_steps=4)
    stop_after(monkeypatch, 2)
    assert T.main(args) == 0
    monkeypatch.undo()
    lower = tiny.args(tokenizer_stage__max_steps=4, tokenizer_stage__lr=1e-4)
    with pytest.raises(WMError) as e:
        T.main(lower)
    assert "--allow-changed tokenizer_stage.lr" in str(e.value), str(e.value)
    with pytest.raises(WMError) as e:  # the data's or the model's shape: never
        T.main(tiny.args(tokenizer_stage__max_steps=4, tokenizer__codebook_size=32)
               + ["--allow-changed", "tokenizer.codebook_size"])
    assert "tokenizer.codebook_size" in str(e.value) and "--fresh" in str(e.value), str(e.value)
    capsys.readouterr()
    assert T.main(lower + ["--allow-changed", "tokenizer_stage.lr"]) == 0
    out = capsys.readouterr().out
    assert "at step 2/4" in out, out
    st = state_of(tiny.run_dir())
    assert st["step"] == 4 and st["config"]["tokenizer_stage"]["lr"] == 1e-4
    hist = json.loads((tiny.run_dir() / "config.json").read_text())["meta"]["history"]
    assert hist[-1]["changed"] == {"tokenizer_stage.lr": [Config().tokenizer_stage.lr, 1e-4]}
    assert hist[-1]["step"] == {"tokenizer": 2}


# ---------------------------------------------------------------------------------------------
# 11. a damaged token cache is rebuilt, and says so


def test_11_a_damaged_token_cache_is_named_and_rebuilt(tiny, capsys):
    args = tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2, world_stage__max_steps=1)
    assert T.main(args) == 0
    codes = next((tiny.run_dir() / "token_cache").glob("*/codes.npy"))
    good = codes.read_bytes()
    b = bytearray(good)
    b[-1] ^= 1
    codes.write_bytes(bytes(b))
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"note: the token cache {codes} is damaged (its sha256 is " in out and "meta.json records" in out, out
    assert "encoding the training frames again" in out, out
    assert codes.read_bytes() == good


def test_11_a_killed_token_cache_build_leaves_no_temporary(tiny):
    args = tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2, world_stage__max_steps=1)
    assert T.main(args) == 0
    folder = next((tiny.run_dir() / "token_cache").glob("*/codes.npy")).parent
    # what a build killed while writing the codes leaves: no meta.json, the codes' temporary
    (folder / "meta.json").unlink()
    (folder / ".codes.npy.tmp-99999999").write_bytes(b"half of the codes")
    assert T.main(args) == 0
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []
    assert (folder / "meta.json").is_file()


# ---------------------------------------------------------------------------------------------
# 12. a finished stage given more steps through --allow-changed trains them


def test_12_more_steps_for_a_finished_stage_train_them(tiny, capsys):
    def args(tok, world, *flags):
        return tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=tok,
                         world_stage__max_steps=world, tokenizer_stage__eval_every=1) + list(flags)

    assert T.main(args(2, 2)) == 0
    tok = tiny.run_dir() / "tokenizer"
    with pytest.raises(WMError) as e:
        T.main(args(4, 2))
    assert "--allow-changed tokenizer_stage.max_steps;" in str(e.value), str(e.value)
    capsys.readouterr()
    # the world stage alone: it goes on from its step 2 on the same tokenizer
    assert T.main(args(2, 3, "--allow-changed", "world_stage.max_steps")) == 0
    out = capsys.readouterr().out
    assert "world stage: finished at step 2; with world_stage.max_steps=3 it goes on" in out, out
    assert "tokenizer stage already finished at step 2" in out and "world: resumed from" in out, out
    assert "at step 2/3" in out and state_of(tiny.run_dir(), "world")["step"] == 3
    # the tokenizer: it goes on; the world stage belongs to the tokenizer it trained on, so a new
    # tokenizer best moves it aside and it starts over
    old_sha = ck.sha256_file(tok / "checkpoints" / "best.pt")
    assert T.main(args(4, 3, "--allow-changed", "tokenizer_stage.max_steps")) == 0
    out = capsys.readouterr().out
    assert "tokenizer stage: finished at step 2; with tokenizer_stage.max_steps=4 it goes on" in out, out
    assert "tokenizer: resumed from" in out and "at step 2/4" in out, out
    assert json.loads((tok / "done.json").read_text())["step"] == 4 and state_of(tiny.run_dir())["step"] == 4
    new_sha = ck.sha256_file(tok / "checkpoints" / "best.pt")
    assert new_sha != old_sha  # steps 3 and 4 validate better than step 2
    aside = sorted(tiny.run_dir().glob("world.*"))
    assert len(aside) == 1 and f"moved them to {aside[0]}: the world stage starts over" in out, out
    assert ck.load(ck.latest_checkpoint(cdir(aside[0].parent, aside[0].name)))["tokenizer"]["sha256"] == old_sha
    w = state_of(tiny.run_dir(), "world")
    assert w["tokenizer"]["sha256"] == new_sha and w["step"] == 3 and "world: resumed from" not in out
    assert T.main(args(4, 3)) == 0  # the plain command now finds both stages finished
    out = capsys.readouterr().out
    assert "tokenizer stage already finished at step 4" in out and "world stage already finished at step 3" in out
