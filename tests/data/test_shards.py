"""wm.data.shards (+ wm.data.synthetic.generate's writers, wm.data.windows.check_against_config): the shard format end to end.

Round trips in both kinds and every compression, byte-identical rewrites, the fingerprint,
verify(), and every refusal a user can run into: a DataError with one line that names the file and
field, and no data lost or left half-written. Small grids (16x16x4) and few frames keep it fast.
"""

import hashlib
import json
import pickle
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from wm.config.sections import COMPRESSIONS, DEFAULT_COMPRESSION, KINDS
from wm.config.sections import DataConfig, SyntheticConfig
from wm.data import writer as SW, shards as S
import wm.data.synthetic.generate as synth
from wm.data.windows import check_against_config
from wm.utils.errors import DataError, WMError

GRID = (16, 16, 4)
NC = 18  # classes (Occ3D's), free = 17


def refused(fn, *args, **kw) -> str:
    """Call fn, expect a DataError with a one-line message; return the message."""
    with pytest.raises(DataError) as ei:
        fn(*args, **kw)
    assert isinstance(ei.value, WMError)
    msg = str(ei.value)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    return msg


def hand_scene(name: str, frames: int, seed: int, with_mask: bool = True) -> dict:
    """A scene of arbitrary (not synthetic-looking) values: every class id, random finite poses."""
    rng = np.random.default_rng(seed)
    occ = rng.integers(0, NC, size=(frames, *GRID), dtype=np.uint8)
    occ.flat[0], occ.flat[1] = 0, NC - 1  # the extremes of the class range
    pose = rng.normal(size=(frames, 4, 4)) * 100
    ts = 1_000_000 * seed + np.arange(frames, dtype=np.int64) * 500_000
    mask = rng.integers(0, 2, size=occ.shape, dtype=np.uint8) if with_mask else None
    return {"name": name, "occ": occ, "pose": pose, "timestamp": ts, "mask": mask}


def scenes(with_mask: bool = True) -> list[dict]:
    """Two synthetic scenes of different lengths and a hand-made one."""
    return [synth.make_scene(0, 0, GRID, 5, with_mask),
            hand_scene("hand-a", 3, 1, with_mask),
            synth.make_scene(0, 1, GRID, 4, with_mask, split_id=1)]


def write_shard(path: Path, kind: str, sc: list[dict], with_mask: bool = True,
                compression: str = DEFAULT_COMPRESSION) -> dict:
    info = synth.dataset_info(GRID, with_mask)
    with SW.ShardWriter(path, kind, info, compression=compression) as w:
        for s in sc:
            w.add_scene(s["name"], s["occ"], s["pose"], s["timestamp"], s["mask"])
        return w.close()


def make_dataset(root: Path, kind: str = "hdf5", with_mask: bool = True,
                 compression: str = DEFAULT_COMPRESSION) -> S.Manifest:
    """train: one shard of scenes(); val: one shard of one hand-made scene."""
    root.mkdir(parents=True, exist_ok=True)
    sfx = S.SUFFIX[kind]
    train = write_shard(root / f"train-0{sfx}", kind, scenes(with_mask), with_mask, compression)
    val = write_shard(root / f"val-0{sfx}", kind, [hand_scene("hand-v", 4, 9, with_mask)],
                      with_mask, compression)
    m = S.Manifest(root, synth.dataset_info(GRID, with_mask), [{**train, "split": "train"}, {**val, "split": "val"}])
    m.write()
    return m


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def edit_manifest(root: Path, fn) -> None:
    p = root / S.MANIFEST
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def edit_field(shard: Path, kind: str, field: str, fn) -> None:
    """Change one array of a written shard in place (same shape): fn(array) -> new array."""
    if kind == "hdf5":
        with h5py.File(shard, "r+") as f:
            f[field][...] = fn(f[field][...])
    else:
        p = shard / f"{field}.npy"
        np.save(p, fn(np.load(p)))


def write_h5_by_hand(path: Path, occ, pose, offsets, names, ts=None) -> None:
    with h5py.File(path, "w") as f:
        f["occ"] = occ
        f["pose"] = pose
        f["timestamp"] = np.arange(len(pose), dtype=np.int64) if ts is None else ts
        f["scene_offsets"] = np.asarray(offsets, np.int64)
        f.create_dataset("scene_names", data=np.array(names, dtype=object), dtype=h5py.string_dtype())


KIND_COMP = [("hdf5", c) for c in COMPRESSIONS] + [("memmap", "none")]


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("kind,comp", KIND_COMP)
def test_round_trip(tmp_path, kind, comp):
    sc = scenes(True)
    m = make_dataset(tmp_path / "ds", kind, True, comp)
    m2, shards = S.open_split(tmp_path / "ds", "train")
    assert m2.fingerprint == m.fingerprint
    assert len(shards) == 1
    sh = shards[0]
    occ = np.concatenate([s["occ"] for s in sc])
    mask = np.concatenate([s["mask"] for s in sc])
    pose = np.concatenate([s["pose"] for s in sc])
    ts = np.concatenate([s["timestamp"] for s in sc])
    assert sh.num_frames == len(occ) == 12
    np.testing.assert_array_equal(sh.scene_offsets, [0, 5, 8, 12])
    assert sh.scene_offsets.dtype == np.int64
    assert sh.scene_names == [s["name"] for s in sc]
    got = sh.read("occ", 0, 12)
    assert got.dtype == np.uint8 and got.shape == occ.shape
    np.testing.assert_array_equal(got, occ)
    np.testing.assert_array_equal(sh.read("mask", 0, 12), mask)
    assert sh.pose.dtype == np.float64
    np.testing.assert_array_equal(sh.pose, pose)  # bitwise: float64 all the way
    assert sh.timestamp.dtype == np.int64
    np.testing.assert_array_equal(sh.timestamp, ts)
    # strided and partial reads equal numpy slicing, across scene boundaries too
    for a, b, st in [(1, 9, 2), (0, 12, 3), (4, 6, 1), (3, 12, 4), (11, 12, 1)]:
        np.testing.assert_array_equal(sh.read("occ", a, b, st), occ[a:b:st])
        np.testing.assert_array_equal(sh.read("mask", a, b, st), mask[a:b:st])
    # a fresh array, not a view into the file
    r = sh.read("occ", 0, 2)
    r[:] = 99
    np.testing.assert_array_equal(sh.read("occ", 0, 2), occ[:2])
    # picklable (DataLoader workers): the copy reopens its own handle
    sh2 = pickle.loads(pickle.dumps(sh))
    np.testing.assert_array_equal(sh2.read("occ", 2, 7, 2), occ[2:7:2])
    sh.close()
    sh2.close()
    _, (v,) = S.open_split(tmp_path / "ds", "val")
    hv = hand_scene("hand-v", 4, 9)
    np.testing.assert_array_equal(v.read("occ", 0, 4), hv["occ"])
    assert v.scene_names == ["hand-v"]
    v.close()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_without_mask(tmp_path, kind):
    sc = scenes(False)
    make_dataset(tmp_path / "ds", kind, with_mask=False)
    m, (sh,) = S.open_split(tmp_path / "ds", "train")
    assert m.info.has_mask is False
    np.testing.assert_array_equal(sh.read("occ", 0, 12), np.concatenate([s["occ"] for s in sc]))
    msg = refused(sh.read, "mask", 0, 2)
    assert "'mask'" in msg and sh.path.name in msg
    sh.close()


def _filter_ids(ds) -> list[int]:
    dcpl = ds.id.get_create_plist()
    return [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]


@pytest.mark.parametrize("comp", list(COMPRESSIONS))
def test_hdf5_layout_is_self_describing(tmp_path, comp):
    write_shard(tmp_path / "a.h5", "hdf5", scenes(True), compression=comp)
    want = S.h5_compression(comp).get("compression")  # None, 'gzip' or a plugin filter id
    want_ids = [] if want is None else [{"gzip": h5py.h5z.FILTER_DEFLATE}.get(want, want)]
    want_ids.append(h5py.h5z.FILTER_FLETCHER32)  # every chunk checksummed, over the compressed bytes
    with h5py.File(tmp_path / "a.h5", "r") as f:
        for k in ("occ", "mask"):
            assert f[k].chunks == (1, *GRID)  # one frame per chunk
            assert _filter_ids(f[k]) == want_ids
        if comp.startswith("gzip"):
            assert f["occ"].compression_opts == int(comp[-1])
        assert f.attrs["format"] == S.FORMAT and f.attrs["version"] == S.VERSION
        assert list(f.attrs["grid"]) == list(GRID)
        assert f.attrs["num_classes"] == NC and f.attrs["free_class"] == NC - 1
        assert json.loads(f.attrs["class_names"]) == list(S.OCC3D_CLASSES)
        assert f.attrs["compression"] == comp


@pytest.mark.parametrize("comp", [c for c, (filt, _) in COMPRESSIONS.items() if filt in S.PLUGIN_FILTERS])
def test_plugin_compression_without_hdf5plugin(tmp_path, monkeypatch, comp):
    root = tmp_path / "ds"
    make_dataset(root, "hdf5", compression=comp)
    monkeypatch.setitem(sys.modules, "hdf5plugin", None)  # import hdf5plugin -> ImportError
    out = tmp_path / "out"
    out.mkdir()
    msg = refused(SW.ShardWriter, out / "x.h5", "hdf5", synth.dataset_info(GRID, True), compression=comp)
    assert "hdf5plugin" in msg and "x.h5" in msg
    assert leftovers(out) == []
    msg = refused(S.open_split, root, "train")
    assert "hdf5plugin" in msg and str(root / "train-0.h5") in msg and comp in msg
    monkeypatch.undo()
    _, (sh,) = S.open_split(root, "train")
    np.testing.assert_array_equal(sh.read("occ", 0, 5), scenes(True)[0]["occ"])
    sh.close()


def test_mixed_synthetic_matches_make_scene(tmp_path):
    root = tmp_path / "mixed"
    m = synth.write_synthetic(root, train_scenes=3, val_scenes=2, frames=4, grid=GRID, seed=7,
                              kind="mixed", scenes_per_shard=2)
    assert {e["kind"] for e in m.shards} == {"hdf5", "memmap"}
    assert S.verify(root) == []
    for split_id, (split, n) in enumerate([("train", 3), ("val", 2)]):
        _, shards = S.open_split(root, split)
        got = []
        for sh in shards:
            o = sh.scene_offsets
            for j, name in enumerate(sh.scene_names):
                got.append((name, sh.read("occ", o[j], o[j + 1]), sh.read("mask", o[j], o[j + 1]),
                            sh.pose[o[j]:o[j + 1]], sh.timestamp[o[j]:o[j + 1]]))
            sh.close()
        assert len(got) == n
        for i, (name, occ, mask, pose, ts) in enumerate(got):
            want = synth.make_scene(7, i, GRID, 4, True, split_id)
            assert name == want["name"]
            np.testing.assert_array_equal(occ, want["occ"])
            np.testing.assert_array_equal(mask, want["mask"])
            np.testing.assert_array_equal(pose, want["pose"])
            np.testing.assert_array_equal(ts, want["timestamp"])


def test_write_synthetic_refuses_existing_data_set(tmp_path):
    root = tmp_path / "ds"
    synth.write_synthetic(root, 1, 1, frames=3, grid=GRID)
    before = (root / S.MANIFEST).read_bytes()
    msg = refused(synth.write_synthetic, root, 1, 1, frames=3, grid=GRID, seed=1)
    assert str(root) in msg and "already" in msg
    assert (root / S.MANIFEST).read_bytes() == before


# ---------------------------------------------------------------------------------------------
# byte-identical rewrites and the fingerprint


DETERMINISTIC = list(KIND_COMP)


def test_rewrite_is_byte_identical(tmp_path):
    sc = scenes(True)
    first = {}
    for kind, comp in DETERMINISTIC:
        p = tmp_path / "a" / f"{kind}-{comp}{S.SUFFIX[kind]}"
        p.parent.mkdir(exist_ok=True)
        first[(kind, comp)] = (p, write_shard(p, kind, sc, compression=comp))
    time.sleep(1.1)  # a stored modification time would differ now
    for (kind, comp), (p1, e1) in first.items():
        p2 = tmp_path / "b" / p1.name
        p2.parent.mkdir(exist_ok=True)
        e2 = write_shard(p2, kind, sc, compression=comp)
        assert e2 == e1, (kind, comp)
        if kind == "hdf5":  # independent of shard_sha256: the raw bytes
            assert hashlib.sha256(p1.read_bytes()).digest() == hashlib.sha256(p2.read_bytes()).digest()
        else:
            for f in sorted(p1.iterdir()):
                assert f.read_bytes() == (p2 / f.name).read_bytes(), f.name


def test_lzf_is_not_offered():
    # h5py's lzf output is not byte-reproducible (liblzf INIT_HTAB=0): about 1 write in 40 gave
    # other chunk bytes for the same frames, which would change a regenerated data set's fingerprint
    assert "lzf" not in COMPRESSIONS
    with pytest.raises(DataError, match="compression 'lzf' must be one of"):
        S.h5_compression("lzf")


def test_fingerprint_stable_and_sensitive(tmp_path):
    root = tmp_path / "ds"
    m = make_dataset(root)
    fp = m.fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert S.load_manifest(root).fingerprint == fp
    assert S.load_manifest(root).fingerprint == fp
    # canonical: the same manifest written with other key order and spacing
    d = json.loads((root / S.MANIFEST).read_text())
    (root / S.MANIFEST).write_text(json.dumps(dict(reversed(list(d.items()))), indent=7))
    assert S.load_manifest(root).fingerprint == fp
    for change in (lambda d: d["shards"][0].update(sha256="0" * 64),
                   lambda d: d["shards"][1].update(split="test"),
                   lambda d: d["shards"][0].update(bytes=d["shards"][0]["bytes"] + 1),
                   lambda d: d.update(frame_rate_hz=10.0)):
        (root / S.MANIFEST).write_text(json.dumps(d))
        edit_manifest(root, change)
        assert S.load_manifest(root).fingerprint != fp


def test_fingerprint_differs_between_data_sets(tmp_path):
    a = synth.write_synthetic(tmp_path / "a", 1, 1, frames=3, grid=GRID, seed=0)
    b = synth.write_synthetic(tmp_path / "b", 1, 1, frames=3, grid=GRID, seed=1)
    c = synth.write_synthetic(tmp_path / "c", 1, 1, frames=3, grid=GRID, seed=0)
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == c.fingerprint  # same data, other folder: same fingerprint


# ---------------------------------------------------------------------------------------------
# verify()


@pytest.mark.parametrize("kind", KINDS)
def test_verify(tmp_path, kind):
    root = tmp_path / "ds"
    make_dataset(root, kind)
    assert S.verify(root) == []
    target = root / f"train-0{S.SUFFIX[kind]}"
    f = target if kind == "hdf5" else target / "occ.npy"
    good = f.read_bytes()

    b = bytearray(good)
    b[len(b) // 2] ^= 0x01  # one flipped bit
    f.write_bytes(bytes(b))
    (problem,) = S.verify(root)
    assert str(target) in problem and "sha256" in problem

    f.write_bytes(good[: len(good) - 100])
    (problem,) = S.verify(root)
    assert str(target) in problem and "bytes" in problem

    f.write_bytes(good)
    assert S.verify(root) == []

    val = root / f"val-0{S.SUFFIX[kind]}"
    SW._remove(val)
    (problem,) = S.verify(root)
    assert str(val) in problem and "missing" in problem


# ---------------------------------------------------------------------------------------------
# writer refusals: a DataError and nothing left behind


def _bad_cases():
    occ = np.zeros((3, *GRID), np.uint8)
    pose = np.tile(np.eye(4), (3, 1, 1))
    ts = np.arange(3, dtype=np.int64)
    mask = np.ones_like(occ)
    big = occ.copy()
    big[1, 2, 3, 1] = NC
    nan_pose = pose.copy()
    nan_pose[1, 0, 3] = np.nan
    inf_pose = pose.copy()
    inf_pose[2, 1, 1] = np.inf
    return {
        "class_id": ((big, pose, ts, mask), ["class id 18", "num_classes"]),
        "dtype": ((occ.astype(np.int16), pose, ts, mask), ["occ", "uint8", "int16"]),
        "float_occ": ((occ.astype(np.float32), pose, ts, mask), ["occ", "uint8"]),
        "grid": ((np.zeros((3, 16, 16, 8), np.uint8), pose, ts, mask), ["occ shape", "16, 16, 4"]),
        "ndim": ((np.zeros((16, 16, 4), np.uint8), pose, ts, mask), ["occ shape"]),
        "nan_pose": ((occ, nan_pose, ts, mask), ["pose", "frame 1", "finite"]),
        "inf_pose": ((occ, inf_pose, ts, mask), ["pose", "frame 2", "finite"]),
        "pose_shape": ((occ, pose[:, :3], ts, mask), ["pose shape", "(3, 4, 4)"]),
        "pose_frames": ((occ, pose[:2], ts, mask), ["pose shape"]),
        "timestamp_shape": ((occ, pose, ts[:2], mask), ["timestamp"]),
        "mask_missing": ((occ, pose, ts, None), ["mask"]),
        "mask_shape": ((occ, pose, ts, mask[:2]), ["mask"]),
        "mask_dtype": ((occ, pose, ts, mask.astype(bool)), ["mask", "uint8"]),
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_writer_refuses_bad_scene_and_leaves_nothing(tmp_path, kind, case):
    args, words = _bad_cases()[case]
    good = hand_scene("good", 2, 3)
    out = tmp_path / "out"
    out.mkdir()
    info = synth.dataset_info(GRID, True)

    def go():
        with SW.ShardWriter(out / f"x{S.SUFFIX[kind]}", kind, info) as w:
            w.add_scene("good", good["occ"], good["pose"], good["timestamp"], good["mask"])
            w.add_scene("bad-scene", *args)
            w.close()

    msg = refused(go)
    assert "bad-scene" in msg
    for word in words:
        assert word in msg, (word, msg)
    assert leftovers(out) == []


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
@pytest.mark.parametrize("kind", KINDS)
def test_writer_refuses_non_finite_timestamp(tmp_path, kind):
    s = hand_scene("s", 3, 1)
    msg = refused(write_shard, tmp_path / f"x{S.SUFFIX[kind]}", kind,
                  [{**s, "timestamp": np.array([0.0, np.nan, 1e6])}])
    assert "timestamp" in msg


def test_writer_into_missing_folder(tmp_path):
    s = hand_scene("s", 2, 1)
    entry = write_shard(tmp_path / "new" / "x.h5", "hdf5", [s])  # as memmap does: make the folder
    assert entry["frames"] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_writer_refuses_mask_when_data_set_has_none(tmp_path, kind):
    s = hand_scene("s", 2, 1, with_mask=True)
    with pytest.raises(DataError, match="has_mask"):
        with SW.ShardWriter(tmp_path / f"x{S.SUFFIX[kind]}", kind, synth.dataset_info(GRID, False)) as w:
            w.add_scene("s", s["occ"], s["pose"], s["timestamp"], s["mask"])
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_writer_refuses_existing_target_untouched(tmp_path, kind):
    target = tmp_path / f"x{S.SUFFIX[kind]}"
    if kind == "hdf5":
        target.write_bytes(b"precious bytes")
        before = {target.name: target.read_bytes()}
    else:
        target.mkdir()
        (target / "occ.npy").write_bytes(b"precious bytes")
        before = {"occ.npy": (target / "occ.npy").read_bytes()}
    msg = refused(SW.ShardWriter, target, kind, synth.dataset_info(GRID, True))
    assert str(target) in msg and "exists" in msg
    assert leftovers(tmp_path) == [target.name]  # no temp beside it
    if kind == "hdf5":
        assert target.read_bytes() == before[target.name]
    else:
        assert leftovers(target) == ["occ.npy"]
        assert (target / "occ.npy").read_bytes() == before["occ.npy"]


@pytest.mark.parametrize("kind", KINDS)
def test_writer_overwrite_replaces_only_when_asked(tmp_path, kind):
    target = tmp_path / f"x{S.SUFFIX[kind]}"
    write_shard(target, kind, [hand_scene("old", 2, 1)])
    s = hand_scene("new", 3, 2)
    with SW.ShardWriter(target, kind, synth.dataset_info(GRID, True), overwrite=True) as w:
        w.add_scene("new", s["occ"], s["pose"], s["timestamp"], s["mask"])
        e = w.close()
    assert e["frames"] == 3 and e["sha256"] == S.shard_sha256(target)
    assert leftovers(tmp_path) == [target.name]


@pytest.mark.parametrize("kind", KINDS)
def test_exception_inside_writer_removes_temp(tmp_path, kind):
    s = hand_scene("s", 2, 1)
    with pytest.raises(KeyboardInterrupt):
        with SW.ShardWriter(tmp_path / f"x{S.SUFFIX[kind]}", kind, synth.dataset_info(GRID, True)) as w:
            w.add_scene("s", s["occ"], s["pose"], s["timestamp"], s["mask"])
            assert leftovers(tmp_path) != []  # the temporary exists while writing
            raise KeyboardInterrupt
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_writer_refuses_empty_shard(tmp_path, kind):
    def go():
        with SW.ShardWriter(tmp_path / f"x{S.SUFFIX[kind]}", kind, synth.dataset_info(GRID, True)) as w:
            w.close()

    msg = refused(go)
    assert f"x{S.SUFFIX[kind]}" in msg and "no scenes" in msg
    assert leftovers(tmp_path) == []


def test_writer_refuses_unknown_kind_and_compression(tmp_path):
    info = synth.dataset_info(GRID, True)
    assert "zarr" in refused(SW.ShardWriter, tmp_path / "x.h5", "zarr", info)
    msg = refused(SW.ShardWriter, tmp_path / "x.h5", "hdf5", info, compression="zstd")
    assert "zstd" in msg and "gzip1" in msg
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# reader refusals: a DataError naming the shard file and the field


@pytest.mark.parametrize("kind", KINDS)
def test_missing_shard(tmp_path, kind):
    root = tmp_path / "ds"
    make_dataset(root, kind)
    shard = root / f"train-0{S.SUFFIX[kind]}"
    SW._remove(shard)
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and "missing" in msg
    S.open_split(root, "val")  # the other split still opens


def test_truncated_hdf5(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, "hdf5")
    shard = root / "train-0.h5"
    b = shard.read_bytes()
    shard.write_bytes(b[: len(b) // 2])
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and "truncated" in msg


@pytest.mark.parametrize("comp", [c for c, (filt, _) in COMPRESSIONS.items() if filt])
def test_corrupt_hdf5_chunk_found_at_read(tmp_path, comp):
    root = tmp_path / "ds"
    make_dataset(root, "hdf5", compression=comp)
    shard = root / "train-0.h5"
    with h5py.File(shard, "r") as f:
        info = f["occ"].id.get_chunk_info(6)  # frame 6: the hand-made scene
    assert info.chunk_offset[0] == 6
    b = bytearray(shard.read_bytes())
    b[info.byte_offset:info.byte_offset + info.size] = b"\xff" * info.size
    shard.write_bytes(bytes(b))
    _, (sh,) = S.open_split(root, "train")  # small fields are intact: opens
    msg = refused(sh.read, "occ", 5, 8)
    assert str(shard) in msg and "'occ'" in msg and "frame 6 is damaged" in msg
    # the damage is local: other frames still read, and verify() names the file
    want = np.concatenate([s["occ"] for s in scenes(True)])
    np.testing.assert_array_equal(sh.read("occ", 0, 6), want[:6])
    sh.close()
    (problem,) = S.verify(root)
    assert str(shard) in problem


@pytest.mark.parametrize("keep", ["half", "header"])
def test_truncated_memmap_npy_names_shard(tmp_path, keep):
    root = tmp_path / "ds"
    make_dataset(root, "memmap")
    shard = root / "train-0.mm"
    f = shard / "occ.npy"
    b = f.read_bytes()
    f.write_bytes(b[: len(b) // 2] if keep == "half" else b[:100])
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and "truncated" in msg


def test_truncated_memmap_npy_names_field(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, "memmap")
    f = root / "train-0.mm" / "occ.npy"
    f.write_bytes(f.read_bytes()[:1000])
    msg = refused(S.open_split, root, "train")
    assert "'occ'" in msg or "occ.npy" in msg


@pytest.mark.parametrize("field", ["occ", "pose", "scene_offsets", "scene_names"])
def test_memmap_missing_field_file(tmp_path, field):
    root = tmp_path / "ds"
    make_dataset(root, "memmap")
    shard = root / "train-0.mm"
    name = "scene_names.json" if field == "scene_names" else f"{field}.npy"
    (shard / name).unlink()
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and f"'{field}'" in msg


def test_hdf5_missing_field(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, "hdf5")
    shard = root / "train-0.h5"
    with h5py.File(shard, "r+") as f:
        del f["timestamp"]
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and "'timestamp'" in msg


def _hand_dataset(root: Path, occ, pose=None, offsets=None, names=None) -> Path:
    """A one-shard data set whose shard is written with h5py directly (no wm checks)."""
    root.mkdir()
    n = len(occ)
    pose = np.tile(np.eye(4), (n, 1, 1)) if pose is None else pose
    offsets = [0, n] if offsets is None else offsets
    names = [f"s{i}" for i in range(len(offsets) - 1)] if names is None else names
    write_h5_by_hand(root / "train-0.h5", occ, pose, offsets, names)
    entry = {"path": "train-0.h5", "kind": "hdf5", "split": "train", "scenes": len(offsets) - 1,
             "frames": n, "bytes": S.shard_size(root / "train-0.h5"),
             "sha256": S.shard_sha256(root / "train-0.h5")}
    S.Manifest(root, synth.dataset_info(GRID, False), [entry]).write()
    return root / "train-0.h5"


def test_hand_written_hdf5_shard_reads(tmp_path):
    # the control for the refusals below: a correct hand-written shard opens and reads back
    occ = np.full((4, *GRID), 3, np.uint8)
    _hand_dataset(tmp_path / "ds", occ, offsets=[0, 1, 4])
    _, (sh,) = S.open_split(tmp_path / "ds", "train")
    np.testing.assert_array_equal(sh.read("occ", 0, 4), occ)
    assert sh.scene_names == ["s0", "s1"]
    sh.close()


def test_wrong_occ_dtype(tmp_path):
    shard = _hand_dataset(tmp_path / "ds", np.zeros((4, *GRID), np.float32))
    msg = refused(S.open_split, tmp_path / "ds", "train")
    assert str(shard) in msg and "'occ'" in msg and "float32" in msg and "uint8" in msg


@pytest.mark.parametrize("kind", KINDS)
def test_frame_shape_differs_from_manifest_grid(tmp_path, kind):
    root = tmp_path / "ds"
    make_dataset(root, kind)
    edit_manifest(root, lambda d: d.update(grid=[16, 16, 8]))
    msg = refused(S.open_split, root, "train")
    assert str(root / f"train-0{S.SUFFIX[kind]}") in msg and "'occ'" in msg and "grid" in msg
    assert "(16, 16, 8)" in msg and "(16, 16, 4)" in msg


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offsets", [[0, 8, 5, 12], [0, 5, 8, 11], [0, 5, 5, 12], [1, 5, 8, 12]])
def test_bad_scene_offsets(tmp_path, kind, offsets):
    root = tmp_path / "ds"
    make_dataset(root, kind)
    shard = root / f"train-0{S.SUFFIX[kind]}"
    edit_field(shard, kind, "scene_offsets", lambda a: np.asarray(offsets, np.int64))
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and "'scene_offsets'" in msg


def test_scene_offsets_past_frame_count_hand_written(tmp_path):
    shard = _hand_dataset(tmp_path / "ds", np.zeros((4, *GRID), np.uint8), offsets=[0, 2, 6])
    msg = refused(S.open_split, tmp_path / "ds", "train")
    assert str(shard) in msg and "'scene_offsets'" in msg and "4" in msg


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_pose(tmp_path, kind, bad):
    root = tmp_path / "ds"
    make_dataset(root, kind)
    shard = root / f"train-0{S.SUFFIX[kind]}"

    def poison(p):
        p[6, 0, 3] = bad
        return p

    edit_field(shard, kind, "pose", poison)
    msg = refused(S.open_split, root, "train")
    assert str(shard) in msg and "'pose'" in msg and "frame 6" in msg


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field,delta", [("frames", 1), ("scenes", -1)])
def test_stale_manifest(tmp_path, kind, field, delta):
    root = tmp_path / "ds"
    make_dataset(root, kind)
    edit_manifest(root, lambda d: d["shards"][0].update({field: d["shards"][0][field] + delta}))
    msg = refused(S.open_split, root, "train")
    assert str(root / f"train-0{S.SUFFIX[kind]}") in msg and "stale" in msg


def test_missing_manifest(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root)
    (root / S.MANIFEST).unlink()
    msg = refused(S.open_split, root, "train")
    assert str(root / S.MANIFEST) in msg and "missing" in msg
    msg = refused(S.open_split, tmp_path / "nowhere", "train")
    assert str(tmp_path / "nowhere") in msg and "not exist" in msg


def test_manifest_invalid_json(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root)
    p = root / S.MANIFEST
    p.write_text(p.read_text()[:-30])  # cut short, as by a crash mid-write
    msg = refused(S.open_split, root, "train")
    assert str(p) in msg and "JSON" in msg


@pytest.mark.parametrize("change,field", [
    (lambda d: d.update(format="occ-other"), "'format'"),
    (lambda d: d.pop("format"), "'format'"),
    (lambda d: d.update(version=2), "'version'"),
    (lambda d: d.pop("num_classes"), "'num_classes'"),
    (lambda d: d.pop("shards"), "'shards'"),
    (lambda d: d["shards"][0].pop("sha256"), "'sha256'"),
    (lambda d: d["shards"][0].update(kind="zip"), "kind"),
    (lambda d: d.update(shards=[5]), "shards[0]"),
    (lambda d: d.update(free_class=18), "free_class"),
    (lambda d: d.update(class_names=["a", "b"]), "class names"),
])
def test_manifest_bad_fields(tmp_path, change, field):
    root = tmp_path / "ds"
    make_dataset(root)
    edit_manifest(root, change)
    msg = refused(S.load_manifest, root)
    assert str(root / S.MANIFEST) in msg and field in msg


@pytest.mark.parametrize("change,field", [
    (lambda d: d.update(shards=5), "shards"),
    (lambda d: d.update(num_classes="18"), "num_classes"),
    (lambda d: d.update(grid="16x16x4"), "grid"),
])
def test_manifest_mistyped_fields_named(tmp_path, change, field):
    root = tmp_path / "ds"
    make_dataset(root)
    edit_manifest(root, change)
    msg = refused(S.load_manifest, root)
    assert str(root / S.MANIFEST) in msg and field in msg


def test_empty_split_names_splits_present(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root)
    msg = refused(S.open_split, root, "test")
    assert "'test'" in msg and "train, val" in msg and str(root / S.MANIFEST) in msg


# ---------------------------------------------------------------------------------------------
# the manifest against the config


def test_check_against_config(tmp_path):
    root = tmp_path / "ds"
    m = make_dataset(root)
    ok = DataConfig(grid=GRID)
    check_against_config(m, ok)  # matches: no error
    check_against_config(m, DataConfig(grid=GRID, use_mask=True))
    src = str(root / S.MANIFEST)
    msg = refused(check_against_config, m, DataConfig(grid=(32, 16, 4)))
    assert src in msg and "data.grid" in msg and "[32, 16, 4]" in msg and "[16, 16, 4]" in msg
    msg = refused(check_against_config, m, DataConfig(grid=GRID, num_classes=20))
    assert src in msg and "data.num_classes" in msg and "20" in msg and "18" in msg
    msg = refused(check_against_config, m, DataConfig(grid=GRID, num_classes=18, free_class=0))
    assert src in msg and "data.free_class" in msg


def test_check_against_config_mask(tmp_path):
    m = make_dataset(tmp_path / "ds", with_mask=False)
    check_against_config(m, DataConfig(grid=GRID))
    msg = refused(check_against_config, m, DataConfig(grid=GRID, use_mask=True))
    assert "data.use_mask" in msg and str(tmp_path / "ds" / S.MANIFEST) in msg


# ---------------------------------------------------------------------------------------------
# ensure_synthetic: generate once, reuse, never leave a half data set under the final name


def _syn_cfg(tmp_path, **kw) -> SyntheticConfig:
    kw = {"train_scenes": 2, "val_scenes": 1, "frames": 3, "cache_dir": str(tmp_path / "cache"), **kw}
    return SyntheticConfig(**kw)


def _mtimes(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


def test_ensure_synthetic_generates_once(tmp_path, monkeypatch):
    cfg = _syn_cfg(tmp_path)
    logs = []
    path = synth.ensure_synthetic(cfg, GRID, log=logs.append)
    assert path.parent == tmp_path / "cache" and path.name.startswith("synthetic-")
    assert len(logs) == 1 and str(path) in logs[0]  # says where
    m = S.load_manifest(path)
    assert m.info.grid == GRID and m.info.has_mask
    assert sorted(e["split"] for e in m.shards) == ["train", "val"]
    assert S.verify(path) == []
    before = _mtimes(path)

    def no_rewrite(*a, **k):
        raise AssertionError("generated again")

    monkeypatch.setattr(synth, "write_synthetic", no_rewrite)
    assert synth.ensure_synthetic(cfg, GRID, log=logs.append) == path
    assert len(logs) == 1
    assert _mtimes(path) == before
    assert leftovers(tmp_path / "cache") == [path.name]
    # other settings: another folder
    monkeypatch.undo()
    other = synth.ensure_synthetic(_syn_cfg(tmp_path, seed=1), GRID, log=logs.append)
    assert other != path and len(logs) == 2


def test_ensure_synthetic_interrupted_leaves_no_data_set(tmp_path, monkeypatch):
    cfg = _syn_cfg(tmp_path, train_scenes=3)
    real, calls = synth.make_scene, []

    def flaky(*a, **k):
        calls.append(a)
        if len(calls) == 3:  # mid-generation: shards already written in the temporary folder
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(synth, "make_scene", flaky)
    with pytest.raises(KeyboardInterrupt):
        synth.ensure_synthetic(cfg, GRID, log=lambda s: None)
    assert len(calls) == 3
    assert leftovers(tmp_path / "cache") == []  # neither the final name nor the temporary
    monkeypatch.undo()
    path = synth.ensure_synthetic(cfg, GRID, log=lambda s: None)  # a later run generates it whole
    assert S.verify(path) == [] and sum(e["scenes"] for e in S.load_manifest(path).shards) == 4


def test_ensure_synthetic_refuses_damaged_cache(tmp_path):
    cfg = _syn_cfg(tmp_path)
    path = synth.ensure_synthetic(cfg, GRID, log=lambda s: None)
    (path / S.MANIFEST).write_text("{")
    msg = refused(synth.ensure_synthetic, cfg, GRID, log=lambda s: None)
    assert str(path / S.MANIFEST) in msg


def test_ensure_synthetic_concurrent_generation(tmp_path, monkeypatch):
    cfg = _syn_cfg(tmp_path)
    real = synth.write_synthetic
    final = {}

    def racing(out, *a, **k):
        m = real(out, *a, **k)
        # meanwhile another rank finished the same data set under the final name
        real(final["path"], *a, **k)
        return m

    path = synth.ensure_synthetic(cfg, GRID, log=lambda s: None)
    SW._remove(path)
    final["path"] = path
    monkeypatch.setattr(synth, "write_synthetic", racing)
    assert synth.ensure_synthetic(cfg, GRID, log=lambda s: None) == path
