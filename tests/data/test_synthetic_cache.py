"""The synthetic data cache: a generation removes the temporaries that killed generations left (never
one of a live process or of another host), and a data set that does not fit this machine's memory or
disk is refused before anything is generated, in one line naming the keys."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wm.config.sections import DataConfig, SyntheticConfig
import wm.data.synthetic.generate as synth
from wm.utils.errors import ConfigError

from helpers import ROOT  # noqa: E402

GRID = (16, 16, 4)


def syn(cache: Path, **kw) -> SyntheticConfig:
    return SyntheticConfig(**{"train_scenes": 2, "val_scenes": 1, "frames": 3, "cache_dir": str(cache), **kw})


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(p.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def test_leftovers_of_dead_generations_are_removed_and_live_ones_kept(tmp_path):
    cache = tmp_path / "cache"
    dead, mine = dead_pid(), os.getpid()
    gone = cache / f".synthetic-0123456789ab.tmp-{dead}"
    live = cache / f".synthetic-0123456789ac.tmp-{mine}"  # a generation in progress (this process)
    remote = cache / f".synthetic-0123456789ad.tmp-{dead}"  # another host's, whose pid means nothing here
    for d in (gone, live, remote):
        (d / "train-00000.mm").mkdir(parents=True)
    synth.owner_file(remote).write_text(json.dumps({"host": socket.gethostname() + "-other", "pid": dead}))
    unrelated = cache / f".notes.tmp-{dead}"
    unrelated.mkdir()
    logs = []
    path = synth.ensure_synthetic(syn(cache), GRID, log=logs.append)
    assert not gone.exists() and live.is_dir() and remote.is_dir() and unrelated.is_dir()
    removed = [ln for ln in logs if ln.startswith("removed")]
    assert removed == [f"removed {gone}: left by a synthetic data generation whose process {dead} is gone"], logs
    assert (path / "manifest.json").is_file() and not synth.owner_file(synth.tmp_path(path)).exists()
    assert synth.owner_file(remote).is_file()


def test_a_generation_killed_with_sigkill_is_cleaned_up_by_the_next(tmp_path):
    cache = tmp_path / "cache"
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
              "import wm.data.synthetic.generate as S; from wm.config.sections import SyntheticConfig\n"
              "real = S.make_scene\n"
              "def slow(*a, **k):\n    s = real(*a, **k); print('scene', flush=True); time.sleep(60); return s\n"
              "S.make_scene = slow\n"
              f"S.ensure_synthetic(SyntheticConfig(train_scenes=2, val_scenes=1, frames=3, cache_dir={str(cache)!r}), "
              f"{GRID!r})\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        lines = [p.stdout.readline().strip() for _ in range(2)]  # "generating ...", then a scene made
        assert lines[1] == "scene", lines  # mid-generation: its temporary folder is there
        temps = sorted(n for n in os.listdir(cache) if n.startswith(".synthetic-"))
        assert len(temps) == 2 and temps[0].endswith(f".tmp-{p.pid}"), temps  # the folder and its owner file
        assert json.loads((cache / temps[1]).read_text()) == {"host": socket.gethostname(), "pid": p.pid}
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    logs = []
    path = synth.ensure_synthetic(syn(cache), GRID, log=logs.append)
    assert f"removed {cache / temps[0]}: left by a synthetic data generation whose process {p.pid} is gone" in logs
    assert sorted(os.listdir(cache)) == [path.name]


# ---------------------------------------------------------------------------------------------
# what a generation needs, against what the machine has


def refused(cfg, grid) -> str:
    with pytest.raises(ConfigError) as e:
        synth.ensure_synthetic(cfg, grid, log=lambda s: None)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def never_generates(monkeypatch):
    def no(*a, **k):
        raise AssertionError("generated")

    monkeypatch.setattr(synth, "write_synthetic", no)


def test_a_grid_too_large_for_any_memory_is_refused_before_generating(tmp_path, monkeypatch):
    never_generates(monkeypatch)
    grid = (2 ** 20, 2 ** 20, 1024)  # one frame alone is 1 PiB
    msg = refused(syn(tmp_path / "cache"), grid)
    total = synth.memory()[0]
    assert msg.startswith("config key 'data.grid': 1048576x1048576x1024 with synthetic.frames=3: generating one "
                          "synthetic scene needs about "), msg
    assert "PiB of host memory, this machine has " in msg and synth._size(total) in msg, msg
    assert "lower data.grid or synthetic.frames" in msg
    assert [n for n in os.listdir(tmp_path / "cache") if "synthetic" in n] == []


def test_a_data_set_too_large_for_any_disk_is_refused_before_generating(tmp_path, monkeypatch):
    never_generates(monkeypatch)
    cfg = syn(tmp_path / "cache", train_scenes=10 ** 9, val_scenes=6, frames=40, format="memmap")
    msg = refused(cfg, (64, 64, 8))  # a scene is small; a billion of them 1.3 PiB of memmap shards (masks as bits)
    assert msg.startswith("config key 'data.grid': 64x64x8 with synthetic.frames=40 x 1000000006 scenes "
                          "(synthetic.train_scenes + synthetic.val_scenes) needs 1.3 PiB of disk in "), msg
    assert f"of disk in {tmp_path / 'cache'}, which has " in msg and " free; lower them, or set synthetic.cache_dir" in msg, msg


def test_one_that_comes_close_warns_and_generates(tmp_path, monkeypatch):
    need = synth.scene_memory(GRID, 3, True, "occ3d")
    monkeypatch.setattr(synth, "memory", lambda: (4 * need, need))  # fits the machine, not half of what is free
    logs = []
    path = synth.ensure_synthetic(syn(tmp_path / "cache"), GRID, log=logs.append)
    warn = [ln for ln in logs if ln.startswith("warning:")]
    assert len(warn) == 1 and "host memory" in warn[0] and "16x16x4 with synthetic.frames=3" in warn[0], logs
    assert (path / "manifest.json").is_file()


def test_fewer_processes_where_more_scenes_at_once_do_not_fit(tmp_path, monkeypatch):
    cfg = syn(tmp_path, train_scenes=64, frames=40)
    grid = (256, 256, 16)  # past PARALLEL_VOXELS: several processes by default
    monkeypatch.setattr(synth, "default_workers", lambda n: 8)
    per = synth.scene_memory(grid, 40, True, "occ3d")
    monkeypatch.setattr(synth, "memory", lambda: (100 * per, 6 * per))
    assert synth.check_resources(cfg, grid, tmp_path, log=lambda s: None) == 3  # within half of what is free


def test_the_demo_is_not_refused(tmp_path):
    logs = []
    workers = synth.check_resources(SyntheticConfig(), DataConfig().grid, tmp_path, log=logs.append)
    assert workers >= 1 and not [ln for ln in logs if "host memory" in ln], logs


def test_generation_memory_estimate_bounds_what_a_scene_takes():
    import tracemalloc

    from wm.data.synthetic import occ3d as synthetic_occ3d

    synthetic_occ3d._rays.cache_clear()  # measured as a fresh process would build them
    tracemalloc.start()
    try:
        synth.make_scene(0, 0, (96, 96, 8), 6, True, 0, "occ3d")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    est = synth.scene_memory((96, 96, 8), 6, True, "occ3d")
    assert peak <= est <= 3 * peak, (peak, est)
