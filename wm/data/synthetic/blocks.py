"""The first built-in scenes ("blocks" style): solid columns on a full ground slab, deterministic from a seed.

A straight street in its own road frame: a road with two lanes each way, sidewalks, and beyond them
solid blocks of buildings, trees, terrain and parking, with poles, barriers and cones; cars, trucks,
buses, bicycles and pedestrians move along it at constant speeds, and the ego drives its lane at a
slowly varying speed. Every column is filled from the ground up, so about 37 % of voxels are
occupied and the two lowest levels are full: far easier than Occ3D (wm/data/synthetic/occ3d.py's docstring and
BENCHMARKS.md, "Synthetic scenes against Occ3D"). `synthetic.style = "blocks"` selects them
(configs/demo_blocks.json: the first demo); the default is the Occ3D-like `occ3d`. The constants are
wm.data.synthetic.road's, shared with it.
"""

from __future__ import annotations

import numpy as np

from wm.data.synthetic.road import C, DT, FREE, LANE, ROAD_HALF, SIZES, WALK, ego_lane, scene_record


def _static_map(rng: np.random.Generator, length_m: float, vx: float, vy: float, width_m: float):
    """Ground class, solid class and solid height (m) per world column, road frame at voxel size."""
    L, W = int(np.ceil(length_m / vx)), int(np.ceil(width_m / vy))
    ys = (np.arange(W) + 0.5) * vy - width_m / 2  # lateral coordinate of each world column
    ground = np.full((L, W), C["terrain"], np.uint8)
    solid = np.full((L, W), FREE, np.uint8)
    height = np.zeros((L, W), np.float32)
    ground[:, np.abs(ys) < ROAD_HALF + WALK] = C["sidewalk"]
    ground[:, np.abs(ys) < ROAD_HALF] = C["driveable_surface"]

    def xs(a, b):  # world rows between a and b metres
        return slice(max(0, int(a / vx)), max(0, min(L, int(np.ceil(b / vx)))))

    def cols(a, b):
        return (ys >= a) & (ys < b)

    # blocks beyond the sidewalks on both sides
    for side in (-1, 1):
        x = rng.uniform(0, 10)
        while x < length_m:
            n = rng.uniform(8, 30)
            kind = rng.choice(["building", "trees", "terrain", "parking"], p=[0.4, 0.3, 0.15, 0.15])
            setback = rng.uniform(0.5, 4.0)
            a, b = ROAD_HALF + WALK + setback, width_m / 2
            lat = cols(a, b) if side > 0 else cols(-b, -a)
            r = xs(x, x + n)
            if kind == "building":
                solid[r, lat] = C["manmade"]
                height[r, lat] = rng.uniform(3.0, 12.0)
            elif kind == "trees":
                ground[r, lat] = C["terrain"]
                for _ in range(int(n / 3)):  # round-ish crowns on trunks
                    cx, cy = x + rng.uniform(0, n), side * rng.uniform(a + 1, b)
                    rad = rng.uniform(1.0, 2.5)
                    rr = xs(cx - rad, cx + rad)
                    solid[rr, cols(cy - rad, cy + rad)] = C["vegetation"]
                    height[rr, cols(cy - rad, cy + rad)] = rng.uniform(2.5, 6.0)
            elif kind == "parking":
                ground[r, lat] = C["other_flat"]
            x += n + rng.uniform(0, 6)
        # poles and barriers at the kerb
        for _ in range(int(length_m / 25)):
            px = rng.uniform(0, length_m)
            py = side * (ROAD_HALF + WALK - 0.5)
            r, c = xs(px - 0.2, px + 0.2), cols(py - 0.2, py + 0.2)
            solid[r, c] = C["manmade"]
            height[r, c] = 5.0
        for _ in range(int(length_m / 60)):
            px = rng.uniform(0, length_m)
            r, c = xs(px, px + rng.uniform(4, 10)), cols(side * ROAD_HALF - 0.3, side * ROAD_HALF + 0.3)
            solid[r, c] = C["barrier"]
            height[r, c] = 1.0
    # cross streets cut through everything
    x = rng.uniform(40, 120)
    while x < length_m:
        w = rng.uniform(8, 14)
        r = xs(x, x + w)
        ground[r, :] = C["driveable_surface"]
        solid[r, :] = FREE
        height[r, :] = 0
        x += rng.uniform(80, 200)
    # a few cones and "others" debris on the road edge
    for _ in range(int(length_m / 80)):
        px, py = rng.uniform(0, length_m), rng.choice([-1, 1]) * rng.uniform(ROAD_HALF - 1, ROAD_HALF)
        r, c = xs(px - 0.25, px + 0.25), cols(py - 0.25, py + 0.25)
        solid[r, c] = rng.choice([C["traffic_cone"], C["others"]])
        height[r, c] = 0.8
    return ground, solid, height


def _agents(rng: np.random.Generator, length_m: float, ego_v: float) -> list[tuple]:
    """(class id, length, width, height, x0, y, vx) for every moving or parked agent."""
    out = []
    lanes_fwd, lanes_back = (-LANE / 2, -1.5 * LANE), (LANE / 2, 1.5 * LANE)
    n_vehicles = int(length_m / 18)
    for _ in range(n_vehicles):
        cls = rng.choice(["car", "truck", "bus", "construction_vehicle", "trailer"],
                         p=[0.72, 0.12, 0.08, 0.04, 0.04])
        l, w, h = SIZES[cls]
        s = rng.uniform(0.85, 1.15)
        if rng.random() < 0.5:
            y, vx = rng.choice(lanes_fwd), ego_v * rng.uniform(0.6, 1.3) + rng.uniform(-1, 1)
        else:
            y, vx = rng.choice(lanes_back), -rng.uniform(5, 13)
        out.append((C[cls], l * s, w, h, rng.uniform(-30, length_m + 30), y, vx))
    for _ in range(int(length_m / 30)):  # parked at the kerb
        side = rng.choice([-1, 1])
        l, w, h = SIZES["car"]
        out.append((C["car"], l, w, h, rng.uniform(0, length_m), side * (ROAD_HALF - 1.1), 0.0))
    for _ in range(int(length_m / 12)):  # pedestrians on the sidewalks
        side = rng.choice([-1, 1])
        l, w, h = SIZES["pedestrian"]
        out.append((C["pedestrian"], l, w, h, rng.uniform(0, length_m),
                    side * (ROAD_HALF + rng.uniform(0.5, WALK - 0.5)), rng.choice([-1, 1]) * rng.uniform(0.8, 1.8)))
    for _ in range(int(length_m / 60)):  # bicycles/motorcycles at the right edge
        cls = rng.choice(["bicycle", "motorcycle"])
        l, w, h = SIZES["bicycle"]
        out.append((C[cls], l, w, h, rng.uniform(0, length_m), -(ROAD_HALF - 0.6),
                    rng.uniform(3, 7) if cls == "bicycle" else rng.uniform(6, 12)))
    return out


def _visible(height_lv: np.ndarray, block: int, samples: int = 24) -> np.ndarray:
    """2D visibility from the grid centre: a column is hidden when a column between it and the
    centre is at least `block` levels tall (buildings, trees, large vehicles)."""
    X, Y = height_lv.shape
    cx, cy = X / 2, Y / 2
    gx, gy = np.meshgrid(np.arange(X) + 0.5, np.arange(Y) + 0.5, indexing="ij")
    s = (np.arange(1, samples) / samples)[:, None, None]
    px = np.clip((cx + s * (gx - cx)).astype(np.int64), 0, X - 1)
    py = np.clip((cy + s * (gy - cy)).astype(np.int64), 0, Y - 1)
    tall = height_lv >= block
    # a column does not hide itself: ignore samples that land on the target column
    own = (px == gx.astype(np.int64)) & (py == gy.astype(np.int64))
    return ~(tall[px, py] & ~own).any(0)


def make_scene(seed: int, index: int, grid: tuple[int, int, int], frames: int,
               with_mask: bool = True, split_id: int = 0) -> dict:
    """One scene: dict(name, occ uint8 (T,X,Y,Z), pose float64 (T,4,4), timestamp int64 (T,), mask)."""
    X, Y, Z = grid
    vx, vy, vz = 80.0 / X, 80.0 / Y, 6.4 / Z
    rng = np.random.default_rng([seed, split_id, index])
    # ego speed profile: smooth random walk within [3, 14] m/s
    v = np.empty(frames)
    v[0] = rng.uniform(4, 12)
    a = rng.uniform(-1, 1)
    for t in range(1, frames):
        a = np.clip(a + rng.normal(0, 0.4), -2, 2)
        v[t] = np.clip(v[t - 1] + a * DT, 3, 14)
    ex = 45.0 + np.concatenate([[0], np.cumsum(v[1:] * DT)])
    ey = ego_lane(rng, frames, 0.5)
    length = ex[-1] + 45.0
    ground, solid, height = _static_map(rng, length + 10, vx, vy, width_m=80.0 + 2 * 2 * LANE + 10)
    agents = _agents(rng, length, float(v.mean()))
    L, W = ground.shape
    g = max(1, int(round(0.8 / vz)))  # ground levels: [-1, ~-0.2] m
    zl = np.arange(Z)
    occ = np.empty((frames, X, Y, Z), np.uint8)
    mask = np.empty((frames, X, Y, Z), np.uint8) if with_mask else None
    y_origin = -(W * vy) / 2
    for t in range(frames):
        i0 = int(round((ex[t] - 40.0) / vx))
        j0 = int(round((ey[t] - 40.0 - y_origin) / vy))
        gc = ground[i0:i0 + X, j0:j0 + Y].copy()
        sc = solid[i0:i0 + X, j0:j0 + Y].copy()
        hm = height[i0:i0 + X, j0:j0 + Y].copy()
        for cls, al, aw, ah, x0, ay, avx in agents:
            ax = x0 + avx * t * DT
            r0, r1 = int((ax - al / 2 - ex[t] + 40) / vx), int(np.ceil((ax + al / 2 - ex[t] + 40) / vx))
            c0, c1 = int((ay - aw / 2 - ey[t] + 40) / vy), int(np.ceil((ay + aw / 2 - ey[t] + 40) / vy))
            if r1 <= 0 or r0 >= X or c1 <= 0 or c0 >= Y:
                continue
            r0, r1, c0, c1 = max(r0, 0), min(r1, X), max(c0, 0), min(c1, Y)
            sc[r0:r1, c0:c1] = cls
            hm[r0:r1, c0:c1] = ah
        levels = np.where(sc == FREE, 0, np.maximum(1, np.round(hm / vz))).astype(np.int64)
        levels = np.minimum(levels, Z - g)
        col = np.where(zl < g, gc[..., None], np.where(zl < g + levels[..., None], sc[..., None], FREE))
        occ[t] = col
        if with_mask:
            vis = _visible(levels, block=max(1, int(round(2.0 / vz))))
            mask[t] = vis[..., None]
    return scene_record(rng, ex, ey, occ, mask, seed, index, split_id)


