"""Forecast latency and throughput: what a deployment waits for, per precision and engine.

    python tools/bench_infer.py --cfg configs/occworld.json --json benchmarks/infer.json        # GPU rows
    python tools/bench_infer.py --cfg configs/occworld.json --occworld ~/OccWorld --json b.json  # + OccWorld's code
    python tools/bench_infer.py --run runs/occworld --export runs/occworld/export --modes ort-fp32,ort-fp16,ort-int8
    python tools/bench_infer.py --set data.grid=16,16,4 ... --device cpu --modes fp32,bf16,ort-fp32  # CPU check

One forecast: the past frames (data.past) encoded, the world model rolled over the data.future
future frames, the codes decoded and the argmax taken; inputs are past occupancy (uint8, already on
the device) and 4x4 poses (numpy), the future ego motion given. Rows (--modes):

- fp32, bf16, bf16-compile, bf16-cudagraphs, bf16-graph, bf16-compile-graph,
  bf16-compile-tuned-graph (Inductor's coordinate-descent tuning and NHWC layouts, as the
  tokenizer trains): PyTorch through
  wm.Forecaster (the world model's key/value cache; bf16 = autocast; compile = torch.compile of
  encode, world step and decode; cudagraphs = torch.compile mode "reduce-overhead"; graph = the
  whole forecast recorded as one CUDA graph, Forecaster(cuda_graph=True): its phases are one,
  "forecast"), on --device;
- fp32-aoti, bf16-aoti, bf16-aoti-graph, bf16-aoti-tuned-graph: the whole forecast compiled ahead
  of time (export.py --aoti's package, wm/export/aoti.py, built here at batch 1 into a temporary
  folder; the row holds its trace, compile and load seconds; tuned: export.py --aoti-tuned) run by
  Forecaster(aoti_dir=...), with graph as one CUDA graph;
- ort-fp32, ort-fp16, ort-int8: onnxruntime on the CPU, the exported graphs (--export folder:
  export.py's files; without one the FP32 and FP16 graphs are exported to a temporary folder, INT8
  needs export.py --int8) run by the deployed host loop wm.export.deployed.forecast (its step graph
  takes and returns the key/value cache: each step after the first runs one frame; INT8 runs
  onnxruntime's copies, .int8-ort.onnx);
- occworld-fp32 (and occworld-bf16, autocast): OccWorld's released model code from --occworld PATH
  at its own config's sizes, its evaluation forward (tools/occworld_harness.py).

Each row: batch-1 latency (median and p90 of --iters forecasts after --warmup, wall clock to the
result on the host side of a synchronize), the best throughput over the batch sweep (batch / median
latency), and the batch-1 phases, each from the previous mark to its own (CUDA events on a GPU,
perf_counter on the CPU), so they add up to the forecast: inputs (checks, poses -> ego motion, to
the device), encode, step_1..step_S, decode (+ argmax), outputs. Weights: the run's (--run) or
random ones of the config (the time does not depend on them). --json writes every forecast's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.utils.errors import WMError, first_line, run_cli  # noqa: E402

TORCH_MODES = {"fp32": ("fp32", None, False), "bf16": ("bf16", None, False),
               "bf16-compile": ("bf16", "default", False), "bf16-cudagraphs": ("bf16", "reduce-overhead", False),
               "bf16-graph": ("bf16", None, True), "bf16-compile-graph": ("bf16", "default", True),
               "bf16-compile-tuned-graph": ("bf16", "default", True)}
# Inductor options of a tuned row: the training tokenizer's (compile.tokenizer_tuning, tokenizer_channels_last)
TUNED = {"bf16-compile-tuned-graph": {"coordinate_descent_tuning": True, "force_layout_optimization": True}}
# the whole forecast compiled ahead of time (wm/export/aoti.py) at batch 1: (dtype, one CUDA graph)
AOTI_MODES = {"fp32-aoti": ("fp32", False), "bf16-aoti": ("bf16", False), "bf16-aoti-graph": ("bf16", True),
              "bf16-aoti-tuned-graph": ("bf16", True)}
ORT_MODES = {"ort-fp32": "", "ort-fp16": ".fp16", "ort-int8": ".int8-ort"}  # onnxruntime's INT8 copy
OCCWORLD_MODES = {"occworld-fp32": "fp32", "occworld-bf16": "bf16"}
ALL_MODES = (*TORCH_MODES, *AOTI_MODES, *ORT_MODES, *OCCWORLD_MODES)


# ---------------------------------------------------------------------------------------------
# timing


class Clock:
    """The phase marks of one forecast: CUDA events on a GPU (no synchronisation between phases),
    perf_counter on the CPU. A phase lasts from the previous mark to its own; "step" marks are
    numbered step_1, step_2...; repeated names (decode chunks) add up."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks = []
        self.t0 = time.perf_counter()
        self.first = self._now()

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def stop(self) -> tuple[float, dict]:
        """(wall ms of the forecast, {phase: ms})."""
        if self.cuda:
            torch.cuda.synchronize()
        total = (time.perf_counter() - self.t0) * 1e3
        phases, prev, steps = {}, self.first, 0
        for name, m in self.marks:
            if name == "step":
                steps += 1
                name = f"step_{steps}"
            phases[name] = phases.get(name, 0.0) + (prev.elapsed_time(m) if self.cuda else (m - prev) * 1e3)
            prev = m
        return total, phases


def measure(fn, clock: Clock, iters: int, warmup: int) -> dict:
    """Time fn(mark) `iters` times after `warmup` calls: every forecast's total and phases (ms)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        clock.start()
        fn(clock.mark)
        clock.stop()
    warm_s = time.perf_counter() - t0
    totals, phases = [], []
    for _ in range(iters):
        clock.start()
        fn(clock.mark)
        tot, ph = clock.stop()
        totals.append(round(tot, 4))
        phases.append({k: round(v, 4) for k, v in ph.items()})
    med = float(np.median(totals))
    return {"warmup_s": round(warm_s, 2), "median_ms": round(med, 3),
            "p90_ms": round(float(np.percentile(totals, 90)), 3),
            "phases_median_ms": {k: round(float(np.median([p[k] for p in phases])), 3) for k in phases[0]},
            "total_ms": totals, "phases_ms": phases}


def sweep(name: str, make_fn, batches, clock: Clock, iters: int, warmup: int, say) -> dict:
    """One row: measure(make_fn(batch)) for every batch; the sweep stops at the first batch that fails
    (out of memory, say), keeping the smaller ones."""
    row = {"mode": name, "status": "ok", "batches": {}}
    for b in batches:
        try:
            r = measure(make_fn(b), clock, iters, warmup)
        except Exception as e:  # out of memory, or a compile failure at this size: keep the smaller batches
            if not row["batches"]:
                raise
            why = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else f"{type(e).__name__}: {first_line(e)}"
            row["batches"][str(b)] = {"error": why}
            torch.cuda.empty_cache()
            say(f"  {name} batch {b}: {why}; the sweep stops here")
            break
        r["forecasts_per_s"] = round(b / (r["median_ms"] / 1e3), 3)
        row["batches"][str(b)] = r
        say(f"  {name:<16} batch {b:>3}: median {r['median_ms']:9.2f} ms  p90 {r['p90_ms']:9.2f} ms  "
            f"{r['forecasts_per_s']:9.2f} forecasts/s  (warm-up {r['warmup_s']:.1f} s)")
    ok = {int(b): r for b, r in row["batches"].items() if "median_ms" in r}
    if ok:
        best = max(ok, key=lambda b: ok[b]["forecasts_per_s"])
        row["best_throughput"] = {"forecasts_per_s": ok[best]["forecasts_per_s"], "batch": best}
        if 1 in ok:
            row["latency_ms"] = {"median": ok[1]["median_ms"], "p90": ok[1]["p90_ms"]}
            row["phases_ms"] = ok[1]["phases_median_ms"]
    return row


# ---------------------------------------------------------------------------------------------
# inputs and engines


def straight_poses(batch: int, frames: int) -> np.ndarray:
    """(B, frames, 4, 4) ego->global poses of a car driving straight at 5 m per frame."""
    p = np.tile(np.eye(4), (batch, frames, 1, 1))
    p[..., 0, 3] = 5.0 * np.arange(frames)
    return p


def past_occupancy(cfg, batch: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(batch)
    return torch.randint(0, cfg.data.num_classes, (batch, cfg.data.past, *cfg.data.grid), generator=g,
                         device=device).to(torch.uint8)


def models(a, cfg):
    """(cfg, tokenizer, world, where the weights come from): the run's, or random ones of cfg."""
    if a.run:
        from wm.checkpoint.trained import load_trained

        t = load_trained(a.run, a.ckpt)
        return t.cfg, t.tokenizer, t.world, f"run {a.run} ({t.ckpt})"
    from wm.config.sections import model_options
    from wm.models.tokenizer import Tokenizer
    from wm.models.world import WorldModel

    torch.manual_seed(0)
    tok = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **model_options(cfg, "tokenizer"))
    world = WorldModel(cfg.world, cfg.tokenizer.codebook_size, **model_options(cfg, "world"))
    return cfg, tok.eval(), world.eval(), "random (no run given)"


def export_graphs(cfg, tok, world, out: Path, say) -> dict:
    """FP32 and FP16 ONNX graphs of the models into `out` (as export.py writes them); seconds taken."""
    import onnx

    from wm.export.onnx import OUTPUTS, dynamic_shapes, example_inputs, export_graph, fp16_model, graphs, save_checked
    from wm.checkpoint.trained import Trained

    t = Trained(cfg, tok.cpu(), world.cpu(), None, None, "")
    t0 = time.perf_counter()
    ex = example_inputs(t, 2)  # batch 2: torch.export specialises a dimension whose example size is 1
    for name, module in graphs(t).items():
        say(f"  exporting {name} to {out} ...")
        path = out / f"{name}.onnx"
        export_graph(module, ex[name], OUTPUTS[name], path, dynamic_shapes(t, name, ex[name], 64))
        save_checked(fp16_model(onnx.load(str(path))), out / f"{name}.fp16.onnx", full_check=False)
    return {"export_s": round(time.perf_counter() - t0, 1)}


def ort_engine(files: dict, threads: int):
    """wm.export.deployed.OrtGraphs over `files` with onnxruntime's defaults (memory arena on: the
    export report turns it off to bound its memory, a deployment keeps it) and `threads` threads."""
    import onnxruntime as ort

    from wm.export.deployed import OrtGraphs

    class Ort(OrtGraphs):
        def session(self, name):
            if name not in self.sessions:
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                self.sessions[name] = ort.InferenceSession(str(self.files[name]), so,
                                                           providers=["CPUExecutionProvider"])
            return self.sessions[name]

    return Ort(files, threads)


# ---------------------------------------------------------------------------------------------
# the rows


def torch_rows(a, cfg, tok, world, device, modes, done, say) -> None:
    from wm.forecaster import Forecaster

    for mode in modes:
        dtype, compile_mode, graph = TORCH_MODES[mode]
        if compile_mode is not None:
            torch._dynamo.reset()  # each compiled row compiles its own graphs
        if graph and device.type != "cuda":
            done({"mode": mode, "engine": "pytorch CUDA graph", "status": "skipped: CUDA graphs need a GPU"})
            continue
        f = Forecaster(cfg, tok, world, device, dtype, compile_mode, cuda_graph=graph, inductor=TUNED.get(mode))
        given = cfg.train.forecast_motion == "given"

        def make(b, f=f):
            occ = past_occupancy(cfg, b, device)
            poses = straight_poses(b, cfg.data.past + cfg.data.future)
            past, fut = poses[:, :cfg.data.past], poses[:, cfg.data.past:] if given else None
            return lambda mark: f(occ, past, future_poses=fut, on_phase=mark)

        engine = f"pytorch {device.type} {dtype}" + (f", torch.compile {compile_mode}" if compile_mode else "") \
            + (", tuned kernels" if mode in TUNED else "") \
            + (", one CUDA graph" if graph else "")
        batches = a.compile_batches if compile_mode else a.batches
        done(guarded(mode, engine, lambda: sweep(mode, make, batches, Clock(device.type == "cuda"), a.iters,
                                                 a.warmup, say), say))


def aoti_rows(a, cfg, tok, world, device, done, say) -> None:
    """Each AOTInductor mode: the package built for batch 1 (its trace, compile and load seconds in
    the row), then timed through Forecaster(aoti_dir=...) as a deployment runs it."""
    from types import SimpleNamespace

    from wm.export.aoti import build
    from wm.forecaster import Forecaster

    given = cfg.train.forecast_motion == "given"
    for mode in [m for m in a.modes if m in AOTI_MODES]:
        dtype, graph = AOTI_MODES[mode]
        if graph and device.type != "cuda":
            done({"mode": mode, "engine": "AOTInductor, one CUDA graph", "status": "skipped: CUDA graphs need a GPU"})
            continue
        tuned = "tuned" in mode
        engine = (f"AOTInductor package {device.type} {dtype}" + (", tuned kernels" if tuned else "")
                  + (", one CUDA graph" if graph else ""))

        def row(dtype=dtype, graph=graph, mode=mode, tuned=tuned):
            with tempfile.TemporaryDirectory(prefix="bench_infer_aoti_") as folder:
                trained = SimpleNamespace(cfg=cfg, tokenizer=tok, world=world, ckpt=None, tokenizer_ckpt=None)
                built = build(trained, Path(folder), device, dtype, batch=1, given=given, say=say, tuned=tuned)
                f = Forecaster(cfg, tok, world, device, dtype, cuda_graph=graph, aoti_dir=Path(folder))
                occ = past_occupancy(cfg, 1, device)
                poses = straight_poses(1, cfg.data.past + cfg.data.future)
                past, fut = poses[:, :cfg.data.past], poses[:, cfg.data.past:] if given else None
                r = sweep(mode, lambda b: (lambda mark: f(occ, past, future_poses=fut, on_phase=mark)), [1],
                          Clock(device.type == "cuda"), a.iters, a.warmup, say)
                return {**r, "aoti": built}

        done(guarded(mode, engine, row, say))


def ort_rows(a, cfg, tok, world, done, say) -> dict:
    from wm.export.int8_report import graph_files
    from wm.forecaster import prepare_inputs
    from wm.export.deployed import forecast

    modes = [m for m in a.modes if m in ORT_MODES]
    info: dict = {}
    if not modes:
        return info
    folder, tmp = Path(a.export) if a.export else None, None
    if folder is None and a.run and graph_files(Path(a.run) / "export")["world_step"].is_file():
        folder = Path(a.run) / "export"
    if folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_infer_")
        folder = Path(tmp.name)
        info.update(export_graphs(cfg, tok, world, folder, say))
    elif not folder.is_dir():
        raise WMError(f"--export {folder} does not exist: give export.py's output folder (<run>/export)")
    info["folder"] = str(folder) if tmp is None else "temporary (FP32 + FP16 exported by this tool)"
    try:
        for mode in modes:
            files = graph_files(folder, ORT_MODES[mode])
            missing = [p.name for p in files.values() if not p.is_file()]
            engine = f"onnxruntime CPU, {a.threads} threads"
            if missing:
                why = "export.py --int8 writes them" if mode == "ort-int8" else "export.py --fp16 writes them" \
                    if mode == "ort-fp16" else "export.py writes them"
                done({"mode": mode, "engine": engine, "status": f"skipped: {missing[0]} not in {folder} ({why})"})
                say(f"  {mode}: skipped ({missing[0]} not in {folder})")
                continue
            g = ort_engine(files, a.threads)
            given = cfg.train.forecast_motion == "given"

            def make(b, g=g):
                occ = past_occupancy(cfg, b, "cpu")
                poses = straight_poses(b, cfg.data.past + cfg.data.future)
                past, fut = poses[:, :cfg.data.past], poses[:, cfg.data.past:] if given else None
                names = {"tokenizer_encode": "encode", "world_step": "step", "tokenizer_decode": "decode"}

                def run(mark):
                    o, m, fm, *_ = prepare_inputs(cfg, torch.device("cpu"), occ, past, fut)
                    mark("inputs")

                    def timed(name, *x):
                        out = g(name, *x)
                        mark(names[name])
                        return out

                    forecast(timed, cfg, o, m, fm)
                    mark("outputs")
                return run

            done(guarded(mode, engine, lambda: sweep(mode, make, a.ort_batches, Clock(False), a.ort_iters, 1, say),
                         say))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return info


def occworld_rows(a, device, done, say) -> dict:
    modes = [m for m in a.modes if m in OCCWORLD_MODES]
    if not modes:
        return {}
    if not a.occworld:
        raise WMError(f"--modes {','.join(modes)} time OccWorld's own code: give its checkout with --occworld PATH")
    import occworld_harness as H

    info = H.load(a.occworld)
    mcfg = H.small(info["model"]) if a.occworld_small else info["model"]
    model = H.build(mcfg, device)
    meta = {"checkout": info["root"], "shims": info["shims"], "frames": list(info["frames"]),
            "grid": list(H.grid(mcfg)), "params": sum(p.numel() for p in model.parameters()),
            "size": "small (harness check)" if a.occworld_small else "its config/occworld.py"}
    say(f"OccWorld from {info['root']}: {meta['params'] / 1e6:.1f} M parameters, grid {meta['grid']}, frames "
        f"{info['frames']} (start, mid, end), shims: {', '.join(info['shims']) or 'none'}")
    for mode in modes:
        amp = OCCWORLD_MODES[mode]

        def make(b, amp=amp):
            x, metas = H.inputs(mcfg, info["frames"], b, device)

            def run(mark):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    H.forecast(model, x, metas, info["frames"], mark)
            return run

        engine = f"OccWorld's code, {device.type} {amp}" + (" (its eval: fp32)" if amp == "fp32" else " autocast")
        done(guarded(mode, engine, lambda: sweep(mode, make, a.occworld_batches, Clock(device.type == "cuda"),
                                                 a.iters, a.warmup, say), say))
    return meta


def guarded(mode: str, engine: str, fn, say) -> dict:
    """A row, or the reason it failed (one line here, the traceback in the JSON): the other rows go on."""
    try:
        row = fn()
    except WMError:
        raise
    except Exception as e:  # a compile or engine failure of one row is a finding, not the end of the run
        say(f"  {mode}: failed: {type(e).__name__}: {first_line(e)}")
        row = {"mode": mode, "status": f"failed: {type(e).__name__}: {first_line(e)}",
               "traceback": traceback.format_exc()}
    row["engine"] = engine
    return row


# ---------------------------------------------------------------------------------------------
# report


def machine(device, threads: int) -> dict:
    from wm.export.int8_report import this_cpu

    cpu, flags = this_cpu()
    out = {"cpu": cpu if cpu != "unknown" else platform.processor() or platform.machine(), "cpu_flags": flags,
           "cpu_cores_usable": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "ort_threads": threads,
           "cudnn_benchmark": torch.backends.cudnn.benchmark,
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    try:
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    return out


def fmt(v, w=9, d=2) -> str:
    return f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"


def table(rep: dict) -> str:
    c, m = rep["forecast"], rep["machine"]
    lines = [f"forecast latency: {c['config']} (grid {'x'.join(map(str, c['grid']))}, {c['past']} past -> "
             f"{c['future']} future frames, {c['motion']} ego motion), weights {c['weights']}",
             f"  {m.get('gpu', 'no GPU')}; CPU {m['cpu']}, {m['cpu_cores_usable']} cores usable; torch "
             f"{m['torch']}" + (f", onnxruntime {m['onnxruntime']} ({m['ort_threads']} threads)" if "onnxruntime" in m
                                else "")]
    phases = []
    for r in rep["rows"]:
        for k in r.get("phases_ms", {}):
            if k not in phases:
                phases.append(k)
    head = f"  {'mode':<16}{'batch-1 ms':>10}{'p90':>9}{'best/s':>9}{'@b':>4}  " + "".join(
        f"{k.replace('step_', 's'):>8}" for k in phases) + "   engine"
    lines += ["", "  latency (median, p90) at batch 1; best throughput (forecasts/s) over the batch sweep @ its batch;",
              "  phases at batch 1 (median ms; s1..sN = world-model steps; they add up to the latency):", head]
    for r in rep["rows"]:
        if r["status"] != "ok":
            lines.append(f"  {r['mode']:<16}{r['status']}")
            continue
        lat, best = r.get("latency_ms", {}), r.get("best_throughput", {})
        cells = "".join(fmt(r.get("phases_ms", {}).get(k), 8, 2) for k in phases)
        lines.append(f"  {r['mode']:<16}{fmt(lat.get('median'), 10)}{fmt(lat.get('p90'))}"
                     f"{fmt(best.get('forecasts_per_s'))}{best.get('batch', '-'):>4}  {cells}   {r['engine']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", help="config of the models to time with random weights (default: the demo)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--run", help="a trained run folder: its models and config instead of --cfg")
    ap.add_argument("--ckpt", help="with --run: this world-model checkpoint instead of the best")
    ap.add_argument("--export", help="export.py's folder of .onnx files for the ort-* rows (default: <run>/export, "
                                     "else FP32 + FP16 exported to a temporary folder)")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="PyTorch rows' device")
    ap.add_argument("--modes", help=f"comma-separated rows out of {', '.join(ALL_MODES)} (default: the PyTorch "
                                    "rows the device runs, the ort-* rows, and occworld-* with --occworld)")
    ap.add_argument("--batches", default="1,4,16", help="batch sweep of the eager PyTorch rows")
    ap.add_argument("--compile-batches", default="1,16",
                    help="batch sweep of the compiled rows (each batch size after the first compiles once more)")
    ap.add_argument("--occworld-batches", default="1,4", help="batch sweep of OccWorld's rows (its eval: batch 1)")
    ap.add_argument("--ort-batches", default="1,4", help="batch sweep of the onnxruntime rows")
    ap.add_argument("--iters", type=int, default=20, help="timed forecasts per batch")
    ap.add_argument("--warmup", type=int, default=3, help="untimed forecasts first (compilation happens here)")
    ap.add_argument("--ort-iters", type=int, default=5, help="timed forecasts per batch of the onnxruntime rows")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime threads (default: every usable core)")
    ap.add_argument("--occworld", metavar="PATH", help="a checkout of wzzheng/OccWorld: time its model code too")
    ap.add_argument("--occworld-small", action="store_true",
                    help="build OccWorld's model at a small size (a CPU check of the harness, not a benchmark)")
    ap.add_argument("--json", help="write the figures (every forecast's total and phases) here")
    a = ap.parse_args(argv)

    from wm.utils.atomic import write_bytes
    from wm.config.loading import load

    if a.device == "cuda" and not torch.cuda.is_available():
        raise WMError("--device cuda: no CUDA device here; use --device cpu")
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    sweeps = ("batches", "compile_batches", "occworld_batches", "ort_batches")
    try:
        for k in sweeps:
            setattr(a, k, [int(b) for b in getattr(a, k).split(",")])
    except ValueError:
        raise WMError("--*batches: give batch sizes separated by commas, e.g. 1,4,16") from None
    if min(min(getattr(a, k)) for k in sweeps) < 1 or a.iters < 1 or a.warmup < 0 or a.ort_iters < 1:
        raise WMError("--*batches, --iters and --ort-iters must be >= 1, --warmup >= 0")
    if a.modes:
        a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        bad = [m for m in a.modes if m not in ALL_MODES]
        if bad:
            raise WMError(f"--modes: {bad[0]!r} is not one of {', '.join(ALL_MODES)}")
    else:
        a.modes = ["fp32", "bf16"] + (["bf16-graph", "bf16-compile", "bf16-compile-graph"]
                                      if device.type == "cuda" else []) \
            + list(ORT_MODES) + (list(OCCWORLD_MODES) if a.occworld else [])
    a.threads = a.threads or len(os.sched_getaffinity(0))
    if a.occworld:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    say = lambda *x: print(*x, flush=True)  # noqa: E731

    if a.run and (a.cfg or a.set):
        raise WMError("--cfg / --set describe models with random weights; with --run the run's own config is used")
    cfg, tok, world, weights = models(a, None if a.run else load(a.cfg, a.set))
    torch.backends.cudnn.benchmark = True  # as OccWorld's evaluation sets it, for every row
    if hasattr(torch._dynamo.config, "recompile_limit"):  # every batch size of the sweep compiles its graphs
        torch._dynamo.config.recompile_limit = 64
    rep = {"forecast": {"config": a.run or a.cfg or "demo", "grid": list(cfg.data.grid), "past": cfg.data.past,
                        "future": cfg.data.future, "motion": cfg.train.forecast_motion, "weights": weights},
           "machine": machine(device, a.threads), "argv": sys.argv[1:] if argv is None else list(argv), "rows": []}
    say(f"timing {', '.join(a.modes)} on {device} ({rep['machine'].get('gpu', rep['machine']['cpu'])})")

    def save():
        if a.json:
            try:
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                write_bytes(a.json, json.dumps(rep, indent=1) + "\n")
            except OSError as e:
                raise WMError(f"cannot write {a.json} ({e}); choose another path with --json") from None

    def done(row):  # the JSON after every row: a run cut short keeps what it measured
        rep["rows"].append(row)
        save()

    # cheap rows first, the compiled ones (minutes of compilation) after
    torch_rows(a, cfg, tok, world, device, [m for m in a.modes if TORCH_MODES.get(m, (0, 1, 0))[1] is None], done, say)
    rep["occworld"] = occworld_rows(a, device, done, say)
    torch_rows(a, cfg, tok, world, device, [m for m in a.modes if TORCH_MODES.get(m, (0, None, 0))[1]], done, say)
    aoti_rows(a, cfg, tok, world, device, done, say)
    rep["onnx"] = ort_rows(a, cfg, tok, world, done, say)
    save()
    print(table(rep))
    if a.json:
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
