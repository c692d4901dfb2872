"""Data statistics (wm/data/stats.py) and the synthetic scenes held to Occ3D's (wm/data/synthetic/occ3d.py)."""

import numpy as np
import pytest

from wm.data import stats as S
from wm.data.shards import OCC3D_CLASSES
from wm.data.synthetic import generate as synth, occ3d
from wm.data.synthetic.road import DT, FREE

FREE = 17


def test_reference_bands_are_the_two_frames_within_a_factor_of_2():
    ref = S.reference_bands(16)
    assert ref["occupied"] == pytest.approx((4.86 / 2, 6.11 * 2))
    # vehicles: frame 1 car .27 + bus .15 + motorcycle .01; frame 2 car .07 + construction .11 +
    # bicycle .01 + motorcycle .005
    assert ref["groups"]["vehicles"] == pytest.approx((0.0, 0.43 * 2))  # moving objects: from 0
    assert ref["groups"]["ground"] == pytest.approx(((1.32 + 0.41 + 0.16) / 2, (1.29 + 0.73 + 0.09 + 0.18) * 2))
    assert ref["height"][0] == pytest.approx((6.6 / 2, 28.9 * 2))
    assert ref["height"][2] == pytest.approx((3.6 / 2, 18.3 * 2))
    # 8 levels: each is the mean of the two 0.4 m levels it covers
    assert S.reference_bands(8)["height"][0] == pytest.approx(((6.6 + 8.1) / 4, (28.9 + 6.9)))
    assert ref["visible"] == pytest.approx((6.8 / 2, 16.8 * 2))


def test_each_public_occ3d_frame_lies_within_the_reference():
    """Real Occ3D-nuScenes frames must pass: neither public frame has a pedestrian, so a frame (or a
    sample of frames) without moving objects is inside the range."""
    for f in S.OCC3D_FRAMES:
        for visible in ("camera_visible", "lidar_visible"):
            stats = {"occupied": f["occupied"], "groups": S.group_shares(f["classes"]), "height": list(f["height"]),
                     "visible": f[visible]}
            assert [r for r in S.compare(stats) if not r[-1]] == []
    ref = S.reference_bands(16)
    assert ref["groups"]["people"] == (0.0, S.PEOPLE_BAND[1]) and ref["groups"]["vehicles"][0] == 0.0


def test_frame_stats_by_hand():
    f = np.full((2, 4, 4, 2), FREE, np.uint8)
    f[0, :, :, 0] = OCC3D_CLASSES.index("driveable_surface")  # 16 voxels
    f[1, 0, 0, 1] = OCC3D_CLASSES.index("car")  # 1 voxel
    mask = np.zeros_like(f)
    mask[0] = 1  # 32 of 64 voxels
    st = S.frame_stats(f, FREE, mask)
    assert st["occupied"] == pytest.approx(100 * 17 / 64)
    assert st["classes"] == pytest.approx({"driveable_surface": 100 * 16 / 64, "car": 100 / 64})
    assert st["groups"]["ground"] == pytest.approx(25.0) and st["groups"]["vehicles"] == pytest.approx(100 / 64)
    assert st["height"] == pytest.approx([100 * 16 / 32, 100 / 32])
    assert st["visible"] == pytest.approx(50.0)
    # counts add up over batches to the same figures
    c = S.add_counts(S.frame_counts(f[:1], FREE, 18, mask[:1]), S.frame_counts(f[1:], FREE, 18, mask[1:]))
    assert S.stats_from_counts(c, FREE) == st
    rows = {w: ok for w, _, _, _, ok in S.compare(st)}
    assert rows["occupied"] is False and rows["height z=1"] is True  # 3.1 % within [3.2 / 2, 4.29 * 2]


@pytest.mark.parametrize("grid,scenes,frames", [((64, 64, 8), 12, 4), ((200, 200, 16), 6, 2)])
def test_synthetic_scenes_look_like_occ3d(grid, scenes, frames):
    """Class groups, occupancy by height, occupied and visible shares all within a factor of 2 of
    the two Occ3D frames, at the demo's grid and at Occ3D's."""
    counts = None
    for i in range(scenes):
        s = synth.make_scene(0, i, grid, frames, with_mask=True, style="occ3d")
        counts = S.add_counts(counts, S.frame_counts(s["occ"], FREE, 18, s["mask"]))
    st = S.stats_from_counts(counts, FREE)
    out = [(w, round(v, 3), round(lo, 3), round(hi, 3)) for w, v, lo, hi, ok in S.compare(st) if not ok]
    assert not out, out
    assert len(S.compare(st)) == 1 + 5 + grid[2] + 1
    # every Occ3D class shows up (small ones too: the metrics need them)
    assert set(st["classes"]) >= {"car", "pedestrian", "truck", "bus", "bicycle", "motorcycle", "manmade", "vegetation"}


def test_synthetic_walls_are_surfaces_not_blocks():
    """Buildings are facades: a building column's wall is seen from the street, its inside is not."""
    s = synth.make_scene(0, 1, (200, 200, 16), 1, with_mask=False, style="occ3d")
    occ = s["occ"][0]
    manmade = occ == OCC3D_CLASSES.index("manmade")
    tall = manmade.sum(-1) >= 8  # columns of building wall
    assert tall.sum() > 50
    # a wall column has free space beside it on some side (no 3x3 block of wall columns anywhere)
    inner = tall[1:-1, 1:-1] & tall[:-2, 1:-1] & tall[2:, 1:-1] & tall[1:-1, :-2] & tall[1:-1, 2:]
    assert inner.sum() < 0.05 * tall.sum()


def test_traffic_moves_like_nuscenes_at_2hz():
    rng = np.random.default_rng(3)
    vox = (0.4, 0.4, 0.4)
    street = occ3d._street(rng, 600.0, vox, 16)
    agents = occ3d._trajectories(rng, street, 40, 20.0, (np.full(40, -100.0), np.zeros(40)))
    cars = [a for a in agents if a[0] == OCC3D_CLASSES.index("car")]
    peds = [a for a in agents if a[0] == OCC3D_CLASSES.index("pedestrian")]
    assert len(cars) > 40 and len(peds) > 60

    def speeds(a):
        return np.hypot(np.diff(a[4]), np.diff(a[5])) / DT

    v_car = np.concatenate([speeds(a) for a in cars])
    assert v_car.max() <= 15.0 + 1e-6 and (v_car > 8).any()
    v_ped = np.concatenate([speeds(a) for a in peds])
    assert v_ped.max() <= 2.0 + 1e-6 and ((v_ped > 0.9) & (v_ped <= 2.0)).mean() > 0.5
    # some cars stop and go again; some turn (into the cross streets)
    stop_go = [a for a in cars if (speeds(a) < 0.05).any() and (speeds(a) > 3).any()]
    turned = [a for a in cars if np.ptp(a[6]) > np.pi / 3]
    assert stop_go and turned
    ex, _ = occ3d._ego(np.random.default_rng(0), 40)
    assert (np.diff(ex) / DT <= 14.0 + 1e-6).all()


def test_synthetic_is_deterministic_and_masks_look_like_a_sensor():
    a = synth.make_scene(5, 2, (64, 64, 8), 3, style="occ3d")
    b = synth.make_scene(5, 2, (64, 64, 8), 3, style="occ3d")
    assert all(np.array_equal(a[k], b[k]) for k in ("occ", "mask", "pose", "timestamp"))
    m = a["mask"][0].astype(bool)
    # the sensor sees the voxels around it and not everything: far corners behind walls are hidden
    assert m[28:36, 28:36, :3].mean() > 0.9
    assert 0.03 < m.mean() < 0.4


def test_blocks_style_is_the_first_generator_and_a_bad_style_is_refused():
    """synthetic.style picks the generator: "blocks" fills every column from a full ground slab (the
    demo's default scenes), "occ3d" labels observed surfaces; any other name is refused in one line."""
    from wm.config.sections import ConfigError, SyntheticConfig
    from wm.utils.errors import DataError

    grid = (64, 64, 8)
    b = synth.make_scene(0, 3, grid, 2, True, 1, style="blocks")
    o = synth.make_scene(0, 3, grid, 2, True, 1, style="occ3d")
    occupied_b = (b["occ"] != FREE).mean()
    assert occupied_b > 0.15 and (b["occ"][..., 0] != FREE).all()  # a full ground slab
    assert (o["occ"] != FREE).mean() < occupied_b / 2
    again = synth.make_scene(0, 3, grid, 2, True, 1, style="blocks")
    assert all(np.array_equal(b[k], again[k]) for k in ("occ", "pose", "timestamp", "mask"))
    with pytest.raises(DataError, match="style 'solid' must be one of"):
        synth.make_scene(0, 3, grid, 2, style="solid")
    with pytest.raises(ConfigError, match="style"):
        SyntheticConfig(style="solid").validate()
