"""Pictures of occupancy: top-down (BEV) colour maps and a dependency-free PNG writer.

A BEV picture shows, per (x, y) column, the class of the highest occupied voxel, one colour per
Occ3D class; columns with nothing but free space are white. Used by tools/inspect_data.py and by
the training logs (TensorBoard images take the same arrays).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

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


def palette(num_classes: int, free_class: int) -> np.ndarray:
    """(num_classes, 3) uint8 colours: Occ3D's for its 17 occupied classes, a fixed pseudo-random
    colour for any further class, white for free."""
    rng = np.random.default_rng(0)
    extra = rng.integers(40, 230, size=(max(0, num_classes - len(PALETTE)), 3)).astype(np.uint8)
    pal = np.concatenate([PALETTE, extra])[:num_classes].copy()
    pal[free_class] = FREE_COLOUR
    return pal


def top_class(occ: np.ndarray, free_class: int) -> np.ndarray:
    """(..., X, Y, Z) labels -> (..., X, Y): class of the highest non-free voxel (free if none)."""
    occupied = occ != free_class
    Z = occ.shape[-1]
    # index of the highest occupied level: argmax over the reversed z axis finds the first True
    top = Z - 1 - np.argmax(occupied[..., ::-1], axis=-1)
    cls = np.take_along_axis(occ, top[..., None], axis=-1)[..., 0]
    return np.where(occupied.any(-1), cls, free_class).astype(np.uint8)


def bev(occ: np.ndarray, num_classes: int, free_class: int) -> np.ndarray:
    """(X, Y, Z) labels -> (Y, X, 3) uint8 image, x to the right (forward) and y up (left)."""
    rgb = palette(num_classes, free_class)[top_class(occ, free_class)]  # (X, Y, 3)
    return np.ascontiguousarray(rgb.transpose(1, 0, 2)[::-1])


def tile(images: list[np.ndarray], gap: int = 2, scale: int = 1) -> np.ndarray:
    """Images side by side on a grey background, each enlarged `scale` times."""
    images = [im.repeat(scale, 0).repeat(scale, 1) for im in images]
    h = max(im.shape[0] for im in images)
    w = sum(im.shape[1] for im in images) + gap * (len(images) - 1)
    out = np.full((h, w, 3), 128, np.uint8)
    x = 0
    for im in images:
        out[:im.shape[0], x:x + im.shape[1]] = im
        x += im.shape[1] + gap
    return out


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
