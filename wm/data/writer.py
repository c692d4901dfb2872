"""Writing shards (the format: wm/data/shards.py) scene by scene: a ShardWriter streams them (memory holds one
scene) into a temporary name and renames into place when complete, so a crash never leaves a half
shard under a final name; it checks every scene against the data set's description first."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import numpy as np

from wm.config.sections import DEFAULT_COMPRESSION, KINDS
from wm.data.shards import (FORMAT, MASK_FILES, VERSION, DatasetInfo, h5_compression, mask_planes, pack_mask,
    packed_bytes, shard_sha256, shard_size)
from wm.utils.atomic import publish, tmp_path
from wm.utils.errors import DataError

__all__ = ["ShardWriter"]


def _check_mask_values(mask: np.ndarray, planes: tuple[int, ...], declared: Optional[dict], where: str) -> None:
    """Every mask value is a combination of the declared flag bits (what bit planes can hold)."""
    union = sum(planes)
    outside = np.bitwise_and(mask, np.uint8(255 ^ union))
    if not outside.any():
        return
    frame = int(np.argmax(outside.reshape(len(mask), -1).any(1)))
    value = int(mask[frame].flat[int(np.argmax(outside[frame].reshape(-1) != 0))])
    said = f"the declared mask_bits {declared}" if declared else "a 0/1 mask (no mask_bits declared)"
    raise DataError(f"{where}: mask value {value} at frame {frame} is outside {said}, whose flag values are "
                    f"{list(planes)}; write only those bits, or declare every flag bit the masks use in mask_bits")


def _check_scene(info: DatasetInfo, name: str, occ, pose, timestamp, mask, path: Path) -> None:
    where = f"{path}: scene {name!r}"
    if not isinstance(occ, np.ndarray) or occ.dtype != np.uint8:
        raise DataError(f"{where}: occ must be a uint8 array, got {getattr(occ, 'dtype', type(occ))}")
    if occ.ndim != 4 or tuple(occ.shape[1:]) != info.grid:
        raise DataError(f"{where}: occ shape {occ.shape}, expected (frames, {', '.join(map(str, info.grid))})")
    n = occ.shape[0]
    if n < 1:
        raise DataError(f"{where}: has no frames")
    top = int(occ.max())
    if top >= info.num_classes:
        raise DataError(f"{where}: class id {top} >= num_classes {info.num_classes}")
    pose = np.asarray(pose)
    if pose.shape != (n, 4, 4):
        raise DataError(f"{where}: pose shape {pose.shape}, expected ({n}, 4, 4)")
    if not np.isfinite(pose).all():
        bad = int(np.argwhere(~np.isfinite(pose).reshape(n, -1).all(1))[0, 0])
        raise DataError(f"{where}: pose of frame {bad} is not finite")
    ts = np.asarray(timestamp)
    if ts.shape != (n,):
        raise DataError(f"{where}: timestamp shape {ts.shape}, expected ({n},)")
    if ts.dtype.kind not in "iu" and not (ts.dtype.kind == "f" and np.isfinite(ts).all()
                                          and (ts == np.round(ts)).all()):
        raise DataError(f"{where}: timestamps must be whole microseconds (int64), got {ts.dtype} "
                        f"{ts[:3].tolist()}...")
    if info.has_mask:
        if mask is None:
            raise DataError(f"{where}: the data set has masks but this scene has none")
        if mask.shape != occ.shape or mask.dtype != np.uint8:
            raise DataError(f"{where}: mask {mask.dtype}{mask.shape} must be uint8 of occ's shape {occ.shape}")
    elif mask is not None:
        raise DataError(f"{where}: a mask was given but the data set has has_mask=False")


class _NpyAppender:
    """Streams frames into a `.npy` file whose frame count is known only at the end.

    The header is written last into space reserved at the front (the .npy format allows header
    padding), so writing never holds more than one scene in memory.
    """

    HEADER = 256  # bytes reserved; a multiple of 64 as the format asks

    def __init__(self, path: Path, dtype, frame_shape: tuple):
        self.path, self.dtype, self.frame_shape, self.n = path, np.dtype(dtype), tuple(frame_shape), 0
        self.f = open(path, "wb")
        self.f.write(b"\0" * self.HEADER)

    def append(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        self.f.write(a.tobytes())
        self.n += a.shape[0]

    def close(self) -> None:
        d = {"descr": self.dtype.str, "fortran_order": False, "shape": (self.n, *self.frame_shape)}
        text = repr(d).encode("latin1")
        pad = self.HEADER - 10 - len(text) - 1
        if pad < 0:
            raise DataError(f"{self.path}: shape {d['shape']} does not fit the npy header")
        self.f.seek(0)
        # format 1.0: magic, version, little-endian uint16 header length, header padded with spaces
        self.f.write(b"\x93NUMPY\x01\x00" + (self.HEADER - 10).to_bytes(2, "little")
                     + text + b" " * pad + b"\n")
        _flush(self.f)
        self.f.close()


def _flush(f) -> None:
    f.flush()
    os.fsync(f.fileno())


class ShardWriter:
    """Writes one shard scene by scene; `close()` renames it into place and returns its manifest
    entry. Used as a context manager, an exception removes the temporary and writes nothing."""

    def __init__(self, path: str | os.PathLike, kind: str, info: DatasetInfo,
                 compression: str = DEFAULT_COMPRESSION, overwrite: bool = False, checksum: bool = True,
                 mask_bits: Optional[dict] = None):
        """mask_bits: {name: flag value} the masks use (the manifest entry's mask_bits, e.g. Occ3D's
        {"camera": 1, "lidar": 2}); None for a 0/1 mask. A memmap shard stores one bit plane per
        flag bit and refuses other values; HDF5 stores the uint8 bytes (checked where declared)."""
        if kind not in KINDS:
            raise DataError(f"shard kind {kind!r} must be one of {list(KINDS)}")
        comp = h5_compression(compression, f"writing {path} with {compression}") if kind == "hdf5" else {}
        self.path, self.kind, self.info, self.compression = Path(path), kind, info, compression
        self.mask_bits = dict(mask_bits) if mask_bits else None
        try:
            self.planes = mask_planes(self.mask_bits)
        except DataError as e:
            raise DataError(f"{self.path}: {e}") from None
        # what the manifest entry and attrs.json say of the mask's storage (nothing: uint8 bytes)
        self.mask_entry = ({"mask_storage": "bits", "mask_planes": list(self.planes)}
                           if kind == "memmap" and info.has_mask else {})
        if self.path.exists() and not overwrite:
            raise DataError(f"{self.path} already exists; choose another folder or remove it first")
        self.tmp = tmp_path(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"cannot create the folder for {self.path} ({e})") from None
        _remove(self.tmp)
        self.closed = False
        self.offsets, self.names, self.n = [0], [], 0
        if kind == "hdf5":
            import h5py

            X, Y, Z = info.grid
            self.h5 = h5py.File(self.tmp, "w", libver="v110")
            for k, v in _attrs(info).items():
                self.h5.attrs[k] = v
            self.h5.attrs["compression"] = compression

            def mk(name, shape, dtype, chunks=None, **kw):
                return self.h5.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape),
                                              dtype=dtype, chunks=chunks or (1, *shape),
                                              track_times=False, fletcher32=checksum, **kw)

            # One frame per chunk: a random window reads exactly its frames; window-sized chunks
            # rarely align with random windows and read ~2x slower. Every chunk carries HDF5's
            # fletcher32 checksum (checked by HDF5 on every read: a damaged chunk is an error
            # naming its frame, never silently wrong voxels; its read cost is in bench_data).
            self.ds = {"occ": mk("occ", (X, Y, Z), np.uint8, **comp),
                       "pose": mk("pose", (4, 4), np.float64, chunks=(1024, 4, 4)),
                       "timestamp": mk("timestamp", (), np.int64, chunks=(1024,))}
            if info.has_mask:
                self.ds["mask"] = mk("mask", (X, Y, Z), np.uint8, **comp)
        else:
            self.tmp.mkdir(parents=True)
            self.app = {"occ": _NpyAppender(self.tmp / "occ.npy", np.uint8, info.grid),
                        "pose": _NpyAppender(self.tmp / "pose.npy", np.float64, (4, 4)),
                        "timestamp": _NpyAppender(self.tmp / "timestamp.npy", np.int64, ())}
            if info.has_mask:
                self.app["mask"] = _NpyAppender(self.tmp / MASK_FILES["bits"], np.uint8,
                                                (len(self.planes), packed_bytes(info.grid)))

    def add_scene(self, name: str, occ: np.ndarray, pose: np.ndarray, timestamp: np.ndarray,
                  mask: Optional[np.ndarray] = None) -> None:
        _check_scene(self.info, name, occ, pose, timestamp, mask, self.path)
        arrays = {"occ": occ, "pose": np.asarray(pose, np.float64),
                  "timestamp": np.asarray(timestamp, np.int64)}
        if mask is not None:
            if self.kind == "memmap" or self.mask_bits:
                _check_mask_values(mask, self.planes, self.mask_bits, f"{self.path}: scene {name!r}")
            arrays["mask"] = pack_mask(mask, self.planes) if self.kind == "memmap" else mask
        n = occ.shape[0]
        if self.kind == "hdf5":
            for k, a in arrays.items():
                d = self.ds[k]
                d.resize(self.n + n, axis=0)
                d[self.n:self.n + n] = a
        else:
            for k, a in arrays.items():
                self.app[k].append(a)
        self.n += n
        self.offsets.append(self.n)
        self.names.append(str(name))

    def close(self) -> dict:
        """Finish, move into place, and return the manifest entry (without split)."""
        if not self.names:
            self.abort()
            self.closed = True
            raise DataError(f"{self.path}: no scenes were added; refusing to write an empty shard")
        offsets = np.asarray(self.offsets, np.int64)
        if self.kind == "hdf5":
            import h5py

            self.h5.create_dataset("scene_offsets", data=offsets, track_times=False)
            self.h5.create_dataset("scene_names", data=np.array(self.names, dtype=object),
                                   dtype=h5py.string_dtype(), track_times=False)
            self.h5.flush()
            self.h5.close()
            with open(self.tmp, "rb+") as f:
                _flush(f)
        else:
            for a in self.app.values():
                a.close()
            np.save(self.tmp / "scene_offsets.npy", offsets)
            (self.tmp / "scene_names.json").write_text(json.dumps(self.names))
            attrs = {**_attrs(self.info), **self.mask_entry}
            (self.tmp / "attrs.json").write_text(json.dumps(attrs, indent=1, sort_keys=True))
        if self.path.exists():  # overwrite=True
            _remove(self.path)
        publish(self.tmp, self.path)
        self.closed = True
        return {"path": self.path.name, "kind": self.kind, "scenes": len(self.names),
                "frames": self.n, "bytes": shard_size(self.path), "sha256": shard_sha256(self.path),
                **self.mask_entry}

    def abort(self) -> None:
        if self.kind == "hdf5":
            try:
                self.h5.close()
            except Exception:
                pass
        else:
            for a in self.app.values():
                a.f.close()
        _remove(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif not self.closed:  # a programming error: say so rather than leave a temp behind
            self.abort()
            raise RuntimeError(f"ShardWriter for {self.path} left without close(); nothing was written")


def _attrs(info: DatasetInfo) -> dict:
    return {"format": FORMAT, "version": VERSION, "grid": list(info.grid),
            "num_classes": info.num_classes, "free_class": info.free_class,
            "class_names": json.dumps(list(info.class_names)), "encoding": "uint8 class id per voxel",
            "voxel_size": list(info.voxel_size), "range": list(info.range),
            "frame_rate_hz": info.frame_rate_hz, "has_mask": info.has_mask}


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


