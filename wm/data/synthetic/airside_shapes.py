"""The shapes of the airside style's classes (wm/data/synthetic/airside.py) as clouds of surface points
at most half a voxel apart, in each body's own frame (x forward, z up from the ground): aircraft
(fuselage, wings, engines, tail, gear), ground equipment, buses and people. `spacing` is the point step
along x, y, z in metres."""

from __future__ import annotations

import functools

import numpy as np


def lin(a: float, b: float, step: float) -> np.ndarray:
    """Cell centres of the fewest equal cells no longer than `step` between a and b."""
    n = max(1, int(np.ceil(abs(b - a) / step - 1e-9)))
    return a + (np.arange(n) + 0.5) * (b - a) / n


def quad(p0, u, v, spacing) -> np.ndarray:
    """Points on the parallelogram p0 + a u + b v (a, b in [0, 1]), no two neighbours further apart than
    spacing = (sx, sy, sz) along any axis."""
    p0, u, v, spacing = (np.asarray(a, np.float64) for a in (p0, u, v, spacing))
    a = lin(0, 1, 1 / max(np.max(np.abs(u) / spacing), 1e-9))
    b = lin(0, 1, 1 / max(np.max(np.abs(v) / spacing), 1e-9))
    aa, bb = np.meshgrid(a, b, indexing="ij")
    return (p0 + aa.reshape(-1, 1) * u + bb.reshape(-1, 1) * v).reshape(-1, 3)


def box(l: float, w: float, h: float, spacing, x0: float = 0.0, y0: float = 0.0, z0: float = 0.0,
         floor: bool = False) -> np.ndarray:
    """An upright box's observed shell (its four sides and roof; its floor too when it hangs in the
    air), centred at (x0, y0), from z0 to z0 + h."""
    e = 1e-3  # keeps the faces inside the box's own voxels
    x, y, z, X, Y, H = x0 - l / 2 + e, y0 - w / 2 + e, z0, l - 2 * e, w - 2 * e, h - e
    faces = [((x, y, z), (X, 0, 0), (0, 0, H)), ((x, y + Y, z), (X, 0, 0), (0, 0, H)),
             ((x, y, z), (0, Y, 0), (0, 0, H)), ((x + X, y, z), (0, Y, 0), (0, 0, H)),
             ((x, y, z + H), (X, 0, 0), (0, Y, 0))] + ([((x, y, z), (X, 0, 0), (0, Y, 0))] if floor else [])
    return np.concatenate([quad(*f, spacing) for f in faces])


def tube(x0: float, x1: float, r, zc, spacing, y0: float = 0.0) -> np.ndarray:
    """The surface of a tube along x from x0 to x1, radius r(x) and axis height zc(x) (functions or numbers)."""
    r = r if callable(r) else functools.partial(np.full_like, fill_value=r)
    zc = zc if callable(zc) else functools.partial(np.full_like, fill_value=zc)
    rmax = max(float(np.max(r(np.linspace(x0, x1, 64)))), 1e-3)
    xs = lin(x0, x1, spacing[0])
    ph = lin(0, 2 * np.pi, min(spacing[1], spacing[2]) / rmax)
    xx, pp = np.meshgrid(xs, ph, indexing="ij")
    rr = r(xx)
    return np.stack([xx, y0 + rr * np.cos(pp), zc(xx) + rr * np.sin(pp)], -1).reshape(-1, 3)


def wing(x_le: float, y0: float, y1: float, c0: float, c1: float, z0: float, sweep: float, dih: float,
          spacing, both: bool = True) -> np.ndarray:
    """A thin swept, tapered surface from span y0 to y1 (both sides of the body when `both`)."""
    ys = lin(y0, y1, min(spacing[0], spacing[1]))
    f = lin(0, 1, min(spacing[0], spacing[1]) / max(c0, c1))
    yy, ff = np.meshgrid(ys, f, indexing="ij")
    t = (yy - y0) / max(y1 - y0, 1e-6)
    le = x_le - np.tan(sweep) * (yy - y0)
    pts = np.stack([le - ff * (c0 + (c1 - c0) * t), yy, z0 + np.tan(dih) * (yy - y0)], -1).reshape(-1, 3)
    return np.concatenate([pts, pts * [1, -1, 1]]) if both else pts


@functools.lru_cache(maxsize=64)
def aircraft(L: float, S: float, D: float, spacing: tuple) -> np.ndarray:
    """A narrow-body airliner's surface points, body frame (x forward from mid-length, y left, z up
    from the ground), cut off above 7.5 m (no grid reaches higher): fuselage with nose and upswept
    tail cone, swept wings with dihedral, two engines, stabilisers, fin and gear."""
    R, half = D / 2, S / 2
    zc0, xn, xt = 1.9 + R, L / 2 - 0.1 * L, -L / 2 + 0.28 * L

    def r(x):
        return np.where(x < xt, R * (0.3 + 0.7 * (x + L / 2) / (xt + L / 2)), R)

    def zc(x):
        return zc0 + np.where(x < xt, 0.5 * R * (xt - x) / (xt + L / 2), 0.0)

    a = L / 2 - xn  # the nose: an ellipsoidal cap, sampled by its angle (its tip is steep in x)
    tt, pp = np.meshgrid(lin(0, np.pi / 2, min(spacing) / max(a, R)), lin(0, 2 * np.pi, min(spacing) / R), indexing="ij")
    nose = np.stack([xn + a * np.sin(tt), R * np.cos(tt) * np.cos(pp), zc0 + R * np.cos(tt) * np.sin(pp)], -1)
    parts = [tube(-L / 2, xn, r, zc, spacing), nose.reshape(-1, 3)]
    c_root, x_le = 0.15 * L, 0.04 * L
    z_wing, sweep, dih = zc0 - 0.55 * R, np.radians(25), np.radians(5)
    parts.append(wing(x_le, 0.8 * R, half, c_root, 0.25 * c_root, z_wing, sweep, dih, spacing))
    ye = 0.32 * half  # engines under the wings
    ze, re_ = z_wing + np.tan(dih) * (ye - 0.8 * R) - 1.35, 0.045 * L
    xe = x_le - np.tan(sweep) * (ye - 0.8 * R) + 2.0
    for side in (-1, 1):
        parts.append(tube(xe - 0.11 * L, xe, re_, ze, spacing, side * ye))
    parts.append(wing(-L / 2 + 0.12 * L, 0.3 * R, 0.17 * S, 0.1 * L, 0.04 * L, zc0 + 0.6 * R, np.radians(30),
                       np.radians(6), spacing))
    fin = wing(-L / 2 + 0.2 * L, zc0 + 0.8 * R, 7.5, 0.17 * L, 0.12 * L, 0.0, np.radians(35), 0.0, spacing, both=False)
    parts.append(np.stack([fin[:, 0], np.zeros(len(fin)), fin[:, 1]], -1))  # the fin stands upright
    xg = L / 2 - 0.13 * L  # nose gear and the two main gears: legs and wheels
    parts += [quad((xg, 0, 0), (0, 0, 0), (0, 0, zc0 - R), spacing), box(0.8, 0.6, 0.8, spacing, xg)]
    xm = x_le - 0.55 * c_root
    for side in (-1, 1):
        parts += [quad((xm, side * 0.2 * half, 0), (0, 0, 0), (0, 0, z_wing), spacing),
                  box(1.4, 1.0, 1.1, spacing, xm, side * 0.2 * half)]
    p = np.concatenate(parts)
    return p[p[:, 2] < 7.5].astype(np.float32)


@functools.lru_cache(maxsize=64)
def shape(kind: str, spacing: tuple, raised: bool = False) -> np.ndarray:
    """Body-frame surface points of a ground vehicle or a person (x forward, z up from the ground);
    `raised`: a belt loader's belt or a catering truck's body lifted to an aircraft's door."""
    if kind == "tug":  # a baggage tractor with its cab
        p = [box(2.8, 1.5, 1.2, spacing), box(1.2, 1.5, 0.8, spacing, -0.6, z0=1.2)]
    elif kind == "pushback":  # low and heavy, its cab at one side
        p = [box(6.0, 2.8, 1.4, spacing), box(1.6, 1.2, 0.8, spacing, -2.0, 0.6, 1.4)]
    elif kind == "baggage_cart":  # a covered cart
        p = [box(3.0, 1.6, 1.9, spacing)]
    elif kind == "belt_loader":  # a chassis with a conveyor rising to the front
        top = 3.2 if raised else 2.2
        p = [box(7.2, 2.1, 1.0, spacing), quad((-3.6, -0.5, 1.1), (7.2, 0, top - 1.1), (0, 1.0, 0), spacing)]
        for side in (-0.55, 0.55):
            p.append(quad((-3.6, side, 1.4), (7.2, 0, top - 1.1), (0, 0, 0.01), spacing))
    elif kind == "fuel":  # a cab and a tank
        p = [box(2.3, 2.5, 2.9, spacing, 3.1), box(6.2, 2.5, 1.0, spacing, -1.1),
             tube(-4.2, 2.0, 1.15, 2.15, spacing)]
    elif kind == "catering":  # a cab and a box body on a scissor lift
        z0 = 2.9 if raised else 1.0
        p = [box(2.2, 2.5, 2.8, spacing, 2.9), box(5.8, 2.5, 2.5, spacing, -1.1, z0=z0, floor=raised),
             box(5.8, 2.4, 0.9, spacing, -1.1)]
        if raised:
            for side in (-1.1, 1.1):
                p += [quad((-3.8, side, 0.9), (5.4, 0, z0 - 0.9), (0, 0.01, 0), spacing),
                      quad((1.6, side, 0.9), (-5.4, 0, z0 - 0.9), (0, 0.01, 0), spacing)]
    elif kind == "stairs":  # a chassis, a flight of stairs up to a platform, handrails
        p = [box(7.6, 2.4, 1.2, spacing), quad((-3.4, -0.7, 1.2), (5.6, 0, 2.3), (0, 1.4, 0), spacing),
             box(1.4, 1.6, 0.05, spacing, 2.9, z0=3.5)]
        for side in (-0.75, 0.75):
            p.append(quad((-3.4, side, 1.3), (5.6, 0, 2.3), (0, 0, 1.0), spacing))
    elif kind == "bus":
        p = [box(13.0, 3.0, 3.0, spacing)]
    elif kind == "person":
        p = [box(0.6, 0.6, 1.75, spacing)]
    else:
        raise ValueError(kind)
    return np.concatenate(p).astype(np.float32)
