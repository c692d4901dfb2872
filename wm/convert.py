"""Converters of real occupancy data into wm shards (tools/convert_occ3d.py, tools/convert_frames.py).

Two sources, one engine:

- **Occ3D-nuScenes** as distributed (`<root>/annotations.json` + `<root>/gts/<scene>/<token>/labels.npz`),
  see `occ3d_scenes`.
- **Your own recordings**: `<root>/<scene>/` folders of per-frame `.npy`/`.npz` grids with a poses file
  per scene, see `frames_scenes` (the exact layout is in its docstring and in tools/convert_frames.py).

The engine (`convert`) plans shards of K scenes per split in a fixed order, checks everything that
can be checked without reading frames (pose rigidity, timestamps, files on disk, scene length) in the
main process, then reads frames and writes shards in parallel worker processes. It is resumable: a
shard is final only once ShardWriter renames it into place, so on a re-run every shard already under
its final name that holds exactly the planned scenes is kept (not rewritten), leftover temporaries of
dead processes are removed, and the manifest is written at the end from all shards.
`conversion.json` beside the manifest records the options; a re-run with different options is
refused (it would mix two data sets). `skipped.json` lists the scenes `--skip-bad` left out.

**Visibility masks.** The shard format has one uint8 `mask` field. Converters store bit flags in it:
bit 0 (value 1) = visible to the cameras (Occ3D `mask_camera`, or "visible" for own recordings),
bit 1 (value 2) = observed by the lidar (Occ3D `mask_lidar`). `--mask camera` or `--mask lidar`
stores just that bit, so `mask != 0` (what wm.data / wm.metrics use with data.use_mask) is exactly
that mask; `--mask both` (the default) stores both bits, and `mask != 0` is then their union (select
one with `mask & 1` / `mask & 2`). Every manifest shard entry says which bits it holds:
`"mask_bits": {"camera": 1, "lidar": 2}`.

No pickle is ever loaded: every `np.load` passes `allow_pickle=False`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import queue
import re
import shutil
import sys
import time
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from wm import runlock
from wm.atomic import clean_temps, write_bytes
from wm.errors import DataError, first_line
from wm.recording_checks import TIME_UNITS, int64_us, reframe, yaw_stats
from wm.shards import (COMPRESSIONS, DEFAULT_COMPRESSION, MANIFEST, OCC3D_CLASSES, SUFFIX, DatasetInfo, Manifest,
                       ShardWriter, shard_sha256, verify)

CONVERSION = "conversion.json"
SKIPPED = "skipped.json"

# mask bit flags (module docstring)
MASK_BITS = {"camera": 1, "lidar": 2}
MASK_MODES = {"both": ("camera", "lidar"), "camera": ("camera",), "lidar": ("lidar",), "none": ()}
VISIBLE_BITS = {"visible": 1}  # own recordings: one visibility mask, bit 0

# Occ3D-nuScenes facts (Tsinghua-MARS-Lab/Occ3D README, "Occ3D-nuScenes"): 200x200x16 voxels of
# 0.4 m over [-40, -40, -1, 40, 40, 5.4] m, classes 0-16 as nuScenes-lidarseg, 17 = free; keyframes
# at 2 Hz.
OCC3D_GRID = (200, 200, 16)
OCC3D_RANGE = (-40.0, -40.0, -1.0, 40.0, 40.0, 5.4)
OCC3D_VOXEL = (0.4, 0.4, 0.4)
OCC3D_HZ = 2.0
# ends of the prev/next chain: "" in nuScenes' own sample table; "EOF" in Occ3D's annotations.json
# (code that walks it tests `prev != 'EOF'`, e.g. the OccTENS-style dataset reader found by search)
CHAIN_END = (None, "", "EOF")

POSE_TOL = 1e-3  # |R^T R - I| and |det R - 1| allowed before a pose is "not a rigid transform"
YAW_UNITS = {"rad": 1.0, "deg": math.pi / 180}


# ---------------------------------------------------------------------------------------------
# poses and timestamps


def quat_to_matrix(q) -> np.ndarray:
    """3x3 rotation of a unit quaternion given as (w, x, y, z), nuScenes' order."""
    w, x, y, z = (float(v) for v in q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def pose_matrix(rotation: np.ndarray, translation) -> np.ndarray:
    m = np.eye(4)
    m[:3, :3] = rotation
    m[:3, 3] = np.asarray(translation, float)
    return m


def yaw_matrix(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def check_rigid(m, where: str, tol: float = POSE_TOL) -> np.ndarray:
    """`m` as a float64 4x4 ego->global rigid transform, or DataError naming `where`."""
    m = np.asarray(m, np.float64)
    if m.shape != (4, 4):
        raise DataError(f"{where}: pose has shape {m.shape}, expected 4x4")
    if not np.isfinite(m).all():
        raise DataError(f"{where}: pose is not finite")
    if np.abs(m[3] - (0.0, 0.0, 0.0, 1.0)).max() > 1e-9:
        raise DataError(f"{where}: pose's last row is {m[3].tolist()}, expected [0, 0, 0, 1]: not a rigid transform")
    r = m[:3, :3]
    err = float(np.abs(r.T @ r - np.eye(3)).max())
    if err > tol:
        raise DataError(f"{where}: pose rotation is not orthonormal (max |R^T R - I| = {err:.3g} > {tol:g}): "
                        "not a rigid transform")
    det = float(np.linalg.det(r))
    if abs(det - 1.0) > tol:
        raise DataError(f"{where}: pose rotation has determinant {det:.4g}, expected +1: not a rigid transform")
    return m


def _whole_us(v, where: str) -> int:
    """A timestamp already in microseconds (int, whole float or digit string) as int."""
    if isinstance(v, bool):
        pass
    elif isinstance(v, int):
        return v
    elif isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    elif isinstance(v, str) and re.fullmatch(r"\s*\d+\s*", v):
        return int(v)
    raise DataError(f"{where}: timestamp {v!r} is not whole microseconds")


# ---------------------------------------------------------------------------------------------
# scenes: what the planner found, what a worker reads


@dataclass
class SceneSpec:
    """One scene to convert: its frames' files in time order and what the poses file said.
    Plain data, so it travels to worker processes."""

    name: str
    split: str
    files: list[str]
    ids: list[str]  # frame ids for messages (sample token / file stem)
    timestamp: np.ndarray  # int64 microseconds
    pose: np.ndarray  # (n, 4, 4) float64 ego->global
    reader: str  # "occ3d" or "frames"
    opts: dict = field(default_factory=dict)


@contextmanager
def _reading(path: Path, where: str, kind: str):
    """A frame file's read errors as one DataError line naming the file and the frame."""
    try:
        yield
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"{path}: {where}: the file is missing") from None
    except (zlib.error, zipfile.BadZipFile) as e:  # an npz member's deflate stream or CRC
        raise DataError(f"{path}: {where}: the file is damaged ({first_line(e)}); download or write it "
                        "again") from None
    except ValueError as e:
        if "pickle" in str(e):  # numpy's message suggests loading it unsafely: never that
            raise DataError(f"{path}: {where}: cannot be read as {kind}: it holds pickled Python objects, "
                            "not an array of numbers (wm never loads pickled data)") from None
        raise DataError(f"{path}: {where}: cannot be read as {kind} ({first_line(e)})") from None
    except (OSError, EOFError, KeyError) as e:
        raise DataError(f"{path}: {where}: cannot be read as {kind} ({first_line(e)})") from None


NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first local header, or an empty zip


def _sniff(path: Path, where: str) -> str:
    """".npy" or ".npz" by the file's first bytes, whatever its name; anything else (a failed
    download's HTML page, a truncated file) is a DataError quoting how it begins."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(NPY_MAGIC):
        return ".npy"
    if head[:4] in ZIP_MAGIC:
        return ".npz"
    shown = head.split(b"\n")[0][:32].decode("ascii", "replace").strip() if head else ""
    begins = f"it begins with {shown!r}" if head else "it is empty"
    raise DataError(f"{path}: {where}: not a NumPy {path.suffix} file ({begins}): damaged, or something "
                    "else saved under this name (a failed download's web page?); download or write it again")


@contextmanager
def _open_frame(path: Path, where: str, fix: str, mmap: bool = False):
    """A frame file opened after checking by its first bytes that it is what its name says: yields
    the array of a .npy or the NpzFile of a .npz. Read errors in the `with` body (npz members
    decompress lazily there) are one DataError naming the file; `fix` says what to do about a
    .npy saved under an .npz name."""
    with _reading(path, where, path.suffix):
        kind = _sniff(path, where)
        if kind != path.suffix and path.suffix in (".npy", ".npz"):
            got = "a single .npy array (np.save)" if kind == ".npy" else "an .npz archive (np.savez)"
            raise DataError(f"{path}: {where}: holds {got}, not what its {path.suffix} name says; {fix}")
        if kind == ".npy":
            yield np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
        else:
            with np.load(path, allow_pickle=False) as z:
                yield z


FRAMES_FIX = "give it the name its contents have (.npy for np.save, .npz for np.savez)"
OCC3D_FIX = ("an Occ3D labels.npz is an .npz archive of semantics, mask_lidar and mask_camera: download it "
             "again")


def _load_npy_npz(path: Path, key: Optional[str], where: str, what: str) -> np.ndarray:
    with _open_frame(path, where, FRAMES_FIX) as z:
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


def _labels(a: np.ndarray, path: Path, where: str, info: DatasetInfo) -> np.ndarray:
    if tuple(a.shape) != info.grid:
        raise DataError(f"{path}: {where}: grid of shape {tuple(a.shape)}, expected {info.grid}")
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    if a.dtype.kind not in "iu":
        raise DataError(f"{path}: {where}: grid has dtype {a.dtype}, expected integer class ids")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= info.num_classes:
        bad = lo if lo < 0 else hi
        raise DataError(f"{path}: {where}: class id {bad} is out of range [0, {info.num_classes}) "
                        f"({info.num_classes} classes)")
    return a.astype(np.uint8, copy=False)


def _visible(a: np.ndarray, path: Path, where: str, info: DatasetInfo, what: str) -> np.ndarray:
    if tuple(a.shape) != info.grid:
        raise DataError(f"{path}: {where}: {what} of shape {tuple(a.shape)}, expected {info.grid}")
    if a.dtype.kind not in "biuf":
        raise DataError(f"{path}: {where}: {what} has dtype {a.dtype}, expected 0/1 values")
    return a != 0


def read_scene(spec: SceneSpec, info: DatasetInfo) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The scene's occupancy (n, X, Y, Z) uint8 and mask (or None), every frame checked."""
    n = len(spec.files)
    occ = np.empty((n, *info.grid), np.uint8)
    mask = np.zeros((n, *info.grid), np.uint8) if info.has_mask else None
    for i, f in enumerate(spec.files):
        path, where = Path(f), f"scene {spec.name!r} frame {spec.ids[i]}"
        if spec.reader == "occ3d":
            bits = spec.opts["mask"]
            with _open_frame(path, where, OCC3D_FIX) as z:
                need = ["semantics"] + [f"mask_{b}" for b in bits]
                missing = [k for k in need if k not in z.files]
                if missing:
                    raise DataError(f"{path}: {where}: has no array {missing[0]!r} (it holds {list(z.files)})")
                arrays = {k: z[k] for k in need}
            if arrays["semantics"].dtype != np.uint8:  # e.g. OpenOcc: int32, free = 16
                raise DataError(f"{path}: {where}: semantics has dtype {arrays['semantics'].dtype}, but "
                                "Occ3D-nuScenes stores uint8 class ids (free = 17): this is another data "
                                "set's format (OpenOcc: int32, free = 16); convert it with "
                                "tools/convert_frames.py and its own class list")
            occ[i] = _labels(arrays["semantics"], path, where, info)
            for b in bits:
                mask[i] |= _visible(arrays[f"mask_{b}"], path, where, info, f"mask_{b}").astype(np.uint8) * MASK_BITS[b]
        else:
            fit = spec.opts.get("reframe")  # --crop / --pad: padded voxels are free and not visible
            occ[i] = _labels(reframe(_load_npy_npz(path, spec.opts.get("key"), where, "occupancy"), fit, info.free_class,
                                     path, where), path, where, info)
            if mask is not None:
                if spec.opts.get("mask_key"):
                    mp, mk = path, spec.opts["mask_key"]
                else:
                    mp, mk = Path(spec.opts["mask_files"][i]), None
                mask[i] = _visible(reframe(_load_npy_npz(mp, mk, where, "mask"), fit, 0, mp, where), mp, where, info,
                                   "mask").astype(np.uint8)
    return occ, mask


def _check_times(name: str, ts: np.ndarray, ids: list[str], where: str) -> None:
    d = np.diff(ts)
    if (d <= 0).any():
        i = int(np.argmax(d <= 0))
        raise DataError(f"{where}: scene {name!r}: frames {ids[i]} and {ids[i + 1]} have timestamps "
                        f"{int(ts[i])} and {int(ts[i + 1])} us: timestamps must increase")


def _check_length(name: str, n: int, where: str) -> None:
    if n < 2:
        raise DataError(f"{where}: scene {name!r} has {n} frame{'s' if n != 1 else ''}; a window needs "
                        "at least 2 (remove the scene or pass --skip-bad)")


# ---------------------------------------------------------------------------------------------
# Occ3D-nuScenes


def load_annotations(path: Path) -> dict:
    """annotations.json of Occ3D-nuScenes, checked for the top-level structure.

    The structure follows the Occ3D README (github.com/Tsinghua-MARS-Lab/Occ3D, "Occ3D-nuScenes"):
    `train_split` / `val_split`: lists of scene names; `scene_infos`: {scene_name: {frame_token:
    {"timestamp", "camera_sensor", "ego_pose": {"translation": [3], "rotation": [4]}, "gt_path",
    "prev", "next"}}}, frames in time order. The README calls `timestamp` a str; readers of the real
    file do arithmetic on it (µs, as nuScenes' sample timestamps), so both are accepted. `rotation`
    is a quaternion in nuScenes' order w, x, y, z (nuscenes-devkit docs/schema_nuscenes.md: "Coordinate
    system orientation as quaternion: w, x, y, z"); the pose maps ego to global coordinates.
    `gt_path` is relative to the folder of annotations.json ("gts/<scene>/<token>/labels.npz").
    """
    if not path.is_file():
        raise DataError(f"{path} is missing: --root must be the unpacked Occ3D-nuScenes folder that holds "
                        "annotations.json and gts/")
    try:
        d = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({first_line(e)}); download it again") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({first_line(e)})") from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a JSON object with train_split, val_split and scene_infos, "
                        f"got {type(d).__name__}")
    for k, t in (("train_split", list), ("val_split", list), ("scene_infos", dict)):
        if k not in d:
            raise DataError(f"{path}: key '{k}' is missing (an Occ3D-nuScenes annotations.json has "
                            "train_split, val_split and scene_infos)")
        if not isinstance(d[k], t):
            raise DataError(f"{path}: '{k}' is a {type(d[k]).__name__}, expected a {t.__name__}")
    both = sorted(set(d["train_split"]) & set(d["val_split"]))
    if both:
        raise DataError(f"{path}: scene {both[0]!r} is in both train_split and val_split")
    return d


QUAT_ORDERS = {"wxyz": (0, 1, 2, 3), "xyzw": (3, 0, 1, 2)}  # positions of w, x, y, z in the file


def occ3d_scene(root: Path, ann_path: Path, name: str, split: str, infos, bits: tuple,
                quat_order: str = "wxyz") -> SceneSpec:
    """Plan one Occ3D scene from annotations.json: frames ordered by timestamp, the order checked
    against the prev/next chain, poses from the quaternions (`quat_order`: how the file writes
    them), every label file present (an absolute gt_path that is not here, e.g. recorded on another
    machine, falls back to root/gts/<scene>/<token>/labels.npz)."""
    where = f"{ann_path}: scene {name!r}"
    qo = QUAT_ORDERS[quat_order]
    quats = []
    if infos is None:
        raise DataError(f"{ann_path}: {split}_split lists scene {name!r} but scene_infos has no entry for it")
    if not isinstance(infos, dict):
        raise DataError(f"{where}: scene_infos entry is a {type(infos).__name__}, expected an object of frames")
    _check_length(name, len(infos), str(ann_path))
    rows = []
    for tok, fr in infos.items():
        fw = f"{where} frame {tok}"
        if not isinstance(fr, dict):
            raise DataError(f"{fw}: expected an object, got {type(fr).__name__}")
        for k in ("timestamp", "ego_pose"):
            if k not in fr:
                raise DataError(f"{fw}: key '{k}' is missing")
        ts = _whole_us(fr["timestamp"], fw)
        ep = fr["ego_pose"]
        try:
            t = np.asarray(ep["translation"], np.float64)
            q = np.asarray(ep["rotation"], np.float64)
        except (TypeError, KeyError, ValueError):
            raise DataError(f"{fw}: ego_pose must hold translation [x, y, z] and rotation [w, x, y, z], "
                            f"got {json.dumps(ep)[:120]}") from None
        if t.shape != (3,) or q.shape != (4,):
            raise DataError(f"{fw}: ego_pose translation has {t.size} numbers and rotation {q.size}; "
                            f"expected 3 and 4 ({', '.join(quat_order)})")
        quats.append((ts, q))
        q = q[list(qo)]  # as w, x, y, z
        qn = float(np.linalg.norm(q))
        if not math.isfinite(qn) or abs(qn - 1.0) > POSE_TOL:
            raise DataError(f"{fw}: ego_pose rotation {q.tolist()} is not a unit quaternion (norm {qn:.4g}): "
                            "not a rigid transform")
        pose = check_rigid(pose_matrix(quat_to_matrix(q / qn), t), fw)
        gt = fr.get("gt_path") or f"gts/{name}/{tok}/labels.npz"
        if not isinstance(gt, str):
            raise DataError(f"{fw}: gt_path is {gt!r}, expected a path")
        rows.append((ts, tok, pose, root / gt, fr))
    rows.sort(key=lambda r: r[0])
    ids = [r[1] for r in rows]
    ts = np.array([r[0] for r in rows], np.int64)
    _check_times(name, ts, ids, str(ann_path))
    # the prev/next chain, where given, must agree with the time order (a token that is not in the
    # scene means a frame is missing from annotations.json)
    for i, (_, tok, _, _, fr) in enumerate(rows):
        for key, want in (("prev", ids[i - 1] if i > 0 else None), ("next", ids[i + 1] if i + 1 < len(ids) else None)):
            if key not in fr:
                continue
            got = fr[key]
            if not (got is None or isinstance(got, str)):
                raise DataError(f"{where} frame {tok}: '{key}' is {got!r}, expected a frame token")
            if (got in CHAIN_END and want is None) or got == want:
                continue
            if got not in CHAIN_END and got not in infos:
                raise DataError(f"{where} frame {tok}: '{key}' is {got!r}, which is not a frame of this scene "
                                "(a frame is missing from annotations.json)")
            raise DataError(f"{where} frame {tok}: '{key}' is {got!r} but by timestamp it is "
                            f"{want if want is not None else 'the scene end'}: prev/next disagree with the timestamps")
    files = []
    for _, tok, _, path, _ in rows:
        if not path.is_file():
            usual = root / "gts" / name / tok / "labels.npz"
            if not usual.is_file():
                also = f"; not at {usual} either" if usual != path else ""
                raise DataError(f"{path}: missing (scene {name!r} frame {tok}, listed in {ann_path}){also}")
            path = usual
        files.append(str(path))
    quats.sort(key=lambda r: r[0])
    return SceneSpec(name, split, files, ids, ts, np.stack([r[2] for r in rows]),
                     "occ3d", {"mask": tuple(bits), "quat": np.stack([q for _, q in quats])})


def occ3d_scenes(root: str | os.PathLike, annotations: Optional[str | os.PathLike] = None,
                 mask: str = "both", max_scenes: int = 0, quat_order: str = "wxyz"):
    """Plan an Occ3D-nuScenes conversion: ({split: [scene names]}, {name: SceneSpec}, bad), bad
    being [{"scene", "split", "error"}] for scenes that cannot be converted (annotations alone)."""
    root = Path(root)
    if mask not in MASK_MODES:
        raise DataError(f"--mask {mask!r} must be one of {list(MASK_MODES)}")
    if quat_order not in QUAT_ORDERS:
        raise DataError(f"--quat-order {quat_order!r} must be one of {list(QUAT_ORDERS)}")
    ann_path = Path(annotations) if annotations else root / "annotations.json"
    d = load_annotations(ann_path)
    order = {"train": list(d["train_split"]), "val": list(d["val_split"])}
    if max_scenes:
        order = {k: v[:max_scenes] for k, v in order.items()}
    specs, bad = {}, []
    for split, names in order.items():
        for name in names:
            try:
                specs[name] = occ3d_scene(root, ann_path, str(name), split, d["scene_infos"].get(name),
                                          MASK_MODES[mask], quat_order)
            except DataError as e:
                bad.append({"scene": str(name), "split": split, "error": str(e)})
    return order, specs, bad


TILT_DEG = 30.0  # an ego tilted further from upright than this is not driving on a road
TILT_SHARE = 0.05  # share of such frames that makes the quaternion order suspect


def _tilt_share(quats: np.ndarray, order: str) -> float:
    """Share of rotations (file's numbers `quats`, read in `order`) that tilt the ego's up axis
    more than TILT_DEG from the global up axis."""
    q = quats[:, list(QUAT_ORDERS[order])]
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    up_z = 1 - 2 * (q[:, 1] ** 2 + q[:, 2] ** 2)  # R[2, 2] of each rotation
    return float((up_z < math.cos(math.radians(TILT_DEG))).mean())


def quat_order_warning(specs: Iterable[SceneSpec], ann_path, quat_order: str) -> Optional[str]:
    """A line when the ego poses read with `quat_order` tilt many frames far from upright (ground
    vehicles stay within a few degrees of it): the quaternions are probably written in the other
    order. Which order a file uses cannot be proven from one frame; over a data set it shows."""
    quats = [s.opts["quat"] for s in specs if "quat" in s.opts]
    if not quats:
        return None
    quats = np.concatenate(quats)
    share = _tilt_share(quats, quat_order)
    if share <= TILT_SHARE:
        return None
    other = next(o for o in QUAT_ORDERS if o != quat_order)
    alt = _tilt_share(quats, other)
    hint = (f"read as {','.join(other)} only {100 * alt:.0f} % would be: if the file writes them so, convert "
            f"with --quat-order {other}") if alt < share else "check the poses"
    return (f"{ann_path}: {100 * share:.0f} % of the {len(quats)} ego rotations, read as quaternions "
            f"{','.join(quat_order)}, tilt the vehicle more than {TILT_DEG:g} degrees from upright; {hint}")


def occ3d_info(grid=OCC3D_GRID, mask: str = "both") -> DatasetInfo:
    return DatasetInfo(grid=tuple(grid), num_classes=len(OCC3D_CLASSES), free_class=OCC3D_CLASSES.index("free"),
                       class_names=OCC3D_CLASSES, voxel_size=OCC3D_VOXEL, range=OCC3D_RANGE,
                       frame_rate_hz=OCC3D_HZ, has_mask=bool(MASK_MODES[mask]))


# ---------------------------------------------------------------------------------------------
# own recordings


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
    _check_length(name, len(pairs), str(pf))
    scale = TIME_UNITS[unit]
    pairs.sort(key=lambda p: p[1])
    ids = [p[0] for p in pairs]
    ts = int64_us(np.array([p[1] for p in pairs], np.float64), unit, f"{pf}: scene {name!r}")
    _check_times(name, ts, ids, str(pf))
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


def peek_grid(spec: SceneSpec) -> tuple[int, int, int]:
    """The grid shape of a scene's first frame (cheap for .npy)."""
    f = Path(spec.files[0])
    where = f"scene {spec.name!r} frame {spec.ids[0]}"
    if f.suffix == ".npy":
        with _open_frame(f, where, FRAMES_FIX, mmap=True) as a:
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


# ---------------------------------------------------------------------------------------------
# the engine


@dataclass
class ShardTask:
    name: str
    split: str
    specs: list[SceneSpec]  # the scenes to write (bad ones already left out)


def plan_shards(order: dict[str, list[str]], specs: dict[str, SceneSpec], kind: str, per_shard: int) -> list[ShardTask]:
    """Shards of `per_shard` consecutive scenes of each split, named <split>-<i:05d>.<h5|mm>. The
    grouping uses every planned scene, bad or not, so shard contents do not shift when one is fixed."""
    if per_shard < 1:
        raise DataError(f"--scenes-per-shard {per_shard} must be >= 1")
    tasks = []
    for split, names in order.items():
        for i in range(0, len(names), per_shard):
            group = [specs[n] for n in names[i:i + per_shard] if n in specs]
            tasks.append(ShardTask(f"{split}-{i // per_shard:05d}{SUFFIX[kind]}", split, group))
    return tasks


_PROGRESS: Optional[Callable[[int, int], None]] = None


def _init_worker(q) -> None:
    global _PROGRESS
    _PROGRESS = lambda s, f: q.put((s, f))  # noqa: E731


def _report(scenes: int, frames: int) -> None:
    if _PROGRESS is not None:
        _PROGRESS(scenes, frames)


def _write_shard(job: tuple) -> tuple[Optional[dict], list[dict], np.ndarray]:
    """Write one shard (runs in a worker). Returns (manifest entry or None, skipped scenes, voxel
    count per class of the scenes written)."""
    out, task, info, kind, compression, skip_bad, extra = job
    path = Path(out) / task.name
    skipped, added = [], 0
    hist = np.zeros(info.num_classes, np.int64)
    with ShardWriter(path, kind, info, compression=compression, overwrite=True) as w:
        for spec in task.specs:
            try:
                occ, mask = read_scene(spec, info)
            except DataError as e:
                if not skip_bad:
                    raise
                skipped.append({"scene": spec.name, "split": spec.split, "error": str(e)})
                _report(1, 0)
                continue
            w.add_scene(spec.name, occ, spec.pose, spec.timestamp, mask)
            for frame in occ:  # a frame at a time: bincount makes an int64 copy of its input
                hist += np.bincount(frame.ravel(), minlength=info.num_classes)
            added += 1
            _report(1, len(spec.files))
        try:
            entry = w.close()  # with no scene added it writes nothing and says so
        except DataError:
            if added:
                raise
            return None, skipped, hist
    return {**entry, "split": task.split, **extra}, skipped, hist


def _shard_contents(path: Path, kind: str, info: DatasetInfo, compression: str) -> Optional[tuple[list[str], int]]:
    """(scene names, frames) of a finished shard if it was written with these settings, else None."""
    try:
        if kind == "hdf5":
            import h5py

            if not path.is_file():
                return None
            with h5py.File(path, "r", locking=False) as f:
                a = dict(f.attrs)
                names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["scene_names"][:]]
                frames = int(f["scene_offsets"][-1])
                if str(a.get("compression")) != compression:
                    return None
        else:
            if not path.is_dir():
                return None
            a = json.loads((path / "attrs.json").read_text())
            names = json.loads((path / "scene_names.json").read_text())
            frames = int(np.load(path / "scene_offsets.npy", allow_pickle=False)[-1])
        same = ([int(g) for g in a["grid"]] == list(info.grid) and int(a["num_classes"]) == info.num_classes
                and bool(a["has_mask"]) == info.has_mask
                and json.loads(a["class_names"]) == list(info.class_names))
        return (list(names), frames) if same else None
    except Exception:  # unreadable or foreign: it is rewritten
        return None


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size


class Progress:
    """One plain stderr line: scenes done of total, frames, rate and ETA."""

    def __init__(self, total: int, enabled: bool = True, label: str = "converting"):
        self.total, self.enabled, self.label = total, enabled, label
        self.done = self.frames = 0
        self.t0 = self.last = time.monotonic()

    def add(self, scenes: int, frames: int) -> None:
        self.done += scenes
        self.frames += frames
        if time.monotonic() - self.last > 0.5:
            self.draw()

    def draw(self, end: bool = False) -> None:
        if not self.enabled:
            return
        self.last = time.monotonic()
        dt = max(1e-9, self.last - self.t0)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        if not math.isfinite(eta):
            eta_s = "--"
        else:
            eta_s = f"{eta // 60:.0f}m{eta % 60:02.0f}s" if eta >= 60 else f"{eta:.0f}s"
        print(f"\r{self.label}: {self.done}/{self.total} scenes, {self.frames} frames, {rate:.2f} scenes/s, "
              f"ETA {eta_s}   ", end="\n" if end else "", file=sys.stderr, flush=True)


@dataclass
class Result:
    manifest: Manifest
    skipped: list[dict]
    written: list[str]  # shard names written this run
    kept: list[str]  # finished shards found and kept
    warnings: list[str] = field(default_factory=list)  # what looks wrong but converted


def _check_record(out: Path, record: dict) -> None:
    p = out / CONVERSION
    if p.is_file():
        try:
            old = json.loads(p.read_text())["options"]
        except (ValueError, KeyError, TypeError, OSError):
            raise DataError(f"{p}: damaged; remove {out} (or the file) and convert again") from None
        new = json.loads(json.dumps(record["options"]))
        diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if diff:
            k = diff[0]
            raise DataError(f"{out} was converted with {k}={old.get(k)!r}, this run has {k}={new.get(k)!r}: "
                            f"re-run with the same options to resume, or choose a new --out")
    elif (out / MANIFEST).is_file():
        raise DataError(f"{out} already holds a data set that no converter made ({MANIFEST} without "
                        f"{CONVERSION}); choose a new --out")


def convert(out: str | os.PathLike, info: DatasetInfo, order: dict[str, list[str]], specs: dict[str, SceneSpec],
            bad: list[dict], *, kind: str = "hdf5", compression: str = "zstd3", scenes_per_shard: int = 8,
            workers: int = 1, skip_bad: bool = False, record: Optional[dict] = None, extra: Optional[dict] = None,
            progress: bool = True, log: Callable[[str], None] = print, warnings: Iterable[str] = ()) -> Result:
    """Write (or finish writing) the data set at `out` from the planned scenes; see the module doc.

    bad: scenes the planner refused ([{"scene", "split", "error"}]); without skip_bad the first is
    raised. record: what goes into conversion.json ("options" must match on a re-run). extra: keys
    added to every shard entry (the mask bits). warnings: the planner's (e.g. quat_order_warning);
    a class histogram whose most common class is not the free one adds its own (class_warning).
    With skip_bad, a split whose every scene was skipped stops the run before the manifest is
    written (a data set without its validation split would only fail later, in training)."""
    if bad and not skip_bad:
        more = f" (+{len(bad) - 1} more; --skip-bad converts the rest and lists them)" if len(bad) > 1 else ""
        raise DataError(bad[0]["error"] + more)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create --out {out} ({first_line(e)})") from None
    record = dict(record or {"options": {}})
    extra = dict(extra or {})
    tasks = plan_shards(order, specs, kind, scenes_per_shard)
    with runlock.held(out, log, runlock.CONVERSION):
        _check_record(out, record)
        stale = [p.name for p in clean_temps(out)]
        if stale:
            log(f"removed {len(stale)} unfinished temporaries of an interrupted run: {', '.join(stale[:4])}"
                f"{' ...' if len(stale) > 4 else ''}")
        entries: dict[str, dict] = {}
        pending: list[ShardTask] = []
        for t in tasks:
            p = out / t.name
            want = [s.name for s in t.specs]
            if p.exists():
                got = _shard_contents(p, kind, info, compression)
                if got is not None and got[0] == want and want:
                    entries[t.name] = {"path": t.name, "kind": kind, "scenes": len(want), "frames": got[1],
                                       "bytes": _size(p), "sha256": shard_sha256(p), "split": t.split, **extra}
                    continue
                why = "is unreadable or was written with other settings" if got is None else \
                    f"holds {len(got[0])} scenes, the plan has {len(want)}"
                log(f"{p.name} {why}: rewriting it" if want else f"{p.name}: all its scenes are skipped; removing it")
                if not want:
                    if p.is_dir():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
            if want:
                pending.append(t)
        kept = list(entries)
        if kept:
            log(f"resuming: {len(kept)} finished shard{'s' if len(kept) != 1 else ''} kept")
        if pending and (out / MANIFEST).exists():
            (out / MANIFEST).unlink()  # never a manifest that disagrees with the shards
        write_bytes(out / CONVERSION, json.dumps({**record, "status": "in progress"}, indent=1) + "\n")
        skipped = list(bad)
        hist = np.zeros(info.num_classes, np.int64)
        bar = Progress(sum(len(t.specs) for t in pending), progress)
        jobs = [(str(out), t, info, kind, compression, skip_bad, extra) for t in pending]
        results: dict[str, tuple] = {}
        if workers <= 1 or len(jobs) <= 1:
            global _PROGRESS
            _PROGRESS = bar.add
            try:
                for job in jobs:
                    results[job[1].name] = _write_shard(job)
            finally:
                _PROGRESS = None
        else:
            results = _run_pool(jobs, workers, bar, out)
        if jobs:
            bar.draw(end=True)
        for t in pending:
            entry, sk, h = results[t.name]
            skipped += sk
            hist += h
            if entry is not None:
                entries[t.name] = entry
        final = [entries[t.name] for t in tasks if t.name in entries]
        write_bytes(out / SKIPPED, json.dumps(skipped, indent=1) + "\n")
        _check_splits(out, order, final, skipped, log)
        warnings = list(warnings) + ([w] if (w := class_warning(out, info, hist)) else [])
        m = Manifest(out, info, final)
        split_counts = {s: sum(e["scenes"] for e in final if e["split"] == s) for s in order}
        m.write()
        write_bytes(out / CONVERSION, json.dumps({**record, "status": "complete", "scenes": split_counts,
                                                 "frames": sum(e["frames"] for e in final),
                                                 "skipped": len(skipped), "fingerprint": m.fingerprint,
                                                 "warnings": warnings}, indent=1) + "\n")
        return Result(m, skipped, [t.name for t in pending if t.name in entries], kept, warnings)


def _check_splits(out: Path, order: dict[str, list[str]], final: list[dict], skipped: list[dict],
                  log: Callable[[str], None]) -> None:
    """Stop (no manifest) when nothing, or no scene of a planned split, was converted; every
    skipped scene is printed first and listed in skipped.json."""
    empty = [sp for sp, names in order.items() if names and not any(e["split"] == sp for e in final)]
    if final and not empty:
        return
    for s in skipped:
        log(f"skipped {s['split']} scene {s['scene']}: {s['error']}")
    if not final:
        n = len(skipped)
        if not n:
            raise DataError(f"nothing to convert into {out}: no scenes were found")
        raise DataError(f"nothing was converted into {out}: {'all ' if n > 1 else ''}{n} scene{'s' if n != 1 else ''} "
                        f"{'were' if n != 1 else 'was'} skipped, each listed in {out / SKIPPED}; the first: "
                        f"{skipped[0]['error']}")
    sp = empty[0]
    first = next(s for s in skipped if s["split"] == sp)
    raise DataError(f"every {sp} scene ({len(order[sp])}) was skipped, so {out} would have no {sp!r} split; no "
                    f"manifest was written. Fix them (listed in {out / SKIPPED}) and run the same command again; "
                    f"the first: {first['error']}")


FREE_SHARE_HINT = "OpenOcc numbers free 16, Occ3D-nuScenes 17"


def class_warning(out: Path, info: DatasetInfo, hist: np.ndarray) -> Optional[str]:
    """A line when the most common class of the converted voxels is not the free class: occupancy
    grids are mostly empty, so the class ids or the free class do not match these files."""
    total = int(hist.sum())
    top = int(np.argmax(hist))
    if not total or top == info.free_class:
        return None
    share = lambda c: f"{100 * hist[c] / total:.1f} %"  # noqa: E731
    return (f"{out}: the most common class is {top} '{info.class_names[top]}' ({share(top)} of the voxels), "
            f"not the free class {info.free_class} '{info.class_names[info.free_class]}' "
            f"({share(info.free_class)}): the class ids or the free class probably do not match these files "
            f"({FREE_SHARE_HINT})")


def _run_pool(jobs: list[tuple], workers: int, bar: Progress, out: Path) -> dict[str, tuple]:
    import multiprocessing as mp

    ctx = mp.get_context()
    q = ctx.Queue()
    pool = ctx.Pool(min(workers, len(jobs)), initializer=_init_worker, initargs=(q,))
    results: dict[str, tuple] = {}
    try:
        futures = {job[1].name: pool.apply_async(_write_shard, (job,)) for job in jobs}
        while futures:
            try:
                bar.add(*q.get(timeout=0.1))
            except queue.Empty:
                pass
            for name in [n for n, f in futures.items() if f.ready()]:
                results[name] = futures.pop(name).get()  # a worker's DataError is raised here
        pool.close()
        pool.join()
        while True:
            try:
                bar.add(*q.get_nowait())
            except queue.Empty:
                break
    except BaseException:
        pool.terminate()
        pool.join()
        clean_temps(out)  # the killed workers' half shards
        raise
    return results


# ---------------------------------------------------------------------------------------------
# what both CLIs share


def add_writer_args(ap: argparse.ArgumentParser) -> None:
    """Options both converters share."""
    ap.add_argument("--format", choices=["hdf5", "memmap"], default="hdf5")
    ap.add_argument("--compression", choices=list(COMPRESSIONS), default=DEFAULT_COMPRESSION,
                    help="HDF5 compression (ignored for memmap)")
    ap.add_argument("--scenes-per-shard", type=int, default=8)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes reading and writing shards in parallel (default: min(8, cores))")
    ap.add_argument("--skip-bad", action="store_true",
                    help="convert the scenes that can be converted and list the others")
    ap.add_argument("--verify", action="store_true", help="recompute every shard's sha256 at the end")
    ap.add_argument("--quiet", action="store_true", help="no progress line")


def convert_and_report(a, info: DatasetInfo, order, specs, bad, record: dict, bits: dict, t0: float,
                       summary: str, warnings: Iterable[str] = ()) -> int:
    """The converters' common ending: print `summary`, convert with the CLI options `a`, report."""
    print(summary)
    res = convert(a.out, info, order, specs, bad, kind=a.format, compression=a.compression,
                  scenes_per_shard=a.scenes_per_shard, workers=a.workers, skip_bad=a.skip_bad,
                  record=record, extra={"mask_bits": bits} if bits else {}, progress=not a.quiet,
                  warnings=warnings)
    return report(a.out, res, t0, a.verify)


def report(out, res, t0: float, do_verify: bool) -> int:
    m = res.manifest
    for s in res.skipped:
        print(f"skipped {s['split']} scene {s['scene']}: {s['error']}")
    splits = {}
    for e in m.shards:
        sc, fr = splits.get(e["split"], (0, 0))
        splits[e["split"]] = (sc + e["scenes"], fr + e["frames"])
    size = sum(e["bytes"] for e in m.shards)
    parts = ", ".join(f"{k} {sc} scene{'s' if sc != 1 else ''} / {fr} frames" for k, (sc, fr) in splits.items())
    kept = f" ({len(res.kept)} kept from an earlier run)" if res.kept else ""
    print(f"wrote {out}: {len(m.shards)} shards{kept}, {parts}, {size / 2**20:.1f} MiB in "
          f"{time.perf_counter() - t0:.1f} s; fingerprint {m.fingerprint[:16]}")
    if res.skipped:
        print(f"skipped {len(res.skipped)} scene{'s' if len(res.skipped) != 1 else ''}: listed in "
              f"{Path(out) / 'skipped.json'}")
    for w in res.warnings:  # last, where they are seen; also in conversion.json
        print(f"warning: {w}", file=sys.stderr)
    if do_verify:
        problems = verify(out)
        for p in problems:
            print(f"CORRUPT {p}")
        print(f"verify: {len(m.shards) - len(problems)}/{len(m.shards)} shards match the manifest")
        return 1 if problems else 0
    return 0
