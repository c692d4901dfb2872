"""Time every phase of `export.py` for a run or a config, and write the figures as JSON.

    python tools/bench_export.py --run runs/occworld --json bench.json -- --int8
    python tools/bench_export.py --cfg configs/occworld.json --set synthetic.train_scenes=4 \
        --set synthetic.val_scenes=2 --json cpu.json -- --int8 --calib-windows 8 --eval-windows 4

With --cfg, a run of that config is trained first for `--steps` steps per stage (the weights do not
matter for the timing; the export, calibration and report code paths are the real ones), into
--out. Everything after `--` goes to export.py. The JSON holds export.py's own phase seconds and
peak memory (export.json), the wall time, and the machine (CPU count, GPU name, torch version).
A benchmark, not a test: nothing here asserts a time.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def machine() -> dict:
    import torch

    out = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
           "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--run", help="an existing run folder")
    g.add_argument("--cfg", help="a config file: train a short run of it first")
    ap.add_argument("--set", action="append", default=[], help="config overrides for --cfg (a.b=value)")
    ap.add_argument("--steps", type=int, default=2, help="steps per stage of the --cfg run")
    ap.add_argument("--out", default="runs/bench_export", help="where the --cfg run goes")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)

    from wm.export import main as export_cli

    t0 = time.perf_counter()
    train_s = None
    if a.cfg:
        import wm.training.main as T

        out = Path(a.out)
        # the weights do not matter: a preset's global batch (80 frames a step) would only slow these steps
        sets = ["tokenizer_stage.global_batch=0", "world_stage.global_batch=0", *a.set,
                f"run.out_dir={out.parent}", f"run.name={out.name}",
                f"tokenizer_stage.max_steps={a.steps}", f"world_stage.max_steps={a.steps}"]
        args = ["--cfg", a.cfg] + [x for s in sets for x in ("--set", s)]
        rc = T.main(args)
        if rc:
            return rc
        train_s = round(time.perf_counter() - t0, 1)
        run = out
    else:
        run = Path(a.run)
    exp = run / "export"
    t1 = time.perf_counter()
    rc = export_cli.main(["--run", str(run), "--out", str(exp), *rest])
    wall = time.perf_counter() - t1
    if rc:
        return rc
    rep = json.loads((exp / "export.json").read_text())
    res = {"run": str(run), "export_args": rest, "machine": machine(), "train_s": train_s,
           "export_wall_s": round(wall, 1), "seconds": rep.get("seconds", {}), "memory": rep.get("memory", {}),
           "graphs": {k: {"bytes": v["bytes"], "export_s": v["export_s"]} for k, v in rep["graphs"].items()}}
    if (exp / "report.json").is_file():
        acc = json.loads((exp / "report.json").read_text())["accuracy"]
        res["accuracy"] = {"windows": acc["windows"], "engine": acc["engine"],
                           "models": {k: {x: v.get(x) for x in ("iou", "miou", "iou_avg", "miou_avg", "drop_iou",
                                                               "drop_miou", "drop_iou_se", "drop_miou_se",
                                                               "drop_iou_avg", "drop_iou_avg_se", "drop_miou_avg",
                                                               "drop_miou_avg_se", "agreement_vs_pytorch",
                                                               "engine", "ms_per_window")}
                                      for k, v in acc["models"].items()}}
        if "parity" in acc:
            res["accuracy"]["parity"] = acc["parity"]
    print(json.dumps({k: res[k] for k in ("machine", "export_wall_s", "seconds", "memory")}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    from wm.utils.errors import run_cli

    run_cli(main)
