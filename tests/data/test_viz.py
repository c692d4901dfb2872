"""Pictures for any class set (wm/data/viz.py): colours from class names, a legend in every picture,
frames enlarged by nearest neighbour to a visible size, and the training logs' TensorBoard images."""

import numpy as np
import pytest

from wm.data.shards import OCC3D_CLASSES
from wm.data.viz import (FREE_COLOUR, GAP_GREY, PALETTE, _FONT, bev, class_palette, draw_text, figure, legend,
    palette, parse_colors)
from wm.utils.errors import DataError

AIRSIDE = ["free", "apron_surface", "aircraft", "tug", "baggage_cart", "belt_loader", "person", "cone",
           "Car", "building", "fence", "pole"]


def test_occ3d_names_keep_occ3d_colours_and_other_names_get_distinct_ones():
    pal = class_palette(AIRSIDE, 0)
    assert (pal[0] == FREE_COLOUR).all()
    assert (pal[AIRSIDE.index("Car")] == PALETTE[OCC3D_CLASSES.index("car")]).all()  # names compare case-blind
    others = [c for c, n in enumerate(AIRSIDE) if n not in ("free", "Car")]
    # belt_loader is class 5: Occ3D's id 5 is construction_vehicle, id 7 pedestrian-red; by name it gets neither
    occ3d_by_id = {tuple(v) for v in PALETTE}
    rgb = [tuple(int(x) for x in pal[c]) for c in others]
    assert not set(rgb) & occ3d_by_id and len(set(rgb)) == len(rgb)
    dist = [np.abs(pal[a].astype(int) - pal[b].astype(int)).sum() for a in range(len(pal)) for b in range(a)]
    assert min(dist) >= 90  # every pair of colours apart (sum of |dR|+|dG|+|dB|)
    # deterministic, and Occ3D's own class list gives exactly Occ3D's palette
    assert (class_palette(AIRSIDE, 0) == pal).all()
    occ = class_palette(OCC3D_CLASSES, 17)
    assert (occ[:17] == PALETTE).all() and (occ[17] == FREE_COLOUR).all()
    assert (palette(18, 17) == occ).all()  # no names, Occ3D's counts: Occ3D
    assert not {tuple(v) for v in palette(12, 0)[1:]} & occ3d_by_id  # no names, other counts: not Occ3D by id


def test_colours_from_classes_json_win():
    colors = parse_colors({"aircraft": "#ff0000", "Car": [1, 2, 3]}, AIRSIDE, "c.json: colors")
    pal = class_palette(AIRSIDE, 0, colors)
    assert pal[2].tolist() == [255, 0, 0] and pal[8].tolist() == [1, 2, 3]
    assert parse_colors([None, [9, 9, 9]] + [None] * 10, AIRSIDE, "x") == {"apron_surface": [9, 9, 9]}
    for bad, words in (({"plane": [1, 2, 3]}, "'plane' is not one of the classes"), ({"tug": "red"}, "[r, g, b]"),
                       ([[1, 2, 3]], "1 colours for 12 classes"), ("red", "expected an object")):
        with pytest.raises(DataError, match=None) as e:
            parse_colors(bad, AIRSIDE, "c.json: colors")
        assert words in str(e.value) and "c.json: colors" in str(e.value)


def test_figure_upscales_a_64_grid_to_256_px_and_has_a_legend_naming_every_class():
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, len(AIRSIDE), (64, 48, 4)).astype(np.uint8) for _ in range(3)]
    img = figure([frames[:2], [frames[2]]], AIRSIDE, 0, titles=["ground truth", "forecast"])
    pal = class_palette(AIRSIDE, 0)
    title_h = 7 * 2 + 4 * 2  # 5x7 font at 2x, padded
    first = bev(frames[0], len(AIRSIDE), 0, pal).repeat(4, 0).repeat(4, 1)  # 64 voxels -> 256 px wide
    assert first.shape[1] == 256
    assert np.array_equal(img[title_h:title_h + first.shape[0], :256], first)
    # the legend: one swatch per class in its colour, under the pictures
    lg = legend(AIRSIDE, pal, img.shape[1], 0, scale=2)
    assert np.array_equal(img[-lg.shape[0]:], lg)
    for c in range(len(AIRSIDE)):
        assert (lg.reshape(-1, 3) == pal[c]).all(1).any(), AIRSIDE[c]
    # the names are written: the legend holds the glyph pixels of the longest name
    assert (lg == 0).all(-1).sum() > sum(_FONT[ch.upper()].sum() for ch in "baggage_cart" if ch.upper() in _FONT)


def test_text_is_drawn_glyph_by_glyph_and_clipped():
    img = np.full((20, 40, 3), 255, np.uint8)
    draw_text(img, "a1", 0, 0, scale=1)
    assert np.array_equal((img[:7, :5] == 0).all(-1), _FONT["A"])
    assert np.array_equal((img[:7, 6:11] == 0).all(-1), _FONT["1"])
    draw_text(img, "zzzzzzzzzz", 30, 15, scale=2)  # runs off the image: clipped, no error


def test_training_logs_a_legend_picture_in_the_data_sets_colours(tiny, restore_signals, monkeypatch):
    """The validation image handed to TensorBoard is wm.data.viz.figure of the data set's classes."""
    import wm.training.main as T
    from wm.utils.logs import Logger

    shots = []
    monkeypatch.setattr(Logger, "image", lambda self, tag, step, rgb: shots.append((tag, rgb)))
    assert T.main(tiny.args(logging__images=True, tokenizer_stage__max_steps=1)) == 0
    tag, rgb = shots[0]
    assert tag == "tokenizer/val/recon_gt_top_pred_bottom"
    assert rgb.shape[1] >= 2 * 256  # a batch of 2 frames of 16 voxels, each enlarged to 256 px
    pal = class_palette(OCC3D_CLASSES, 17)
    assert np.array_equal(rgb[-legend(OCC3D_CLASSES, pal, rgb.shape[1], 17).shape[0]:],
                          legend(OCC3D_CLASSES, pal, rgb.shape[1], 17))
    assert (rgb.reshape(-1, 3)[:, None] == GAP_GREY).all(-1).any()


def _dark(img) -> int:
    return int((img == 0).all(-1).sum())


def _glyph_pixels(texts, s: int) -> int:
    return sum(int(_FONT.get(ch.upper(), _FONT["?"]).sum()) * s * s for t in texts for ch in t)


def test_a_long_class_name_is_not_clipped_in_a_256_px_legend():
    names = ["free", "construction_vehicle", "tug"]
    lg = legend(names, class_palette(names, 0), 256, 0, scale=2)
    assert lg.shape[1] == 256

    def whole(s):  # every glyph pixel of every name, and each swatch's dark border (no colour here is black)
        return _glyph_pixels(names, s) + len(names) * (4 * 7 * s - 4)

    assert _dark(lg) in (whole(1), whole(2)), (_dark(lg), whole(1), whole(2))


def test_forecast_picture_labels_every_frame_with_its_step():
    names = ["free", "road", "tug"]
    frames = [np.full((16, 16, 2), 1, np.uint8)] * 2  # no dark voxel colour: only text and swatches are dark
    plain = figure([frames, frames], names, 0, titles=["ground truth", "prediction"])
    labels = ["t+1 (0.5s)", "t+2 (1s)"]
    img = figure([frames, frames], names, 0, titles=["ground truth", "prediction"], labels=labels)
    assert img.shape[0] > plain.shape[0] and img.shape[1] == plain.shape[1]
    assert _dark(img) - _dark(plain) == _glyph_pixels(labels, 2)
