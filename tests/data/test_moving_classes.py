"""Moving classes belong to the data set (wm.data.stats.moving_classes): the manifest's
`moving_classes` (from classes.json at conversion), `data.moving_classes` over it, and for a data set
that declares none the classes named as nuScenes' moving ones; every table, TensorBoard scalar and
picture of moving objects takes that list."""

import dataclasses
import json

import numpy as np
import pytest

from wm.config.sections import Config, DataConfig
from wm.data.shards import OCC3D_CLASSES, DatasetInfo, load_manifest
from wm.data.stats import NUSCENES_MOVING, moving_classes
from wm.data.synthetic.generate import write_synthetic
from wm.data.viz import bev_pair, class_palette
from wm.data.windows import check_against_config
from wm.evaluation.final_report import final_table, make_summary
from wm.training.stages import class_scalars, val_metrics
from wm.utils.errors import DataError

AIRSIDE = ("free", "apron", "aircraft", "tug", "baggage_cart", "person", "cone", "building")


def airside(**kw) -> DatasetInfo:
    return DatasetInfo(grid=(4, 4, 2), num_classes=len(AIRSIDE), free_class=0, class_names=AIRSIDE, **kw)


def test_moving_classes_are_the_data_sets_own():
    assert moving_classes(DatasetInfo(grid=(4, 4, 2))) == NUSCENES_MOVING  # Occ3D's names: nuScenes' list
    assert moving_classes(airside()) == ()  # other names: none, unless declared
    declared = airside(moving_classes=("aircraft", "tug", "baggage_cart", "person"))
    assert moving_classes(declared) == ("aircraft", "tug", "baggage_cart", "person")
    assert moving_classes(declared, ("tug",)) == ("tug",)  # data.moving_classes wins
    mixed = DatasetInfo(grid=(4, 4, 2), num_classes=4, free_class=0, class_names=("free", "pedestrian", "tree", "car"))
    assert moving_classes(mixed) == ("car", "pedestrian")  # only the nuScenes-named ones, in the table's order
    for bad, words in ((("plane",), "'plane' is not one of the classes"), (("free",), "is the free class"),
                       (("tug", "tug"), "'tug' is named twice")):
        with pytest.raises(DataError, match="moving_classes") as e:
            airside(moving_classes=bad)
        assert words in str(e.value)


def test_manifests_without_the_field_load_with_the_nuscenes_list(tmp_path):
    m = write_synthetic(tmp_path / "s", train_scenes=1, val_scenes=1, frames=3, grid=(8, 8, 2))
    d = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert "moving_classes" not in d  # left out when not declared: fingerprints do not move
    assert moving_classes(load_manifest(tmp_path / "s").info) == NUSCENES_MOVING
    d["moving_classes"] = ["car", "bus"]
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(d))
    assert load_manifest(tmp_path / "s").info.moving_classes == ("car", "bus")
    d["moving_classes"] = ["car", "plane"]
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(DataError, match=r"manifest\.json: moving_classes: 'plane' is not one of the classes"):
        load_manifest(tmp_path / "s")
    # data.moving_classes is checked against the data set's classes before anything trains
    d["moving_classes"] = ["car"]
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(d))
    m = load_manifest(tmp_path / "s")
    check_against_config(m, DataConfig(grid=(8, 8, 2), moving_classes=("bus", "pedestrian")))
    with pytest.raises(DataError, match=r"data\.moving_classes \(data set .*manifest\.json\): 'tug' is not one of the classes"):
        check_against_config(m, DataConfig(grid=(8, 8, 2), moving_classes=("tug",)))
    with pytest.raises(DataError, match=r"data\.moving_classes \(data set .*\): 'free' is the free class"):
        check_against_config(m, DataConfig(grid=(8, 8, 2), moving_classes=("free",)))


def test_validation_metrics_tables_and_pictures_take_the_data_sets_moving_classes():
    moving = ("aircraft", "baggage_cart")
    names = val_metrics("world", 2, AIRSIDE, 0, moving)
    assert "val/class_iou/baggage_cart_t2" in names and "val/copy_last_class_iou/aircraft_t1" in names
    assert "val/class_iou/tug_t1" not in names and "val/class_iou/tug" in names
    assert not any("car_t" in n for n in names)
    summary = {"per_class_avg": [None, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
               "per_class": [[None, 1, 10, 3, 40, 5, 6, 7], [None, 1, 20, 3, 50, 5, 6, 7]]}
    s = class_scalars(summary, AIRSIDE, 0, "val/class_iou/", per_step=moving)
    assert s["val/class_iou/aircraft_t2"] == 20 and s["val/class_iou/baggage_cart_t1"] == 40
    assert "val/class_iou/tug_t1" not in s
    # the final table: every moving class by its whole name, and summary.json
    cfg = Config()
    cfg.data.future = 2
    r = {**s, **class_scalars(summary, AIRSIDE, 0, "val/copy_last_class_iou/", per_step=moving)}
    table = final_table(cfg, {"world": r}, moving=moving).splitlines()
    first = table.index(next(t for t in table if t.startswith("moving classes"))) + 2  # after the step header
    rows = {ln.split()[0]: ln.split() for ln in table[first:]}
    assert set(rows) == {"aircraft", "baggage_cart"}
    assert rows["baggage_cart"][1:4] == ["40.0", "/", "40.0"]
    summ = make_summary(cfg, {"world": r}, moving=moving)["world"]
    assert summ["class_iou"] == {"aircraft": [10, 20], "baggage_cart": [40, 50]}
    # the pictures draw moving objects over what is above them: a tug under a building shows as the tug
    info = airside(moving_classes=("tug",))
    col = np.zeros((1, 2, 2, 2), np.uint8)
    col[0, 0, 0] = [AIRSIDE.index("tug"), AIRSIDE.index("building")]
    pal = class_palette(AIRSIDE, 0)

    def count(img, name):  # pixels of that class's colour (the legend's swatch included, alike in both)
        return int((img.reshape(-1, 3) == pal[AIRSIDE.index(name)]).all(1).sum())

    shown, hidden = bev_pair([col, col], info), bev_pair([col, col], dataclasses.replace(info, moving_classes=()))
    assert count(shown, "tug") > count(hidden, "tug") and count(shown, "building") < count(hidden, "building")


def test_occ3d_runs_keep_their_moving_classes():
    assert NUSCENES_MOVING == ("car", "pedestrian", "truck", "bus", "construction_vehicle", "trailer", "bicycle",
                               "motorcycle")
    assert set(NUSCENES_MOVING) < set(OCC3D_CLASSES)
