"""Convert Occ3D-nuScenes (as distributed) into a wm data set: shards + manifest.json.

    python tools/convert_occ3d.py --root /data/Occ3D-nuScenes/trainval --out data/occ3d --workers 8
    python tools/convert_occ3d.py --root ... --out data/occ3d --max-scenes 10    # a quick trial
    python tools/convert_occ3d.py --root ... --out data/occ3d_mm --format memmap --mask camera --verify

--root is the folder as unpacked: annotations.json plus gts/<scene_name>/<sample_token>/labels.npz
(arrays semantics (200,200,16) uint8, 18 classes, free = 17; mask_lidar; mask_camera). Scenes go to
the train/val split that annotations.json gives (train_split / val_split), frames
in time order, ego poses as 4x4 ego->global (from the quaternion w,x,y,z + translation; --quat-order
xyzw for files that write x,y,z,w: a warning says when most poses would tip the vehicle over),
timestamps in microseconds. An absolute gt_path that is not on this machine is looked for at
ROOT/gts/<scene>/<token>/labels.npz. A labels.npz whose semantics are not uint8 (OpenOcc: int32,
free = 16) is refused; a data set whose most common class is not free gets a warning.

Masks (the shard's one uint8 `mask` field holds bit flags): bit 0 (1) = mask_camera, bit 1 (2) =
mask_lidar. --mask both (default) keeps both bits; --mask camera keeps only mask_camera (then
data.use_mask=true scores exactly Occ3D's camera-visible voxels, the benchmark's protocol);
--mask lidar only mask_lidar; --mask none no mask.

Resumable: re-run the same command after an interruption; finished shards are kept, the rest are
written, and the manifest is written at the end. A scene that cannot be converted stops the run
with one line naming the scene and the file; --skip-bad converts the others and lists what it
skipped (also in <out>/skipped.json).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.data.convert.engine import add_writer_args, convert_and_report  # noqa: E402
from wm.data.convert.occ3d import (MASK_BITS, MASK_MODES, OCC3D_GRID, QUAT_ORDERS, occ3d_info, occ3d_scenes,
    quat_order_warning)
from wm.utils.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="the Occ3D-nuScenes folder: annotations.json and gts/")
    ap.add_argument("--out", required=True, help="data set folder to write (or to resume)")
    ap.add_argument("--annotations", help="annotations.json (default: ROOT/annotations.json)")
    ap.add_argument("--mask", choices=list(MASK_MODES), default="both",
                    help="visibility masks to keep (bit 0 camera, bit 1 lidar)")
    ap.add_argument("--grid", type=int, nargs=3, default=list(OCC3D_GRID), metavar=("X", "Y", "Z"),
                    help="expected grid of every labels.npz (default: Occ3D's 200 200 16)")
    ap.add_argument("--max-scenes", type=int, default=0, help="convert only the first N scenes of each split")
    ap.add_argument("--quat-order", choices=list(QUAT_ORDERS), default="wxyz",
                    help="order of the ego_pose rotation quaternions in annotations.json (default: nuScenes' "
                         "w,x,y,z; a warning says when the poses look like the other order)")
    add_writer_args(ap)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    order, specs, bad = occ3d_scenes(a.root, a.annotations, a.mask, a.max_scenes, a.quat_order)
    ann = Path(a.annotations or Path(a.root) / "annotations.json")
    info = occ3d_info(a.grid, a.mask)
    bits = {b: MASK_BITS[b] for b in MASK_MODES[a.mask]}
    options = {"source": str(Path(a.annotations or Path(a.root) / "annotations.json").resolve()),
               "format": a.format, "compression": a.compression if a.format == "hdf5" else "none",
               "scenes_per_shard": a.scenes_per_shard, "grid": list(info.grid), "mask": a.mask,
               "max_scenes": a.max_scenes}
    if a.quat_order != "wxyz":  # only when given: a resume compares records key by key
        options["quat_order"] = a.quat_order
    record = {"tool": "convert_occ3d", "options": options, "mask_bits": bits,
              "mask_convention": "uint8 bit flags: bit 0 (1) = Occ3D mask_camera, bit 1 (2) = mask_lidar"}
    return convert_and_report(
        a, info, order, specs, bad, record, bits, t0,
        f"{a.root}: {sum(len(v) for v in order.values())} scenes "
        f"({', '.join(f'{k} {len(v)}' for k, v in order.items())}), "
        f"{sum(len(s.files) for s in specs.values())} frames listed; masks: {a.mask}",
        [w for w in [quat_order_warning(specs.values(), ann, a.quat_order)] if w])


if __name__ == "__main__":
    run_cli(main)
