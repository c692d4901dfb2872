"""The run folder's lock and the disk it is on: a full disk is found before anything is written (one
line naming the folder, the space needed and free; no lock file left behind), and the lock belongs
to the trainer alone, so a trainer killed with kill -9 can be restarted at once even while its
DataLoader workers are still alive."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from wm.config.loading import load as load_config
import wm.training.main as T
from wm.utils import runlock
from wm.utils.errors import WMError

from helpers import cdir, stop_after  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
Usage = namedtuple("Usage", "total used free")

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")


def full_disk(monkeypatch, free: int = 0) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, (1 << 40) - free, free))


def test_a_full_disk_at_start_is_one_line_and_leaves_nothing(tiny, monkeypatch):
    full_disk(monkeypatch)
    with pytest.raises(WMError) as e:
        T.main(tiny.args())
    msg = str(e.value)
    rd = tiny.run_dir()
    assert "\n" not in msg and f"not enough space for {rd}" in msg and "needs about" in msg and "has 0 KiB free" in msg, msg
    assert not rd.exists()


def test_a_full_disk_at_resume_is_one_line_and_changes_nothing(tiny, monkeypatch):
    args = tiny.args(tokenizer_stage__max_steps=4, checkpoint__every=1)
    stop_after(monkeypatch, 2)
    assert T.main(args) == 0
    monkeypatch.undo()
    before = {p: p.read_bytes() for p in tiny.run_dir().rglob("*") if p.is_file()}
    full_disk(monkeypatch, free=100 << 10)
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = str(e.value)
    assert "\n" not in msg and "needs about" in msg and "has 100 KiB free" in msg, msg
    assert {p: p.read_bytes() for p in tiny.run_dir().rglob("*") if p.is_file()} == before


def test_the_space_asked_for_covers_the_checkpoint_written(tiny):
    from wm.checkpoint.checks import checkpoint_bytes, meta_model

    assert T.main(tiny.args(tokenizer_stage__max_steps=1)) == 0
    size = (cdir(tiny.run_dir()) / "step_000000001.pt").stat().st_size
    cfg = load_config(None, [a for a in tiny.args() if a != "--set"])
    need = checkpoint_bytes(meta_model(cfg, "tokenizer"))
    assert size <= need <= size + (2 << 20)


def test_a_failing_lock_write_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(WMError) as e:
        runlock.acquire(tmp_path / "r")
    monkeypatch.undo()
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "r" / "run.lock") in msg and "No space left" in msg, msg
    assert not (tmp_path / "r" / "run.lock").exists()
    runlock.acquire(tmp_path / "r")  # nothing held: it can be taken
    runlock.release(tmp_path / "r")


HOLD_AND_FORK = """
import os, sys, time
from wm.utils import runlock
runlock.acquire(sys.argv[1], say=lambda m: None)
if os.fork() == 0:  # a child that outlives its parent, as DataLoader workers do after kill -9
    time.sleep(30)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


def test_the_lock_is_not_held_by_forked_children_of_a_killed_owner(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(tmp_path / "r")], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "held"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        os.killpg(p.pid, 0)  # the child is still alive, in the group
        notes = []
        runlock.acquire(tmp_path / "r", say=notes.append)
        runlock.release(tmp_path / "r")
        assert notes and f"pid {p.pid}" in notes[0] and "no longer running" in notes[0], notes
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


HOLD_NAMING_ANOTHER = """
import json, os, socket, sys, time
from wm.utils import runlock
runlock.acquire(sys.argv[1], say=lambda m: None)
f = runlock._HELD[next(iter(runlock._HELD))][0]  # the file now names a process that has ended
f.seek(0); f.truncate(); f.write(json.dumps({"host": socket.gethostname(), "pid": int(sys.argv[2])})); f.flush()
print("held", flush=True)
time.sleep(60)
"""


def test_a_refusal_names_the_live_holder_never_a_dead_process(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    p = subprocess.Popen([sys.executable, "-c", HOLD_NAMING_ANOTHER, str(tmp_path / "r"), dead], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(WMError) as e:
            runlock.acquire(tmp_path / "r")
        msg = str(e.value)
        assert f"in use by pid {p.pid} on host" in msg and f"pid {dead}" not in msg and "\n" not in msg, msg
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


@pytest.mark.slow
def test_a_trainer_killed_with_workers_alive_restarts_at_once(tiny):
    first = tiny.spawn(tokenizer_stage__max_steps=400, loader__num_workers=2, checkpoint__every=1)
    try:
        assert first.wait_for(r"^tokenizer step 2/400 ", 120), first.output
        os.kill(first.pid, signal.SIGKILL)  # the trainer only: its two workers live on for a while
        assert first.p.wait(30) == -signal.SIGKILL
        os.killpg(first.pid, 0)  # the workers are still there
        second = tiny.spawn(tokenizer_stage__max_steps=400, loader__num_workers=2, checkpoint__every=1)
        try:
            assert second.wait_for(r"resumed from .* at step \d+/400", 120), second.output
            assert "in use by" not in second.output
        finally:
            second.kill_group()
            second.finish(30)
    finally:
        first.kill_group()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the first run's workers end once their trainer is gone
        try:
            os.killpg(first.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
