"""Which layers of a run's INT8 world step cost its accuracy, and which to keep float.

export.py --int8 quantizes the world step's convolutions and matrix products and its report gives
the drop after decoding, averaged over many windows. This tool looks where a drop comes from, on
the world step's own answer: the codes of the next frames, compared position by position with
those of the FP32 file. On --windows validation windows, the past frames encoded by the FP32
tokenizer, the world step's rollout of --steps frames runs in onnxruntime through

  fp32            the FP32 file (the reference)
  as exported     the export's INT8 file for onnxruntime (.int8-ort.onnx)
  thresholds max  a Q/DQ copy with every activation's threshold at its exact max (nothing clipped)
  float: GROUP    a Q/DQ copy with one group of layers kept float, the others as exported (a
                  group: one module path with its layer indices folded, e.g.
                  world.dec_levels.N.temporal.N.ffn.2, the second FFN linear of every temporal
                  layer of the decoder levels)

and then through copies that keep float the groups that helped most, one more each time, up to
--max-groups, until the codes agree on --target of the positions at every step. The
export.py --int8-float pattern of the smallest such set is printed. The copies use the export's
own thresholds (world_step.calib.json), so no calibration runs again.

    python tools/int8_sensitivity.py --run runs/occworld_20min                 # its export/, 8 windows
    python tools/int8_sensitivity.py --run RUN --windows 16 --steps 2 --json sensitivity.json

Variants run side by side in --workers processes of --threads onnxruntime threads each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.utils.errors import WMError, run_cli  # noqa: E402

GRAPH = "world_step"


def group_key(scope: str) -> str:
    """A module path with its layer indices folded: every numeric component but the last becomes N
    (world.dec_levels.1.temporal.0.ffn.2 -> world.dec_levels.N.temporal.N.ffn.2; the last stays,
    it names the layer within its Sequential)."""
    parts = scope.split(".")
    return ".".join("N" if p.isdigit() and i < len(parts) - 1 else p for i, p in enumerate(parts))


def group_pattern(key: str) -> str:
    """The --int8-float regular expression matching exactly the module paths of a group."""
    return "^" + r"\.".join(r"\d+" if p == "N" else re.escape(p) for p in key.split(".")) + "$"


def float_pattern(kept: str | None, keys) -> str:
    """export.py's --int8-float value: what the export kept float, then the groups."""
    parts = ([kept] if kept else []) + [group_pattern(k) for k in keys]
    return "|".join(parts)


def quantized_groups(fp32, int8) -> dict[str, dict]:
    """{group key: {"nodes": [...], "weights": weight values}} of the nodes the INT8 file quantizes
    (those that read an int8 weight), keyed by their module paths in the FP32 file."""
    from wm.export.qdq import qdq_scales
    from wm.export.quantizable import _scope

    scopes = {n.name: _scope(n) for n in fp32.graph.node}
    shapes = {i.name: math.prod(i.dims) for i in int8.graph.initializer}
    groups: dict[str, dict] = {}
    for w, info in qdq_scales(int8)["weights"].items():
        for node in info["consumers"]:
            sc = scopes.get(node, "")
            if not sc:  # no module path: no --int8-float pattern can name it
                continue
            g = groups.setdefault(group_key(sc), {"nodes": [], "weights": 0})
            g["nodes"].append(node)
            g["weights"] += shapes.get(w, 0)
    return groups


def _rollouts(path, cfg, feeds, steps: int, threads: int) -> np.ndarray:
    """The world step's rollout by the file at `path` over every batch of `feeds` -> codes
    (windows, steps, h, w) int64."""
    import torch

    from wm.export.deployed import OrtGraphs, world_steps

    torch.set_num_threads(threads)  # the cache's copies; several variants share the cores
    run = OrtGraphs({GRAPH: Path(path)}, threads)
    out = []
    with torch.no_grad():
        for codes, motion, future in feeds:
            c, _ = world_steps(run, cfg, torch.from_numpy(codes), torch.from_numpy(motion), steps,
                               None if future is None else torch.from_numpy(future))
            out.append(c[:, codes.shape[1]:].numpy())
    return np.concatenate(out)


def _variant(job: dict) -> tuple[str, np.ndarray, float]:
    """One variant in a worker process: build its Q/DQ copy (unless it is a file already), roll it
    out, delete the copy. Returns (name, codes, seconds)."""
    t0 = time.perf_counter()
    path = job.get("file")
    work = None
    if path is None:
        from wm.export.qdq import cpu_copy, quantize_qdq

        work = Path(tempfile.mkdtemp(prefix="v-", dir=job["work"]))
        (work / "fp32.onnx").symlink_to(Path(job["fp32"]).resolve())  # the quantizer's scratch files land here
        quantize_qdq(work / "fp32.onnx", work / "q.onnx", job["thresholds"], nodes_to_exclude=job["exclude"],
                     exclude_products=not job["products"], exclude_pose=not job["pose"])
        cpu_copy(work / "q.onnx", work / "q-ort.onnx")
        (work / "q.onnx").unlink()
        path = work / "q-ort.onnx"
    try:
        with np.load(job["feeds"], allow_pickle=False) as z:
            n = int(z["n"])
            feeds = [(z[f"codes{i}"], z[f"motion{i}"], z[f"future{i}"] if f"future{i}" in z else None)
                     for i in range(n)]
        codes = _rollouts(path, job["cfg"], feeds, job["steps"], job["threads"])
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return job["name"], codes, time.perf_counter() - t0


def _encode(trained, n_windows: int, batch: int, work: Path, log) -> tuple[Path, int]:
    """Encode the past frames of `n_windows` validation windows with the FP32 tokenizer (PyTorch,
    the GPU if there is one) and save the world step's feeds. Returns (feeds file, windows)."""
    import torch

    from wm.export.collect import batches, windows
    from wm.export.deployed import TorchGraphs
    from wm.export.onnx import graphs

    cfg = trained.cfg
    P, S = cfg.data.past, cfg.data.future
    given = cfg.train.forecast_motion == "given"
    ds, idx, _ = windows(trained, None, cfg.data.val_split, n_windows, "--windows", log)
    run = TorchGraphs({"tokenizer_encode": graphs(trained)["tokenizer_encode"]},
                      "cuda" if torch.cuda.is_available() else "cpu")
    arrays = {}
    with torch.no_grad():
        for i, b in enumerate(batches(ds, idx, batch)):
            occ, motion = b["occ"], b["motion"].float()
            B = len(occ)
            codes = run("tokenizer_encode", occ[:, :P].reshape(B * P, *occ.shape[2:]))[0]
            arrays[f"codes{i}"] = codes.reshape(B, P, *codes.shape[1:]).long().cpu().numpy()
            arrays[f"motion{i}"] = motion[:, :P].numpy()
            if given:
                arrays[f"future{i}"] = motion[:, P:P + S].numpy()
    arrays["n"] = np.array(len(arrays) // (3 if given else 2))
    path = work / "feeds.npz"
    np.savez(path, **arrays)
    return path, len(idx)


def _agree(codes: np.ndarray, ref: np.ndarray) -> list[float]:
    """Fraction of code positions equal to the reference's, per step."""
    return [float((codes[:, s] == ref[:, s]).mean()) for s in range(ref.shape[1])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run folder (export.py --int8 run on it)")
    ap.add_argument("--export", help="export folder (default: <run>/export)")
    ap.add_argument("--windows", type=int, default=8, help="validation windows, spread evenly over the split")
    ap.add_argument("--steps", type=int, default=1,
                    help="future frames rolled out (1: the past frames' call alone, where the drop starts)")
    ap.add_argument("--batch", type=int, default=1, help="windows per world-step call")
    ap.add_argument("--target", type=float, default=0.99,
                    help="codes equal to the FP32 file's, at every step, that the kept-float set must reach")
    ap.add_argument("--max-groups", type=int, default=4, help="the most groups kept float together")
    ap.add_argument("--workers", type=int, default=0, help="variants side by side (0: cores / 4, at least 1)")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime threads per variant (0: cores / workers)")
    ap.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    a = ap.parse_args(argv)
    for k in ("windows", "steps", "batch", "max_groups"):
        if getattr(a, k) < 1:
            raise WMError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if not 0 < a.target <= 1:
        raise WMError(f"--target must be in (0, 1], got {a.target}")

    import onnx

    from wm.export.int8 import kept_float
    from wm.checkpoint.trained import load_trained

    trained = load_trained(a.run)
    cfg = trained.cfg
    exp = Path(a.export) if a.export else Path(a.run) / "export"
    need = [exp / f"{GRAPH}.onnx", exp / f"{GRAPH}.int8.onnx", exp / f"{GRAPH}.int8-ort.onnx",
            exp / f"{GRAPH}.calib.json", exp / "report.json"]
    for p in need:
        if not p.is_file():
            raise WMError(f"{p} does not exist; run export.py --run {a.run} --int8 first")
    try:
        calib = json.loads((exp / f"{GRAPH}.calib.json").read_text())["tensors"]
        cal = json.loads((exp / "report.json").read_text())["int8"]["calibration"]
    except (ValueError, KeyError, TypeError) as e:
        raise WMError(f"{exp}: unreadable {GRAPH}.calib.json or report.json ({type(e).__name__}: {e}); "
                      "run export.py --int8 again") from None
    kept, products = cal.get("kept_float"), cal.get("activation_products") == "int8"
    pose = cal.get("pose_path", "int8") == "int8"  # an export from before the pose path's rule quantized it
    fp32, int8 = onnx.load(str(need[0])), onnx.load(str(need[1]), load_external_data=False)
    groups = quantized_groups(fp32, int8)
    if not groups:
        raise WMError(f"{need[1]} quantizes no layer with a module path; nothing to look for")
    total_w = sum(g["weights"] for g in groups.values()) or 1
    # what the export kept float by its --int8-float pattern (e.g. the tokenizer's: none of this graph)
    base_float = kept_float({GRAPH: fp32}, kept, require_match=False)[GRAPH]
    del fp32, int8

    cores = os.cpu_count() or 1
    workers = a.workers or max(1, cores // 4)
    threads = a.threads or max(1, cores // workers)
    thresholds = {t: float(v["amax"]) for t, v in calib.items()}
    at_max = {t: float(v["max"]) for t, v in calib.items()}
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="wm-int8-sensitivity-"))
    try:
        feeds, n = _encode(trained, a.windows, a.batch, work, print)
        print(f"{GRAPH}: {n} validation windows, {a.steps} step(s), {len(groups)} groups of quantized layers, "
              f"{workers} variants side by side x {threads} threads")
        common = {"fp32": str(need[0]), "products": products, "pose": pose, "work": str(work), "feeds": str(feeds),
                  "cfg": cfg, "steps": a.steps, "threads": threads}

        def job(name, file=None, th=thresholds, extra=()):
            return {**common, "name": name, "file": None if file is None else str(file), "thresholds": th,
                    "exclude": sorted({*base_float, *extra})}

        jobs = [job("fp32", need[0]), job("as exported", need[2]), job("thresholds max", th=at_max)]
        jobs += [job(f"float: {k}", extra=g["nodes"]) for k, g in groups.items()]
        ctx = get_context("spawn")  # no fork of a process whose torch/OpenMP threads are running
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            res = {name: (codes, sec) for name, codes, sec in pool.map(_variant, jobs)}
            ref = res["fp32"][0]
            agree = {k: _agree(c, ref) for k, (c, _) in res.items() if k != "fp32"}
            base = agree["as exported"]
            gain = {k: [x - y for x, y in zip(agree[f"float: {k}"], base)] for k in groups}
            order = sorted(groups, key=lambda k: (-gain[k][0], -sum(gain[k])))
            cum = {1: agree[f"float: {order[0]}"]}
            more = [job(f"together: {i}", extra=[node for k in order[:i] for node in groups[k]["nodes"]])
                    for i in range(2, min(a.max_groups, len(order)) + 1)]
            for name, codes, sec in pool.map(_variant, more):
                cum[int(name.split(": ")[1])] = _agree(codes, ref)
                res[name] = (codes, sec)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reach = [i for i in sorted(cum) if min(cum[i]) >= a.target]
    pick = reach[0] if reach else max(cum, key=lambda i: (min(cum[i]), -i))
    chosen = order[:pick]

    def pct(xs):
        return "  ".join(f"{100 * x:7.3f}" for x in xs)

    steps_h = "  ".join(f"{'t+' + str(s + 1):>7}" for s in range(a.steps))
    print(f"\ncodes equal to the FP32 file's, % of positions        weights float  {steps_h}")
    print(f"{'as exported':<54}{0.0:12.1f} %  {pct(base)}")
    print(f"{'thresholds max (nothing clipped)':<54}{0.0:12.1f} %  {pct(agree['thresholds max'])}")
    for k in order:
        print(f"{'float: ' + k:<54}{100 * groups[k]['weights'] / total_w:12.1f} %  {pct(agree['float: ' + k])}")
    print("\nthe groups that helped most, kept float together:")
    for i in sorted(cum):
        w = sum(groups[k]["weights"] for k in order[:i]) / total_w
        print(f"{'+ ' + order[i - 1]:<54}{100 * w:12.1f} %  {pct(cum[i])}")
    pattern = float_pattern(kept, chosen)
    verdict = (f"the first {pick} reach {100 * a.target:g} % at every step" if reach else
               f"no set of up to {a.max_groups} groups reaches {100 * a.target:g} % at every step; the best "
               f"is the first {pick}")
    print(f"\n{verdict}: python export.py --run {a.run} --int8 --int8-float '{pattern}'")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json:
        out = {"run": str(a.run), "export": str(exp), "graph": GRAPH, "windows": n, "steps": a.steps,
               "workers": workers, "threads": threads, "cpu_count": cores, "kept_float": kept,
               "activation_products": "int8" if products else "float", "pose_path": "int8" if pose else "float",
               "target": a.target,
               "agreement": {"as exported": base, "thresholds max": agree["thresholds max"]},
               "groups": {k: {"nodes": len(groups[k]["nodes"]),
                              "weights_fraction": groups[k]["weights"] / total_w,
                              "agreement": agree[f"float: {k}"], "pattern": group_pattern(k)} for k in order},
               "together": [{"groups": order[:i], "agreement": cum[i],
                             "weights_fraction": sum(groups[k]["weights"] for k in order[:i]) / total_w}
                            for i in sorted(cum)],
               "reached": bool(reach), "int8_float": pattern,
               "seconds": {k: round(s, 2) for k, (_, s) in res.items()},
               "seconds_total": round(time.perf_counter() - t0, 2)}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
