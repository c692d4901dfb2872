"""What both synthetic styles share (wm/data/synthetic/occ3d.py's "occ3d" scenes, wm/data/synthetic/blocks.py's
"blocks"): Occ3D-nuScenes' class ids, the 2 Hz frame step, the road's lanes and sidewalks, agent sizes,
the ego's lane, and the record a rendered scene becomes."""

from __future__ import annotations

import numpy as np

from wm.data.shards import OCC3D_CLASSES

C = {name: i for i, name in enumerate(OCC3D_CLASSES)}
FREE = C["free"]
DT = 0.5  # s between frames (2 Hz, as nuScenes keyframes)
LANE = 3.5  # m
ROAD_HALF = 2 * LANE  # two lanes each way
WALK = 3.0  # sidewalk width, m

# class: (length, width, height) in metres
SIZES = {"car": (4.6, 1.9, 1.6), "truck": (8.0, 2.5, 3.2), "bus": (11.0, 2.6, 3.2),
         "bicycle": (1.8, 0.7, 1.5), "pedestrian": (0.7, 0.7, 1.8),
         "construction_vehicle": (6.0, 2.6, 3.0), "trailer": (9.0, 2.5, 3.5)}


def ego_lane(rng: np.random.Generator, frames: int, p: float) -> np.ndarray:
    """The ego's y in the road frame: the centre of the right lane, with probability `p` one smooth
    change to the next lane over ~3 s (both styles)."""
    ey = np.full(frames, -LANE / 2)
    if rng.random() < p:
        t0 = rng.integers(0, max(1, frames - 6))
        ramp = np.clip((np.arange(frames) - t0) / 6, 0, 1)
        ey = -LANE / 2 - LANE * (3 * ramp**2 - 2 * ramp**3)
    return ey


def scene_record(rng: np.random.Generator, ex: np.ndarray, ey: np.ndarray, occ: np.ndarray,
                 mask, seed: int, index: int, split_id: int) -> dict:
    """A rendered scene as make_scene returns it (both styles): the road frame placed in the world with
    a random heading and offset (drawn from `rng` last), 2 Hz timestamps, and a name."""
    frames = len(ex)
    th = rng.uniform(-np.pi, np.pi)
    off = rng.uniform(-500, 500, size=2)
    R = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    pose = np.tile(np.eye(4), (frames, 1, 1))
    pose[:, :2, :2] = R
    pose[:, :2, 3] = (R @ np.stack([ex, ey])).T + off
    t0 = 1_533_000_000_000_000 + (split_id * 100_000 + index) * 3_600_000_000
    timestamp = t0 + np.arange(frames, dtype=np.int64) * int(DT * 1e6)
    return {"name": f"synth-{split_id}-{seed}-{index:05d}", "occ": occ, "pose": pose,
            "timestamp": timestamp, "mask": mask}
