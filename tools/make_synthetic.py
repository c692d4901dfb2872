"""Write a synthetic occupancy data set (procedural driving scenes, Occ3D classes) as shards.

    python tools/make_synthetic.py --out data/synth --grid 64 64 8 --train-scenes 24 --val-scenes 6
    python tools/make_synthetic.py --out data/synth200 --grid 200 200 16 --format memmap
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.config.sections import COMPRESSIONS, DEFAULT_COMPRESSION  # noqa: E402
from wm.config.sections import STYLES
from wm.data.synthetic.generate import write_synthetic  # noqa: E402
from wm.utils.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to create (must not hold a data set)")
    ap.add_argument("--grid", type=int, nargs=3, default=[64, 64, 8], metavar=("X", "Y", "Z"))
    ap.add_argument("--train-scenes", type=int, default=24)
    ap.add_argument("--val-scenes", type=int, default=6)
    ap.add_argument("--frames", type=int, default=40, help="frames per scene (2 Hz)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["hdf5", "memmap", "mixed"], default="hdf5",
                    help="shard kind (default hdf5; the demo generates memmap, synthetic.format)")
    ap.add_argument("--compression", choices=list(COMPRESSIONS), default=DEFAULT_COMPRESSION)
    ap.add_argument("--scenes-per-shard", type=int, default=8)
    ap.add_argument("--no-mask", action="store_true", help="do not write visibility masks")
    ap.add_argument("--style", choices=list(STYLES), default="occ3d",
                    help="occ3d: observed surfaces with Occ3D's statistics (default occ3d: the demo's scenes, "
                         "synthetic.style); airside: airport aprons, 17 classes of their own (configs/airside_*.json); "
                         "blocks: solid columns, the first generator (configs/demo_blocks.json)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes generating scenes (default: one per core, at most 16, for a large data set; "
                         "1 for a small one); the bytes are the same with any number")
    a = ap.parse_args(argv)
    if a.workers is not None and a.workers < 1:
        ap.error(f"--workers {a.workers}: give 1 or more processes")
    t = time.perf_counter()
    m = write_synthetic(a.out, a.train_scenes, a.val_scenes, a.frames, tuple(a.grid), a.seed,
                        a.format, a.compression, not a.no_mask, a.scenes_per_shard, progress=True, style=a.style,
                        workers=a.workers)
    frames = sum(s["frames"] for s in m.shards)
    size = sum(s["bytes"] for s in m.shards)
    print(f"wrote {len(m.shards)} shards, {frames} frames, {size / 2**20:.1f} MiB to {a.out} in "
          f"{time.perf_counter() - t:.1f} s; fingerprint {m.fingerprint[:16]}")
    return 0


if __name__ == "__main__":
    run_cli(main)
