"""Visibility masks in memmap shards are stored as bits: one np.packbits plane (little bit order, over
a frame's flattened voxels) per flag bit the shard declares, in mask.bits.npy, the manifest entry
saying "mask_storage": "bits" and "mask_planes". Every reader sees the same uint8 flag values as
from HDF5's bytes and from the memmap shards written before (mask.npy, no mask_storage), which still
read; a value outside the declared bits is refused when written."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from wm.config.sections import DataConfig
from wm.data import writer as SW, shards as S
from wm.data.synthetic.generate import dataset_info, make_scene
from wm.data.windows import OccWindows
import wm.training.main as T
from wm.utils.errors import DataError

from helpers import ROOT  # noqa: E402

BOTH = {"camera": 1, "lidar": 2}


def scenes(grid, frames=(5, 3, 7), bits=None, seed=0) -> list[dict]:
    """Synthetic scenes whose masks take every value the declared bits allow (0..3 for camera | lidar)."""
    rng = np.random.default_rng(seed)
    planes = S.mask_planes(bits)
    out = []
    for i, n in enumerate(frames):
        s = make_scene(seed, i, grid, n, True, style="blocks")
        mask = np.zeros((n, *grid), np.uint8)
        for v in planes:
            mask |= (rng.random((n, *grid)) < 0.5).astype(np.uint8) * np.uint8(v)
        out.append({**s, "mask": mask})
    return out


def write(root, kind, sc, grid, bits=None, split="train"):
    """A one-shard data set of the scenes; the entry carries mask_bits where declared, as converters write."""
    info = dataset_info(grid, True)
    root.mkdir(parents=True, exist_ok=True)
    with SW.ShardWriter(root / f"{split}-0{S.SUFFIX[kind]}", kind, info, mask_bits=bits) as w:
        for s in sc:
            w.add_scene(s["name"], s["occ"], s["pose"], s["timestamp"], s["mask"])
        entry = w.close()
    m = S.Manifest(root, info, [{**entry, "split": split, **({"mask_bits": bits} if bits else {})}])
    m.write()
    return m


def as_bytes(root):
    """Rewrite a bits data set the way memmap shards were written before: mask.npy of uint8 bytes
    (the writer's own .npy appender), no mask fields in attrs.json or the manifest entry."""
    m = S.load_manifest(root)
    for e in m.shards:
        sh = S.Shard(root, e, m.info)
        mask = sh.read("mask", 0, sh.num_frames)
        sh.close()
        p = root / e["path"]
        app = SW._NpyAppender(p / "mask.npy", np.uint8, m.info.grid)
        app.append(mask)
        app.close()
        (p / "mask.bits.npy").unlink()
        attrs = json.loads((p / "attrs.json").read_text())
        for k in ("mask_storage", "mask_planes"):
            attrs.pop(k)
            e.pop(k)
        (p / "attrs.json").write_text(json.dumps(attrs, indent=1, sort_keys=True))
        e.update(bytes=S.shard_size(p), sha256=S.shard_sha256(p))
    m.write()
    return m


def one_line(fn, *a, **kw) -> str:
    with pytest.raises(DataError) as e:
        fn(*a, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


CASES = [((5, 3, 3), None), ((5, 3, 3), BOTH), ((16, 16, 4), None), ((16, 16, 4), BOTH),
         ((5, 3, 3), {"lidar": 2}), ((4, 4, 3), {"a": 1, "b": 4, "c": 8})]


@pytest.mark.parametrize("grid, bits", CASES, ids=[f"{'x'.join(map(str, g))}-{b}" for g, b in CASES])
def test_bits_read_back_what_bytes_do_frame_by_frame_and_in_slices(tmp_path, grid, bits):
    sc = scenes(grid, bits=bits)
    want = np.concatenate([s["mask"] for s in sc])
    if bits == BOTH:
        assert set(np.unique(want)) == {0, 1, 2, 3}  # camera | lidar = 3 among them
    mm = write(tmp_path / "mm", "memmap", sc, grid, bits)
    assert mm.shards[0]["mask_storage"] == "bits" and mm.shards[0]["mask_planes"] == list(S.mask_planes(bits))
    write(tmp_path / "old", "memmap", sc, grid, bits)
    old = as_bytes(tmp_path / "old")
    assert "mask_storage" not in old.shards[0] and (tmp_path / "old" / "train-0.mm" / "mask.npy").is_file()
    h5 = write(tmp_path / "h5", "hdf5", sc, grid, bits)
    assert "mask_storage" not in h5.shards[0]
    opened = [S.open_split(tmp_path / d, "train")[1][0] for d in ("mm", "old", "h5")]
    n = len(want)
    for i in range(n):
        for sh in opened:
            got = sh.read("mask", i, i + 1)
            assert got.dtype == np.uint8 and got.shape == (1, *grid) and got.flags.c_contiguous
            np.testing.assert_array_equal(got, want[i:i + 1])
    rng = np.random.default_rng(1)
    for _ in range(25):
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 3))  # past the end too: numpy's slicing clips
        st = int(rng.integers(1, 5))
        for sh in opened:
            np.testing.assert_array_equal(sh.read("mask", a, b, st), want[a:b:st])
    got = opened[0].read("mask", 0, 2)
    got[:] = 77  # a fresh array, not a view of the file
    np.testing.assert_array_equal(opened[0].read("mask", 0, 2), want[:2])
    for sh in opened:
        sh.close()
    # the windows training reads, with each flag selected and with any nonzero
    for sel in [0] + list(S.mask_planes(bits)):
        cfg = DataConfig(grid=grid, past=2, future=1, stride=2, use_mask=True, mask_bits=sel)
        ds = [OccWindows(tmp_path / d, "train", cfg) for d in ("mm", "old", "h5")]
        for k in range(len(ds[0])):
            ref = ds[2][k]["mask"]
            for d in ds[:2]:
                assert torch.equal(d[k]["mask"], ref), (sel, k)


@pytest.mark.parametrize("grid, bits", [((5, 3, 3), None), ((5, 3, 3), BOTH), ((16, 16, 4), BOTH),
                                        ((7, 1, 1), {"x": 128})])
def test_mask_file_holds_k_bit_planes_a_frame(tmp_path, grid, bits):
    sc = scenes(grid, frames=(4, 9), bits=bits)
    m = write(tmp_path, "memmap", sc, grid, bits)
    k, nb = len(S.mask_planes(bits)), math.ceil(math.prod(grid) / 8)
    f = tmp_path / "train-0.mm" / "mask.bits.npy"
    assert f.stat().st_size == SW._NpyAppender.HEADER + 13 * k * nb  # nothing but the planes after the header
    a = np.load(f, mmap_mode="r")
    assert a.dtype == np.uint8 and a.shape == (13, k, nb)
    assert not (tmp_path / "train-0.mm" / "mask.npy").exists()
    occ = (tmp_path / "train-0.mm" / "occ.npy").stat().st_size
    assert occ == SW._NpyAppender.HEADER + 13 * math.prod(grid)
    attrs = json.loads((tmp_path / "train-0.mm" / "attrs.json").read_text())
    assert (attrs["mask_storage"], attrs["mask_planes"]) == ("bits", list(S.mask_planes(bits)))
    assert m.shards[0]["bytes"] == S.shard_size(tmp_path / "train-0.mm")
    # little bit order along the flattened voxels: voxel j of a frame is bit j % 8 of byte j // 8
    flat = sc[0]["mask"][0].reshape(-1)
    for p, v in enumerate(S.mask_planes(bits)):
        for j in sorted({0, 1, min(8, len(flat) - 1), len(flat) - 1}):
            assert (a[0, p, j // 8] >> (j % 8)) & 1 == int(flat[j] & v != 0)


def test_an_old_bytes_data_set_still_reads_and_verifies(tmp_path):
    grid = (5, 3, 3)
    sc = scenes(grid, bits=BOTH)
    write(tmp_path / "d", "memmap", sc, grid, BOTH)
    m = as_bytes(tmp_path / "d")
    assert S.verify(tmp_path / "d") == []
    assert all("mask_storage" not in e for e in json.loads((tmp_path / "d" / "manifest.json").read_text())["shards"])
    _, (sh,) = S.open_split(tmp_path / "d", "train")
    assert sh.mask_storage == "bytes"
    np.testing.assert_array_equal(sh.read("mask", 0, sh.num_frames, 2), np.concatenate([s["mask"] for s in sc])[::2])
    sh.close()
    assert m.fingerprint == S.load_manifest(tmp_path / "d").fingerprint


@pytest.mark.parametrize("kind, bits, value", [("memmap", None, 2), ("memmap", {"camera": 1}, 3),
                                               ("memmap", BOTH, 4), ("hdf5", {"camera": 1}, 2),
                                               ("memmap", {"lidar": 2}, 1)])
def test_a_mask_value_outside_the_declared_bits_is_refused_in_one_line(tmp_path, kind, bits, value):
    grid = (5, 3, 3)
    good, bad = scenes(grid, frames=(2, 3), bits=bits)
    bad["mask"][2].flat[7] = value
    out = tmp_path / f"x{S.SUFFIX[kind]}"

    def go():
        with SW.ShardWriter(out, kind, dataset_info(grid, True), mask_bits=bits) as w:
            w.add_scene("good", good["occ"], good["pose"], good["timestamp"], good["mask"])
            w.add_scene("bad-scene", bad["occ"], bad["pose"], bad["timestamp"], bad["mask"])
            w.close()

    msg = one_line(go)
    assert str(out) in msg and "'bad-scene'" in msg and f"mask value {value} at frame 2" in msg, msg
    assert "mask_bits" in msg, msg
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_hdf5_without_declared_bits_keeps_any_byte(tmp_path):
    """HDF5 stores the bytes as given: masks of other values than flags still round-trip there."""
    grid = (5, 3, 3)
    (s,) = scenes(grid, frames=(3,))
    s["mask"][1].flat[4] = 200
    m = write(tmp_path, "hdf5", [s], grid)
    _, (sh,) = S.open_split(m.root, "train")
    np.testing.assert_array_equal(sh.read("mask", 0, 3), s["mask"])
    sh.close()


def entry_change(k, v):
    return lambda e: e.update({k: v}) if v is not None else e.pop(k)


@pytest.mark.parametrize("change, words", [
    (entry_change("mask_storage", "packed"), ["'mask_storage'", "'packed'", "expected one of"]),
    (entry_change("mask_planes", [3]), ["'mask_planes'", "[3]", "expected a list of distinct flag values"]),
    (entry_change("mask_planes", [2, 1]), ["'mask_planes'", "[2, 1]"]),
    (entry_change("mask_planes", None), ["mask_storage 'bits'", "no field 'mask_planes'"]),
    (entry_change("mask_planes", [1, 2, 4]), ["'mask' (mask.bits.npy)", "(2, 6)", "expected (3, 6)"]),
    (entry_change("mask_storage", None), ["'mask' is missing (mask.npy)"]),
])
def test_a_manifest_entry_that_disagrees_about_the_mask_is_one_line(tmp_path, change, words):
    grid = (5, 3, 3)
    write(tmp_path, "memmap", scenes(grid, bits=BOTH), grid, BOTH)
    d = json.loads((tmp_path / "manifest.json").read_text())
    change(d["shards"][0])
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    msg = one_line(OccWindows, tmp_path, "train", DataConfig(grid=grid, past=1, future=1, use_mask=True))
    assert "train-0.mm" in msg and all(w in msg for w in words), msg


def test_hdf5_entry_saying_bits_is_refused(tmp_path):
    grid = (5, 3, 3)
    write(tmp_path, "hdf5", scenes(grid, bits=BOTH), grid, BOTH)
    d = json.loads((tmp_path / "manifest.json").read_text())
    d["shards"][0].update(mask_storage="bits", mask_planes=[1, 2])
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    msg = one_line(S.load_manifest, tmp_path)
    assert "train-0.h5" in msg and "HDF5 shard" in msg, msg


def inspect_main():
    spec = importlib.util.spec_from_file_location("inspect_data", ROOT / "tools" / "inspect_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_inspect_data_verify_passes_on_bits_and_names_a_damaged_mask_file(tmp_path, capsys):
    grid = (16, 16, 4)
    write(tmp_path / "d", "memmap", scenes(grid, bits=BOTH), grid, BOTH)
    main = inspect_main()
    assert main([str(tmp_path / "d"), "--verify", "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert "verify: 1/1 shards match the manifest" in out and "masks: yes" in out, out
    f = tmp_path / "d" / "train-0.mm" / "mask.bits.npy"
    a = np.load(f, mmap_mode="r+")
    a[3, 1, 5] ^= 1  # one voxel's lidar bit
    a.flush()
    del a
    assert main([str(tmp_path / "d"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "train-0.mm" in out and "sha256" in out, out


def test_convert_resume_keeps_a_bits_shard_with_its_storage_fields(tmp_path):
    from test_convert import SCENES, make_occ3d, occ3d_convert

    make_occ3d(tmp_path / "src", SCENES)
    out = tmp_path / "out"
    first = occ3d_convert(tmp_path / "src", out, kind="memmap")
    assert all(e["mask_storage"] == "bits" and e["mask_planes"] == [1, 2] for e in first.manifest.shards)
    import shutil

    shutil.rmtree(out / "val-00000.mm")
    (out / "manifest.json").unlink()
    res = occ3d_convert(tmp_path / "src", out, kind="memmap")
    assert sorted(res.kept) == ["train-00000.mm", "train-00001.mm"] and res.written == ["val-00000.mm"]
    assert res.manifest.fingerprint == first.manifest.fingerprint
    assert S.verify(out) == []


@pytest.mark.usefixtures("restore_signals", "one_thread")
def test_training_reads_bit_masks(tiny, monkeypatch):
    """A tiny tokenizer run with data.use_mask on a memmap set of camera | lidar bits: every mask the
    loss sees is the lidar bit of a stored frame."""
    import shutil

    from wm.models.tokenizer import Tokenizer

    grid = (16, 16, 4)
    shutil.rmtree(tiny.data)
    train = scenes(grid, frames=(12, 12), bits=BOTH)
    write(tiny.data, "memmap", train, grid, BOTH)
    info = dataset_info(grid, True)
    with SW.ShardWriter(tiny.data / "val-0.mm", "memmap", info, mask_bits=BOTH) as w:
        (v,) = scenes(grid, frames=(12,), bits=BOTH, seed=5)
        w.add_scene("v", v["occ"], v["pose"], v["timestamp"], v["mask"])
        val = w.close()
    m = S.load_manifest(tiny.data)
    S.Manifest(tiny.data, info, m.shards + [{**val, "split": "val", "mask_bits": BOTH}]).write()
    frames = {((f & 2) != 0).tobytes() for s in train + [v] for f in s["mask"]}
    seen = []
    loss = Tokenizer.loss

    def spy(self, logits, occ, vq, mask=None):
        if mask is not None:
            seen.append(mask.bool().numpy())
        return loss(self, logits, occ, vq, mask=mask)

    monkeypatch.setattr(Tokenizer, "loss", spy)
    assert T.main(tiny.args(tokenizer_stage__max_steps=2, data__use_mask=True, data__mask_bits=2)) == 0
    assert seen
    for batch in seen:
        for f in batch:
            assert f.tobytes() in frames
