"""export.py's body: a trained world-model run exported to ONNX (FP32, optionally FP16 and INT8), checked against PyTorch.

    python export.py                              # newest world-model run under runs/, its best checkpoint
    python export.py --run runs/demo --fp16
    python export.py --run runs/demo --int8       # + Q/DQ INT8 graphs, calibration caches, report.json
    python export.py --run runs/demo --ckpt runs/demo/world/checkpoints/step_000000450.pt

Writes into <run>/export/ the three graphs a deployment runs (wm/export/onnx.py says why three, and
wm/export/deployed.py is the host loop over them): tokenizer_encode.onnx, world_step.onnx (one
world-model step; the loop calls it once per future frame), tokenizer_decode.onnx; *.fp16.onnx with
--fp16; with --int8 *.int8.onnx Q/DQ graphs calibrated by TensorRT's entropy method, *.calib.cache
TensorRT calibration caches and report.json (IoU/mIoU per future step, past occupancy -> future
occupancy, of PyTorch FP32, FP16, INT8 and copy-last on held-out windows); and export.json: what
was compared (onnxruntime against PyTorch at batch 1 and 2), the seconds of every phase and the
peak host (and GPU) memory.

Calibration runs on the GPU where there is one (the exported programs in PyTorch), else in
onnxruntime on the CPU (--engine picks). The report's INT8 rows are always the INT8 files' own:
onnxruntime runs every graph that holds quantized nodes (on the CPU), and PyTorch the float ones.

TensorRT: where `import tensorrt` works and a GPU is present, each graph (the INT8 Q/DQ one with
--int8, else FP16 with --fp16, else FP32) is built into `<graph>.engine` as a strongly typed
network, run with torch CUDA tensors, compared with onnxruntime and timed; elsewhere one line says
why and the `trtexec` command for the target machine is printed (--no-trt skips this).
"""

import argparse
import json
import os
import time
from pathlib import Path

from wm.utils.atomic import write_bytes
from wm.utils.errors import WMError


def peak_memory(peaks) -> dict:
    """Peak resident memory of this process (GiB, overall and per phase: wm.export.memory) and the
    GPU's peak allocation. (The children's ru_maxrss is left out: it counted the parent's pages a
    threshold worker had mapped before exec, i.e. it repeated the parent's figure.)"""
    import torch

    out = peaks.as_dict()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main(argv=None) -> int:
    """export(), ended by SIGTERM/SIGINT with one line: where it was, what it had finished."""
    from wm.utils.stop_signals import stop_with_one_line

    progress = {"phase": "loading the checkpoint", "done": [], "out": None}

    def stopped(sig: str) -> str:
        done = progress["done"]
        fin = f"finished: {', '.join(done)} in {progress['out']}" if done else "nothing was finished"
        return f"export got {sig} during {progress['phase']}; {fin}; no partial file was kept, and a rerun starts over"

    with stop_with_one_line(stopped):
        return export(argv, progress)


def export(argv, progress: dict) -> int:
    """The export; `progress` says the phase it is in and what it has finished (for main's line)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="run folder (default: the newest world-model run under --runs)")
    ap.add_argument("--runs", default="runs", help="where to look for runs")
    ap.add_argument("--ckpt", help="world-model checkpoint (default: the run's best)")
    ap.add_argument("--out", help="output folder (default: <run>/export)")
    ap.add_argument("--fp16", action="store_true", help="also write FP16 graphs (inputs/outputs keep their types)")
    ap.add_argument("--max-batch", type=int, default=64, help="largest batch the graphs accept")
    ap.add_argument("--world-max-batch", type=int, default=0,
                    help="largest batch of world_step's TensorRT profile (default: --max-batch, less where "
                         "its key/value cache would pass 8 GiB)")
    ap.add_argument("--int8", action="store_true",
                    help="also write INT8 Q/DQ graphs and TensorRT calibration caches, and report.json")
    ap.add_argument("--calib-windows", type=int, default=128,
                    help="training windows for INT8 calibration, spread evenly over the split (0: all)")
    ap.add_argument("--eval-windows", type=int, default=64,
                    help="validation windows of the report (0: all; more than the split has: all)")
    ap.add_argument("--batch", type=int, default=2, help="windows per calibration/report batch")
    ap.add_argument("--engine", choices=("auto", "torch", "onnxruntime"), default="auto",
                    help="what runs calibration and the report: torch (the exported programs and PyTorch "
                         "FP32/FP16 on the GPU; the INT8 files' quantized graphs still in onnxruntime) or "
                         "onnxruntime (CPU, every file); auto: torch where a GPU is present")
    ap.add_argument("--time-budget", type=float, default=0, metavar="MIN",
                    help="with --int8: after the first calibration window, stop with the --calib-windows and "
                         "--eval-windows that fit this many minutes if the estimate is over it (the estimate "
                         "is printed either way)")
    ap.add_argument("--calib-method", choices=("entropy", "percentile", "max"), default="entropy",
                    help="INT8 thresholds: entropy (TensorRT's EntropyCalibrator2), percentile (99.99 %% of "
                         "the values) or max (nothing clipped)")
    # INT8 where the forecast's time is (the world step, once per future frame); the tokenizer's INT8
    # costs more accuracy than its one pass saves time (docs/EXPORT.md), so it stays float
    ap.add_argument("--int8-float", metavar="REGEX", default=r"tok\.",
                    help="keep float the convolutions and matrix products whose module path matches this "
                         "regular expression (default: the tokenizer's encoder and decoder, %(default)s; '' "
                         "quantizes everything; e.g. 'tok.enc' or 'world.temporal'); the report's int8_tokenizer / "
                         "int8_world rows say which part an INT8 drop comes from")
    ap.add_argument("--int8-attention", action="store_true",
                    help="also quantize the matrix products of two activations (attention scores and "
                         "weighted values); by default they stay float and only products with a weight "
                         "are INT8 (docs/EXPORT.md)")
    ap.add_argument("--int8-pose", action="store_true",
                    help="also quantize the world model's ego-motion (pose-token) path; by default it stays "
                         "float: one vector per frame, so its INT8 saves no time, and its error reaches every "
                         "cell (docs/EXPORT.md)")
    ap.add_argument("--parity-windows", type=int, default=2,
                    help="with the torch engine: windows the report also runs through the FP32 files in "
                         "onnxruntime, for their parity with PyTorch")
    ap.add_argument("--host-memory-gib", type=float, default=8.0,
                    help="with the torch engine: the INT8 report's onnxruntime rollouts (about 2 GiB each at "
                         "the occworld size) run side by side only as far as this much host memory allows "
                         "beside the export's own")
    ap.add_argument("--aoti", action="store_true",
                    help="also compile the whole forecast ahead of time for this machine (AOTInductor, "
                         "wm/export/aoti.py): a .pt2 package that Forecaster.from_run(run, aoti=True) loads in "
                         "seconds, compiling and tuning nothing")
    ap.add_argument("--aoti-batch", type=int, default=1, help="windows per forecast of the AOTInductor package")
    ap.add_argument("--aoti-dtype", choices=("fp32", "bf16", "fp16"),
                    help="autocast of the AOTInductor package (default: bf16 on a GPU, fp32 on a CPU)")
    ap.add_argument("--aoti-tuned", action="store_true",
                    help="tune the package's kernels (coordinate descent, NHWC convolutions): minutes more of "
                         "compilation, once per machine kind, for a faster forecast")
    ap.add_argument("--aoti-motion", choices=("given", "predicted"),
                    help="the package's future ego motion (default: as the run evaluates, train.forecast_motion)")
    ap.add_argument("--trt-version", default="10.3.0", help="TensorRT version in the calibration cache header")
    ap.add_argument("--no-trt", action="store_true",
                    help="skip the TensorRT step (by default: engines where TensorRT and a GPU are "
                         "here, else the trtexec lines to run on the target)")
    a = ap.parse_args(argv)

    import torch

    from wm.export.onnx import (OUTPUTS, WORLD_DIMS, compare, dynamic_shapes, example_inputs, export_graph, graphs,
        world_max_batch, world_profile)
    from wm.checkpoint.trained import find_run, load_trained

    t_start = time.perf_counter()
    torch.set_grad_enabled(False)
    # FP32 means FP32 on the GPU too (the reference every drop is measured against): no TF32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    a.run, a.runs, a.ckpt, a.out = (v and os.path.expanduser(v) for v in (a.run, a.runs, a.ckpt, a.out))  # a quoted ~
    run = Path(a.run) if a.run else find_run(a.runs)
    if a.ckpt:  # the checks the run's own checkpoints get (but its stage, said below): load_trained reads a wm state
        from wm.checkpoint.files import load_checked
        from wm.checkpoint.checks import EVAL_KEYS, problem

        load_checked(a.ckpt, check=lambda p, ckpt_state: problem(ckpt_state, ckpt_state.get("stage") if isinstance(ckpt_state.get("stage"), str)
                                                         else "world", model="own", keys=EVAL_KEYS))
    t = load_trained(run, a.ckpt)
    if a.batch < 1:
        raise WMError(f"--batch must be >= 1, got {a.batch}")
    if a.aoti_tuned and not a.aoti:
        raise WMError("--aoti-tuned tunes the AOTInductor package's kernels: add --aoti")
    if a.aoti and a.aoti_batch < 1:
        raise WMError(f"--aoti-batch must be >= 1, got {a.aoti_batch}")
    if not a.host_memory_gib > 0:
        raise WMError(f"--host-memory-gib must be > 0 (GiB of host memory for the INT8 report), "
                      f"got {a.host_memory_gib}")
    if not 0 <= a.world_max_batch <= a.max_batch:
        raise WMError(f"--world-max-batch must be between 1 and --max-batch ({a.max_batch}), or 0 for its "
                      f"default; got {a.world_max_batch}")
    if a.int8:
        from wm.export.int8 import check_windows

        check_windows(t, a.calib_windows, a.eval_windows)  # one line, before anything long runs
    out = Path(a.out) if a.out else run / "export"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise WMError(f"cannot write the export folder {out} ({e}); choose another with --out") from None
    print(f"exporting {t.ckpt} (tokenizer {t.tokenizer_ckpt}) to {out}")
    progress["out"] = out
    report = {"checkpoint": str(t.ckpt), "tokenizer_checkpoint": str(t.tokenizer_ckpt),
              "data_fingerprint": t.data_fingerprint, "init": t.init, "graphs": {}, "seconds": {}}
    secs = report["seconds"]
    from wm.export.memory import PhasePeaks

    peaks = PhasePeaks()
    ex = {b: example_inputs(t, b, seed=b) for b in (1, 2)}
    programs = {}
    t0 = time.perf_counter()
    mods = graphs(t)
    for i, (name, module) in enumerate(mods.items()):
        path = out / f"{name}.onnx"
        print(f"  exporting {name} ({i + 1}/{len(mods)}) ...", flush=True)
        progress["phase"] = f"the export of {name}"
        # example batch 2: torch.export specialises a dimension whose example size is 1
        s, programs[name] = export_graph(module, ex[2][name], OUTPUTS[name], path,
                                         dynamic_shapes(t, name, ex[2][name], a.max_batch))
        r = {"file": path.name, "bytes": path.stat().st_size, "export_s": round(s, 1),
             "inputs": {k: [str(v.dtype).replace("torch.", ""), ["batch", *([WORLD_DIMS[k]] if name == "world_step" else []),
                                                                 *v.shape[1 + (name == "world_step"):]]]
                        for k, v in ex[1][name].items()},
             "vs_pytorch": {f"batch{b}": compare(module, path, ex[b][name]) for b in (1, 2)}}
        peaks.mark(f"export_{name}")
        progress["done"].append(path.name)
        if a.fp16:
            progress["phase"] = f"the FP16 copy of {name}"
            r["fp16"] = to_fp16(path, out / f"{name}.fp16.onnx", module, ex)
            peaks.mark(f"fp16_{name}")
            progress["done"].append(f"{name}.fp16.onnx")
        report["graphs"][name] = r
        line = "  ".join(f"batch {b}: agree {v['class_agreement']:.4f}" +
                         (f" max|diff| {v['max_abs_diff']:.2e}" if v["max_abs_diff"] is not None else "")
                         for b, v in ((k[-1], v) for k, v in r["vs_pytorch"].items()))
        print(f"{name:<18}{path.stat().st_size / 2**20:7.1f} MiB  {s:6.1f} s   {line}")
        if "fp16" in r:
            f = r["fp16"]["vs_pytorch"]
            print(f"{name + '.fp16':<18}{r['fp16']['bytes'] / 2**20:7.1f} MiB            " + "  ".join(
                f"batch {k[-1]}: agree {v['class_agreement']:.4f}" for k, v in f.items()))
    secs["export_fp32" + ("_fp16" if a.fp16 else "")] = round(time.perf_counter() - t0, 2)
    del ex
    if a.int8:
        from wm.export.int8 import run_int8

        progress["phase"] = "INT8 calibration"
        after = {"int8_histograms": (None, "INT8 thresholds"),
                 "int8_thresholds": (None, "INT8 quantization (the Q/DQ graphs)"),
                 "int8_qdq": ("the INT8 Q/DQ graphs and calibration caches", "the INT8 accuracy report"),
                 "int8_report": ("report.json", "the rest of the export")}

        def mark(phase: str) -> None:
            peaks.mark(phase)
            done, progress["phase"] = after.get(phase, (None, progress["phase"]))
            if done:
                progress["done"].append(done)

        full = run_int8(t, out, a.calib_windows, a.eval_windows, batch=a.batch, trt_version=a.trt_version,
                        engine=a.engine, programs=programs, parity_windows=a.parity_windows, mark=mark,
                        budget_s=60 * a.time_budget, method=a.calib_method, exclude_scopes=a.int8_float,
                        products=a.int8_attention, pose=a.int8_pose, memory_gib=a.host_memory_gib)
        report["int8"] = full["int8"]
        secs.update({f"int8_{k}": v for k, v in full["int8"]["seconds"].items() if k != "total"})
    if not a.no_trt:
        from wm.export.trt_run import deploy

        t0 = time.perf_counter()
        progress["phase"] = "the TensorRT step"
        # the most deployable graphs written: Q/DQ INT8, else FP16, else FP32; a graph --int8-float
        # left wholly float builds from its FP16 file where there is one
        q = report.get("int8", {}).get("graphs", {})
        kinds = {name: ".int8" if a.int8 and (q[name]["nodes_quantized"] or not a.fp16) else
                 ".fp16" if a.fp16 else "" for name in report["graphs"]}
        files = {name: out / f"{name}{kind}.onnx" for name, kind in kinds.items()}
        ex = example_inputs(t, 2, seed=2)  # made again: the world step's held the export's memory
        feeds = {name: {k: v.numpy() for k, v in ex[name].items()} for name in files}
        c = t.cfg
        h, w = ex["world_step"]["codes"].shape[-2:]
        top = a.world_max_batch or world_max_batch(c, h, w, a.max_batch)
        if top < a.max_batch and not a.world_max_batch:
            print(f"note: world_step's TensorRT profile goes to batch {top}, not {a.max_batch}: beyond it its "
                  f"key/value cache of {c.world.max_frames} frames passes 8 GiB (--world-max-batch sets it)")
        report["tensorrt"] = deploy(files, feeds, max_batch=a.max_batch, opt_batch=1,
                                    dims=world_profile(c), max_batches={"world_step": top})
        secs["tensorrt"] = round(time.perf_counter() - t0, 2)
        peaks.mark("tensorrt")
    if a.aoti:
        from wm.export.aoti import build

        progress["phase"] = "the AOTInductor compile"
        t0 = time.perf_counter()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = a.aoti_dtype or ("bf16" if device.type == "cuda" else "fp32")
        given = None if a.aoti_motion is None else a.aoti_motion == "given"
        report["aoti"] = r = build(t, out, device, dtype, a.aoti_batch, given=given, tuned=a.aoti_tuned)
        print(f"{r['file']}  {r['bytes'] / 2**20:.1f} MiB  traced {r['export_s']:.1f} s, compiled {r['compile_s']:.1f} s, "
              f"loads in {r['load_s']:.2f} s; agree {r['class_agreement']:.4f} with PyTorch")
        progress["done"].append(r["file"])
        secs["aoti"] = round(time.perf_counter() - t0, 2)
        peaks.mark("aoti")
    secs["total"] = round(time.perf_counter() - t_start, 2)
    report["memory"] = peak_memory(peaks)
    write_bytes(out / "export.json", json.dumps(report, indent=1))
    m = report["memory"]
    print(f"wrote {out / 'export.json'}  ({secs['total']:.0f} s; peak host memory {m['host_peak_gib']:.1f} GiB"
          + (f", GPU {m['gpu_peak_gib']:.1f} GiB" if "gpu_peak_gib" in m else "") + ")")
    return 0


def to_fp16(src: Path, dst: Path, module, ex) -> dict:
    """FP16 copy of a graph (wm.export.onnx.fp16_model), checked, published atomically, compared."""
    import onnx

    from wm.export.onnx import compare, fp16_model, save_checked

    save_checked(fp16_model(onnx.load(str(src))), dst, full_check=False)
    name = src.stem
    return {"file": dst.name, "bytes": dst.stat().st_size,
            "vs_pytorch": {f"batch{b}": compare(module, dst, ex[b][name]) for b in (1, 2)}}

