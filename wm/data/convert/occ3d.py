"""Occ3D-nuScenes as distributed (`<root>/annotations.json` + `<root>/gts/<scene>/<token>/labels.npz`)
planned into scenes for the conversion engine (wm/data/convert/engine.py; the CLI is tools/convert_occ3d.py),
and the reading of one labels.npz.

Masks: bit 0 (value 1) of the shard's mask field = Occ3D `mask_camera`, bit 1 (value 2) =
`mask_lidar` (MASK_BITS); `--mask` keeps both, one of them, or none (MASK_MODES).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from wm.data.convert.scene import (POSE_TOL, SceneSpec, check_length, check_rigid, check_times, labels, open_frame,
    pose_matrix, quat_to_matrix, visible)
from wm.data.shards import OCC3D_CLASSES, DatasetInfo
from wm.utils.errors import DataError, first_line

# the bits of the shard's mask field, and what --mask keeps of them
MASK_BITS = {"camera": 1, "lidar": 2}
MASK_MODES = {"both": ("camera", "lidar"), "camera": ("camera",), "lidar": ("lidar",), "none": ()}

# Occ3D-nuScenes facts (Tsinghua-MARS-Lab/Occ3D README, "Occ3D-nuScenes"): 200x200x16 voxels of
# 0.4 m over [-40, -40, -1, 40, 40, 5.4] m, classes 0-16 as nuScenes-lidarseg, 17 = free; keyframes
# at 2 Hz.
OCC3D_GRID = (200, 200, 16)
OCC3D_RANGE = (-40.0, -40.0, -1.0, 40.0, 40.0, 5.4)
OCC3D_VOXEL = (0.4, 0.4, 0.4)
OCC3D_HZ = 2.0

# ends of the prev/next chain: "" in nuScenes' own sample table; "EOF" in Occ3D's annotations.json
CHAIN_END = (None, "", "EOF")
QUAT_ORDERS = {"wxyz": (0, 1, 2, 3), "xyzw": (3, 0, 1, 2)}  # positions of w, x, y, z in the file
OCC3D_FIX = ("an Occ3D labels.npz is an .npz archive of semantics, mask_lidar and mask_camera: download it "
             "again")


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
    check_length(name, len(infos), str(ann_path))
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
    check_times(name, ts, ids, str(ann_path))
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


def read_frame(spec: SceneSpec, i: int, info: DatasetInfo) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Frame i of an Occ3D scene: its class ids and its mask bits (None without masks), checked."""
    path, where, bits = Path(spec.files[i]), f"scene {spec.name!r} frame {spec.ids[i]}", spec.opts["mask"]
    with open_frame(path, where, OCC3D_FIX) as z:
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
    occ = labels(arrays["semantics"], path, where, info)
    if not bits:
        return occ, None
    mask = np.zeros(info.grid, np.uint8)
    for b in bits:
        mask |= visible(arrays[f"mask_{b}"], path, where, info, f"mask_{b}").astype(np.uint8) * MASK_BITS[b]
    return occ, mask
