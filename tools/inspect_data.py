"""Look at a data set: what is in it, whether it is intact, and what its frames look like.

    python tools/inspect_data.py DATA                      # summary: scenes, frames, grid, bytes, and
                                                           # class shares, occupancy by height, visible
                                                           # share beside two Occ3D frames'
    python tools/inspect_data.py DATA --verify             # + recompute every shard's sha256
    python tools/inspect_data.py DATA --png out/           # + out/frame.png and out/window.png
    python tools/inspect_data.py DATA --png out/ --split val --window 12 --past 5 --future 6

The pictures are top-down: each (x, y) column shows the class of its highest occupied voxel (x
forward to the right, y to the left upwards); white is free. Colours follow the class names: Occ3D's
colours for Occ3D's names, the data set's own class_colors (classes.json "colors" at conversion)
where given, distinct colours for the rest; a legend under every picture names them. Frames are
enlarged (nearest neighbour) to at least 256 px wide unless --scale says otherwise. The window
picture shows past frames, a gap, then the future frames, each labelled (t-1, t, t+1 (0.5s), ...);
the data set's moving classes are drawn over whatever is above them. Where the split's scenes are
shorter than the window, as many past and future frames as its longest scene holds are drawn, with
a note.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.config.sections import DataConfig  # noqa: E402
from wm.data.shards import MANIFEST, Shard, load_manifest, open_split, verify  # noqa: E402
from wm.data.stats import FACTOR, compare, moving_classes, sample_counts, stats_from_counts  # noqa: E402
from wm.data.viz import class_palette, figure, write_png  # noqa: E402
from wm.data.windows import OccWindows  # noqa: E402
from wm.evaluation.metrics import step_label  # noqa: E402
from wm.utils.errors import DataError, run_cli  # noqa: E402


def print_stats(stats: dict, class_names, free: int, pal: np.ndarray) -> None:
    """Class shares, and every figure with a reference band beside the two Occ3D frames' range."""
    print(f"classes over {stats['frames']} frames (percent of all voxels; occupied {stats['occupied']:.2f} %):")
    for name, v in sorted(stats["classes"].items(), key=lambda kv: -kv[1]):
        c = class_names.index(name)
        print(f"  {c:>3} {name:<22}{v:>8.3f} %   rgb{tuple(int(x) for x in pal[c])}")
    print(f"against two public Occ3D-nuScenes frames (range = lowest / {FACTOR:g} .. highest x {FACTOR:g}, in %; "
          "vehicles and people from 0, as a real frame may hold none; a guide, not a test):")
    for what, v, lo, hi, ok in compare(stats):
        print(f"  {what:<18}{v:>8.2f}   [{lo:6.2f}, {hi:6.2f}]  {'ok' if ok else 'outside'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="data set folder (holds manifest.json)")
    ap.add_argument("--verify", action="store_true", help="recompute every shard's sha256")
    ap.add_argument("--sample", type=int, default=256,
                    help="frames read for the statistics (0 = all)")
    ap.add_argument("--png", metavar="DIR", help="write frame.png and window.png into DIR")
    ap.add_argument("--split", default="train")
    ap.add_argument("--window", type=int, default=0, help="window index to draw")
    ap.add_argument("--past", type=int, default=5)
    ap.add_argument("--future", type=int, default=6)
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--scale", type=int, default=0, help="pixels per voxel (0: a frame at least 256 px wide)")
    a = ap.parse_args(argv)

    m = load_manifest(a.root)
    info = m.info
    if a.verify:  # first: a damaged shard (HDF5 or memmap) must be named, not fail the summary below
        problems = verify(m.root)
        for p in problems:
            print(f"CORRUPT {p}")
        print(f"verify: {len(m.shards) - len(problems)}/{len(m.shards)} shards match the manifest")
        if problems:
            return 1
    print(f"data set  {m.root}  ({MANIFEST} fingerprint {m.fingerprint[:16]})")
    print(f"grid      {' x '.join(map(str, info.grid))} voxels of {' x '.join(f'{v:g}' for v in info.voxel_size)} m,"
          f" range {list(info.range)}, {info.frame_rate_hz:g} Hz, masks: {'yes' if info.has_mask else 'no'}")
    print(f"classes   {info.num_classes} (free = {info.free_class} '{info.class_names[info.free_class]}'); moving: "
          f"{', '.join(moving_classes(info)) or 'none declared (classes.json moving_classes at conversion)'}")
    splits = sorted({s["split"] for s in m.shards})
    all_shards = []
    print(f"{'split':<8}{'shards':>7}{'kinds':>14}{'scenes':>8}{'frames':>9}{'MiB':>10}{'B/frame':>10}{'vs raw':>8}")
    raw = int(np.prod(info.grid)) * (2 if info.has_mask else 1)
    for sp in splits:
        es = m.split(sp)
        shards = [Shard(m.root, e, info) for e in es]
        all_shards += shards
        frames = sum(s.num_frames for s in shards)
        size = sum(e["bytes"] for e in es)
        kinds = ",".join(sorted({e["kind"] for e in es}))
        print(f"{sp:<8}{len(es):>7}{kinds:>14}{sum(e['scenes'] for e in es):>8}{frames:>9}"
              f"{size / 2**20:>10.1f}{size / frames:>10.0f}{raw * frames / size:>7.1f}x")
    ds = picture_window(a, m) if a.png else None  # a window that cannot be drawn is said before the statistics
    counts = sample_counts(all_shards, info, a.sample)
    print_stats(stats_from_counts(counts, info.free_class, info.class_names), list(info.class_names),
                info.free_class, class_palette(info.class_names, info.free_class, info.class_colors))
    if ds is not None:
        draw(a, ds, info)
    return 0


def picture_window(a, m) -> OccWindows:
    """The windows --png draws from: --past + --future frames at --stride, or, where the split's
    scenes are shorter than that, as many past and future frames (in the same proportion) as the
    longest scene holds at --stride, with a note."""
    for k in ("past", "stride"):
        if getattr(a, k) < 1:
            raise DataError(f"--{k} {getattr(a, k)} must be >= 1")
    if a.future < 0:
        raise DataError(f"--future {a.future} must be >= 0")
    _, shards = open_split(m.root, a.split)
    longest = max(int(np.diff(sh.scene_offsets).max()) for sh in shards)
    fits = (longest - 1) // a.stride + 1  # frames of one scene at --stride
    span = (a.past + a.future - 1) * a.stride + 1
    if span > longest:
        if fits < 2:
            raise DataError(f"--stride {a.stride}: split {a.split!r} has scenes of at most {longest} frames, "
                            f"which hold {fits} frame at that stride; choose a smaller --stride")
        past = min(fits - 1, max(1, round(fits * a.past / (a.past + a.future))))
        print(f"note: split {a.split!r} has scenes of at most {longest} frames, fewer than the {span} that "
              f"{a.past} past + {a.future} future frames at stride {a.stride} span; drawing {past} past + "
              f"{fits - past} future (--past, --future, --stride choose)")
        a.past, a.future = past, fits - past
    info = m.info
    cfg = DataConfig(root=str(m.root), grid=info.grid, num_classes=info.num_classes, free_class=info.free_class,
                     past=a.past, future=a.future, stride=a.stride, train_split=a.split)
    ds = OccWindows(m.root, a.split, cfg, keys={k: f"--{k} {{}}" for k in ("past", "future", "stride")})
    if not 0 <= a.window < len(ds):
        raise DataError(f"--window {a.window}: split {a.split!r} has {len(ds)} windows")
    return ds


def draw(a, ds: OccWindows, info) -> None:
    """frame.png (the last past frame) and window.png (past | future, each frame labelled) of window
    --window, moving objects drawn over what is above them."""
    out = Path(a.png)
    out.mkdir(parents=True, exist_ok=True)
    occ = ds[a.window]["occ"].numpy()
    names, free, colors = info.class_names, info.free_class, info.class_colors
    moving = moving_classes(info)
    prefer = [c for c, n in enumerate(names) if n in moving]
    step_s = a.stride / info.frame_rate_hz if info.frame_rate_hz > 0 else None
    labels = [f"t-{a.past - 1 - i}" if i < a.past - 1 else "t" for i in range(a.past)] + [None] + \
        [step_label(k + 1, step_s) for k in range(a.future)]
    write_png(out / "frame.png", figure([[occ[a.past - 1]]], names, free, colors, scale=a.scale, prefer=prefer))
    write_png(out / "window.png", figure([list(occ[:a.past]) + [None] + list(occ[a.past:])], names, free, colors,
                                         titles=[f"{a.past} past | {a.future} future"], scale=a.scale,
                                         prefer=prefer, labels=labels))
    sh, first, _ = ds.locate(a.window)
    print(f"wrote {out / 'frame.png'} (last past frame) and {out / 'window.png'} "
          f"({a.past} past | {a.future} future) of window {a.window}: {sh.path.name} frames "
          f"{first}..{first + ds.cfg.span - 1} step {a.stride}"
          + (f"; moving classes drawn on top: {', '.join(moving)}" if moving else ""))


if __name__ == "__main__":
    run_cli(main)
