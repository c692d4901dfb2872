"""Pictures of occupancy: top-down (BEV) colour maps with a class legend, and a dependency-free PNG writer.

A BEV picture shows, per (x, y) column, the class of the highest occupied voxel; columns with
nothing but free space are white. Colours come from the data set's class names (`class_palette`):
Occ3D's colours for Occ3D's class names, the data set's own `class_colors` (manifest.json, from
`colors` in tools/convert_frames.py's classes.json) where given, and distinct generated colours
for every other name, so a custom class never borrows an Occ3D class's colour by id.

`figure(rows, class_names, free_class)` is what every picture goes through (tools/inspect_data.py,
the training logs' TensorBoard images): rows of frames, each frame enlarged by nearest neighbour to
at least `min_px` pixels wide (a 64x64 frame becomes 256x256), optional row titles, and a legend
of every class under it. Text is drawn with a built-in 5x7 pixel font (upper case), so no imaging
library is needed.
"""

from __future__ import annotations

import colorsys
import math
import re
import struct
import zlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from wm.data.shards import OCC3D_CLASSES
from wm.data.stats import moving_classes
from wm.utils.errors import DataError

# Occ3D-nuScenes colours (as in the Occ3D/OccWorld visualisations), index = class id.
PALETTE = np.array([
    [0, 0, 0],        # 0 others
    [255, 120, 50],   # 1 barrier
    [255, 192, 203],  # 2 bicycle
    [255, 255, 0],    # 3 bus
    [0, 150, 245],    # 4 car
    [0, 255, 255],    # 5 construction_vehicle
    [200, 180, 0],    # 6 motorcycle
    [255, 0, 0],      # 7 pedestrian
    [255, 240, 150],  # 8 traffic_cone
    [135, 60, 0],     # 9 trailer
    [160, 32, 240],   # 10 truck
    [255, 0, 255],    # 11 driveable_surface
    [139, 137, 137],  # 12 other_flat
    [75, 0, 75],      # 13 sidewalk
    [150, 240, 80],   # 14 terrain
    [230, 230, 250],  # 15 manmade
    [0, 175, 0],      # 16 vegetation
], np.uint8)
FREE_COLOUR = np.array([255, 255, 255], np.uint8)
OCC3D_COLOURS = {n: PALETTE[i] for i, n in enumerate(OCC3D_CLASSES[:len(PALETTE)])}
GAP_GREY = 128


def _key(name: str) -> str:
    """Class names compare case-blind, with '-' and ' ' as '_' ("Traffic cone" is traffic_cone)."""
    return re.sub(r"[\s\-]+", "_", name.strip().lower())


def parse_colors(colors, names: Sequence[str], where: str) -> dict:
    """A user's colours -> {class name: [r, g, b]}: an object {name: colour} or a list in class
    order (null entries keep the automatic colour); a colour is [r, g, b] (0-255) or "#rrggbb"."""
    if isinstance(colors, list):
        if len(colors) != len(names):
            raise DataError(f"{where}: {len(colors)} colours for {len(names)} classes (a list is one per class, "
                            "in class order; use an object {name: colour} for some of them)")
        colors = {n: c for n, c in zip(names, colors) if c is not None}
    if not isinstance(colors, dict):
        raise DataError(f"{where}: expected an object {{class name: colour}} or a list of colours")
    out = {}
    for n, c in colors.items():
        if n not in names:
            raise DataError(f"{where}: {n!r} is not one of the classes {list(names)}")
        if isinstance(c, str) and re.fullmatch(r"#[0-9a-fA-F]{6}", c):
            rgb = [int(c[i:i + 2], 16) for i in (1, 3, 5)]
        elif isinstance(c, list) and len(c) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                         and 0 <= v <= 255 for v in c):
            rgb = list(c)
        else:
            raise DataError(f"{where}: colour of {n!r} is {c!r}; give [r, g, b] with 0-255 or \"#rrggbb\"")
        out[n] = rgb
    return out


def _distinct(taken: list[np.ndarray]) -> np.ndarray:
    """The next colour of a fixed sequence (golden-angle hues at a few saturations and values) that
    is far enough from every colour already taken; deterministic, never near white or black."""
    for i in range(1024):
        h = (i * 0.618033988749895) % 1.0
        s, v = ((0.85, 0.95), (0.6, 0.75), (0.95, 0.6), (0.45, 0.9))[(i // 7) % 4]
        rgb = np.array([round(255 * x) for x in colorsys.hsv_to_rgb(h, s, v)], np.uint8)
        min_d = min((float(np.abs(rgb.astype(int) - t.astype(int)).sum()) for t in taken), default=1e9)
        if min_d >= (110 if i < 256 else 30):
            return rgb
    return np.array([GAP_GREY] * 3, np.uint8)


def class_palette(class_names: Sequence[str], free_class: int, colors: Optional[dict] = None) -> np.ndarray:
    """(num_classes, 3) uint8 colours for a data set's classes: free is white; `colors` {name: rgb}
    first, then Occ3D's colour for an Occ3D class name, then a distinct generated colour."""
    colors = colors or {}
    pal = np.zeros((len(class_names), 3), np.uint8)
    taken = [FREE_COLOUR]
    auto = []
    for c, n in enumerate(class_names):
        if c == free_class:
            pal[c] = FREE_COLOUR
        elif n in colors:
            pal[c] = colors[n]
        elif _key(n) in OCC3D_COLOURS:
            pal[c] = OCC3D_COLOURS[_key(n)]
        else:
            auto.append(c)
            continue
        taken.append(pal[c])
    for c in auto:
        pal[c] = _distinct(taken)
        taken.append(pal[c])
    return pal


def palette(num_classes: int, free_class: int, class_names: Optional[Sequence[str]] = None,
            colors: Optional[dict] = None) -> np.ndarray:
    """class_palette by names; without names, Occ3D's classes when the counts are Occ3D's, else
    generated colours (never Occ3D's colours by id for someone else's classes)."""
    if class_names is None:
        occ3d = num_classes == len(OCC3D_CLASSES) and free_class == OCC3D_CLASSES.index("free")
        class_names = OCC3D_CLASSES if occ3d else [f"class {i}" for i in range(num_classes)]
    return class_palette(class_names, free_class, colors)


def top_class(occ: np.ndarray, free_class: int, prefer=()) -> np.ndarray:
    """(..., X, Y, Z) labels -> (..., X, Y): class of the highest non-free voxel (free if none);
    a column holding any class of `prefer` shows the highest of those instead (a car under a tree)."""
    occupied = occ != free_class
    if len(prefer):
        shown = np.isin(occ, prefer)
        occupied = np.where(shown.any(-1, keepdims=True), shown, occupied)
    Z = occ.shape[-1]
    # index of the highest occupied level: argmax over the reversed z axis finds the first True
    top = Z - 1 - np.argmax(occupied[..., ::-1], axis=-1)
    cls = np.take_along_axis(occ, top[..., None], axis=-1)[..., 0]
    return np.where(occupied.any(-1), cls, free_class).astype(np.uint8)


def bev(occ: np.ndarray, num_classes: int, free_class: int, pal: Optional[np.ndarray] = None,
        prefer=()) -> np.ndarray:
    """(X, Y, Z) labels -> (Y, X, 3) uint8 image, x to the right (forward) and y up (left);
    `prefer`: see top_class."""
    pal = palette(num_classes, free_class) if pal is None else pal
    rgb = pal[top_class(occ, free_class, prefer)]  # (X, Y, 3)
    return np.ascontiguousarray(rgb.transpose(1, 0, 2)[::-1])


def tile(images: list[np.ndarray], gap: int = 2, scale: int = 1) -> np.ndarray:
    """Images side by side on a grey background, each enlarged `scale` times."""
    images = [im.repeat(scale, 0).repeat(scale, 1) for im in images]
    h = max(im.shape[0] for im in images)
    w = sum(im.shape[1] for im in images) + gap * (len(images) - 1)
    out = np.full((h, w, 3), GAP_GREY, np.uint8)
    x = 0
    for im in images:
        out[:im.shape[0], x:x + im.shape[1]] = im
        x += im.shape[1] + gap
    return out


# ---------------------------------------------------------------------------------------------
# text: a 5x7 pixel font (upper case, digits, the punctuation of class names and titles)

_GLYPHS = {
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "####. #...# #...# #...# #...# #...# ####.",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "####. ....# ....# .###. ....# ....# ####.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": ".###. #.... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ....# .###.",
    "_": "..... ..... ..... ..... ..... ..... #####", "-": "..... ..... ..... ##### ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..", "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...", "/": "....# ....# ...#. ..#.. .#... #.... #....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....", "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    " ": "..... ..... ..... ..... ..... ..... .....", "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..", ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "=": "..... ..... ##### ..... ##### ..... .....", "%": "##..# ##.#. ...#. ..#.. .#... .#.## #..##",
}
_FONT = {c: np.array([[ch == "#" for ch in row] for row in g.split()], bool) for c, g in _GLYPHS.items()}
GLYPH_W, GLYPH_H = 5, 7


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * (GLYPH_W + 1) * scale


def draw_text(img: np.ndarray, text: str, x: int, y: int, colour=(0, 0, 0), scale: int = 2) -> None:
    """Write `text` into `img` (H, W, 3) at top-left (x, y), clipped at the edges; lower case is
    drawn as upper case, an unknown character as '?'."""
    for i, ch in enumerate(text.upper()):
        g = _FONT.get(ch, _FONT["?"]).repeat(scale, 0).repeat(scale, 1)
        x0 = x + i * (GLYPH_W + 1) * scale
        h, w = min(g.shape[0], img.shape[0] - y), min(g.shape[1], img.shape[1] - x0)
        if h <= 0 or w <= 0:
            continue
        img[y:y + h, x0:x0 + w][g[:h, :w]] = colour


def _legend_labels(class_names: Sequence[str], free_class: Optional[int]) -> list[str]:
    return [n + (" (free)" if c == free_class and "free" not in n.lower() else "") for c, n in enumerate(class_names)]


def _legend_item(labels: Sequence[str], scale: int) -> int:
    """Width of one legend entry (swatch, gap, the longest name, margin) at `scale`."""
    return GLYPH_H * scale + 3 * scale + max(text_width(t, scale) for t in labels) + 6 * scale


def legend(class_names: Sequence[str], pal: np.ndarray, width: int, free_class: Optional[int] = None,
           scale: int = 2) -> np.ndarray:
    """(H, width, 3) white panel: one swatch and name per class, in as many columns as fit; a font
    of `scale`, or smaller where the longest name would not fit the width at it."""
    labels = _legend_labels(class_names, free_class)
    while scale > 1 and _legend_item(labels, scale) + 3 * scale > width:
        scale -= 1
    sw, pad = GLYPH_H * scale, 3 * scale
    item = _legend_item(labels, scale)
    cols = max(1, (width - pad) // item)
    rows = math.ceil(len(labels) / cols)
    row_h = sw + pad
    out = np.full((pad + rows * row_h, width, 3), 255, np.uint8)
    for c, t in enumerate(labels):
        x, y = pad + (c // rows) * item, pad + (c % rows) * row_h
        out[y:y + sw, x:x + sw] = 0  # a dark border, so white (free) shows as a swatch
        out[y + 1:y + sw - 1, x + 1:x + sw - 1] = pal[c]
        draw_text(out, t, x + sw + pad, y, scale=scale)
    return out


def figure(rows: Sequence[Sequence[Optional[np.ndarray]]], class_names: Sequence[str], free_class: int,
           colors: Optional[dict] = None, titles: Optional[Sequence[str]] = None, min_px: int = 256,
           scale: int = 0, prefer=(), labels: Optional[Sequence[Optional[str]]] = None) -> np.ndarray:
    """The picture of one or more rows of (X, Y, Z) frames (None in a row: a past|future gap): BEV
    maps in the data set's colours, enlarged by nearest neighbour so a frame is at least `min_px`
    wide (or `scale` pixels per voxel when given), a title over each row, `labels` over the frames
    of the first row (one per entry, e.g. the forecast's steps), a legend of every class (the
    picture widened where the longest class name needs it); `prefer`: see top_class."""
    pal = class_palette(class_names, free_class, colors)
    frames = [f for r in rows for f in r if f is not None]
    k = scale or max(1, math.ceil(min_px / frames[0].shape[0]))
    gap = max(2, k)
    strips, lefts = [], []
    for r in rows:
        ims = [bev(f, len(class_names), free_class, pal, prefer) if f is not None else None for f in r]
        h = next(im.shape[0] for im in ims if im is not None)
        ims = [im if im is not None else np.full((h, max(2, h // 8), 3), GAP_GREY, np.uint8) for im in ims]
        lefts.append(np.cumsum([0] + [im.shape[1] * k + gap for im in ims])[:-1])
        strips.append(tile(ims, gap=gap, scale=k))
    width = max(s.shape[1] for s in strips)
    ts = 2 if width >= 200 else 1
    width = max(width, _legend_item(_legend_labels(class_names, free_class), 1) + 3)
    parts = []
    for i, s in enumerate(strips):
        if titles:
            head = np.full((GLYPH_H * ts + 4 * ts, width, 3), 255, np.uint8)
            draw_text(head, titles[i], 2 * ts, 2 * ts, scale=ts)
            parts.append(head)
        if labels and i == 0:
            band = np.full((GLYPH_H * ts + 4 * ts, width, 3), 255, np.uint8)
            for x, t in zip(lefts[0], labels):
                if t:
                    draw_text(band, t, int(x) + ts, 2 * ts, scale=ts)
            parts.append(band)
        row = np.full((s.shape[0], width, 3), GAP_GREY, np.uint8)
        row[:, :s.shape[1]] = s
        parts += [row, np.full((gap, width, 3), GAP_GREY, np.uint8)]
    parts.append(legend(class_names, pal, width, free_class, scale=ts))
    return np.concatenate(parts)


def bev_pair(frames: list, info, moving=None, labels=None) -> np.ndarray:
    """Ground truth above, model below: BEV pictures (wm.data.viz.figure) with a legend, the `moving`
    classes (default: the data set's) drawn over whatever is above them (a car under a tree shows as
    the car); `labels` over the frames (the forecast's steps)."""
    moving = moving_classes(info) if moving is None else moving
    dyn = [c for c, n in enumerate(info.class_names) if n in moving]
    return figure([list(frames[0]), list(frames[1])], info.class_names, info.free_class, info.class_colors,
                  titles=["ground truth", "prediction"], prefer=dyn, labels=labels)


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """Write an (H, W, 3) uint8 image as PNG (zlib + the PNG chunk layout; no imaging library)."""
    rgb = np.ascontiguousarray(rgb, np.uint8)
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))  # filter type 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)
