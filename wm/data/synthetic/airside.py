"""The "airside" style of the built-in data set (`synthetic.style`): airport aprons with their own 17
classes, a second domain to fine-tune a road-trained ("occ3d") model onto. Writing and caching live in
wm/data/synthetic/generate.py; the frame step, the scene record and the lidar-style mask are the occ3d style's.

A scene is a head-of-stand service road (x along it, y across, 0 = its centre line). On one side
(+y) a stepped terminal facade 12-24 m off, seen from the apron only (no insides, no roofs), with
gaps where grass shows; jet bridges reach from rotundas over the road to the stands. On the other
(-y) aircraft parked nose-in (35-40 m long, ~35 m span, ~4 m fuselage; fuselage, wings, engines, tail
and gear as observed shells, clipped to the grid's height) with belt loaders, cart trains, fuel and
catering trucks, stairs, cones and crew; some are pushed back by a tug (~1 m/s) or taxi in along the
lead-in line (3-8 m/s, braking to the stop bar). On the road and the equipment lane: tugs pulling 2-4
carts that follow their turns, service trucks, buses, stairs and belt loaders, stop-and-go; people
walk near the stands and the facade. The ground (apron, one-voxel painted lines, grass) is labelled
where a sensor on the road sees it. The ego, an apron vehicle in the right lane at 0-8 m/s with
stops, is not labelled (as in Occ3D) and nothing comes within a metre of it.

Frames are ego-centred over the Occ3D range at any grid, 2 Hz. Every shape is a cloud of surface
points (at most half a voxel apart: surfaces one voxel thick, without holes) placed by its pose, one
scatter per frame for all agents. At 64x64x8 and 200x200x16 the occupied share, every height level
and the visible share lie within Occ3D's bands (wm.data.stats; tests/data/test_synthetic_airside.py).

The shapes of its classes (surface points, where the road style's are boxes) live in
wm/data/synthetic/airside_shapes.py.
"""

from __future__ import annotations


import numpy as np

from wm.data.synthetic import airside_shapes as shapes
from wm.data.synthetic.occ3d import _sensor_mask
from wm.data.synthetic.road import DT, FREE as OCC3D_FREE, scene_record

AIRSIDE_CLASSES = ("others", "aircraft", "tug", "baggage_cart", "belt_loader", "service_truck",
                   "passenger_stairs", "bus", "person", "traffic_cone", "apron", "marking", "grass",
                   "terminal", "jet_bridge", "light_mast", "free")
A = {n: i for i, n in enumerate(AIRSIDE_CLASSES)}
AIRSIDE_FREE = A["free"]
AIRSIDE_MOVING = ("aircraft", "tug", "baggage_cart", "belt_loader", "service_truck", "passenger_stairs",
                  "bus", "person")
# the pictures' legend (DatasetInfo.class_colors): ground pale, vehicles saturated, free is white anyway
AIRSIDE_COLORS = {
    "others": [0, 0, 0], "aircraft": [0, 120, 245], "tug": [139, 69, 19], "baggage_cart": [255, 120, 50],
    "belt_loader": [160, 32, 240], "service_truck": [0, 190, 190], "passenger_stairs": [255, 20, 147],
    "bus": [230, 200, 0], "person": [255, 0, 0], "traffic_cone": [255, 170, 0], "apron": [175, 175, 175],
    "marking": [250, 240, 120], "grass": [120, 220, 70], "terminal": [110, 110, 160],
    "jet_bridge": [70, 0, 110], "light_mast": [0, 80, 0]}

ROAD = 4.0  # half width of the two-lane service road, m
LANE = 1.75  # lane centres at -LANE (driving +x, the ego's) and +LANE
GSE_Y = 7.0  # the equipment lane between the road and the facade
STAND_Y = -6.0  # the lane through the stands in front of the aircraft's noses
WIDTH = 96.0  # the static map spans y in [-48, 48] m
SUB = 5  # substeps per frame for speed profiles
EGO = (4.8, 2.0)  # the ego's length and width, m

# each kind of agent: its class, and the length and width (m) the traffic filter and trains need
KIND = {"tug": ("tug", 2.8, 1.5), "pushback": ("tug", 6.0, 2.8), "baggage_cart": ("baggage_cart", 3.0, 1.6),
        "belt_loader": ("belt_loader", 7.2, 2.1), "fuel": ("service_truck", 8.5, 2.5),
        "catering": ("service_truck", 8.0, 2.5), "stairs": ("passenger_stairs", 7.6, 2.4),
        "bus": ("bus", 13.0, 3.0), "person": ("person", 0.6, 0.6)}


# ------------------------------------------------------------------------------------------- motion


def _travel(rng: np.random.Generator, n: int, v0: float, vmax: float, stop_p: float, start: float = 0.0,
            dist: float = np.inf, acc: float = 1.0, dec: float = 1.5) -> np.ndarray:
    """Distance travelled (m) at each of n frames: waiting until `start` s, then cruising (from v0,
    with smooth changes within [0.4, 1] x vmax) with, with probability stop_p, one stop (brake,
    wait 2-10 s, pull away): apron traffic is slow and stop-and-go. With `dist`, it brakes to rest
    at that distance and stays there."""
    dt = DT / SUB
    s = np.zeros(n)
    cruise, cur, pos = v0, (v0 if start <= 0 else 0.0), 0.0
    stop_at = rng.uniform(0, n * DT) if rng.random() < stop_p else np.inf
    wait = rng.uniform(2, 10)
    for k in range(n * SUB):
        t = k * dt
        if k % SUB == 0:
            s[k // SUB] = pos
            cruise = float(np.clip(cruise + rng.normal(0, 0.3), 0.4 * vmax, vmax))
        target = 0.0 if t < start or stop_at <= t < stop_at + wait else cruise
        cur = min(target, cur + acc * dt) if cur < target else max(target, cur - dec * dt)
        cur = min(cur, np.sqrt(2 * dec * max(0.0, dist - pos)))
        pos += cur * dt
    return s


class _Route:
    """A path through waypoints with rounded corners, by arc length: at(s) gives x, y, heading, and
    carries on straight before its start and past its end (a train's carts start behind the tug)."""

    def __init__(self, pts, radius: float = 4.0, step: float = 0.25):
        pts = np.asarray(pts, np.float64)
        dense = [pts[:1]]
        for a, b in zip(pts[:-1], pts[1:]):
            k = max(1, int(np.ceil(np.hypot(*(b - a)) / step)))
            dense.append(a + (b - a) * (np.arange(1, k + 1) / k)[:, None])
        p = np.concatenate(dense)
        k = int(radius / step)
        if len(pts) > 2 and k > 0:  # a moving average over ~2 radii rounds each corner
            pad = np.pad(p, ((k, k), (0, 0)), mode="reflect", reflect_type="odd")
            c = np.cumsum(np.pad(pad, ((1, 0), (0, 0))), 0)
            p = (c[2 * k + 1:] - c[:-2 * k - 1]) / (2 * k + 1)
        self.x, self.y = p[:, 0], p[:, 1]
        self.s = np.concatenate([[0], np.cumsum(np.hypot(np.diff(self.x), np.diff(self.y)))])
        self.h = np.unwrap(np.arctan2(np.gradient(self.y), np.gradient(self.x)))
        self.length = self.s[-1]

    def at(self, s):
        s = np.asarray(s, np.float64)
        h = np.interp(s, self.s, self.h)
        over = s - np.clip(s, 0, self.length)  # beyond either end: straight on
        x = np.interp(s, self.s, self.x) + over * np.cos(h)
        y = np.interp(s, self.s, self.y) + over * np.sin(h)
        return x, y, h


# ------------------------------------------------------------------------------------------- apron


class _Apron:
    """The static scene in the road frame at voxel size: rows i <-> x = (i + 0.5) vx, columns j <->
    y = (j + 0.5) vy - WIDTH / 2. Holds the ground's class, height and level per column, whether a
    sensor on the road sees that ground, and everything static above it."""

    def __init__(self, length: float, vox: tuple, Z: int, base: float):
        self.vox, self.Z, self.base = vox, Z, base
        vx, vy, _ = vox
        self.L, self.W = int(np.ceil(length / vx)), int(np.ceil(WIDTH / vy))
        self.xs = (np.arange(self.L) + 0.5) * vx
        self.ys = (np.arange(self.W) + 0.5) * vy - WIDTH / 2
        self.ground = np.full((self.L, self.W), A["apron"], np.uint8)
        self.occ = np.full((self.L, self.W, Z), AIRSIDE_FREE, np.uint8)
        self.stands: list[dict] = []

    def row(self, x):
        return np.clip(np.floor(np.asarray(x) / self.vox[0]), 0, self.L - 1).astype(np.int64)

    def col(self, y):
        return np.clip(np.floor((np.asarray(y) + WIDTH / 2) / self.vox[1]), 0, self.W - 1).astype(np.int64)

    def paint(self, x0: float, y0: float, x1: float, y1: float, cls: int = A["marking"]) -> None:
        """A painted line one voxel wide from (x0, y0) to (x1, y1)."""
        n = max(2, int(np.hypot(x1 - x0, y1 - y0) / (0.5 * min(self.vox[:2]))) + 1)
        t = np.linspace(0, 1, n)
        self.ground[self.row(x0 + t * (x1 - x0)), self.col(y0 + t * (y1 - y0))] = cls

    def stamp(self, pts: np.ndarray, cls: int) -> None:
        """Road-frame points (x, y, z above the ground) into the static voxels, each on its column's ground."""
        vx, vy, vz = self.vox
        i, j = np.floor(pts[:, 0] / vx).astype(np.int64), np.floor((pts[:, 1] + WIDTH / 2) / vy).astype(np.int64)
        ok = (i >= 0) & (i < self.L) & (j >= 0) & (j < self.W)
        i, j, z = i[ok], j[ok], pts[ok, 2]
        k = self.gl[i, j] + 1 + np.floor(z / vz).astype(np.int64)
        ok = k < self.Z
        self.occ[i[ok], j[ok], k[ok]] = cls


def _place(pts: np.ndarray, x: float, y: float, h: float) -> np.ndarray:
    """Body-frame points turned by heading h and moved to (x, y)."""
    c, s = np.cos(h), np.sin(h)
    return np.stack([x + c * pts[:, 0] - s * pts[:, 1], y + s * pts[:, 0] + c * pts[:, 1], pts[:, 2]], -1)


def _knots(rng: np.random.Generator, xs: np.ndarray, lo: float, hi: float, every: float) -> np.ndarray:
    """A value wandering smoothly along x between lo and hi."""
    k = rng.uniform(lo, hi, int(xs[-1] / every) + 2)
    return np.interp(xs / every, np.arange(len(k)), k)


def _apron(rng: np.random.Generator, length: float, vox: tuple, Z: int, base: float, spacing: tuple,
           focus: float) -> _Apron:
    """Lay out one apron: the stepped facade with gaps, the stands (one at least with an aircraft on
    the move, near x = focus), the ground's height and classes, the painted lines, and the static
    things above the ground."""
    ap = _Apron(length, vox, Z, base)
    xs, ys = ap.xs, ap.ys
    # the facade: segments 12-24 m off the road, now and then a gap where the terminal steps back
    face = np.full(ap.L, np.inf)
    x, gap = -10.0, False
    while x < length + 10:
        gap = not gap and x > 0 and rng.random() < 0.2
        n = rng.uniform(20, 40) if gap else rng.uniform(30, 90)
        face[ap.row(max(x, 0)):ap.row(x + n) + 1] = np.inf if gap else rng.uniform(12, 24)
        x += n
    ap.face = face
    # stands along the other side, 46-52 m apart; a stand whose rotunda falls in a gap is a remote one
    x = rng.uniform(12, 30)
    while x < length - 8:
        L, S, D = rng.uniform(35, 40), rng.uniform(34, 36), rng.uniform(3.8, 4.1)
        yn = rng.uniform(-10.5, -9.0)
        xr = x - rng.uniform(11, 14)
        state = rng.choice(["parked", "pushback", "arriving", "empty"], p=[0.55, 0.2, 0.15, 0.1])
        ap.stands.append(dict(x=x, L=L, S=S, R=D / 2, D=D, yn=yn, yc=yn - L / 2, xr=xr, state=str(state),
                              contact=bool(np.isfinite(face[ap.row(xr)]) and xr > 0)))
        x += rng.uniform(46, 52)
    if ap.stands and not any(s["state"] in ("pushback", "arriving") for s in ap.stands):
        # every scene shows an aircraft on the move: the stand nearest the ego's middle pushes back
        min(ap.stands, key=lambda s: abs(s["x"] - focus))["state"] = "pushback"
    # the ground's height: the road level, the apron rising towards the terminal (1.5 %: it drains
    # away from the building) and falling away on the stands' side, with a drainage wave along x
    yy = ys[None, :]
    away = np.clip(-yy - ROAD, 0, None)
    wave = 0.05 * np.sin(2 * np.pi * xs / rng.uniform(40, 70) + rng.uniform(0, 2 * np.pi))[:, None]
    height = base + 0.015 * np.clip(yy - ROAD, 0, None) - rng.uniform(0, 0.008) * away \
        + wave * np.clip(away / 10, 0, 1)
    ap.gl = np.clip(np.floor(height / vox[2]), 0, Z - 1).astype(np.int64)
    # what the road sees of the ground (lidar grazes flat ground): a reach that wanders along the
    # road, separately on each side, and never past the facade
    reach_far = _knots(rng, xs, 5, 15, 20)[:, None]
    reach_near = np.minimum(_knots(rng, xs, 7, 18, 20), face)[:, None]
    seen = np.where(yy >= 0, yy < reach_near, -yy < reach_far)
    ap.ground[np.isinf(face)[:, None] & (yy > GSE_Y + 3)] = A["grass"]
    _markings(ap)
    for s, t in zip(ap.stands, ap.stands[1:]):  # grass islands at the far end between stands
        ap.ground[ap.row(s["x"] + 21):ap.row(t["x"] - 21), ys < -28] = A["grass"]
    _structures(rng, ap, spacing)
    cell = np.take_along_axis(ap.occ, ap.gl[..., None], 2)[..., 0]
    put = seen & (cell == AIRSIDE_FREE)
    np.put_along_axis(ap.occ, ap.gl[..., None], np.where(put, ap.ground, cell)[..., None], 2)
    return ap


def _markings(ap: _Apron) -> None:
    """Painted lines: the road's edges and dashed centre, the equipment lane's edge, each stand's
    lead-in (taxi) line, stop bars, restraint and boundary lines, and zebra crossings."""
    end = ap.xs[-1]
    for y in (-ROAD, ROAD, GSE_Y + 1.8):
        ap.paint(0, y, end, y)
    for x in np.arange(0, end, 8.0):
        ap.paint(x, 0, x + 3, 0)
    for s in ap.stands:
        x, yn = s["x"], s["yn"]
        ap.paint(x, -ROAD - 1.5, x, -WIDTH / 2)
        for k in range(3):  # stop bars for three aircraft types, at the nose wheel
            yb = yn - 0.13 * s["L"] - 1.2 * k
            ap.paint(x - 1.5, yb, x + 1.5, yb)
        ap.paint(x - 20, yn + 0.8, x + 20, yn + 0.8)
        for side in (-1, 1):
            ap.paint(x + side * 20, yn + 0.8, x + side * 20, -WIDTH / 2)
        if (int(x) // 7) % 2:  # a zebra crossing beside some stands
            for y in np.arange(-ROAD + 0.5, ROAD, 1.0):
                ap.paint(x + 15, y, x + 18, y)


def _structures(rng: np.random.Generator, ap: _Apron, spacing: tuple) -> None:
    """The facade (a wall one voxel thick, its steps and ends included), rotundas and jet bridges,
    light masts, cones, ground power units and container rows."""
    face, Z = ap.face, ap.Z
    zl = np.arange(Z)
    fin = np.isfinite(face)
    for i in np.flatnonzero(fin):
        js = [ap.col(face[i])]
        for k in (i - 1, i + 1):  # a step to the neighbouring segment, or the building's end
            if 0 <= k < ap.L and face[k] != face[i]:
                other = face[k] if np.isfinite(face[k]) else face[i] + 8
                if other > face[i]:
                    js = range(ap.col(face[i]), ap.col(other) + 1)
        for j in js:
            ap.occ[i, j, zl > ap.gl[i, j]] = A["terminal"]
    box = shapes.box(0.5, 0.5, 9.0, spacing)
    for s in ap.stands:
        x, R = s["x"], s["R"]
        if s["contact"]:  # rotunda on its pillar, the bridge over the road, its drive column
            xr, yr = s["xr"], face[ap.row(s["xr"])] - 2.6
            ring = shapes.tube(2.6, 7.5, 2.0, 0.0, spacing[::-1])[:, [1, 2, 0]] + [xr, yr, 0]  # a tube stood upright
            disc = shapes.quad((xr - 2, yr - 2, 2.6), (4, 0, 0), (0, 4, 0), spacing)
            disc = disc[np.hypot(disc[:, 0] - xr, disc[:, 1] - yr) <= 2.0]
            ap.stamp(np.concatenate([ring, disc, shapes.box(0.8, 0.8, 2.6, spacing, xr, yr)]), A["jet_bridge"])
            docked = s["state"] == "parked"
            end = np.array([x - R - 1.6, s["yn"] - 5.0]) if docked else np.array([xr + 1.5, -8.5])
            start = np.array([xr, yr - 2.0])
            u = end - start
            n = np.array([-u[1], u[0]]) / np.hypot(*u)
            zf = rng.uniform(2.8, 3.15)  # a door sill of 2.8-3.2 m
            bw, bh = 2.5, 2.9  # the tunnel's outer width and height
            tube = [shapes.quad((*(start - bw / 2 * n), zf), (*u, 0), (*(bw * n), 0), spacing),
                    shapes.quad((*(start - bw / 2 * n), zf + bh), (*u, 0), (*(bw * n), 0), spacing)]
            for side in (-bw / 2, bw / 2):
                tube.append(shapes.quad((*(start + side * n), zf), (*u, 0), (0, 0, bh), spacing))
            h = np.arctan2(u[1], u[0])
            tube.append(_place(shapes.box(3.0, 3.4, 3.0, spacing, z0=zf - 0.1, floor=True), *end, h))
            col = end - 2.5 * u / np.hypot(*u)
            for side in (-0.9, 0.9):
                tube.append(shapes.quad((*(col + side * n), 0), (0, 0, 0), (0, 0, zf), spacing))
            tube.append(_place(shapes.box(1.2, 2.6, 0.9, spacing), *col, h))
            ap.stamp(np.concatenate(tube), A["jet_bridge"])
        if rng.random() < 0.8:  # a light mast at the stand's boundary
            ap.stamp(box + [x + 22.5 + rng.uniform(-1, 1), rng.uniform(-36, -26), 0], A["light_mast"])
        if s["state"] == "parked":  # cones at the nose, the wing tips, the engines and the tail
            cone = shapes.box(0.4, 0.4, 0.7, spacing)
            yc, L, S = s["yc"], s["L"], s["S"]
            spots = [(x, s["yn"] + 1.5), (x - S / 2 - 1, yc - 0.02 * L), (x + S / 2 + 1, yc - 0.02 * L),
                     (x - 0.16 * S, yc + 0.12 * L), (x + 0.16 * S, yc + 0.12 * L), (x, yc - L / 2 - 1.5)]
            for cx, cy in spots:
                if rng.random() < 0.8:
                    ap.stamp(cone + [cx, cy, 0], A["traffic_cone"])
            if s["contact"]:  # a ground power unit by the nose
                ap.stamp(shapes.box(1.8, 1.1, 1.4, spacing, x + 3.2, s["yn"] - 1.5), A["others"])
        if rng.random() < 0.5:  # a row of baggage containers in the equipment area
            x0, y0 = x + 20 + rng.uniform(-0.5, 0.5), rng.uniform(-20, -12)
            for k in range(int(rng.integers(2, 6))):
                ap.stamp(shapes.box(1.6, 1.5, 1.6, spacing, x0, y0 - 1.8 * k), A["others"])


# ----------------------------------------------------------------------------------------- traffic


class _Agents:
    """What moves or could: (class, body points, x (T,), y (T,), heading (T,), group, length, width);
    a group (a train, an aircraft and its tug) is kept or dropped as one."""

    def __init__(self, n: int, spacing: tuple):
        self.n, self.spacing, self.items, self.groups = n, spacing, [], 0

    def group(self) -> int:
        self.groups += 1
        return self.groups

    def add(self, kind: str, x, y, h, g=None, raised: bool = False, plane: dict = None) -> None:
        """An agent of `kind` (or the aircraft of stand `plane`) at poses x, y, h (arrays or numbers)."""
        if plane:
            cls, l, w = A["aircraft"], plane["L"], plane["S"]
            pts = shapes.aircraft(round(plane["L"], 1), round(plane["S"], 1), round(plane["D"], 2), self.spacing)
        else:
            (name, l, w), pts = KIND[kind], shapes.shape(kind, self.spacing, raised)
            cls = A[name]
        full = [np.broadcast_to(np.asarray(v, np.float64), (self.n,)).copy() for v in (x, y, h)]
        self.items.append((cls, pts, *full, self.group() if g is None else g, l, w))

    def train(self, route: _Route, s, carts: int, g=None) -> None:
        """A tug pulling `carts` carts along a route, each cart on the tug's path behind it."""
        g = self.group() if g is None else g
        self.add("tug", *route.at(s), g)
        for k in range(carts):  # a tow bar of 0.8 m between each two
            self.add("baggage_cart", *route.at(s - (1.4 + 0.8 + 1.5) - k * (3.0 + 0.8)), g)

    def walker(self, rng: np.random.Generator, pts, start: float = 0.0) -> None:
        """A person walking a route at 0.5-1.5 m/s with pauses, or (a third of them) standing."""
        route, v = _Route(pts, radius=0.5), rng.uniform(0.5, 1.5)
        s = _travel(rng, self.n, v, v, 0.5, start, route.length, 0.8, 1.0) if rng.random() < 0.67 else np.zeros(self.n)
        self.add("person", *route.at(s))

    def clear_of(self, ex: np.ndarray, ey: np.ndarray) -> list:
        """The agents of every group none of whose members ever comes within a metre of the ego."""
        near = set()
        for cls, _, x, y, h, g, l, w in self.items:
            hx = 0.5 * (np.abs(l * np.cos(h)) + np.abs(w * np.sin(h))) + EGO[0] / 2 + 1.0
            hy = 0.5 * (np.abs(l * np.sin(h)) + np.abs(w * np.cos(h))) + EGO[1] / 2 + 1.0
            if ((np.abs(x - ex) < hx) & (np.abs(y - ey) < hy)).any():
                near.add(g)
        return [a for a in self.items if a[5] not in near]


def _stand(rng: np.random.Generator, ag: _Agents, s: dict, t_pass: float) -> None:
    """An aircraft at a stand with its ground service, pushed back, taxiing in, or an empty stand;
    t_pass: when the ego passes the stand (what moves is timed to be seen)."""
    n, x, yn, yc, L, S, R = ag.n, s["x"], s["yn"], s["yc"], s["L"], s["S"], s["R"]
    right, xe = x + R, x + 22.5  # the service side (the aircraft's right), the equipment area
    y_fwd, y_aft, y_r2 = yn - 9.5, yc - L / 2 + 12, yc - L / 2 + 6.5
    end = (n - 1) * DT

    def parked_train(x0, y0):
        ag.train(_Route([(x0, y0), (x0, y0 - 30)]), np.zeros(n), int(rng.integers(2, 5)))

    if s["state"] == "parked":
        ag.add(None, x, yc, np.pi / 2, plane=s)
        ag.add("belt_loader", right + 3.8, y_fwd, np.pi, raised=True)
        if rng.random() < 0.5:
            ag.add("belt_loader", right + 3.8, y_aft, np.pi, raised=True)
        else:  # driving to the aft hold from the equipment area
            route = _Route([(xe + 4, STAND_Y), (right + 12, STAND_Y), (right + 12, y_aft), (right + 3.8, y_aft)])
            v, start = rng.uniform(2.5, 4.5), float(np.clip(t_pass - rng.uniform(0, 12), 0, end))
            ag.add("belt_loader", *route.at(_travel(rng, n, v, v, 0.0, start, route.length)))
        if rng.random() < 0.5:
            parked_train(right + 8.5, y_fwd - 2)
        else:  # a train from the equipment lane, across the road to the forward hold
            d = rng.choice([-1, 1])
            route = _Route([(x + d * 40, GSE_Y), (right + 8.5, GSE_Y), (right + 8.5, y_fwd - 4)], radius=5)
            v, start = rng.uniform(3, 6), float(np.clip(t_pass - rng.uniform(5, 15), 0, end))
            ag.train(route, _travel(rng, n, v, v + 1, 0.2, start, route.length), int(rng.integers(2, 5)))
        if rng.random() < 0.5:
            ag.add("fuel", x + 9.5, yc - 1, rng.choice([-1, 1]) * np.pi / 2)
        if rng.random() < 0.5:
            ag.add("catering", right + 4.1, y_r2, 0.0, raised=True)
        if not s["contact"]:  # a remote stand: stairs at the doors, a bus for the passengers
            ag.add("stairs", x - R - 3.9, yn - 5, 0.0)
            if rng.random() < 0.5:
                ag.add("bus", x - 16, yn - 6, -np.pi / 2)
        if rng.random() < (0.6 if not s["contact"] else 0.3):
            ag.add("stairs", x - R - 3.9, y_r2, 0.0)
        for _ in range(int(rng.integers(2, 6))):  # ground crew on the service side
            a, b = [(right + rng.uniform(1, 6), rng.uniform(y_aft, yn)) for _ in range(2)]
            ag.walker(rng, [a, b, a])
        return
    if s["state"] == "pushback":
        g, side = ag.group(), rng.choice([-1, 1])
        route = _Route([(x, yc), (x, yc - 40), (x + side * 25, yc - 65)], radius=15)
        start = float(np.clip(t_pass - rng.uniform(4, 12), 0, max(0.0, end - 10)))
        sa = _travel(rng, n, 0.0, rng.uniform(0.9, 1.2), 0.0, start, acc=0.3, dec=0.3)
        ax, ay, ah = route.at(sa)
        ag.add(None, ax, ay, ah + np.pi, g, plane=s)
        ag.add("pushback", *route.at(sa - L / 2 - 1.0), g)
        if rng.random() < 0.7:  # a wing walker beside the tip
            k = rng.choice([-1, 1]) * (S / 2 + 0.8)
            ag.add("person", ax - k * np.sin(ah), ay + k * np.cos(ah), ah, g)
    elif s["state"] == "arriving":  # taxiing in along the lead-in line, braking to the stop bar
        side, v, dec = rng.choice([-1, 1]), rng.uniform(3, 8), 0.5
        route = _Route([(x + side * 45, yc - 75), (x, yc - 45), (x, yc)], radius=15)
        D = route.length
        start = t_pass + rng.uniform(-2, 8) - ((D - v * v / (2 * dec)) / v + v / dec)
        s0 = 0.0 if start >= 0 else min(-start * v, D - 5)  # already on its way when the scene starts
        ag.add(None, *route.at(s0 + _travel(rng, n, v, v, 0.0, max(start, 0.0), D - s0, 0.5, dec)), plane=s)
        ag.add("person", x - 5, yn + 1.2, -np.pi / 2)  # the marshaller
    else:
        for _ in range(int(rng.integers(0, 3))):
            ag.walker(rng, [(x + rng.uniform(-10, 10), rng.uniform(-30, -8)), (x + rng.uniform(-10, 10), -8)])
    if rng.random() < 0.7:  # equipment waiting in the equipment area
        ag.add("belt_loader", xe + 2.5, -11, -np.pi / 2)
    if rng.random() < 0.6:
        parked_train(xe + 2.5, -17)


def _traffic(rng: np.random.Generator, ag: _Agents, ap: _Apron) -> None:
    """Traffic on the service road and the equipment lane (trains, service trucks, buses, belt loaders,
    stairs: stop-and-go, some turning into a stand's equipment area), equipment parked along the
    facade where there is room and no bridge, people walking along the facade and over the crossings."""
    n, length = ag.n, ap.xs[-1]
    speed = {"train": (3, 7, 0.4), "fuel": (3, 8, 0.5), "catering": (3, 8, 0.5), "bus": (5, 10, 0.4),
             "belt_loader": (3, 6, 0.3), "stairs": (1.5, 3, 0.2)}
    for lane, count in (("road", rng.poisson(length / 18)), ("gse", rng.poisson(length / 30) + 1)):
        for _ in range(count):
            d = rng.choice([-1, 1])
            if lane == "road":
                y, kind = -d * LANE, rng.choice(list(speed), p=[0.35, 0.18, 0.12, 0.17, 0.1, 0.08])
            else:
                y, kind = GSE_Y + d * 0.8, rng.choice(["train", "belt_loader", "stairs", "catering"],
                                                     p=[0.6, 0.15, 0.15, 0.1])
            x0 = rng.uniform(-40, length + 40)
            pts = [(x0, y), (x0 + d * 400, y)]
            ahead = [s["x"] + 22.5 for s in ap.stands if (s["x"] + 22.5 - x0) * d > 15]
            if ahead and kind != "bus" and rng.random() < 0.3:
                xe = min(ahead, key=lambda xe: abs(xe - x0))
                pts = [(x0, y), (xe, y), (xe, -14), (xe, -60)]
            route, (lo, hi, stop_p) = _Route(pts, radius=5), speed[kind]
            vmax = rng.uniform(lo, hi)
            s = _travel(rng, n, rng.uniform(0.4, 1) * vmax, vmax, stop_p)
            ag.train(route, s, int(rng.integers(2, 5))) if kind == "train" else ag.add(str(kind), *route.at(s))
    x = rng.uniform(0, 10)
    bridges = np.array([s["xr"] for s in ap.stands if s["contact"]] or [-1e9])
    while x < length:
        room = ap.face[ap.row(x)] - GSE_Y - 2.2
        kind = rng.choice(["train", "belt_loader", "stairs", "catering", "tug"], p=[0.4, 0.2, 0.15, 0.15, 0.1])
        l, w = KIND["tug" if kind == "train" else kind][1:]
        if room > w + 1.5 and np.abs(bridges - x).min() > 8 and rng.random() < 0.35:
            y, h = GSE_Y + 2.2 + w / 2, rng.choice([0.0, np.pi])
            if kind == "train":
                ag.train(_Route([(x, y), (x + 30 * np.cos(h), y)]), np.zeros(n), int(rng.integers(1, 4)))
                l += 12
            else:
                ag.add(str(kind), x, y, h)
        x += l + rng.uniform(2, 12)
    for _ in range(rng.poisson(length / 40)):
        x0 = rng.uniform(0, length)
        yf = ap.face[ap.row(x0)]
        if np.isfinite(yf):
            y, d = yf - rng.uniform(1.0, 2.0), rng.choice([-1, 1]) * rng.uniform(5, 30)
            ag.walker(rng, [(x0, y), (x0 + d, y)])
    for s in ap.stands:
        if (int(s["x"]) // 7) % 2:  # the stands with a zebra crossing
            for _ in range(rng.poisson(1.5)):
                xz = s["x"] + 16.5 + rng.uniform(-1, 1)
                pts = [(xz, GSE_Y + 1.5), (xz, STAND_Y - 2), (xz + rng.uniform(-5, 5), -14)]
                ag.walker(rng, pts[::rng.choice([-1, 1])], start=rng.uniform(0, 15))


# ----------------------------------------------------------------------------------------- rendering


def _render(ap: _Apron, agents: list, ex: np.ndarray, ey: np.ndarray, grid: tuple, with_mask: bool):
    """Every frame ego-centred: the static apron cropped, then all agents' points in one scatter
    (into free voxels and each other's, never into the static scene), and the mask seen from the
    ego's sensor."""
    X, Y, Z = grid
    vx, vy, vz = ap.vox
    T = len(ex)
    occ = np.empty((T, X, Y, Z), np.uint8)
    mask = np.empty((T, X, Y, Z), np.uint8) if with_mask else None
    if agents:
        pts = np.concatenate([a[1] for a in agents])
        who = np.concatenate([np.full(len(a[1]), k, np.int32) for k, a in enumerate(agents)])
        cls = np.concatenate([np.full(len(a[1]), a[0], np.uint8) for a in agents])
        bx, by, lz = pts[:, 0], pts[:, 1], np.floor(pts[:, 2] / vz).astype(np.int64)
        rad = np.array([np.hypot(a[1][:, 0], a[1][:, 1]).max() for a in agents])
        AX, AY, AH = (np.stack([a[i] for a in agents]) for i in (2, 3, 4))  # (agents, T)
    for t in range(T):
        i0 = int(round((ex[t] - 40.0) / vx))
        j0 = int(round((ey[t] - 40.0 + WIDTH / 2) / vy))
        frame = np.full((X, Y, Z), AIRSIDE_FREE, np.uint8)
        part = ap.occ[max(i0, 0):i0 + X, j0:j0 + Y]
        frame[max(0, -i0):max(0, -i0) + part.shape[0], :part.shape[1]] = part
        if agents:
            ax, ay, ah = AX[:, t], AY[:, t], AH[:, t]
            near = (np.abs(ax - ex[t]) < 40 + rad) & (np.abs(ay - ey[t]) < 40 + rad)
            sel = np.flatnonzero(near[who])
            k = who[sel]
            c, s = np.cos(ah)[k], np.sin(ah)[k]
            # placed on the cropped static grid (not at the ego's sub-voxel offset), so what stands
            # still stays in the same voxels as the apron around it
            ix = np.floor(((ax - i0 * vx)[k] + c * bx[sel] - s * by[sel]) / vx).astype(np.int64)
            iy = np.floor(((ay + WIDTH / 2 - j0 * vy)[k] + s * bx[sel] + c * by[sel]) / vy).astype(np.int64)
            iz = (ap.gl[ap.row(ax), ap.col(ay)] + 1)[k] + lz[sel]
            ok = (ix >= 0) & (ix < X) & (iy >= 0) & (iy < Y) & (iz < Z)
            ix, iy, iz, cc = ix[ok], iy[ok], iz[ok], cls[sel][ok]
            cur = frame[ix, iy, iz]
            # the static scene stays as it is (agents stand on the ground, never in it or in a wall)
            keep = (cur == AIRSIDE_FREE) | ((cur >= A["aircraft"]) & (cur <= A["person"]))
            frame[ix[keep], iy[keep], iz[keep]] = cc[keep]
        occ[t] = frame
        if with_mask:  # the occ3d style's sensor (free is Occ3D's id there); its columns are solid
            # from the ground up, so a bridge overhead would hide all behind it: bridges do not occlude
            see = (frame == AIRSIDE_FREE) | (frame == A["jet_bridge"])
            mask[t] = _sensor_mask(np.where(see, OCC3D_FREE, 0).astype(np.uint8), ap.vox, ap.base)
    return occ, mask


def _ego(rng: np.random.Generator, frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The ego's x, y in the road frame: the right lane at 0-8 m/s, stopping at times."""
    vmax = rng.uniform(4, 8)
    ex = 50.0 + _travel(rng, frames, rng.uniform(0, 1) * vmax, vmax, 0.4)
    return ex, np.full(frames, -LANE)


def make_scene(seed: int, index: int, grid: tuple[int, int, int], frames: int, with_mask: bool = True,
               split_id: int = 0) -> dict:
    """One scene: dict(name, occ uint8 (T,X,Y,Z), pose float64 (T,4,4), timestamp int64 (T,), mask)."""
    X, Y, Z = grid
    vox = (80.0 / X, 80.0 / Y, 6.4 / Z)
    spacing = (min(vox[:2]) / 2, min(vox[:2]) / 2, vox[2] / 2)  # surface points at most half a voxel apart
    rng = np.random.default_rng([seed, split_id, index])
    ex, ey = _ego(rng, frames)
    # the road's height over the grid's floor, 0.30-0.37 m, spread over every 4 consecutive scenes:
    # the apron then lies in the lowest 0.8 m and, at 0.4 m levels, in the two lowest (as Occ3D's
    # ground does: the bands allow little ground on the second level)
    base = 0.30 + 0.07 * (index % 4 + rng.uniform()) / 4
    ap = _apron(rng, ex[-1] + 50.0, vox, Z, base, spacing, focus=float(ex[frames // 2]))
    ag = _Agents(frames, spacing)
    for s in ap.stands:
        _stand(rng, ag, s, DT * min(frames - 1, int(np.searchsorted(ex, s["x"]))))
    _traffic(rng, ag, ap)
    occ, mask = _render(ap, ag.clear_of(ex, ey), ex, ey, grid, with_mask)
    return scene_record(rng, ex, ey, occ, mask, seed, index, split_id)
