"""Own recordings planned into scenes for the conversion engine (wm/data/convert/engine.py): `<root>/<scene>/`
folders of per-frame `.npy`/`.npz` grids with a poses file per scene (the layout is in
tools/convert_frames.py, the CLI), and the reading of one frame. Bit 0 (value 1) of the shard's
mask field is "visible" (VISIBLE_BITS). The checks of units, rates and grids are in
wm/data/convert/recording_checks.py.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from wm.data.convert.recording_checks import TIME_UNITS, int64_us, reframe, yaw_stats
from wm.data.convert.scene import (SceneSpec, check_length, check_rigid, check_times, labels, open_frame, pose_matrix,
    visible, yaw_matrix)
from wm.data.shards import DatasetInfo
from wm.utils.errors import DataError, first_line

VISIBLE_BITS = {"visible": 1}  # own recordings: one visibility mask, bit 0
YAW_UNITS = {"rad": 1.0, "deg": math.pi / 180}
FRAMES_FIX = "give it the name its contents have (.npy for np.save, .npz for np.savez)"

POSE_FILES = ("poses.csv", "poses.json")
MATRIX_COLS = tuple(f"m{r}{c}" for r in range(4) for c in range(4))
XYZYAW_COLS = ("x", "y", "z", "yaw")


def _pose_row(row: dict, where: str, yaw_scale: float = 1.0) -> tuple[Optional[str], float, np.ndarray]:
    """(frame or None, timestamp, 4x4) from one record of a poses file (CSV row or JSON object);
    a `yaw` is multiplied by `yaw_scale` (pi/180 for --yaw-units deg)."""
    if "timestamp" not in row or row["timestamp"] in (None, ""):
        raise DataError(f"{where}: no timestamp")

    def num(v, k):
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise DataError(f"{where}: {k} is {v!r}, not a number") from None
        if not math.isfinite(x):
            raise DataError(f"{where}: {k} is {v!r}, not a finite number")
        return x

    ts = num(row["timestamp"], "timestamp")
    frame = row.get("frame")
    frame = None if frame in (None, "") else str(frame)
    if "matrix" in row:  # JSON: 4x4 nested or 16 flat, row-major
        try:
            m = np.asarray(row["matrix"], np.float64).reshape(4, 4)
        except (TypeError, ValueError):
            raise DataError(f"{where}: matrix must be 16 numbers (4x4, row-major)") from None
    elif all(k in row for k in MATRIX_COLS):
        m = np.array([num(row[k], k) for k in MATRIX_COLS]).reshape(4, 4)
    elif all(k in row for k in XYZYAW_COLS):
        x, y, z, yaw = (num(row[k], k) for k in XYZYAW_COLS)
        m = pose_matrix(yaw_matrix(yaw * yaw_scale), (x, y, z))
    else:
        raise DataError(f"{where}: needs either m00..m33 (a 4x4 matrix, row-major) or x, y, z, yaw")
    return frame, ts, check_rigid(m, where)


def read_poses(path: Path, scene: str, yaw_unit: str = "rad",
               yaws: Optional[list] = None) -> list[tuple[Optional[str], float, np.ndarray]]:
    """Records of a scene's poses file: CSV with a header row, or JSON (a list of objects). The
    yaw of x,y,z,yaw records is in `yaw_unit` (YAW_UNITS); `yaws`, when given, receives each
    record's yaw as written (for yaw_unit_note)."""
    where0 = f"{path}: scene {scene!r}"
    scale = YAW_UNITS[yaw_unit]
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{where0}: cannot be read ({first_line(e)})") from None
    out = []
    if path.suffix == ".csv":
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        rows = list(csv.reader(lines))
        if not rows:
            raise DataError(f"{where0}: empty; expected a header row and one row per frame")
        head = [h.strip().lower() for h in rows[0]]
        if "timestamp" not in head:
            raise DataError(f"{where0}: the header row {rows[0]} has no 'timestamp' column (the first line must "
                            "name the columns: timestamp[,frame],m00..m33 or timestamp[,frame],x,y,z,yaw)")
        for i, r in enumerate(rows[1:], 2):
            if len(r) != len(head):
                raise DataError(f"{where0} line {i}: {len(r)} values for {len(head)} columns")
            row = {h: v.strip() for h, v in zip(head, r)}
            out.append(_pose_row(row, f"{where0} line {i}", scale))
            _keep_yaw(row, yaws)
    else:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where0}: not valid JSON ({first_line(e)})") from None
        if isinstance(d, dict) and isinstance(d.get("poses"), list):
            d = d["poses"]
        if not isinstance(d, list):
            raise DataError(f"{where0}: expected a list of pose objects (or {{\"poses\": [...]}})")
        for i, r in enumerate(d):
            if not isinstance(r, dict):
                raise DataError(f"{where0} entry {i}: expected an object, got {type(r).__name__}")
            row = {str(k).lower(): v for k, v in r.items()}
            out.append(_pose_row(row, f"{where0} entry {i}", scale))
            _keep_yaw(row, yaws)
    return out


def _keep_yaw(row: dict, yaws: Optional[list]) -> None:
    """The yaw as written (a record _pose_row built from x, y, z, yaw), for yaw_unit_note."""
    if yaws is not None and "matrix" not in row and not all(k in row for k in MATRIX_COLS) and "yaw" in row:
        yaws.append(float(row["yaw"]))


def _frame_files(folder: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """{stem: grid file} and {stem: mask file} of a scene folder."""
    frames, masks = {}, {}
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.suffix not in (".npy", ".npz"):
            continue
        stem, target = f.name[:-4], frames
        if stem.endswith(".mask"):
            stem, target = stem[:-5], masks
        if stem in target:
            raise DataError(f"{f}: scene {folder.name!r} frame {stem}: both {stem}.npy and {stem}.npz exist; keep one")
        target[stem] = f
    return frames, masks


def frames_scene(folder: Path, split: str, unit: str, key: Optional[str], mask_key: Optional[str],
                 yaw_unit: str = "rad") -> SceneSpec:
    """Plan one scene folder of own recordings (layout: tools/convert_frames.py)."""
    name = folder.name
    found = [folder / p for p in POSE_FILES if (folder / p).is_file()]
    if not found:
        raise DataError(f"{folder}: scene {name!r} has no poses file ({' or '.join(POSE_FILES)})")
    if len(found) > 1:
        raise DataError(f"{folder}: scene {name!r} has both {POSE_FILES[0]} and {POSE_FILES[1]}; keep one")
    pf = found[0]
    frames, masks = _frame_files(folder)
    yaws: list = []
    records = read_poses(pf, name, yaw_unit, yaws)
    named = [r[0] is not None for r in records]
    if any(named) and not all(named):
        raise DataError(f"{pf}: scene {name!r}: some rows name a frame and some do not; name all or none")
    if all(named) and records:
        by = {}
        for fr, ts, m in records:
            if fr in by:
                raise DataError(f"{pf}: scene {name!r}: frame {fr!r} has two pose rows")
            if fr not in frames:
                raise DataError(f"{pf}: scene {name!r}: frame {fr!r} has a pose but no file {fr}.npy or "
                                f"{fr}.npz in {folder}")
            by[fr] = (ts, m)
        no_pose = [s for s in frames if s not in by]
        if no_pose:
            raise DataError(f"{frames[no_pose[0]]}: scene {name!r} frame {no_pose[0]} has no row in {pf.name}")
        pairs = [(s, *by[s]) for s in frames]
    else:
        stems = list(frames)  # sorted by name
        if len(stems) != len(records):
            raise DataError(f"{pf}: scene {name!r}: {len(records)} pose rows for {len(stems)} frame files; "
                            "without a 'frame' column rows are matched to files sorted by name, one each")
        pairs = [(s, ts, m) for s, (_, ts, m) in zip(stems, records)]
        t = np.array([p[1] for p in pairs])
        if len(t) > 1 and (np.diff(t) <= 0).any():
            i = int(np.argmax(np.diff(t) <= 0))
            raise DataError(f"{pf}: scene {name!r}: timestamps of rows {i + 1} and {i + 2} ({t[i]:g}, {t[i + 1]:g}) "
                            "do not increase, but rows are matched to frame files in name order; add a 'frame' column")
    check_length(name, len(pairs), str(pf))
    scale = TIME_UNITS[unit]
    pairs.sort(key=lambda p: p[1])
    ids = [p[0] for p in pairs]
    ts = int64_us(np.array([p[1] for p in pairs], np.float64), unit, f"{pf}: scene {name!r}")
    check_times(name, ts, ids, str(pf))
    opts = {"key": key, "mask_key": mask_key, "poses": str(pf)}
    if yaw_unit == "rad" and len(yaws) == len(records) > 1:  # x,y,z,yaw records: how their yaw looks, in time order
        t = np.array([r[1] for r in records]) * scale / 1e6
        o = np.argsort(t, kind="stable")
        opts["yaw"] = yaw_stats(np.array(yaws)[o], t[o])
    if mask_key:
        npy = [s for s in ids if frames[s].suffix != ".npz"]
        if npy:
            raise DataError(f"{frames[npy[0]]}: scene {name!r} frame {npy[0]}: --mask-key needs .npz frames")
        opts["has_mask"] = True
    elif masks:
        lacking = [s for s in ids if s not in masks]
        if lacking:
            raise DataError(f"{folder}: scene {name!r} frame {lacking[0]} has no mask file {lacking[0]}.mask.npy "
                            f"(other frames of the scene have one)")
        stray = [s for s in masks if s not in frames]
        if stray:
            raise DataError(f"{masks[stray[0]]}: scene {name!r}: a mask for frame {stray[0]}, which has no grid file")
        opts["mask_files"] = [str(masks[s]) for s in ids]
        opts["has_mask"] = True
    else:
        opts["has_mask"] = False
    return SceneSpec(name, split, [str(frames[s]) for s in ids], ids, ts,
                     np.stack([p[2] for p in pairs]), "frames", opts)


def split_scenes(names: list[str], val_scenes: Optional[Iterable[str]], val_fraction: float,
                 where: str) -> dict[str, list[str]]:
    """{"train": [...], "val": [...]} (names sorted). Named val scenes, or a deterministic
    fraction: scenes ranked by sha256 of their name, the first round(f * n) (at least 1) go to val."""
    names = sorted(names)
    if val_scenes is not None:
        val = list(dict.fromkeys(val_scenes))
        unknown = [v for v in val if v not in names]
        if unknown:
            raise DataError(f"--val-scenes: {unknown[0]!r} is not a scene folder in {where} "
                            f"(scenes: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''})")
        val = set(val)
    else:
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"--val-fraction {val_fraction} must be in [0, 1)")
        k = 0 if val_fraction == 0 else min(len(names) - 1, max(1, round(val_fraction * len(names))))
        val = set(sorted(names, key=lambda s: hashlib.sha256(s.encode()).hexdigest())[:k])
    train = [n for n in names if n not in val]
    if not train:
        raise DataError(f"{where}: every scene is a validation scene; leave some for training")
    return {"train": train, "val": [n for n in names if n in val]}


def frames_scenes(root: str | os.PathLike, val_scenes=None, val_fraction: float = 0.1, unit: str = "s",
                  key: Optional[str] = None, mask_key: Optional[str] = None, yaw_unit: str = "rad"):
    """Plan a conversion of own recordings: ({split: [names]}, {name: SceneSpec}, bad)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"--root {root} is not a folder (expected one sub-folder per scene)")
    if unit not in TIME_UNITS:
        raise DataError(f"--time-unit {unit!r} must be one of {list(TIME_UNITS)}")
    if yaw_unit not in YAW_UNITS:
        raise DataError(f"--yaw-units {yaw_unit!r} must be one of {list(YAW_UNITS)}")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"{root}: no scene folders (expected {root}/<scene>/ with frames and {POSE_FILES[0]})")
    order = split_scenes([p.name for p in folders], val_scenes, val_fraction, str(root))
    split_of = {n: s for s, ns in order.items() for n in ns}
    specs, bad = {}, []
    for p in folders:
        try:
            specs[p.name] = frames_scene(p, split_of[p.name], unit, key, mask_key, yaw_unit)
        except DataError as e:
            bad.append({"scene": p.name, "split": split_of[p.name], "error": str(e)})
    # one data set has masks everywhere or nowhere
    if any(s.opts["has_mask"] for s in specs.values()):
        for name in [n for n, s in specs.items() if not s.opts["has_mask"]]:
            s = specs.pop(name)
            bad.append({"scene": name, "split": s.split,
                        "error": f"{root / name}: scene {name!r} has no mask files but other scenes have masks "
                                 f"(<frame>.mask.npy beside each <frame>.npy)"})
    return order, specs, bad


def _load_npy_npz(path: Path, key: Optional[str], where: str, what: str) -> np.ndarray:
    with open_frame(path, where, FRAMES_FIX) as z:
        if path.suffix == ".npy":
            return z
        names = list(z.files)
        if key is None:
            if not names:
                raise DataError(f"{path}: {where}: the .npz holds no arrays")
            key = "semantics" if "semantics" in names else names[0]
        if key not in names:
            raise DataError(f"{path}: {where}: has no array {key!r} for the {what} (it holds {names})")
        return z[key]


def peek_grid(spec: SceneSpec) -> tuple[int, int, int]:
    """The grid shape of a scene's first frame (cheap for .npy)."""
    f = Path(spec.files[0])
    where = f"scene {spec.name!r} frame {spec.ids[0]}"
    if f.suffix == ".npy":
        with open_frame(f, where, FRAMES_FIX, mmap=True) as a:
            pass
    else:
        a = _load_npy_npz(f, spec.opts.get("key"), where, "occupancy")
    if a.ndim != 3:
        raise DataError(f"{f}: {where}: grid of shape {tuple(a.shape)}, expected three sizes (X, Y, Z)")
    return tuple(int(s) for s in a.shape)


def median_rate(specs: Iterable[SceneSpec]) -> float:
    """Frames per second from the median timestamp step; a rate within 0.2 % of a multiple of 0.5 Hz
    is that multiple (clock jitter makes a 10 Hz log 10.001 Hz, and horizons in seconds need the
    nominal rate to land on whole frames)."""
    steps = np.concatenate([np.diff(s.timestamp) for s in specs] or [np.zeros(0)])
    steps = steps[steps > 0]
    if not len(steps):
        return 1.0
    r = 1e6 / float(np.median(steps))
    nominal = round(2 * r) / 2
    return nominal if nominal > 0 and abs(r - nominal) <= 0.002 * nominal else round(r, 3)


def read_frame(spec: SceneSpec, i: int, info: DatasetInfo) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Frame i of a recorded scene: its class ids and its visibility (None without masks), checked."""
    path, where = Path(spec.files[i]), f"scene {spec.name!r} frame {spec.ids[i]}"
    fit = spec.opts.get("reframe")  # --crop / --pad: padded voxels are free and not visible
    occ = labels(reframe(_load_npy_npz(path, spec.opts.get("key"), where, "occupancy"), fit, info.free_class,
                         path, where), path, where, info)
    if not info.has_mask:
        return occ, None
    if spec.opts.get("mask_key"):
        mp, mk = path, spec.opts["mask_key"]
    else:
        mp, mk = Path(spec.opts["mask_files"][i]), None
    return occ, visible(reframe(_load_npy_npz(mp, mk, where, "mask"), fit, 0, mp, where), mp, where, info,
                        "mask").astype(np.uint8)
