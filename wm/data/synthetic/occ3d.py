"""The "occ3d" style of the built-in data set (`synthetic.style`, the demo's): procedural driving
scenes, deterministic from a seed. Writing and caching live in wm/data/synthetic/generate.py, what both styles'
scenes share in wm/data/synthetic/road.py.

The scenes are built to look like Occ3D-nuScenes to a model, not like solid blocks: every
label is an observed surface. A scene is a straight street in its own road frame: a road (driveable_surface)
with two lanes each way, sidewalks a kerb above it, and beyond them blocks of buildings, parks,
open ground and parking on both sides, with cross streets now and then. What is labelled is what a
car driving the street would see: building facades (rays from the road stop at the first wall, so
no insides, no roofs, nothing behind), tree crowns as one-voxel shells on trunks, hedges, bushes,
fences, poles, barriers, cones, and ground only where it is seen and only so far out (a reach that
wanders along the street). The road's height over the grid's floor varies from scene to scene and
open ground rolls gently, so ground spreads over the lowest levels as in Occ3D.

Traffic moves like nuScenes traffic at 2 Hz: cars at up to 15 m/s that cruise, brake to a stop and
pull away, change lanes and turn into cross streets; trucks, buses, trailers; parked cars; many
pedestrians at 1-2 m/s on the sidewalks (some standing) and crossing at the crossings; bicycles and
motorcycles. Agents are drawn as oriented boxes' observed shells; none comes near the ego (which,
as in Occ3D, is not labelled). The ego drives its lane at 0-14 m/s with stops and lane changes.

Frames are rendered ego-centred over the Occ3D range [-40, 40] m (X, Y) x [-1, 5.4] m (Z), at any
grid size; classes are Occ3D-nuScenes' 18 with free = 17. Each scene's global heading and offset
are random, so ego poses carry real rotations. The visibility mask is lidar-like: seen from a
sensor 1.9 m above the road at the grid's centre, a voxel is visible when no column in between
rises above the line of sight and (above the sensor) the line of sight ends on something.

Measured with tools/inspect_data.py (wm/data/stats.py), at 200x200x16 and at the demo's 64x64x8
the occupied share, the class groups (ground, structures, vegetation, vehicles, people), the
occupancy of every height level and the visible share all lie within a factor of 2 of two public
Occ3D frames (tests/data/test_datastats.py holds them there); at 200x200x16 about 4-5 % of voxels are
occupied (Occ3D: 4.9-6.1 %), at 64x64x8 about 10 % (a one-voxel surface is 3x thicker there).
"""

from __future__ import annotations

import functools

import numpy as np

from wm.data.synthetic.road import C, DT, FREE, LANE, ROAD_HALF, SIZES, WALK, ego_lane, scene_record


class _Street:
    """The static street in its own road frame, at voxel size: x along the road from its start, y
    across it (0 = the road's centre line); rows i <-> x = (i + 0.5) vx, columns j <-> y. Holds only
    what a car driving it would observe: ground where it is seen, building facades (not their
    insides or roofs), tree crowns as shells, posts, fences and street furniture."""

    def __init__(self, rng: np.random.Generator, length_m: float, width_m: float, vox: tuple, Z: int,
                 base: float):
        self.rng, self.vox, self.Z = rng, vox, Z
        vx, vy, _ = vox
        self.L, self.W = int(np.ceil(length_m / vx)), int(np.ceil(width_m / vy))
        self.width_m = width_m
        self.xs = (np.arange(self.L) + 0.5) * vx
        self.ys = (np.arange(self.W) + 0.5) * vy - width_m / 2
        # the road's height above the grid's floor (-1 m): where the ego's frame sits relative to the
        # road varies with the vehicle and the slope; the first level above the road is g
        self.base = base
        self.g = 1 + int(np.floor(self.base / vox[2]))
        self.ground = np.full((self.L, self.W), FREE, np.uint8)  # ground class per column
        self.building = np.zeros((self.L, self.W), np.float32)  # building height (m), 0 where none
        self.occ = np.full((self.L, self.W, Z), FREE, np.uint8)  # everything above the ground
        self.cross: list[tuple[float, float]] = []  # cross streets: (x0, x1) m

    def rows(self, a: float, b: float) -> slice:
        vx = self.vox[0]
        return slice(int(np.clip(np.floor(a / vx), 0, self.L)), int(np.clip(np.ceil(b / vx), 0, self.L)))

    def cols(self, a: float, b: float) -> slice:
        vy, w2 = self.vox[1], self.width_m / 2
        return slice(int(np.clip(np.floor((a + w2) / vy), 0, self.W)), int(np.clip(np.ceil((b + w2) / vy), 0, self.W)))

    def levels(self, z0: float, z1: float) -> slice:
        """Levels between z0 and z1 m above the ground (at least one)."""
        vz = self.vox[2]
        a = min(self.Z - 1, self.g + int(np.floor(z0 / vz)))
        return slice(a, max(a + 1, min(self.Z, self.g + int(round(z1 / vz)))))

    def box(self, x0: float, x1: float, y0: float, y1: float, z0: float, z1: float, cls: int) -> None:
        """A solid box (posts, fences, hedges: thin things, solid is what a sensor sees of them);
        thinner than a voxel, it takes the voxel it stands in."""
        rr, cc = self.rows(x0, x1), self.cols(y0, y1)
        if rr.stop <= rr.start:
            rr = self.rows((x0 + x1) / 2, (x0 + x1) / 2 + 1e-3)
        if cc.stop <= cc.start:
            cc = self.cols((y0 + y1) / 2, (y0 + y1) / 2 + 1e-3)
        self.occ[rr, cc, self.levels(z0, z1)] = cls

    def crown(self, x: float, y: float, r: float, rz: float, zc: float) -> None:
        """A tree crown: the shell (one voxel thick) of an ellipsoid centred zc m above the ground;
        foliage lets lidar in, so both sides are labelled."""
        vx, vy, vz = self.vox
        rr, cc = self.rows(x - r, x + r), self.cols(y - r, y + r)
        if rr.stop <= rr.start or cc.stop <= cc.start:
            return
        px = self.xs[rr, None, None] - x
        py = self.ys[None, cc, None] - y
        pz = (np.arange(self.Z) + 0.5 - self.g)[None, None, :] * vz - zc
        out = (px / r) ** 2 + (py / r) ** 2 + (pz / rz) ** 2 <= 1.0
        a, c = max(r - max(vx, vy), 1e-6), max(rz - vz, 1e-6)
        inner = (px / a) ** 2 + (py / a) ** 2 + (pz / c) ** 2 <= 1.0
        shell = out & ~inner
        shell[..., : self.g] = False  # nothing below the ground
        view = self.occ[rr, cc]
        view[shell & (view == FREE)] = C["vegetation"]


def _street(rng: np.random.Generator, length_m: float, vox: tuple, Z: int, base: float = 0.0) -> _Street:
    """Lay out one street: road, sidewalks, blocks of buildings, parks, open ground and parking on
    both sides, cross streets, trees, hedges, fences, poles and street furniture."""
    s = _Street(rng, length_m, 80.0 + 2 * 2 * LANE + 12, vox, Z, base)
    ys, xs = s.ys, s.xs
    s.ground[:, np.abs(ys) < ROAD_HALF + WALK] = C["sidewalk"]
    s.ground[:, np.abs(ys) < ROAD_HALF] = C["driveable_surface"]
    edge = ROAD_HALF + WALK  # where the blocks begin
    far = s.width_m / 2
    for side in (-1, 1):
        def lat(a, b):  # columns between a and b metres from the road's centre, on this side
            return s.cols(a, b) if side > 0 else s.cols(-b, -a)

        x = rng.uniform(0, 8)
        while x < length_m:
            n = rng.uniform(10, 35)
            kind = rng.choice(["building", "park", "open", "parking"], p=[0.3, 0.4, 0.15, 0.15])
            setback = rng.uniform(0.0, 5.0)
            r, a = s.rows(x, x + n), edge + setback
            if kind == "building":
                s.building[r, lat(a, a + rng.uniform(10, 25))] = rng.uniform(3.0, 5.0) if rng.random() < 0.3 \
                    else rng.uniform(5.0, 14.0)
                s.ground[r, lat(edge, a)] = C["sidewalk"] if setback < 2.5 else C["terrain"]
            elif kind == "park":
                s.ground[r, lat(edge, far)] = C["terrain"]
                for _ in range(int(rng.poisson(n / 3))):  # trees: trunk and crown
                    tx, ty = x + rng.uniform(0, n), side * rng.uniform(a + 1, min(far, a + 25))
                    cr, zc = rng.uniform(1.5, 3.5), rng.uniform(3.0, 6.0)
                    s.crown(tx, ty, cr, rng.uniform(1.2, 2.5), zc)
                    s.box(tx - 0.15, tx + 0.15, ty - 0.15, ty + 0.15, 0, zc - 1.0, C["vegetation"])
                for _ in range(int(rng.poisson(n / 6))):  # bushes
                    bx, by, br = x + rng.uniform(0, n), side * rng.uniform(a, min(far, a + 20)), rng.uniform(0.6, 1.5)
                    s.box(bx - br, bx + br, by - br, by + br, 0, rng.uniform(0.6, 2.0), C["vegetation"])
            elif kind == "open":
                s.ground[r, lat(edge, far)] = C["terrain"]
                if rng.random() < 0.6:  # a fence or wall along the back
                    b = a + rng.uniform(6, 20)
                    s.box(x, x + n, *sorted((side * b, side * (b + 0.3))), 0, rng.uniform(1.0, 2.5), C["manmade"])
            else:
                s.ground[r, lat(edge, a + rng.uniform(10, 20))] = C["other_flat"]
            if kind != "building" and rng.random() < 0.5:  # a hedge at the sidewalk's edge
                s.box(x, x + n * rng.uniform(0.4, 1), *sorted((side * edge, side * (edge + 0.8))), 0,
                      rng.uniform(1.0, 2.2), C["vegetation"])
            x += n + rng.uniform(0, 5)
        # street trees in the sidewalk, poles and signs at the kerb, barriers at the road's edge
        x = rng.uniform(0, 10)
        while x < length_m:
            if rng.random() < 0.8:
                ty, cr, zc = side * (ROAD_HALF + WALK - 1.0), rng.uniform(1.5, 3.0), rng.uniform(3.0, 5.0)
                s.crown(x, ty, cr, rng.uniform(1.0, 2.0), zc)
                s.box(x - 0.15, x + 0.15, ty - 0.15, ty + 0.15, 0, zc - 1.0, C["vegetation"])
            x += rng.uniform(7, 14)
        for _ in range(int(rng.poisson(length_m / 30))):
            px, py = rng.uniform(0, length_m), side * (ROAD_HALF + 0.5)
            s.box(px - 0.1, px + 0.1, py - 0.1, py + 0.1, 0, rng.uniform(3.0, 8.0), C["manmade"])
        for _ in range(int(rng.poisson(length_m / 80))):
            px, py = rng.uniform(0, length_m), side * (ROAD_HALF - 0.3)
            s.box(px, px + rng.uniform(3, 10), py - 0.2, py + 0.2, 0, 1.0, C["barrier"])
    for _ in range(int(rng.poisson(length_m / 60))):  # cones and debris on the road's edges
        px, py = rng.uniform(0, length_m), rng.choice([-1, 1]) * rng.uniform(ROAD_HALF - 1.5, ROAD_HALF - 0.3)
        s.box(px - 0.2, px + 0.2, py - 0.2, py + 0.2, 0, 0.7, rng.choice([C["traffic_cone"], C["others"]]))
    # cross streets cut through everything
    x = rng.uniform(30, 100)
    while x < length_m:
        w = rng.uniform(9, 14)
        r = s.rows(x, x + w)
        s.ground[r, :] = C["driveable_surface"]
        s.ground[r, np.abs(ys) >= far - 2] = C["sidewalk"]
        s.building[r] = 0
        s.occ[r] = FREE
        s.cross.append((x, x + w))
        x += w + rng.uniform(70, 180)
    # only what the street sees: rays from the road's centre line, across and obliquely, stop at the
    # first building; ground and everything else behind it stays unlabelled (free)
    seen = _seen_from_road(s.building > 0, s.vox, ys)
    # open ground beyond the sidewalks is observed only so far out (lidar grazes it): a reach that
    # wanders smoothly along the street, 0-10 m, separately on each side
    dist = np.abs(ys)[None, :] - (ROAD_HALF + WALK)
    knots = rng.uniform(0, 10, size=(2, int(length_m / 15) + 2))
    at = xs / 15
    reach = np.stack([np.interp(at, np.arange(knots.shape[1]), k) for k in knots], 1)  # (L, 2)
    reach = np.where(ys[None, :] < 0, reach[:, :1], reach[:, 1:])
    ground_seen = seen & (s.building == 0) & (dist <= reach)
    s.occ[~seen] = FREE
    # the ground's own height: sidewalks a kerb above the road, open ground rolling gently
    knots = rng.uniform(-0.2, 0.6, size=(2, int(length_m / 10) + 2))
    roll = np.stack([np.interp(xs / 10, np.arange(knots.shape[1]), k) for k in knots], 1)
    roll = np.where(ys[None, :] < 0, roll[:, :1], roll[:, 1:])
    dz = np.where(s.ground == C["sidewalk"], 0.15, np.where(s.ground == C["driveable_surface"], 0.0, roll))
    lvl = np.clip(np.floor((s.base + dz) / s.vox[2]), 0, s.Z - 1).astype(np.int64)
    cell = np.take_along_axis(s.occ, lvl[..., None], 2)
    np.put_along_axis(s.occ, lvl[..., None], np.where(ground_seen[..., None] & (cell == FREE),
                                                       s.ground[..., None], cell), 2)
    wall = seen & (s.building > 0)
    hl = np.minimum(s.Z, s.g + np.maximum(1, np.round(s.building / s.vox[2]))).astype(np.int64)
    zl = np.arange(s.Z)
    s.occ[(zl >= s.g) & (zl < hl[..., None]) & wall[..., None]] = C["manmade"]
    return s


def _seen_from_road(block: np.ndarray, vox: tuple, ys: np.ndarray, slopes=(0.0, -0.7, 0.7, -1.7, 1.7)) -> np.ndarray:
    """(L, W) bool: columns a ray from the road's centre line reaches before hitting a blocking
    column, across the road (slope 0) and obliquely (dx/dy = slope), on both sides. A blocking
    column is itself seen (it is the facade)."""
    L, W = block.shape
    vx, vy, _ = vox
    mid = int(np.searchsorted(ys, 0.0))
    seen = np.zeros_like(block)
    for side in (-1, 1):
        cols = np.arange(mid, W) if side > 0 else np.arange(mid - 1, -1, -1)
        d = np.abs(ys[cols])  # lateral distance of each column from the centre line
        for slope in slopes:
            shift = np.round(d * slope / vx).astype(np.int64)  # rows a ray drifts by the time it gets there
            pad = np.abs(shift).max()
            rows = np.arange(L)[:, None] + shift[None, :] + pad  # sheared: one ray per row of the road
            b = np.zeros((L + 2 * pad, len(cols)), bool)
            b[rows, np.arange(len(cols))[None, :]] = block[:, cols]
            # blocked beyond the first blocking column of each ray
            hit = np.cumsum(b, 1)
            ok = (hit - b) == 0
            seen[:, cols] |= ok[rows, np.arange(len(cols))[None, :]]
    return seen


# ------------------------------------------------------------------------------------------ traffic


def _speeds(rng: np.random.Generator, n: int, v0: float, vmax: float, stop_p: float, sub: int) -> np.ndarray:
    """A speed profile (n * sub substeps of DT / sub): cruising with smooth changes, and with
    probability stop_p one stop (brake to 0 at ~3 m/s^2, wait 2-8 s, pull away at ~2 m/s^2)."""
    dt = DT / sub
    v = np.empty(n * sub)
    cruise, cur = v0, v0
    stop_at = rng.uniform(0, n * DT) if rng.random() < stop_p else np.inf
    wait = rng.uniform(2, 8)
    for k in range(n * sub):
        t = k * dt
        if k % sub == 0:
            cruise = float(np.clip(cruise + rng.normal(0, 0.5), 0.3 * vmax, vmax))
        if stop_at <= t < stop_at + wait + cur / 3:
            cur = max(0.0, cur - 3.0 * dt) if t < stop_at + wait else cur
        else:
            cur = min(cruise, cur + 2.0 * dt) if cur < cruise else max(cruise, cur - 2.0 * dt)
        v[k] = cur
    return v


def _trajectories(rng: np.random.Generator, s: _Street, frames: int, t_span: float, ego: tuple) -> list[tuple]:
    """Every agent as (class id, length, width, height, x (T,), y (T,), heading (T,)) in the road
    frame at the scene's frames: vehicles that cruise, stop, change lanes and turn into cross
    streets, parked cars, pedestrians walking and crossing, bicycles and motorcycles. None of them
    ever comes within a metre of the ego (ego = (x (T,), y (T,)); nuScenes labels no ego)."""
    sub = 5
    n = frames
    dt = DT / sub
    out = []
    length = s.xs[-1]

    def integrate(x0, y0, h0, v, lane_to=None, turn=None):
        """Positions at the frames from a speed profile; optional lane change (start s, dy m) and turn
        (x where it starts, +1 left / -1 right, radius)."""
        x, y, h = np.empty(n * sub), np.empty(n * sub), np.empty(n * sub)
        cx, cy, ch, turned = x0, y0, h0, 0.0
        lane_left = lane_to[1] if lane_to is not None else 0.0
        for k in range(n * sub):
            if turn is not None and turned < np.pi / 2 and (cx - turn[0]) * np.cos(h0) >= 0:
                dh = min(np.pi / 2 - turned, v[k] * dt / turn[2])
                ch += turn[1] * dh
                turned += dh
            cx += v[k] * dt * np.cos(ch)
            cy += v[k] * dt * np.sin(ch)
            if lane_to is not None and k * dt >= lane_to[0] and turned == 0 and lane_left:
                take = np.sign(lane_left) * min(abs(lane_left), abs(lane_to[1]) * dt / 3.0)  # over ~3 s
                cy, lane_left = cy + take, lane_left - take
            x[k], y[k], h[k] = cx, cy, ch
        return x[::sub], y[::sub], h[::sub]

    lanes = {1: (-LANE / 2, -1.5 * LANE), -1: (LANE / 2, 1.5 * LANE)}  # +x traffic keeps right (-y)
    for _ in range(int(rng.poisson(length / 7))):
        cls = rng.choice(["car", "truck", "bus", "construction_vehicle", "trailer"], p=[0.8, 0.08, 0.06, 0.03, 0.03])
        l, w, hgt = SIZES[cls]
        sc = rng.uniform(0.9, 1.1)
        d = rng.choice([1, -1])
        y0 = rng.choice(lanes[d])
        vmax = rng.uniform(5, 15) if cls == "car" else rng.uniform(4, 10)
        v = _speeds(rng, n, rng.uniform(0.3, 1) * vmax, vmax, 0.3, sub)
        x0 = rng.uniform(-40, length + 40)
        lane = None
        if rng.random() < 0.2:
            other = [yy for yy in lanes[d] if yy != y0][0]
            lane = (rng.uniform(0, t_span), other - y0)
        turn = None
        ahead = [c for c in s.cross if (c[0] - x0) * d > 0]
        if ahead and rng.random() < 0.35:
            c = min(ahead, key=lambda c: abs(c[0] - x0))
            turn = ((c[0] + c[1]) / 2 - d * 4, rng.choice([1, -1]), rng.uniform(5, 9))
        x, y, h = integrate(x0, y0, 0.0 if d > 0 else np.pi, v, lane, turn)
        out.append((C[cls], l * sc, w, hgt * (rng.uniform(0.95, 1.25) if cls == "car" else 1), x, y, h))
    for _ in range(int(rng.poisson(length / 20))):  # parked at the kerb
        side = rng.choice([-1, 1])
        l, w, hgt = SIZES["car"]
        x0 = rng.uniform(0, length)
        out.append((C["car"], l, w, hgt, np.full(n, x0), np.full(n, side * (ROAD_HALF + 1.0)),
                    np.zeros(n)))
    l, w, hgt = SIZES["pedestrian"]
    for _ in range(int(rng.poisson(length / 6))):  # pedestrians on the sidewalks, some standing
        side = rng.choice([-1, 1])
        y0 = side * (ROAD_HALF + rng.uniform(0.5, WALK - 0.3))
        vmax = rng.uniform(1.0, 2.0) if rng.random() < 0.8 else 0.0
        v = _speeds(rng, n, vmax, max(vmax, 1e-3), 0.2, sub) if vmax else np.zeros(n * sub)
        x, y, h = integrate(rng.uniform(0, length), y0, rng.choice([0.0, np.pi]), v)
        out.append((C["pedestrian"], l, w, hgt, x, y, h))
    for c0, c1 in s.cross:  # people crossing at the crossings
        for _ in range(int(rng.poisson(3))):
            side = rng.choice([-1, 1])
            v = np.full(n * sub, rng.uniform(1.0, 1.6))
            start = side * (ROAD_HALF + 1.5) + side * rng.uniform(0, 20)
            x, y, h = integrate(rng.uniform(c0 - 3, c0 - 1), start, -side * np.pi / 2, v)
            out.append((C["pedestrian"], l, w, hgt, x, y, h))
    for _ in range(int(rng.poisson(length / 50))):  # bicycles and motorcycles at the right edge
        cls = rng.choice(["bicycle", "motorcycle"])
        l, w, hgt = SIZES["bicycle"]
        vmax = rng.uniform(3, 7) if cls == "bicycle" else rng.uniform(6, 14)
        d = rng.choice([1, -1])
        v = _speeds(rng, n, vmax, vmax, 0.2, sub)
        x, y, h = integrate(rng.uniform(0, length), -d * (ROAD_HALF - 0.6), 0.0 if d > 0 else np.pi, v)
        out.append((C[cls], l, w, hgt, x, y, h))
    ex, ey = ego
    el, ew = SIZES["car"][:2]
    return [a for a in out if not ((np.abs(a[4] - ex) < (a[1] + el) / 2 + 1.0) &
                                   (np.abs(a[5] - ey) < (a[2] + ew) / 2 + 1.0)).any()]


def _draw_agent(occ: np.ndarray, cls: int, l: float, w: float, h: float, gx: float, gy: float, yaw: float,
                vox: tuple, g: int) -> None:
    """An oriented box centred at grid position (gx, gy) (voxel units), as its observed shell: the
    outline at every level up to its height, the roof over the inside."""
    X, Y, Z = occ.shape
    vx, vy, vz = vox
    ext = 0.5 * (abs(l * np.cos(yaw)) + abs(w * np.sin(yaw))) / vx, 0.5 * (abs(l * np.sin(yaw)) + abs(w * np.cos(yaw))) / vy
    r0, r1 = int(np.floor(gx - ext[0])), int(np.ceil(gx + ext[0])) + 1
    c0, c1 = int(np.floor(gy - ext[1])), int(np.ceil(gy + ext[1])) + 1
    if r1 <= 0 or c1 <= 0 or r0 >= X or c0 >= Y:
        return
    px = (np.arange(r0, r1) + 0.5 - gx)[:, None] * vx
    py = (np.arange(c0, c1) + 0.5 - gy)[None, :] * vy
    lx, ly = px * np.cos(yaw) + py * np.sin(yaw), -px * np.sin(yaw) + py * np.cos(yaw)
    inside = (np.abs(lx) <= l / 2) & (np.abs(ly) <= w / 2)
    if not inside.any():  # smaller than a voxel: the voxel its centre is in
        inside[int(gx) - r0, int(gy) - c0] = True
    pad = np.pad(inside, 1)
    rim = inside & ~(pad[:-2, 1:-1] & pad[2:, 1:-1] & pad[1:-1, :-2] & pad[1:-1, 2:])
    top = min(Z, g + int(max(1, round(h / vz))))
    a, b = max(r0, 0), min(r1, X)
    c, d = max(c0, 0), min(c1, Y)
    ins, rm = inside[a - r0:b - r0, c - c0:d - c0], rim[a - r0:b - r0, c - c0:d - c0]
    view = occ[a:b, c:d]
    view[..., g:top][rm] = cls
    view[..., top - 1][ins] = cls


@functools.lru_cache(maxsize=4)
def _rays(X: int, Y: int, vx: float, vy: float) -> tuple:
    """The sensor rays of a grid, fixed for all its frames: for each step k along the ray from the
    grid's centre to every column, the flat index of the column it crosses, whether that lies
    before the target column or at/behind it (inside the grid), and target range / step range."""
    gx, gy = np.meshgrid(np.arange(X) + 0.5 - X / 2, np.arange(Y) + 0.5 - Y / 2, indexing="ij")
    r = np.hypot(gx * vx, gy * vy)  # metres from the sensor
    n = np.maximum(np.hypot(gx, gy), 1e-6)
    ux, uy = gx / n, gy / n  # direction in voxel units
    step = min(vx, vy)
    per_m = 1.0 / np.hypot(ux * vx, uy * vy)  # voxel units per metre along the ray
    own = np.floor(gx + X / 2) * Y + np.floor(gy + Y / 2)
    idx, before, beyond, ratio = [], [], [], []
    for k in range(1, int(np.hypot(X * vx, Y * vy) / 2 / step) + 2):
        dist = k * step
        px = np.floor(X / 2 + ux * dist * per_m).astype(np.int64)
        py = np.floor(Y / 2 + uy * dist * per_m).astype(np.int64)
        inside = (px >= 0) & (px < X) & (py >= 0) & (py < Y)
        flat = np.clip(px, 0, X - 1) * Y + np.clip(py, 0, Y - 1)
        idx.append(flat.ravel().astype(np.int32))
        before.append((inside & (dist < r - 0.5 * step) & (flat != own)).ravel())
        beyond.append((inside & (dist >= r - 0.5 * step)).ravel())
        ratio.append((r / dist).ravel().astype(np.float32))
    return np.stack(idx), np.stack(before), np.stack(beyond), np.stack(ratio)


def _sensor_mask(occ: np.ndarray, vox: tuple, road_m: float, sensor_m: float = 1.9) -> np.ndarray:
    """A lidar-style visibility mask (uint8 0/1) seen from the grid's centre at sensor_m above the
    road (whose surface is road_m above the grid's floor): a voxel is visible when no column between it and the sensor rises
    above the line of sight (2.5D: each column's top), and, above the sensor, when that line of
    sight ends on something at or beyond it (a ray into the sky returns nothing, so says nothing)."""
    X, Y, Z = occ.shape
    occupied = occ != FREE
    top = np.where(occupied.any(-1), Z - np.argmax(occupied[..., ::-1], -1), 0).astype(np.float32).ravel()
    hs = (road_m + sensor_m) / vox[2]  # sensor height in levels
    idx, before, beyond, ratio = _rays(X, Y, float(vox[0]), float(vox[1]))
    v = (top[idx] - hs) * ratio  # (K, X*Y): height over the sensor scaled to the target's range
    hide = np.where(before, v, -np.inf).max(0)  # the line of sight must pass above all of these
    end = np.maximum(np.where(beyond, v, -np.inf).max(0), top - hs)  # ...and end on one of these
    # each level's point nearest the sensor's height (its top below the sensor, its bottom above)
    z = np.arange(Z, dtype=np.float32)
    near = np.clip(hs, z, z + 1) - hs
    vis = (near >= hide[:, None]) & ((near <= 0) | (near <= end[:, None]))
    return vis.reshape(X, Y, Z).astype(np.uint8)


def _ego(rng: np.random.Generator, frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The ego's x, y in the road frame: nuScenes-like speeds (0-14 m/s, stops at times) in the
    right lanes, with a lane change now and then."""
    v = _speeds(rng, frames, rng.uniform(2, 12), rng.uniform(6, 14), 0.25, 1)
    ex = 45.0 + np.concatenate([[0], np.cumsum(v[1:] * DT)])
    return ex, ego_lane(rng, frames, 0.4)


def make_scene(seed: int, index: int, grid: tuple[int, int, int], frames: int, with_mask: bool = True,
               split_id: int = 0) -> dict:
    """One scene: dict(name, occ uint8 (T,X,Y,Z), pose float64 (T,4,4), timestamp int64 (T,), mask)."""
    X, Y, Z = grid
    vox = (80.0 / X, 80.0 / Y, 6.4 / Z)
    rng = np.random.default_rng([seed, split_id, index])
    ex, ey = _ego(rng, frames)
    length = ex[-1] + 45.0
    # the road's height over the grid's floor, 0-1 m, spread evenly over every 5 consecutive scenes
    # (so that even a small data set has Occ3D's spread of ground heights)
    base = (index % 5 + rng.uniform()) / 5
    street = _street(rng, length + 10, vox, Z, base)
    agents = _trajectories(rng, street, frames, frames * DT, (ex, ey))
    occ = np.empty((frames, X, Y, Z), np.uint8)
    mask = np.empty((frames, X, Y, Z), np.uint8) if with_mask else None
    y_origin = -street.width_m / 2
    for t in range(frames):
        i0 = int(round((ex[t] - 40.0) / vox[0]))
        j0 = int(round((ey[t] - 40.0 - y_origin) / vox[1]))
        frame = np.full((X, Y, Z), FREE, np.uint8)
        part = street.occ[max(i0, 0):i0 + X, j0:j0 + Y]
        frame[max(0, -i0):max(0, -i0) + part.shape[0], :part.shape[1]] = part
        for cls, al, aw, ah, axs, ays, ahs in agents:
            gx, gy = (axs[t] - ex[t] + 40) / vox[0], (ays[t] - ey[t] + 40) / vox[1]
            if -al <= gx * vox[0] <= 80 + al and -al <= gy * vox[1] <= 80 + al:
                _draw_agent(frame, cls, al, aw, ah, gx, gy, ahs[t], vox, street.g)
        occ[t] = frame
        if with_mask:
            mask[t] = _sensor_mask(frame, vox, street.base)
    return scene_record(rng, ex, ey, occ, mask, seed, index, split_id)
