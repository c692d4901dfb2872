"""GPU self-check: is this machine (driver, CUDA, NCCL, Triton, torch) fit to train wm? One table,
one row per check, PASS / FAIL / SKIP with a one-line reason; exit status 1 if any row fails. Where
no CUDA GPU is visible it says so in one line at once and exits with status 2, checking nothing
(--device cpu runs the checks that have a CPU meaning, on request).

    python tools/gpu_check.py                                   # about 4 minutes on one host
    python tools/gpu_check.py --data /data/occ3d_nuscenes       # also the shard read speed of a data set
    python tools/gpu_check.py --cfg configs/occworld.json --set data.grid=64,64,16   # other models
    python tools/gpu_check.py --device cpu --backend aot_eager  # the same steps on a CPU (gloo; its tests)

Each row is printed as soon as it is known, then the whole table.

Rows:
  versions    torch, CUDA, cuDNN, NCCL, Triton and the GPUs (name, memory)
  cuda tests  `pytest -m cuda tests` (the tests marked cuda: the Triton kernels
              against their references, the sync-free step, pinned checkpoint copies, the forecast as
              one CUDA graph), in a subprocess beside the step checks (--tests-timeout from the start)
  steps       one training step of each stage (wm.training.loop.train_step, as fit runs it) eager and
              torch.compile'd from the same weights and batch, on one device: the loss and the gradient
              norm must agree within --loss-tol / --grad-tol (relative); the compiled step's first call
              (compilation included) is timed. Then "captured": the same steps compiled with and without
              compile.cuda_graphs (wm/training/step_graph.py; warm-up, capture, replays), each loss within
              --loss-tol; on CUDA the step must have been captured
  ddp steps   the same under DDP on --ranks processes (torchrun, NCCL; gloo on a CPU) when that many
              GPUs exist, in 1 MiB gradient buckets (several, as at the occworld sizes with 100 MiB);
              also fails if DDP warns that a gradient's strides differ from its bucket view's (a copy
              per step)
  all-reduce  NCCL all-reduce bus bandwidth (GB/s) of --allreduce-mib MiB among those ranks
  reads       random windows/s and MB/s read from --data (wm's dataset: the path training uses)

The steps run on a small synthetic data set written to a temporary folder, with the models of --cfg
(default: the demo's) at their data.grid; each step check runs in its own process, so a CUDA error
is a FAIL row, not the end of the check. Tolerances: bf16 rounds differently in eager kernels and in
Inductor's fused ones (about 1e-3 of the loss at initialisation); a wrong layout or a lost gradient
is off by far more. The children inherit the environment (NCCL_* settings included).
"""

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wm.utils import distributed  # noqa: E402
from wm.utils.errors import WMError, first_line, run_cli  # noqa: E402

CHECKS = ("versions", "tests", "steps", "ddp", "allreduce", "reads")
RESULT = "GPUCHECK "  # a worker's result line


def graph_warmup() -> int:
    """The captured step's uncaptured warm-up steps (imported when needed: wm's models take seconds
    to import, and a machine without a GPU is told so at once)."""
    from wm.training.step_graph import WARMUP

    return WARMUP


def graph_steps() -> int:
    """The steps of the captured check: the warm-up, then the capture and two replays."""
    return graph_warmup() + 3


# ---------------------------------------------------------------------------------------------
# rows


def row(name: str, status: str, detail: str) -> dict:
    return {"check": name, "status": status, "detail": detail}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(device: str) -> dict:
    parts = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda or 'none'}"]
    if torch.backends.cudnn.is_available():
        parts.append(f"cuDNN {torch.backends.cudnn.version()}")
    try:
        import triton

        parts.append(f"Triton {triton.__version__}")
    except ImportError:
        parts.append("Triton none")
    # zstd shards (the default compression) and the tests' data sets need it: say so up front
    parts.append("hdf5plugin " + (_version("hdf5plugin") or "none (zstd shards unreadable: pip install -r requirements.txt)"))
    if device == "cpu":
        return row("versions", "PASS", ", ".join(parts) + f"; CPU {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores (--device cpu)")
    if not torch.cuda.is_available():
        return row("versions", "FAIL", ", ".join(parts) + "; no CUDA device is visible (driver, "
                   "CUDA_VISIBLE_DEVICES, or a CPU build of torch)")
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    parts.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    names = {}
    for g in gpus:
        key = f"{g.name} {g.total_memory / 2**30:.0f} GiB sm_{g.major}{g.minor}"
        names[key] = names.get(key, 0) + 1
    return row("versions", "PASS", ", ".join(parts) + "; " + ", ".join(f"{n}x {k}" for k, n in names.items()))


def start_cuda_tests(device: str):
    """`pytest -m cuda tests` started in the background (it runs beside the step checks); None on a CPU."""
    if device == "cpu":
        return None
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "cuda", "tests", "-p", "no:cacheprovider"]
    # wide lines: pytest cuts its summary lines (and with them the error's message) to the terminal
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def cuda_tests(proc, timeout: float) -> dict:
    """The row of start_cuda_tests' run, waiting at most `timeout` seconds more for it."""
    if proc is None:
        return row("cuda tests", "SKIP", "no CUDA here: the tests marked cuda are skipped (pytest -m cuda)")
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return row("cuda tests", "FAIL", "pytest -m cuda did not end in time")
    out = stdout.strip().splitlines()
    summary = out[-1] if out else stderr.strip()[-200:]
    if proc.returncode == 5:  # none collected: no Triton, and no other CUDA test ran
        return row("cuda tests", "FAIL", f"no CUDA test was collected ({summary})")
    if proc.returncode != 0:
        first = first_failure(out) or stderr.strip()[-200:]
        r = row("cuda tests", "FAIL", f"{summary}; first: {first}")
        r["output"] = "\n".join(out)[-8000:]  # into --json: the failures in full
        return r
    return row("cuda tests", "PASS", summary)


def first_failure(lines: list[str]) -> str:
    """pytest's first short-summary line, 'tests/x.py::test - Error: message', with the test's path
    and the error's message kept (the middle is what gets cut)."""
    for ln in lines:
        if ln.startswith(("FAILED ", "ERROR ")):
            text = ln.split(" ", 1)[1]
            return text if len(text) <= 360 else text[:200] + " ... " + text[-155:]
    return ""


def reads(data: str, cfg, seconds: float) -> dict:
    """Random windows of `data` through OccWindows (shards -> dataset, as training reads them)."""
    from wm.config.sections import DataConfig
    from wm.data.windows import OccWindows
    from wm.data.shards import load_manifest

    try:
        m = load_manifest(data)
        split = cfg.data.train_split if m.split(cfg.data.train_split) else m.shards[0]["split"]
        info = m.info
        dc = DataConfig(grid=info.grid, num_classes=info.num_classes, free_class=info.free_class,
                        past=cfg.data.past, future=cfg.data.future, stride=cfg.data.stride,
                        train_split=split)
        ds = OccWindows(data, split, dc)
        rng = np.random.default_rng(0)
        ds[int(rng.integers(len(ds)))]  # opening the shards is not read speed
        n, t0, nbytes = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds and n < 2000:
            nbytes += ds[int(rng.integers(len(ds)))]["occ"].numel()
            n += 1
        dt = time.perf_counter() - t0
    except (WMError, OSError) as e:
        return row("reads", "FAIL", f"{data}: {first_line(str(e))}")
    return row("reads", "PASS", f"{n / dt:.1f} windows/s, {nbytes / dt / 1e6:.0f} MB/s of occupancy "
               f"({dc.window}-frame windows of split {split!r}, 1 process, {len(ds)} windows)")


# ---------------------------------------------------------------------------------------------
# the step checks: a worker process (alone, or one of --ranks under torchrun)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "tools" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(a) -> int:
    """Each stage: one step eager, one compiled, same weights and batch; with --allreduce-mib the
    bus bandwidth. Rank 0 prints one RESULT line."""
    import wm.training.main as T
    import wm.training.wrappers as W
    from wm.config.loading import load as load_config
    from wm.checkpoint.run_folder import Run
    from wm.training.stages import TokenizerStage, WorldStage

    B = load_bench()
    cfg = load_config(a.cfg, a.set)
    dist = distributed.init(cfg.train.device, cfg.ddp.timeout_s)
    out: dict = {"stages": {}, "world_size": dist.world_size}
    try:
        device = dist.device
        dtype = T.amp_dtype(cfg, device)
        if a.backend != "inductor":  # CPU tests: the same capture, without Inductor's compile time
            import wm.training.loop as L

            real = W.compiled
            # the loop holds its own reference to wrappers.compiled: both are replaced
            W.compiled = L.compiled = lambda ddp, c, inductor=None, steps=None: (
                torch.compile(ddp, backend=a.backend) if W.compiles(c, device) else real(ddp, c, inductor, steps))
        run = Run(cfg, dist)
        run.say = lambda *x, **k: None
        for name in cfg.train.stages:
            if name == "world":
                B.ensure_tokenizer_checkpoint(run, dist)
            res = {}
            # eager and compiled: one step each from the same weights and batch; compiled and graphed:
            # the same graph_steps() steps uncaptured and captured (the last ones replayed graphs)
            # (on a CPU the graphed steps run uncompiled against the eager ones: one compile fewer)
            cuda = device.type == "cuda"
            for mode in ("eager", "compiled", "graphed"):
                c = copy.deepcopy(cfg)
                c.compile.enable = mode == "compiled" or mode == "graphed" and cuda
                c.compile.cuda_graphs = mode == "graphed"
                vrun = copy.copy(run)
                vrun.cfg = c
                stage = TokenizerStage(vrun) if name == "tokenizer" else WorldStage(vrun, device, dtype)
                runner = B.Runner(stage, c, dist, device, dtype)
                losses = []
                try:
                    with warnings.catch_warnings(record=True) as seen:
                        warnings.simplefilter("always")
                        t0 = time.perf_counter()
                        r = runner.step()
                        loss, gnorm = float(r.terms["loss"]), float(r.grad_norm)
                        took = time.perf_counter() - t0
                        losses.append(loss)
                        for _ in range(graph_steps() - 1 if mode == "graphed" or (mode == "compiled") == cuda else 0):
                            losses.append(float(runner.step().terms["loss"]))
                    graphed = runner.graphed and runner.run_step.graphs is not None
                finally:
                    runner.close()
                strides = [first_line(str(w.message)) for w in seen if "bucket view strides" in str(w.message)]
                res[mode] = {"loss": loss, "grad_norm": gnorm, "seconds": took, "stride_warnings": strides,
                             "losses": losses, "captured": graphed}
            out["stages"][name] = res
        if a.allreduce_mib > 0 and dist.active:
            out["allreduce"] = allreduce_busbw(dist, a.allreduce_mib)
        run.log.close()
        run.close()
    finally:
        distributed.close(dist)
    if dist.is_main:
        print(RESULT + json.dumps(out), flush=True)
    # End before this frame frees the DDP reducers and with them the gloo group: its destructor joins
    # its threads holding the GIL while one may need the GIL to free a tensor of the last collective
    # (a deadlock seen on a loaded 2-core CPU). The result line is out; nothing else is owed.
    sys.stderr.flush()
    os._exit(0)


def allreduce_busbw(dist: distributed.Dist, mib: float) -> dict:
    """NCCL-tests' bus bandwidth of an fp32 all-reduce: bytes / time x 2 (n - 1) / n, best of the timed runs."""
    t = torch.ones(int(mib * 2**20 / 4), device=dist.device)
    sync = torch.cuda.synchronize if dist.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        distributed.all_reduce_(t, dist)
    sync()
    best = math.inf
    for _ in range(10 if dist.device.type == "cuda" else 3):
        t0 = time.perf_counter()
        distributed.all_reduce_(t, dist)
        sync()
        best = min(best, time.perf_counter() - t0)
    n = dist.world_size
    return {"mib": mib, "seconds": best, "busbw_gbs": t.numel() * 4 / best * 2 * (n - 1) / n / 1e9}


def step_rows(label: str, res: dict, a) -> list[dict]:
    """PASS/FAIL rows of a worker's result: loss and gradient norm of compiled vs eager per stage."""
    rows = []
    for name, r in res["stages"].items():
        e, c = r["eager"], r["compiled"]
        dl = abs(c["loss"] - e["loss"]) / max(abs(e["loss"]), 1e-12)
        dg = abs(c["grad_norm"] - e["grad_norm"]) / max(abs(e["grad_norm"]), 1e-12)
        warn = e["stride_warnings"] + c["stride_warnings"]
        text = (f"loss {e['loss']:.5g} eager / {c['loss']:.5g} compiled (rel {dl:.1e}), grad norm "
                f"{e['grad_norm']:.5g} / {c['grad_norm']:.5g} (rel {dg:.1e}); compiled first step {c['seconds']:.1f} s")
        ok = dl <= a.loss_tol and dg <= a.grad_tol and all(map(math.isfinite, (e["loss"], c["loss"])))
        if warn:
            ok, text = False, f"DDP: {warn[0][:120]}; " + text
        elif not ok:
            text = f"beyond --loss-tol {a.loss_tol:g} / --grad-tol {a.grad_tol:g}: " + text
        rows.append(row(f"{label} {name}", "PASS" if ok else "FAIL", text))
        g = r.get("graphed")
        if g:  # the captured step against the same steps uncaptured (compiled on CUDA, eager on a CPU)
            c = c if len(c["losses"]) > 1 else e
            worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(g["losses"], c["losses"]))
            ok = worst <= a.loss_tol and len(g["losses"]) == len(c["losses"]) and all(map(math.isfinite, g["losses"]))
            how = (f"steps {graph_warmup() + 1}-{len(g['losses'])} replayed as CUDA graphs" if g["captured"]
                   else "not captured (no GPU: the captured step's code ran as it is)")
            text = (f"{len(g['losses'])} steps, losses {' '.join(f'{x:.5g}' for x in g['losses'])} vs uncaptured "
                    f"{' '.join(f'{x:.5g}' for x in c['losses'])} (worst rel {worst:.1e}); {how}")
            if not ok:
                text = f"beyond --loss-tol {a.loss_tol:g}: " + text
            elif a.device == "cuda" and not g["captured"]:
                ok, text = False, "the step was not captured on CUDA: " + text
            rows.append(row(f"{label} {name} captured", "PASS" if ok else "FAIL", text))
    return rows


def run_worker(a, work: Path, ranks: int, tag: str) -> tuple:
    """The worker in a subprocess (torchrun when ranks > 1): (its result or None, the last lines)."""
    args = ["--worker", "--backend", a.backend, "--allreduce-mib", str(a.allreduce_mib if ranks > 1 else 0)]
    if a.cfg:
        args += ["--cfg", a.cfg]
    # 1 MiB DDP buckets: several, as at the occworld sizes with 100 MiB; no coordinate-descent
    # tuning: it searches block sizes for a minute and changes no result
    sets = ["ddp.bucket_mib=1", "compile.tokenizer_tuning=false"] + list(a.set) + [
        f"data.root={work / 'data'}", f"run.out_dir={work / tag}", "run.name=check",
                          f"train.device={a.device}", "logging.tensorboard=false", "logging.images=false",
                          "loader.num_workers=0", f"tokenizer_stage.batch_size={a.batch}",
                          f"world_stage.batch_size={a.batch}", "tokenizer_stage.grad_accum=1",
                          "world_stage.grad_accum=1", "tokenizer_stage.global_batch=0", "world_stage.global_batch=0"]
    for kv in sets:
        args += ["--set", kv]
    script = str(Path(__file__).resolve())
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), script, *args]
    else:
        cmd = [sys.executable, script, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # NCCL_* and the like pass through
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.step_timeout)
        text = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, f"did not end within {a.step_timeout:.0f} s (--step-timeout); last output: {tail(text)}"
    for ln in text.splitlines():
        if ln.startswith(RESULT):
            return json.loads(ln[len(RESULT):]), ""
    return None, f"exit status {r.returncode}: {tail(text)}"


def tail(text: str) -> str:
    """The most telling line of a failed child's output: its error, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|error:|CUDA error|Exception)", ln)]
    return (errs[-1] if errs else lines[-1] if lines else "(no output)")[:240]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(work: Path, a) -> None:
    """A small synthetic data set at the config's grid: enough windows for --batch on --ranks ranks."""
    from wm.config.loading import load as load_config
    from wm.data.synthetic.generate import write_synthetic

    cfg = load_config(a.cfg, a.set)
    write_synthetic(work / "data", train_scenes=2 * max(a.ranks, 1), val_scenes=1,
                    frames=cfg.data.span + 2 * a.batch, grid=tuple(cfg.data.grid), kind="memmap", style="blocks")


def table(rows: list[dict]) -> str:
    w = max(len(r["check"]) for r in rows)
    return "\n".join(f"{r['check']:<{w}}  {r['status']:<4}  {r['detail']}" for r in rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default) or cpu: the step, DDP (gloo), all-reduce and read checks on this CPU, "
                         "skipping what has no CPU meaning (minutes; without a GPU only on request)")
    ap.add_argument("--cfg", help="config whose models and grid the steps use (default: the demo's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--data", help="a data set folder whose read speed to measure (reads row; else skipped)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"subset of {','.join(CHECKS)}")
    ap.add_argument("--ranks", type=int, default=2, help="DDP processes of the ddp and all-reduce rows")
    ap.add_argument("--batch", type=int, default=2, help="samples per rank of the step checks")
    ap.add_argument("--loss-tol", type=float, default=2e-2, help="relative loss difference allowed, compiled vs eager")
    ap.add_argument("--grad-tol", type=float, default=5e-2, help="relative gradient-norm difference allowed")
    ap.add_argument("--allreduce-mib", type=float, default=256.0, help="all-reduce size (MiB, fp32)")
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend of the steps (inductor, what training uses; aot_eager for quick CPU tests)")
    ap.add_argument("--step-timeout", type=float, default=240.0, help="seconds each step check may take")
    ap.add_argument("--tests-timeout", type=float, default=300.0,
                    help="seconds from the start the CUDA tests (run beside the step checks) may take")
    ap.add_argument("--read-seconds", type=float, default=5.0, help="seconds of reading in the reads row")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.checks = [c for c in a.checks.split(",") if c]
    bad = [c for c in a.checks if c not in CHECKS]
    if bad:
        ap.error(f"unknown check {bad}; choose from {','.join(CHECKS)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    if a.device == "cuda" and not torch.cuda.is_available():  # before any import of wm's models: at once
        raise WMError(f"no CUDA GPU is visible here (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}): "
                      "nothing to check; run it on the GPU machine, or pass --device cpu to run the step, DDP (gloo), "
                      "all-reduce and read checks on this CPU (minutes)")
    from wm.config.loading import load as load_config

    cfg = load_config(a.cfg, a.set)  # a bad --cfg / --set is one line before anything runs
    t_start = time.perf_counter()
    rows: list[dict] = []

    def add(*new: dict) -> None:  # each row as soon as it is known: a check cut short keeps the others
        for r in new:
            rows.append(r)
            print(f"{r['check']:<16}  {r['status']:<4}  {r['detail']}  [{time.perf_counter() - t_start:.0f} s]",
                  flush=True)

    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    ranks_ok = a.device == "cpu" or gpus >= a.ranks
    if "versions" in a.checks:
        add(versions(a.device))
    tests = start_cuda_tests(a.device) if "tests" in a.checks else None  # beside the step checks
    want = [c for c in ("steps", "ddp", "allreduce") if c in a.checks]
    if want and a.device == "cuda" and not gpus:
        add(*[row(c, "FAIL", "no CUDA device") for c in want])
        want = []
    work = Path(tempfile.mkdtemp(prefix="wm-gpu-check-"))
    try:
        if want:
            make_data(work, a)
        if "steps" in want:
            res, why = run_worker(a, work, 1, "one")
            add(*(step_rows("steps 1 " + a.device, res, a) if res else [row("steps", "FAIL", why)]))
        if ("ddp" in want or "allreduce" in want) and not ranks_ok:
            add(*[row(c, "SKIP", f"{gpus} GPU(s): fewer than --ranks {a.ranks}")
                  for c in ("ddp", "allreduce") if c in want])
        elif "ddp" in want or "allreduce" in want:
            res, why = run_worker(a, work, a.ranks, "ddp")
            label = f"ddp {a.ranks}x{a.device}"
            if res is None:
                add(row(label, "FAIL", why))
            else:
                if "ddp" in want:
                    add(*step_rows(label, res, a))
                if "allreduce" in want:
                    bw = res.get("allreduce")
                    add(row("all-reduce", "PASS", f"{bw['busbw_gbs']:.1f} GB/s bus bandwidth, "
                            f"{bw['mib']:g} MiB fp32 on {a.ranks} ranks "
                            f"({'NCCL' if a.device == 'cuda' else 'gloo'}), best of the timed runs")
                        if bw else row("all-reduce", "FAIL", "no figure came back"))
        if "reads" in a.checks:
            add(reads(a.data, cfg, a.read_seconds) if a.data else
                row("reads", "SKIP", "give --data DIR to time a data set's reads"))
        if "tests" in a.checks:
            add(cuda_tests(tests, a.tests_timeout - (time.perf_counter() - t_start)))
            tests = None
    finally:
        if tests is not None and tests.poll() is None:
            tests.kill()
            tests.communicate()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    failed = [r for r in rows if r["status"] == "FAIL"]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows pass or skip, {len(failed)} fail "
          f"({time.perf_counter() - t_start:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    run_cli(main)
