"""Windows, the dataset, the resumable sampler and the DataLoader wiring (wm/data/windows.py)."""

import math

import numpy as np
import pytest
import torch

from wm.config.runtime import LoaderConfig
from wm.config.sections import DataConfig
from wm.data.shards import DatasetInfo, Manifest
from wm.data.windows import OccWindows, ResumableSampler, make_loader, relative_motion, window_index
from wm.data.writer import ShardWriter
from wm.utils.errors import DataError

GRID = (8, 8, 2)


def yaw_pose(x, y, yaw):
    c, s = math.cos(yaw), math.sin(yaw)
    p = np.eye(4)
    p[:2, :2] = [[c, -s], [s, c]]
    p[:2, 3] = [x, y]
    return p


def write_set(root, scene_lens, kind="hdf5", has_mask=True, split="train", seed=0):
    """A data set whose frame f (global, in writing order) is filled with (f % 17) and whose ego
    drives along x at 1 m/frame turning 0.1 rad/frame: every value can be checked by hand."""
    info = DatasetInfo(grid=GRID, has_mask=has_mask)
    root.mkdir(parents=True, exist_ok=True)
    f0, scenes = 0, []
    with ShardWriter(root / f"{split}-0{'.h5' if kind == 'hdf5' else '.mm'}", kind, info) as w:
        for si, n in enumerate(scene_lens):
            ids = np.arange(f0, f0 + n)
            occ = np.broadcast_to((ids % 17).astype(np.uint8)[:, None, None, None], (n, *GRID)).copy()
            pose = np.stack([yaw_pose(float(k), 0.0, 0.1 * k) for k in range(n)])
            mask = (occ % 2).astype(np.uint8) if has_mask else None
            w.add_scene(f"s{si}", occ, pose, np.arange(n) * 500_000, mask)
            scenes.append((occ, pose))
            f0 += n
        entry = w.close()
    Manifest(root, info, [{**entry, "split": split}]).write()
    return scenes


def cfg(**kw):
    base = dict(grid=GRID, past=2, future=1, stride=1, batch_size=2)
    base.update(kw)
    return DataConfig(**base)


# ---------------------------------------------------------------------------------------------
# window index


def test_window_index_respects_scene_boundaries(tmp_path):
    write_set(tmp_path, [5, 3, 8])
    ds = OccWindows(tmp_path, "train", cfg(past=2, future=1))  # span 3
    # scene 0 (frames 0-4): starts 0,1,2; scene 1 (5-7): 5; scene 2 (8-15): 8..13
    assert ds.index[:, 1].tolist() == [0, 1, 2, 5, 8, 9, 10, 11, 12, 13]
    assert (ds.index[:, 0] == 0).all()


def test_window_index_with_stride_and_step(tmp_path):
    write_set(tmp_path, [5, 3, 8])
    ds = OccWindows(tmp_path, "train", cfg(past=2, future=1, stride=2))  # 3 frames span 5
    assert ds.index[:, 1].tolist() == [0, 8, 9, 10, 11]  # scene 1 (3 frames) has none
    ds = OccWindows(tmp_path, "train", cfg(past=1, future=1, window_step=3))  # span 2
    # scene 0: 0,3; scene 1: 5; scene 2 (8-15, starts 8..14): 8, 11, 14
    assert ds.index[:, 1].tolist() == [0, 3, 5, 8, 11, 14]


def test_window_index_over_several_shards():
    class Fake:  # window_index only needs scene_offsets
        def __init__(self, o):
            self.scene_offsets = np.array(o)

    idx = window_index([Fake([0, 2, 6]), Fake([0, 4])], span=3)
    assert idx.tolist() == [[0, 2], [0, 3], [1, 0], [1, 1]]


def test_window_longer_than_every_scene(tmp_path):
    write_set(tmp_path, [4, 3])
    with pytest.raises(DataError, match=r"manifest.json.*data.past=3.*spans 5 frames.*longest scene.*has 4"):
        OccWindows(tmp_path, "train", cfg(past=3, future=2))


def test_max_windows_spreads_evenly(tmp_path):
    write_set(tmp_path, [12])
    ds = OccWindows(tmp_path, "train", cfg(past=1, future=1, max_windows=3))  # 11 windows
    assert ds.index[:, 1].tolist() == [0, 5, 10]


# ---------------------------------------------------------------------------------------------
# items


@pytest.mark.parametrize("kind", ["hdf5", "memmap"])
def test_item_frames_motion_and_mask(tmp_path, kind):
    scenes = write_set(tmp_path, [4, 9], kind=kind)
    ds = OccWindows(tmp_path, "train", cfg(past=2, future=2, stride=2, use_mask=True))  # span 7
    assert len(ds) == 3  # scene 1, starts 0,1,2 (global frames 4,5,6)
    item = ds[1]  # scene 1 frames 1,3,5,7
    occ1, _ = scenes[1]
    assert item["occ"].dtype == torch.uint8 and item["occ"].shape == (4, *GRID)
    assert torch.equal(item["occ"], torch.from_numpy(occ1[1:8:2]))
    # global frame ids 5,7,9,11 -> values 5,7,9,11 -> mask = value % 2 = 1
    assert item["occ"][:, 0, 0, 0].tolist() == [5, 7, 9, 11]
    assert torch.equal(item["mask"], item["occ"] % 2)
    # ego at x=k with yaw 0.1k; last past frame is scene frame 3 (x=3, yaw 0.3).
    # Frame k in that frame: dx = k-3 rotated by -0.3, yaw = 0.1(k-3).
    m = item["motion"]
    for j, k in enumerate([1, 3, 5, 7]):
        d = k - 3
        assert m[j, 0].item() == pytest.approx(d * math.cos(-0.3), abs=1e-5)
        assert m[j, 1].item() == pytest.approx(d * math.sin(-0.3), abs=1e-5)
        assert m[j, 2].item() == pytest.approx(0.1 * d, abs=1e-6)
    assert item["index"].item() == 1


def test_relative_motion_wraps_yaw():
    poses = np.stack([yaw_pose(0, 0, 3.0), yaw_pose(0, 0, -3.0)])
    m = relative_motion(poses, 0)
    assert m[1, 2] == pytest.approx(2 * math.pi - 6.0, abs=1e-6)  # -6 rad wraps to +0.283


def test_no_mask_unless_asked(tmp_path):
    write_set(tmp_path, [4])
    assert "mask" not in OccWindows(tmp_path, "train", cfg())[0]


def test_class_id_out_of_range_found_at_read(tmp_path):
    write_set(tmp_path, [6], kind="memmap", has_mask=False)
    occ = np.load(tmp_path / "train-0.mm" / "occ.npy", mmap_mode="r+")
    occ[4, 1, 1, 0] = 40  # a converter bug the writer did not see
    occ.flush()
    del occ
    ds = OccWindows(tmp_path, "train", cfg())  # span 3: windows 0-3
    assert ds[1]["occ"].max() < 18  # frames 1-3 are fine
    for i in (2, 3):  # frames 2-4 and 3-5 hold the bad id: refused, never silently clipped
        with pytest.raises(DataError, match=r"train-0.mm.*'occ' frames .*class id 40 >= num_classes 18"):
            ds[i]


# ---------------------------------------------------------------------------------------------
# sampler


def rank_lists(n, ws, **kw):
    return [list(ResumableSampler(n, ws, r, **kw)) for r in range(ws)]


def interleave(lists):
    return [x for group in zip(*lists) for x in group]


def test_sampler_epoch_covers_every_window_once_with_padding():
    lists = rank_lists(10, 3, seed=1)
    assert [len(x) for x in lists] == [4, 4, 4]
    order = ResumableSampler(10, 3, 0, seed=1).order().tolist()
    seq = interleave(lists)
    assert seq == order + order[:2]  # padding wraps to the start of the order
    assert sorted(set(seq)) == list(range(10))


def test_sampler_epoch_drop_last():
    lists = rank_lists(10, 3, seed=1, drop_last=True)
    order = ResumableSampler(10, 3, 0, seed=1).order().tolist()
    assert [len(x) for x in lists] == [3, 3, 3]
    assert interleave(lists) == order[:9]
    assert len(set(interleave(lists))) == 9


def test_sampler_order_depends_on_seed_and_epoch_only():
    a, b = ResumableSampler(50, 1, 0, seed=3), ResumableSampler(50, 4, 2, seed=3)
    assert a.order().tolist() == b.order().tolist()
    assert a.order(0).tolist() != a.order(1).tolist()
    assert a.order(0).tolist() != ResumableSampler(50, seed=4).order(0).tolist()
    assert sorted(a.order(5).tolist()) == list(range(50))
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("ws_a,ws_b", [(1, 2), (2, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_resume_on_another_world_size(ws_a, ws_b, drop_last):
    n, seed = 23, 7
    # run on ws_a for 2 steps of 2 samples per rank, save the state
    before = [ResumableSampler(n, ws_a, r, seed=seed, drop_last=drop_last) for r in range(ws_a)]
    consumed = []
    iters = [iter(s) for s in before]
    for _ in range(2):
        for _ in range(2):
            consumed += [next(it) for it in iters]
        for s in before:
            s.advance(2 * ws_a)
    state = before[0].state_dict()
    assert state["consumed"] == 4 * ws_a and state["epoch"] == 0
    # resume on ws_b
    after = []
    for r in range(ws_b):
        s = ResumableSampler(n, ws_b, r, seed=seed, drop_last=drop_last)
        s.load_state_dict(state)
        after.append(list(s))
    order = before[0].order().tolist()
    k = 4 * ws_a
    assert sorted(consumed) == sorted(order[:k])
    rest = interleave(after) if len({len(x) for x in after}) == 1 else None
    left = n - k
    per = left // ws_b if drop_last else math.ceil(left / ws_b)
    assert [len(x) for x in after] == [per] * ws_b
    expect = (order + order)[k:k + per * ws_b]  # what the uninterrupted order continues with
    assert rest == expect
    if not drop_last:  # every window of the epoch seen exactly once before any repeat
        assert sorted(set(consumed + rest)) == list(range(n))


def test_sampler_advance_rolls_epoch_and_state_checks():
    s = ResumableSampler(10, 2, 0, seed=0)
    assert s.epoch_samples() == 10
    s.advance(6)
    assert (s.epoch, s.consumed, len(s)) == (0, 6, 2)
    s.advance(4)
    assert (s.epoch, s.consumed) == (1, 0)
    t = ResumableSampler(11, 2, 0, seed=0)
    with pytest.raises(DataError, match="walked 10 windows but the data now has 11"):
        t.load_state_dict(s.state_dict())
    u = ResumableSampler(10, 2, 0, seed=1)
    with pytest.raises(DataError, match="seed=0"):
        u.load_state_dict(s.state_dict())


# ---------------------------------------------------------------------------------------------
# loader


def test_loader_with_two_workers_over_hdf5(tmp_path):
    write_set(tmp_path, [6, 7, 5])
    c = cfg(past=2, future=1, batch_size=3, use_mask=True)
    ds = OccWindows(tmp_path, "train", c)
    assert all(s._h5 is None for s in ds.shards)  # nothing open in the parent: workers open lazily
    sampler = ResumableSampler(len(ds), seed=5)
    loader = make_loader(ds, sampler, LoaderConfig(num_workers=2, prefetch_factor=2), c.batch_size)
    expect = list(sampler)
    for epoch in range(2):  # persistent workers: the second epoch reuses them
        got = []
        for b in loader:
            assert b["occ"].shape == (3, 3, *GRID) and b["occ"].dtype == torch.uint8
            for j, i in enumerate(b["index"].tolist()):
                ref = ds[i]
                assert torch.equal(b["occ"][j], ref["occ"]) and torch.equal(b["mask"][j], ref["mask"])
                assert torch.equal(b["motion"][j], ref["motion"])
            got += b["index"].tolist()
        assert got == expect[:len(got)] and len(got) == len(ds) // 3 * 3
        sampler.set_epoch(epoch + 1)
        expect = list(sampler)
    assert loader._iterator is not None and loader._iterator._persistent_workers


@pytest.mark.parametrize("ws,pos", [(1, 0), (2, 6), (3, 5)])
def test_epoch_batches_are_each_epochs_drop_last_batches_one_after_another(ws, pos):
    """The endless batch sampler yields, from a mid-epoch position, what a per-epoch loader with
    drop_last would: the rest of the epoch in whole batches, then each next epoch's."""
    from wm.data.windows import EpochBatches

    n, b = 23, 2
    for r in range(ws):
        s = ResumableSampler(n, ws, r, seed=3, drop_last=True)
        s.advance(pos)
        got = iter(EpochBatches(s, b))
        want, e, c = [], 0, pos
        for _ in range(3):  # the rest of epoch 0, then epochs 1 and 2
            idx = s.indices(e, c)
            want += [idx[k * b:(k + 1) * b] for k in range(len(idx) // b)]
            e, c = e + 1, 0
        assert [next(got) for _ in range(len(want))] == want
        assert (s.epoch, s.consumed) == (0, pos)  # iterating does not move the sampler: the loop does
    with pytest.raises(DataError, match="fewer than one batch of 4"):
        next(iter(EpochBatches(ResumableSampler(5, 2, 0, drop_last=True), 4)))


def test_batch_stream_runs_through_epochs_on_one_loader_iterator(tmp_path):
    """Training's stream over the endless loader: the same batches and the same sampler state after
    every batch as a loader started again at each epoch, and one worker iterator for every epoch."""
    import wm.training.loop as L

    write_set(tmp_path, [6, 7, 5])
    c = cfg(past=2, future=1)
    ds = OccWindows(tmp_path, "train", c)
    lc = LoaderConfig(num_workers=2, prefetch_factor=2)
    streams = []
    for endless in (True, False):
        s = ResumableSampler(len(ds), seed=5, drop_last=True)
        s.advance(3)  # a resumed run: mid-epoch
        streams.append(L.BatchStream(make_loader(ds, s, lc, 5, endless=endless), s, 5))
    first = streams[0].it
    per_epoch = len(ds) // 5  # 12 windows: 2 batches and a tail of 2 an epoch
    for _ in range(3 * per_epoch):
        a, b = (st() for st in streams)
        assert a["index"].tolist() == b["index"].tolist()
        assert streams[0].sampler.state_dict() == streams[1].sampler.state_dict()
    assert streams[0].sampler.epoch >= 2 and streams[0].it is first
    for st in streams:
        st.it = None
