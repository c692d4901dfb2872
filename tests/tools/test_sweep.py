"""tools/sweep.py: the queue of a grid's runs, skipping finished runs on a re-run, SIGTERM and kill -9 of
the launcher (no process left, the runs resume bitwise), a failed run, the refusals, the SLURM array.
Tiny tokenizer-only runs on the CPU (tests/helpers.py's `Tiny`), two at a time."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, TINY_SETTINGS, Proc, assert_same
from wm.checkpoint.files import latest_checkpoint, load
from wm.config.loading import load as load_config, save as save_config
from wm.utils import runlock
from wm.utils.errors import WMError

sys.path.insert(0, str(ROOT / "tools"))
import runs  # noqa: E402
import sweep  # noqa: E402

STEPS = 32  # long enough for a SIGTERM to land mid-stage, short enough for seconds a run
GRID = ["--grid", "tokenizer_stage.lr=1e-3,3e-3", "--grid", "tokenizer.code_dim=4,8"]
NAMES = ["tokenizer_stage.lr-1e-3__tokenizer.code_dim-4", "tokenizer_stage.lr-1e-3__tokenizer.code_dim-8",
         "tokenizer_stage.lr-3e-3__tokenizer.code_dim-4", "tokenizer_stage.lr-3e-3__tokenizer.code_dim-8"]


def base_cfg(folder: Path, data: Path) -> Path:
    """The tiny settings on the data set `data` as a config file in `folder`: the sweep's --cfg."""
    sets = {**TINY_SETTINGS, "data.root": str(data), "tokenizer_stage.max_steps": str(STEPS)}
    path = folder / "base.json"
    save_config(load_config(None, [f"{k}={v}" for k, v in sets.items()]), path)
    return path


def cmd(cfg: Path, out: Path, grid=GRID) -> list:
    return [sys.executable, "tools/sweep.py", "--cfg", cfg, *grid, "--out", out, "--jobs", "2"]


def model(run_dir: Path) -> dict:
    return load(latest_checkpoint(run_dir / "tokenizer" / "checkpoints"))["model"]


def started(output: str) -> list[int]:
    """The pids of the runs a sweep started (its `start ... (pid N, ...` lines)."""
    return [int(p) for p in re.findall(r"^start .* \(pid (\d+),", output, re.M)]


def in_groups(groups) -> list[int]:
    """The live processes (zombies that no one reaped have ended) of these process groups: a run's
    group holds train.py or torchrun and what they start in it."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if int(pgrp) in groups and state != "Z":
            out.append(int(stat.parent.name))
    return out


def all_gone(groups, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while in_groups(groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not in_groups(groups)


PROCS: list[tuple[Proc, str]] = []


def start(argv, out: Path, env=None) -> Proc:
    """A sweep (a session of its own) into `out`: the test's end kills it and what is left of its runs."""
    PROCS.append((Proc(argv, env), f"run.out_dir={out}\0"))
    return PROCS[-1][0]


def ours(pid: int, marker: str) -> bool:
    """Whether `pid` is a run of this test's sweep (a pid of a run that ended may be another's now)."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


@pytest.fixture(autouse=True)
def no_process_survives():
    yield
    while PROCS:
        p, marker = PROCS.pop()
        p.kill()
        p.wait_for(r"$^", 0.2)  # the rest of its output: the runs it started
        for pid in started(p.output):
            if ours(pid, marker):
                os.killpg(pid, signal.SIGKILL)


def wait_for_file(path: Path, text: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        proc.wait_for(r"$^", 0.05)  # keeps reading the sweep's output
    raise AssertionError(f"no {text!r} in {path} within {timeout} s:\n{proc.output}")


def sweep_until_a_run_trains(cfg: Path, out: Path, grid=GRID, first=NAMES[0]) -> Proc:
    """A sweep started and let run until its first run has taken 2 of its STEPS steps."""
    p = start(cmd(cfg, out, grid), out)
    wait_for_file(out / "logs" / f"{first}.log", f"tokenizer step 2/{STEPS} ", p, 120)
    return p


@pytest.fixture(scope="module")
def swept(tiny_factory):
    """One uninterrupted sweep of the four runs, two at a time; later tests compare with it."""
    t = tiny_factory()
    cfg, out = base_cfg(t.base, t.data), t.base / "sweep"
    p = start(cmd(cfg, out), out)
    rc = p.finish(300)
    return SimpleNamespace(t=t, cfg=cfg, out=out, rc=rc, output=p.output)


# ---------------------------------------------------------------------------------------------
# the queue, the re-run


@pytest.mark.slow
def test_the_queue_trains_every_combination_in_its_own_folder(swept):
    assert swept.rc == 0, swept.output
    assert sorted(d.name for d in swept.out.iterdir() if (d / "config.json").is_file()) == NAMES
    for name in NAMES:
        cfg = json.loads((swept.out / name / "config.json").read_text())
        lr, dim = re.fullmatch(r"tokenizer_stage\.lr-(.+)__tokenizer\.code_dim-(\d+)", name).groups()
        assert cfg["tokenizer_stage"]["lr"] == float(lr) and cfg["tokenizer"]["code_dim"] == int(dim)
        assert cfg["run"]["out_dir"] == str(swept.out)
        assert runs.status(swept.out / name) == "finished"
        assert f"tokenizer step {STEPS}/{STEPS} " in (swept.out / "logs" / f"{name}.log").read_text()
        assert re.search(rf"^finished \[\d/4\] {re.escape(name)} in \d+ s$", swept.output, re.M), swept.output
    assert len(started(swept.output)) == 4
    rec = json.loads((swept.out / "sweep.json").read_text())
    assert rec["cfg"] == str(swept.cfg) and rec["grids"] == [["tokenizer_stage.lr", ["1e-3", "3e-3"]],
                                                            ["tokenizer.code_dim", ["4", "8"]]]
    assert [r["name"] for r in rec["runs"]] == NAMES
    assert re.search(r"^name +status .*\n(.*finished.*\n){4}sweep: all 4 runs finished", swept.output, re.M)


@pytest.mark.slow
def test_a_rerun_skips_finished_runs_and_waits_for_a_held_one(swept):
    ckpts = sorted(swept.out.glob("*/tokenizer/checkpoints/*.pt"))
    before = {c: c.stat().st_mtime_ns for c in ckpts}
    held = swept.out / NAMES[3]
    runlock.acquire(held)  # as a run still saving after a killed sweep: the sweep waits for it
    try:
        p = start(cmd(swept.cfg, swept.out), swept.out)
        assert p.wait_for(rf"^wait +\[4/4\] {re.escape(NAMES[3])}: running", 60), p.output
    finally:
        runlock.release(held)
    assert p.finish(60) == 0, p.output
    assert len(re.findall(r"^skip +\[\d/4\] .* \(finished\)$", p.output, re.M)) == 4, p.output
    assert not started(p.output)
    assert {c: c.stat().st_mtime_ns for c in ckpts} == before


# ---------------------------------------------------------------------------------------------
# stopping the sweep


@pytest.mark.slow
def test_sigterm_saves_every_run_and_the_rerun_ends_bitwise_as_an_uninterrupted_sweep(swept, tmp_path):
    out = tmp_path / "cut"
    p = sweep_until_a_run_trains(swept.cfg, out)
    p.p.send_signal(signal.SIGTERM)
    assert p.finish(120) == 128 + signal.SIGTERM, p.output
    assert "the same command resumes them" in p.output and "not started" in p.output, p.output
    assert all_gone(started(p.output), 10), in_groups(started(p.output))
    cut = [n for n in NAMES[:2] if runs.status(out / n) == "preempted"]  # a run may have ended first
    assert cut, [runs.status(out / n) for n in NAMES]
    assert all(load(latest_checkpoint(out / n / "tokenizer" / "checkpoints"))["step"] < STEPS for n in cut)

    p = start(cmd(swept.cfg, out), out)
    assert p.finish(300) == 0, p.output
    for n in cut:
        assert re.search(rf"tokenizer: resumed from .* at step \d+/{STEPS}", (out / "logs" / f"{n}.log").read_text())
    for name in NAMES:
        assert_same(model(out / name), model(swept.out / name), name)


@pytest.mark.slow
def test_kill_9_of_the_sweep_leaves_no_run_behind_and_a_rerun_completes(swept, tmp_path):
    out = tmp_path / "killed"
    grid = ["--grid", "tokenizer_stage.lr=1e-3,3e-3", "--set", "tokenizer.code_dim=4"]  # NAMES[0] and NAMES[2]
    p = sweep_until_a_run_trains(swept.cfg, out, grid, "tokenizer_stage.lr-1e-3")
    pids = started(p.output)
    assert len(pids) == 2, p.output
    p.p.kill()  # the launcher alone: its runs are in sessions of their own
    p.finish(10)
    assert all_gone(pids, 60), f"processes {in_groups(pids)} outlived their killed sweep"
    states = [runs.status(out / f"tokenizer_stage.lr-{lr}") for lr in ("1e-3", "3e-3")]
    assert "preempted" in states, states  # PR_SET_PDEATHSIG's SIGTERM: a graceful save (a run may have ended first)

    p = start(cmd(swept.cfg, out, grid), out)
    assert p.finish(300) == 0, p.output
    for lr, name in (("1e-3", NAMES[0]), ("3e-3", NAMES[2])):
        assert_same(model(out / f"tokenizer_stage.lr-{lr}"), model(swept.out / name), name)


# ---------------------------------------------------------------------------------------------
# a failed run, the refusals


@pytest.mark.slow
def test_a_failed_run_exits_1_and_the_others_finish(swept, tmp_path):
    out = tmp_path / "bad"
    p = start([sys.executable, "tools/sweep.py", "--cfg", swept.cfg, "--grid",
              f"data.root={swept.t.data},{tmp_path / 'missing'}", "--set", "tokenizer_stage.max_steps=2",
              "--out", out, "--jobs", "2"], out)
    assert p.finish(300) == 1, p.output
    good, bad = (sweep.run_name([("data.root", str(v))]) for v in (swept.t.data, tmp_path / "missing"))
    assert runs.status(out / good) == "finished"
    assert re.search(rf"^failed +\[2/2\] {re.escape(bad)}: exit 2, .*: error: data set folder .*missing",
                     p.output, re.M), p.output
    assert f"1 of 2 runs failed: {bad}" in p.output


def refusal(argv) -> str:
    with pytest.raises(WMError) as e:
        sweep.main([str(a) for a in argv])
    assert "\n" not in str(e.value)
    return str(e.value)


def test_refusals_are_one_line_naming_the_flag(tmp_path, monkeypatch):
    cfg, out = base_cfg(tmp_path, tmp_path / "data"), tmp_path / "o"  # refused before any data is read
    base = ["--cfg", cfg, "--out", out]
    assert refusal([*base, "--grid", "tokenizer_stage.lrr=1e-3"]).startswith(
        "--grid tokenizer_stage.lrr=1e-3: config key 'tokenizer_stage.lrr': unknown key; did you mean "
        "'tokenizer_stage.lr'?")
    assert refusal([*base, "--grid", "tokenizer_stage.lr=1e-3,abc"]).startswith(
        "--grid tokenizer_stage.lr=abc: config key 'tokenizer_stage.lr': expected float")
    assert "empty value" in refusal([*base, "--grid", "tokenizer_stage.lr="])
    assert "empty value" in refusal([*base, "--grid", "tokenizer_stage.lr=1e-3,,3e-3"])
    assert "lists a value twice" in refusal([*base, "--grid", "tokenizer_stage.lr=1e-3,1e-3"])
    assert "have the same config" in refusal([*base, "--grid", "tokenizer_stage.lr=1e-3,0.001"])
    assert "given twice" in refusal([*base, "--grid", "tokenizer.code_dim=4", "--grid", "tokenizer.code_dim=8"])
    assert "both as --set and as --grid" in refusal([*base, "--grid", "tokenizer.code_dim=4,8", "--set",
                                                      "tokenizer.code_dim=4"])
    assert "sets run.out_dir and run.name itself" in refusal([*base, "--grid", "run.name=a,b"])
    assert "must be >= 1" in refusal([*base, *GRID, "--jobs", "0"])
    assert "invalid int value" in refusal([*base, *GRID, "--jobs", "two"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "no CUDA GPU is visible here" in refusal([*base, *GRID, "--gpus", "0"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "GPU 7 is not there; this machine shows 2 GPUs" in refusal([*base, *GRID, "--gpus", "7"])
    assert "do not split into runs of --ranks-per-run 2" in refusal([*base, *GRID, "--gpus", "0", "--ranks-per-run", 2])
    monkeypatch.undo()
    # another sweep in the same folder (--slurm records one and runs nothing), and a second sweep at once
    assert sweep.main(["--cfg", str(cfg), *GRID, "--out", str(tmp_path / "s1"), "--slurm"]) == 0
    msg = refusal(["--cfg", cfg, "--grid", "tokenizer_stage.lr=1e-3,1e-2", "--out", tmp_path / "s1", "--jobs", "2"])
    assert msg.startswith(f"{tmp_path / 's1'} holds another sweep: the grid differs (there: --grid tokenizer_stage.lr="
                          "1e-3,3e-3 --grid tokenizer.code_dim=4,8; now: --grid tokenizer_stage.lr=1e-3,1e-2)"), msg
    msg = refusal(["--cfg", cfg, *GRID, "--set", "run.seed=1", "--out", tmp_path / "s1"])
    assert "the --set list differs (there: no --set; now: --set run.seed=1)" in msg
    cfg2 = tmp_path / "base2.json"  # the base config edited after the sweep began
    shutil.copy(cfg, cfg2)
    assert sweep.main(["--cfg", str(cfg2), *GRID, "--out", str(tmp_path / "s2"), "--slurm"]) == 0
    cfg2.write_text(cfg2.read_text().replace(f'"max_steps": {STEPS}', '"max_steps": 8', 1))
    assert f"the content of {cfg2} (sha256) differs" in refusal(["--cfg", cfg2, *GRID, "--out", tmp_path / "s2"])
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(out / "sweep.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert f"is in use by pid {holder.pid}" in refusal([*base, *GRID, "--jobs", "2"])
    finally:
        holder.kill()
        holder.wait()
    assert not any(d.is_dir() and d.name != "logs" for d in out.iterdir())  # nothing ran


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path):
    for argv, line in ((["--grid", "a=1", "--grid", "a=2"], "error: --grid a is given twice; "),
                       (["--jobs", "x"], "error: argument --jobs: invalid int value: 'x'")):
        r = subprocess.run([sys.executable, "tools/sweep.py", *argv, "--out", str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == "", r
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(line), r.stderr


def test_names_are_readable_unique_and_short():
    assert sweep.run_name([("tokenizer_stage.lr", "1e-3"), ("world_stage.lr", "3e-4")]) == \
        "tokenizer_stage.lr-1e-3__world_stage.lr-3e-4"
    a, b = sweep.run_name([("data.root", "/d/a b")]), sweep.run_name([("data.root", "/d/a_b")])
    assert re.fullmatch(r"data\.root-_d_a_b~[0-9a-f]{6}", a) and a != b
    long, longer = sweep.run_name([("data.root", "x" * 300)]), sweep.run_name([("data.root", "x" * 301)])
    assert len(long.encode()) <= 200 and long != longer
    assert sweep.split_values("[8,8],[16,16],3") == ["[8,8]", "[16,16]", "3"]


def test_gpu_slots_split_the_gpus_into_groups(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = lambda *a: sweep.parse_args(["--out", "o", *a])  # noqa: E731
    assert sweep.slots(args())[0] == ["0", "1", "2", "3"]
    assert sweep.slots(args("--ranks-per-run", "2"))[0] == ["0,1", "2,3"]
    assert sweep.slots(args("--gpus", "1,3", "--per-gpu", "2"))[0] == ["1", "1", "3", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # ids index the GPUs torch sees
    assert sweep.slots(args("--gpus", "2,3", "--ranks-per-run", "2"))[0] == ["6,7"]
    assert sweep.slots(args("--jobs", "3"))[0] == ["", "", ""]


# ---------------------------------------------------------------------------------------------
# SLURM


@pytest.mark.slow
def test_slurm_writes_an_array_whose_task_trains_its_combination(swept, tmp_path, capsys):
    out = tmp_path / "slurm"
    assert sweep.main(["--cfg", str(swept.cfg), *GRID, "--out", str(out), "--slurm", "--jobs", "2"]) == 0
    script = out / "sweep.sbatch"
    text = script.read_text()
    assert "#SBATCH --array=0-3%2\n" in text and "--gpus-per-task" not in text  # train.device=cpu
    subprocess.run(["bash", "-n", script], check=True)
    assert not any((d / "config.json").exists() for d in out.iterdir())  # it ran nothing
    env = {"SLURM_ARRAY_TASK_ID": "2", "OMP_NUM_THREADS": "1"}
    p = start(["bash", script], out, env=env)
    assert p.finish(300) == 0, p.output
    assert [d.name for d in out.iterdir() if (d / "config.json").exists()] == [NAMES[2]]
    assert_same(model(out / NAMES[2]), model(swept.out / NAMES[2]), NAMES[2])
    assert sweep.main(["--task", "2", "--out", str(out)]) == 0  # what the task runs, again
    assert f"skip     [3/4] {NAMES[2]} (finished)" in capsys.readouterr().out
