"""A data error raised inside a DataLoader worker reaches the user as the one line it would be in the
main process, the workers are ended, and the trainer exits at once (wm.data.windows.Batches, wm.data.windows's exit
handler); a bug in a worker keeps its traceback. Every case runs with loader.num_workers=2."""

import contextlib
import multiprocessing
import os
import signal
import sys
import time

import h5py
import numpy as np
import pytest

# the tiny shards are zstd: h5py edits them through the plugin (requirements.txt; a bare GPU host may lack it)
pytest.importorskip("hdf5plugin")

from wm.config.runtime import LoaderConfig
from wm.config.sections import DataConfig
from wm.data.synthetic.generate import write_synthetic
from wm.data.windows import OccWindows, ResumableSampler, make_loader, start_workers
from wm.utils.errors import ConfigError, DataError

from helpers import flip_chunk  # noqa: E402

GRID = (16, 16, 4)
HANG = 60  # seconds; every case here ends in a few


@contextlib.contextmanager
def deadline(seconds: float = HANG):
    """Fail (instead of waiting forever) when the block has not ended within `seconds`."""
    def hung(*_):
        raise AssertionError(f"still running after {seconds}s: hung")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def live_workers() -> list:
    """This process's DataLoader workers still running (the only daemonic children these tests start)."""
    return [p for p in multiprocessing.active_children() if p.daemon]


def data_set(root, kind="memmap", train_scenes=2, scenes_per_shard=8):
    write_synthetic(root, train_scenes=train_scenes, val_scenes=1, frames=12, grid=GRID, kind=kind,
                    scenes_per_shard=scenes_per_shard)
    return root


def windows(root) -> OccWindows:
    return OccWindows(root, "train", DataConfig(grid=GRID, past=2, future=1))


def batches(ds):
    """Training's iterator over `ds` in window order: 2 workers, 2 batches ahead each."""
    loader = make_loader(ds, ResumableSampler(len(ds), shuffle=False), LoaderConfig(num_workers=2, prefetch_factor=2), 2)
    return start_workers(loader)


def drawn_error(it, exc=DataError):
    """Draw batches until the error; it must be `exc` itself (not a wrapper), its line alone, with
    the workers ended when it arrives."""
    with deadline(), pytest.raises(Exception) as e:
        for _ in it:
            pass
    assert type(e.value) is exc, f"{type(e.value).__name__}: {e.value}"
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg and "DataLoader worker" not in msg, msg
    assert e.value.__suppress_context__, "raised from None: no chained traceback"
    assert live_workers() == [], "the workers outlived the error"
    return msg


def poke_class(shard, frame, value: int = 200) -> None:
    """An out-of-range class id at one voxel of `frame` (an index or a slice; memmap or HDF5 shard)."""
    if shard.suffix == ".mm":
        a = np.load(shard / "occ.npy", mmap_mode="r+")
        a[frame, 0, 0, 0] = value
        a.flush()
    else:
        with h5py.File(shard, "r+") as f:
            f["occ"][frame, 0, 0, 0] = value


# ---------------------------------------------------------------------------------------------
# in process: each data error path through the workers


def test_class_id_out_of_range_in_a_worker_is_the_main_process_line(tmp_path):
    root = data_set(tmp_path / "d")
    shard = root / "train-00000.mm"
    poke_class(shard, 7)
    ds = windows(root)
    first_bad = next(i for i in range(len(ds)) if ds.locate(i)[1] <= 7 < ds.locate(i)[2])
    with pytest.raises(DataError) as main:
        ds[first_bad]
    msg = drawn_error(batches(ds))
    assert msg == str(main.value)  # the very line the main process says
    assert str(shard) in msg and "class id 200" in msg, msg


def test_frame_shape_changed_after_open_is_named_in_the_worker(tmp_path):
    root = data_set(tmp_path / "d")
    shard = root / "train-00000.mm"
    ds = windows(root)  # checked at open: 16x16x4 frames
    n = np.load(shard / "occ.npy", mmap_mode="r").shape[0]
    np.save(shard / "occ.npy", np.zeros((n, 16, 16, 2), np.uint8))  # replaced while in use
    msg = drawn_error(batches(ds))
    assert str(shard) in msg and "'occ'" in msg and "(24, 16, 16, 2)" in msg and "(24, 16, 16, 4)" in msg, msg


def test_damaged_hdf5_chunk_read_by_a_worker_names_shard_field_and_frame(tmp_path):
    root = data_set(tmp_path / "d", kind="hdf5")
    shard = root / "train-00000.h5"
    flip_chunk(shard, "occ", 9)
    msg = drawn_error(batches(windows(root)))
    assert str(shard) in msg and "'occ'" in msg and "frame 9" in msg and "checksum" in msg, msg


@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_shard_deleted_after_the_first_batch_is_named_by_the_worker(tmp_path, kind):
    root = data_set(tmp_path / "d", kind=kind, scenes_per_shard=1)  # train-00000 and train-00001
    ds = windows(root)  # 10 windows a shard: batches 0-4 read train-00000 only
    it = batches(ds)
    with deadline():
        next(it)  # workers started and reading; the 4 batches they read ahead are all of train-00000
    gone = root / ("train-00001" + (".mm" if kind == "memmap" else ".h5"))
    if gone.is_dir():
        for f in gone.iterdir():
            f.unlink()
        gone.rmdir()
    else:
        gone.unlink()
    msg = drawn_error(it)
    assert str(gone) in msg and "is gone" in msg, msg


def test_non_finite_pose_is_refused_at_open_and_cannot_reach_a_worker(tmp_path):
    root = data_set(tmp_path / "d")
    pose = root / "train-00000.mm" / "pose.npy"
    a = np.load(pose, mmap_mode="r+")
    ds = windows(root)  # opened (and checked) before the pose goes bad
    a[3, 0, 3] = np.nan
    a.flush()
    with deadline():
        motions = [b["motion"] for b in batches(ds)]  # the workers read the poses checked at open
    assert len(motions) == len(ds) // 2 and all(m.isfinite().all() for m in motions)
    with pytest.raises(DataError) as e:  # a new open (training's, before its workers start) refuses the shard
        windows(root)
    assert str(e.value) == f"shard {root / 'train-00000.mm'}: field 'pose' is not finite at frame 3"


def test_a_config_error_in_a_worker_is_rebuilt_although_torch_cannot_construct_it(tmp_path, monkeypatch):
    # ConfigError takes (key, msg): torch re-raises it as a RuntimeError with the worker's traceback
    def refuse(self, i):
        raise ConfigError("data.stride", "3 is not allowed here")

    monkeypatch.setattr(OccWindows, "__getitem__", refuse)
    msg = drawn_error(batches(windows(data_set(tmp_path / "d"))), ConfigError)
    assert msg == "config key 'data.stride': 3 is not allowed here"


def test_a_bug_in_a_worker_keeps_its_traceback(tmp_path, monkeypatch):
    def bug(self, i):
        return 1 // 0

    monkeypatch.setattr(OccWindows, "__getitem__", bug)
    it = batches(windows(data_set(tmp_path / "d")))
    with deadline(), pytest.raises(ZeroDivisionError) as e:
        next(it)
    assert "Caught ZeroDivisionError in DataLoader worker process" in str(e.value)
    assert "Original Traceback" in str(e.value) and "return 1 // 0" in str(e.value)  # the worker's own frame
    assert live_workers() == []


# ---------------------------------------------------------------------------------------------
# end to end: train.py's one line, exit status 2, no traceback, no hang


def finished(p, timeout: float = HANG) -> tuple[int, str]:
    """Exit status and output of a train.py process that must end by itself, its workers with it."""
    rc = p.finish(timeout)  # kills the group and fails if it does not end
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):  # nothing of its process group is left
        os.killpg(p.pid, 0)
    return rc, p.output


def test_train_py_class_id_out_of_range_with_two_workers_is_one_line_and_exits(tiny):
    shard = tiny.data / "train-00000.h5"
    poke_class(shard, slice(None))  # every frame: the first batch a worker reads fails
    rc, out = finished(tiny.spawn(loader__num_workers=2))
    assert rc == 2, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"error: shard {shard}: field 'occ' frames ") and "class id 200 >= num_classes 18" in last, out
    assert "Traceback" not in out and "DataLoader worker" not in out, out


def test_train_py_bug_in_a_worker_prints_its_traceback_and_exits(tiny):
    script = ("import sys; import wm.data.windows as D\n"
              "def bug(self, i):\n    return 1 // 0\n"
              "D.OccWindows.__getitem__ = bug\n"
              "from wm.utils.errors import run_cli; from wm.training.main import main\n"
              "run_cli(lambda: main(sys.argv[1:]))\n")
    from helpers import Proc

    rc, out = finished(Proc([sys.executable, "-c", script, *tiny.args(loader__num_workers=2)]))
    assert rc == 1, out
    assert "Traceback" in out and "Caught ZeroDivisionError in DataLoader worker process" in out, out
    assert "line 3, in bug" in out and "\nerror:" not in out, out



def test_train_py_an_error_in_the_main_process_with_workers_running_exits(tiny):
    # not from a worker: the loop fails while its workers run; the exit must not wait for them
    script = ("import sys; import wm.training.loop as L; from wm.utils.errors import WMError\n"
              "def step(*a, **kw):  # the loader's workers were started with its iterator, before\n"
              "    raise WMError('the disk is full (a test)')\n"
              "L.train_step = step\n"
              "from wm.utils.errors import run_cli; from wm.training.main import main\n"
              "run_cli(lambda: main(sys.argv[1:]))\n")
    from helpers import Proc

    rc, out = finished(Proc([sys.executable, "-c", script, *tiny.args(loader__num_workers=2)]))
    assert rc == 2 and out.strip().splitlines()[-1] == "error: the disk is full (a test)", out
    assert "Traceback" not in out, out
