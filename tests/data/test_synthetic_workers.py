"""wm.data.synthetic.generate's scene generation on several processes: the same bytes as on one, a worker's error
raised in the caller with nothing left behind, and no worker outliving a killed parent."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wm.data import shards as S
import wm.data.synthetic.generate as synth
from wm.utils.errors import DataError

GRID = (24, 24, 4)
ROOT = Path(__file__).resolve().parents[2]


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(c) for c in (task / "children").read_text().split()}
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("kind", ["memmap", "mixed"])
def test_two_workers_write_the_same_bytes_as_one(tmp_path, kind):
    kw = dict(train_scenes=5, val_scenes=3, frames=6, grid=GRID, seed=3, kind=kind, scenes_per_shard=2,
              style="occ3d")
    one = synth.write_synthetic(tmp_path / "one", workers=1, **kw)
    two = synth.write_synthetic(tmp_path / "two", workers=2, **kw)
    assert one.fingerprint == two.fingerprint
    a, b = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert len(two.shards) == 5 and a.keys() == b.keys()  # 3 + 2 shards
    assert a == b
    assert S.verify(tmp_path / "two") == []
    assert _children(os.getpid()) == set()  # the pool is gone


def test_large_data_sets_use_every_core_small_ones_one():
    assert synth.default_workers(synth.PARALLEL_VOXELS - 1) == 1
    cores = len(os.sched_getaffinity(0))
    assert synth.default_workers(synth.PARALLEL_VOXELS) == min(cores, 16)
    # the occworld_20min data set (72 scenes x 40 frames at 200x200x16) is large; the demo's is not
    assert synth.default_workers(72 * 40 * 200 * 200 * 16) == min(cores, 16)
    assert synth.default_workers(30 * 40 * 64 * 64 * 8) == 1


forked = pytest.mark.skipif(mp.get_start_method() != "fork", reason="the workers see a patched make_scene only when forked")


@pytest.fixture
def flag_on_sigterm():
    """A SIGTERM handler that only sets a flag, as training's (wm.training.loop.Preemption), inherited by forked
    workers: the clean-up must not rely on SIGTERM to end them."""
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    yield
    signal.signal(signal.SIGTERM, old)


@forked
def test_a_workers_error_reaches_the_caller_and_leaves_no_data_set(tmp_path, monkeypatch, flag_on_sigterm):
    real = synth.make_scene

    def bad_third(seed, index, *a):
        if index == 2:
            raise ValueError("something went wrong")
        return real(seed, index, *a)

    monkeypatch.setattr(synth, "make_scene", bad_third)
    with pytest.raises(DataError, match="synthetic scene 2: ValueError: something went wrong"):
        synth.write_synthetic(tmp_path / "ds", 4, 1, frames=3, grid=GRID, workers=2)
    assert _children(os.getpid()) == set()
    # through ensure_synthetic: the temporary folder is removed, no data set under the final name
    from wm.config.sections import SyntheticConfig

    monkeypatch.setattr(synth, "default_workers", lambda n: 2)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="synthetic scene 2"):
        synth.ensure_synthetic(SyntheticConfig(train_scenes=4, val_scenes=1, frames=3, cache_dir=str(cache)),
                               GRID, log=lambda s: None)
    assert sorted(p.name for p in cache.iterdir()) == []


@forked
def test_a_killed_worker_ends_in_one_line_not_a_hang(tmp_path, monkeypatch, flag_on_sigterm):
    real = synth.make_scene

    def killed_at_third(seed, index, *a):
        if index == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
        return real(seed, index, *a)

    monkeypatch.setattr(synth, "make_scene", killed_at_third)
    with pytest.raises(DataError) as e:
        synth.write_synthetic(tmp_path / "ds", 5, 1, frames=3, grid=GRID, workers=2)
    msg = str(e.value)
    assert "\n" not in msg and "ended without its scene" in msg and "exit code -9" in msg and "--workers 1" in msg
    assert _children(os.getpid()) == set()


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    # 200x200x16 scenes take about a second each: the kill lands while the workers generate
    code = ("import sys, wm.data.synthetic.generate as s; s.write_synthetic(sys.argv[1], 40, 0, frames=20, grid=(200, 200, 16), "
            "style='occ3d', kind='memmap', workers=2)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ds")], cwd=ROOT, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
            workers = _children(p.pid)
        assert len(workers) == 2, "the pool did not start"
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a worker outlived its killed parent"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for w in workers:  # never leave one behind, even when the test fails
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
