"""The command-line tools, run as a user runs them: exit codes, one-line errors, files they write."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import read_png  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run(*args, check=True):
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools") / "synth"
    run("tools/make_synthetic.py", "--out", str(out), "--grid", "32", "32", "4", "--train-scenes", "3",
        "--val-scenes", "1", "--frames", "14", "--format", "mixed", "--scenes-per-shard", "2")
    return out




def test_inspect_summary_verify_and_pictures(data, tmp_path):
    p = run("tools/inspect_data.py", str(data), "--verify", "--png", str(tmp_path), "--window", "2",
            "--past", "3", "--future", "2")
    assert "32 x 32 x 4" in p.stdout and "verify: 3/3 shards match" in p.stdout
    lines = {ln.split()[0]: ln.split() for ln in p.stdout.splitlines() if ln.startswith(("train ", "val "))}
    assert lines["train"][1:5] == ["2", "hdf5,memmap", "3", "42"] and lines["val"][3:5] == ["1", "14"]
    assert "driveable_surface" in p.stdout
    frame = read_png(tmp_path / "frame.png")
    assert frame.shape[1] == 256 and frame.shape[0] > 256  # 32 voxels x 8 px, the legend under it
    window = read_png(tmp_path / "window.png")
    assert window.shape[1] > 5 * 256  # 5 panels and the past|future gap
    # the picture is the window's last past frame, in the Occ3D colours, 8 px per voxel
    from wm.config.sections import DataConfig
    from wm.data.windows import OccWindows
    from wm.data.viz import bev

    from wm.data.stats import NUSCENES_MOVING
    from wm.data.shards import OCC3D_CLASSES

    ds = OccWindows(data, "train", DataConfig(grid=(32, 32, 4), past=3, future=2))
    moving = [OCC3D_CLASSES.index(n) for n in NUSCENES_MOVING]  # drawn over what is above them, as in training
    assert np.array_equal(frame[:256], bev(ds[2]["occ"][2].numpy(), 18, 17, prefer=moving).repeat(8, 0).repeat(8, 1))


def test_pictures_of_scenes_shorter_than_the_window_draw_what_fits(data, tmp_path):
    # the default 5 past + 6 future frames at stride 2 span 21 frames; the val scene has 14, which hold
    # 7 frames at stride 2: drawn as 3 past + 4 future, said in a note
    p = run("tools/inspect_data.py", str(data), "--png", str(tmp_path), "--split", "val", "--stride", "2", check=False)
    assert p.returncode == 0, p.stderr
    assert ("note: split 'val' has scenes of at most 14 frames, fewer than the 21 that 5 past + 6 future frames at "
            "stride 2 span; drawing 3 past + 4 future (--past, --future, --stride choose)") in p.stdout, p.stdout
    assert "driveable_surface" in p.stdout  # the statistics too
    window = read_png(tmp_path / "window.png")
    assert 7 * 256 < window.shape[1] < 8 * 256 and read_png(tmp_path / "frame.png").shape[1] == 256
    # a stride that leaves not even two frames is the user's to change: one line, before the statistics
    p = run("tools/inspect_data.py", str(data), "--png", str(tmp_path / "x"), "--split", "val", "--stride", "14",
            check=False)
    assert p.returncode == 2 and "--stride 14" in p.stderr and "driveable_surface" not in p.stdout, p.stdout


def test_verify_names_a_corrupt_shard_and_exits_1(data, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    shard = bad / "train-00000.h5"
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0xFF
    shard.write_bytes(bytes(b))
    p = run("tools/inspect_data.py", str(bad), "--verify", "--sample", "1", check=False)
    assert p.returncode == 1
    assert "CORRUPT" in p.stdout and "train-00000.h5" in p.stdout and "verify: 2/3" in p.stdout


def test_errors_are_one_line_and_nothing_is_written_over(data, tmp_path):
    p = run("tools/inspect_data.py", str(tmp_path / "nope"), check=False)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "nope" in p.stderr and "does not exist" in p.stderr
    before = (data / "manifest.json").read_bytes()
    p = run("tools/make_synthetic.py", "--out", str(data), "--grid", "32", "32", "4", check=False)
    assert p.returncode == 2 and "already holds a data set" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error:")
    assert (data / "manifest.json").read_bytes() == before
    p = run("tools/inspect_data.py", str(data), "--png", str(tmp_path), "--split", "test", check=False)
    assert p.returncode == 2 and "no shards in split 'test'" in p.stderr and "train, val" in p.stderr


def test_bench_data_writes_figures(tmp_path):
    out = tmp_path / "bench.json"
    p = run("tools/bench_data.py", "--grid", "16", "16", "4", "--scenes", "2", "--frames", "14",
            "--windows", "10", "--workers", "0", "--layouts", "hdf5-zstd3", "memmap", "--json", str(out))
    d = json.loads(out.read_text())
    assert set(d["layouts"]) == {"hdf5-zstd3", "memmap", "npz"}
    for r in d["layouts"].values():
        assert r["windows_per_s"] > 0 and r["bytes_per_frame"] > 0
    # memmap is raw: 16*16*4 occ + 128 pose + 8 timestamp bytes per frame, plus headers and the
    # small fields spread over 28 frames (under 100 bytes a frame)
    assert 1024 + 136 <= d["layouts"]["memmap"]["bytes_per_frame"] < 1024 + 136 + 100
    assert "memmap" in p.stdout and "npz" in p.stdout


def test_bench_data_stream_times_both_loaders(tmp_path):
    out = tmp_path / "stream.json"
    run("tools/bench_data.py", "--grid", "16", "16", "4", "--scenes", "2", "--frames", "14", "--stream", "1",
        "--stream-steps", "12", "--batch", "4", "--workers", "1", "--json", str(out))
    d = json.loads(out.read_text())["stream"]
    assert set(d) == {"endless", "restarted each epoch"}
    for r in d.values():
        assert r["steps_per_epoch"] == 7  # 28 frames in batches of 4
        assert r["epoch_first_wait_ms"] >= 0 and r["other_wait_ms"] >= 0 and 0 <= r["wait_frac"] < 1


def test_bev_can_show_moving_objects_under_a_canopy():
    from wm.data.viz import bev, palette

    occ = np.full((4, 4, 4), 17, np.uint8)
    occ[1, 2, 0] = 4  # a car...
    occ[1, 2, 3] = 16  # ...under a tree crown
    pal = palette(18, 17)
    plain, shown = bev(occ, 18, 17), bev(occ, 18, 17, prefer=[4, 7])
    # image row = 3 - y, column = x
    assert tuple(plain[1, 1]) == tuple(pal[16]) and tuple(shown[1, 1]) == tuple(pal[4])
    assert np.array_equal(np.delete(plain.reshape(16, 3), 5, 0), np.delete(shown.reshape(16, 3), 5, 0))


def test_make_synthetic_help_and_default_are_the_demos_scenes(tmp_path):
    from wm.config.sections import Config
    from wm.config.loading import load
    from wm.data.synthetic.generate import write_synthetic

    style = Config().synthetic.style  # what `python train.py` generates
    assert style == load(ROOT / "configs" / "demo.json").synthetic.style == "occ3d"
    p = run("tools/make_synthetic.py", "--help")
    text = " ".join(p.stdout.split())
    assert "(default occ3d: the demo's scenes" in text and "blocks: solid columns (the demo's" not in text, text
    # the default writes the occ3d scenes: the same data set, byte for byte, as asking for them
    small = ("--grid", "8", "8", "2", "--train-scenes", "1", "--val-scenes", "1", "--frames", "3")
    run("tools/make_synthetic.py", "--out", str(tmp_path / "a"), *small)
    m = write_synthetic(tmp_path / "b", 1, 1, 3, (8, 8, 2), style="occ3d")
    from wm.data.shards import load_manifest

    assert load_manifest(tmp_path / "a").fingerprint == m.fingerprint
