"""Random-window read throughput of every shard layout against one compressed .npz per frame.

    python tools/bench_data.py                          # 200x200x16, 8 scenes x 40 frames
    python tools/bench_data.py --windows 400 --workers 2 --json bench_data.json
    python tools/bench_data.py --cold                   # drop each layout's files from the page cache first

The same synthetic frames are written as HDF5 shards (each compression in wm.config.sections.COMPRESSIONS,
with the fletcher32 chunk checksums wm writes, and the default compression once without them),
as a memmap shard, and in Occ3D's layout (`<scene>/<frame>/labels.npz` holding `semantics`, one
np.savez_compressed file per frame: the baseline). The same random windows (past + future frames
of one scene) are then read through wm's dataset (`OccWindows`: the path training uses, class
check and ego motion included), single process and through a DataLoader with worker processes.
Reported: bytes on disk per frame, windows/s and MB/s of raw occupancy delivered, and the speed-up
over the npz baseline. Targets (docs/ARCHITECTURE.md): memmap >= 10x the npz baseline; the default HDF5
compression >= 2x at >= 30x fewer bytes than raw.

    python tools/bench_data.py --stream 80 --batch 32 --workers 6 --scenes 4   # the training stream

`--stream STEP_MS`: instead, what a training step waits for data, from the memmap layout through
the loop's own stream (wm.training.loop.BatchStream over wm.data.windows.make_loader, single frames as the
tokenizer trains on, `--batch` a step), the step itself simulated by sleeping STEP_MS (a GPU step
at that pace): the wait per step, at the epoch's first step and at the others, for the loader
that runs through the epochs (endless, what training uses) and for one that is started again at
every epoch. A small data set (`--scenes`) makes many epoch ends.
"""

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.config.runtime import LoaderConfig  # noqa: E402
from wm.config.sections import DataConfig  # noqa: E402
from wm.config.sections import COMPRESSIONS, DEFAULT_COMPRESSION
from wm.data.shards import Manifest  # noqa: E402
from wm.data.synthetic.generate import dataset_info, make_scene  # noqa: E402
from wm.data.windows import OccWindows, ResumableSampler, make_loader, relative_motion  # noqa: E402
from wm.data.writer import ShardWriter  # noqa: E402
from wm.utils.errors import run_cli  # noqa: E402


class NpzWindows(Dataset):
    """The baseline: Occ3D's layout, one compressed npz per frame, same windows as OccWindows."""

    def __init__(self, root: Path, scenes: list[str], frames_per_scene: list[int], cfg: DataConfig):
        self.root, self.cfg = root, cfg
        self.poses = {s: np.load(root / s / "poses.npy") for s in scenes}
        self.index = [(s, f) for s, n in zip(scenes, frames_per_scene)
                      for f in range(0, n - cfg.span + 1, cfg.window_step)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, a = self.index[i]
        ks = range(a, a + self.cfg.span, self.cfg.stride)
        occ = np.stack([np.load(self.root / s / f"{k:03d}" / "labels.npz")["semantics"] for k in ks])
        motion = relative_motion(self.poses[s][a:a + self.cfg.span:self.cfg.stride], self.cfg.past - 1)
        return {"occ": torch.from_numpy(occ), "motion": torch.from_numpy(motion),
                "index": torch.tensor(i)}


def drop_cache(path: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `path` (no root needed)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def time_single(ds, picks) -> float:
    ds[int(picks[0])]  # open handles / maps outside the timing
    t = time.perf_counter()
    for i in picks:
        ds[int(i)]
    return len(picks) / (time.perf_counter() - t)


def time_loader(ds, picks, workers: int, batch: int) -> float:
    dl = DataLoader(ds, batch_size=batch, sampler=[int(i) for i in picks], num_workers=workers,
                    prefetch_factor=4 if workers else None)
    it = iter(dl)
    warm = max(1, 2 * workers)  # worker start-up is not read speed
    for _ in range(warm):
        next(it)
    t, n = time.perf_counter(), 0
    for b in it:
        n += len(b["occ"])
    return n / (time.perf_counter() - t)


def time_stream(root: Path, cfg: DataConfig, a) -> dict:
    """Wait for data per simulated step (ms), through the training stream, endless loader or not."""
    import wm.training.loop as L
    from wm.evaluation.evaluate import frames_config

    ds = OccWindows(root, "train", frames_config(cfg))
    out = {}
    for endless in (True, False):
        sampler = ResumableSampler(len(ds), seed=a.seed, drop_last=True)
        lc = LoaderConfig(num_workers=a.workers, prefetch_factor=4)
        stream = L.BatchStream(make_loader(ds, sampler, lc, a.batch, endless=endless), sampler, a.batch)
        per_epoch = len(ds) // a.batch
        for _ in range(per_epoch):  # the first epoch starts the workers: not a steady state
            stream()
        first, other = [], []
        for k in range(a.stream_steps):
            t = time.perf_counter()
            stream()
            (first if k % per_epoch == 0 else other).append((time.perf_counter() - t) * 1e3)
            time.sleep(a.stream / 1e3)
        stream.it = None  # ends the workers
        name = "endless" if endless else "restarted each epoch"
        out[name] = {"steps_per_epoch": per_epoch, "epoch_first_wait_ms": float(np.mean(first)),
                     "other_wait_ms": float(np.mean(other)) if other else 0.0,
                     "wait_frac": (sum(first) + sum(other)) / (sum(first) + sum(other) + a.stream * a.stream_steps)}
        r = out[name]
        print(f"  loader {name:<21} wait at an epoch's first step {r['epoch_first_wait_ms']:7.1f} ms, at the "
              f"others {r['other_wait_ms']:6.2f} ms; {100 * r['wait_frac']:.1f} % of the time "
              f"({per_epoch} steps an epoch, {a.stream:g} ms steps)", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", type=int, nargs=3, default=[200, 200, 16], metavar=("X", "Y", "Z"))
    ap.add_argument("--scenes", type=int, default=8)
    ap.add_argument("--frames", type=int, default=40, help="frames per scene")
    ap.add_argument("--past", type=int, default=5)
    ap.add_argument("--future", type=int, default=6)
    ap.add_argument("--windows", type=int, default=300, help="random windows read per layout and mode")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (0: skip that mode)")
    ap.add_argument("--batch", type=int, default=1, help="DataLoader batch size")
    ap.add_argument("--layouts", nargs="*", help="subset, e.g. hdf5-gzip1 memmap npz")
    ap.add_argument("--cold", action="store_true", help="evict each layout's files from the page cache before reading")
    ap.add_argument("--dir", help="where to write the layouts (default: a temporary folder, removed)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream", type=float, metavar="STEP_MS",
                    help="time the training stream's wait for data at simulated steps of STEP_MS instead")
    ap.add_argument("--stream-steps", type=int, default=60, help="timed steps of each --stream loader")
    a = ap.parse_args(argv)
    if a.stream is not None:
        if a.stream < 0 or a.stream_steps < 1 or a.workers < 0:
            ap.error("--stream must be >= 0, --stream-steps >= 1, --workers >= 0")

    torch.set_num_threads(1)
    grid = tuple(a.grid)
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="wm-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    # every HDF5 layout carries fletcher32 chunk checksums (as wm writes them); "-nocheck" is the
    # default compression without them, to measure what the checksum costs on read
    layouts = [f"hdf5-{c}" for c in COMPRESSIONS] + [f"hdf5-{DEFAULT_COMPRESSION}-nocheck", "memmap", "npz"]
    if a.layouts:
        unknown = set(a.layouts) - set(layouts)
        if unknown:
            ap.error(f"unknown layouts {sorted(unknown)}; choose from {layouts}")
        layouts = [x for x in layouts if x in a.layouts] + (["npz"] if "npz" not in a.layouts else [])
    if a.stream is not None:
        layouts = ["memmap"]
    cfg = DataConfig(grid=grid, past=a.past, future=a.future)
    info = dataset_info(grid, with_mask=False)
    raw_frame = int(np.prod(grid))

    t0 = time.perf_counter()
    scenes = [make_scene(a.seed, i, grid, a.frames, with_mask=False) for i in range(a.scenes)]
    print(f"generated {a.scenes} scenes x {a.frames} frames of {'x'.join(map(str, grid))} "
          f"in {time.perf_counter() - t0:.1f} s; writing layouts under {base}", file=sys.stderr)
    paths = {}
    try:
        for lay in layouts:
            p = base / lay
            shutil.rmtree(p, ignore_errors=True)
            p.mkdir()
            if lay == "npz":
                for s in scenes:
                    d = p / s["name"]
                    d.mkdir()
                    np.save(d / "poses.npy", s["pose"])
                    for k, f in enumerate(s["occ"]):
                        (d / f"{k:03d}").mkdir()
                        np.savez_compressed(d / f"{k:03d}" / "labels.npz", semantics=f)
            else:
                kind, comp = ("memmap", "none") if lay == "memmap" else ("hdf5", lay.split("-")[1])
                with ShardWriter(p / f"train-00000{'.mm' if kind == 'memmap' else '.h5'}", kind, info,
                                 compression=comp, checksum=not lay.endswith("-nocheck")) as w:
                    for s in scenes:
                        w.add_scene(s["name"], s["occ"], s["pose"], s["timestamp"])
                    entry = w.close()
                Manifest(p, info, [{**entry, "split": "train"}]).write()
            paths[lay] = p

        if a.stream is not None:
            res = time_stream(paths["memmap"], cfg, a)
            if a.json:
                Path(a.json).write_text(json.dumps({"stream": res, "settings": {**vars(a), "grid": list(grid)},
                                                    "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}},
                                                   indent=1))
            return 0
        results = {}
        picks = None
        for lay in layouts:
            p = paths[lay]
            t = time.perf_counter()
            if lay == "npz":
                ds = NpzWindows(p, [s["name"] for s in scenes], [a.frames] * a.scenes, cfg)
            else:
                ds = OccWindows(p, "train", cfg)
            open_ms = (time.perf_counter() - t) * 1e3
            if picks is None:  # the same random windows for every layout
                picks = np.random.default_rng(a.seed).integers(0, len(ds), a.windows)
            mb = cfg.window * raw_frame / 1e6
            if a.cold:
                drop_cache(p)
            single = time_single(ds, picks)
            if a.cold:
                drop_cache(p)
            loader = time_loader(ds, picks, a.workers, a.batch) if a.workers else float("nan")
            size = du(p)
            frames = a.scenes * a.frames
            results[lay] = {"bytes_per_frame": size / frames, "ratio_vs_raw": raw_frame * frames / size,
                            "windows_per_s": single, "mb_per_s": single * mb,
                            "loader_windows_per_s": loader, "loader_mb_per_s": loader * mb,
                            "open_ms": open_ms}
            print(f"  {lay:<12} {single:8.1f} windows/s single, {loader:8.1f} with {a.workers} workers",
                  file=sys.stderr)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)

    npz = results["npz"]
    print(f"\nrandom windows of {cfg.window} frames ({a.past} past + {a.future} future), grid "
          f"{'x'.join(map(str, grid))} ({raw_frame / 1e3:.0f} kB raw/frame), {a.windows} windows per run, "
          f"{'cold' if a.cold else 'warm'} page cache, {os.cpu_count()} cores, workers={a.workers}, batch={a.batch}")
    head = (f"{'layout':<19}{'bytes/frame':>12}{'x smaller':>10}{'win/s':>9}{'MB/s':>8}{'vs npz':>8}"
            f"{'win/s@' + str(a.workers) + 'w':>11}{'MB/s':>8}{'vs npz':>8}{'open ms':>9}")
    print(head)
    print("-" * len(head))
    for lay, r in results.items():
        r["speedup_vs_npz"] = r["windows_per_s"] / npz["windows_per_s"]
        r["loader_speedup_vs_npz"] = r["loader_windows_per_s"] / npz["loader_windows_per_s"]
        tag = " (default)" if lay == f"hdf5-{DEFAULT_COMPRESSION}" else ""
        print(f"{lay:<19}{r['bytes_per_frame']:>12.0f}{r['ratio_vs_raw']:>9.1f}x{r['windows_per_s']:>9.1f}"
              f"{r['mb_per_s']:>8.0f}{r['speedup_vs_npz']:>7.1f}x{r['loader_windows_per_s']:>11.1f}"
              f"{r['loader_mb_per_s']:>8.0f}{r['loader_speedup_vs_npz']:>7.1f}x{r['open_ms']:>9.1f}{tag}")
    checks = []
    if "memmap" in results:
        checks.append(("memmap >= 10x npz", results["memmap"]["speedup_vs_npz"] >= 10))
    d = results.get(f"hdf5-{DEFAULT_COMPRESSION}")
    if d:
        checks.append((f"hdf5-{DEFAULT_COMPRESSION} >= 2x npz", d["speedup_vs_npz"] >= 2))
        checks.append((f"hdf5-{DEFAULT_COMPRESSION} >= 30x smaller than raw", d["ratio_vs_raw"] >= 30))
    nc = results.get(f"hdf5-{DEFAULT_COMPRESSION}-nocheck")
    if d and nc:
        d["checksum_read_cost"] = 1 - d["windows_per_s"] / nc["windows_per_s"]  # negative: noise won
        print(f"fletcher32 chunk checksums: hdf5-{DEFAULT_COMPRESSION} reads {d['windows_per_s']:.1f} windows/s with "
              f"them, {nc['windows_per_s']:.1f} without (read rate {-100 * d['checksum_read_cost']:+.1f} %), "
              f"{d['bytes_per_frame'] - nc['bytes_per_frame']:+.0f} bytes/frame")
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name} (single process)")
    if a.json:
        out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(), "torch": torch.__version__},
               "settings": {**vars(a), "grid": list(grid), "default_compression": DEFAULT_COMPRESSION},
               "layouts": results, "checks": {n: ok for n, ok in checks}}
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
