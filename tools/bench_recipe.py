"""The recipe's time from a measured run at the real data size: what a user of a preset waits for.

    python tools/bench_recipe.py --cfg configs/occworld.json --steps 438 --preempt-after 40 \
        --set synthetic.train_scenes=700 --set synthetic.val_scenes=150 --set synthetic.format=memmap \
        --out /scratch/recipe --json benchmarks/recipe.json --occworld ~/OccWorld

1. Trains the preset as it is (its global batch, data, compile choice) for `--steps` optimizer steps
   a stage (default 438: one OccWorld epoch of 3500 samples at 8 a step) with `train.py` in a
   subprocess, every output line stamped with its time (`<out>/train.log`); torch's local compile
   caches live under `<out>` (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR). Where the preset's own
   length compiles (compile.enable auto and max_steps >= compile.min_steps) the short run compiles too.
2. With `--preempt-after S`: S seconds after the tokenizer's first step, SIGTERM (a spot node's
   notice); the local compile caches are emptied (a fresh node) and the same command resumes from
   the run's checkpoint and its compile cache (`<out>/resume.log`): the resume's first step is the
   figure.
3. From the stamped lines: data generation, each stage's first step (compile), its steady rate
   (median of the step lines after the first), its validation rate and seconds, the token cache,
   the whole run. The recipe's time: per stage, the preset's max_steps x global batch at the steady
   rate, plus its validations (max_steps / eval_every, at the measured validation seconds), plus
   one compile; OccWorld's code at its batch 1 beside it (the preset's samples at its rates).
4. With `--occworld PATH` (a checkout of wzzheng/OccWorld, checked before the runs start): after
   the runs have finished, OccWorld's own training step of each stage, imported from PATH and run
   as its train.py runs it (tools/occworld_harness.py: fp32, batch 1, its configs' models, losses,
   AdamW and clip), timed on the same device for `--occworld-steps` steps after
   `--occworld-warmup` untimed ones: its tokenizer frames/s (10-frame samples) and world windows/s
   (its 16-frame windows: 15 frames in, each one's next the target; wm's preset trains on its own
   data.past + data.future windows) are the `OccWorld's code h` rates, measured in this run; the
   figures (and the checkout's commit, the shims used) go to the report's `occworld_code`. Or
   `--occworld-rates TOK,WORLD` types those two rates in (e.g. tools/bench_train.py's OccWorld
   figures on the same card); not both.
A benchmark, not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from wm.utils.errors import WMError, first_line, run_cli  # noqa: E402

STAGES = ("tokenizer", "world")
STEP = re.compile(r"^(tokenizer|world) step (\d+)/(\d+) .* ([\d.]+) samples/s")
FIRST = re.compile(r"^(tokenizer|world): first step ([\d.]+) s")
VAL = re.compile(r"^\s*(tokenizer|world) validation: (\d+)/(\d+) windows, ([\d.]+) windows/s")
CACHE = re.compile(r"^token cache: (\d+)/(\d+) frames encoded \((\d+) frames/s\)")


def stamped(cmd: list[str], log: Path, env: dict, on_line=None) -> tuple[subprocess.Popen, float]:
    """Start `cmd` (its own process group); a thread writes each output line to `log` as `<seconds
    since start> <line>` and calls on_line(t, line). Returns the process and its start time."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         bufsize=1, start_new_session=True)
    t0 = time.perf_counter()

    def pump():
        with open(log, "w") as f:
            for line in p.stdout:
                t = time.perf_counter() - t0
                f.write(f"{t:.2f} {line}")
                f.flush()
                if on_line:
                    on_line(t, line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return p, t0


def read_log(log: Path) -> list[tuple[float, str]]:
    out = []
    for ln in log.read_text().splitlines():
        t, _, line = ln.partition(" ")
        try:
            out.append((float(t), line))
        except ValueError:
            continue
    return out


def phases(lines: list[tuple[float, str]]) -> dict:
    """What the stamped lines of one train.py process say: seconds of each phase and the rates."""
    out: dict = {"wall_s": round(lines[-1][0], 1) if lines else 0.0}
    gen = [i for i, (_, ln) in enumerate(lines) if ln.startswith("generating synthetic")]
    if gen and gen[0] + 1 < len(lines):
        out["generation_s"] = round(lines[gen[0] + 1][0] - lines[gen[0]][0], 1)
    for stage in STAGES:
        s: dict = {}
        rates = []
        for t, ln in lines:
            if (m := FIRST.match(ln)) and m[1] == stage:
                s["first_step_s"] = float(m[2])
                s["cached"] = "from the run's compile cache" in ln
            elif (m := STEP.match(ln)) and m[1] == stage:
                rates.append((int(m[2]), float(m[4])))
            elif (m := VAL.match(ln)) and m[1] == stage and m[2] == m[3]:
                s["val_windows"], s["val_windows_per_s"] = int(m[3]), float(m[4])
                s["val_s"] = round(int(m[3]) / float(m[4]), 1)
        # the first step line's rate holds the compile; the rest are steady
        steady = [r for _, r in rates[1:]] if len(rates) > 1 else [r for _, r in rates]
        if steady:
            s["samples_per_s"] = round(statistics.median(steady), 2)
            s["steps"] = rates[-1][0]
        if s:
            out[stage] = s
    caches = [(t, m) for t, ln in lines if (m := CACHE.match(ln))]
    if caches:
        done = [m for _, m in caches if m[1] == m[2]]
        if done:
            out["token_cache_frames"], out["token_cache_frames_per_s"] = int(done[-1][2]), int(done[-1][3])
            out["token_cache_s"] = round(int(done[-1][2]) / max(1, int(done[-1][3])), 1)
    return out


def recipe_time(cfg, measured: dict, occworld: Optional[dict] = None) -> dict:
    """The preset's whole schedule at the measured rates: per stage its steps x global batch at the
    steady rate, its validations, one compile."""
    from wm.training.batching import stage_batch

    out, total = {}, 0.0
    for stage in STAGES:
        m = measured.get(stage, {})
        if "samples_per_s" not in m:
            continue
        s = getattr(cfg, f"{stage}_stage")
        samples = s.max_steps * stage_batch(cfg, stage, 1).per_step
        train_h = samples / m["samples_per_s"] / 3600
        every = s.eval_every if s.eval_every > 0 else s.max_steps
        vals = max(1, s.max_steps // every)
        val_h = vals * m.get("val_s", 0.0) / 3600
        compile_h = m.get("first_step_s", 0.0) / 3600
        row = {"max_steps": s.max_steps, "samples": samples, "validations": vals,
               "train_h": round(train_h, 2), "val_h": round(val_h, 2), "compile_h": round(compile_h, 3),
               "total_h": round(train_h + val_h + compile_h, 2)}
        if occworld and stage in occworld:
            row["occworld_code_h"] = round(samples / occworld[stage] / 3600, 1)
        out[stage] = row
        total += row["total_h"]
    out["total_h"] = round(total, 2)
    if occworld and all("occworld_code_h" in out.get(s, {}) for s in STAGES):
        out["occworld_code_total_h"] = round(sum(out[s]["occworld_code_h"] for s in STAGES), 1)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", default="configs/occworld.json", help="the preset (its schedule is the recipe)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for the measured run (repeatable)")
    ap.add_argument("--steps", type=int, default=438, help="optimizer steps a stage of the measured run")
    ap.add_argument("--preempt-after", type=float, default=0, metavar="S",
                    help="SIGTERM S seconds after the tokenizer's first step, then resume on emptied local caches")
    ap.add_argument("--occworld-rates", metavar="TOK,WORLD",
                    help="OccWorld's code at its batch 1 on this card, typed in: tokenizer frames/s, world windows/s")
    ap.add_argument("--occworld", metavar="PATH",
                    help="a checkout of wzzheng/OccWorld: time its own training step of each stage after the runs")
    ap.add_argument("--occworld-steps", type=int, default=30, help="timed steps of OccWorld's code a stage")
    ap.add_argument("--occworld-warmup", type=int, default=5, help="untimed steps of OccWorld's code before them")
    ap.add_argument("--occworld-small", action="store_true",
                    help="OccWorld's models shrunk to run in seconds on a CPU (a check of the harness, not a benchmark)")
    ap.add_argument("--out", default="runs/bench_recipe", help="run folder parent, logs, local compile caches")
    ap.add_argument("--json", help="write the figures here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    from bench_finetune import machine

    from wm.config.loading import load

    if a.steps < 1:
        raise WMError(f"--steps must be >= 1, got {a.steps}")
    occworld = None
    if a.occworld and a.occworld_rates:
        raise WMError("--occworld times OccWorld's code in this run and --occworld-rates types its rates in: give one")
    if a.occworld:
        if a.occworld_steps < 1 or a.occworld_warmup < 0:
            raise WMError(f"--occworld-steps must be >= 1 and --occworld-warmup >= 0, got {a.occworld_steps} and "
                          f"{a.occworld_warmup}")
        import occworld_harness as H

        for stage in STAGES:
            H.load_train(a.occworld, stage)  # a bad checkout is one line now, not after the runs
    if a.occworld_rates:
        try:
            tok, world = (float(v) for v in a.occworld_rates.split(","))
        except ValueError:
            raise WMError(f"--occworld-rates {a.occworld_rates!r}: give two numbers, frames/s,windows/s") from None
        occworld = {"tokenizer": tok, "world": world}
    recipe = load(a.cfg, a.set)  # the schedule as the preset has it (refused here in one line if bad)
    out = Path(a.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from wm.training.wrappers import compiles as stage_compiles

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # train.device=auto's choice
    compiles = any(stage_compiles(recipe, device, getattr(recipe, f"{s}_stage").max_steps) for s in STAGES)
    cmd = [sys.executable, "train.py", "--cfg", a.cfg, *[x for kv in a.set for x in ("--set", kv)],
           "--set", f"tokenizer_stage.max_steps={a.steps}", "--set", f"world_stage.max_steps={a.steps}",
           "--set", f"compile.enable={'true' if compiles else 'false'}", "--set", f"run.out_dir={out / 'runs'}"]
    caches = {"TORCHINDUCTOR_CACHE_DIR": out / "inductor", "TRITON_CACHE_DIR": out / "triton"}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in caches.items()}}
    print(" ".join(cmd), flush=True)
    first_at: list[float] = []

    def watch(t, line):
        print(line, flush=True)
        if FIRST.match(line) and line.startswith("tokenizer") and not first_at:
            first_at.append(t)

    p, t0 = stamped(cmd, out / "train.log", env, watch)
    preempted = False
    while p.poll() is None:
        time.sleep(0.5)
        if a.preempt_after and first_at and not preempted and time.perf_counter() - t0 - first_at[0] >= a.preempt_after:
            os.killpg(p.pid, signal.SIGTERM)  # the trainer saves and exits; its loader workers ignore it
            preempted = True
    p.wait()
    time.sleep(0.5)  # the pump's last lines
    rep = {"machine": machine(), "cfg": a.cfg, "sets": a.set, "steps": a.steps, "compile": compiles,
           "command": cmd, "run": phases(read_log(out / "train.log")), "returncode": p.returncode}
    if preempted:
        for d in caches.values():
            shutil.rmtree(d, ignore_errors=True)  # a fresh node: only the run folder survives
        print("resuming on emptied local compile caches", flush=True)
        q, _ = stamped(cmd, out / "resume.log", env, lambda t, line: print(line, flush=True))
        q.wait()
        time.sleep(0.5)
        rep["resume"] = phases(read_log(out / "resume.log"))
        rep["resume_returncode"] = q.returncode
    occ_failed = False
    if a.occworld:
        rep["occworld_code"] = occworld_code(a.occworld, device, a.occworld_steps, a.occworld_warmup,
                                             recipe.data.window, a.occworld_small)
        occworld = {s: rep["occworld_code"][s]["samples_per_s"] for s in STAGES
                    if "samples_per_s" in rep["occworld_code"][s]}
        occ_failed = len(occworld) < len(STAGES)
    measured = merged(rep)
    rep["measured"] = measured
    rep["recipe"] = recipe_time(recipe, measured, occworld)
    if occworld:
        rep["occworld_rates"] = occworld
        rep["occworld_rates_from"] = "measured in this run (occworld_code)" if a.occworld else "--occworld-rates"
    print(table(rep))
    if a.json:
        from wm.utils.atomic import write_bytes

        write_bytes(a.json, json.dumps(rep, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0 if (p.returncode in (0, None) or preempted) and not occ_failed else 1


def occworld_code(path, device, steps: int, warmup: int, wm_window: int, small: bool = False) -> dict:
    """OccWorld's own training step of each stage on `device`, timed by tools/occworld_harness.py.
    In-process: the wm runs were subprocesses and have exited, so nothing of this process holds the
    device; each stage's model is freed (and its peak memory reset) before the next."""
    import torch

    import occworld_harness as H

    out: dict = {"steps": steps, "warmup": warmup, "device": str(device), "wm_window_frames": wm_window,
                 "size": "small (harness check)" if small else "its configs' sizes"}
    for stage in STAGES:
        print(f"OccWorld's code: {stage} training step, {warmup} untimed + {steps} timed steps on {device}", flush=True)
        try:
            r = H.train_rate(path, stage, device, steps, warmup, small)
        except Exception as e:  # its code, not ours: the runs' figures are still reported
            r = {"error": "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError)
                 else f"{type(e).__name__}: {first_line(e)}"}
            if not isinstance(e, (WMError, torch.cuda.OutOfMemoryError)):
                r["traceback"] = traceback.format_exc()
            print(f"OccWorld's code: {stage} failed: {r['error']}", flush=True)
        else:
            for k in ("root", "commit", "shims"):
                out[k] = r.pop(k)
            print(f"OccWorld's code: {stage} {r['samples_per_s']:.2f} {r['unit']}/s, {r['ms_per_step']:.1f} ms a step"
                  + (f", peak {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else ""), flush=True)
        out[stage] = r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def merged(rep: dict) -> dict:
    """Per stage, the figures of the process that ran most of it: the first run's, else the
    resume's (a stage the first run did not reach); the first step of each compile kept apart."""
    out = {k: v for k, v in rep["run"].items() if k not in STAGES}
    for stage in STAGES:
        a, b = rep["run"].get(stage, {}), rep.get("resume", {}).get(stage, {})
        m = dict(a) if a.get("samples_per_s") and a.get("steps", 0) >= b.get("steps", 0) - a.get("steps", 0) else dict(b)
        for k in ("val_windows", "val_windows_per_s", "val_s"):
            m.setdefault(k, a.get(k, b.get(k)))
        if a.get("first_step_s") is not None:
            m["first_step_s"] = a["first_step_s"]  # a fresh compile
            if b.get("first_step_s") is not None:  # a stage the first run never reached has no resume figure
                m["resume_first_step_s"] = b["first_step_s"]
        out[stage] = {k: v for k, v in m.items() if v is not None}
    if "token_cache_s" not in out and "token_cache_s" in rep.get("resume", {}):
        out.update({k: rep["resume"][k] for k in ("token_cache_frames", "token_cache_frames_per_s", "token_cache_s")})
    return out


def table(rep: dict) -> str:
    m, r = rep["measured"], rep["recipe"]
    lines = ["| stage | first step s | resume first step s | samples/s | validation | recipe h (train + val + compile)"
             + (" | OccWorld's code h |" if "occworld_rates" in rep else " |"),
             "|---|---|---|---|---|---|" + ("---|" if "occworld_rates" in rep else "")]
    for stage in STAGES:
        s, t = m.get(stage, {}), r.get(stage, {})
        val = f"{s['val_windows']} at {s['val_windows_per_s']:.1f}/s ({s['val_s']:.0f} s)" if "val_s" in s else "-"
        lines.append(f"| {stage} | {s.get('first_step_s', '-')} | {s.get('resume_first_step_s', '-')} | "
                     f"{s.get('samples_per_s', '-')} | {val} | " + (
                         f"{t['total_h']} ({t['train_h']} + {t['val_h']} + {t['compile_h']})" if t else "-")
                     + (f" | {t.get('occworld_code_h', '-')} |" if "occworld_rates" in rep else " |"))
    extra = [f"{k} {m[k]}" for k in ("generation_s", "token_cache_s", "wall_s") if k in m]
    return "\n".join(lines + [f"recipe total {r.get('total_h')} h" + (
        f" (OccWorld's code {r['occworld_code_total_h']} h)" if "occworld_code_total_h" in r else "")
        + ("; " + ", ".join(extra) if extra else "")] + occworld_note(rep))


def occworld_note(rep: dict) -> list[str]:
    """Where the OccWorld's code column's rates came from, under the table."""
    if "occworld_code" in rep:
        c = rep["occworld_code"]
        at = f"checkout {c.get('root', '?')}" + (f" at {c['commit'][:12]}" if c.get("commit") else "")
        parts = []
        for stage in STAGES:
            s = c.get(stage, {})
            if "error" in s:
                parts.append(f"{stage} failed ({s['error']})")
            elif stage == "tokenizer":
                parts.append(f"tokenizer {s['samples_per_s']:.2f} frames/s ({s['frames_per_sample']}-frame samples)")
            else:
                parts.append(f"world {s['samples_per_s']:.2f} windows/s (its {s['window_frames']}-frame windows; "
                             f"wm's preset trains on {c['wm_window_frames']}-frame windows)")
        size = "; SMALL MODELS, a check of the harness" if c.get("size", "").startswith("small") else ""
        return [f"OccWorld's code h: its own training step measured in this run on {c['device']} (fp32, batch 1, "
                f"{c['steps']} steps after {c['warmup']}{size}; {at}): " + ", ".join(parts)]
    if "occworld_rates" in rep:
        o = rep["occworld_rates"]
        return [f"OccWorld's code h: rates typed in (--occworld-rates), tokenizer {o['tokenizer']} frames/s, "
                f"world {o['world']} windows/s"]
    return []


if __name__ == "__main__":
    run_cli(main)
