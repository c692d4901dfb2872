"""The attack suite: every reliability promise of wm (docs/RELIABILITY.md) attacked at tiny sizes the
way a cluster and its users attack a run, each case judged PASS or FAIL, one table at the end.

    python tools/attack.py                          # every case, 3 to 4 min on 2 cores
    python tools/attack.py --cases sigterm,lock     # some of them (--list names them)
    python tools/attack.py --json attack.json       # the table as JSON too

A case FAILS when a user-caused failure shows a Traceback or is not one `error:` line naming the file,
when a process outlives its timeout (it is killed with its process group and the case says "hung"),
when a checkpoint the run had is lost or changed, when a resumed run is not bitwise equal to an
uninterrupted one, or when the expected line does not appear. The exit status is 1 on any FAIL.

Every trainer is a real `python train.py` / `export.py` subprocess in its own process group, on a
16x16x4 synthetic data set (2 training scenes of 12 frames, 1 validation scene) and tiny models, the
sizes tests/helpers.py uses; the kill -9 case forks its trainers from a fork server that imported
torch once (tools/kill_campaign.py's protocol and helpers). Everything is written under one
temporary folder, removed at the end; no process is left behind.
"""

import argparse
import datetime
import errno
import hashlib
import json
import os
import platform
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

import kill_campaign as kc  # noqa: E402
import procs  # noqa: E402  (imports torch; its fork server, helpers and comparisons)
import torch  # noqa: E402

import wm.checkpoint.files as ck  # noqa: E402

TINY = {  # tests/helpers.py's TINY_SETTINGS
    "data.grid": "16,16,4", "data.past": "2", "data.future": "2", "loader.num_workers": "0",
    "tokenizer.widths": "8,8,8", "tokenizer.mid_attention": "true", "tokenizer.codebook_size": "16",
    "tokenizer.code_dim": "8", "tokenizer.dead_code_steps": "2", "world.widths": "8,16", "world.heads": "2",
    "train.device": "cpu", "train.amp": "fp32", "logging.tensorboard": "false", "logging.every": "1",
    "train.stages": "tokenizer", "tokenizer_stage.batch_size": "2", "tokenizer_stage.warmup_steps": "2",
    "tokenizer_stage.max_steps": "4", "world_stage.batch_size": "2", "world_stage.warmup_steps": "2",
    "world_stage.max_steps": "4",
}
STEPS = 24  # the tokenizer runs most cases resume: two epochs, a save every step, validation every 6
TOK = {"tokenizer_stage.max_steps": STEPS, "checkpoint.every": 1, "checkpoint.keep_last": 3,
       "tokenizer_stage.eval_every": 6}
BOTH = {"train.stages": "tokenizer,world", "tokenizer_stage.max_steps": 2, "world_stage.max_steps": 2,
        "checkpoint.every": 1}  # tests/reliability/test_reliability4.py's two-stage run
RUN_S = 180  # the longest any one trainer may take here before it counts as hung


class Failed(Exception):
    """A case's verdict FAIL: `observed` says what was seen instead."""

    def __init__(self, observed: str, output: str = ""):
        super().__init__(observed)
        self.observed, self.output = observed, output


def expect(cond, observed: str, output: str = "") -> None:
    if not cond:
        raise Failed(observed, output)


# ---------------------------------------------------------------------------------------------
# processes: each in its own process group, read line by line, killed with its group on timeout

LIVE: set = set()  # the processes started and not yet reaped: killed at the end, whatever happens


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (by /proc's parent links): those that left its group too (setsid)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL the live, unreaped process `pid`, its process group and every process below it."""
    below = descendants(pid)
    for kill, target in [(os.killpg, pid), (os.kill, pid)] + [(os.kill, p) for p in below]:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Proc(procs.Proc):
    """procs.Proc kept in LIVE until reaped; killed with every process below it; a hang is a FAIL."""

    def __init__(self, cmd, env=None, cwd=ROOT):
        super().__init__(cmd, env, cwd)
        LIVE.add(self)

    def finish(self, timeout: float = RUN_S) -> int:
        try:
            rc = super().finish(timeout)
        except procs.Hung:
            raise Failed(f"hung: still running after {timeout:.0f} s (killed with its process group)",
                         self.output) from None
        LIVE.discard(self)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:  # once reaped its pid may be another's: never signalled again
            kill_tree(self.p.pid)
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        LIVE.discard(self)


def run(cmd, timeout: float = RUN_S, env=None) -> tuple[int, str]:
    p = Proc(cmd, env)
    rc = p.finish(timeout)
    return rc, p.output


def run_all(cmds: list, timeout: float = RUN_S, at_once: int = 4) -> list[tuple[int, str, bool]]:
    """Several commands side by side (at most `at_once`): (exit status, output, its group gone) each."""
    out, todo = [None] * len(cmds), list(enumerate(cmds))
    while todo:
        batch, todo = todo[:at_once], todo[at_once:]
        procs = [(i, Proc(c)) for i, c in batch]
        for i, p in procs:
            rc = p.finish(timeout)
            out[i] = (rc, p.output, p.group_gone())
    return out


def train_cmd(args: list) -> list:
    return [sys.executable, "train.py", *args]


def one_line_error(rc: int, out: str, *names) -> str:
    """The one `error:` line a user-caused failure must end in (exit 2, no Traceback, naming each of
    `names`); raises Failed otherwise."""
    errs = [ln for ln in out.splitlines() if ln.startswith("error:")]
    last = (out.strip().splitlines() or [""])[-1]
    bad = []
    if "Traceback" in out:
        bad.append("a Traceback")
    if rc != 2:
        bad.append(f"exit {rc}")
    if len(errs) != 1:
        bad.append(f"{len(errs)} error: lines")
    elif last != errs[0]:
        bad.append("the error: line is not the last")
    for n in names:
        if errs and str(n) not in errs[0]:
            bad.append(f"the error does not name {n}")
    expect(not bad, "; ".join(bad) + f" (last line: {last[:160]})", out)
    return errs[0]


REDACT: list = []  # the work folder, written <tmp> in the table


def short(line: str, n: int = 150) -> str:
    line = line.strip()
    for r in REDACT:
        line = re.sub(re.escape(r) + r"(/[^\s:,'()]+)*/", ".../", line)  # a path in the work folder: its name
    return line if len(line) <= n else line[:n - 3] + "..."


# ---------------------------------------------------------------------------------------------
# checkpoints: damage, plant, compare


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cdir(run_dir: Path, stage: str = "tokenizer") -> Path:
    return run_dir / stage / "checkpoints"


def flip_tensor_bytes(path: Path, n: int = 8) -> None:
    """Flip `n` bytes in the middle of the largest tensor record of a torch zip checkpoint (same size)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    b = bytearray(path.read_bytes())
    name_len, extra_len = (int.from_bytes(b[info.header_offset + o:info.header_offset + o + 2], "little")
                           for o in (26, 28))
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    for i in range(start, start + n):
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def plant(folder: Path, step: int, obj) -> Path:
    """`obj` as step file `step` of `folder`, with its .sha256 and the `latest` pointer naming it:
    intact by every checksum, so only what it holds can tell it does not belong."""
    path = folder / ck.checkpoint_name(step)
    path.unlink(missing_ok=True)
    size, sha = ck.write_hashed(path, lambda f: torch.save(obj, f))
    ck.write_sums(path, sha)
    ck.write_json_atomic(folder / ck.POINTER, {"file": path.name, "sha256": sha, "size": size, "step": step})
    return path


def planted_resume(tdir: Path, n: int, cmd: list, state: dict, why: str = "") -> tuple[str, str]:
    """`state` planted as step n+1 of the stopped run in `tdir`, the same command again: one line
    names it as skipped (holding `why`), the run resumes at its own step n. Returns (line, output)."""
    planted = plant(cdir(tdir), n + 1, state)
    rc, out = run(cmd)
    said = [ln for ln in out.splitlines() if f"skipped {planted}" in ln]
    expect(rc == 0 and len(said) == 1 and why in said[0], f"planted: exit {rc}, {len(said)} lines skipping it"
           + (f" ({why!r})" if why else ""), out)
    expect(resumed_at(out) == n, f"planted: resumed at step {resumed_at(out)}, not {n}", out)
    return said[0], out


def newest_state(run_dir: Path, stage: str = "tokenizer") -> dict:
    found = ck.newest_valid(cdir(run_dir, stage), say=lambda m: None)
    expect(found is not None, f"{cdir(run_dir, stage)} holds no valid checkpoint")
    return found[1]


def differs(ref_dir: Path, got_dir: Path, stage: str = "tokenizer") -> list[str]:
    """What of the final training state and best.pt of `got_dir` is not bitwise `ref_dir`'s."""
    a, b = newest_state(ref_dir, stage), newest_state(got_dir, stage)
    bad = [f"final {k}" for k in kc.KEYS if not kc.same(a[k], b[k])]
    ra, rb = (ck.load_checked(cdir(d, stage) / ck.BEST) for d in (ref_dir, got_dir))
    if not kc.same(ra["model"], rb["model"]) or ra["step"] != rb["step"]:
        bad.append(f"best.pt (step {ra['step']} vs {rb['step']})")
    return bad


def expect_bitwise(ref_dir: Path, got_dir: Path, out: str = "", stage: str = "tokenizer") -> str:
    bad = differs(ref_dir, got_dir, stage)
    expect(not bad, "resumed run DIFFERS from the uninterrupted one: " + ", ".join(bad), out)
    return "bitwise equal to the uninterrupted run"


def committed(folder: Path) -> dict:
    """The committed step files (those with their .sha256) and best.pt of `folder`: name -> sha256."""
    out = {p.name: sha256(p) for p in ck.list_checkpoints(folder) if Path(str(p) + ck.SUMS).is_file()}
    if (folder / ck.BEST_JSON).is_file() and (folder / ck.BEST).is_file():
        out[ck.BEST] = sha256(folder / ck.BEST)
    return out


def resumed_at(out: str) -> int | None:
    m = re.search(r"tokenizer: resumed from \S+ at step (\d+)/", out)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# the shared tiny fixtures, each built on first use


class Ctx:
    def __init__(self, base: Path, a):
        self.base, self.a, self._cache = base, a, {}

    def once(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def args(self, out: str, name: str = "r", data: Path | None = None, **over) -> list:
        s = dict(TINY, **{"data.root": str(data or self.data), "run.out_dir": str(self.base / out), "run.name": name})
        s.update({k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in over.items()})
        return [x for k, v in s.items() for x in ("--set", f"{k}={v}")]

    def tok(self, out: str, **over) -> list:
        return self.args(out, **dict(TOK, **over))

    @property
    def data(self) -> Path:
        def build():
            from wm.data.synthetic.generate import write_synthetic

            d = self.base / "data"
            write_synthetic(d, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4))
            return d
        return self.once("data", build)

    @property
    def data_mm(self) -> Path:
        def build():
            from wm.data.synthetic.generate import write_synthetic

            d = self.base / "data_mm"
            write_synthetic(d, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4), kind="memmap")
            return d
        return self.once("data_mm", build)

    def copy_data(self, src: Path, name: str) -> Path:
        dst = self.base / name
        shutil.copytree(src, dst)
        return dst

    @property
    def ref(self) -> Path:
        """The uninterrupted tokenizer run every resumed one is compared with."""
        def build():
            rc, out = run(train_cmd(self.tok("ref")))
            expect(rc == 0, f"the uninterrupted reference run failed (exit {rc})", out)
            return self.base / "ref" / "r"
        return self.once("ref", build)

    @property
    def cut(self) -> tuple[Path, int]:
        """The same tokenizer run stopped by SIGTERM after step 6: (its run folder, its last step)."""
        def build():
            p = Proc(train_cmd(self.tok("cut")))
            expect(p.wait_for(rf"^tokenizer step 6/{STEPS} ", RUN_S), "the run to cut never reached step 6", p.output)
            os.killpg(p.pid, signal.SIGTERM)
            rc = p.finish()
            m = re.search(r"preempted \(SIGTERM/SIGINT\); saved step (\d+)", p.output)
            expect(rc == 0 and m, f"the run to cut did not save and exit 0 on SIGTERM (exit {rc})", p.output)
            return self.base / "cut" / "r", int(m.group(1))
        return self.once("cut", build)

    def cut_copy(self, out: str) -> tuple[Path, int, list]:
        """A copy of `cut` under `out`, its last step, and the command that resumes it."""
        src, n = self.cut
        dst = self.base / out / "r"
        shutil.copytree(src, dst)
        return dst, n, train_cmd(self.tok(out))

    def prepare(self, names: list) -> None:
        """Build the fixtures the cases `names` need side by side (their trainers start at once)."""
        need = {k for n in names for k in NEEDS.get(n, ())}
        procs = {}
        if "ref" in need:
            procs["ref"] = Proc(train_cmd(self.tok("ref")))
        if "both" in need:
            procs["r"] = Proc(train_cmd(self.args("both", "r", **BOTH)))
            procs["r2"] = Proc(train_cmd(self.args("both", "r2", **dict(BOTH, **{"tokenizer_stage.max_steps": 3,
                                                                                "world_stage.max_steps": 3}))))
        try:
            if "cut" in need:
                self.cut  # noqa: B018  (stops its run at step 6 while the others train)
            for k, p in procs.items():
                rc = p.finish()
                expect(rc == 0, f"the fixture run {k} failed (exit {rc})", p.output)
        finally:
            for p in procs.values():
                p.kill()
        if "ref" in need:
            self._cache["ref"] = self.base / "ref" / "r"
        if "both" in need:
            self._cache["both"] = self.base / "both"

    @property
    def both(self) -> Path:
        """tests/reliability/test_reliability4.py's runs: r (2 + 2 steps), r2 (3 + 3: its world checkpoints name
        another tokenizer), in one folder; returns the folder."""
        def build():
            res = run_all([train_cmd(self.args("both", "r", **BOTH)),
                           train_cmd(self.args("both", "r2", **dict(BOTH, **{"tokenizer_stage.max_steps": 3,
                                                                             "world_stage.max_steps": 3})))])
            for rc, out, _ in res:
                expect(rc == 0, f"a two-stage run to attack failed (exit {rc})", out)
            return self.base / "both"
        return self.once("both", build)


# ---------------------------------------------------------------------------------------------
# the cases: each returns (observed) or raises Failed


CASES: dict = {}
NEEDS = {"sigterm": ("ref",), "bitflip": ("ref", "cut"), "foreign": ("ref", "cut", "both"),
         "nan": ("ref", "cut", "both"), "pickle": ("ref", "cut", "both"), "fulldisk": ("ref",), "lock": ("ref",)}


def case(name: str, done: str, expected: str, hidden: bool = False):
    def deco(fn):
        CASES[name] = {"fn": fn, "done": done, "expected": expected, "hidden": hidden}
        return fn
    return deco


kill_child = kc.child_main  # a trainer that marks its saves and widens their renames


class KillChild(kc.Child):
    """kill_campaign's Child (line reader, kill, wait) running kill_child, with a timeout on wait."""

    def __init__(self, argv):
        r, w = kc.FORKS.Pipe(duplex=False)
        self.p = kc.FORKS.Process(target=kill_child, args=(argv, w), daemon=True)
        self.p.start()
        w.close()
        self.q, self.lines = queue.Queue(), []
        threading.Thread(target=self._read, args=(r,), daemon=True).start()
        KILL_CHILDREN.append(self)

    def wait(self, timeout: float = RUN_S) -> int:
        self.p.join(timeout)
        if self.p.exitcode is None:
            kill_tree(self.p.pid)
            self.p.join(10)
            raise Failed(f"hung: a trainer ran past {timeout:.0f} s (killed)", self.output)
        return self.p.exitcode


KILL_CHILDREN: list = []


@case("kill9", "kill -9 at random instants of a two-stage run (half of them inside checkpoint saves), the same "
      "command again after each kill until it ends; several rounds",
      "after every kill a valid newest checkpoint and a resume at or after the committed step; every round bitwise "
      "equal to an uninterrupted run (both stages' final state and best.pt, the world stage's tokenizer)")
def case_kill9(ctx: Ctx) -> str:
    rnd, n, want = random.Random(ctx.a.seed), ctx.a.kill_steps, ctx.a.kills
    base = ctx.base / "kill9"
    deadline = time.monotonic() + ctx.a.kill_budget

    def cmd(out):
        s = dict(kc.SETTINGS, **{"data.root": str(ctx.data), "run.out_dir": str(base / out), "run.name": "r",
                                 "tokenizer_stage.max_steps": str(n), "world_stage.max_steps": str(n)})
        return [x for k, v in s.items() for x in ("--set", f"{k}={v}")]

    warm = kc.FORKS.Process(target=int)  # the fork server imports torch once, outside any timing
    warm.start()
    warm.join()
    t0, c = time.time(), KillChild(cmd("straight"))
    rc = c.wait()
    c.drain()
    expect(rc == 0, f"the uninterrupted run failed (exit {rc})", c.output)
    life, save_len = [time.time() - t0], [0.05]
    ref = kc.stage_states(base / "straight" / "r")
    kills, rounds, resumes = [], [], 0
    while len(kills) < want or 2 * sum(k["save"] for k in kills) < len(kills):
        expect(time.monotonic() < deadline, f"only {len(kills)} kills in {ctx.a.kill_budget} s")
        run_dir, before, no = base / f"killed{len(rounds) + 1}" / "r", {"tokenizer": 0, "world": 0}, len(rounds) + 1
        while True:
            expect(time.monotonic() < deadline, f"round {no} did not end in the time given to the case")
            c = KillChild(cmd(f"killed{no}"))
            t0 = time.time()
            behind = 2 * sum(k["save"] for k in kills) < len(kills)
            mode = "save" if behind or rnd.random() < 0.5 else "any"
            at = t0 + rnd.uniform(0.3, max(life)) if mode == "any" else None
            strike, saves, nth, in_save, t_begin = None, 0, rnd.randint(1, 4), False, time.time()
            while True:
                line = c.next_line(0.002)
                if line is None:
                    break
                if line.startswith("wm-save-begin"):
                    in_save, saves = True, saves + 1
                    t_begin = time.time()
                    if mode == "save" and strike is None and saves >= nth:
                        strike = t_begin + rnd.uniform(0, 0.9 * sorted(save_len)[len(save_len) // 2])
                elif line.startswith("wm-save-end"):
                    in_save = False
                    save_len.append(time.time() - t_begin)
                m = re.search(r"resumed from (\S+) at step (\d+)/", line or "")
                if m:
                    stage = "world" if "/world/" in m.group(1) else "tokenizer"
                    expect(int(m.group(2)) >= before[stage], f"round {no}: {stage} resumed at step {m.group(2)}, "
                           f"but step {before[stage]} was committed before the kill", c.output)
                    resumes += 1
                now = time.time()
                if (at and now >= at) or (strike and now >= strike) or now - t0 > RUN_S:
                    c.kill()
                    break
            rc = c.wait()
            c.drain()
            if rc == 0:
                life.append(time.time() - t0)
                break
            expect(rc == -signal.SIGKILL, f"round {no}: the run failed (exit {rc})", c.output)
            if run_dir.exists():
                try:
                    before = kc.committed_steps(run_dir)
                except Exception as e:  # no valid checkpoint left: a kill lost one
                    raise Failed(f"round {no}: after a kill {e}") from None
            kills.append({"round": no, "mode": mode, "save": bool(in_save), "committed": dict(before)})
        bad = kc.compare(ref, kc.stage_states(run_dir))
        rounds.append(bad)
        expect(not bad, f"round {no} DIFFERS from the uninterrupted run: {', '.join(bad)}")
    during = sum(k["save"] for k in kills)
    return (f"{len(kills)} kills ({during} during saves) in {len(rounds)} rounds, {resumes} resumes at or after "
            f"the committed step; every round bitwise equal")


@case("kill_campaign_tool", "tools/kill_campaign.py itself at tiny settings (--kills 2 --steps 4)",
      "exit 0, its JSON says every round bitwise equal")
def case_kill_campaign_tool(ctx: Ctx) -> str:
    js = ctx.base / "kill_campaign.json"
    rc, out = run([sys.executable, "tools/kill_campaign.py", "--kills", "2", "--steps", "4", "--seed",
                   str(ctx.a.seed), "--dir", str(ctx.base / "kill_campaign"), "--json", str(js)], timeout=300)
    last = (out.strip().splitlines() or [""])[-1]
    expect(rc == 0 and js.is_file(), f"exit {rc}: {short(last)}", out)
    rep = json.loads(js.read_text())
    expect(rep["all_equal"], f"rounds differ: {rep['rounds']}", out)
    return f"exit 0: {len(rep['kills'])} kills, {len(rep['rounds'])} round(s), all bitwise equal"


@case("sigterm", "SIGTERM to the whole process group (trainer and 2 DataLoader workers) after step 3 of a "
      "24-step run, as SLURM and `timeout` do; the same command again",
      "exit 0, one 'preempted ... saved step N' line, no Traceback, nothing of the group left; the resume "
      "continues at step N and ends bitwise equal to an uninterrupted run")
def case_sigterm(ctx: Ctx) -> str:
    ref, cmd = ctx.ref, train_cmd(ctx.tok("sigterm", **{"loader.num_workers": 2}))
    p = Proc(cmd)
    expect(p.wait_for(rf"^tokenizer step 3/{STEPS} ", RUN_S), "never reached step 3", p.output)
    os.killpg(p.pid, signal.SIGTERM)
    rc = p.finish()
    out = p.output
    said = [ln for ln in out.splitlines() if "preempted (SIGTERM/SIGINT); saved step" in ln]
    expect(rc == 0, f"exit {rc} after SIGTERM", out)
    expect("Traceback" not in out and "error:" not in out, "a Traceback or an error line after SIGTERM", out)
    expect(len(said) == 1, f"{len(said)} 'preempted ... saved step' lines", out)
    expect(p.group_gone(), "a process of the trainer's group outlived it", out)
    n = int(re.search(r"saved step (\d+)", said[0]).group(1))
    expect(n < STEPS and newest_state(ctx.base / "sigterm" / "r")["step"] == n,
           f"'{said[0]}' but the newest checkpoint is not step {n}", out)
    rc, out2 = run(cmd)
    expect(rc == 0 and resumed_at(out2) == n, f"the resume: exit {rc}, resumed at {resumed_at(out2)}", out2)
    return f"exit 0, '{short(said[0], 60)}'; resumed at step {n}/{STEPS}; " + expect_bitwise(
        ref, ctx.base / "sigterm" / "r", out2)


@case("bitflip", "8 bytes flipped inside a tensor of the newest checkpoint (same size) of a run stopped at "
      "step N; the same command again",
      "one warning naming the file and its sha256, resume from step N-1 (never step 0), bitwise equal to an "
      "uninterrupted run")
def case_bitflip(ctx: Ctx) -> str:
    ref = ctx.ref
    run_dir, n, cmd = ctx.cut_copy("bitflip")
    newest = ck.latest_checkpoint(cdir(run_dir))
    expect(newest.name == ck.checkpoint_name(n), f"the newest checkpoint is {newest.name}, not step {n}")
    size, before = newest.stat().st_size, sha256(newest)
    flip_tensor_bytes(newest)
    expect(newest.stat().st_size == size and sha256(newest) != before, "the flip did not change the file in place")
    rc, out = run(cmd)
    said = [ln for ln in out.splitlines() if f"skipped {newest}" in ln]
    expect(rc == 0, f"exit {rc}", out)
    expect(len(said) == 1 and "sha256" in said[0] and said[0].startswith("warning:"),
           f"{len(said)} warnings naming {newest.name} with its sha256", out)
    expect(resumed_at(out) == n - 1, f"resumed at step {resumed_at(out)}, not {n - 1}", out)
    return f"'{short(said[0], 100)}'; resumed at step {n - 1}/{STEPS}; " + expect_bitwise(ref, run_dir, out)


@case("foreign", "another run's world checkpoint (r2's step 3, another tokenizer) copied in as the newest world "
      "step, with its .sha256 and `latest`; another run's tokenizer state (run.seed 7) planted as the newest "
      "tokenizer step of a stopped run; the same commands again",
      "world: one warning, the file moved to world/foreign-<date>/, the run's own files as they were, nothing "
      "moved aside (no world.*), resume from its own step 2; tokenizer: named and skipped, resume from step N, "
      "bitwise equal")
def case_foreign(ctx: Ctx) -> str:
    both, ref = ctx.both, ctx.ref
    run_dir = ctx.base / "foreign" / "r"
    shutil.copytree(both / "r", run_dir)
    world, src, name = cdir(run_dir, "world"), cdir(both / "r2", "world"), ck.checkpoint_name(3)
    own = {p.name: p.read_bytes() for p in world.iterdir() if p.name != ck.POINTER}
    for f in (name, name + ck.SUMS, ck.POINTER):
        shutil.copy2(src / f, world / f)
    copied = (world / name).read_bytes()
    (run_dir / "world" / "done.json").unlink()
    rc, out = run(train_cmd(ctx.args("foreign", **BOTH)))
    expect(rc == 0, f"world: exit {rc}", out)
    lines = [ln for ln in out.splitlines() if str(world / name) in ln]
    expect(len(lines) == 1 and lines[0].startswith(f"warning: {world / name} is not this run's world checkpoint"),
           f"world: {len(lines)} lines name the stray file", out)
    aside = list((run_dir / "world").glob("foreign-*"))
    expect(len(aside) == 1 and (aside[0] / name).read_bytes() == copied, "world: the stray file is not in one "
           "world/foreign-*/ folder with its bytes", out)
    expect({n: (world / n).read_bytes() for n in own if (world / n).exists()} == own and all(
        (world / n).exists() for n in own), "world: the run's own checkpoint files changed or went", out)
    expect(not list(run_dir.glob("world.*")) and "starts over" not in out, "world: the run's own stage was moved "
           "aside", out)
    expect(f"world: resumed from {world / ck.checkpoint_name(2)} at step 2/2" in out, "world: not resumed from its "
           "own step 2", out)
    # the tokenizer stage: another run's state (its config's run.seed 7) as the newest step of a stopped run
    tdir, n, cmd = ctx.cut_copy("foreign_tok")
    st = torch.load(cdir(tdir) / ck.checkpoint_name(n), weights_only=True)
    st["config"]["run"]["seed"] = 7
    st["step"] = n + 1
    said, out2 = planted_resume(tdir, n, cmd, st, "another run")
    return (f"world: '{short(lines[0], 120)}', own files unchanged, resumed at 2/2; "
            f"tokenizer: '{short(said, 100)}', resumed at {n}/{STEPS}, " + expect_bitwise(ref, tdir, out2))


@case("nan", "a checkpoint holding NaN (the world best.pt, one tensor NaN, re-saved) given with --ckpt to "
      "train.py --eval-only and to export.py; a state holding NaN planted as the newest step of a stopped run",
      "--ckpt: refused in one error: line naming the file and 'non-finite', nothing exported; planted: named and "
      "skipped, resume from step N, bitwise equal")
def case_nan(ctx: Ctx) -> str:
    both, ref = ctx.both, ctx.ref
    st = ck.load_checked(cdir(both / "r", "world") / ck.BEST)
    k = next(iter(st["model"]))
    st["model"][k] = torch.full_like(st["model"][k], float("nan"))
    bad = ctx.base / "nan.pt"
    torch.save(st, bad)
    out_dir = ctx.base / "nan_export"
    (rc1, out1, g1), (rc2, out2, g2) = run_all([
        train_cmd(ctx.args("both", **BOTH)) + ["--eval-only", "--ckpt", str(bad)],
        [sys.executable, "export.py", "--run", str(both / "r"), "--ckpt", str(bad), "--out", str(out_dir)]])
    e1 = one_line_error(rc1, out1, bad, "non-finite")
    one_line_error(rc2, out2, bad, "non-finite")
    expect(not out_dir.exists(), "export.py wrote its output folder", out2)
    tdir, n, cmd = ctx.cut_copy("nan_tok")
    st = torch.load(cdir(tdir) / ck.checkpoint_name(n), weights_only=True)
    t = next(iter(st["model"]))
    st["model"][t] = st["model"][t].clone().fill_(float("nan"))
    st["step"] = n + 1
    _, out3 = planted_resume(tdir, n, cmd, st, "non-finite")
    return (f"eval-only: '{short(e1, 100)}'; export: exit 2, one line; planted: skipped, resumed at {n}/{STEPS}, "
            + expect_bitwise(ref, tdir, out3))


EVIL = """
import os
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + {marker!r},))
"""


@case("pickle", "a malicious pickle (torch.save of an object whose __reduce__ runs `touch MARKER`; checked live by "
      "a weights_only=False load in a throw-away process) given with --ckpt to train.py --eval-only and "
      "export.py, and planted as the newest step (with its .sha256) of a stopped run",
      "MARKER never appears; --ckpt: one error: line naming the file; planted: named and skipped, resume from "
      "step N, bitwise equal")
def case_pickle(ctx: Ctx) -> str:
    both, ref = ctx.both, ctx.ref
    marker, evil = ctx.base / "MARKER", ctx.base / "evil.pt"
    ns: dict = {}
    exec(EVIL.format(marker=str(marker)), ns)
    torch.save({"model": ns["Evil"](), "stage": "world", "step": 1}, evil)
    rc, out = run([sys.executable, "-c", f"import torch; torch.load({str(evil)!r}, weights_only=False)"], timeout=120)
    expect(marker.exists(), "the control load (weights_only=False) did not create the marker: the attack file is "
           "not live", out)
    marker.unlink()
    out_dir = ctx.base / "pickle_export"
    (rc1, out1, _), (rc2, out2, _) = run_all([
        train_cmd(ctx.args("both", **BOTH)) + ["--eval-only", "--ckpt", str(evil)],
        [sys.executable, "export.py", "--run", str(both / "r"), "--ckpt", str(evil), "--out", str(out_dir)]])
    expect(not marker.exists(), "MARKER appeared: the pickle ran", out1 + out2)
    e1 = one_line_error(rc1, out1, evil)
    one_line_error(rc2, out2, evil)
    expect(not out_dir.exists(), "export.py wrote its output folder", out2)
    tdir, n, cmd = ctx.cut_copy("pickle_tok")
    _, out3 = planted_resume(tdir, n, cmd, {"model": ns["Evil"](), "stage": "tokenizer", "step": n + 1})
    expect(not marker.exists(), "MARKER appeared: the planted pickle ran", out3)
    return (f"no MARKER; eval-only and export: '{short(e1, 100)}'; planted: skipped, resumed at {n}/{STEPS}, "
            + expect_bitwise(ref, tdir, out3))


def _flip_chunk(shard: Path, field: str, frame: int) -> None:
    import h5py
    import hdf5plugin  # noqa: F401  (the zstd filter)

    with h5py.File(shard, "r") as f:
        info = f[field].id.get_chunk_info_by_coord((frame, 0, 0, 0))
    b = bytearray(shard.read_bytes())
    b[info.byte_offset + info.size // 2] ^= 0x5A
    shard.write_bytes(bytes(b))


def _data_runs(ctx: Ctx, variants: list) -> str:
    """Train one epoch (every training frame read) on each damaged data set, with 0 and 2 loader
    workers, side by side: one error: line naming `names`, exit 2, no process of the group left."""
    cmds, seen = [], []
    for label, root, names in variants:
        for w in (0, 2):
            cmds.append(train_cmd(ctx.args(f"data_{label}_{w}", data=root, **{"tokenizer_stage.max_steps": 12,
                                                                              "loader.num_workers": w})))
            seen.append((label, w, names))
    obs = []
    for (label, w, names), (rc, out, gone) in zip(seen, run_all(cmds)):
        try:
            line = one_line_error(rc, out, *names)
            expect(gone, "a process of the trainer's group outlived it", out)
            expect("DataLoader worker" not in out, "the error names a DataLoader worker", out)
        except Failed as e:
            raise Failed(f"{label}, {w} workers: {e.observed}", e.output) from None
        if w == 2:
            obs.append(f"{label}: '{short(line, 90)}'")
    return "; ".join(obs) + " (the same line with 0 workers)"


@case("shards", "damaged shards under train.py (one epoch, loader.num_workers 0 and 2): a memmap occ.npy truncated "
      "to half, one byte flipped inside an HDF5 occ chunk (frame 5)",
      "exit 2, one error: line naming the shard (and the frame), no Traceback, no hang, no worker left")
def case_shards(ctx: Ctx) -> str:
    mm = ctx.copy_data(ctx.data_mm, "data_truncated")
    occ = mm / "train-00000.mm" / "occ.npy"
    os.truncate(occ, occ.stat().st_size // 2)
    h5 = ctx.copy_data(ctx.data, "data_flipped")
    shard = h5 / "train-00000.h5"
    _flip_chunk(shard, "occ", 5)
    return _data_runs(ctx, [("truncated .npy", mm, [mm / "train-00000.mm"]),
                            ("flipped HDF5 chunk", h5, [shard, "frame 5"])])


@case("manifest", "damaged manifest.json under train.py (loader.num_workers 0 and 2): the top level a list; "
      "shards[0] with \"path\": 5",
      "exit 2, one error: line naming manifest.json and what is wrong, no Traceback, no hang")
def case_manifest(ctx: Ctx) -> str:
    lst, p5 = ctx.copy_data(ctx.data, "data_list"), ctx.copy_data(ctx.data, "data_path5")
    m = json.loads((lst / "manifest.json").read_text())
    (lst / "manifest.json").write_text(json.dumps([m]))
    m["shards"][0]["path"] = 5
    (p5 / "manifest.json").write_text(json.dumps(m))
    return _data_runs(ctx, [("a list", lst, [lst / "manifest.json", "list"]),
                            ('"path": 5', p5, [p5 / "manifest.json", "'path'"])])


def fulldisk_inner(spec_path: str) -> int:
    """In a private mount namespace (unshare -rm): a small tmpfs as the run's disk, the trainer paused
    after step 4 while the disk is filled to the last byte, then let go; then the disk freed and the
    same command again. Prints the facts as JSON; the outer process judges them."""
    spec = json.loads(Path(spec_path).read_text())
    disk, cmd = Path(spec["disk"]), spec["cmd"]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size']}", "tmpfs", str(disk)], check=True,
                   timeout=30)
    res: dict = {}
    try:
        p = Proc(cmd)
        res["reached"] = p.wait_for(rf"^tokenizer step 4/{STEPS} ", RUN_S)
        os.killpg(p.pid, signal.SIGSTOP)
        folder = cdir(disk / "r")
        res["committed"] = committed(folder)
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for chunk in (1 << 20, 4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except OSError as e:
                    res["fill_errno"] = e.errno
        finally:
            os.close(fd)
        res["free_after_fill"] = shutil.disk_usage(disk).free
        os.killpg(p.pid, signal.SIGCONT)
        try:
            res["rc"] = p.finish()
        except Failed as e:
            res["rc"] = f"hung: {e.observed}"
        res["out"] = p.output
        res["after"] = {n: sha256(folder / n) for n in res["committed"] if (folder / n).is_file()}
        res["temps"] = [q.name for q in folder.iterdir() if ".tmp-" in q.name]
        (disk / "filler").unlink()
        rc, out = run(cmd)
        res["rc2"], res["out2"] = rc, out
        shutil.copytree(disk / "r", spec["copy_to"])
    finally:
        for q in list(LIVE):
            q.kill()
        print("RESULT " + json.dumps(res), flush=True)
        subprocess.run(["umount", str(disk)], timeout=30)
    return 0


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        d = tempfile.mkdtemp(prefix="wm-attack-probe-")
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                           capture_output=True, timeout=30)
        os.rmdir(d)
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


FULL_DISK_PATCH = """
import errno, re, sys
import wm.checkpoint.files as ck
real, first = ck._HashingWriter.write, int(sys.argv[1])
class Full:  # the checkpoint file's writes, once the disk is full (tests/training/test_train.py's FullDisk)
    def __init__(self, f):
        self.f = f
    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")
    def __getattr__(self, k):
        return getattr(self.f, k)
def write(self, b):  # the disk fills up 4 KiB into the save of step `first` (and stays full)
    m = re.search(r"step_(\\d+)", str(getattr(self.f, "name", "")))
    if m and int(m.group(1)) >= first and self.size > 4096 and not isinstance(self.f, Full):
        self.f = Full(self.f)
    return real(self, b)
ck._HashingWriter.write = write
from wm.utils.errors import run_cli
from wm.training.main import main
run_cli(lambda: main(sys.argv[2:]))
"""


@case("fulldisk", "the run folder's disk fills up during training: a 24 MiB tmpfs in a private mount namespace "
      "(unshare -rm, no privileges), the trainer paused after step 4 while a file fills the disk to its last "
      "byte, then let go; the disk freed and the same command again (without unshare: ENOSPC raised by a "
      "patched checkpoint writer in the trainer's process, and the table says so)",
      "exit 2, one error: line naming the step file and 'No space left on device', no Traceback; every committed "
      "checkpoint still there, same bytes, no temporary left; the rerun ends bitwise equal")
def case_fulldisk(ctx: Ctx) -> str:
    ref = ctx.ref
    over = {"checkpoint.keep_last": 30}  # nothing rotates away: every committed file must stay
    if not ctx.a.no_tmpfs and _can_unshare():
        disk = ctx.base / "disk"
        disk.mkdir()
        spec = {"disk": str(disk), "size": "24m", "copy_to": str(ctx.base / "fulldisk" / "r"),
                "cmd": train_cmd(ctx.args("disk", **dict(TOK, **over)))}
        (ctx.base / "fulldisk.json").write_text(json.dumps(spec))
        rc, out = run(["unshare", "-rm", sys.executable, str(Path(__file__).resolve()), "--_fulldisk-inner",
                       str(ctx.base / "fulldisk.json")], timeout=2 * RUN_S + 60)
        m = re.search(r"^RESULT (.*)$", out, re.M)
        expect(rc == 0 and m, f"the namespace helper failed (exit {rc})", out)
        res = json.loads(m.group(1))
        expect(res.get("reached"), "the trainer never reached step 4", res.get("out", out))
        expect(res.get("fill_errno") == errno.ENOSPC and res.get("free_after_fill", 1) < 4096,
               f"the disk did not fill ({res.get('free_after_fill')} bytes free)", out)
        expect(isinstance(res["rc"], int), res["rc"], res["out"])
        line = one_line_error(res["rc"], res["out"], "No space left on device", ".pt")
        how = "tmpfs in a private mount namespace"
        kept, after, temps = res["committed"], res["after"], res["temps"]
        rc2, out2, got = res["rc2"], res["out2"], ctx.base / "fulldisk" / "r"
    else:
        got = ctx.base / "fulldisk" / "r"
        cmd = ctx.args("fulldisk", **dict(TOK, **over))
        rc, out = run([sys.executable, "-c", FULL_DISK_PATCH, "5", *cmd])
        line = one_line_error(rc, out, "No space left on device", ck.checkpoint_name(5))
        how = (f"SIMULATED ({'--no-tmpfs' if ctx.a.no_tmpfs else 'unshare -rm unavailable'}): ENOSPC raised by a "
               "patched checkpoint writer")
        folder = cdir(got)
        kept = {ck.checkpoint_name(s): None for s in range(1, 5)}
        after = {n: None for n in kept if (folder / n).is_file() and ck.load_checked(folder / n)}
        temps = [q.name for q in folder.iterdir() if ".tmp-" in q.name]
        rc2, out2 = run(train_cmd(cmd))
    lost = [n for n in kept if n not in after or after[n] != kept[n]]
    expect(not lost, f"checkpoints lost or changed by the full disk: {lost}", out)
    expect(not temps, f"temporaries left in the checkpoint folder: {temps}", out)
    expect(rc2 == 0, f"the rerun on the freed disk: exit {rc2}", out2)
    kept_how = "same bytes" if any(kept.values()) else "each valid"
    return (f"[{how}] '{short(line, 100)}'; {len(kept)} committed files kept, {kept_how}, no temporary; rerun: "
            + expect_bitwise(ref, got, out2))


@case("lock", "a second train.py on the run folder of a running one (the first paused after step 2 so it is "
      "surely still running), then the first let go to its end",
      "the second: exit 2, one error: line naming the first's pid, host and run.lock, nothing in the folder "
      "written; the first ends exit 0, bitwise equal to an uninterrupted run")
def case_lock(ctx: Ctx) -> str:
    ref, cmd = ctx.ref, train_cmd(ctx.tok("lock"))
    run_dir = ctx.base / "lock" / "r"
    p = Proc(cmd)
    try:
        expect(p.wait_for(rf"^tokenizer step 2/{STEPS} ", RUN_S), "the first never reached step 2", p.output)
        os.killpg(p.pid, signal.SIGSTOP)
        before = {str(f.relative_to(run_dir)): sha256(f) for f in run_dir.rglob("*") if f.is_file()}
        rc2, out2 = run(train_cmd(ctx.tok("lock", **{"tokenizer_stage.lr": 1e-4})))
        line = one_line_error(rc2, out2, f"pid {p.pid}", socket.gethostname(), run_dir / "run.lock")
        now = {str(f.relative_to(run_dir)): sha256(f) for f in run_dir.rglob("*") if f.is_file()}
        expect(now == before, "the refused trainer changed the run folder", out2)
    finally:
        try:
            os.killpg(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    rc = p.finish()
    expect(rc == 0 and "Traceback" not in p.output, f"the first: exit {rc}", p.output)
    return f"second: '{short(line, 100)}', folder untouched; first: exit 0, " + expect_bitwise(ref, run_dir, p.output)


@case("_fail", "(self-test) a command that succeeds where a one-line error is expected", "a FAIL", hidden=True)
def case_fail(ctx: Ctx) -> str:
    rc, out = run([sys.executable, "-c", "print('all is well')"], timeout=60)
    return one_line_error(rc, out, "nothing")


@case("_hang", "(self-test) a command that sleeps past its 2 s timeout", "a FAIL: hung, its group killed",
      hidden=True)
def case_hang(ctx: Ctx) -> str:
    rc, out = run([sys.executable, "-c", "import time; time.sleep(120)"], timeout=2)
    return f"exit {rc}"


# ---------------------------------------------------------------------------------------------


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def table(rows: list) -> str:
    cells = [("case", "what was done", "expected", "observed", "result")] + [
        (r["case"], r["done"], r["expected"], r["observed"], r["status"]) for r in rows]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * 5]
    out += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in row) + " |" for row in cells[1:]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help="comma-separated case names (default: all; --list names them)")
    ap.add_argument("--list", action="store_true", help="name the cases and exit")
    ap.add_argument("--json", help="write the table (and each FAIL's output) here as JSON")
    ap.add_argument("--seed", type=int, default=0, help="the kill -9 instants")
    ap.add_argument("--kills", type=int, default=8, help="kill -9 at least this many times (half inside saves)")
    ap.add_argument("--kill-steps", type=int, default=8, help="steps of each stage in the kill -9 case")
    ap.add_argument("--kill-budget", type=float, default=240, help="seconds the kill -9 case may take")
    ap.add_argument("--no-tmpfs", action="store_true", help="simulate the full disk in the trainer's process")
    ap.add_argument("--_fulldisk-inner", dest="fulldisk_inner", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.fulldisk_inner:
        return fulldisk_inner(a.fulldisk_inner)
    if a.list:
        for k, c in CASES.items():
            if not c["hidden"]:
                print(f"{k:<20} {c['done']}")
        return 0
    names = [n for n, c in CASES.items() if not c["hidden"]] if not a.cases else a.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        known = ", ".join(k for k, c in CASES.items() if not c["hidden"])
        print(f"error: unknown case {', '.join(unknown)}; the cases: {known}", file=sys.stderr)
        return 2

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    t_start, rows = time.time(), []
    try:
        with tempfile.TemporaryDirectory(prefix="wm-attack-") as tmp:
            ctx = Ctx(Path(tmp), a)
            REDACT[:] = [tmp]
            t0 = time.time()
            try:
                ctx.prepare(names)
            except Exception as e:  # the cases that need them fail one by one below, building them again
                print(f"fixtures: {getattr(e, 'observed', e)}", file=sys.stderr)
            print(f"[{time.time() - t_start:5.0f} s] fixtures built ({time.time() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
            for n in names:
                c, t0 = CASES[n], time.time()
                row = {"case": n, "done": c["done"], "expected": c["expected"]}
                try:
                    row.update(observed=c["fn"](ctx), status="PASS")
                except Failed as e:
                    row.update(observed=e.observed, status="FAIL", output=e.output[-4000:])
                except Exception as e:  # a bug of the case itself, or of what it called in-process
                    row.update(observed=f"the case crashed: {type(e).__name__}: {e}", status="FAIL",
                               output=traceback.format_exc()[-4000:])
                finally:
                    for q in list(LIVE):
                        q.kill()
                    for kcld in KILL_CHILDREN:
                        if kcld.p.exitcode is None:
                            kill_tree(kcld.p.pid)
                row["observed"] = row["observed"].replace(tmp, "<tmp>")
                row["seconds"] = round(time.time() - t0, 1)
                rows.append(row)
                print(f"[{time.time() - t_start:5.0f} s] {n}: {row['status']} ({row['seconds']} s): {row['observed']}",
                      file=sys.stderr, flush=True)
                if row["status"] == "FAIL" and row.get("output"):
                    print("    " + "\n    ".join(row["output"].strip().splitlines()[-6:]), file=sys.stderr, flush=True)
    finally:
        for q in list(LIVE):
            q.kill()
    wall = time.time() - t_start
    ok = all(r["status"] == "PASS" for r in rows)
    print(table(rows))
    print(f"\n{sum(r['status'] == 'PASS' for r in rows)} of {len(rows)} cases PASS; {wall:.0f} s on {machine()}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "command": " ".join(["python", "tools/attack.py", *(argv if argv is not None else sys.argv[1:])]),
            "machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(wall, 1), "passed": ok, "cases": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
