"""A grid of train.py runs: one run folder per combination, queued over the GPUs (or CPU slots).

    python tools/sweep.py --cfg base.json --grid tokenizer_stage.lr=1e-3,3e-3 --grid world_stage.lr=1e-3,3e-4 \
        --out runs/sweep1                                     # every visible GPU, one run each
    python tools/sweep.py ... --gpus 0,1,2,3 --per-gpu 2      # two runs share each GPU
    python tools/sweep.py ... --ranks-per-run 2               # each run on 2 GPUs (torchrun): 2 at once on 4
    python tools/sweep.py ... --jobs 2 --set train.device=cpu # no GPUs: 2 runs at once, the cores split
    python tools/sweep.py ... --slurm                         # write <out>/sweep.sbatch (a job array), run nothing
    python tools/sweep.py --grid 'tokenizer.widths=[8,8],[16,16]' ...   # list values: in brackets

The runs are the Cartesian product of the --grids (the last varies fastest). Each is `train.py
[--cfg base.json] --set <each --set> --set <its grid values> --set run.out_dir=<out> --set
run.name=<name>` in the sweep's working folder, its output appended to `<out>/logs/<name>.log`.
The name is `<key>-<value>` per grid joined by `__`, each value as written: `tokenizer_stage.lr-1e-3__
world_stage.lr-3e-4`. Characters other than letters, digits and `._+-` become `_`, and such a value
gets `~` and 6 hex digits of its SHA-1 (names stay unique); a name over 200 bytes is cut to 191 and
ends in `~` and 8 hex digits of the whole.

Where: `--gpus` ids (default: every GPU torch sees; ids index CUDA_VISIBLE_DEVICES where set) in
groups of `--ranks-per-run`, each group running `--per-gpu` runs at once, CUDA_VISIBLE_DEVICES naming
it. Without GPUs, or with `--jobs N`: N runs at once (default 1: a CPU run uses every core), with
CUDA_VISIBLE_DEVICES empty. Unless OMP_NUM_THREADS is set, each rank gets cores / ranks at once (>= 1).

The same command again skips finished runs and resumes the others from their checkpoints (train.py
resumes a run folder given the same command; a folder still in use, e.g. by a killed sweep's run that
is saving, is waited for). `<out>/sweep.json` records the base config (path, SHA-256), the grids and
the sets: another sweep into the same --out is refused, and `<out>/sweep.lock` keeps out a second
one at once. SIGTERM/SIGINT: every run's process group gets SIGTERM (train.py saves a checkpoint and
exits; torchrun passes it on), the sweep waits for them and exits 128+signal. A run also gets SIGTERM
when the sweep dies, even by kill -9 (Linux: PR_SET_PDEATHSIG). Exit status: 0 all finished, 1 a run
failed, 2 a refused command line. At the end, the runs table (tools/runs.py).

--slurm: `<out>/sweep.sbatch`, one array task per run; task I runs `tools/sweep.py --task I --out
<out>`, which takes run I from sweep.json and skips it when finished: the same rule.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from wm.utils import runlock  # noqa: E402
from wm.utils.atomic import write_bytes  # noqa: E402
from wm.utils.errors import ArgParser, ConfigError, Stopped, WMError, first_line, run_cli  # noqa: E402

SWEEP_LOCK = runlock.Use("sweep.lock", "sweep folder", "sweep lock", "that sweep", "choose another --out",
                         "choose a writable --out", keep=True)
SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")
MAX_NAME = 200
OWN = ("run.out_dir", "run.name")  # the sweep sets these itself
IDENTITY = ("cfg", "cfg_sha256", "grids", "sets")  # what makes a sweep folder the same sweep


def parse_args(argv):
    ap = ArgParser(prog="tools/sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", help="base config JSON (default: the built-in demo)")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                    help="values of one config key to sweep (repeatable: the runs are their product)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every run")
    ap.add_argument("--out", required=True, help="folder of the sweep's run folders, logs and sweep.json")
    ap.add_argument("--gpus", help="GPU ids to use, e.g. 0,1,2,3 (default: every visible GPU)")
    ap.add_argument("--per-gpu", type=int, help="runs at once on each GPU (group) (default 1)")
    ap.add_argument("--ranks-per-run", type=int, default=1, help="GPUs (torchrun ranks) per run (default 1)")
    ap.add_argument("--jobs", type=int, help="without GPUs: runs at once (default 1); --slurm: array tasks at once")
    ap.add_argument("--slurm", action="store_true", help="write <out>/sweep.sbatch (a SLURM job array), run nothing")
    ap.add_argument("--task", type=int, help=argparse.SUPPRESS)  # one array task: run I of <out>/sweep.json
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# the grid: combinations, names, validation


def split_values(raw: str) -> list[str]:
    """`a,b,[1,2]` -> ['a', 'b', '[1,2]']: commas inside brackets belong to a list value."""
    out, depth, cur = [], 0, ""
    for ch in raw:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def parse_grids(items: list[str]) -> list[tuple[str, list[str]]]:
    grids: list[tuple[str, list[str]]] = []
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise WMError(f"--grid {item!r} must look like section.key=value1,value2")
        if key in OWN:
            raise WMError(f"--grid {key}: the sweep sets {' and '.join(OWN)} itself (--out, the run names)")
        if any(k == key for k, _ in grids):
            raise WMError(f"--grid {key} is given twice; give all its values in one --grid {key}=v1,v2")
        values = split_values(raw)
        if not raw.strip() or any(not v for v in values):
            raise WMError(f"--grid {item!r} has an empty value; list values separated by commas, e.g. {key}=1,2")
        if len(set(values)) != len(values):
            raise WMError(f"--grid {item!r} lists a value twice")
        grids.append((key, values))
    return grids


def parse_sets(items: list[str], grids) -> list[str]:
    for item in items:
        key = item.partition("=")[0].strip()
        if "=" not in item or not key:
            raise WMError(f"--set {item!r} must look like section.key=value")
        if key in OWN:
            raise WMError(f"--set {key}: the sweep sets {' and '.join(OWN)} itself (--out, the run names)")
        if any(k == key for k, _ in grids):
            raise WMError(f"{key} is given both as --set and as --grid; keep one")
    return list(items)


def safe(value: str) -> str:
    """A value as a file-name part: other characters become `_`, and then its hash keeps it unique."""
    s = "".join(c if c in SAFE else "_" for c in value)
    return s if s == value else f"{s}~{hashlib.sha1(value.encode()).hexdigest()[:6]}"


def run_name(combo: list[tuple[str, str]]) -> str:
    name = "__".join(f"{k}-{safe(v)}" for k, v in combo) or "base"
    if len(name.encode()) > MAX_NAME:
        name = f"{name.encode()[:MAX_NAME - 9].decode(errors='ignore')}~{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def plan(cfg: Optional[str], grids, sets: list[str], out: Path) -> tuple[list[dict], bool]:
    """Every run ({name, sets}), each combination loaded with wm.config.sections's loader: an unknown key or a
    wrong value is refused here, naming its --grid / --set, before anything runs. Also whether every
    run has train.device=cpu."""
    from wm.config.loading import load, to_dict

    runs, seen, cpu = [], {}, True
    for combo in itertools.product(*[[(k, v) for v in vs] for k, vs in grids]):
        combo = list(combo)
        name = run_name(combo)
        own = [f"{k}={v}" for k, v in combo]
        try:
            c = load(cfg, sets + own + [f"run.out_dir={out}", f"run.name={name}"], say=lambda *a, **k: None)
        except ConfigError as e:
            named = lambda k: e.key == k or e.key.startswith((k + "[", k + "."))  # noqa: E731
            flag = next((f"--grid {k}={v}" for k, v in combo if named(k)), None) or \
                next((f"--set {s}" for s in sets if named(s.partition("=")[0].strip())), None)
            raise WMError(f"{flag}: {e}" if flag else f"run {name} ({', '.join(own) or 'the base config'}): {e}") \
                from None
        except WMError as e:
            raise WMError(f"run {name}: {e}") from None
        d = to_dict(c)
        d["run"].pop("name")
        key = json.dumps(d, sort_keys=True)
        if key in seen:
            raise WMError(f"runs {seen[key]} and {name} have the same config (one value written two ways?); "
                          "drop one of the values")
        seen[key] = name
        cpu &= c.train.device == "cpu"
        runs.append({"i": len(runs), "name": name, "sets": own})
    if len({r["name"] for r in runs}) != len(runs):  # only values written to collide with another's hash
        raise WMError("two runs get the same folder name; write the values another way")
    return runs, cpu


def shown(k: str, v) -> str:
    """A sweep.json identity field as the command line gave it."""
    if k == "grids":
        return " ".join(f"--grid {g}={','.join(vs)}" for g, vs in v or []) or "no --grid"
    if k == "sets":
        return " ".join(f"--set {s}" for s in v or []) or "no --set"
    return str(v)[:12] if k == "cfg_sha256" and v else str(v or "the built-in demo")


def check_record(out: Path, rec: dict) -> None:
    """Refuse a sweep folder that holds another sweep, in one line naming what differs."""
    path = out / "sweep.json"
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WMError(f"{path} is unreadable ({first_line(e)}); move it away or choose another --out") from None
    for k in IDENTITY:
        if old.get(k) != rec[k]:
            what = {"cfg": "the base config", "cfg_sha256": f"the content of {rec['cfg']} (sha256)",
                    "grids": "the grid", "sets": "the --set list"}[k]
            raise WMError(f"{out} holds another sweep: {what} differs (there: {shown(k, old.get(k))}; now: "
                          f"{shown(k, rec[k])}); choose another --out, or give that sweep's command")


# ---------------------------------------------------------------------------------------------
# one run: its command, its status, its process


def train_cmd(rec: dict, run: dict, ranks: int) -> list[str]:
    train = str(ROOT / "train.py")
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), train]
            if ranks > 1 else [sys.executable, train])
    args = ["--cfg", rec["cfg"]] if rec["cfg"] else []
    for s in rec["sets"] + run["sets"] + [f"run.out_dir={rec['out']}", f"run.name={run['name']}"]:
        args += ["--set", s]
    return head + args


def status(run_dir: Path) -> str:
    """tools/runs.py's one-line status of a run folder (first word: finished, running, preempted...)."""
    import runs

    return runs.status(run_dir) if (run_dir / "config.json").exists() else "not started"



_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_launcher(parent: int):
    """In the child before exec: SIGTERM (train.py's graceful save) when the launcher dies, however."""
    def setup():
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(143)
    return setup if _LIBC is not None else None


def spawn(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Start a run in a session of its own (its group gets our signals), its output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        f.flush()
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_die_with_launcher(os.getpid()))


def last_line(log: Path) -> str:
    """The log's last non-empty line (train.py's `error: ...`), for the console."""
    try:
        lines = [ln for ln in log.read_bytes()[-4096:].decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def threads(at_once: int) -> dict:
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // at_once))}


def slots(args) -> tuple[list[Optional[str]], str]:
    """(CUDA_VISIBLE_DEVICES of each slot, None: leave it; what the console says)."""
    ranks = args.ranks_per_run
    if ranks < 1:
        raise WMError(f"--ranks-per-run {ranks} must be >= 1")
    if args.jobs is not None:
        if args.gpus is not None or args.per_gpu is not None:
            raise WMError("--jobs runs without GPUs; --gpus / --per-gpu place runs on GPUs: give one or the other")
        if args.jobs < 1:
            raise WMError(f"--jobs {args.jobs} must be >= 1")
        return [""] * args.jobs, f"{args.jobs} at once without GPUs"
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        if args.gpus is not None or args.per_gpu is not None:
            raise WMError("no CUDA GPU is visible here (torch.cuda.device_count() is 0); use --jobs N for N runs "
                          "at once on the CPU")
        return [""], "1 at a time without GPUs"
    try:
        ids = [int(g) for g in args.gpus.split(",")] if args.gpus is not None else list(range(n))
    except ValueError:
        raise WMError(f"--gpus {args.gpus!r} must be GPU ids separated by commas, e.g. 0,1") from None
    bad = [g for g in ids if not 0 <= g < n]
    if bad or len(set(ids)) != len(ids) or not ids:
        raise WMError(f"--gpus {args.gpus}: {'GPU ' + str(bad[0]) + ' is not there' if bad else 'an id is repeated'}; "
                      f"this machine shows {n} GPU{'s' if n != 1 else ''} (ids 0-{n - 1})")
    if len(ids) % ranks:
        raise WMError(f"--gpus {','.join(map(str, ids))}: {plural(len(ids), 'GPU')} do not split into runs of "
                      f"--ranks-per-run {ranks}; give a multiple of {ranks} ids")
    per = 1 if args.per_gpu is None else args.per_gpu
    if per < 1:
        raise WMError(f"--per-gpu {per} must be >= 1")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(n)]  # ids index what torch sees
    groups = [",".join(names[g] for g in ids[i:i + ranks]) for i in range(0, len(ids), ranks)]
    return [g for g in groups for _ in range(per)], f"{len(groups) * per} at once on GPUs {','.join(map(str, ids))}"


# ---------------------------------------------------------------------------------------------
# the queue


@dataclass
class Job:
    p: subprocess.Popen
    run: dict
    log: Path
    t0: float
    signalled: bool = False

    def term(self) -> None:
        """SIGTERM to the run's group: train.py (its loader workers ignore it) or torchrun, which passes
        it on to its workers (they run in sessions of their own)."""
        if not self.signalled and self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.signalled = True


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def run_queue(rec: dict, todo: list[dict], envs: list[Optional[str]], out: Path, n: int) -> tuple[list, list, int]:
    """Run `todo` over the slots (CUDA_VISIBLE_DEVICES of each; None: leave it). Returns (finished
    names, failed names, the signal that stopped the sweep or 0)."""
    stop = SimpleNamespace(signum=0)

    def note(signum, frame):  # only the first signal; printing here could re-enter stdout
        stop.signum = stop.signum or signum

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    base = dict(os.environ, PYTHONUNBUFFERED="1", **threads(len(envs) * rec["ranks_per_run"]))
    pending, free, running = [], list(range(len(envs))), {}
    done, failed, waiting, announced = [], [], set(), False
    tag = lambda run: f"[{run['i'] + 1}/{n}] {run['name']}"  # noqa: E731
    for run in todo:
        if status(out / run["name"]).split()[0] == "finished":
            print(f"skip     {tag(run)} (finished)", flush=True)
            done.append(run["name"])
        else:
            pending.append(run)
    try:
        while pending or running:
            while pending and free and not stop.signum:
                run = pending.pop(0)
                st = status(out / run["name"])
                if st.split()[0] == "finished":  # another process finished it while this one waited
                    print(f"skip     {tag(run)} (finished)", flush=True)
                    done.append(run["name"])
                    continue
                if st.split()[0] == "running":  # e.g. a killed sweep's run, still saving its checkpoint
                    if run["name"] not in waiting:
                        print(f"wait     {tag(run)}: {st} (its run.lock is held)", flush=True)
                        waiting.add(run["name"])
                    pending.append(run)
                    break
                slot = free.pop(0)
                env = dict(base) if envs[slot] is None else dict(base, CUDA_VISIBLE_DEVICES=envs[slot])
                log = out / "logs" / f"{run['name']}.log"
                running[slot] = job = Job(spawn(train_cmd(rec, run, rec["ranks_per_run"]), env, log), run, log,
                                          time.monotonic())
                where = f"GPU {envs[slot]}" if envs[slot] else "CPU" if envs[slot] == "" else "SLURM's devices"
                print(f"start    {tag(run)} (pid {job.p.pid}, {where}, log {log})", flush=True)
            if stop.signum and not announced:
                print(f"sweep: {signal.Signals(stop.signum).name}: stopping {plural(len(running), 'run')} (each saves "
                      f"a checkpoint); {len(pending)} not started", flush=True)
                pending.clear()
                announced = True
            for job in running.values():
                if stop.signum:
                    job.term()
            time.sleep(0.1)
            for slot, job in list(running.items()):
                rc = job.p.poll()
                if rc is None:
                    continue
                del running[slot]
                free.append(slot)
                st = status(out / job.run["name"])
                if rc == 0 and st.split()[0] == "finished":
                    done.append(job.run["name"])
                    print(f"finished {tag(job.run)} in {time.monotonic() - job.t0:.0f} s", flush=True)
                elif job.signalled:
                    print(f"stopped  {tag(job.run)}: exit {rc}, {st} (log {job.log})", flush=True)
                else:
                    failed.append(job.run["name"])
                    print(f"failed   {tag(job.run)}: exit {rc}, {st} (log {job.log}): {last_line(job.log)}",
                          flush=True)
    finally:
        for job in running.values():  # the launcher itself failed: the runs still save and end
            job.term()
        for job in running.values():
            job.p.wait()
        for s, h in old.items():
            signal.signal(s, h)
    return done, failed, stop.signum


def table(out: Path) -> None:
    import runs

    runs.main([str(out)])


# ---------------------------------------------------------------------------------------------
# SLURM


def write_sbatch(rec: dict, out: Path, jobs: Optional[int]) -> Path:
    n, ranks = len(rec["runs"]), rec["ranks_per_run"]
    limit = f"%{jobs}" if jobs else ""
    gpus = f"#SBATCH --gpus-per-task={ranks}\n" if not rec["cpu_only"] else ""
    text = f"""#!/bin/bash
# A sweep of {n} runs as a SLURM job array, written by tools/sweep.py: task I trains run I of
# {out}/sweep.json (skipped when finished, resumed otherwise), its output in {out}/logs/<run>.log.
#
#   sbatch {out}/sweep.sbatch
#
# Submitting it again (after a time limit, a preemption, a failure) resumes the runs not finished.
# Set the partition, account and time for your cluster below; {out} must be on a shared filesystem.
#
#SBATCH --job-name=wm-sweep
#SBATCH --array=0-{n - 1}{limit}
#SBATCH --ntasks=1
{gpus}#SBATCH --cpus-per-task={8 * ranks}
#SBATCH --time=08:00:00
#SBATCH --output={out}/logs/slurm-%A_%a.out
# SIGTERM to the task 120 s before the time limit: it passes it on, train.py saves and exits
#SBATCH --signal=B:TERM@120
set -euo pipefail
cd {shlex.quote(rec['cwd'])}
# the Python and the checkout that wrote this script
exec {shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tools' / 'sweep.py'))} \\
    --task "$SLURM_ARRAY_TASK_ID" --out {shlex.quote(str(out))}
"""
    path = out / "sweep.sbatch"
    (out / "logs").mkdir(exist_ok=True)  # SLURM writes --output there and makes no folders
    write_bytes(path, text)
    return path


def task(out: Path, i: int) -> int:
    """One array task: run `i` of the sweep in the foreground, skipped when finished."""
    try:
        rec = json.loads((out / "sweep.json").read_text())
    except (OSError, ValueError) as e:
        raise WMError(f"{out / 'sweep.json'} is unreadable ({first_line(e)}); write it with tools/sweep.py --slurm") \
            from None
    if not 0 <= i < len(rec["runs"]):
        raise WMError(f"--task {i}: the sweep in {out} has runs 0-{len(rec['runs']) - 1}")
    run, n = rec["runs"][i], len(rec["runs"])
    os.chdir(rec["cwd"])
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, int(cpus) // rec["ranks_per_run"]))
    envs = [None]  # SLURM sets CUDA_VISIBLE_DEVICES
    done, failed, signum = run_queue(rec, [run], envs, out, n)
    if signum:
        raise Stopped(signum, f"run {run['name']} saved; submit {out}/sweep.sbatch again to resume")
    return 0 if done else 1


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out).expanduser().absolute()
    if args.task is not None:
        return task(out, args.task)
    if args.cfg is not None and not Path(args.cfg).is_file():
        raise WMError(f"--cfg {args.cfg}: no such file")
    cfg = str(Path(args.cfg).absolute()) if args.cfg is not None else None
    grids = parse_grids(args.grid)
    sets = parse_sets(args.set, grids)
    planned, cpu_only = plan(cfg, grids, sets, out)
    rec = {"cfg": cfg, "cfg_sha256": cfg and hashlib.sha256(Path(cfg).read_bytes()).hexdigest(),
           "grids": [[k, vs] for k, vs in grids], "sets": sets,
           "out": str(out), "cwd": os.getcwd(), "ranks_per_run": args.ranks_per_run, "cpu_only": cpu_only,
           "runs": planned}
    if args.slurm:
        if args.gpus is not None or args.per_gpu is not None:
            raise WMError("--slurm: each array task gets its GPUs from SLURM; leave out --gpus and --per-gpu")
        if args.ranks_per_run < 1 or (args.jobs is not None and args.jobs < 1):
            raise WMError("--ranks-per-run and --jobs must be >= 1")
        envs, where = [], ""
    else:
        envs, where = slots(args)
    with runlock.held(out, use=SWEEP_LOCK):
        check_record(out, rec)
        write_bytes(out / "sweep.json", json.dumps(rec, indent=1) + "\n")
        if args.slurm:
            path = write_sbatch(rec, out, args.jobs)
            print(f"sweep: {plural(len(planned), 'run')}; submit them with: sbatch {path}\n"
                  f"  (one array task per run; submitting again resumes the runs not finished)")
            return 0
        print(f"sweep: {plural(len(planned), 'run')} in {out}, {where}"
              f"{', ' + str(args.ranks_per_run) + ' ranks each' if args.ranks_per_run > 1 else ''}", flush=True)
        done, failed, signum = run_queue(rec, planned, envs, out, len(planned))
        if not signum:
            table(out)
    if signum:
        raise Stopped(signum, f"{len(planned) - len(done) - len(failed)} of {len(planned)} runs not finished; "
                      f"the same command resumes them: python tools/sweep.py {shlex.join(argv)}")
    if failed:
        print(f"sweep: {len(failed)} of {len(planned)} runs failed: {', '.join(failed)} (their logs are in {out}/logs)")
        return 1
    print(f"sweep: {'all ' if len(planned) > 1 else ''}{plural(len(planned), 'run')} finished")
    return 0


if __name__ == "__main__":
    run_cli(main)
