"""Own recordings at other grids, rates and unit conventions (tools/convert_frames.py): --crop / --pad
to a grid the model takes, the warning when a grid will not train, per-drive timestamp units, yaw in
degrees, range against grid x voxel size, and class colours in classes.json.

Recordings are written in tmp_path in the documented layout; what the converter wrote is read back
and compared with the source arrays cut or padded by hand (numpy slicing, not the converter's code).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wm.data.convert.frames import frames_scenes
from wm.data.convert.recording_checks import TIME_UNITS, UNITS, plan_fit, time_unit_outliers
from wm.data.shards import Shard, load_manifest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["free", "apron", "aircraft", "tug", "person"]  # free = 0: not the last class


def cli(*args):
    return subprocess.run([sys.executable, "tools/convert_frames.py", *map(str, args), "--quiet", "--workers", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def error_line(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def recordings(root: Path, grid=(10, 6, 3), drives=("d1", "d2", "d3"), n=6, hz=10.0, units=None,
               yaw_deg=False, masks=True, seed=0, t0=1000.0) -> dict:
    """Drives of `n` frames at `hz`, poses as x,y,z,yaw CSV (d1, d3) and JSON (d2); a gentle left
    turn (0.3 rad/s). units: {drive: seconds per timestamp unit} to write some drive in ms; t0: the
    first drive's start in seconds (1.533e9: a Unix time, as real logs write)."""
    rng = np.random.default_rng(seed)
    truth = {}
    for k, name in enumerate(drives):
        d = root / name
        d.mkdir(parents=True)
        occ = rng.integers(0, len(NAMES), (n, *grid)).astype(np.uint8)
        vis = rng.integers(0, 2, (n, *grid)).astype(np.uint8)
        t = t0 + k * 100 + np.arange(n) / hz
        yaw = 0.5 + 0.3 * np.arange(n) / hz
        for i in range(n):
            np.save(d / f"{i:06d}.npy", occ[i])
            if masks:
                np.save(d / f"{i:06d}.mask.npy", vis[i])
        ts = t / (units or {}).get(name, 1.0)
        y = np.degrees(yaw) if yaw_deg else yaw
        if name == "d2":
            (d / "poses.json").write_text(json.dumps(
                [{"timestamp": float(ts[i]), "frame": f"{i:06d}", "x": 2.0 * i, "y": 0.0, "z": 0.0, "yaw": float(y[i])}
                 for i in range(n)]))
        else:
            rows = [f"{float(ts[i])!r},{2.0 * i!r},0.0,0.0,{float(y[i])!r}" for i in range(n)]
            (d / "poses.csv").write_text("timestamp,x,y,z,yaw\n" + "\n".join(rows) + "\n")
        truth[name] = {"occ": occ, "vis": vis, "yaw": yaw}
    return truth


def read_back(out: Path) -> dict:
    m = load_manifest(out)
    got = {}
    for e in m.shards:
        sh = Shard(out, e, m.info)
        for i, name in enumerate(sh.scene_names):
            a, b = int(sh.scene_offsets[i]), int(sh.scene_offsets[i + 1])
            got[name] = {"occ": sh.read("occ", a, b), "pose": sh.read("pose", a, b),
                         "mask": sh.read("mask", a, b) if m.info.has_mask else None}
    return got


def classes_json(path: Path, **extra) -> Path:
    path.write_text(json.dumps({"class_names": NAMES, "free_class": "free", "voxel_size": 1.0, **extra}))
    return path


# ---------------------------------------------------------------------------------------------
# grids: the warning, --crop, --pad


def test_odd_grid_warns_at_conversion_with_both_remedies(tmp_path):
    recordings(tmp_path / "rec")
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
            classes_json(tmp_path / "c.json"), "--val-scenes", "d3")
    assert p.returncode == 0, p.stderr
    warn = [ln for ln in p.stdout.splitlines() if ln.startswith("warning: grid")]
    assert warn == ["warning: grid 10 x 6 x 3: X=10 and Y=6 are not multiples of 4: the default 2-level tokenizer "
                    "(the demo's tokenizer.widths) takes them, a 3-level one (OccWorld's, configs/occworld*.json) "
                    "refuses them (it halves X and Y twice); for 3 levels convert with --crop (8 x 4 x 3) or "
                    "--pad (12 x 8 x 3)"], p.stdout


def test_grid_note_states_the_constraint_of_each_tokenizer():
    from wm.config.sections import Config
    from wm.config.loading import load
    from wm.data.convert.recording_checks import grid_note

    # what the note says of the tokenizers is what they are
    assert Config().tokenizer.downsample == 2 and load(ROOT / "configs/occworld.json").tokenizer.downsample == 4
    assert grid_note((96, 64, 10)) is None
    assert grid_note((98, 64, 10)) == (
        "grid 98 x 64 x 10: X=98 is not a multiple of 4: the default 2-level tokenizer (the demo's tokenizer.widths) "
        "takes it, a 3-level one (OccWorld's, configs/occworld*.json) refuses it (it halves X and Y twice); for 3 "
        "levels convert with --crop (96 x 64 x 10) or --pad (100 x 64 x 10)")
    assert grid_note((97, 64, 10)) == (
        "grid 97 x 64 x 10: X=97 is not a multiple of 2, which every tokenizer refuses (the default 2-level one "
        "halves X and Y once, OccWorld's 3 levels twice); convert with --crop (96 x 64 x 10) or --pad (100 x 64 x 10)")


def test_crop_keeps_the_ego_centred_and_moves_the_range(tmp_path):
    truth = recordings(tmp_path / "rec")
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
            classes_json(tmp_path / "c.json"), "--val-scenes", "d3", "--crop")
    assert p.returncode == 0, p.stderr
    assert "warning: grid" not in p.stdout and "--crop: grid 10 x 6 x 3 -> 8 x 4 x 3" in p.stdout
    m = load_manifest(tmp_path / "out")
    # default range: the grid centred on the ego, 1 m voxels: x [-5, 5], y [-3, 3]; the ego sits
    # between cells 4|5 and 2|3, so an 8 x 4 cut keeps cells 1..8 and 1..4
    assert m.info.grid == (8, 4, 3) and m.info.range == (-4.0, -2.0, -1.0, 4.0, 2.0, 2.0)
    got = read_back(tmp_path / "out")
    for name, t in truth.items():
        np.testing.assert_array_equal(got[name]["occ"], t["occ"][:, 1:9, 1:5])
        np.testing.assert_array_equal(got[name]["mask"], t["vis"][:, 1:9, 1:5])


def test_pad_adds_free_invisible_voxels_around_the_ego(tmp_path):
    truth = recordings(tmp_path / "rec")
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
            classes_json(tmp_path / "c.json"), "--val-scenes", "d3", "--pad")
    assert p.returncode == 0, p.stderr
    m = load_manifest(tmp_path / "out")
    assert m.info.grid == (12, 8, 3) and m.info.range == (-6.0, -4.0, -1.0, 6.0, 4.0, 2.0)
    got = read_back(tmp_path / "out")
    for name, t in truth.items():
        want = np.zeros((len(t["occ"]), 12, 8, 3), np.uint8)  # free is class 0 here
        want[:, 1:11, 1:7] = t["occ"]
        vis = np.zeros_like(want)
        vis[:, 1:11, 1:7] = t["vis"]
        np.testing.assert_array_equal(got[name]["occ"], want)
        np.testing.assert_array_equal(got[name]["mask"], vis)


def test_crop_follows_an_off_centre_ego_and_explicit_sizes(tmp_path):
    truth = recordings(tmp_path / "rec", masks=False)
    # the ego 2 m from the grid's low x edge (a forward-looking grid): a cut of 4 x 4 around it
    cj = classes_json(tmp_path / "c.json", range=[-2, -3, -1, 8, 3, 2])
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json", cj, "--val-scenes", "d3",
            "--crop", 4, 4)
    assert p.returncode == 0, p.stderr
    m = load_manifest(tmp_path / "out")
    assert m.info.grid == (4, 4, 3) and m.info.range == (-2.0, -2.0, -1.0, 2.0, 2.0, 2.0)
    np.testing.assert_array_equal(read_back(tmp_path / "out")["d1"]["occ"], truth["d1"]["occ"][:, 0:4, 1:5])
    # the same cut at the high edge of x
    plan = plan_fit((10, 6, 3), (1, 1, 1), [-2, -3, -1, 8, 3, 2], "crop", (4, 4), align="high")
    assert plan["start"] == [6, 2] and plan["range"][:2] == [4.0, -1.0]
    # a size that is not a crop is one line
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "o2", "--classes-json", cj,
                          "--crop", 12, 4))
    assert "--crop 12 4" in line and "shrink" in line


# ---------------------------------------------------------------------------------------------
# timing and geometry checks


def test_a_drive_in_milliseconds_is_an_error_naming_it(tmp_path):
    recordings(tmp_path / "rec", units={"d2": 1e-3})
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
                          classes_json(tmp_path / "c.json")))
    assert "d2" in line and "poses.json" in line and "x1000" in line and "milliseconds" in line, line
    assert not (tmp_path / "out" / "manifest.json").exists()
    # --skip-bad converts the others, at their 10 Hz
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json", classes_json(tmp_path / "c.json"),
            "--val-scenes", "d3", "--skip-bad", "--pad")
    assert p.returncode == 0, p.stderr
    assert sorted(read_back(tmp_path / "out")) == ["d1", "d3"] and load_manifest(tmp_path / "out").info.frame_rate_hz == 10


@pytest.mark.parametrize("drives_in_us", [("d1", "d2", "d3"), ("d2",)])
def test_microsecond_unix_timestamps_read_as_seconds_are_one_line_naming_the_unit(tmp_path, drives_in_us):
    """Unix times in microseconds read as seconds do not fit int64 microseconds: one line naming the
    drive's poses file and --time-unit us, every drive or one drive alike."""
    recordings(tmp_path / "rec", t0=1.533e9, units={d: 1e-6 for d in drives_in_us})
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
                          classes_json(tmp_path / "c.json"), "--pad"))
    first = drives_in_us[0]  # the first drive that fails is named (d1: poses.csv, d2: poses.json)
    assert f"{first}/poses.{'json' if first == 'd2' else 'csv'}" in line and f"scene {first!r}" in line, line
    assert "look like microseconds" in line and "--time-unit us" in line, line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_milliseconds_in_every_drive_are_refused_naming_the_unit(tmp_path):
    """Every drive in milliseconds read as seconds: 100 s frame intervals (0.01 Hz) are no sensor log."""
    recordings(tmp_path / "rec", t0=1.533e9, units={d: 1e-3 for d in ("d1", "d2", "d3")})
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
                          classes_json(tmp_path / "c.json"), "--pad"))
    assert "d1" in line and "poses.csv" in line and "median frame interval 100 s (0.01 Hz)" in line, line
    assert "0.5-100 Hz" in line and "look like milliseconds" in line and "--time-unit ms" in line, line
    # with frame_rate_hz 10 in classes.json the stored timestamps would be 1000x too large: refused too
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
                          classes_json(tmp_path / "c.json", frame_rate_hz=10), "--pad"))
    assert "c.json: frame_rate_hz 10" in line and "0.01 Hz" in line and "--time-unit ms" in line, line
    # read as milliseconds, they convert at 10 Hz, with or without the given rate
    for extra in ({}, {"frame_rate_hz": 10}):
        p = cli("--root", tmp_path / "rec", "--out", tmp_path / f"ok{len(extra)}", "--classes-json",
                classes_json(tmp_path / "c.json", **extra), "--pad", "--time-unit", "ms")
        assert p.returncode == 0, p.stderr
        assert load_manifest(tmp_path / f"ok{len(extra)}").info.frame_rate_hz == 10


def test_a_given_frame_rate_that_the_timestamps_contradict_is_one_line(tmp_path):
    recordings(tmp_path / "rec")  # 10 Hz in seconds
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
                          classes_json(tmp_path / "c.json", frame_rate_hz=2), "--pad"))
    assert "c.json: frame_rate_hz 2" in line and "0.1 s (10 Hz)" in line, line
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
                          classes_json(tmp_path / "c.json"), "--pad", "--frame-rate", "12"))
    assert line.startswith("error: --frame-rate 12") and "(10 Hz)" in line, line


def test_time_unit_reference_is_the_plausible_rate_between_two_drives(tmp_path):
    recordings(tmp_path / "rec", drives=("a", "b"), units={"a": 1e-6})  # a in microseconds, b in seconds
    _, specs, bad = frames_scenes(tmp_path / "rec", val_fraction=0)
    assert bad == []
    out = time_unit_outliers(specs, "s")
    assert [o["scene"] for o in out] == ["a"] and "microseconds" in out[0]["error"]
    assert time_unit_outliers({"b": specs["b"]}, "s") == []
    assert list(UNITS) == list(TIME_UNITS)  # the same units in the same order


def test_yaw_in_degrees_warns_and_yaw_units_deg_reads_it(tmp_path):
    truth = recordings(tmp_path / "rec", yaw_deg=True, masks=False)
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "o1", "--classes-json", classes_json(tmp_path / "c.json"),
            "--pad")
    assert p.returncode == 0, p.stderr
    assert "warning: yaw looks like degrees in 3 of 3 scenes" in p.stdout and "--yaw-units deg" in p.stdout
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "o2", "--classes-json", classes_json(tmp_path / "c.json"),
            "--pad", "--yaw-units", "deg")
    assert p.returncode == 0 and "warning" not in p.stdout, p.stdout
    pose = read_back(tmp_path / "o2")["d1"]["pose"]
    yaw = truth["d1"]["yaw"]
    np.testing.assert_allclose(pose[:, 0, 0], np.cos(yaw), atol=1e-12)
    np.testing.assert_allclose(pose[:, 1, 0], np.sin(yaw), atol=1e-12)
    # the same drives in radians: no warning
    recordings(tmp_path / "rad", masks=False)
    p = cli("--root", tmp_path / "rad", "--out", tmp_path / "o3", "--classes-json", classes_json(tmp_path / "c.json"),
            "--pad")
    assert p.returncode == 0 and "warning" not in p.stdout, p.stdout


def test_range_that_disagrees_with_grid_and_voxels_is_one_line(tmp_path):
    recordings(tmp_path / "rec")
    cj = classes_json(tmp_path / "c.json", range=[-40, -40, -1, 40, 40, 2])
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json", cj))
    assert "c.json" in line and "spans 80 x 80 x 3 m" in line and "spans 10 x 6 x 3 m" in line, line


def test_class_colours_from_classes_json_reach_the_manifest(tmp_path):
    recordings(tmp_path / "rec", masks=False)
    cj = classes_json(tmp_path / "c.json", colors={"aircraft": "#102030", "tug": [1, 2, 3]})
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json", cj, "--pad")
    assert p.returncode == 0, p.stderr
    assert load_manifest(tmp_path / "out").info.class_colors == {"aircraft": [16, 32, 48], "tug": [1, 2, 3]}
    bad = classes_json(tmp_path / "b.json", colors={"plane": [1, 2, 3]})
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "o2", "--classes-json", bad))
    assert "b.json: colors" in line and "'plane'" in line
    bad = classes_json(tmp_path / "b.json", colors={"tug": [1, 2, 300]})
    assert "[r, g, b]" in error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "o2", "--classes-json", bad))


def test_data_sets_without_colours_keep_their_manifest_and_fingerprint(tmp_path):
    """class_colors is left out of manifest.json when empty: existing fingerprints do not move."""
    recordings(tmp_path / "rec", masks=False)
    assert cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json",
               classes_json(tmp_path / "c.json"), "--pad").returncode == 0
    d = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "class_colors" not in d
    assert math.isclose(d["frame_rate_hz"], 10.0)


def test_frame_rate_is_the_nominal_rate_despite_clock_jitter():
    from wm.data.convert.frames import median_rate
    from wm.data.convert.scene import SceneSpec

    def spec(step_us, n=20, jitter=0):
        ts = np.cumsum(np.r_[0, np.full(n - 1, step_us)]) + np.random.default_rng(0).integers(-jitter, jitter + 1, n)
        return SceneSpec("s", "train", [], [], ts.astype(np.int64), np.zeros((n, 4, 4)), "frames")

    assert median_rate([spec(99_990)]) == 10.0  # 10.001 Hz of clock jitter is a 10 Hz log
    assert median_rate([spec(100_000, jitter=300)]) == 10.0
    assert median_rate([spec(500_000)]) == 2.0 and median_rate([spec(80_000)]) == 12.5
    assert median_rate([spec(1_999_000)]) == 0.5
    assert median_rate([spec(97_000)]) == 10.309 and median_rate([spec(80_300)]) == 12.453  # rates of their own


def test_moving_classes_from_classes_json_reach_the_manifest(tmp_path):
    recordings(tmp_path / "rec", masks=False)
    cj = classes_json(tmp_path / "c.json", moving_classes=["aircraft", "tug", "person"])
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes-json", cj, "--pad")
    assert p.returncode == 0, p.stderr
    assert "moving classes: aircraft, tug, person" in p.stdout and "note: no moving classes" not in p.stdout
    assert load_manifest(tmp_path / "out").info.moving_classes == ("aircraft", "tug", "person")
    # --classes takes them as --moving-classes
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "o2", "--classes", ",".join(NAMES), "--free", "free",
            "--voxel-size", 1, "--pad", "--moving-classes", "tug,person")
    assert p.returncode == 0, p.stderr
    assert load_manifest(tmp_path / "o2").info.moving_classes == ("tug", "person")
    # none declared for names that are not nuScenes': said at conversion, what to add
    p = cli("--root", tmp_path / "rec", "--out", tmp_path / "o3", "--classes-json", classes_json(tmp_path / "n.json"),
            "--pad")
    assert p.returncode == 0, p.stderr
    note = [ln for ln in p.stdout.splitlines() if ln.startswith("note: no moving classes")]
    assert len(note) == 1 and '"moving_classes"' in note[0] and "n.json" in note[0], p.stdout
    assert "moving_classes" not in json.loads((tmp_path / "o3" / "manifest.json").read_text())
    # a name that is not a class: one line
    bad = classes_json(tmp_path / "b.json", moving_classes=["plane"])
    line = error_line(cli("--root", tmp_path / "rec", "--out", tmp_path / "o4", "--classes-json", bad, "--pad"))
    assert "b.json: moving_classes: 'plane' is not one of the classes" in line, line
