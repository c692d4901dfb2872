"""Forecast horizons in seconds: which future step each one is (`horizon_steps`, the horizons
--eval-only takes by default: `default_horizons`), and which window setting reaches them on a data set.

`python train.py --cfg cfg.json --horizons 1,2` (without --eval-only) prints one setting of
data.past, data.future, data.stride and world.max_frames whose windows reach every horizon as a whole
future step on the data set's scenes, or one line saying which horizon cannot be reached and why;
`data.horizons_s` makes training refuse, before the first step, a setting that does not reach them,
with the planned one in the message.

The rule (one feasible setting, not an optimum): a horizon h is h x rate frames ahead, which must be
a whole number; the stride must divide every horizon's frame count; future = longest / stride; a
window spans (past - 1) x stride + longest + 1 frames and must fit a scene of every split. Each
stride takes the most past frames (up to data.past) that fit; of those settings, one with at least
two past frames, then the step nearest OccWorld's 0.5 s, then the longer past is taken.
world.max_frames is raised to past + future - 1 where it is shorter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from wm.utils.errors import ConfigError, DataError, WMError

STEP_S = 0.5  # OccWorld's step (2 Hz keyframes): the stride whose step is nearest is preferred
PROTOCOL_HORIZONS = (1.0, 2.0, 3.0)  # seconds: OccWorld reports the 1 s, 2 s and 3 s future frames


@dataclass
class Plan:
    past: int
    future: int
    stride: int
    max_frames: int
    steps: list[int]  # 1-based future step of each horizon
    windows: dict  # {split: windows of that split at this setting (window_step 1)}

    @property
    def span(self) -> int:
        return (self.past + self.future - 1) * self.stride + 1


def _secs(hs: Sequence[float]) -> str:
    return ", ".join(f"{h:g} s" for h in hs)


def horizon_label(h: float) -> str:
    return f"{h:g}s"


def horizon_steps(horizons: Sequence[float], frame_rate_hz: float, stride: int, future: int,
                  longest: Optional[int] = None) -> list[int]:
    """0-based future-step indices of `horizons` (seconds after the last past frame). `longest`: the
    most future frames the model's config admits (world.max_frames + 1 - data.past), if known.

    Future step k (1-based) lies k * stride / frame_rate_hz seconds ahead. A horizon between two
    steps, or beyond the `future` steps the windows hold, raises WMError naming what would reach it.
    At 2 Hz and stride 1, (1, 2, 3) s -> [1, 3, 5] = metrics.OCCWORLD_STEPS."""
    if not horizons:
        raise WMError("--horizons: give at least one horizon in seconds, e.g. 1,2,3")
    if not frame_rate_hz > 0:
        raise DataError(f"the data set's frame_rate_hz is {frame_rate_hz}; horizons in seconds need a "
                        "positive frame rate in manifest.json")
    dt = stride / frame_rate_hz  # seconds per future step
    steps, short = [], []
    for h in horizons:
        k = h / dt
        if not h > 0 or abs(k - round(k)) > 1e-6 * max(1.0, abs(k)) or round(k) < 1:
            raise WMError(f"horizon {h:g} s is not a whole number of future steps: the data is "
                          f"{frame_rate_hz:g} Hz at data.stride={stride}, one step every {dt:g} s; choose "
                          f"--horizons that are multiples of {dt:g} s or another data.stride")
        k = int(round(k))
        if k > future:
            short.append((h, k))
        steps.append(k - 1)
    if short:
        need = max(k for _, k in short)
        reach = future * dt
        fix = f"evaluate with --set data.future={need} (the windows may differ from training)"
        if longest is not None and need > longest:  # that would be refused by world.max_frames: say so now
            fix = (f"this model takes data.future <= {longest} (world.max_frames), so those horizons need a model "
                   f"trained at a larger data.stride (one step = stride / {frame_rate_hz:g} Hz)")
        raise WMError(f"eval horizon too short: data.future={future} at {frame_rate_hz:g} Hz, stride {stride} "
                      f"reaches {reach:g} s, but {', '.join(f'{h:g} s' for h, _ in short)} "
                      f"need{'s' if len(short) == 1 else ''} data.future >= {need}; {fix} or ask for "
                      f"--horizons up to {reach:g} s")
    if len(set(steps)) != len(steps):
        raise WMError(f"--horizons {','.join(horizon_label(h) for h in horizons)} name a future step twice")
    return steps


def default_horizons(frame_rate_hz: float, stride: int, future: int) -> tuple[tuple[float, ...], str]:
    """The horizons --eval-only uses without --horizons, and why: OccWorld's 1 s, 2 s, 3 s where the
    windows reach them in whole steps; otherwise the future steps at a third, two thirds and all of
    the window (the protocol's shape: steps 2, 4, 6 of 6), in seconds."""
    if not frame_rate_hz > 0:
        return PROTOCOL_HORIZONS, "OccWorld's protocol"
    dt = stride / frame_rate_hz
    ks = [h / dt for h in PROTOCOL_HORIZONS]
    whole = all(abs(k - round(k)) <= 1e-6 * max(1.0, k) for k in ks)
    if whole and round(ks[-1]) <= future:
        return PROTOCOL_HORIZONS, ""
    steps = sorted({max(1, round(i * future / 3)) for i in (1, 2, 3)})
    hs = tuple(round(k * dt, 6) for k in steps)
    if whole:
        need = f"need data.future >= {round(ks[-1])} at this stride"
    else:
        need = f"are not whole steps of {dt:g} s (data.stride={stride} at {frame_rate_hz:g} Hz)"
    return hs, (f"the default for these windows ({future} future frames at {frame_rate_hz:g} Hz, stride {stride}, "
                f"reach {future * dt:g} s); OccWorld's 1 s, 2 s, 3 s {need}; --horizons chooses others")


def parse_horizons(text: str) -> tuple[float, ...]:
    """'1,2,3' or '0.5s,1s' -> seconds, or WMError saying how to write them."""
    try:
        hs = tuple(float(x.strip().rstrip("s")) for x in text.split(",") if x.strip())
    except ValueError:
        raise WMError(f"--horizons {text!r}: give seconds separated by commas, e.g. 1,2,3") from None
    if not hs or not all(math.isfinite(h) for h in hs):
        raise WMError(f"--horizons {text!r}: give seconds separated by commas, e.g. 1,2,3")
    return hs


def frames_ahead(horizons: Sequence[float], rate: float) -> list[int]:
    """Each horizon as a whole number of frames at `rate`, or WMError naming the one that is not."""
    if not rate > 0:
        raise WMError(f"the data set's frame_rate_hz is {rate}; horizons in seconds need a positive frame rate")
    out = []
    for h in horizons:
        n = h * rate
        if not h > 0 or abs(n - round(n)) > 1e-6 * max(1.0, n):
            raise WMError(f"horizon {h:g} s is not a whole number of frames at {rate:g} Hz (a frame every "
                          f"{1 / rate:g} s); choose horizons that are multiples of {1 / rate:g} s")
        out.append(int(round(n)))
    return out


def windows(lengths: np.ndarray, span: int) -> int:
    """Windows of `span` frames (one starting at every frame) in scenes of `lengths` frames."""
    return int(np.maximum(0, np.asarray(lengths) - span + 1).sum())


def plan(horizons: Sequence[float], rate: float, lengths: dict, past: int, max_frames: int) -> Plan:
    """One setting that reaches every horizon (seconds) in scenes of `lengths` ({split: frames per
    scene}) at `rate` Hz, starting from data.past = `past` and world.max_frames = `max_frames`; or
    WMError (one line) naming the horizon no window can reach and why."""
    ahead = frames_ahead(horizons, rate)
    longest = max(ahead)
    tops = {split: int(max(ls)) if len(ls) else 0 for split, ls in lengths.items()}
    split, top = min(tops.items(), key=lambda kv: kv[1])  # the split whose longest scene is shortest
    if longest + 1 > top:  # even one past frame needs longest + 1 frames of one scene
        far = [h for h, n in zip(horizons, ahead) if n + 1 > top]
        raise WMError(f"horizon {_secs(far)} cannot be reached on this data set: at {rate:g} Hz "
                      f"{max(far):g} s is {longest} frames ahead, so a window needs at least {longest + 1} frames "
                      f"(1 past frame + {longest}), but the longest {split} scene has {top}; horizons up to "
                      f"{max(0, top - 1) / rate:g} s fit (or record longer scenes)")
    g = math.gcd(*ahead)
    fits = []  # (past, stride) whose window fits a scene of every split
    for st in (s for s in range(1, g + 1) if g % s == 0):
        p = min(max(1, past), (min(tops.values()) - longest - 1) // st + 1)
        while p >= 1 and not all(windows(ls, (p - 1) * st + longest + 1) for ls in lengths.values()):
            p -= 1
        if p >= 1:
            fits.append((p, st))
    # two past frames or more first (one gives the model no motion to go on), then the step nearest
    # STEP_S, then the longer past, then the smaller stride
    p, st = min(fits, key=lambda f: (f[0] < min(2, past), abs(math.log(f[1] / rate / STEP_S)), -f[0], f[1]))
    f = longest // st
    span = (p - 1) * st + longest + 1
    return Plan(p, f, st, max(max_frames, p + f - 1), [n // st for n in ahead],
                {split: windows(ls, span) for split, ls in lengths.items()})


def describe(pl: Plan, horizons: Sequence[float], rate: float, past: int, root) -> str:
    """The plan as printed by `train.py --horizons` (several lines): the setting, what it means, how to use it."""
    dt = pl.stride / rate
    at = ", ".join(f"{h:g} s = t+{k}" for h, k in zip(horizons, pl.steps))
    keys = {"data.past": pl.past, "data.future": pl.future, "data.stride": pl.stride, "world.max_frames": pl.max_frames}
    lines = [f"horizons {_secs(horizons)} on {root} ({rate:g} Hz):",
             "  " + " ".join(f"{k}={v}" for k, v in keys.items()),
             f"  one step = {dt:g} s ({pl.stride} frame{'s' if pl.stride > 1 else ''}); {at}; a window spans "
             f"{pl.span} frames: " + ", ".join(f"{n} {split} window{'s' if n != 1 else ''}"
                                                for split, n in pl.windows.items())]
    if pl.past < past:
        lines.append(f"  data.past lowered from {past}: at this stride {past} past frames would span "
                     f"{(past + pl.future - 1) * pl.stride + 1} frames, and not every split has a scene that long")
    lines.append("  train with: " + " ".join(f"--set {k}={v}" for k, v in keys.items())
                 + f" --set data.horizons_s={','.join(f'{h:g}' for h in horizons)}")
    return "\n".join(lines)


def scene_lengths(root, splits: Sequence[str]) -> dict:
    """{split: frames of each scene} of a data set, from its shards' scene offsets (no frame is read)."""
    from wm.data.shards import open_split

    out = {}
    for split in splits:
        _, shards = open_split(root, split)
        out[split] = np.concatenate([np.diff(sh.scene_offsets) for sh in shards])
    return out


def reached(horizons: Sequence[float], rate: float, stride: int, future: int) -> bool:
    """Whether windows of `future` steps of `stride` frames at `rate` Hz hold every horizon as a whole step."""
    ks = [h * rate / stride for h in horizons] if rate > 0 else [math.nan]
    return all(abs(k - round(k)) <= 1e-6 * max(1.0, k) and 1 <= round(k) <= future for k in ks)


def check_config_reaches(cfg, root, rate: float) -> None:
    """data.horizons_s against the window setting, before training: ConfigError with a setting that
    reaches them on this data set (or why none can) when the configured windows do not."""
    d = cfg.data
    if not d.horizons_s or reached(d.horizons_s, rate, d.stride, d.future):
        return
    have = f"data.past={d.past} data.future={d.future} data.stride={d.stride} at {rate:g} Hz"
    try:
        pl = plan(d.horizons_s, rate, scene_lengths(root, (d.train_split, d.val_split)), d.past, cfg.world.max_frames)
    except WMError as e:
        raise ConfigError("data.horizons_s", f"{_secs(d.horizons_s)} are not reached by {have}, and {e}") from None
    keys = {"data.past": pl.past, "data.future": pl.future, "data.stride": pl.stride, "world.max_frames": pl.max_frames}
    raise ConfigError("data.horizons_s", f"{_secs(d.horizons_s)} are not reached by {have} (one step = "
                      f"{d.stride / rate:g} s, {d.future} steps); a setting that reaches them on this data set: "
                      + " ".join(f"--set {k}={v}" for k, v in keys.items()))


def print_plan(cfg, text: str, root) -> int:
    """`train.py --horizons 1,2` without --eval-only: print the plan for the config's data set (or
    raise WMError: one line), train nothing."""
    from wm.data.shards import load_manifest

    hs = parse_horizons(text)
    rate = load_manifest(root).info.frame_rate_hz
    d = cfg.data
    pl = plan(hs, rate, scene_lengths(root, (d.train_split, d.val_split)), d.past, cfg.world.max_frames)
    print(describe(pl, hs, rate, d.past, root))
    print("(nothing trained: --horizons without --eval-only plans; with --eval-only it chooses the horizons scored)")
    return 0
