"""One scene to convert, as a converter plans it and a shard worker reads it: SceneSpec, the checks
of its poses and timestamps, and the opening of its frame files (a file is what its first bytes
say, whatever its name; every read error is one DataError naming the file and the frame).

No pickle is ever loaded: every `np.load` passes `allow_pickle=False`.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wm.data.shards import DatasetInfo
from wm.utils.errors import DataError, first_line

POSE_TOL = 1e-3  # |R^T R - I| and |det R - 1| allowed before a pose is "not a rigid transform"


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


def check_times(name: str, ts: np.ndarray, ids: list[str], where: str) -> None:
    d = np.diff(ts)
    if (d <= 0).any():
        i = int(np.argmax(d <= 0))
        raise DataError(f"{where}: scene {name!r}: frames {ids[i]} and {ids[i + 1]} have timestamps "
                        f"{int(ts[i])} and {int(ts[i + 1])} us: timestamps must increase")


def check_length(name: str, n: int, where: str) -> None:
    if n < 2:
        raise DataError(f"{where}: scene {name!r} has {n} frame{'s' if n != 1 else ''}; a window needs "
                        "at least 2 (remove the scene or pass --skip-bad)")


# ---------------------------------------------------------------------------------------------
# the scene and its frame files


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
def open_frame(path: Path, where: str, fix: str, mmap: bool = False):
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


def labels(a: np.ndarray, path: Path, where: str, info: DatasetInfo) -> np.ndarray:
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


def visible(a: np.ndarray, path: Path, where: str, info: DatasetInfo, what: str) -> np.ndarray:
    if tuple(a.shape) != info.grid:
        raise DataError(f"{path}: {where}: {what} of shape {tuple(a.shape)}, expected {info.grid}")
    if a.dtype.kind not in "biuf":
        raise DataError(f"{path}: {where}: {what} has dtype {a.dtype}, expected 0/1 values")
    return a != 0
