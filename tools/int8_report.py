"""The export's accuracy report again, every row run by onnxruntime on the CPU.

`export.py --int8` with a GPU scores its INT8 rows on the files already (onnxruntime runs each
graph that holds quantized nodes, PyTorch the float ones) and its FP16 row as PyTorch under float16
autocast. This tool runs the held-out windows through the files alone: the FP16 files themselves,
TensorRT's `.int8.onnx` by its ONNX semantics (Q/DQ as float ops) apart from onnxruntime's copy,
each float graph in onnxruntime too, on as many windows as asked (more windows, smaller errors),
without exporting again. PyTorch FP32, the reference of every drop, runs on the GPU where there is
one, as export.py computes it. It prints the table and sets each row beside the export's own
report.json.

    python tools/int8_report.py --run runs/occworld                           # every row, 64 windows
    python tools/int8_report.py --run runs/occworld --rows onnx_int8_ort --eval-windows 16

Writes <export>/report-onnxruntime.json (--json elsewhere); the export's report.json is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.utils.errors import WMError, run_cli  # noqa: E402


def beside(own: dict, export_report: dict) -> list[str]:
    """One line per row both reports have: IoU / mIoU averaged and the drops, here | report.json."""
    theirs = export_report.get("accuracy", {})
    lines = [f"beside the export's report.json (engine {theirs.get('engine', '?')}, {theirs.get('windows', '?')} "
             f"windows), IoU / mIoU averaged and their drops, the files here | report.json:"]

    def f(x):
        return f"{x:6.2f}" if x is not None else f"{'-':>6}"

    for v, r in own["models"].items():
        t = theirs.get("models", {}).get(v)
        if t is None or v == "pytorch_fp32":
            continue
        lines.append(f"  {v:<14} {f(r['iou_avg'])} / {f(r['miou_avg'])}, drop {f(r['drop_iou_avg'])} / "
                     f"{f(r['drop_miou_avg'])} | {f(t['iou_avg'])} / {f(t['miou_avg'])}, drop "
                     f"{f(t['drop_iou_avg'])} / {f(t['drop_miou_avg'])}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a trained run folder")
    ap.add_argument("--export", help="its export folder (default: <run>/export)")
    ap.add_argument("--ckpt", help="world-model checkpoint (default: the one the export's report.json names, "
                                   "else the run's best)")
    ap.add_argument("--eval-windows", type=int, default=64, help="validation windows (0: all), as export.py")
    ap.add_argument("--batch", type=int, default=2, help="windows per batch")
    ap.add_argument("--rows", help="comma-separated rows besides pytorch_fp32 and copy_last (default: every "
                                   "file kind there is: onnx_fp32, onnx_fp16, onnx_int8, onnx_int8_ort)")
    ap.add_argument("--device", default="auto", help="where PyTorch FP32, the reference, runs: auto (cuda where "
                                                    "there is a GPU, as export.py), cpu, cuda")
    ap.add_argument("--json", help="write the report here (default: <export>/report-onnxruntime.json)")
    a = ap.parse_args(argv)
    if a.eval_windows < 0 or a.batch < 1:
        raise WMError("--eval-windows must be >= 0 (0: all) and --batch >= 1")
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise WMError(f"--device {a.device}: use auto, cpu, or cuda on a machine with a GPU")
    # FP32 means FP32 on the GPU too, as in export.py: no TF32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    from wm.utils.atomic import write_bytes
    from wm.checkpoint.trained import load_trained
    from wm.export.int8_report import accuracy_report, format_report

    run_dir = Path(a.run)
    export = Path(a.export) if a.export else run_dir / "export"
    prior = {}
    if (export / "report.json").is_file():
        try:
            prior = json.loads((export / "report.json").read_text())
        except (OSError, ValueError) as e:
            print(f"note: {export / 'report.json'} is unreadable ({e}); no comparison with it")
    ckpt = a.ckpt or (prior.get("checkpoint") if Path(prior.get("checkpoint") or "").is_file() else None)
    torch.set_grad_enabled(False)
    trained = load_trained(run_dir, ckpt)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()] if a.rows else None
    print(f"the files of {export} in onnxruntime on the CPU, PyTorch FP32 on {device}, checkpoint {trained.ckpt}")
    rep = accuracy_report(trained, export, a.eval_windows, batch=a.batch, engine="onnxruntime", device=device,
                          rows=rows)
    full = {"checkpoint": str(trained.ckpt), "data_fingerprint": trained.data_fingerprint, "accuracy": rep}
    out = Path(a.json) if a.json else export / "report-onnxruntime.json"
    write_bytes(out, json.dumps(full, indent=1) + "\n")
    print(format_report(rep))
    if prior.get("accuracy"):
        print("\n".join(beside(rep, prior)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
