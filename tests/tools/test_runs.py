"""tools/runs.py: the table of run folders (nested sweeps, the differing config keys, --sort, typed
--filter, --csv/--json/--markdown), every status (a held lock, a lock left by kill -9, end records,
damaged files as one row each), 200 folders, and the files real tiny trainings write (finished,
preempted, failed: wm/training/main.py's end record)."""

import csv
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import runs as R  # noqa: E402

from wm.utils import runlock  # noqa: E402

FP = "0123456789abcdef" * 4


def fake(d: Path, lr=0.004, batch=2, stages=("tokenizer", "world"), done=None, summary=True, iou=40.0,
         seconds=(0.5, 1.0, 1.5, 2.0), records=(), extra=None) -> Path:
    """A run folder as wm writes it, from its small files: config.json, each done stage's done.json
    and best.json, summary.json (world forecast per second), metrics.jsonl lines `records`."""
    cfg = {"run": {"name": d.name, "out_dir": str(d.parent), "seed": 0},
           "data": {"stride": 1, "grid": [16, 16, 4]},
           "train": {"stages": list(stages), "amp": "fp32"},
           "tokenizer_stage": {"lr": lr, "batch_size": batch, "best_metric": "val/miou", "best_mode": "max"},
           "world_stage": {"lr": 0.004, "best_metric": "val/miou", "best_mode": "max"},
           "meta": {"data_fingerprint": FP, "data_root": str(d / "nodata")}}
    for k, v in (extra or {}).items():
        sec, _, key = k.partition(".")
        cfg[sec][key] = v
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    for s in (stages if done is None else done):
        (d / s / "checkpoints").mkdir(parents=True)
        (d / s / "done.json").write_text(json.dumps({"step": 4, "metrics": {"val/miou": 3.0, "val/iou": 40.0},
                                                     "reason": "finished", "wall_s": 10.0, "gpu_hours": 0.5}))
        (d / s / "checkpoints" / "best.json").write_text(json.dumps({"metric": "val/miou", "value": iou / 10,
                                                                     "step": 4}))
    if summary and (done is None or set(done) == set(stages)):
        n = len(seconds)
        world = {"seconds": list(seconds), "iou": [iou + i for i in range(n)],
                 "miou": [iou / 10 + i for i in range(n)], "iou_avg": iou, "miou_avg": iou / 10}
        (d / "summary.json").write_text(json.dumps({"world": world, "gpu_hours": 1.0}))
    if records:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def cli(*args) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "tools/runs.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    return p.returncode, p.stdout, p.stderr


def out_of(capsys, *args) -> str:
    assert R.main([str(a) for a in args]) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# the table


@pytest.fixture
def sweep(tmp_path):
    """Four finished runs, two of them two folders down; one lacks tokenizer_stage.batch_size."""
    root = tmp_path / "runs"
    fake(root / "sweep1" / "a", lr=0.001, batch=2, iou=30.0)
    fake(root / "sweep1" / "b", lr=0.01, batch=4, iou=50.0)
    fake(root / "c", lr=0.001, batch=8, iou=40.0, seconds=(0.5, 1.0))  # reaches 1 s only
    d = fake(root / "sweep2" / "x" / "d", lr=0.0001, iou=20.0)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["tokenizer_stage"]["batch_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    (root / "c" / "tokenizer" / "config.json").write_text("{}")  # inside a run folder: not a run
    (root / "empty" / "deeper").mkdir(parents=True)
    return root


def test_the_table_lists_nested_runs_with_only_the_keys_that_differ(sweep, capsys):
    rows = R.collect(sweep)
    assert [r["name"] for r in rows] == ["c", "sweep1/a", "sweep1/b", "sweep2/x/d"]
    assert {r["status"] for r in rows} == {"finished"}
    assert R.differing(rows) == ["tokenizer_stage.batch_size", "tokenizer_stage.lr"]  # not run.name/out_dir
    cols, vals = R.table(rows)
    assert cols[:5] == ["name", "status", "data", "tokenizer_stage.batch_size", "tokenizer_stage.lr"]
    a = dict(zip(cols, vals[1]))
    assert a == {"name": "sweep1/a", "status": "finished", "data": FP[:12], "tokenizer_stage.batch_size": 2,
                 "tokenizer_stage.lr": 0.001, "steps.tokenizer": 4, "steps.world": 4, "gpu_hours": 1.0,
                 "best.tokenizer": 3.0, "best.world": 3.0, "iou": 30.0, "miou": 3.0,
                 "iou_1s": 31.0, "miou_1s": 4.0, "iou_2s": 33.0, "miou_2s": 6.0, "iou_3s": None, "miou_3s": None}
    c = dict(zip(cols, vals[0]))
    assert (c["iou_1s"], c["iou_2s"]) == (41.0, None)
    text = out_of(capsys, sweep).splitlines()
    assert len(text) == 5 and text[0].split() == cols
    assert text[2].split()[:5] == ["sweep1/a", "finished", FP[:12], "2", "0.001"] and text[2].split()[-2:] == ["-", "-"]
    assert text[4].split()[3] == "-"  # d has no batch_size
    assert len({ln.index("status") if i == 0 else ln.index("finished") for i, ln in enumerate(text)}) == 1  # aligned
    # with one run left nothing differs
    assert R.table([rows[0]])[0] == R.COLUMNS


def test_sort_and_typed_filters(sweep, capsys):
    def names(*args):
        return [r["name"] for r in json.loads(out_of(capsys, sweep, "--json", *args))]

    assert names("--sort", "tokenizer_stage.lr") == ["sweep2/x/d", "c", "sweep1/a", "sweep1/b"]  # stable on ties
    assert names("--sort", "-tokenizer_stage.lr") == ["sweep1/b", "c", "sweep1/a", "sweep2/x/d"]
    assert names("--sort=-iou") == ["sweep1/b", "c", "sweep1/a", "sweep2/x/d"]
    assert names("--sort", "iou_2s") == ["sweep2/x/d", "sweep1/a", "sweep1/b", "c"]  # missing last
    assert names("--sort", "iou_2s", "--desc") == ["sweep1/b", "sweep1/a", "sweep2/x/d", "c"]  # missing last still
    assert names("--sort", "-tokenizer_stage.batch_size") == ["c", "sweep1/b", "sweep1/a", "sweep2/x/d"]
    assert names("--filter", "tokenizer_stage.lr=1e-3") == ["c", "sweep1/a"]
    assert names("--filter", "tokenizer_stage.lr=0.001", "--filter", "tokenizer_stage.batch_size=8") == ["c"]
    assert names("--filter", "status=finished", "--filter", "train.stages=tokenizer,world") == \
        ["c", "sweep1/a", "sweep1/b", "sweep2/x/d"]
    assert names("--filter", 'train.stages=["tokenizer"]') == []
    assert names("--filter", "data.grid=16,16,4", "--filter", "iou=5e1") == ["sweep1/b"]
    assert names("--filter", "tokenizer_stage.batch_size=-") == ["sweep2/x/d"]


def test_csv_json_markdown(sweep, capsys):
    got = list(csv.DictReader(io.StringIO(out_of(capsys, sweep, "--csv"))))
    assert [r["name"] for r in got] == ["c", "sweep1/a", "sweep1/b", "sweep2/x/d"]
    assert got[1]["tokenizer_stage.lr"] == "0.001" and float(got[1]["iou_2s"]) == 33.0 and got[1]["iou_3s"] == ""
    cols, vals = R.table(R.collect(sweep))
    assert json.loads(out_of(capsys, sweep, "--json")) == [dict(zip(cols, v)) for v in vals]
    md = out_of(capsys, sweep, "--markdown").splitlines()
    assert len(md) == 6 and md[0].startswith("| name | status |") and set(md[1]) == {"|", "-"}
    assert md[3].startswith("| sweep1/a | finished | 0123456789ab | 2 | 0.001 |")


def test_usage_errors_are_one_line_and_exit_2(sweep, tmp_path):
    for args, says in [((tmp_path / "nope",), "no such folder"),
                       ((sweep, "--filter", "tokenizer_stage.lr"), "write KEY=VALUE"),
                       ((sweep, "--filter", "no_such.key=1"), "no such column or config key"),
                       ((sweep, "--sort", "bogus"), "--sort 'bogus'"),
                       ((sweep, "--json", "--csv"), "not allowed with")]:
        rc, out, err = cli(*args)
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and says in err, err


# ---------------------------------------------------------------------------------------------
# statuses


def rec(kind, step=1, **kv):
    return {"kind": kind, "step": step, "time": time.time(), **kv}


def test_every_status_from_small_files(tmp_path, capsys):
    root = tmp_path / "runs"
    fake(root / "fin", done=None)
    fake(root / "new", done=(), summary=False)
    fake(root / "kill", done=(), records=[rec("tokenizer/train", 3, **{"perf/device_hours": 0.25})])
    fake(root / "pre", done=("tokenizer",), records=[
        rec("tokenizer/train", 4), rec("world/train", 1, **{"perf/device_hours": 0.5}),
        rec("world/train", 2, **{"perf/device_hours": 0.75}),  # a first process, then a second one:
        rec("world/train", 3, **{"perf/device_hours": 0.125}),
        rec("world/val", 3, **{"val/iou": 33.0, "val/miou": 3.3, "val/iou_t1": 34.0, "val/miou_t1": 3.4,
                               "val/iou_t2": 32.0, "val/miou_t2": 3.2}), rec("run/end", 0, status="preempted")])
    (root / "pre" / "nodata").mkdir()  # its data set: 2 frames a second, so t+2 is 1 s
    (root / "pre" / "nodata" / "manifest.json").write_text(json.dumps({"frame_rate_hz": 2.0, "shards": []}))
    fake(root / "fail", done=(), records=[rec("tokenizer/train"), rec("run/end", 0, status="failed",
                                                                      error="tokenizer_stage.lr: too big; lower it")])
    fake(root / "ctrlc", done=(), records=[rec("run/end", 0, status="stopped", error="KeyboardInterrupt: ")])
    fake(root / "resumed", done=(), records=[rec("run/end", 0, status="preempted"), rec("tokenizer/train", 5)])
    fake(root / "nosum", summary=False, records=[rec("world/train", 4)])
    d = fake(root / "cut", done=(), records=[rec("tokenizer/train", 2)])
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"kind": "tokenizer/train", "st')
    rows = {r["name"]: r for r in R.collect(root)}
    st = {k: r["status"] for k, r in rows.items()}
    assert st == {
        "fin": "finished", "new": "not started", "kill": "stopped: no end record (killed?)", "pre": "preempted",
        "fail": "failed: tokenizer_stage.lr: too big; lower it", "ctrlc": "stopped: KeyboardInterrupt: ",
        "resumed": "stopped: no end record (killed?)",
        "nosum": "stopped: the stages finished but summary.json is missing; rerun the same command to write it",
        "cut": "stopped: no end record (killed?); metrics.jsonl's last line is cut short"}
    pre = rows["pre"]  # an unfinished run's figures come from its log
    assert (pre["steps.tokenizer"], pre["steps.world"], pre["iou"], pre["miou"]) == (4, 3, 33.0, 3.3)
    assert pre["gpu_hours"] == 0.5 + 0.75 + 0.125 and pre["best.world"] == 3.3
    assert (pre["iou_1s"], pre["miou_1s"], pre["iou_2s"]) == (32.0, 3.2, None)
    assert rows["kill"]["steps.tokenizer"] == 3 and rows["cut"]["steps.tokenizer"] == 2
    assert R.status(root / "fail") == st["fail"] and R.status(root / "nowhere") == "not started"
    got = json.loads(out_of(capsys, root, "--json", "--filter", "status=stopped"))
    assert sorted(r["name"] for r in got) == ["ctrlc", "cut", "kill", "nosum", "resumed"]
    text = out_of(capsys, root)  # a long status: cut in the table, whole below it
    assert "nosum: stopped: the stages finished but summary.json is missing" in text


def test_a_long_log_is_read_from_its_tail(tmp_path, monkeypatch):
    d = fake(tmp_path / "r", done=(), records=[rec("tokenizer/train", i, **{"perf/device_hours": i / 100})
                                               for i in range(1, 300)] + [rec("run/end", 0, status="preempted")])
    monkeypatch.setattr(R, "TAIL", 1000)  # a few records, the first of them cut: never read as one
    row = R.inspect(d)
    assert (row["status"], row["steps.tokenizer"], row["gpu_hours"]) == ("preempted", 299, 2.99)


def test_damaged_folders_are_one_row_each(tmp_path, capsys):
    root = tmp_path / "runs"
    for name in ("notjson", "alist", "done", "summary", "unreadable", "ok"):
        fake(root / name)
    (root / "notjson" / "config.json").write_text('{"run": {"name": ')
    (root / "alist" / "config.json").write_text("[1, 2]")
    (root / "done" / "world" / "done.json").write_text('{"step": 4, "met')
    (root / "summary" / "summary.json").write_text('{"world": {"iou"')
    (root / "unreadable" / "summary.json").unlink()
    (root / "unreadable" / "summary.json").mkdir()
    st = {r["name"]: r["status"] for r in R.collect(root)}
    assert st["notjson"].startswith("damaged: config.json is not JSON (")
    assert st["alist"] == "damaged: config.json holds list, not an object"
    assert st["done"].startswith("damaged: world/done.json is not JSON")
    assert st["summary"].startswith("damaged: summary.json is not JSON")
    assert st["unreadable"].startswith("damaged: cannot read summary.json (") and st["ok"] == "finished"
    rc, out, err = cli(root, "--csv")
    assert rc == 0 and err == "" and len(list(csv.reader(io.StringIO(out)))) == 7


HOLD = """import sys, time
sys.path.insert(0, {root!r})
from wm.utils import runlock
runlock.acquire(sys.argv[1], say=lambda *a: None)
print("held", flush=True)
time.sleep(60)
"""


def test_a_held_lock_is_running_and_one_left_by_kill_9_is_stale(tmp_path):
    d = fake(tmp_path / "runs" / "r", done=(), records=[rec("tokenizer/train", 2)])
    runlock.acquire(d, say=lambda *a: None)  # held by this process: tested without dropping it
    try:
        assert R.status(d) == "running" and R.status(d) == "running"
        assert runlock.acquire(d) and runlock._HELD[(d / "run.lock").resolve()][1] == 2  # still ours
        runlock.release(d)
    finally:
        runlock.release(d)
    assert R.status(d) == "stopped: no end record (killed?)"  # released: run.lock is empty
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT)), str(d)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline() == "held\n"
        assert R.status(d) == "running"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    assert R.status(d).startswith(f"stale lock: pid {p.pid} on host ")
    with open(d / "metrics.jsonl", "a") as f:  # an end record after the owner's start: that owner ended it
        f.write(json.dumps(rec("run/end", 0, status="preempted", time=time.time() + 1)) + "\n")
    assert R.status(d) == "preempted"


def test_200_runs(tmp_path, capsys):
    root = tmp_path / "runs"
    for i in range(200):
        fake(root / f"sweep{i % 4}" / f"r{i:03d}", lr=0.001 * (1 + i % 5), iou=float(i % 50),
             done=None if i % 3 else ("tokenizer",), records=[rec("world/train", i % 7 + 1)])
    rows = R.collect(root)
    assert len(rows) == 200 and sum(r["status"] == "finished" for r in rows) == 133
    text = out_of(capsys, root, "--sort=-iou").splitlines()
    assert len(text) == 201 and text[0].split()[3] == "tokenizer_stage.lr"


# ---------------------------------------------------------------------------------------------
# what wm really writes


@pytest.mark.usefixtures("restore_signals", "one_thread")
def test_real_runs_finished_preempted_failed(tiny, monkeypatch, capsys):
    import wm.training.main as T
    from wm.utils.errors import WMError
    from wm.training.loop import Preemption

    short = dict(train__stages="tokenizer,world", tokenizer_stage__max_steps=2, world_stage__max_steps=2)
    assert T.main(tiny.args(name="fin", **short)) == 0
    assert T.main(tiny.args(name="pre", tokenizer_stage__lr=0.001, **short), stop=Preemption(requested=True)) == 0

    def refuse(*a, **k):
        raise WMError("world stage refused in a test; fix the test")

    monkeypatch.setattr(T, "WorldStage", refuse)
    with pytest.raises(WMError):
        T.main(tiny.args(name="fail", **short))
    capsys.readouterr()
    rows = {r["name"]: r for r in R.collect(tiny.base / "runs")}
    assert {k: r["status"] for k, r in rows.items()} == {
        "fin": "finished", "pre": "preempted", "fail": "failed: world stage refused in a test; fix the test"}
    assert R.differing(list(rows.values())) == ["tokenizer_stage.lr"]
    fin, run = rows["fin"], tiny.run_dir(name="fin")
    summary = json.loads((run / "summary.json").read_text())
    best = json.loads((run / "world" / "checkpoints" / "best.json").read_text())
    fp = json.loads((run / "config.json").read_text())["meta"]["data_fingerprint"]
    assert (fin["steps.tokenizer"], fin["steps.world"], fin["data"]) == (2, 2, fp[:12])
    assert fin["gpu_hours"] == summary["gpu_hours"] and fin["best.world"] == best["value"]
    assert (fin["iou"], fin["iou_1s"], fin["iou_2s"]) == (summary["world"]["iou_avg"], summary["world"]["iou"][1], None)
    ends = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"run/end"' in ln]
    assert [(e["status"], "error" in e) for e in ends] == [("finished", False)]
    pre = rows["pre"]  # stopped after its first step, saved: the log's step and device hours
    assert pre["steps.tokenizer"] == 1 and pre["steps.world"] is None and pre["gpu_hours"] > 0
    fail = rows["fail"]  # the tokenizer finished before the world stage failed
    assert fail["steps.tokenizer"] == 2 and fail["best.tokenizer"] is not None and fail["iou"] is None
    for name in rows:
        assert (tiny.run_dir(name=name) / "run.lock").read_text() == ""  # released
