"""Converters of real data (wm/convert*.py, tools/convert_occ3d.py, tools/convert_frames.py).

Source trees are built in tmp_path in the exact on-disk layouts (Occ3D-nuScenes: annotations.json +
gts/<scene>/<token>/labels.npz; own recordings: <scene>/ folders with frames and a poses file), then
converted, and every frame, mask bit, pose and timestamp is compared with what was written. Poses
are checked against rotations built independently (Rodrigues' formula from the same axis-angle the
quaternions came from). Error lines are checked through the CLIs, as a user sees them.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wm.config.sections import DataConfig
from wm.data.convert.engine import convert
from wm.data.convert.frames import frames_scenes, split_scenes
from wm.data.convert.occ3d import occ3d_info, occ3d_scenes
from wm.data.shards import Shard, load_manifest, verify
from wm.data.windows import OccWindows
from wm.utils.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
G = (8, 8, 4)  # small grid for most tests; one test uses Occ3D's real 200x200x16


def cli(tool, *args):
    return subprocess.run([sys.executable, f"tools/{tool}", *map(str, args), "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def one_error_line(p) -> str:
    """The CLI failed the house way: exit 2, one line 'error: ...' on stderr, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


def rodrigues(axis, angle) -> np.ndarray:
    k = np.asarray(axis, float) / np.linalg.norm(axis)
    K = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + np.sin(angle) * K + (1 - np.cos(angle)) * K @ K


def quat(axis, angle) -> list:
    k = np.asarray(axis, float) / np.linalg.norm(axis)
    return [float(np.cos(angle / 2)), *(float(v) for v in np.sin(angle / 2) * k)]


# ---------------------------------------------------------------------------------------------
# Occ3D-nuScenes source trees


def make_occ3d(root: Path, scenes, grid=G, seed=0, end="EOF", shuffle=True) -> dict:
    """Occ3D layout in `root`; scenes: [(name, split, frames)]. Returns the truth per scene."""
    rng = np.random.default_rng(seed)
    ann = {"train_split": [], "val_split": [], "scene_infos": {}}
    truth = {}
    for si, (name, split, n) in enumerate(scenes):
        toks = [hashlib.md5(f"{name}/{i}".encode()).hexdigest() for i in range(n)]
        ts = 1531883530_000000 + si * 10**8 + np.arange(n) * 500_000 + rng.integers(0, 999, n)
        sem = rng.integers(0, 18, (n, *grid)).astype(np.uint8)
        sem[:, :, :, -1] = 17  # some free
        cam = rng.integers(0, 2, (n, *grid)).astype(np.uint8)
        lid = rng.integers(0, 2, (n, *grid)).astype(np.uint8)
        axes = rng.normal(size=(n, 3)) * [0.05, 0.05, 1.0]  # mostly yaw, a little pitch/roll
        axes[:, 2] = np.copysign(np.maximum(np.abs(axes[:, 2]), 0.5), axes[:, 2])  # upright: tilt < 25 deg
        angles = rng.uniform(-np.pi, np.pi, n)
        trans = rng.uniform(-500, 1500, (n, 3))
        pose = np.zeros((n, 4, 4))
        infos = {}
        for i in range(n):
            gt = f"gts/{name}/{toks[i]}/labels.npz"
            (root / gt).parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(root / gt, semantics=sem[i], mask_lidar=lid[i], mask_camera=cam[i])
            pose[i] = np.eye(4)
            pose[i, :3, :3] = rodrigues(axes[i], angles[i])
            pose[i, :3, 3] = trans[i]
            infos[toks[i]] = {
                "timestamp": int(ts[i]),
                "camera_sensor": {"CAM_FRONT": {"img_path": f"imgs/CAM_FRONT/{toks[i]}.jpg",
                                                "intrinsic": np.eye(3).tolist(),
                                                "extrinsic": {"translation": [1.7, 0.0, 1.5],
                                                              "rotation": [0.5, -0.5, 0.5, -0.5]},
                                                "ego_pose": {"translation": trans[i].tolist(),
                                                             "rotation": quat(axes[i], angles[i])}}},
                "ego_pose": {"translation": trans[i].tolist(), "rotation": quat(axes[i], angles[i])},
                "gt_path": gt,
                "prev": toks[i - 1] if i else end,
                "next": toks[i + 1] if i + 1 < n else end,
            }
        if shuffle:  # the file's order is not trusted: frames are ordered by timestamp
            infos = dict(reversed(list(infos.items())))
        ann["scene_infos"][name] = infos
        ann[f"{split}_split"].append(name)
        truth[name] = {"split": split, "tokens": toks, "ts": ts.astype(np.int64), "sem": sem, "cam": cam,
                       "lid": lid, "pose": pose}
    (root / "annotations.json").write_text(json.dumps(ann))
    return truth


SCENES = [("scene-0001", "train", 4), ("scene-0002", "train", 3), ("scene-0003", "val", 5),
          ("scene-0004", "train", 6)]


def read_back(out: Path) -> dict:
    """{scene: dict(split, occ, mask, pose, ts)} from a converted data set."""
    m = load_manifest(out)
    got = {}
    for e in m.shards:
        sh = Shard(out, e, m.info)
        o = sh.scene_offsets
        for j, name in enumerate(sh.scene_names):
            a, b = int(o[j]), int(o[j + 1])
            got[name] = {"split": e["split"], "occ": sh.read("occ", a, b),
                         "mask": sh.read("mask", a, b) if m.info.has_mask else None,
                         "pose": sh.pose[a:b], "ts": sh.timestamp[a:b], "shard": e["path"]}
        sh.close()
    return got


def occ3d_convert(src, out, **kw):
    mask = kw.pop("mask", "both")
    grid = kw.pop("grid", G)
    order, specs, bad = occ3d_scenes(src, mask=mask)
    bits = {"both": {"camera": 1, "lidar": 2}, "camera": {"camera": 1}}.get(mask, {})
    opts = dict(kind="hdf5", scenes_per_shard=2, workers=1, progress=False, log=lambda s: None,
                record={"options": {"mask": mask, "grid": list(grid)}}, extra={"mask_bits": bits})
    opts.update(kw)
    return convert(out, occ3d_info(grid, mask), order, specs, bad, **opts)


def test_occ3d_every_frame_mask_pose_timestamp_and_split(tmp_path):
    truth = make_occ3d(tmp_path / "src", SCENES)
    res = occ3d_convert(tmp_path / "src", tmp_path / "out", workers=2)  # the process pool
    got = read_back(tmp_path / "out")
    assert set(got) == set(truth)
    for name, t in truth.items():
        g = got[name]
        assert g["split"] == t["split"]
        np.testing.assert_array_equal(g["occ"], t["sem"])
        np.testing.assert_array_equal(g["mask"], t["cam"] | (t["lid"] << 1))  # bit 0 camera, bit 1 lidar
        np.testing.assert_array_equal(g["ts"], t["ts"])
        assert g["pose"].dtype == np.float64
        np.testing.assert_allclose(g["pose"], t["pose"], atol=1e-9)
    m = res.manifest
    assert [e["path"] for e in m.shards] == ["train-00000.h5", "train-00001.h5", "val-00000.h5"]
    assert [e["scenes"] for e in m.shards] == [2, 1, 1]
    assert all(e["mask_bits"] == {"camera": 1, "lidar": 2} for e in m.shards)
    assert m.info.num_classes == 18 and m.info.free_class == 17 and m.info.class_names[17] == "free"
    assert m.info.has_mask and m.info.grid == G
    # scenes keep the split lists' order inside shards
    assert got["scene-0001"]["shard"] == got["scene-0002"]["shard"] == "train-00000.h5"
    assert verify(tmp_path / "out") == []
    rec = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert rec["status"] == "complete" and rec["scenes"] == {"train": 3, "val": 1}
    assert json.loads((tmp_path / "out" / "skipped.json").read_text()) == []


def test_occ3d_memmap_camera_mask_and_chain_end_markers(tmp_path):
    truth = make_occ3d(tmp_path / "src", SCENES[:3], end="", seed=1)  # nuScenes' own end marker ""
    occ3d_convert(tmp_path / "src", tmp_path / "out", kind="memmap", mask="camera")
    got = read_back(tmp_path / "out")
    m = load_manifest(tmp_path / "out")
    assert all(e["kind"] == "memmap" and e["mask_bits"] == {"camera": 1} for e in m.shards)
    for name, t in truth.items():
        np.testing.assert_array_equal(got[name]["mask"], t["cam"])
        np.testing.assert_array_equal(got[name]["occ"], t["sem"])


def test_occ3d_real_grid_size_through_the_cli(tmp_path):
    truth = make_occ3d(tmp_path / "src", [("scene-0061", "train", 2), ("scene-0103", "val", 2)],
                       grid=(200, 200, 16))
    p = cli("convert_occ3d.py", "--root", tmp_path / "src", "--out", tmp_path / "out", "--verify",
            "--workers", "1")
    assert p.returncode == 0, p.stderr
    assert "verify: 2/2 shards match the manifest" in p.stdout
    got = read_back(tmp_path / "out")
    for name, t in truth.items():
        np.testing.assert_array_equal(got[name]["occ"], t["sem"])
        np.testing.assert_array_equal(got[name]["mask"], t["cam"] | (t["lid"] << 1))
        np.testing.assert_allclose(got[name]["pose"], t["pose"], atol=1e-9)
    assert load_manifest(tmp_path / "out").info.grid == (200, 200, 16)


def test_converted_occ3d_opens_in_occwindows_and_motion_matches_poses(tmp_path):
    truth = make_occ3d(tmp_path / "src", SCENES, seed=3)
    occ3d_convert(tmp_path / "src", tmp_path / "out")
    cfg = DataConfig(root=str(tmp_path / "out"), grid=G, past=2, future=2, use_mask=True)
    ds = OccWindows(tmp_path / "out", "train", cfg)
    # train scenes: 4, 3, 6 frames -> 1 + 0 + 3 windows of 4 frames
    assert len(ds) == 4
    for i in range(len(ds)):
        item = ds[i]
        sh, first, _ = ds.locate(i)
        j = int(np.searchsorted(sh.scene_offsets, first, side="right") - 1)
        name, k = sh.scene_names[j], first - int(sh.scene_offsets[j])
        t = truth[name]
        np.testing.assert_array_equal(item["occ"].numpy(), t["sem"][k:k + 4])
        assert set(np.unique(item["mask"].numpy())) <= {0, 1, 2, 3}
        np.testing.assert_array_equal(item["mask"].numpy(), (t["cam"] | t["lid"] << 1)[k:k + 4])
        # motion of each frame in the last past frame's ego frame, from the source poses directly
        ref = t["pose"][k + 1]
        for s in range(4):
            p = t["pose"][k + s]
            d = ref[:3, :3].T @ (p[:3, 3] - ref[:3, 3])
            rel = ref[:3, :3].T @ p[:3, :3]
            want = [d[0], d[1], np.arctan2(rel[1, 0], rel[0, 0])]
            np.testing.assert_allclose(item["motion"][s].numpy(), want, atol=1e-3)
        assert abs(float(item["motion"][1].abs().max())) < 1e-6  # the reference frame itself


def test_occ3d_resume_keeps_finished_shards_and_cleans_temporaries(tmp_path):
    make_occ3d(tmp_path / "src", SCENES)
    out = tmp_path / "out"
    first = occ3d_convert(tmp_path / "src", out)
    done = out / "train-00000.h5"
    st = done.stat()
    # the state a kill leaves: a shard never renamed into place (its temporary, of a dead process),
    # a later shard not started, no manifest
    (out / "train-00001.h5").rename(out / ".train-00001.h5.tmp-99999999")
    (out / "val-00000.h5").unlink()
    (out / "manifest.json").unlink()
    res = occ3d_convert(tmp_path / "src", out)
    assert res.kept == ["train-00000.h5"] and sorted(res.written) == ["train-00001.h5", "val-00000.h5"]
    st2 = done.stat()
    assert (st2.st_ino, st2.st_mtime_ns, st2.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert res.manifest.fingerprint == first.manifest.fingerprint  # byte-identical shards
    assert verify(out) == []
    # a complete data set re-run: nothing rewritten
    again = occ3d_convert(tmp_path / "src", out)
    assert again.written == [] and len(again.kept) == 3
    assert again.manifest.fingerprint == first.manifest.fingerprint


def test_occ3d_rerun_with_other_options_is_refused(tmp_path):
    make_occ3d(tmp_path / "src", SCENES[:2])
    out = tmp_path / "out"
    assert cli("convert_occ3d.py", "--root", tmp_path / "src", "--out", out, "--grid", *G).returncode == 0
    line = one_error_line(cli("convert_occ3d.py", "--root", tmp_path / "src", "--out", out, "--grid", *G,
                              "--scenes-per-shard", "1"))
    assert "scenes_per_shard=8" in line and "scenes_per_shard=1" in line and str(out) in line


def _no_final_output(out: Path, failing_shard: str) -> None:
    """Nothing half-written under a final name: no manifest, no temporaries, and the shard that
    was to hold the bad scene does not exist (shards finished before it may)."""
    if out.exists():
        assert not (out / "manifest.json").exists()
        assert not [p for p in out.iterdir() if ".tmp-" in p.name]
        assert not (out / failing_shard).exists()


def _drop_middle_frame(src, name):
    ann = json.loads((src / "annotations.json").read_text())
    infos = ann["scene_infos"][name]
    tok = sorted(infos, key=lambda t: infos[t]["timestamp"])[1]
    del infos[tok]
    (src / "annotations.json").write_text(json.dumps(ann))
    return tok


def _edit_pose(src, name, rotation):
    ann = json.loads((src / "annotations.json").read_text())
    tok = next(iter(ann["scene_infos"][name]))
    ann["scene_infos"][name][tok]["ego_pose"]["rotation"] = rotation
    (src / "annotations.json").write_text(json.dumps(ann))
    return tok


def _labels_file(src, name, i=0):
    return sorted((src / "gts" / name).glob("*/labels.npz"))[i]


OCC3D_BAD = {
    # case: (how to break the tree, what the line must name besides the file)
    "no annotations": (lambda s: (s / "annotations.json").unlink(), "annotations.json", None),
    "malformed json": (lambda s: (s / "annotations.json").write_text('{"train_split": ['), "annotations.json", None),
    "no scene_infos": (lambda s: (s / "annotations.json").write_text('{"train_split": [], "val_split": []}'),
                       "annotations.json", "scene_infos"),
    "label file missing": (lambda s: _labels_file(s, "scene-0004").unlink(), "labels.npz", "scene-0004"),
    "frame missing from annotations": (lambda s: _drop_middle_frame(s, "scene-0004"), "annotations.json", "scene-0004"),
    "wrong grid": (lambda s: np.savez(_labels_file(s, "scene-0004", 1), semantics=np.zeros((8, 8, 3), np.uint8),
                                      mask_lidar=np.zeros((8, 8, 3), np.uint8),
                                      mask_camera=np.zeros((8, 8, 3), np.uint8)),
                   "labels.npz", "scene-0004"),
    "class out of range": (lambda s: np.savez(_labels_file(s, "scene-0004", 2), semantics=np.full(G, 18, np.uint8),
                                              mask_lidar=np.ones(G, np.uint8), mask_camera=np.ones(G, np.uint8)),
                           "labels.npz", "scene-0004"),
    "no semantics array": (lambda s: np.savez(_labels_file(s, "scene-0004", 0), labels=np.zeros(G, np.uint8)),
                           "labels.npz", "scene-0004"),
    "not a unit quaternion": (lambda s: _edit_pose(s, "scene-0004", [2.0, 0.0, 0.0, 0.0]), "annotations.json",
                              "scene-0004"),
    "one-frame scene": (lambda s: None, "annotations.json", "scene-0005"),
}


@pytest.mark.parametrize("case", list(OCC3D_BAD))
def test_occ3d_bad_input_gives_one_line_naming_scene_and_file(tmp_path, case):
    src, out = tmp_path / "src", tmp_path / "out"
    scenes = SCENES + ([("scene-0005", "train", 1)] if case == "one-frame scene" else [])
    make_occ3d(src, scenes)
    breaker, file_part, scene = OCC3D_BAD[case]
    breaker(src)
    line = one_error_line(cli("convert_occ3d.py", "--root", src, "--out", out, "--grid", *G, "--workers", "1",
                              "--scenes-per-shard", "1"))
    assert file_part in line, line
    if scene:
        assert scene in line, line
    if case == "label file missing":
        assert "missing" in line
    if case == "class out of range":
        assert "class id 18" in line
    if case == "not a unit quaternion":
        assert "rigid" in line
    if case == "one-frame scene":
        assert "1 frame" in line
    _no_final_output(out, "train-00002.h5")  # scenes-per-shard 1: scene-0004 is the third train shard


def test_occ3d_skip_bad_converts_the_rest_and_lists_what_it_skipped(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    truth = make_occ3d(src, SCENES + [("scene-0005", "val", 1)])
    np.savez(_labels_file(src, "scene-0002", 1), semantics=np.full(G, 99, np.uint8),
             mask_lidar=np.ones(G, np.uint8), mask_camera=np.ones(G, np.uint8))
    p = cli("convert_occ3d.py", "--root", src, "--out", out, "--grid", *G, "--skip-bad", "--workers", "2",
            "--scenes-per-shard", "2")
    assert p.returncode == 0, p.stderr
    assert "skipped val scene scene-0005" in p.stdout and "skipped train scene scene-0002" in p.stdout
    skipped = json.loads((out / "skipped.json").read_text())
    assert sorted(s["scene"] for s in skipped) == ["scene-0002", "scene-0005"]
    assert any("class id 99" in s["error"] and "labels.npz" in s["error"] for s in skipped)
    got = read_back(out)
    assert sorted(got) == ["scene-0001", "scene-0003", "scene-0004"]
    np.testing.assert_array_equal(got["scene-0004"]["occ"], truth["scene-0004"]["sem"])
    assert [(e["path"], e["scenes"]) for e in load_manifest(out).shards] == \
        [("train-00000.h5", 1), ("train-00001.h5", 1), ("val-00000.h5", 1)]


# ---------------------------------------------------------------------------------------------
# own recordings


def make_frames(root: Path, grid=(6, 4, 3), ncls=5, seed=0, masks=False) -> dict:
    """Three scenes, one per poses format: CSV 4x4 with a frame column, CSV x,y,z,yaw matched by
    name order, JSON with matrices (frames named out of time order)."""
    rng = np.random.default_rng(seed)
    truth = {}
    specs = {"drive_a": ("csv44", 4), "drive_b": ("csvyaw", 3), "drive_c": ("json", 5)}
    for name, (fmt, n) in specs.items():
        d = root / name
        d.mkdir(parents=True)
        occ = rng.integers(0, ncls, (n, *grid)).astype(np.int64 if fmt == "json" else np.uint8)
        vis = rng.integers(0, 2, (n, *grid)).astype(bool)
        t = (100.0 + np.arange(n) * 0.1 + rng.uniform(0, 0.01, n)).tolist()  # plain floats: repr is the number
        yaw = rng.uniform(-3, 3, n).tolist()
        xyz = rng.uniform(-50, 50, (n, 3)).tolist()
        pose = np.zeros((n, 4, 4))
        for i in range(n):
            pose[i] = np.eye(4)
            pose[i, :3, :3] = rodrigues([0, 0, 1], yaw[i])
            pose[i, :3, 3] = xyz[i]
        stems = [f"{i:06d}" for i in range(n)]
        if fmt == "json":
            stems = [f"f{(7 * i) % n}" for i in range(n)]  # names not in time order: the frame field decides
        for i, s in enumerate(stems):
            np.save(d / f"{s}.npy", occ[i])
            if masks:
                np.save(d / f"{s}.mask.npy", vis[i])
        if fmt == "csv44":
            cols = ",".join(f"m{r}{c}" for r in range(4) for c in range(4))
            rows = [f"{t[i]!r},{stems[i]}," + ",".join(repr(float(v)) for v in pose[i].ravel()) for i in range(n)]
            rows = rows[::-1]  # any row order when frames are named
            (d / "poses.csv").write_text(f"# my recorder\ntimestamp,frame,{cols}\n" + "\n".join(rows) + "\n")
        elif fmt == "csvyaw":
            rows = [f"{t[i]!r},{xyz[i][0]!r},{xyz[i][1]!r},{xyz[i][2]!r},{yaw[i]!r}" for i in range(n)]
            (d / "poses.csv").write_text("timestamp,x,y,z,yaw\n" + "\n".join(rows) + "\n")
        else:
            recs = [{"timestamp": t[i], "frame": stems[i], "matrix": pose[i].tolist()} for i in range(n)]
            (d / "poses.json").write_text(json.dumps(recs[::-1]))
        truth[name] = {"occ": occ.astype(np.uint8), "vis": vis.astype(np.uint8),
                       "ts": np.round(np.array(t) * 1e6).astype(np.int64), "pose": pose}
    return truth


def test_frames_three_pose_formats_every_frame_and_split(tmp_path):
    truth = make_frames(tmp_path / "rec")
    p = cli("convert_frames.py", "--root", tmp_path / "rec", "--out", tmp_path / "out",
            "--classes", "road,car,building,tree,free", "--free", "free", "--val-scenes", "drive_b",
            "--format", "memmap", "--verify", "--workers", "2", "--scenes-per-shard", "1")
    assert p.returncode == 0, p.stderr
    assert "verify: 3/3 shards match" in p.stdout
    m = load_manifest(tmp_path / "out")
    assert m.info.class_names == ("road", "car", "building", "tree", "free") and m.info.free_class == 4
    assert m.info.grid == (6, 4, 3) and not m.info.has_mask
    assert m.info.frame_rate_hz == pytest.approx(10, rel=0.1)
    got = read_back(tmp_path / "out")
    assert {n: g["split"] for n, g in got.items()} == {"drive_a": "train", "drive_b": "val", "drive_c": "train"}
    for name, t in truth.items():
        np.testing.assert_array_equal(got[name]["occ"], t["occ"])
        np.testing.assert_array_equal(got[name]["ts"], t["ts"])
        np.testing.assert_allclose(got[name]["pose"], t["pose"], atol=1e-9)


def test_frames_npz_masks_and_classes_json(tmp_path):
    rec = tmp_path / "rec"
    truth = make_frames(rec, masks=True, seed=1)
    # scene a as .npz with the grid under a custom key
    for f in sorted((rec / "drive_a").glob("*.npy")):
        if not f.name.endswith(".mask.npy"):
            np.savez_compressed(f.with_suffix(".npz"), other=np.zeros(3), labels=np.load(f))
            f.unlink()
    (tmp_path / "classes.json").write_text(json.dumps(
        {"class_names": ["road", "car", "building", "tree", "free"], "free_class": "free",
         "voxel_size": 0.5, "frame_rate_hz": 10}))
    order, specs, bad = frames_scenes(rec, ["drive_c"], unit="s", key="labels")
    assert bad == []
    p = cli("convert_frames.py", "--root", rec, "--out", tmp_path / "out", "--classes-json", tmp_path / "classes.json",
            "--key", "labels", "--val-scenes", "drive_c")
    assert p.returncode == 0, p.stderr
    m = load_manifest(tmp_path / "out")
    assert m.info.has_mask and m.info.voxel_size == (0.5, 0.5, 0.5) and m.info.frame_rate_hz == 10
    assert all(e["mask_bits"] == {"visible": 1} for e in m.shards)
    got = read_back(tmp_path / "out")
    for name, t in truth.items():
        np.testing.assert_array_equal(got[name]["occ"], t["occ"])
        np.testing.assert_array_equal(got[name]["mask"], t["vis"])
    cfg = DataConfig(root=str(tmp_path / "out"), grid=(6, 4, 3), num_classes=5, free_class=4, past=2, future=1,
                     use_mask=True)
    ds = OccWindows(tmp_path / "out", "val", cfg)
    assert len(ds) == 3 and ds[0]["mask"].shape == (3, 6, 4, 3)


def _frames_bad_pose(rec, m):
    d = rec / "drive_a"
    lines = (d / "poses.csv").read_text().splitlines()
    cells = lines[2].split(",")
    cells[2:18] = [repr(float(v)) for v in np.asarray(m, float).ravel()]
    lines[2] = ",".join(cells)
    (d / "poses.csv").write_text("\n".join(lines) + "\n")


FRAMES_BAD = {
    "not orthonormal": (lambda r: _frames_bad_pose(r, np.diag([1.0, 2.0, 1.0, 1.0])), "poses.csv", "orthonormal"),
    "reflection": (lambda r: _frames_bad_pose(r, np.diag([1.0, -1.0, 1.0, 1.0])), "poses.csv", "determinant"),
    "last row": (lambda r: _frames_bad_pose(r, np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1.0]])),
                 "poses.csv", "last row"),
    "class out of range": (lambda r: np.save(r / "drive_c" / "f2.npy", np.full((6, 4, 3), 5)), "f2.npy", "class id 5"),
    "wrong grid": (lambda r: np.save(r / "drive_c" / "f1.npy", np.zeros((6, 4, 2), np.uint8)), "f1.npy", "shape"),
    "one frame": (lambda r: [f.unlink() for f in sorted((r / "drive_b").glob("00000[1-9].npy"))]
                  and (r / "drive_b" / "poses.csv").write_text("timestamp,x,y,z,yaw\n1,0,0,0,0\n"),
                  "poses.csv", "1 frame"),
    "no poses file": (lambda r: (r / "drive_b" / "poses.csv").unlink(), "drive_b", "poses"),
    "rows vs files": (lambda r: (r / "drive_b" / "000002.npy").unlink(), "poses.csv", "3 pose rows for 2"),
    "pickled frame": (lambda r: np.save(r / "drive_c" / "f0.npy", np.array([{"a": 1}], dtype=object)), "f0.npy",
                      "cannot be read"),
}


@pytest.mark.parametrize("case", list(FRAMES_BAD))
def test_frames_bad_input_gives_one_line_naming_scene_and_file(tmp_path, case):
    rec, out = tmp_path / "rec", tmp_path / "out"
    make_frames(rec)
    breaker, file_part, what = FRAMES_BAD[case]
    breaker(rec)
    line = one_error_line(cli("convert_frames.py", "--root", rec, "--out", out, "--classes", "a,b,c,d,free",
                              "--free", "4", "--workers", "1", "--grid", 6, 4, 3, "--val-fraction", "0"))
    scene = {"not orthonormal": "drive_a", "reflection": "drive_a", "last row": "drive_a"}.get(case) or \
        ("drive_b" if case in ("one frame", "no poses file", "rows vs files") else "drive_c")
    assert file_part in line and scene in line and what in line, line
    _no_final_output(out, "train-00000.h5")


def test_frames_skip_bad_and_usage_errors(tmp_path):
    rec, out = tmp_path / "rec", tmp_path / "out"
    truth = make_frames(rec)
    _frames_bad_pose(rec, np.diag([1.0, -1.0, 1.0, 1.0]))
    p = cli("convert_frames.py", "--root", rec, "--out", out, "--classes", "a,b,c,d,free", "--free", "free",
            "--skip-bad", "--val-fraction", "0")
    assert p.returncode == 0, p.stderr
    assert "skipped train scene drive_a" in p.stdout
    assert [s["scene"] for s in json.loads((out / "skipped.json").read_text())] == ["drive_a"]
    got = read_back(out)
    assert sorted(got) == ["drive_b", "drive_c"]
    np.testing.assert_array_equal(got["drive_c"]["occ"], truth["drive_c"]["occ"])
    # usage mistakes: one line each
    assert "--free" in one_error_line(cli("convert_frames.py", "--root", rec, "--out", tmp_path / "o2",
                                          "--classes", "a,b"))
    assert "not one of the classes" in one_error_line(cli("convert_frames.py", "--root", rec, "--out",
                                                          tmp_path / "o2", "--classes", "a,b", "--free", "z"))
    assert "nope" in one_error_line(cli("convert_frames.py", "--root", rec, "--out", tmp_path / "o2",
                                        "--classes", "a,b,c,d,free", "--free", "free", "--val-scenes", "nope"))


def test_val_fraction_split_is_deterministic_and_never_empty():
    names = [f"s{i:03d}" for i in range(20)]
    a = split_scenes(names, None, 0.2, "x")
    b = split_scenes(list(reversed(names)), None, 0.2, "x")
    assert a == b and len(a["val"]) == 4 and len(a["train"]) == 16
    assert set(a["val"]) | set(a["train"]) == set(names)
    assert len(split_scenes(names[:2], None, 0.01, "x")["val"]) == 1
    assert split_scenes(names[:3], None, 0.0, "x")["val"] == []
    with pytest.raises(DataError, match="leave some for training"):
        split_scenes(["only"], ["only"], 0.1, "x")


def test_no_pickle_is_ever_loaded(tmp_path, monkeypatch):
    """Every np.load in the converters passes allow_pickle=False."""
    make_occ3d(tmp_path / "src", SCENES[:2])
    make_frames(tmp_path / "rec")
    seen = []
    real = np.load

    def spy(*a, **k):
        seen.append(k.get("allow_pickle"))
        return real(*a, **k)

    monkeypatch.setattr(np, "load", spy)
    occ3d_convert(tmp_path / "src", tmp_path / "out")
    order, specs, bad = frames_scenes(tmp_path / "rec", val_fraction=0.0)
    from wm.data.convert.engine import read_scene
    from wm.data.shards import DatasetInfo

    read_scene(specs["drive_c"], DatasetInfo(grid=(6, 4, 3), num_classes=5, free_class=4,
                                             class_names=("a", "b", "c", "d", "e")))
    assert seen and all(v is False for v in seen), seen
