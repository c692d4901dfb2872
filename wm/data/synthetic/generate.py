"""The built-in data set: procedural scenes, deterministic from a seed, written as shards and cached.
Three styles (`synthetic.style`): "occ3d" (wm/data/synthetic/occ3d.py, Occ3D-like driving scenes, the
demo's), "blocks" (wm/data/synthetic/blocks.py, the first generator's solid columns), both with Occ3D's
classes and what their scenes share in wm/data/synthetic/road.py, and "airside" (wm/data/synthetic/airside.py,
airport aprons with their own 17 classes: a second domain to fine-tune onto)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import numpy as np

from wm.config.sections import STYLES
from wm.config.sections import DEFAULT_COMPRESSION
from wm.data.shards import DatasetInfo, Manifest, load_manifest, packed_bytes
from wm.data.synthetic import airside as synthetic_airside, blocks as synthetic_blocks, occ3d as synthetic_occ3d
from wm.data.synthetic.road import DT
from wm.data.writer import ShardWriter
from wm.utils.atomic import free_space, mib, tmp_path
from wm.utils.errors import ConfigError, DataError

RANGE = (-40.0, -40.0, -1.0, 40.0, 40.0, 5.4)


def dataset_info(grid: tuple[int, int, int], with_mask: bool, style: str = "occ3d") -> DatasetInfo:
    X, Y, Z = grid
    # the road styles keep Occ3D's classes and a manifest without class keys (so their fingerprints hold)
    classes = {} if style != "airside" else dict(
        num_classes=len(synthetic_airside.AIRSIDE_CLASSES), free_class=synthetic_airside.AIRSIDE_FREE,
        class_names=synthetic_airside.AIRSIDE_CLASSES, moving_classes=synthetic_airside.AIRSIDE_MOVING,
        class_colors=synthetic_airside.AIRSIDE_COLORS)
    return DatasetInfo(grid=tuple(grid), voxel_size=(80.0 / X, 80.0 / Y, 6.4 / Z), range=RANGE,
                       frame_rate_hz=1 / DT, has_mask=with_mask, **classes)


# the cache key's generator number per style; occ3d and blocks keep theirs, so their caches keep their names
GENERATOR = {"blocks": 1, "occ3d": 2, "airside": 3}


def make_scene(seed: int, index: int, grid: tuple[int, int, int], frames: int,
               with_mask: bool = True, split_id: int = 0, style: str = "blocks") -> dict:
    """One scene: dict(name, occ uint8 (T,X,Y,Z), pose float64 (T,4,4), timestamp int64 (T,), mask)."""
    if style == "blocks":
        return synthetic_blocks.make_scene(seed, index, grid, frames, with_mask, split_id)
    if style == "airside":
        return synthetic_airside.make_scene(seed, index, grid, frames, with_mask, split_id)
    if style != "occ3d":
        raise DataError(f"synthetic style {style!r} must be one of {list(STYLES)}")
    return synthetic_occ3d.make_scene(seed, index, grid, frames, with_mask, split_id)


def write_synthetic(out: str | os.PathLike, train_scenes: int, val_scenes: int, frames: int = 40,
                    grid=(64, 64, 8), seed: int = 0, kind: str = "hdf5",
                    compression: str = DEFAULT_COMPRESSION, with_mask: bool = True,
                    scenes_per_shard: int = 8, progress: bool = False, style: str = "blocks",
                    workers: int | None = None) -> Manifest:
    """Write a synthetic data set (train + val splits) to folder `out`.

    kind: "hdf5", "memmap", or "mixed" (shards alternate between the two); style: see STYLES;
    workers: processes that generate scenes (None: default_workers)."""
    out = Path(out)
    if (out / "manifest.json").exists():
        raise DataError(f"{out} already holds a data set; choose another folder or remove it first")
    if style not in STYLES:
        raise DataError(f"synthetic style {style!r} must be one of {list(STYLES)}")
    if kind not in ("hdf5", "memmap", "mixed"):
        raise DataError(f"kind {kind!r} must be hdf5, memmap or mixed")
    if frames < 2 or train_scenes < 1 or val_scenes < 0:
        raise DataError("need frames >= 2, train_scenes >= 1, val_scenes >= 0")
    out.mkdir(parents=True, exist_ok=True)
    info = dataset_info(tuple(grid), with_mask, style)
    jobs = [(seed, i, tuple(grid), frames, with_mask, split_id, style)
            for split_id, n in enumerate((train_scenes, val_scenes)) for i in range(n)]
    if workers is None:
        workers = default_workers(len(jobs) * frames * int(np.prod(grid)))
    entries, k = [], 0
    with _scenes(jobs, workers) as scenes:  # in job order, whatever the workers
        for split_id, (split, n) in enumerate((("train", train_scenes), ("val", val_scenes))):
            for first in range(0, n, scenes_per_shard):
                kk = kind if kind != "mixed" else ("hdf5", "memmap")[k % 2]
                name = f"{split}-{first // scenes_per_shard:05d}" + {"hdf5": ".h5", "memmap": ".mm"}[kk]
                with ShardWriter(out / name, kk, info, compression=compression) as w:
                    for i in range(first, min(n, first + scenes_per_shard)):
                        s = next(scenes)
                        w.add_scene(s["name"], s["occ"], s["pose"], s["timestamp"], s["mask"])
                        if progress:
                            print(f"\r{split}: scene {i + 1}/{n}", end="", file=sys.stderr, flush=True)
                    entry = w.close()
                entries.append({**entry, "split": split})
                k += 1
            if progress and n:
                print(file=sys.stderr)
    m = Manifest(out, info, entries)
    m.write()
    return m


# below this many voxel-frames in all (about 18 s of one 2-core EPYC's core) one process is enough
PARALLEL_VOXELS = 2 ** 28


def default_workers(voxel_frames: int) -> int:
    """Processes that generate scenes: one per core (at most 16, each holding a scene in memory) for a
    large data set, one for a small one. Every scene is seeded by its own index, so the bytes are the
    same with any number."""
    if voxel_frames < PARALLEL_VOXELS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 16))


def _scene_worker(jobs: list[tuple], out, close: list) -> None:
    """One generating process: make_scene(*job) for each of its jobs in order, each sent to the parent
    (the pipe holds about one scene, so a worker runs at most a scene ahead of the writer)."""
    import signal

    # the parent alone decides what a group's SIGTERM or Ctrl-C does (as for the DataLoader's workers)
    # and kills its workers when it stops; a killed parent leaves them a pipe without reader: they exit
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for c in close:  # the read ends this process inherited: else a pipe never loses its last reader
        c.close()
    for job in jobs:
        try:
            scene = make_scene(*job)
        except Exception as e:  # sent on and raised in the parent, where the writer stops
            scene = e if isinstance(e, DataError) else DataError(f"synthetic scene {job[1]}: {type(e).__name__}: {e}")
        try:
            out.send(scene)
        except (BrokenPipeError, ConnectionResetError):
            return  # the parent is gone
        if isinstance(scene, Exception):
            return


def _received(conn, proc) -> dict:
    try:
        scene = conn.recv()
    except EOFError:
        proc.join(1)
        raise DataError(f"the process generating synthetic scenes (pid {proc.pid}) ended without its scene "
                        f"(exit code {proc.exitcode}: killed, out of memory?); try fewer processes "
                        f"(tools/make_synthetic.py --workers 1)") from None
    if isinstance(scene, Exception):
        raise scene
    return scene


@contextlib.contextmanager
def _scenes(jobs: list[tuple], workers: int):
    """An iterator of make_scene(*job) for each job in order, on `workers` processes (job i on process
    i mod workers), which are killed when the block ends."""
    if workers <= 1 or len(jobs) <= 1:
        yield (make_scene(*job) for job in jobs)
        return
    import multiprocessing as mp

    ctx, n = mp.get_context(), min(workers, len(jobs))
    procs, conns = [], []
    try:
        for w in range(n):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_scene_worker, args=(jobs[w::n], writer, conns + [reader]), daemon=True,
                            name=f"wm-synthetic-{w}")
            p.start()
            writer.close()
            procs.append(p)
            conns.append(reader)
        yield (_received(conns[i % n], procs[i % n]) for i in range(len(jobs)))
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
        for c in conns:
            c.close()


def default_cache_dir() -> Path:
    return Path(os.environ.get("WM_CACHE") or Path.home() / ".cache" / "wm")


def ensure_synthetic(cfg, grid, log=print) -> Path:
    """The synthetic data set for `cfg` (a SyntheticConfig) and `grid`, generated once into
    <cache>/synthetic-<hash of the settings> and reused after. Generation writes into a temporary
    folder and renames it, so an interrupted run never leaves a half data set behind; it first removes
    the temporaries of killed generations and refuses a set that would not fit (check_resources)."""
    key = {"train_scenes": cfg.train_scenes, "val_scenes": cfg.val_scenes, "frames": cfg.frames,
           "seed": cfg.seed, "format": cfg.format, "compression": cfg.compression,
           "with_mask": cfg.with_mask, "grid": list(grid), "generator": GENERATOR.get(cfg.style, 1)}
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    path = base / f"synthetic-{h}"
    if (path / "manifest.json").is_file():
        load_manifest(path)  # refuses a damaged one with a clear line
        return path
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the synthetic data cache {base} ({e}); "
                        "set synthetic.cache_dir or $WM_CACHE to a writable folder") from None
    remove_leftovers(base, log)
    workers = check_resources(cfg, grid, base, log)
    tmp = tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"generating synthetic {cfg.style} scenes ({cfg.train_scenes}+{cfg.val_scenes} scenes x {cfg.frames} "
        f"frames, grid {'x'.join(map(str, grid))}) into {path} (once)")
    owner = owner_file(tmp)
    try:
        owner.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        write_synthetic(tmp, cfg.train_scenes, cfg.val_scenes, cfg.frames, grid, cfg.seed,
                        cfg.format, cfg.compression, cfg.with_mask, style=cfg.style, workers=workers)
        try:
            os.replace(tmp, path)
        except OSError:
            if not (path / "manifest.json").is_file():
                raise
            # another process (another rank) finished the same data set first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
            load_manifest(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        owner.unlink(missing_ok=True)
    return Path(path)


# ---------------------------------------------------------------------------------------------
# the cache folder: leftovers of killed generations, and what a generation needs


# tmp_path() of a synthetic-<hash> folder, and beside it while it is generated its owner file
_LEFTOVER = re.compile(r"(\.synthetic-[0-9a-f]+\.tmp-(\d+))(\.owner)?")


def owner_file(tmp: Path) -> Path:
    """Beside a folder being generated: {"host", "pid"} of the process generating it."""
    return tmp.with_name(tmp.name + ".owner")


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(base: Path, log=print) -> list[Path]:
    """Remove the temporary folders of generations killed mid-way (kill -9, out of memory) from the
    cache folder `base`, one line each: those whose process is gone. One of a live process (a
    generation in progress) is left, and so is one another host is generating (a shared cache
    folder), whose process this host cannot see."""
    removed, host = [], socket.gethostname()
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return removed
    temps = {m.group(1): m.group(2) for m in map(_LEFTOVER.fullmatch, names) if m}
    for name, pid in temps.items():
        p, owner = base / name, owner_file(base / name)
        try:
            who = json.loads(owner.read_text())
        except (OSError, ValueError):
            who = {}  # killed before it was written: the name's pid decides
        if (isinstance(who, dict) and who.get("host", host) != host) or _pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(OSError):
            owner.unlink(missing_ok=True)
        if not p.exists():
            log(f"removed {p}: left by a synthetic data generation whose process {pid} is gone")
            removed.append(p)
    return removed


def scene_memory(grid, frames: int, with_mask: bool, style: str) -> int:
    """Bytes a process generating one scene holds at its peak, as measured with tracemalloc: the
    scene's arrays, per-column maps of the road (~640 B a column), and for the occ3d and airside masks
    the sensor's rays (~16 B per column and step, about max(X, Y) steps), plus a quarter."""
    X, Y, Z = (int(g) for g in grid)
    rays = 16 * X * Y * max(X, Y) if with_mask and style != "blocks" else 0
    return (frames * X * Y * Z * (2 if with_mask else 1) + 640 * X * Y + rays) * 5 // 4


# HDF5 compression of synthetic scenes, raw bytes per stored byte: 4-6x at the demo's grid, up to 44x
# at 128x128x16 (more free space); the low end estimates a set, the high one bounds it from below
RATIO_LOW, RATIO_HIGH = 4, 64


def _size(n: float) -> str:
    for unit, k in (("PiB", 50), ("TiB", 40), ("GiB", 30)):
        if n >= 2 ** k:
            return f"{n / 2 ** k:,.1f} {unit}"
    return mib(n)


def memory() -> tuple[int, int]:
    """(the memory this process may use in all: physical, or the cgroup's limit where lower; what is
    available now), in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    total, avail = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    with contextlib.suppress(OSError, ValueError, StopIteration):  # free pages plus the reclaimable cache
        with open("/proc/meminfo") as f:
            avail = int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):  # "max" or no such file: no limit
            lim = int(Path(limit).read_text())
            if lim < total:
                total = lim
                avail = min(avail, max(0, lim - int(Path(used).read_text())))
            break
    return total, min(avail, total)


def check_resources(cfg, grid, base: Path, log=print) -> int:
    """Refuse, before anything is generated, a synthetic data set (a SyntheticConfig and data.grid)
    whose scenes do not fit this machine's memory or whose shards do not fit the free space of `base`;
    warn of one that comes close. Returns the generating processes: default_workers, fewer where
    more scenes at once would not fit the memory available."""
    voxels = int(np.prod([int(g) for g in grid]))
    scenes = cfg.train_scenes + cfg.val_scenes
    # memmap shards store the 0/1 mask as one bit a voxel, HDF5 as a byte a voxel (before compression)
    mask = (packed_bytes(grid) if cfg.format == "memmap" else voxels) if cfg.with_mask else 0
    scene = cfg.frames * (voxels + mask) + cfg.frames * (16 * 8 + 8)  # + pose, timestamp
    what = f"{'x'.join(map(str, grid))} with synthetic.frames={cfg.frames}"
    total, avail = memory()
    per = scene_memory(grid, cfg.frames, cfg.with_mask, cfg.style)
    if per > total:
        raise ConfigError("data.grid", f"{what}: generating one synthetic scene needs about {_size(per)} of host "
                                       f"memory, this machine has {_size(total)}; lower data.grid or synthetic.frames")
    # no more processes, each holding a scene, than fit in half of what is available
    workers = min(default_workers(scenes * cfg.frames * voxels), max(1, avail // (2 * per)))
    if per * workers > avail / 2:
        log(f"warning: generating the synthetic scenes ({what}) needs about {_size(per * workers)} of host "
            f"memory, {_size(avail)} is available now; it may run out (lower data.grid or synthetic.frames)")
    raw = scenes * scene
    plain = cfg.format == "memmap" or cfg.compression == "none"
    least, likely = (raw, raw) if plain else (raw // RATIO_HIGH, raw // RATIO_LOW)
    free = free_space(base)
    if free is None:
        return workers  # no figure to go by: the writes themselves decide
    sets = f"{what} x {scenes} scenes (synthetic.train_scenes + synthetic.val_scenes)"
    fix = "lower them, or set synthetic.cache_dir (or $WM_CACHE) to a larger disk"
    if least > free:
        raise ConfigError("data.grid", f"{sets} needs {'' if plain else 'at least '}{_size(least)} of disk in "
                                       f"{base}, which has {_size(free)} free; {fix}")
    if likely > free / 2:
        log(f"warning: the synthetic data set ({sets}) needs about {_size(likely)} of disk in {base}, which has "
            f"{_size(free)} free; {fix} if it runs out")
    return workers
