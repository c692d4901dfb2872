"""kill -9 a tiny two-stage training run at random instants, half of them during checkpoint saves,
resume it each time with the same command, and check that it ends bitwise equal to a run that was
never interrupted (both stages' final state and best checkpoint, and the tokenizer the world stage
trained on).

    python tools/kill_campaign.py                       # >= 30 kills, >= half during saves, seed 0
    python tools/kill_campaign.py --kills 40 --seed 3 --json kills.json

The trainer runs in a child that marks each checkpoint save on stdout and widens the instants
between the renames of a save by a few random milliseconds (the renames themselves are wm's own),
so a kill can land before, inside or between any of them. Children are forked from a fork server
that has imported torch and wm once (multiprocessing's "forkserver"), so a restart costs a fork, not
the seconds of an interpreter importing torch: on a loaded 2-core machine those seconds were most
of a campaign. Every kill line, and every round's comparison, is printed as it happens. A "save" kill waits for a save to begin
and strikes within its typical length; an "any" kill strikes at a uniform instant of the process's
life (start-up, data, the token cache, training, validation). After every kill the tool checks
that each stage folder still has a valid newest checkpoint (wm.checkpoint.files.newest_valid) and that
the next run resumes no earlier than the newest step committed before the kill. When a run
finishes before enough kills landed, the round is compared with the reference and a new round
starts in a fresh folder.
"""

import argparse
import json
import multiprocessing
import os
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # before torch: the fork server inherits it

import torch  # noqa: E402

from wm.checkpoint.files import CheckpointError, load_checked, newest_valid, sha256_file  # noqa: E402
from wm.utils.errors import WMError, run_cli  # noqa: E402

SETTINGS = {  # tiny models on 16x16x4 frames; both stages; a save every step, best every 3
    "data.grid": "16,16,4", "data.past": "2", "data.future": "2", "loader.num_workers": "0",
    "tokenizer.widths": "8,8,8", "tokenizer.codebook_size": "16", "tokenizer.code_dim": "8",
    "tokenizer.dead_code_steps": "2", "world.widths": "8,16", "world.heads": "2",
    "train.device": "cpu", "logging.tensorboard": "false", "logging.every": "1",
    "train.stages": "tokenizer,world", "checkpoint.every": "1", "checkpoint.keep_last": "2",
    "tokenizer_stage.batch_size": "2", "tokenizer_stage.warmup_steps": "2",
    "tokenizer_stage.eval_every": "3", "world_stage.batch_size": "2", "world_stage.warmup_steps": "2",
    "world_stage.eval_every": "3",
}

def child_main(argv: list, out) -> None:
    """A trainer (train.py's main with `argv`) whose stdout and stderr go to the pipe `out`, in its
    own session; it marks each save and widens the instants between a save's renames."""
    import random

    import wm.checkpoint.checkpointer as c
    from wm.utils.errors import run_cli
    from wm.training.main import main

    os.setsid()
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.stdout
    rnd = random.Random()
    write, replace = c.Checkpointer._write, os.replace

    def marked(self, *a, **kw):
        print("wm-save-begin", flush=True)
        write(self, *a, **kw)
        print("wm-save-end", flush=True)

    def widened(src, dst, *a, **kw):  # a few ms before each rename of a checkpoint file: room to land in
        if "checkpoints" in str(dst) or str(dst).endswith("done.json"):
            time.sleep(rnd.uniform(0, 0.02))
        return replace(src, dst, *a, **kw)

    c.Checkpointer._write = marked
    os.replace = widened
    sys.argv = ["train.py", *argv]
    run_cli(lambda: main(argv))


FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(["torch", "wm.training.main", "wm.checkpoint.files"])

KEYS = ("model", "optimizer", "scaler", "sampler", "rng", "step")


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Child:
    """A trainer forked from the fork server, its output read line by line by a thread."""

    def __init__(self, argv):
        r, w = FORKS.Pipe(duplex=False)
        self.p = FORKS.Process(target=child_main, args=(argv, w), daemon=True)
        self.p.start()
        w.close()  # the child holds the write end now: its death ends the stream
        self.q, self.lines = queue.Queue(), []
        threading.Thread(target=self._read, args=(r,), daemon=True).start()

    def _read(self, r):
        with open(r.fileno(), "r", closefd=False) as f:
            for line in f:
                self.q.put(line)
        r.close()
        self.q.put(None)

    def kill(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)

    def wait(self) -> int:
        self.p.join()
        return self.p.exitcode

    def next_line(self, timeout):
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            return ""
        if line is None:
            self.q.put(None)
            return None
        self.lines.append(line)
        return line

    def drain(self):
        while (line := self.next_line(0.2)) is not None and line != "":
            pass

    @property
    def output(self):
        return "".join(self.lines)


def stage_states(run_dir: Path) -> dict:
    out = {}
    for stage in ("tokenizer", "world"):
        folder = run_dir / stage / "checkpoints"
        found = newest_valid(folder, say=lambda m: None)
        best = load_checked(folder / "best.pt") if (folder / "best.pt").exists() else None
        out[stage] = (found[1] if found else None, best)
    return out


def compare(ref: dict, got: dict) -> list[str]:
    bad = []
    for stage in ("tokenizer", "world"):
        (rs, rb), (gs, gb) = ref[stage], got[stage]
        for k in KEYS:
            if not same(rs[k], gs[k]):
                bad.append(f"{stage} final {k}")
        if not same(rb["model"], gb["model"]) or rb["step"] != gb["step"]:
            bad.append(f"{stage} best.pt (step {rb['step']} vs {gb['step']})")
    # the world stage names its tokenizer by file and sha256 (the files differ between run folders:
    # the state holds run.out_dir): it must be this run's tokenizer best.pt, equal to the reference's
    tok = got["world"][0]["tokenizer"]
    if Path(tok["path"]).name != "best.pt" or sha256_file(Path(tok["path"])) != tok["sha256"]:
        bad.append(f"the world stage's tokenizer ({tok['path']})")
    return bad


def committed_steps(run_dir: Path) -> dict:
    steps = {}
    for stage in ("tokenizer", "world"):
        try:
            found = newest_valid(run_dir / stage / "checkpoints", say=lambda m: None)
        except CheckpointError as e:
            raise WMError(f"after a kill: {e}") from None
        steps[stage] = found[1]["step"] if found else 0
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps of each stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    rnd = random.Random(a.seed)
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="wm-kills-"))
    t_start = time.time()
    try:
        from wm.data.synthetic.generate import write_synthetic

        data = base / "data"
        if not (data / "manifest.json").exists():
            write_synthetic(data, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4))

        def cmd(out):
            s = dict(SETTINGS, **{"data.root": str(data), "run.out_dir": str(base / out), "run.name": "r",
                                  "tokenizer_stage.max_steps": str(a.steps), "world_stage.max_steps": str(a.steps)})
            return [x for k, v in s.items() for x in ("--set", f"{k}={v}")]

        warm = FORKS.Process(target=int)  # starts the fork server (torch imported once), outside any timing
        warm.start()
        warm.join()
        ref_dir, life_len = base / "straight" / "r", [8.0]
        if not ref_dir.exists():
            t0, c = time.time(), Child(cmd("straight"))
            rc = c.wait()
            c.drain()
            if rc != 0:
                raise WMError(f"the uninterrupted reference run failed (exit {rc}):\n{c.output[-3000:]}")
            life_len = [time.time() - t0]
            print(f"reference run: {life_len[0]:.1f} s", flush=True)
        ref = stage_states(ref_dir)

        kills, rounds, save_len = [], [], [0.05]
        rnd_no, resumes_checked = 0, 0
        def enough():  # at least --kills, at least half of them during saves
            return len(kills) >= a.kills and 2 * sum(k["during_save"] for k in kills) >= len(kills)

        while not enough():
            rnd_no += 1
            out = f"killed{rnd_no}"
            shutil.rmtree(base / out, ignore_errors=True)
            run_dir, before, finished = base / out / "r", {"tokenizer": 0, "world": 0}, False
            while not finished:
                c = Child(cmd(out))
                behind = 2 * sum(k["during_save"] for k in kills) < len(kills)  # fewer than half in saves
                t0, mode = time.time(), ("save" if behind or rnd.random() < 0.5 else "any")
                in_save, t_begin = False, None
                # "any": a uniform instant of a whole run's life; "save": inside the 1st-4th save of this
                # process (the first is often the replay of a step the last kill interrupted)
                deadline = t0 + rnd.uniform(0.3, max(life_len)) if mode == "any" else None
                strike, saves, nth_save = None, 0, rnd.randint(1, 4)
                while True:
                    line = c.next_line(0.002)
                    if line is None:
                        break
                    if line.startswith("wm-save-begin"):
                        in_save, t_begin, saves = True, time.time(), saves + 1
                        if mode == "save" and strike is None and saves >= nth_save:
                            strike = t_begin + rnd.uniform(0, 0.9 * sorted(save_len)[len(save_len) // 2])
                    elif line.startswith("wm-save-end"):
                        in_save = False
                        if t_begin is not None:
                            save_len.append(time.time() - t_begin)
                    m = re.search(r"resumed from (\S+) at step (\d+)/", line or "")
                    if m:
                        stage = "world" if "/world/" in m.group(1) else "tokenizer"
                        if int(m.group(2)) < before[stage]:
                            raise WMError(f"round {rnd_no}: {stage} resumed at step {m.group(2)}, but step "
                                          f"{before[stage]} was committed before the kill")
                        resumes_checked += 1
                    now = time.time()
                    if (deadline and now >= deadline) or (strike and now >= strike):
                        c.kill()
                        break
                rc = c.wait()
                c.drain()
                if rc == 0:
                    finished = True
                    life_len.append(time.time() - t0)
                    break
                if rc != -signal.SIGKILL:
                    raise WMError(f"round {rnd_no}: the run failed (exit {rc}):\n{c.output[-3000:]}")
                during = in_save or any(ln.startswith("wm-save-begin") for ln in c.lines[-1:])  # incl. unread
                before = committed_steps(run_dir) if run_dir.exists() else before
                kills.append({"round": rnd_no, "mode": mode, "after_s": round(time.time() - t0, 3),
                              "during_save": bool(during), "committed": dict(before)})
                n_save = sum(k["during_save"] for k in kills)
                print(f"kill {len(kills):>3}: round {rnd_no}, {mode:<4} at {time.time() - t0:5.2f} s, "
                      f"{'during a save' if during else 'between saves':<13}, committed {before}; so far "
                      f"{n_save} during saves, every resume at or after its committed step "
                      f"[{time.time() - t_start:.0f} s]", flush=True)
            bad = compare(ref, stage_states(run_dir))
            rounds.append({"round": rnd_no, "kills": sum(k["round"] == rnd_no for k in kills),
                           "bitwise_equal": not bad, "differs": bad})
            equal = sum(r["bitwise_equal"] for r in rounds)
            print(f"round {rnd_no}: {'bitwise equal to the uninterrupted run' if not bad else 'DIFFERS: ' + ', '.join(bad)}"
                  f" (so far {equal} of {len(rounds)} rounds equal) [{time.time() - t_start:.0f} s]", flush=True)
        during = sum(k["during_save"] for k in kills)
        ok = all(r["bitwise_equal"] for r in rounds)
        print(f"\n{len(kills)} kills ({during} during saves, {len(kills) - during} between), {len(rounds)} round(s), "
              f"{resumes_checked} resumes checked; every round bitwise equal: {ok}; {time.time() - t_start:.0f} s")
        if a.json:
            Path(a.json).write_text(json.dumps({"seed": a.seed, "kills": kills, "rounds": rounds,
                                                "during_saves": during, "all_equal": ok}, indent=1))
        return 0 if ok else 1
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    run_cli(main)
