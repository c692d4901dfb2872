"""The airside style (wm/data/synthetic/airside.py): its class set, determinism, Occ3D's statistics at the
demo's grid and at Occ3D's, classes that really move, the unlabelled ego, a written data set, and the
cache names of the road styles kept as they were."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from wm.data import stats as S
from wm.data.synthetic import generate as synth
from wm.data.synthetic import airside as air
from wm.utils.errors import DataError

CLASSES, FREE, MOVING = air.AIRSIDE_CLASSES, air.AIRSIDE_FREE, air.AIRSIDE_MOVING
C = {n: i for i, n in enumerate(CLASSES)}
STATIC = ("apron", "marking", "grass", "terminal", "jet_bridge", "light_mast", "traffic_cone", "others")
GROUND = ("apron", "marking", "grass")


def scene(index, grid, frames, seed=0, mask=True):
    return synth.make_scene(seed, index, grid, frames, mask, style="airside")


def test_the_class_set_is_fixed_and_declared_in_the_manifest_info():
    # other code uses these names and ids
    assert CLASSES == ("others", "aircraft", "tug", "baggage_cart", "belt_loader", "service_truck",
                       "passenger_stairs", "bus", "person", "traffic_cone", "apron", "marking", "grass",
                       "terminal", "jet_bridge", "light_mast", "free")
    assert FREE == 16 and CLASSES[FREE] == "free" and len(set(CLASSES)) == 17
    assert MOVING == ("aircraft", "tug", "baggage_cart", "belt_loader", "service_truck", "passenger_stairs",
                      "bus", "person")
    assert len(CLASSES) - 1 >= 10 and len(MOVING) >= 5 and set(MOVING) <= set(CLASSES) - {"free"}
    info = synth.dataset_info((64, 64, 8), True, "airside")
    assert (info.num_classes, info.free_class, info.class_names, info.moving_classes) == (17, 16, CLASSES, MOVING)
    # a colour for every class but free, all different, in the form the pictures read
    from wm.data.viz import class_palette, parse_colors

    assert set(info.class_colors) == set(CLASSES) - {"free"}
    assert parse_colors(info.class_colors, CLASSES, "class_colors") == info.class_colors
    pal = class_palette(CLASSES, FREE, info.class_colors)
    assert len({tuple(c) for c in pal}) == 17
    # the road styles' manifests are as they were: Occ3D's classes, no colour or moving keys
    for style in ("occ3d", "blocks"):
        d = synth.dataset_info((64, 64, 8), True, style).to_json()
        assert d == synth.dataset_info((64, 64, 8), True).to_json()
        assert d["num_classes"] == 18 and not {"class_colors", "moving_classes"} & set(d)
    from wm.config.sections import SyntheticConfig

    SyntheticConfig(style="airside").validate()


def test_same_seed_same_bytes_another_seed_or_scene_others():
    a, b = scene(2, (64, 64, 8), 4, seed=4), air.make_scene(4, 2, (64, 64, 8), 4, True, 0)
    assert all(np.array_equal(a[k], b[k]) for k in ("occ", "mask", "pose", "timestamp")) and a["name"] == b["name"]
    assert a["occ"].dtype == np.uint8 and a["occ"].max() == FREE and a["mask"].dtype == np.uint8
    assert not np.array_equal(a["occ"], scene(2, (64, 64, 8), 4, seed=5)["occ"])
    assert not np.array_equal(a["occ"], scene(3, (64, 64, 8), 4, seed=4)["occ"])


@pytest.mark.parametrize("grid,scenes,frames", [((64, 64, 8), range(12), 6), ((200, 200, 16), [3], 3)])
def test_statistics_lie_within_occ3ds_bands(grid, scenes, frames):
    """The occupied share, every height level and the visible share within compare's bands (class
    groups are Occ3D's names, so there are none here)."""
    counts = None
    for i in scenes:
        s = scene(i, grid, frames)
        counts = S.add_counts(counts, S.frame_counts(s["occ"], FREE, len(CLASSES), s["mask"]))
    st = S.stats_from_counts(counts, FREE, CLASSES)
    rows = S.compare(st)
    assert "groups" not in st and len(rows) == 1 + grid[2] + 1
    out = [(w, round(v, 2), round(lo, 2), round(hi, 2)) for w, v, lo, hi, ok in rows if not ok]
    assert not out, out
    # what an apron holds shows up over a dozen scenes (small things too)
    expected = {"aircraft", "tug", "baggage_cart", "belt_loader", "service_truck", "person", "traffic_cone",
                "apron", "marking", "terminal", "jet_bridge", "light_mast"}
    assert len(scenes) == 1 or set(st["classes"]) >= expected


def _static_shift(f0, f1, most=8):
    """Rows the static scene moved by from frame f0 to f1 (the ego drives +x): the shift under which
    every static voxel of one frame is the same in the other."""
    static = [C[n] for n in STATIC]
    s0, s1, X = np.isin(f0, static), np.isin(f1, static), f0.shape[0]
    bad = [np.count_nonzero((s0[d:] | s1[:X - d]) & (f0[d:] != f1[:X - d])) for d in range(most)]
    assert min(bad) == 0, "no shift maps the static scene onto itself"
    return int(np.argmin(bad))


def _centroid_moves(occ):
    """Per class: the displacement of its voxels' centroid from each frame to the next, with the ego's
    motion taken out (in voxels, over the rows both frames see), summed over the scene; and per step
    the number of moving classes whose centroid moved."""
    total, per_step = {}, []
    for t in range(len(occ) - 1):
        d = _static_shift(occ[t], occ[t + 1])
        a, b = occ[t][d:], occ[t + 1][:occ.shape[1] - d]
        moved = 0
        for c in range(len(CLASSES) - 1):
            pa, pb = np.argwhere(a == c), np.argwhere(b == c)
            if len(pa) and len(pb):
                step = float(np.linalg.norm(pa.mean(0) - pb.mean(0)))
                total[CLASSES[c]] = total.get(CLASSES[c], 0.0) + step
                moved += CLASSES[c] in MOVING and step > 0
        per_step.append(moved)
    return total, per_step


def test_five_moving_classes_move_and_the_static_scene_stays():
    occ = scene(0, (64, 64, 8), 40, mask=False)["occ"]
    total, per_step = _centroid_moves(occ)
    assert all(total.get(n, 0.0) == 0.0 for n in STATIC), total  # parked on the grid as the apron is
    moving = [n for n in MOVING if total.get(n, 0.0) > 1.0]
    assert len(moving) >= 5, total
    assert "aircraft" in moving  # a pushback or an arrival in every scene
    # several things on the move in most steps: what copy-last-frame cannot forecast
    assert np.mean(np.array(per_step) >= 3) > 0.8, per_step


@pytest.mark.parametrize("grid,frames", [((64, 64, 8), 12), ((200, 200, 16), 2)])
def test_the_ego_is_not_labelled_and_nothing_comes_near_it(grid, frames):
    """The ego's footprint (4.8 x 2 m at the grid's centre, and a metre around it where the voxels
    resolve one) is free from the road up to 2 m: the ego is not labelled, no agent reaches it."""
    X, Y, Z = grid
    vx, vy, vz = 80 / X, 80 / Y, 6.4 / Z
    margin = max(0.0, 1.0 - max(vx, vy))
    xs, ys = (np.arange(X) + 0.5) * vx - 40, (np.arange(Y) + 0.5) * vy - 40
    foot = (np.abs(xs)[:, None] <= 2.4 + margin) & (np.abs(ys)[None, :] <= 1.0 + margin)
    for i in (0, 1, 2):
        for frame in scene(i, grid, frames, mask=False)["occ"]:
            cols = frame[foot]  # (columns, Z)
            ground = np.isin(cols, [C[n] for n in GROUND])
            assert ground.any(1).all()  # the road under the ego is labelled
            road = ground.argmax(1)[:, None]
            z = np.arange(Z)[None, :]
            above = (z > road) & (z <= road + int(np.ceil(2.0 / vz)))
            assert (cols[above] == FREE).all(), np.unique(cols[above])


def test_a_written_airside_data_set_declares_its_classes(tmp_path):
    from wm.config.sections import DataConfig
    from wm.data.windows import check_against_config
    from wm.data.shards import load_manifest, open_split

    grid = (32, 32, 4)
    synth.write_synthetic(tmp_path / "air", 2, 1, frames=3, grid=grid, kind="memmap", style="airside")
    raw = json.loads((tmp_path / "air" / "manifest.json").read_text())
    assert raw["class_names"] == list(CLASSES) and raw["free_class"] == 16 and raw["num_classes"] == 17
    assert raw["moving_classes"] == list(MOVING) and raw["class_colors"] == air.AIRSIDE_COLORS
    m, shards = open_split(tmp_path / "air", "train")
    assert m.info.class_names == CLASSES and m.info.moving_classes == MOVING
    occ = shards[0].read("occ", 0, 3)
    assert occ.max() == FREE and (occ == C["apron"]).any()
    # Occ3D's class count left in the config is refused in one line that names the setting and the value
    with pytest.raises(DataError) as e:
        check_against_config(load_manifest(tmp_path / "air"), DataConfig(grid=grid))
    msg = str(e.value)
    assert "\n" not in msg and "data.num_classes" in msg and "17 classes" in msg
    with pytest.raises(DataError, match=r"free class is 16 but data.free_class is 17"):
        check_against_config(m, DataConfig(grid=grid, num_classes=17))
    check_against_config(m, DataConfig(grid=grid, num_classes=17, free_class=16))


def test_the_road_styles_keep_their_cache_names(tmp_path, monkeypatch):
    """ensure_synthetic's folder name hashes the settings with a generator number per style: occ3d's
    and blocks' are as before (their generated sets are found again), airside has its own."""
    from wm.config.sections import SyntheticConfig

    made = []

    def fake_write(out, *a, style, **k):
        made.append(style)
        Path(out).mkdir()

    monkeypatch.setattr(synth, "write_synthetic", fake_write)
    for style, generator in (("occ3d", 2), ("blocks", 1), ("airside", 3)):
        cfg = SyntheticConfig(style=style, cache_dir=str(tmp_path))
        key = {"train_scenes": cfg.train_scenes, "val_scenes": cfg.val_scenes, "frames": cfg.frames,
               "seed": cfg.seed, "format": cfg.format, "compression": cfg.compression, "with_mask": cfg.with_mask,
               "grid": [64, 64, 8], "generator": generator}
        name = "synthetic-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        assert synth.ensure_synthetic(cfg, (64, 64, 8), log=lambda s: None).name == name
    assert made == ["occ3d", "blocks", "airside"]
