"""Convert your own recordings (per-frame occupancy grids + poses) into a wm data set.

    python tools/convert_frames.py --root recordings --out data/mine --classes road,car,building,free --free free
    python tools/convert_frames.py --root recordings --out data/mine --classes-json classes.json --val-scenes drive_07

Layout: one folder per scene; every folder name is a scene name. Hidden names (.x) are ignored.

    recordings/
      drive_01/
        poses.csv            # or poses.json (exactly one of them)
        000000.npy           # one occupancy grid per frame: (X, Y, Z) integer class ids
        000000.mask.npy      # optional visibility mask (nonzero = visible), same shape
        000001.npy           # .npz works too: the array --key (default 'semantics' if
        ...                  #   present, else the first array); masks: --mask-key in the same .npz

Every frame of every scene must have the same grid (X, Y, Z); ids must be in [0, number of classes).
Frames are matched to poses by the 'frame' column (the file name without .npy/.npz/.mask.npy) when
the poses file has one; without it, rows are matched one-to-one to the frame files sorted by name
(zero-pad numbers: 000010 after 000009), and the timestamps must then increase down the file.
Frames are stored in timestamp order.

poses.csv: a header row naming the columns, then one row per frame; '#' lines are comments.
    timestamp,frame,m00,m01,m02,m03,m10,...,m33    4x4 ego->global matrix, row-major (16 numbers)
    timestamp,frame,x,y,z,yaw                      position in metres, yaw in radians about +z (--yaw-units deg)
  ('frame' is optional.)
poses.json: a list of objects (or {"poses": [...]}), each
    {"timestamp": 12.5, "frame": "000025", "matrix": [[...4 rows...]] or 16 numbers}  or
    {"timestamp": 12.5, "frame": "000025", "x": 1.0, "y": 2.0, "z": 0.0, "yaw": 0.1}
Timestamps are in seconds unless --time-unit ms|us|ns; they are stored as int64 microseconds.
A matrix must be a rigid transform: rotation orthonormal (|R^T R - I| <= 1e-3), det +1, last row
0 0 0 1.

Classes: --classes a,b,c --free c (name or id), or --classes-json FILE:
    {"class_names": ["road", "car", "building", "free"], "free_class": "free",
     "voxel_size": [0.4, 0.4, 0.4], "range": [-40, -40, -1, 40, 40, 5.4], "frame_rate_hz": 10,
     "colors": {"car": [0, 150, 245], "building": "#e6e6fa"}, "moving_classes": ["car"]}
(moving_classes: the classes that move, for the forecast's per-step tables and the pictures; with
--classes give them as --moving-classes. voxel_size, range, frame_rate_hz, colors, moving_classes optional; --voxel-size/--range/--frame-rate override.
Defaults: 0.4 m voxels, a range centred on the ego in x/y from z = -1 m, the frame rate from the
median timestamp step (snapped to a multiple of 0.5 Hz within 0.2 %: clock jitter). range must span
grid x voxel_size. colors: the pictures' colour of some or
all classes (a {name: colour} object or a list in class order; [r, g, b] or "#rrggbb"); the others
get Occ3D's colour where the name is an Occ3D class name, else a distinct one.)

Grid: a 3-level tokenizer (OccWorld's) needs X and Y divisible by 4, the default 2-level one by 2 (a
warning says so at conversion). --crop cuts X and Y
down to the nearest multiple of 4 (or to --crop X Y), --pad grows them with free, not-visible
voxels (or to --pad X Y); both keep the ego near the middle (--align ego, the default; centre, low,
high) and move the manifest's range with the cut.

Checks: a scene whose median frame interval differs from the others' by x1000 or more (one drive
in milliseconds among drives in seconds) is refused, naming it; so are timestamps that do not fit
int64 microseconds in the unit read (Unix microseconds read as seconds), a median frame rate
outside 0.5-100 Hz, and one more than 5 % off a given frame_rate_hz / --frame-rate: each in one line
naming the unit the timestamps look like (--time-unit); a yaw that looks like degrees (some
|yaw| beyond 2 pi, or turns faster than 2 rad/s when read as radians) is a warning: --yaw-units deg.

Split: --val-scenes a,b names the validation scenes; otherwise --val-fraction (default 0.1) of the
scenes, chosen deterministically (ranked by the sha256 of their names; at least one).

Masks are stored as bit 0 (value 1) of the shard's mask field ("visible"); data.use_mask=true uses
them. Resumable, --skip-bad, --verify, --format, --compression, --workers: as tools/convert_occ3d.py.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.data.convert.engine import add_writer_args, convert_and_report  # noqa: E402
from wm.data.convert.frames import VISIBLE_BITS, YAW_UNITS, frames_scenes, median_rate, peek_grid  # noqa: E402
from wm.data.convert.recording_checks import (GRID_MULTIPLE, TIME_UNITS, check_range, grid_note, plan_fit,
    rate_problem, time_unit_outliers, yaw_unit_note)
from wm.data.shards import DatasetInfo, check_moving  # noqa: E402
from wm.data.stats import moving_classes  # noqa: E402
from wm.data.viz import parse_colors  # noqa: E402
from wm.utils.errors import DataError, run_cli  # noqa: E402

CLASS_KEYS = ("class_names", "free_class", "voxel_size", "range", "frame_rate_hz", "colors", "moving_classes")


def classes_from_args(a) -> dict:
    """{"class_names", "free_class" (id), maybe "voxel_size", "range", "frame_rate_hz"}."""
    if bool(a.classes) == bool(a.classes_json):
        raise DataError("give the classes either as --classes a,b,c --free NAME or as --classes-json FILE")
    if a.classes_json and a.moving_classes:
        raise DataError(f"--moving-classes goes with --classes; with --classes-json write \"moving_classes\" "
                        f"into {a.classes_json}")
    if a.classes_json:
        p = Path(a.classes_json)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise DataError(f"--classes-json {p}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise DataError(f"{p}: expected an object with {', '.join(CLASS_KEYS)}")
        unknown = [k for k in d if k not in CLASS_KEYS]
        if unknown:
            raise DataError(f"{p}: unknown key '{unknown[0]}' (known: {', '.join(CLASS_KEYS)})")
        for k in ("class_names", "free_class"):
            if k not in d:
                raise DataError(f"{p}: key '{k}' is missing")
        names, free, where = d["class_names"], d["free_class"], str(p)
        d.setdefault("moving_classes", [])
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise DataError(f"{p}: class_names must be a list of names")
    else:
        if a.free is None:
            raise DataError("--classes needs --free NAME (or id): the class of empty voxels")
        names, free, where = [n.strip() for n in a.classes.split(",")], a.free, "--classes"
        d = {}
        if not all(names):
            raise DataError(f"--classes {a.classes!r}: an empty class name")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise DataError(f"{where}: class {dup!r} is named twice")
    if isinstance(free, str) and free in names:
        fid = names.index(free)
    elif isinstance(free, int) or (isinstance(free, str) and free.isdigit()):
        fid = int(free)
    else:
        raise DataError(f"{where}: free class {free!r} is not one of the classes {names}")
    if not 0 <= fid < len(names):
        raise DataError(f"{where}: free class id {fid} is not below the {len(names)} classes")
    out = {"class_names": names, "free_class": fid}
    for k in ("voxel_size", "range", "frame_rate_hz"):
        if k in d:
            out[k] = d[k]
    if "colors" in d:
        out["colors"] = parse_colors(d["colors"], names, f"{where}: colors")
    moving = d["moving_classes"] if a.classes_json else (a.moving_classes.split(",") if a.moving_classes else [])
    key = f"{where}: moving_classes" if a.classes_json else "--moving-classes"
    if not (isinstance(moving, list) and all(isinstance(n, str) for n in moving)):
        raise DataError(f"{key}: expected a list of class names")
    check_moving([n.strip() for n in moving], names, fid, key)
    out["moving_classes"] = [n.strip() for n in moving]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="folder with one sub-folder per scene")
    ap.add_argument("--out", required=True, help="data set folder to write (or to resume)")
    ap.add_argument("--classes", help="class names in id order, comma-separated")
    ap.add_argument("--free", help="the free (empty) class: a name from --classes or an id")
    ap.add_argument("--classes-json", help="JSON with class_names, free_class [, voxel_size, range, frame_rate_hz, "
                    "colors, moving_classes]")
    ap.add_argument("--moving-classes", help="with --classes: the classes that move, comma-separated (tables list "
                    "their forecast IoU per step; pictures draw them on top)")
    ap.add_argument("--key", help="array name in .npz frames (default: 'semantics' if present, else the first)")
    ap.add_argument("--mask-key", help="array name of the visibility mask inside each .npz frame")
    ap.add_argument("--time-unit", choices=list(TIME_UNITS), default="s", help="unit of the poses' timestamps")
    ap.add_argument("--grid", type=int, nargs=3, metavar=("X", "Y", "Z"),
                    help="expected grid (default: the first frame's)")
    ap.add_argument("--voxel-size", type=float, nargs="+", metavar="M", help="voxel size in metres (1 or 3 numbers)")
    ap.add_argument("--range", type=float, nargs=6, metavar="V", help="xmin ymin zmin xmax ymax zmax in metres")
    ap.add_argument("--frame-rate", type=float, help="frames per second (default: from the timestamps)")
    ap.add_argument("--yaw-units", choices=list(YAW_UNITS), default="rad", help="unit of the poses' yaw column")
    fit = ap.add_mutually_exclusive_group()
    fit.add_argument("--crop", type=int, nargs="*", metavar="N",
                     help=f"cut X and Y to multiples of {GRID_MULTIPLE} (or to --crop X Y)")
    fit.add_argument("--pad", type=int, nargs="*", metavar="N",
                     help=f"grow X and Y to multiples of {GRID_MULTIPLE} with free voxels (or to --pad X Y)")
    ap.add_argument("--align", choices=["ego", "centre", "low", "high"], default="ego",
                    help="where --crop/--pad keep the grid: around the ego (default), the middle, or an edge")
    ap.add_argument("--val-scenes", help="comma-separated validation scene names")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="share of scenes for validation (default 0.1)")
    add_writer_args(ap)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cls = classes_from_args(a)
    val = [v.strip() for v in a.val_scenes.split(",") if v.strip()] if a.val_scenes else None
    order, specs, bad = frames_scenes(a.root, val, a.val_fraction, a.time_unit, a.key, a.mask_key, a.yaw_units)
    for b in time_unit_outliers(specs, a.time_unit):  # refused (or skipped with --skip-bad) like any bad scene
        specs.pop(b["scene"])
        bad.append(b)
    given, given_where = (a.frame_rate, "--frame-rate") if a.frame_rate else \
        (cls.get("frame_rate_hz"), f"{a.classes_json}: frame_rate_hz")
    if given is not None and not (isinstance(given, (int, float)) and not isinstance(given, bool) and given > 0):
        raise DataError(f"{given_where} {given!r} must be a positive number of frames per second")
    problem = rate_problem(specs, a.time_unit, given, given_where)
    if problem:  # timestamps in another unit than read, or a rate they contradict: every horizon would be off
        raise DataError(problem)
    if a.grid:
        grid = tuple(a.grid)
    elif specs:
        grid = peek_grid(specs[min(specs)])
    else:
        raise DataError(bad[0]["error"] if bad else f"{a.root}: no scenes")
    voxel = a.voxel_size or cls.get("voxel_size") or [0.4]
    voxel = [float(v) for v in (voxel if isinstance(voxel, list) else [voxel])]
    if len(voxel) == 1:
        voxel *= 3
    if len(voxel) != 3:
        raise DataError(f"voxel size {voxel} must be 1 or 3 numbers")
    rng = a.range or cls.get("range") or [-grid[0] * voxel[0] / 2, -grid[1] * voxel[1] / 2, -1.0,
                                          grid[0] * voxel[0] / 2, grid[1] * voxel[1] / 2, -1.0 + grid[2] * voxel[2]]
    if len(rng) != 6:
        raise DataError(f"range {list(rng)} must be 6 numbers")
    check_range(grid, voxel, rng, "--range" if a.range else f"{a.classes_json}" if "range" in cls else "range")
    fit = None
    for mode in ("crop", "pad"):
        size = getattr(a, mode)
        if size is not None:
            if len(size) not in (0, 2):
                raise DataError(f"--{mode} takes no sizes (the nearest multiple of {GRID_MULTIPLE}) or two: X Y")
            fit = plan_fit(grid, voxel, rng, mode, size or None, GRID_MULTIPLE, a.align)
    if fit:
        for spec in specs.values():
            spec.opts["reframe"] = fit
        print(f"--{'crop' if a.crop is not None else 'pad'}: grid {' x '.join(map(str, grid))} -> "
              f"{' x '.join(map(str, fit['grid']))} (first new cell = source cell {fit['start'][0]}, "
              f"{fit['start'][1]}), range {fit['range']}")
        grid, rng = tuple(fit["grid"]), fit["range"]
    for note in (grid_note(grid), yaw_unit_note(specs.values())):
        if note:
            print(f"warning: {note}")
    rate = a.frame_rate or cls.get("frame_rate_hz") or median_rate(specs.values())
    has_mask = any(s.opts["has_mask"] for s in specs.values())
    try:
        info = DatasetInfo(grid=grid, num_classes=len(cls["class_names"]), free_class=cls["free_class"],
                           class_names=cls["class_names"], voxel_size=voxel, range=rng, frame_rate_hz=float(rate),
                           has_mask=has_mask, class_colors=cls.get("colors") or {},
                           moving_classes=cls["moving_classes"])
    except (TypeError, ValueError) as e:
        raise DataError(f"classes / voxel size / range: {e}") from None
    options = {"source": str(Path(a.root).resolve()), "format": a.format,
               "compression": a.compression if a.format == "hdf5" else "none",
               "scenes_per_shard": a.scenes_per_shard, "grid": list(info.grid),
               "class_names": list(info.class_names), "free_class": info.free_class,
               "voxel_size": list(info.voxel_size), "range": list(info.range),
               "frame_rate_hz": info.frame_rate_hz, "key": a.key, "mask_key": a.mask_key,
               "time_unit": a.time_unit, "splits": {k: v for k, v in order.items()}}
    # recorded only when used: a resume compares records key by key, and one without them has none
    for k, v in (("yaw_units", a.yaw_units if a.yaw_units != "rad" else None), ("fit", fit),
                 ("class_colors", dict(info.class_colors) or None),
                 ("moving_classes", list(info.moving_classes) or None)):
        if v is not None:
            options[k] = v
    moving = moving_classes(info)
    if moving:
        print(f"moving classes: {', '.join(moving)}{'' if info.moving_classes else ' (nuScenes names)'}")
    else:
        add = f'add "moving_classes": [...] to {a.classes_json}' if a.classes_json else "add --moving-classes a,b"
        print(f"note: no moving classes declared; the forecast's per-step table and TensorBoard IoU of moving classes, "
              f"and moving objects drawn over the pictures, need them: {add} (or set data.moving_classes to train)")
    bits = VISIBLE_BITS if has_mask else {}
    record = {"tool": "convert_frames", "options": options, "mask_bits": bits,
              "mask_convention": "uint8: bit 0 (1) = visible" if has_mask else "no masks"}
    return convert_and_report(
        a, info, order, specs, bad, record, bits, t0,
        f"{a.root}: {sum(len(v) for v in order.values())} scenes "
        f"({', '.join(f'{k} {len(v)}' for k, v in order.items())}), grid {' x '.join(map(str, grid))}, "
        f"{info.num_classes} classes (free = {info.free_class} '{info.class_names[info.free_class]}'), "
        f"{info.frame_rate_hz:g} Hz, masks: {'yes' if has_mask else 'no'}")


if __name__ == "__main__":
    run_cli(main)
