"""What a data set looks like in numbers: occupied share, class shares per group, occupancy by
height, visible share; beside the same figures from two public Occ3D-nuScenes frames.

`frame_stats(frames, free, masks)` computes them from uint8 frames (N, X, Y, Z); `reference_bands`
gives, for any height Z, the range "within a factor of 2 of the two Occ3D frames" (lowest frame / 2
to highest frame x 2) per class group and per height band, from 0 for the moving-object groups (a
real frame may hold none); `compare` puts the two side by side.
tools/inspect_data.py prints them for any data set, and the synthetic generator's tests hold it to
the bands, so anyone can see how far their own data is from Occ3D's.

All shares are percent of all voxels of the frames (a class group's share, a height level's share
of its own X*Y voxels, the visible share of all voxels).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from wm.data.shards import OCC3D_CLASSES

# Class groups over Occ3D-nuScenes' class names (a data set with other names gets no groups).
GROUPS = {
    "ground": ("driveable_surface", "other_flat", "sidewalk", "terrain"),
    "structures": ("manmade", "barrier", "traffic_cone", "others"),
    "vegetation": ("vegetation",),
    "vehicles": ("car", "truck", "bus", "construction_vehicle", "trailer", "bicycle", "motorcycle"),
    "people": ("pedestrian",),
}

# nuScenes' moving classes (Occ3D-nuScenes names), in the order tables list them: the moving classes of a
# data set that declares none (its manifest's moving_classes)
NUSCENES_MOVING = ("car", "pedestrian", "truck", "bus", "construction_vehicle", "trailer", "bicycle", "motorcycle")


def moving_classes(info, override: Sequence[str] = ()) -> tuple[str, ...]:
    """The classes that move, in table order: `override` (data.moving_classes) when given, else the
    data set's own (manifest moving_classes, from classes.json at conversion), else its classes named
    as nuScenes' moving ones (none for a class set of other names)."""
    if override:
        return tuple(override)
    if info.moving_classes:
        return tuple(info.moving_classes)
    return tuple(n for n in NUSCENES_MOVING if n in info.class_names)

# Source of every reference range: two public Occ3D-nuScenes frames (200 x 200 x 16, free = 17) whose
# class shares, occupancy per height level and visible shares are below. Each range is "within a
# factor of 2 of the two frames" (lowest / FACTOR .. highest x FACTOR), except the moving-object groups.
OCC3D_FRAMES = (
    {"occupied": 6.11, "camera_visible": 6.8, "lidar_visible": 8.8,
     "classes": {"vegetation": 2.92, "driveable_surface": 1.32, "manmade": 0.83, "sidewalk": 0.41, "car": 0.27,
                 "terrain": 0.16, "bus": 0.15, "others": 0.03, "barrier": 0.01, "motorcycle": 0.01},
     "height": (28.9, 6.9, 3.6, 4.0, 4.6, 4.8, 5.1, 5.6, 5.8, 5.7, 5.2, 4.7, 3.9, 3.5, 3.0, 2.5)},
    {"occupied": 4.86, "camera_visible": 15.7, "lidar_visible": 16.8,
     "classes": {"vegetation": 1.04, "driveable_surface": 1.29, "manmade": 1.33, "sidewalk": 0.18, "car": 0.07,
                 "terrain": 0.73, "construction_vehicle": 0.11, "other_flat": 0.09, "bicycle": 0.01,
                 "motorcycle": 0.005},
     "height": (6.6, 8.1, 18.3, 7.4, 3.2, 3.4, 2.7, 2.5, 2.5, 2.7, 2.7, 3.2, 3.4, 3.8, 3.9, 3.4)},
)
# Moving objects may be absent from any real frame (neither public frame has a pedestrian voxel), so
# the vehicles and people ranges start at 0. The vehicles' upper end is the frames' x FACTOR; people
# have no measured share, so theirs is a stated choice: the cars' 0.07 % of the second frame x FACTOR
# (a busy pavement), not a measurement.
MOVING_GROUPS = ("vehicles", "people")
PEOPLE_BAND = (0.0, 0.14)
FACTOR = 2.0


def group_shares(classes: dict[str, float]) -> dict[str, float]:
    return {g: sum(classes.get(n, 0.0) for n in names) for g, names in GROUPS.items()}


def _levels(profile: Sequence[float], Z: int) -> np.ndarray:
    """A 16-level height profile resampled to Z levels over the same height range (mean of the fine
    levels each coarse level covers, linear interpolation where they do not nest)."""
    p = np.asarray(profile, np.float64)
    if len(p) % Z == 0:
        return p.reshape(Z, -1).mean(1)
    edges = np.linspace(0, len(p), Z + 1)
    fine = np.concatenate([[0], np.cumsum(p)])  # integral of the profile over fine levels
    integ = np.interp(edges, np.arange(len(p) + 1), fine)
    return np.diff(integ) / np.diff(edges)


def reference_bands(Z: int = 16) -> dict:
    """Ranges within FACTOR of the two Occ3D frames: {"occupied": (lo, hi), "groups": {g: (lo, hi)},
    "height": [(lo, hi)] * Z, "visible": (lo, hi)} in percent."""
    def band(values):
        return (min(values) / FACTOR, max(values) * FACTOR)

    groups = [group_shares(f["classes"]) for f in OCC3D_FRAMES]
    out_groups = {g: band([s[g] for s in groups]) for g in GROUPS if g != "people"}
    out_groups["people"] = PEOPLE_BAND
    for g in MOVING_GROUPS:
        out_groups[g] = (0.0, out_groups[g][1])
    heights = np.stack([_levels(f["height"], Z) for f in OCC3D_FRAMES])  # (2, Z)
    return {"occupied": band([f["occupied"] for f in OCC3D_FRAMES]),
            "groups": out_groups,
            "height": [band(heights[:, z]) for z in range(Z)],
            "visible": band([v for f in OCC3D_FRAMES for v in (f["camera_visible"], f["lidar_visible"])])}


def frame_counts(frames: np.ndarray, free: int, num_classes: int, masks: Optional[np.ndarray] = None) -> dict:
    """Counts of uint8 frames (N, X, Y, Z) that add up over batches: voxels per class, occupied
    voxels per height level, voxels, columns, frames, visible voxels (with masks)."""
    frames = np.asarray(frames)
    out = {"classes": np.bincount(frames.ravel(), minlength=num_classes)[:num_classes].astype(np.int64),
           "height": (frames != free).sum(axis=(0, 1, 2)).astype(np.int64),
           "voxels": int(frames.size), "columns": int(frames.size // frames.shape[-1]), "frames": len(frames)}
    if masks is not None:
        out["visible"] = int(np.count_nonzero(masks))
    return out


def add_counts(a: Optional[dict], b: dict) -> dict:
    return dict(b) if a is None else {k: a[k] + b[k] for k in b}


def stats_from_counts(c: dict, free: int, class_names: Sequence[str] = OCC3D_CLASSES) -> dict:
    """Figures in percent: occupied, classes {name: share of all voxels} (non-free, present ones),
    groups {group: share} (Occ3D class names only), height [occupied share of level z's voxels],
    visible (where counted)."""
    n = max(1, c["voxels"])
    classes = {class_names[i]: 100.0 * int(v) / n for i, v in enumerate(c["classes"]) if i != free and v}
    out = {"frames": int(c["frames"]), "occupied": 100.0 * (n - int(c["classes"][free])) / n, "classes": classes,
           "height": [100.0 * int(h) / max(1, c["columns"]) for h in c["height"]]}
    if set(class_names) >= set(sum(GROUPS.values(), ())):
        out["groups"] = group_shares(classes)
    if "visible" in c:
        out["visible"] = 100.0 * c["visible"] / n
    return out


def frame_stats(frames: np.ndarray, free: int, masks: Optional[np.ndarray] = None,
                class_names: Sequence[str] = OCC3D_CLASSES) -> dict:
    """stats_from_counts of one array of frames (N, X, Y, Z)."""
    return stats_from_counts(frame_counts(frames, free, len(class_names), masks), free, class_names)


def sample_counts(shards: list, info, sample: int) -> dict:
    """frame_counts over `sample` frames spread evenly over `shards` (wm.data.shards.Shard; all frames
    if 0), with the masks where the data set has them."""
    total = sum(s.num_frames for s in shards)
    picks = np.arange(total) if not sample or sample >= total else \
        np.linspace(0, total - 1, sample).round().astype(np.int64)
    starts = np.cumsum([0] + [s.num_frames for s in shards])
    counts = None
    for g in picks:
        sid = int(np.searchsorted(starts, g, side="right") - 1)
        i = int(g - starts[sid])
        mask = shards[sid].read("mask", i, i + 1) if info.has_mask else None
        counts = add_counts(counts, frame_counts(shards[sid].read("occ", i, i + 1), info.free_class,
                                                 info.num_classes, mask))
    return counts


def compare(stats: dict) -> list[tuple[str, float, float, float, bool]]:
    """(what, value, lo, hi, inside) for every figure of `stats` that has a reference band."""
    ref = reference_bands(len(stats["height"]))
    rows = [("occupied", stats["occupied"], *ref["occupied"])]
    for g, v in stats.get("groups", {}).items():
        rows.append((f"group {g}", v, *ref["groups"][g]))
    for z, v in enumerate(stats["height"]):
        rows.append((f"height z={z}", v, *ref["height"][z]))
    if "visible" in stats:
        rows.append(("visible", stats["visible"], *ref["visible"]))
    return [(w, v, lo, hi, bool(lo <= v <= hi)) for w, v, lo, hi in rows]
