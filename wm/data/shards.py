"""The shard format: a data set is a folder with `manifest.json` and shards of two kinds.

- HDF5 shard (`*.h5`): one concatenated dataset per field, not one per scene. `occ` uint8
  (N, X, Y, Z), one frame per chunk, compressed; `mask` (optional, same); `pose` float64 (N, 4, 4)
  ego->global; `timestamp` int64 (N,) microseconds; `scene_offsets` int64 (S+1,); `scene_names`
  (S,). File attributes repeat grid, classes and encoding so a lone shard describes itself.
- memmap shard (a folder `*.mm`): the same arrays as `.npy` files read with
  `np.load(mmap_mode="r")`, plus `scene_names.json` and `attrs.json`. Uncompressed, for local
  NVMe where read speed is everything. The mask is stored as bits (`mask.bits.npy`, uint8
  (N, k, ceil(X*Y*Z/8))): one np.packbits plane (little bit order, over the flattened voxels) per
  flag bit the shard declares; the entry (and attrs.json) says `"mask_storage": "bits"` and
  `"mask_planes"` (the flag value of each plane, e.g. [1, 2] for Occ3D's camera | lidar). An
  entry without mask_storage is a `mask.npy` of uint8 bytes (older data sets). Readers
  return the same uint8 flag values either way.

`manifest.json` lists every shard (path, kind, split, scenes, frames, bytes, sha256) and the data
set's facts; its canonical sha256 is the data set's fingerprint. A data set may mix both kinds.

wm/data/writer.py writes shards. Readers check every field
against the manifest when opened and name the file and field in every error; HDF5 handles are
opened lazily in the process that reads (h5py handles do not survive fork), so a Dataset holding
shards can be handed to DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from wm.config.sections import COMPRESSIONS, KINDS
from wm.utils.atomic import write_bytes
from wm.utils.errors import DataError, first_line

FORMAT, VERSION = "wm-occ", 1
SUFFIX = {"hdf5": ".h5", "memmap": ".mm"}

PLUGIN_FILTERS = ("zstd", "lz4")


def _plugins(why: str):
    """Import hdf5plugin (registers zstd/lz4 with HDF5) or say how to get it."""
    try:
        import hdf5plugin
    except ImportError:
        raise DataError(f"{why} needs the hdf5plugin package: pip install hdf5plugin "
                        "(or use compression gzip1, readable by stock HDF5)") from None
    return hdf5plugin


def h5_compression(name: str, why: str = "") -> dict:
    """h5py create_dataset keyword arguments for compression `name`."""
    if name not in COMPRESSIONS:
        raise DataError(f"compression {name!r} must be one of {list(COMPRESSIONS)}")
    filt, level = COMPRESSIONS[name]
    if filt is None:
        return {}
    if filt in PLUGIN_FILTERS:
        hp = _plugins(why or f"compression {name}")
        return dict(hp.Zstd(clevel=level)) if filt == "zstd" else dict(hp.LZ4())
    return {"compression": filt, "compression_opts": level} if level is not None else {"compression": filt}


OCC3D_CLASSES = (
    "others", "barrier", "bicycle", "bus", "car", "construction_vehicle", "motorcycle",
    "pedestrian", "traffic_cone", "trailer", "truck", "driveable_surface", "other_flat",
    "sidewalk", "terrain", "manmade", "vegetation", "free",
)


@dataclass
class DatasetInfo:
    """The facts of a data set, written into manifest.json and into every shard's attributes."""

    grid: tuple[int, int, int]
    num_classes: int = 18
    free_class: int = 17
    class_names: tuple[str, ...] = OCC3D_CLASSES
    voxel_size: tuple[float, float, float] = (0.4, 0.4, 0.4)
    range: tuple[float, ...] = (-40.0, -40.0, -1.0, 40.0, 40.0, 5.4)
    frame_rate_hz: float = 2.0
    has_mask: bool = False
    # {class name: [r, g, b]} for the pictures (wm.data.viz.class_palette); optional, and left out of
    # manifest.json when empty: the fingerprint of a data set without colors has no such key
    class_colors: dict = field(default_factory=dict)
    # the classes that move, in the order tables list them (wm.data.stats.moving_classes); optional and
    # left out of manifest.json when empty, where nuScenes-named classes stand for them
    moving_classes: tuple[str, ...] = ()

    def __post_init__(self):
        self.grid = tuple(int(g) for g in self.grid)
        self.class_names = tuple(self.class_names)
        self.moving_classes = tuple(self.moving_classes)
        self.voxel_size = tuple(float(v) for v in self.voxel_size)
        self.range = tuple(float(v) for v in self.range)
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise DataError(f"grid {self.grid} must be three positive sizes")
        if not 2 <= self.num_classes <= 256:
            raise DataError(f"num_classes {self.num_classes} must be in [2, 256] (labels are uint8)")
        if not 0 <= self.free_class < self.num_classes:
            raise DataError(f"free_class {self.free_class} is not a class id below {self.num_classes}")
        if len(self.class_names) != self.num_classes:
            raise DataError(f"{len(self.class_names)} class names given for {self.num_classes} classes")
        check_moving(self.moving_classes, self.class_names, self.free_class, "moving_classes")

    def to_json(self) -> dict:
        d = json.loads(json.dumps(asdict(self)))
        for k in ("class_colors", "moving_classes"):
            if not d[k]:
                del d[k]
        return d


def check_moving(moving, class_names, free_class: int, where: str) -> None:
    """Moving classes must be distinct, non-free classes of the data set; DataError naming `where`."""
    for n in moving:
        if n not in class_names:
            raise DataError(f"{where}: {n!r} is not one of the classes {list(class_names)}")
        if class_names.index(n) == free_class:
            raise DataError(f"{where}: {n!r} is the free class; name classes of objects that move")
        if list(moving).count(n) > 1:
            raise DataError(f"{where}: {n!r} is named twice")


MASK_STORAGES = ("bytes", "bits")
MASK_FILES = {"bytes": "mask.npy", "bits": "mask.bits.npy"}


def mask_planes(mask_bits: dict | None) -> tuple[int, ...]:
    """The flag values stored as bit planes: every bit set in the declared `mask_bits` values
    ({name: value}), lowest first; a plain 0/1 mask (nothing declared) is the one plane 1."""
    union = 0
    for name, v in (mask_bits or {}).items():
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 255):
            raise DataError(f"mask_bits {name!r}: {v!r} must be a flag value in 1..255 (bits of the uint8 mask)")
        union |= v
    return tuple(1 << b for b in range(8) if union >> b & 1) or (1,)


def packed_bytes(grid) -> int:
    """Bytes of one bit plane of one frame."""
    return (int(np.prod(grid)) + 7) // 8


def pack_mask(mask: np.ndarray, planes: tuple[int, ...]) -> np.ndarray:
    """(n, X, Y, Z) uint8 flags -> (n, k, ceil(XYZ/8)) uint8: plane j holds the bit planes[j]."""
    flat = mask.reshape(len(mask), -1)
    return np.stack([np.packbits(flat & v, axis=1, bitorder="little") for v in planes], 1)


def unpack_mask(packed: np.ndarray, planes: tuple[int, ...], grid) -> np.ndarray:
    """pack_mask's inverse: (n, k, nb) uint8 planes -> (n, X, Y, Z) uint8 flags, a fresh array."""
    n, nb, voxels = packed.shape[0], packed.shape[2], int(np.prod(grid))
    if tuple(planes) == (1,):  # a 0/1 mask: numpy's unpacking is all there is to do
        return np.unpackbits(packed[:, 0], axis=1, count=voxels, bitorder="little").reshape(n, *grid)
    out = np.empty((n, nb), np.uint64)
    for i in range(n):  # a frame at a time: small temporaries are reused, fresh big ones page-fault
        for j, v in enumerate(planes):
            # 0/1 bytes as uint64 words: one shift moves 8 voxels' bits
            w = np.unpackbits(packed[i, j], bitorder="little").view(np.uint64)
            if v != 1:
                np.left_shift(w, np.uint64(v.bit_length() - 1), out=w)
            if j:
                np.bitwise_or(out[i], w, out=out[i])
            else:
                out[i] = w
    return np.ascontiguousarray(out.view(np.uint8).reshape(n, nb * 8)[:, :voxels]).reshape(n, *grid)


def shard_size(p: Path) -> int:
    """Bytes of a shard file, or of a memmap folder's files."""
    return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size


def shard_sha256(path: str | os.PathLike) -> str:
    """sha256 of a shard file, or of a memmap folder's files (name and bytes, in name order)."""
    p, h = Path(path), hashlib.sha256()
    files = sorted(f for f in p.iterdir()) if p.is_dir() else [p]
    for f in files:
        if p.is_dir():
            h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# manifest


MANIFEST = "manifest.json"


@dataclass
class Manifest:
    root: Path
    info: DatasetInfo
    shards: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **self.info.to_json(), "shards": self.shards}

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical manifest: which data (exactly) trained a model."""
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def split(self, split: str) -> list[dict]:
        entries = [s for s in self.shards if s["split"] == split]
        if not entries:
            present = sorted({s["split"] for s in self.shards})
            raise DataError(f"{self.root / MANIFEST}: no shards in split {split!r} "
                            f"(splits present: {', '.join(present) or 'none'})")
        return entries

    def write(self) -> None:
        """Atomically (re)write manifest.json."""
        write_bytes(self.root / MANIFEST, json.dumps(self.to_json(), indent=1) + "\n")


def load_manifest(root: str | os.PathLike) -> Manifest:
    root = Path(root)
    p = root / MANIFEST
    if not root.is_dir():
        raise DataError(f"data set folder {root} does not exist")
    if not p.is_file():
        raise DataError(f"{p} is missing: {root} is not a wm data set "
                        "(make one with tools/make_synthetic.py or tools/convert_*.py)")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{p}: not valid JSON ({e}); the manifest is damaged, re-create the data set") from None
    if not isinstance(d, dict):
        raise DataError(f"{p}: the top level is {_json_kind(d)}, expected an object of fields (format, version, "
                        "grid, ..., shards); the manifest is damaged, re-create the data set")
    if d.get("format") != FORMAT:
        raise DataError(f"{p}: field 'format' is {_short(d.get('format'))}, expected {FORMAT!r}")
    if d.get("version") != VERSION:
        raise DataError(f"{p}: field 'version' is {d.get('version')!r}; this wm reads version {VERSION}")
    keys = ("grid", "num_classes", "free_class", "class_names", "voxel_size", "range",
            "frame_rate_hz", "has_mask")
    missing = [k for k in keys + ("shards",) if k not in d]
    if missing:
        raise DataError(f"{p}: field '{missing[0]}' is missing")
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    expect = {"grid": ("a list of sizes", lambda v: isinstance(v, list) and all(number(x) for x in v)),
              "num_classes": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
              "free_class": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
              "class_names": ("a list of names", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
              "voxel_size": ("a list of numbers", lambda v: isinstance(v, list) and all(number(x) for x in v)),
              "range": ("a list of numbers", lambda v: isinstance(v, list) and all(number(x) for x in v)),
              "frame_rate_hz": ("a number", number),
              "has_mask": ("true or false", lambda v: isinstance(v, bool))}
    for k, (what, ok) in expect.items():
        if not ok(d[k]):
            raise DataError(f"{p}: field '{k}' is {d[k]!r}, expected {what}")
    colors = d.get("class_colors", {})
    if not (isinstance(colors, dict) and all(k in d["class_names"] and isinstance(v, list) and len(v) == 3
                                             and all(isinstance(x, int) and 0 <= x <= 255 for x in v)
                                             for k, v in colors.items())):
        raise DataError(f"{p}: field 'class_colors' is {colors!r}, expected {{class name: [r, g, b]}} (0-255)")
    moving = d.get("moving_classes", [])
    if not (isinstance(moving, list) and all(isinstance(x, str) for x in moving)):
        raise DataError(f"{p}: field 'moving_classes' is {moving!r}, expected a list of class names")
    try:
        info = DatasetInfo(**{k: d[k] for k in keys}, class_colors=colors, moving_classes=moving)
    except (TypeError, ValueError, DataError) as e:
        raise DataError(f"{p}: {e}") from None
    shards = d["shards"]
    if not isinstance(shards, list):
        raise DataError(f"{p}: field 'shards' is {shards!r}, expected a list of shard entries")
    for i, s in enumerate(shards):
        _check_entry(p, i, s)
    return Manifest(root, info, list(shards))


def _whole(least: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= least


# what each field of a shard entry must be: (said in the message, test)
ENTRY = {"path": ("a path inside the data set folder (a string)", lambda v: isinstance(v, str) and v.strip() != ""),
         "kind": (f"one of {list(KINDS)}", lambda v: isinstance(v, str) and v in KINDS),
         "split": ("a split name (a string)", lambda v: isinstance(v, str) and v != ""),
         "scenes": ("a whole number >= 1", _whole(1)),
         "frames": ("a whole number >= 1", _whole(1)),
         "bytes": ("a whole number >= 0", _whole(0)),
         "sha256": ("64 hex digits", lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-fA-F]{64}", v) is not None)}


FLAGS = tuple(1 << b for b in range(8))


def _planes_ok(v) -> bool:
    return (isinstance(v, list) and 1 <= len(v) <= 8 and all(isinstance(x, int) and not isinstance(x, bool)
                                                           and x in FLAGS for x in v) and v == sorted(set(v)))


# optional fields of a shard entry: absent means the mask is uint8 bytes (mask.npy, or HDF5's field)
ENTRY_MASK = {"mask_storage": (f"one of {list(MASK_STORAGES)}", lambda v: isinstance(v, str) and v in MASK_STORAGES),
              "mask_planes": ("a list of distinct flag values (1, 2, 4, ..., 128), lowest first", _planes_ok)}


def _check_entry(p: Path, i: int, s) -> None:
    """One shard entry of manifest.json has every field, each of its type: DataError naming the entry and field."""
    if not isinstance(s, dict):
        raise DataError(f"{p}: shards[{i}] is {_json_kind(s)}, expected an object with fields {', '.join(ENTRY)}")
    name = f"shards[{i}]" + (f" ({s['path']})" if ENTRY["path"][1](s.get("path")) else "")
    for k, (what, ok) in ENTRY.items():
        if k not in s:
            raise DataError(f"{p}: {name} has no field '{k}'; the manifest is damaged, re-create the data set")
        if not ok(s[k]):
            raise DataError(f"{p}: {name} field '{k}' is {_short(s[k])}, expected {what}; the manifest is "
                            "damaged, re-create the data set")
    for k, (what, ok) in ENTRY_MASK.items():
        if k in s and not ok(s[k]):
            raise DataError(f"{p}: {name} field '{k}' is {_short(s[k])}, expected {what}; the manifest is "
                            "damaged, re-create the data set")
    if s.get("mask_storage") == "bits" and (s["kind"] != "memmap" or "mask_planes" not in s):
        why = "has no field 'mask_planes'" if s["kind"] == "memmap" else "is an HDF5 shard (its mask is bytes)"
        raise DataError(f"{p}: {name} says mask_storage 'bits' but {why}; the manifest is damaged, "
                        "re-create the data set")


def _short(v, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def _json_kind(v) -> str:
    """How a JSON value is named in a message: its JSON type and (shortened) text."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")
    return kind if v is None else f"{kind} ({_short(v, 40)})"


def verify(root: str | os.PathLike) -> list[str]:
    """Recompute every shard's sha256 and size against the manifest. Returns the problems found
    (one line each, naming the file); an empty list means the data set is intact."""
    m = load_manifest(root)
    problems = []
    for s in m.shards:
        p = m.root / s["path"]
        if not p.exists():
            problems.append(f"{p}: missing (listed in {m.root / MANIFEST})")
            continue
        size = shard_size(p)
        if size != s["bytes"]:
            problems.append(f"{p}: {size} bytes, manifest says {s['bytes']} (truncated or replaced)")
            continue
        h = shard_sha256(p)
        if h != s["sha256"]:
            problems.append(f"{p}: sha256 {h[:12]}... does not match the manifest's {s['sha256'][:12]}...")
    return problems


# ---------------------------------------------------------------------------------------------
# reading


class Shard:
    """One shard, opened for reading: small fields (offsets, names, poses, timestamps) are loaded
    and checked at open; frames are read on demand. Picklable: the HDF5 handle is reopened lazily
    in whichever process reads."""

    def __init__(self, root: Path, entry: dict, info: DatasetInfo, cache_bytes: int = 1 << 20):
        self.path = Path(root) / entry["path"]
        self.kind, self.info, self.entry, self.cache_bytes = entry["kind"], info, entry, cache_bytes
        self._h5 = self._pid = None
        self._mm: dict[str, np.ndarray] = {}
        self._opened: dict = {}  # field: (shape, dtype) as checked at open; a reading process holds its file to it
        self.compression, self.needs_plugin = "none", False
        self.mask_storage = entry.get("mask_storage", "bytes")
        self.mask_planes = tuple(entry.get("mask_planes", ()))
        if not self.path.exists():
            raise DataError(f"shard {self.path} is missing (listed in {Path(root) / MANIFEST}); "
                            "restore it or re-create the data set")
        fields = ("occ", "mask") if info.has_mask else ("occ",)
        try:
            if self.kind == "hdf5":
                f = self._file()  # opening needs no filter; reading frames may
                self.compression = str(f.attrs.get("compression", "unknown"))
                if self.compression not in COMPRESSIONS:  # written elsewhere: offer every filter
                    try:
                        import hdf5plugin  # noqa: F401
                    except ImportError:
                        pass
                elif COMPRESSIONS[self.compression][0] in PLUGIN_FILTERS:
                    self.needs_plugin = True
                    _plugins(f"shard {self.path} (compressed with {self.compression})")
                for k in fields + ("pose", "timestamp", "scene_offsets", "scene_names"):
                    if k not in f:
                        raise DataError(f"shard {self.path}: field '{k}' is missing")
                big = {k: (f[k].shape, f[k].dtype) for k in fields}
                self.pose = f["pose"][:]
                self.timestamp = f["timestamp"][:]
                self.scene_offsets = f["scene_offsets"][:]
                self.scene_names = [n.decode() if isinstance(n, bytes) else str(n)
                                    for n in f["scene_names"][:]]
                self.close()  # a DataLoader worker opens its own handle
            else:
                arr = {k: self._npy(k) for k in fields + ("pose", "timestamp", "scene_offsets")}
                big = {k: (arr[k].shape, arr[k].dtype) for k in fields}
                # copies, not views of the mapped files: what is checked here is what every worker reads
                self.pose = np.array(arr["pose"])
                self.timestamp = np.array(arr["timestamp"])
                self.scene_offsets = np.array(arr["scene_offsets"])
                names = self.path / "scene_names.json"
                if not names.is_file():
                    raise DataError(f"shard {self.path}: field 'scene_names' is missing (scene_names.json)")
                try:
                    self.scene_names = json.loads(names.read_text())
                except json.JSONDecodeError as e:
                    raise DataError(f"shard {names}: not valid JSON ({e})") from None
                self._mm = {}  # re-mapped on demand, in the reading process
        except DataError:
            raise
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"shard {self.path}: cannot be read ({first_line(e)}); it is truncated or "
                            "corrupt: run tools/inspect_data.py --verify and re-create it") from None
        self._check(big)
        self._opened = big

    # -- checks at open: cheap, whole-shard, before anything trains
    def _check(self, big: dict) -> None:
        where, n = f"shard {self.path}", None
        for k, (shape, dtype) in big.items():
            if dtype != np.uint8:
                raise DataError(f"{where}: field '{k}' has dtype {dtype}, expected uint8")
            if k == "mask" and self._bits:
                want = (len(self.mask_planes), packed_bytes(self.info.grid))
                if tuple(shape[1:]) != want:
                    raise DataError(f"{where}: field 'mask' ({self._file_of(k)}) frames are {tuple(shape[1:])}, "
                                    f"expected {want} ({want[0]} bit planes of the grid {self.info.grid}); "
                                    "the shard does not match its manifest entry: re-create the data set")
            elif tuple(shape[1:]) != self.info.grid:
                raise DataError(f"{where}: field '{k}' frames are {tuple(shape[1:])}, but the manifest "
                                f"grid is {self.info.grid}")
            n = shape[0] if n is None else n
            if shape[0] != n:
                raise DataError(f"{where}: field '{k}' has {shape[0]} frames, 'occ' has {n}")
        if self.pose.shape != (n, 4, 4):
            raise DataError(f"{where}: field 'pose' has shape {self.pose.shape}, expected ({n}, 4, 4)")
        if not np.isfinite(self.pose).all():
            bad = int(np.argwhere(~np.isfinite(self.pose).reshape(n, -1).all(1))[0, 0])
            raise DataError(f"{where}: field 'pose' is not finite at frame {bad}")
        if self.timestamp.shape != (n,):
            raise DataError(f"{where}: field 'timestamp' has shape {self.timestamp.shape}, expected ({n},)")
        o = self.scene_offsets
        if o.ndim != 1 or len(o) < 2 or o[0] != 0 or o[-1] != n or not (np.diff(o) > 0).all():
            raise DataError(f"{where}: field 'scene_offsets' must rise strictly from 0 to the frame "
                            f"count {n}, got {o.tolist()[:8]}{'...' if len(o) > 8 else ''}")
        if len(self.scene_names) != len(o) - 1:
            raise DataError(f"{where}: field 'scene_names' has {len(self.scene_names)} names for "
                            f"{len(o) - 1} scenes")
        if (self.entry["frames"], self.entry["scenes"]) != (n, len(o) - 1):
            raise DataError(f"{where}: has {n} frames in {len(o) - 1} scenes but the manifest says "
                            f"{self.entry['frames']} in {self.entry['scenes']}; the manifest is stale")

    @property
    def num_frames(self) -> int:
        return int(self.scene_offsets[-1])

    def _file(self):
        import h5py

        if self._h5 is None or self._pid != os.getpid():
            if self.needs_plugin:
                _plugins(f"shard {self.path} (compressed with {self.compression})")
            self._still_there()
            # locking=False: read-only shards on network filesystems (and h5py files across fork).
            self._h5 = h5py.File(self.path, "r", rdcc_nbytes=self.cache_bytes, locking=False)
            self._pid = os.getpid()
            for k in self._opened:
                self._as_opened(k, self._h5[k].shape, self._h5[k].dtype)
        return self._h5

    def _still_there(self) -> None:
        """A reading process (a DataLoader worker) opens the shard itself, later than the checks at open."""
        if self._opened and not self.path.exists():
            raise DataError(f"shard {self.path} is gone: it was there when the data set was opened (deleted "
                            "or moved while in use); restore it, or re-create the data set and start again")

    def _as_opened(self, field: str, shape, dtype) -> None:
        was = self._opened.get(field)
        if was is not None and (tuple(shape), dtype) != (tuple(was[0]), was[1]):
            raise DataError(f"shard {self.path}: field '{field}' is now {dtype}{tuple(shape)}, it was "
                            f"{was[1]}{tuple(was[0])} when the data set was opened (the shard was replaced while "
                            "in use); start again, so that it is checked")

    @property
    def _bits(self) -> bool:
        return self.kind == "memmap" and self.mask_storage == "bits"

    def _file_of(self, k: str) -> str:
        return MASK_FILES[self.mask_storage] if k == "mask" else f"{k}.npy"

    def _npy(self, k: str) -> np.ndarray:
        name = self._file_of(k)
        p = self.path / name
        if not p.is_file():
            raise DataError(f"shard {self.path}: field '{k}' is missing ({name})")
        try:
            return np.load(p, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"shard {self.path}: field '{k}' ({name}) cannot be read ({first_line(e)}); "
                            "it is truncated or corrupt: run tools/inspect_data.py --verify and "
                            "re-create it") from None

    def read(self, field: str, start: int, stop: int, step: int = 1) -> np.ndarray:
        """Frames [start:stop:step] of `occ` or `mask` as a fresh uint8 array."""
        if field == "mask" and not self.info.has_mask:
            raise DataError(f"shard {self.path}: the data set has no visibility masks (field 'mask')")
        try:
            if self.kind == "hdf5":
                try:
                    return self._file()[field][start:stop:step]
                except OSError as e:
                    raise DataError(self._damaged(field, start, stop, step, e)) from None
            if field not in self._mm:
                self._still_there()
                a = self._npy(field)
                self._as_opened(field, a.shape, a.dtype)
                self._mm[field] = a
            if field == "mask" and self._bits:
                return unpack_mask(self._mm[field][start:stop:step], self.mask_planes, self.info.grid)
            return np.array(self._mm[field][start:stop:step])
        except DataError:
            raise
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"shard {self.path}: field '{field}' frames {start}:{stop} cannot be read "
                            f"({first_line(e)}); the shard is corrupt: run tools/inspect_data.py "
                            "--verify and re-create it") from None

    def _damaged(self, field: str, start: int, stop: int, step: int, e: OSError) -> str:
        """The one line for an HDF5 read that failed: the first frame that fails on its own."""
        ds = self._file()[field]
        for i in range(start, min(stop, ds.shape[0]), step):
            try:
                ds[i]
            except OSError as err:
                what = f"is damaged: its chunk fails its fletcher32 checksum or decompression ({first_line(err)})"
                return (f"shard {self.path}: field '{field}' frame {i} {what}; restore the shard from a copy "
                        "or re-create it (tools/inspect_data.py --verify checks a whole data set)")
        return (f"shard {self.path}: field '{field}' frames {start}:{stop} cannot be read ({first_line(e)}); "
                "the shard is corrupt: run tools/inspect_data.py --verify and re-create it")

    def close(self) -> None:
        if self._h5 is not None:
            try:
                self._h5.close()
            except Exception:
                pass
        self._h5 = self._pid = None
        self._mm = {}

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_h5"] = d["_pid"] = None
        d["_mm"] = {}
        return d


def open_split(root: str | os.PathLike, split: str, cache_bytes: int = 1 << 20) -> tuple[Manifest, list[Shard]]:
    """The manifest and the opened (checked) shards of one split."""
    m = load_manifest(root)
    return m, [Shard(m.root, e, m.info, cache_bytes) for e in m.split(split)]
