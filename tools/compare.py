"""Regression gate: is the candidate model worse than the baseline on the same validation windows?

    python tools/compare.py --baseline runs/main --candidate runs/pr
    python tools/compare.py --baseline runs/main --candidate runs/pr/export --json cmp.json --markdown cmp.md
    python tools/compare.py --baseline runs/main/world/checkpoints/step_000000450.pt --candidate runs/pr
    python tools/compare.py --baseline A --candidate B --data /data/occ3d --windows 200 --metrics iou_avg,miou_t6

A and B: run folders (their best valid world checkpoint), world checkpoint files (.pt) or export
folders (export.py's ONNX graphs, run in onnxruntime as deployed; the checkpoint export.json records
supplies their config). Both are scored here, on the same windows of one data set (--data, default
the candidate's data root; --split, default its val split; --windows N spread evenly, default all),
the PyTorch models in one precision (--amp; ONNX files compute in their own): forecast IoU and
mIoU per future step and their mean over the steps (absent classes as --eval-only counts them,
--mode occworld by default). A run's own summary.json is only compared with: a note says when it
was computed on other data, split or windows.

Each difference (candidate - baseline, points) gets a paired bootstrap interval that resamples whole
scenes (consecutive windows share frames), the same scenes for both models, and a verdict:
worse (interval below -tolerance), better (above +tolerance), same (inside +-tolerance),
inconclusive (otherwise, or with one scene). wm/experiments/compare.py has the details.

Exit status: 0 pass; 1 regression (a gated metric, --metrics, default iou_avg,miou_avg, is worse;
with --strict also inconclusive); 2 usage error (one line: a missing folder, not a wm run, models of
another grid, classes or window, a bad option). The table goes to the console; --json and
--markdown write it to files, and where $GITHUB_STEP_SUMMARY is set the markdown table is appended
to it (a GitHub Actions job summary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wm.utils.errors import ArgParser, WMError, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    from wm.experiments.compare import DEFAULT_METRICS, EXPORT_ROWS

    ap = ArgParser(prog="tools/compare.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="run folder, world checkpoint (.pt) or export folder")
    ap.add_argument("--candidate", required=True, help="run folder, world checkpoint (.pt) or export folder")
    ap.add_argument("--data", help="data set both are scored on (default: the candidate's data.root)")
    ap.add_argument("--split", help="split scored (default: the candidate's data.val_split)")
    ap.add_argument("--windows", type=int, default=0, help="windows scored, spread evenly over the split (0: all)")
    ap.add_argument("--mask", default="none", help="visibility mask scored (as --eval-only: none, mask, camera, lidar)")
    ap.add_argument("--mode", choices=("occworld", "exclude"), default="occworld",
                    help="classes absent from the ground truth: occworld counts them 100 (--eval-only's default), "
                         "exclude leaves them out (training validation's)")
    ap.add_argument("--tolerance", type=float, default=0.5,
                    help="points of IoU / mIoU within which a difference counts as the same (default %(default)s)")
    ap.add_argument("--confidence", type=float, default=0.95, help="coverage of the bootstrap interval")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the scenes")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bootstrap's draws")
    ap.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                    help="metrics that gate the exit status: iou_avg, miou_avg, iou_t<k>, miou_t<k> "
                         "(default %(default)s)")
    ap.add_argument("--strict", action="store_true", help="an inconclusive gated metric fails the gate too")
    ap.add_argument("--json", help="write the report as JSON here")
    ap.add_argument("--markdown", help="write the markdown table here")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where PyTorch models run")
    ap.add_argument("--amp", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                    help="autocast of both PyTorch models, as train.amp (auto: bf16 on CUDA and on a CPU with AMX)")
    ap.add_argument("--batch", type=int, default=0, help="windows per batch (default: the candidate's world batch)")
    ap.add_argument("--workers", type=int, default=0, help="data loader processes (at most 2)")
    ap.add_argument("--export-files", choices=EXPORT_ROWS, default="onnx_fp32",
                    help="which files of an export folder are scored (as the INT8 report's rows)")
    a = ap.parse_args(argv)
    for flag, ok, what in (("windows", a.windows >= 0, ">= 0"), ("batch", a.batch >= 0, ">= 0"),
                           ("workers", a.workers >= 0, ">= 0"), ("tolerance", a.tolerance >= 0, ">= 0 points"),
                           ("confidence", 0 < a.confidence < 1, "between 0 and 1"),
                           ("resamples", a.resamples >= 100, ">= 100")):
        if not ok:
            raise WMError(f"--{flag} must be {what}, got {getattr(a, flag)}")
    return a


def device_and_dtype(device: str, amp: str):
    """The torch device and autocast dtype (None: fp32) both PyTorch models run in."""
    from types import SimpleNamespace

    import torch

    from wm.training.main import amp_dtype

    if device == "cuda" and not torch.cuda.is_available():
        raise WMError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    dtype = amp_dtype(SimpleNamespace(train=SimpleNamespace(amp=amp)), dev)
    if dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise WMError("--amp bf16 but this GPU has no bf16; use --amp fp16 or fp32")
    return dev, dtype


def write(path: str, text: str, what: str) -> None:
    from wm.utils.atomic import write_bytes

    p = Path(path).expanduser()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(p, text)
    except OSError as e:
        raise WMError(f"cannot write the {what} {p} ({e}); choose another path") from None


def main(argv=None) -> int:
    a = parse_args(argv)
    for flag in ("baseline", "candidate"):  # before torch is imported: a typo costs no model load
        if not Path(getattr(a, flag)).expanduser().exists():
            raise WMError(f"--{flag} {getattr(a, flag)} does not exist; pass a run folder (runs/<name>), a world "
                          "checkpoint (.pt) or an export folder")
    from wm.checkpoint.run_folder import unwritable

    for flag in ("json", "markdown"):  # before the scoring: a bad path costs no minutes
        out = getattr(a, flag)
        why = unwritable(Path(out).expanduser().parent) if out else None
        if why:
            raise WMError(f"cannot write --{flag} {out} ({why}); choose another path")
    import torch

    from wm.experiments.compare import compare, format_markdown, format_table, load_model, parse_metrics

    with torch.no_grad():  # scoring only; a caller's grad mode is left as it was
        dev, dtype = device_and_dtype(a.device, a.amp)
        base = load_model(a.baseline, "baseline", dev, dtype, a.export_files)
        cand = load_model(a.candidate, "candidate", dev, dtype, a.export_files)
        metrics = parse_metrics(a.metrics, cand.cfg.data.future)
        rep = compare(base, cand, data=a.data, split=a.split, windows=a.windows, mask=a.mask, mode=a.mode,
                      tolerance=a.tolerance, confidence=a.confidence, resamples=a.resamples, seed=a.seed,
                      metrics=metrics, strict=a.strict, batch=a.batch, workers=a.workers)
    print(format_table(rep))
    md = format_markdown(rep)
    if a.json:
        write(a.json, json.dumps(rep, indent=1, allow_nan=False) + "\n", "JSON report")
    if a.markdown:
        write(a.markdown, md, "markdown table")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            with open(summary, "a") as f:
                f.write(md + "\n")
        except OSError as e:
            raise WMError(f"cannot append to $GITHUB_STEP_SUMMARY {summary} ({e})") from None
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    run_cli(main)
