"""Do a run's INT8 files compute the same on every x86 CPU class?

onnxruntime picks its integer kernels by the CPU it runs on (AMX, AVX-512 VNNI, or AVX2 alone,
whose kernels add pairs of int8 products in int16 and saturate). This tool runs each INT8 file
three ways on the inputs of real rollouts and reports, per graph, how many outputs agree:

  native   onnxruntime's integer kernels on this CPU
  emulated the same kernels under qemu's model of another CPU (--cpu, default Haswell: AVX2 and FMA,
           no AVX-512, no VNNI; qemu answers onnxruntime's CPUID as that CPU would)
  onnx     the file's ONNX semantics (Q/DQ as float ops, what TensorRT's file defines), on this CPU

and, as the yardstick, native_vs_1ulp: the native run again with every float input one ulp up. A
trained model's argmax over its codes can move that much on a last-bit change, which every float
kernel of another CPU class makes; a CPU class that agrees about as well differs by float rounding
alone, one that agrees much less computes something else (e.g. saturated int8 products).

    python tools/int8_cpus.py --run runs/demo                          # its export/, 8 validation windows
    python tools/int8_cpus.py --run runs/demo --cpu Skylake-Client --windows 16 --json cpus.json
    python tools/int8_cpus.py --run runs/occworld --windows 1 --batch 1 --calls-per-graph 1   # a large model
    python tools/int8_cpus.py --run runs/occworld --windows 1 --graphs world_step              # its INT8 graph only
    python tools/int8_cpus.py --run runs/occworld --windows 1 --batch 1 --calls-per-graph 1 \
        --graphs world_step --files int8-ort --save calls/     # record here, then on any other machine:
    python tools/int8_cpus.py --replay calls/                  # no run folder or dataset needed there

Both INT8 files are run (`--files`): `.int8-ort.onnx` (onnxruntime's copy: the same values as uint8 with zero
point 128, whose integer products are exact on every x86 CPU; its float layers differ by CPU class
in the last bits, as an FP32 model's do) and `.int8.onnx` (TensorRT's: int8, which onnxruntime's kernels
without VNNI saturate). The rollouts run
natively through the export's host loop (onnxruntime's kernels, `.int8-ort.onnx`), every graph call's
inputs are saved, and each way runs them all again in one process that imports only numpy and
onnxruntime. Codes compare as they are, the decoder's class logits by their argmax over the classes,
float outputs (the world step's ego motion and cache rows) by their largest difference. Needs
qemu-x86_64 (Debian, Ubuntu: apt-get install qemu-user) and `export.py --int8` run first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.utils.atomic import write_bytes  # noqa: E402
from wm.utils.errors import WMError, run_cli  # noqa: E402

KINDS = {".int8-ort": "onnxruntime's copy (.int8-ort.onnx)", ".int8": "TensorRT's file (.int8.onnx)"}

# One way over every saved call: numpy and onnxruntime only, so that it starts in seconds under qemu.
# argv: calls.json, "int8" (integer kernels), "ulp" (the same, float inputs one ulp up) or "float"
# (Q/DQ as float ops), output folder.
_RUN = r"""
import json, sys, numpy as np, onnxruntime as ort
calls, mode, out = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
sessions = {}
for i, (graph, model, feed) in enumerate(calls):
    if model not in sessions:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.enable_cpu_mem_arena = False
        if mode == "float":
            so.add_session_config_entry("session.disable_quant_qdq", "1")
        sessions[model] = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    with np.load(feed) as z:
        feed = dict(z)
    if mode == "ulp":  # every float input one ulp up: how far the model itself moves the outputs
        feed = {k: np.nextafter(v, np.inf).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in feed.items()}
    outs = sessions[model].run(None, feed)
    if graph == "tokenizer_decode":  # class logits: the class each voxel gets
        outs = [o.argmax(1).astype(np.uint8) if o.dtype.kind == "f" else o for o in outs]
    np.savez(f"{out}/{i:05d}.npz", *outs)
"""


def record_calls(run_dir: Path, export: Path, windows: int, batch: int, folder: Path, log,
                 graphs=None, per_graph: int = 0) -> tuple[list, int]:
    """Roll out `windows` validation windows with the `.int8-ort` files natively, saving the inputs
    of every call of `graphs` (default: all), the first `per_graph` of each (0: all), under
    `folder` (a world step's key/value cache is 0.6 GB at the occworld size): ([(graph, feed path)], windows)."""
    from wm.export.collect import batches, windows as pick
    from wm.export.deployed import OrtGraphs, forecast
    from wm.checkpoint.trained import load_trained
    from wm.export.int8_report import CPU_INT8, graph_files

    trained = load_trained(run_dir)
    cfg = trained.cfg
    calls: list = []

    seen: dict = {}

    class Recorder(OrtGraphs):
        def __call__(self, name, *inputs):
            s = self.session(name)
            feed = {i.name: x.detach().cpu().numpy() for i, x in zip(s.get_inputs(), inputs)}
            seen[name] = seen.get(name, 0) + 1
            if (graphs is None or name in graphs) and (not per_graph or seen[name] <= per_graph):
                path = folder / f"feed-{len(calls):05d}.npz"
                np.savez(path, **feed)
                calls.append((name, str(path)))
            return tuple(torch.from_numpy(np.ascontiguousarray(o)) for o in s.run(None, feed))

    run = Recorder(graph_files(export, CPU_INT8))
    ds, idx, _ = pick(trained, None, cfg.data.val_split, windows, "--windows", log)
    P, given = cfg.data.past, cfg.train.forecast_motion == "given"
    for b in batches(ds, idx, batch):
        occ, motion = b["occ"], b["motion"]
        forecast(run, cfg, occ[:, :P], motion[:, :P], motion[:, P:] if given else None)
    return calls, len(idx)


def run_way(calls: list, files: dict, mode: str, qemu: list, folder: Path) -> None:
    """Every call through `files` ({graph: model}) in one process (under `qemu` if given)."""
    folder.mkdir()
    spec = folder.with_suffix(".json")
    spec.write_text(json.dumps([(g, str(files[g]), feed) for g, feed in calls]))
    r = subprocess.run(qemu + [sys.executable, "-c", _RUN, str(spec), mode, str(folder)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WMError(f"onnxruntime {'under ' + ' '.join(qemu) if qemu else 'on this CPU'} ({mode}) failed: {tail[0]}"
                      + (" (qemu-x86_64 -cpu help lists its CPU models)" if qemu else ""))


def compare(calls: list, a: Path, b: Path) -> dict:
    """{graph: {"agree": fraction of equal integer outputs, "elements", "calls", "max_abs_diff" of
    float outputs (or None)}} between two ways' outputs of the same calls."""
    out: dict = {}
    for i, (graph, _) in enumerate(calls):
        r = out.setdefault(graph, {"equal": 0, "elements": 0, "calls": 0, "max_abs_diff": None})
        r["calls"] += 1
        with np.load(a / f"{i:05d}.npz") as x, np.load(b / f"{i:05d}.npz") as y:
            for k in x.files:
                u, v = x[k], y[k]
                if u.dtype.kind == "f":
                    d = float(np.abs(u.astype(np.float64) - v).max()) if u.size else 0.0
                    r["max_abs_diff"] = d if r["max_abs_diff"] is None else max(r["max_abs_diff"], d)
                else:
                    r["equal"] += int((u == v).sum())
                    r["elements"] += int(u.size)
    for r in out.values():
        r["agree"] = r.pop("equal") / r["elements"] if r["elements"] else None
    return out


def save(folder: Path, calls: list, n: int, files: dict, meta: dict) -> None:
    """Copy the calls' INT8 files ({kind: {graph: path}}) beside their saved inputs in `folder` and
    describe them in folder/calls.json, every path relative, so the folder replays anywhere."""
    copied: dict = {}
    for kind, by_graph in files.items():
        for g in sorted({g for g, _ in calls}):
            shutil.copy2(by_graph[g], folder / by_graph[g].name)
            copied.setdefault(kind, {})[g] = by_graph[g].name
    spec = dict(meta, windows=n, calls=[(g, Path(f).name) for g, f in calls], files=copied)
    write_bytes(folder / "calls.json", json.dumps(spec, indent=1) + "\n")


def load_saved(folder: Path) -> tuple[list, dict, dict]:
    """A --save folder's (calls with absolute feed paths, {kind: {graph: path}}, its description)."""
    try:
        spec = json.loads((folder / "calls.json").read_text())
        calls = [(g, str(folder / f)) for g, f in spec["calls"]]
        files = {k: {g: folder / f for g, f in v.items()} for k, v in spec["files"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WMError(f"--replay {folder}: not a folder that int8_cpus.py --save wrote ({e}); save one with "
                      f"--run <run> --save {folder}")
    for p in [Path(f) for _, f in calls] + [p for v in files.values() for p in v.values()]:
        if not p.is_file():
            raise WMError(f"--replay {folder}: {p.name} is missing; copy the whole folder that --save wrote")
    return calls, files, spec


def need_qemu(cpu: str) -> list:
    """The command that runs a program as qemu's `cpu` model would, or a one-line refusal."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise WMError("qemu-x86_64 is not installed; it runs onnxruntime as another CPU would "
                      "(Debian, Ubuntu: apt-get install qemu-user)")
    return [qemu, "-cpu", cpu]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a trained run folder")
    ap.add_argument("--export", help="its export folder (default: <run>/export)")
    ap.add_argument("--cpu", default="Haswell", help="qemu's CPU model to compare with (qemu-x86_64 -cpu help)")
    ap.add_argument("--windows", type=int, default=8, help="validation windows rolled out (0: all)")
    ap.add_argument("--batch", type=int, default=4, help="windows per rollout")
    ap.add_argument("--calls-per-graph", type=int, default=0,
                    help="run again only the first N calls of each graph (0: all): under qemu an occworld-size "
                         "call took 3 to 10 minutes on 2 cores")
    ap.add_argument("--graphs", default="tokenizer_encode,world_step,tokenizer_decode",
                    help="run again only these graphs' calls (comma-separated): export.py keeps the tokenizer "
                         "float by default, and under qemu its calls take most of the time")
    ap.add_argument("--files", default="int8-ort,int8",
                    help="which INT8 files (comma-separated): int8-ort (onnxruntime's copy), int8 (TensorRT's)")
    ap.add_argument("--save", metavar="DIR",
                    help="only record: the calls' inputs and INT8 files into DIR (new or empty), for --replay "
                         "on another machine (one without the run, or of another CPU class)")
    ap.add_argument("--replay", metavar="DIR", help="run the calls a --save wrote into DIR, instead of --run's")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    from wm.export.int8_report import GRAPHS, graph_files, this_cpu

    graphs = [g for g in a.graphs.split(",") if g]
    if not graphs or set(graphs) - set(GRAPHS):
        raise WMError(f"--graphs {a.graphs!r}: name some of {', '.join(GRAPHS)}")
    kinds = ["." + k for k in a.files.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        raise WMError(f"--files {a.files!r}: name some of int8-ort, int8")
    if a.windows < 0 or a.batch < 1 or a.calls_per_graph < 0:
        raise WMError("--windows and --calls-per-graph must be >= 0 (0: all) and --batch >= 1")
    if (a.run is None) == (a.replay is None) or (a.save and a.replay):
        raise WMError("give --run <run> (with --save DIR to only record), or --replay DIR alone")
    say = lambda *x: print(*x, flush=True)  # noqa: E731
    name, flags = this_cpu()
    if a.replay:
        qemu = need_qemu(a.cpu)
        calls, files, spec = load_saved(Path(a.replay))
        calls = [c for c in calls if c[0] in graphs]
        files = {k: v for k, v in files.items() if k in kinds}
        if not files or not calls:
            raise WMError(f"--replay {a.replay} holds {', '.join(spec['files'])} files of "
                          f"{', '.join(sorted({g for g, _ in spec['calls']}))} calls; "
                          "ask for those with --files, --graphs")
        keep = ("run", "export", "calls_per_graph", "recorded_on")
        return ways(calls, files, spec["windows"], qemu, name, flags, say,
                    {k: spec.get(k) for k in keep}, a.json)
    run_dir = Path(a.run)
    export = Path(a.export) if a.export else run_dir / "export"
    for kind in kinds:
        for f in graph_files(export, kind).values():
            if not f.is_file():
                raise WMError(f"{f} does not exist; run export.py --run {run_dir} --int8 first")
    files = {k: graph_files(export, k) for k in kinds}
    if a.save:
        folder = Path(a.save)
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise WMError(f"--save {folder}: exists and is not an empty folder; name a new one")
        folder.mkdir(parents=True, exist_ok=True)
        calls, n = record_calls(run_dir, export, a.windows, a.batch, folder, say, graphs, a.calls_per_graph)
        save(folder, calls, n, files, {"run": str(run_dir), "export": str(export),
                                       "calls_per_graph": a.calls_per_graph or None,
                                       "recorded_on": {"cpu": name, "flags": flags,
                                                       "onnxruntime": __import__("onnxruntime").__version__}})
        mib = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        say(f"saved {len(calls)} calls of {n} windows and their INT8 files in {folder} ({mib:.0f} MiB); "
            f"on another machine: python tools/int8_cpus.py --replay {folder}")
        return 0
    qemu = need_qemu(a.cpu)  # before the rollout, not after it
    with tempfile.TemporaryDirectory(prefix="wm-int8-cpus-") as tmp:
        calls, n = record_calls(run_dir, export, a.windows, a.batch, Path(tmp), say, graphs, a.calls_per_graph)
        return ways(calls, files, n, qemu, name, flags, say,
                    {"run": str(run_dir), "export": str(export), "calls_per_graph": a.calls_per_graph or None}, a.json)


def ways(calls: list, files: dict, n: int, qemu: list, name: str, flags: list, say, where: dict,
         json_out=None) -> int:
    """Run `calls` the three ways and the yardstick for each kind of `files` ({kind: {graph: file}}),
    the emulated way under `qemu` ([qemu-x86_64, -cpu, model]); print the table, write `json_out`."""
    from wm.export.int8_report import GRAPHS

    emulated = " ".join(["qemu", *qemu[1:]])
    say(f"{n} windows rolled out: {len(calls)} graph calls, each run natively ({name}), "
        f"under {emulated}, as its ONNX semantics, and natively one ulp up")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="wm-int8-cpus-ways-") as tmp:
        for kind, by_graph in files.items():
            d = Path(tmp) / kind.strip(".")
            d.mkdir()
            run_way(calls, by_graph, "int8", [], d / "native")
            run_way(calls, by_graph, "int8", qemu, d / "emulated")
            run_way(calls, by_graph, "float", [], d / "onnx")
            run_way(calls, by_graph, "ulp", [], d / "ulp")
            rows[kind] = {"file": KINDS[kind],
                          "native_vs_emulated": compare(calls, d / "native", d / "emulated"),
                          "native_vs_1ulp": compare(calls, d / "native", d / "ulp"),
                          "native_vs_onnx": compare(calls, d / "native", d / "onnx"),
                          "emulated_vs_onnx": compare(calls, d / "emulated", d / "onnx")}
    rep = dict(where, windows=n, calls=len(calls), graphs=[g for g in GRAPHS if any(c == g for c, _ in calls)],
               cpu={"native": name, "native_flags": flags, "emulated": emulated},
               onnxruntime=__import__("onnxruntime").__version__, rows=rows)
    print(table(rep))
    if json_out:
        write_bytes(json_out, json.dumps(rep, indent=1) + "\n")
        print(f"wrote {json_out}")
    return 0


def table(rep: dict) -> str:
    """One line per file, pair of ways and graph: the agreement of codes / classes, the float
    outputs' largest difference."""
    lines = [f"INT8 files on two CPU classes: native = {rep['cpu']['native']} "
             f"({', '.join(rep['cpu']['native_flags']) or 'no AVX2'}), emulated = {rep['cpu']['emulated']}, "
             f"onnx = Q/DQ as float ops; {rep['windows']} windows, {rep['calls']} calls"
             + (f" (recorded on {rep['recorded_on']['cpu']})" if rep.get("recorded_on") else ""),
             f"{'file':<16} {'pair':<20} {'graph':<18} {'agree':>8} {'float max|diff|':>17}"]
    for kind, row in rep["rows"].items():
        for pair in ("native_vs_emulated", "native_vs_1ulp", "native_vs_onnx", "emulated_vs_onnx"):
            for g, r in row[pair].items():
                agree = f"{100 * r['agree']:7.3f}%" if r["agree"] is not None else f"{'-':>8}"
                diff = f"{r['max_abs_diff']:17.3g}" if r["max_abs_diff"] is not None else f"{'-':>17}"
                lines.append(f"{kind.strip('.') + '.onnx':<16} {pair:<20} {g:<18} {agree} {diff}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
