"""The conversion engine: scenes planned by a reader (wm/data/convert/occ3d.py, wm/data/convert/frames.py)
into a wm data set (shards + manifest.json); tools/convert_occ3d.py and tools/convert_frames.py are
its CLIs.

`convert` plans shards of K scenes per split in a fixed order (the readers have already checked
everything that can be checked without reading frames: pose rigidity, timestamps, files on disk,
scene length), then reads frames and writes shards in parallel worker processes. It owns the output
folder through its lock (wm.utils.runlock.CONVERSION) and is resumable: a shard is final only once
ShardWriter renames it into place, so on a re-run every shard already under its final name that
holds exactly the planned scenes is kept (not rewritten), leftover temporaries are removed, and the
manifest is written at the end from all shards. `conversion.json` beside the manifest records the
options; a re-run with different options is refused (it would mix two data sets). `skipped.json`
lists the scenes `--skip-bad` left out.

**Visibility masks.** The shard format has one uint8 `mask` field. Converters store bit flags in it:
bit 0 (value 1) = visible to the cameras (Occ3D `mask_camera`, or "visible" for own recordings),
bit 1 (value 2) = observed by the lidar (Occ3D `mask_lidar`). `--mask camera` or `--mask lidar`
stores just that bit, so `mask != 0` (what wm.data.windows / wm.evaluation.metrics use with data.use_mask) is exactly
that mask; `--mask both` (the default) stores both bits, and `mask != 0` is then their union (select
one with `mask & 1` / `mask & 2`). Every manifest shard entry says which bits it holds:
`"mask_bits": {"camera": 1, "lidar": 2}`. Memmap shards store just those bits, one bit plane each
(wm/data/shards.py); a mask value outside them is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from wm.config.sections import COMPRESSIONS, DEFAULT_COMPRESSION
from wm.data.convert import frames as convert_frames, occ3d as convert_occ3d
from wm.data.convert.scene import SceneSpec
from wm.data.shards import MANIFEST, SUFFIX, DatasetInfo, Manifest, shard_sha256, verify
from wm.data.writer import ShardWriter
from wm.utils import runlock
from wm.utils.atomic import clean_temps, write_bytes
from wm.utils.errors import DataError, first_line

CONVERSION = "conversion.json"
SKIPPED = "skipped.json"
READERS = {"occ3d": convert_occ3d.read_frame, "frames": convert_frames.read_frame}  # SceneSpec.reader


def read_scene(spec: SceneSpec, info: DatasetInfo) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The scene's occupancy (n, X, Y, Z) uint8 and mask (or None), every frame checked."""
    read = READERS[spec.reader]
    n = len(spec.files)
    occ = np.empty((n, *info.grid), np.uint8)
    mask = np.zeros((n, *info.grid), np.uint8) if info.has_mask else None
    for i in range(n):
        occ[i], m = read(spec, i, info)
        if mask is not None:
            mask[i] = m
    return occ, mask


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
    with ShardWriter(path, kind, info, compression=compression, overwrite=True,
                     mask_bits=extra.get("mask_bits")) as w:
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


def _shard_contents(path: Path, kind: str, info: DatasetInfo,
                    compression: str) -> Optional[tuple[list[str], int, dict]]:
    """(scene names, frames, its mask storage fields for the entry) of a finished shard if it was
    written with these settings, else None."""
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
        storage = {k: a[k] for k in ("mask_storage", "mask_planes") if k in a and info.has_mask}
        return (list(names), frames, storage) if same else None
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
                                       "bytes": _size(p), "sha256": shard_sha256(p), **got[2], "split": t.split,
                                       **extra}
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
