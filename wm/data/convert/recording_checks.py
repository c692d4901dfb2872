"""Own recordings: checks of their timing and geometry, and fitting their grid to the model.

Used by tools/convert_frames.py (planning, in the main process) and wm.data.convert.frames.read_frame
(the crop / pad of every frame, in the workers):

- `check_range`: the data set's `range` must span grid x voxel size.
- `grid_note`: the warning when X or Y is not a multiple of GRID_MULTIPLE, saying which tokenizer
  refuses the grid (OccWorld's 3 levels; the default 2 levels need multiples of 2) and both fixes;
  `plan_fit` / `reframe`: --crop / --pad to such a grid, kept around the ego, with the range moved along.
- `time_unit_outliers`: a scene whose median frame interval is x1000 (or more) off the others' (one
  drive in milliseconds among drives in seconds) is refused, named.
- `int64_us` / `rate_problem`: timestamps that do not fit int64 microseconds in the unit given, a
  median rate outside what sensor logs record (MIN_HZ..MAX_HZ), or one that contradicts a given
  frame_rate_hz, are refused in one line naming the unit the timestamps look like.
- `yaw_stats` / `yaw_unit_note`: a yaw column that looks like degrees gets a warning. The rule,
  measured on 2000 fabricated drives each at 2 and 10 Hz (24-40 frames, yaw rates up to 0.5 rad/s,
  any heading): some |yaw| > 2 pi or a turn faster than 2 rad/s read as radians warned on 0 % of
  drives in radians and caught 99.2 % (2 Hz) / 100 % (10 Hz) of the same drives in degrees; "no
  |yaw| above pi but a step above 0.5 rad" warned on 17 % / 4 % of the radian drives (steps across
  the +-pi wrap) and caught 0.1 % of the degree ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from wm.utils.errors import DataError


# OccWorld's tokenizer downsamples X and Y twice by 2 (wm.config.sections refuses grids that tokenizer.widths
# cannot divide); fewer tokenizer levels need only a divisor of 4.
GRID_MULTIPLE = 4
# timestamp units (--time-unit) in microseconds, each x1000 finer than the one before
TIME_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}
UNITS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}
# Frame rates of sensor logs (camera/lidar keyframes 0.5-2 Hz up to 100 Hz IMU-synchronous grids):
# a median rate outside them says the timestamps' unit is wrong, not the sensor.
MIN_HZ, MAX_HZ = 0.5, 100.0
# a frame_rate_hz given beside the timestamps may differ from their median rate by clock jitter only
RATE_TOL = 0.05
# A yaw rate no ground vehicle reaches (rad/s); yaw written in degrees but read as radians turns
# 57x faster than it should (a 3 deg/s turn reads as 3 rad/s).
MAX_YAW_RATE = 2.0


def check_range(grid, voxel, rng, where: str) -> None:
    """`range` must span grid x voxel size on every axis (to 0.1 % of a voxel), else one line."""
    span = [rng[i + 3] - rng[i] for i in range(3)]
    want = [g * v for g, v in zip(grid, voxel)]
    if any(abs(a - b) > 1e-3 * v for a, b, v in zip(span, want, voxel)):
        raise DataError(f"{where}: range {[float(r) for r in rng]} spans {' x '.join(f'{a:g}' for a in span)} m, "
                        f"but the grid {' x '.join(map(str, grid))} of {' x '.join(f'{v:g}' for v in voxel)} m voxels "
                        f"spans {' x '.join(f'{b:g}' for b in want)} m; correct range or voxel_size (or leave range "
                        "out: it defaults to the grid centred on the ego)")


def grid_note(grid, multiple: int = GRID_MULTIPLE) -> Optional[str]:
    """A warning when X or Y is not a multiple of `multiple` (4: a 3-level tokenizer's), saying which
    tokenizers take the grid: the default 2-level one needs multiples of 2 only."""
    bad = [(a, n) for a, n in zip("XY", grid[:2]) if n % multiple]
    if not bad:
        return None
    down = [n // multiple * multiple for n in grid[:2]]
    up = [-(-n // multiple) * multiple for n in grid[:2]]
    z = grid[2]
    fix = f"convert with --crop ({down[0]} x {down[1]} x {z}) or --pad ({up[0]} x {up[1]} x {z})"
    odd = [(a, n) for a, n in bad if n % 2]
    named = odd or bad
    what = f"grid {' x '.join(map(str, grid))}: {' and '.join(f'{a}={n}' for a, n in named)} " + \
        ("is not a multiple" if len(named) == 1 else "are not multiples")
    if odd:
        return (f"{what} of 2, which every tokenizer refuses (the default 2-level one halves X and Y once, "
                f"OccWorld's 3 levels twice); {fix}")
    it = "it" if len(bad) == 1 else "them"
    return (f"{what} of {multiple}: the default 2-level tokenizer (the demo's tokenizer.widths) takes {it}, a 3-level "
            f"one (OccWorld's, configs/occworld*.json) refuses {it} (it halves X and Y twice); for 3 levels {fix}")


def plan_fit(grid, voxel, rng, mode: str, size=None, multiple: int = GRID_MULTIPLE, align: str = "ego") -> dict:
    """How --crop / --pad change X and Y: {"src": grid, "start": [sx, sy], "grid": new grid,
    "range": new range}. New cell i of an axis is source cell i + start (start < 0: padding).

    size: the new (X, Y), else the nearest multiple of `multiple` below (crop) or above (pad).
    align: "ego" (default) keeps the ego (the origin of the ego frame, located through `range`) as
    near the middle of the new grid as the source allows; "centre" the grid's middle; "low" / "high"
    keep the low / high edge of each axis."""
    if mode not in ("crop", "pad"):
        raise ValueError(mode)
    new_xy = list(size) if size else [(n // multiple * multiple if mode == "crop" else -(-n // multiple) * multiple)
                                      for n in grid[:2]]
    start = []
    for ax in range(2):
        n, m = int(grid[ax]), int(new_xy[ax])
        if m < 1 or (mode == "crop" and m > n) or (mode == "pad" and m < n):
            raise DataError(f"--{mode} {new_xy[0]} {new_xy[1]}: the grid is {grid[0]} x {grid[1]}; --{mode} must "
                            f"{'shrink' if mode == 'crop' else 'grow'} X and Y (or keep them)")
        if align == "low":
            centre = m / 2
        elif align == "high":
            centre = n - m / 2
        elif align == "centre":
            centre = n / 2
        else:  # the ego's cell: the ego frame's origin, where range puts it (the middle if outside)
            e = -rng[ax] / voxel[ax]
            centre = e if 0 <= e <= n else n / 2
        lo, hi = (0, n - m) if mode == "crop" else (n - m, 0)
        start.append(int(min(hi, max(lo, math.floor(centre - m / 2 + 0.5)))))
    out = [int(new_xy[0]), int(new_xy[1]), int(grid[2])]
    new_rng = [rng[0] + start[0] * voxel[0], rng[1] + start[1] * voxel[1], rng[2],
               rng[0] + (start[0] + out[0]) * voxel[0], rng[1] + (start[1] + out[1]) * voxel[1], rng[5]]
    return {"src": [int(g) for g in grid], "start": start, "grid": out, "range": [round(v, 9) for v in new_rng]}


def reframe(a: np.ndarray, fit: Optional[dict], fill: int, path: Path, where: str) -> np.ndarray:
    """A source frame (or mask) cut / padded to the planned grid (plan_fit); `fill` where padded."""
    if not fit:
        return a
    if tuple(a.shape) != tuple(fit["src"]):
        raise DataError(f"{path}: {where}: grid of shape {tuple(a.shape)}, expected {tuple(fit['src'])} "
                        f"(before --crop/--pad)")
    out = np.full(tuple(fit["grid"]), fill, a.dtype)
    src, dst = [], []
    for ax in range(2):
        s0, n, m = fit["start"][ax], a.shape[ax], fit["grid"][ax]
        lo, hi = max(0, s0), min(n, s0 + m)  # source cells that land inside the new grid
        src.append(slice(lo, hi))
        dst.append(slice(lo - s0, hi - s0))
    out[dst[0], dst[1]] = a[src[0], src[1]]
    return out


def yaw_stats(yaw: np.ndarray, t_s: np.ndarray) -> dict:
    """What a scene's yaw column looks like, read as radians: the largest |yaw| and the largest
    frame-to-frame turn rate (wrapped to (-pi, pi], so a legitimate wrap is no turn)."""
    step = np.angle(np.exp(1j * np.diff(yaw)))
    dt = np.maximum(np.diff(t_s), 1e-9)
    return {"max_abs": float(np.abs(yaw).max()), "max_rate": float((np.abs(step) / dt).max())}


def yaw_unit_note(specs: Iterable) -> Optional[str]:
    """A warning when the yaw of x,y,z,yaw poses looks like degrees: some |yaw| beyond 2 pi (no
    heading in radians needs it) or a turn faster than MAX_YAW_RATE rad/s."""
    specs = list(specs)
    odd = [(s.name, s.opts["yaw"]) for s in specs if "yaw" in s.opts and
           (s.opts["yaw"]["max_abs"] > 2 * math.pi + 1e-6 or s.opts["yaw"]["max_rate"] > MAX_YAW_RATE)]
    if not odd:
        return None
    name, st = odd[0]
    total = sum(1 for s in specs if "yaw" in s.opts)
    return (f"yaw looks like degrees in {len(odd)} of {total} scenes ({name}: |yaw| up to {st['max_abs']:.3g}, "
            f"turning up to {st['max_rate']:.3g} rad/s read as radians); if so, convert with --yaw-units deg")


def unit_guess(step_written: float, unit: str) -> str:
    """'; they look like <unit> (...): convert with --time-unit u' for the one other unit in which a
    median frame interval `step_written` (as written) is a sensor's rate, else what to do."""
    for u, us in TIME_UNITS.items():
        dt = step_written * us / 1e6
        if u != unit and dt > 0 and MIN_HZ <= 1 / dt <= MAX_HZ:
            return f"; they look like {UNITS[u]} (a frame every {dt:g} s, {1 / dt:g} Hz): convert with --time-unit {u}"
    return "; check the timestamps and their unit (--time-unit s|ms|us|ns)"


def int64_us(written: np.ndarray, unit: str, where: str) -> np.ndarray:
    """Timestamps as written, in `unit`, as int64 microseconds; DataError naming `where` and the
    likely unit when they do not fit (Unix microseconds read as seconds are 1e21 us)."""
    us = np.asarray(written, np.float64) * TIME_UNITS[unit]
    if not (np.abs(us) < 2.0 ** 63).all():
        i = int(np.argmax(~(np.abs(us) < 2.0 ** 63)))
        step = float(np.median(np.diff(written))) if len(written) > 1 else 0.0
        raise DataError(f"{where}: timestamp {written[i]:.17g} read as {UNITS[unit]} is {us[i] / 1e6:.3g} s, "
                        f"beyond int64 microseconds{unit_guess(step, unit)}")
    return np.array([round(v) for v in us.tolist()], np.int64)


def rate_problem(specs: dict, unit: str, given: Optional[float] = None, given_where: str = "") -> Optional[str]:
    """Why the scenes' median frame interval (every scene's steps together) cannot be right, or None:
    a rate outside MIN_HZ..MAX_HZ, or more than RATE_TOL off `given` (a frame_rate_hz named by
    `given_where`). The message names the first scene's poses file and the unit the timestamps look like."""
    steps = [np.diff(s.timestamp) for s in specs.values() if len(s.timestamp) > 1]
    steps = np.concatenate(steps) if steps else np.zeros(0)
    if not len(steps) or np.median(steps) <= 0:
        return None
    step_us = float(np.median(steps))
    hz = 1e6 / step_us
    first = specs[min(specs)]
    measured = f"median frame interval {step_us / 1e6:g} s ({hz:g} Hz) read as {UNITS[unit]}"
    guess = unit_guess(step_us / TIME_UNITS[unit], unit)
    if given is not None and abs(hz / given - 1) > RATE_TOL:
        return f"{given_where} {given:g} but the timestamps' {measured}{guess}; or correct {given_where}"
    if not MIN_HZ <= hz <= MAX_HZ:
        who = f"scene {first.name!r}" if len(specs) == 1 else f"scenes {first.name!r} and {len(specs) - 1} more"
        return (f"{first.opts.get('poses', first.name)}: {who}: {measured}, outside the {MIN_HZ:g}-{MAX_HZ:g} Hz "
                f"of sensor logs{guess}")
    return None


def ratio_words(r: float) -> str:
    return f"x{r:.0f}" if r >= 1 else f"x1/{1 / r:.0f}"


def time_unit_outliers(specs: dict, unit: str = "s") -> list[dict]:
    """Scenes whose median frame interval differs from the other scenes' by x1000 or more (a drive
    written in milliseconds among drives in seconds): [{"scene", "split", "error"}]. The reference
    is the interval most scenes agree on (within x10), ties going to the rate nearest 10 Hz."""
    med = {n: float(np.median(np.diff(s.timestamp))) for n, s in specs.items() if len(s.timestamp) > 1}
    if len(med) < 2:
        return []
    lg = {n: math.log10(v) for n, v in med.items()}
    support = {n: [m for m in lg if abs(lg[m] - lg[n]) < 1] for n in lg}
    ref_name = max(lg, key=lambda n: (len(support[n]), -abs(6 - lg[n] - 1)))
    ref = float(np.median([med[m] for m in support[ref_name]]))
    names = list(UNITS)
    out = []
    for n, v in med.items():
        r = math.log10(v / ref)
        if abs(r) < 2.5:
            continue
        k = round(r / 3)
        i = names.index(unit) + k
        guess = (f": its timestamps look like {UNITS[names[i]]} where the others are in {UNITS[unit]}"
                 if abs(r - 3 * k) < 0.5 and 0 <= i < len(names) else "")
        s = specs[n]
        out.append({"scene": n, "split": s.split,
                    "error": f"{s.opts.get('poses', n)}: scene {n!r}: median frame interval {v / 1e6:.6g} s, "
                             f"{ratio_words(v / ref)} the other scenes' {ref / 1e6:.6g} s{guess}; write every scene's "
                             f"timestamps in one unit (--time-unit {unit} reads them all as {UNITS[unit]})"})
    return out
