"""One table of every wm run folder under a folder: what each run is, how far it got, its figures.

    python tools/runs.py runs                                  # aligned text, sorted by name
    python tools/runs.py runs --sort=-iou                      # best forecast first (missing values last)
    python tools/runs.py runs --sort tokenizer_stage.lr --desc
    python tools/runs.py runs --filter status=finished --filter tokenizer_stage.lr=1e-3
    python tools/runs.py runs --csv > runs.csv                 # or --json, --markdown

A run folder is a folder holding config.json (found at any depth: sweeps nest them; a run folder's
own subfolders are not searched). Only small files are read (config.json, done.json, best.json,
summary.json, run.lock, the last 256 KiB of metrics.jsonl), never a checkpoint.

Columns: name (the path under RUNS_DIR), status, data (the data set's fingerprint, 12 hex), the
config keys whose values differ between the listed runs (run.name and run.out_dir left out: the
name says where), steps.<stage> (done.json's step, else the last logged step), gpu_hours (summary.json,
else the stages' done.json plus the logged device hours of unfinished ones: approximate),
best.<stage> (the stage's <stage>_stage.best_metric: best.json, else done.json, else the best logged
validation), iou/miou (the forecast's average over future steps) and iou_1s ... miou_3s (at 1, 2, 3 s;
'-' where the run's steps do not reach that time). --sort and --filter take any column or config key;
a filter compares typed (1e-3 matches 0.001, true matches a bool, a,b matches a list), and on status
it also matches the status's first word or its text before ':'.

Status (`status(run_dir)`; its first word is stable, scripts may split on it):
    running                 its run.lock is held by a live process (a POSIX lock; tested, not taken)
    finished                every stage of its train.stages has its done.json, and summary.json exists
    preempted               its last process ended on SIGTERM/SIGINT after saving: rerun the same command
    failed: <error>         its last process ended on an error (the error's one line)
    stopped: <why>          ended without finishing: Ctrl-C/exit (its end record), or with no end record
                            (killed, or written by an older wm), or finished stages without summary.json
    stale lock: <who>       run.lock names a process whose lock is gone and that left no end record
                            after its start: killed (kill -9, OOM, a lost node); rerun to resume
    not started             no config.json yet, or config.json only: no step logged, no checkpoint
    damaged: <file> ...     a file the table needs is not what wm writes (not JSON, cut short, unreadable)
The end record is the {"kind": "run/end", "status", "error"} line wm/training/main.py appends to metrics.jsonl;
a status may end in "; metrics.jsonl's last line is cut short" (a kill mid-write: the next run drops it).
Exit status: 0, or 2 with one line `error: ...` (no such folder, a bad --filter, an unknown --sort key).
"""

from __future__ import annotations

import csv
import datetime
import fcntl
import functools
import io
import json
import os
import re
import socket
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wm.utils import runlock  # noqa: E402
from wm.utils.errors import ArgParser, WMError, first_line, run_cli  # noqa: E402

STAGES = ("tokenizer", "world")
TAIL = 1 << 18  # bytes of metrics.jsonl read from its end: ~400 records (4000 steps at logging.every=10)
HIDDEN = ("run.name", "run.out_dir")  # differ for every run; the name column says where
HORIZONS = (1, 2, 3)
COLUMNS = ["name", "status", "data", *(f"steps.{s}" for s in STAGES), "gpu_hours", *(f"best.{s}" for s in STAGES),
           "iou", "miou", *(f"{m}_{h}s" for h in HORIZONS for m in ("iou", "miou"))]


class Damaged(Exception):
    """A file of the run folder that is not what wm writes; str(e) names it."""


def read_json(path: Path, name: str):
    """The object in `path` (None where there is none), else Damaged naming the file as `name`."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Damaged(f"cannot read {name} ({first_line(e)})") from None
    try:
        d = json.loads(text)
    except ValueError as e:  # UnicodeDecodeError is one
        raise Damaged(f"{name} is not JSON ({first_line(e)}): cut short or overwritten") from None
    if not isinstance(d, dict):
        raise Damaged(f"{name} holds {type(d).__name__ if d is not None else 'null'}, not an object")
    return d


def find_runs(root: Path) -> list[Path]:
    """Every folder under `root` (itself included) holding config.json; not searched below one."""
    out = []
    for folder, dirs, files in os.walk(root):
        if "config.json" in files:
            out.append(Path(folder))
            dirs[:] = []
    return sorted(out)


def flat_config(cfg: dict) -> dict:
    """config.json as {"section.key": value}, meta left out."""
    return {f"{sec}.{k}": v for sec, kv in cfg.items() if sec != "meta" and isinstance(kv, dict) for k, v in kv.items()}


def lock_state(run_dir: Path) -> tuple[str, dict]:
    """("held" | "free" | "unknown", the owner run.lock names): the lock tested with F_GETLK, never taken."""
    path = run_dir.resolve() / runlock.LOCK
    if path in runlock._HELD:  # this process holds it: opening and closing the file would drop it
        return "held", {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return "free", {}
    except OSError:
        return "unknown", {}
    with f:
        owner = _parse(f.read()) or {}  # empty once its owner released it
        if not sys.platform.startswith("linux"):  # struct flock's layout below is Linux's
            return "unknown", owner
        try:  # Linux's struct flock: who holds a lock that a write lock would conflict with
            got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except OSError:  # a filesystem without locks: the owner record decides
            return "unknown", owner
        return ("free" if struct.unpack("hhqqi4x", got)[0] == fcntl.F_UNLCK else "held"), owner


HOURS = re.compile(rb'"perf/device_hours": ([-+.\deE]+)')


def number_in(raw: bytes, key: str):
    """The number logged under `key` in one metrics.jsonl line, else None (null: a NaN logged)."""
    m = re.search(rb'"' + re.escape(key.encode()) + rb'": ([-+.\deE]+)', raw)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


def read_tail(path: Path, stages) -> dict:
    """From the end of metrics.jsonl: the last train step and logged device hours per stage, the
    validation lines per stage (newest first, unparsed), the end record if no train/val record
    follows it, whether the last line is cut short, and whether there is any record at all."""
    out = {"steps": {}, "hours": {}, "vals": {s: [] for s in stages}, "end": None, "cut": False, "any": False}
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL))
            data = f.read()
    except FileNotFoundError:
        return out
    except OSError as e:
        raise Damaged(f"cannot read metrics.jsonl ({first_line(e)})") from None
    first = data.find(b"\n") + 1 if size > TAIL else 0  # past the part of a line the tail starts in
    last = data.rfind(b"\n") + 1
    out["cut"] = last < len(data)  # no newline at its end: a record being written, or cut by a kill
    data = b"\n" + data[first:last]  # records found by their start, b'\n{"kind": "<kind>", "step": ' (Logger's)
    later = -1  # where the last train/val record starts
    for s in stages:
        train, val = (b'\n{"kind": "%s/%s", "step": ' % (s.encode(), w) for w in (b"train", b"val"))
        if (i := data.rfind(train)) >= 0:
            out["steps"][s], later = int(number_in(data[i:i + 99], "step") or 0), max(later, i)
            # from its first train record on (stages run in order); each process counts from 0
            hs = [float(h) for h in HOURS.findall(data, data.find(train))]
            out["hours"][s] = sum(a for a, b in zip(hs, hs[1:]) if b < a) + (hs[-1] if hs else 0.0)
        j = data.find(val)
        while j >= 0:  # few: one per validation
            out["vals"][s].insert(0, data[j + 1:data.find(b"\n", j + 1)])
            later, j = max(later, j), data.find(val, j + 1)
    if (e := data.rfind(b'\n{"kind": "run/end"')) > later:
        try:
            out["end"] = json.loads(data[e + 1:data.find(b"\n", e + 1)])
        except ValueError:
            pass  # a damaged line: as if there were none
    out["any"] = later >= 0 or out["end"] is not None
    return out


def _when(owner: dict) -> float | None:
    try:  # the owner's start, as runlock writes it
        return datetime.datetime.fromisoformat(owner["start"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@functools.lru_cache(maxsize=None)
def frame_rate(root) -> float | None:
    """The data set's frame rate (its manifest.json), read once per data set; None where unknown."""
    try:
        hz = _num(json.loads(Path(root, "manifest.json").read_bytes())["frame_rate_hz"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return hz if hz and hz > 0 else None


def inspect(run_dir: Path) -> dict:
    """Everything the table says of one run folder: its status, config and figures."""
    row = {"status": None, "config": {}, "data": None, **{c: None for c in COLUMNS[3:]}}
    try:
        cfg = read_json(run_dir / "config.json", "config.json")
    except Damaged as e:
        row["status"] = f"damaged: {e}"
        return row
    if cfg is None:  # a folder a run is yet to write (status() of a sweep's next run), or just locked
        row["status"] = "running" if lock_state(run_dir)[0] == "held" else "not started"
        return row
    row["config"] = flat = flat_config(cfg)
    meta = cfg.get("meta") if isinstance(cfg.get("meta"), dict) else {}
    fp = meta.get("data_fingerprint")
    row["data"] = fp[:12] if isinstance(fp, str) else None
    stages = flat.get("train.stages")
    stages = [s for s in stages if s in STAGES] if isinstance(stages, list) else list(STAGES)
    held, owner = lock_state(run_dir)
    here, pid = owner.get("host") == socket.gethostname(), owner.get("pid")
    running = held == "held"
    if held == "unknown" and owner:  # no lock to test (a filesystem without locks): the owner record decides
        running = not here or (isinstance(pid, int) and runlock.pid_alive(pid))
    try:
        done = {s: d for s in stages if (d := read_json(run_dir / s / "done.json", f"{s}/done.json")) is not None}
        summary = read_json(run_dir / "summary.json", "summary.json")
        # best.json torn or being replaced: done.json or the log still has the figure
        bests = {s: _parse(_bytes(run_dir / s / "checkpoints" / "best.json")) for s in stages}
        finished = len(done) == len(stages) and summary is not None
        tail = read_tail(run_dir / "metrics.jsonl", stages) if not finished else None
        for s, d in done.items():
            if not isinstance(d.get("step"), int) or not isinstance(d.get("metrics"), dict):
                raise Damaged(f"{s}/done.json is not the stage's record (no step or metrics)")
    except Damaged as e:
        row["status"] = "running" if running else f"damaged: {e}"
        return row
    row["status"] = "running" if running else _status(run_dir, stages, done, summary, tail, owner)
    if running and held == "unknown" and not here:
        row["status"] = f"running (as run.lock says: pid {pid} on host {owner.get('host')}; not checked from here)"
    tail = tail or {"steps": {}, "hours": {}, "vals": {s: [] for s in stages}}
    hours = 0.0
    for s in stages:
        d, b, vals = done.get(s), bests[s], tail["vals"].get(s, [])
        if d:
            row[f"steps.{s}"], hours = d["step"], hours + (_num(d.get("gpu_hours")) or 0.0)
        else:  # the last logged step (a resume may not have logged yet: its checkpoint's)
            row[f"steps.{s}"] = tail["steps"][s] if s in tail["steps"] else _latest(run_dir, s)
            hours += tail["hours"].get(s, 0.0)
        metric = flat.get(f"{s}_stage.best_metric", "val/miou")
        if b is not None and _num(b.get("value")) is not None:
            row[f"best.{s}"] = b["value"]
        elif d is not None and _num(d["metrics"].get(metric)) is not None:
            row[f"best.{s}"] = d["metrics"][metric]
        else:
            got = [v for r in vals if (v := number_in(r, metric)) is not None]
            pick = min if flat.get(f"{s}_stage.best_mode") == "min" else max
            row[f"best.{s}"] = pick(got) if got else None
    row["gpu_hours"] = _num(summary.get("gpu_hours")) if summary else (hours or None)
    world = summary.get("world") if summary else None
    if isinstance(world, dict):  # the final figures
        row["iou"], row["miou"] = _num(world.get("iou_avg")), _num(world.get("miou_avg"))
        secs, at = world.get("seconds"), {m: world.get(m) for m in ("iou", "miou")}
    elif v := next((v for v in map(_parse, tail["vals"].get("world", ())) if v), None):  # a run on its way
        row["iou"], row["miou"] = _num(v.get("val/iou")), _num(v.get("val/miou"))
        n = max((int(k[9:]) for k in v if k.startswith("val/iou_t") and k[9:].isdigit()), default=0)
        rate, stride = frame_rate(meta.get("data_root")), flat.get("data.stride", 1)
        secs = [(t + 1) * stride / rate for t in range(n)] if rate and _num(stride) else None
        at = {m: [v.get(f"val/{m}_t{t + 1}") for t in range(n)] for m in ("iou", "miou")}
    else:
        secs, at = None, {}
    for h in HORIZONS if isinstance(secs, list) else ():  # a future step at exactly h seconds, else none
        i = next((i for i, s in enumerate(secs) if _num(s) is not None and abs(s - h) < 1e-6), None)
        for m, vals in at.items():
            row[f"{m}_{h}s"] = _num(vals[i]) if i is not None and isinstance(vals, list) and i < len(vals) else None
    return row


def _bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _parse(raw: bytes) -> dict | None:
    """A JSON object, else None (none, or cut short)."""
    try:
        v = json.loads(raw)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def _latest(run_dir: Path, stage: str):
    """The step of a stage's newest checkpoint (its `latest` file names it), else None."""
    try:
        name = (run_dir / stage / "checkpoints" / "latest").read_text().strip()
        return int(name.removeprefix("step_").removesuffix(".pt"))
    except (OSError, ValueError):
        return None


def _status(run_dir: Path, stages, done: dict, summary, tail: dict | None, owner: dict) -> str:
    """The status of a run folder whose lock is not held (see the module's docstring)."""
    if tail is None:
        return "finished"
    end = tail["end"]
    start = _when(owner)
    if owner and not (end is not None and start is not None and _num(end.get("time")) and end["time"] >= start):
        return (f"stale lock: pid {owner.get('pid', '?')} on host {owner.get('host', '?')} holds no lock and left no "
                "end record (killed?); rerun the same command to resume")
    note = "; metrics.jsonl's last line is cut short" if tail["cut"] else ""
    if end is not None:
        st, err = end.get("status"), end.get("error")
        if st == "preempted":
            return "preempted" + note
        if st in ("failed", "stopped"):
            return f"{st}: {err or 'no error recorded'}{note}"
    if len(done) == len(stages):
        return f"stopped: the stages finished but summary.json is missing; rerun the same command to write it{note}"
    started = done or tail["any"] or any(_latest(run_dir, s) is not None for s in stages)
    return f"stopped: no end record (killed?){note}" if started else "not started" + note


def status(run_dir: Path) -> str:
    """The status of one run folder (module docstring): running, finished, preempted, failed: ...,
    stopped: ..., stale lock: ..., not started, damaged: ... (the first word is stable)."""
    return inspect(Path(run_dir))["status"]


def collect(root: Path) -> list[dict]:
    """One row per run folder under `root`, sorted by name: the COLUMNS (name relative to root), the
    run's flat config under "config" (every key) and its absolute folder under "path"."""
    root = Path(root)
    if not root.is_dir():
        raise WMError(f"{root}: no such folder; pass the folder that holds the run folders (run.out_dir)")
    rows = []
    for d in find_runs(root):
        row = inspect(d)
        row["name"], row["path"] = d.relative_to(root).as_posix(), str(d.resolve())
        rows.append(row)
    return rows


def differing(rows: list[dict]) -> list[str]:
    """The config keys whose values are not the same in every readable run of `rows`, sorted."""
    cfgs = [r["config"] for r in rows if r["config"]]
    keys = sorted({k for c in cfgs for k in c} - set(HIDDEN))
    return [k for k in keys if len({repr(c.get(k, "\0missing")) for c in cfgs}) > 1]  # repr: 1, 1.0, True differ


def value(row: dict, key: str):
    return row[key] if key in COLUMNS else row["config"].get(key)


def check_key(rows: list[dict], key: str, flag: str) -> None:
    known = key in COLUMNS or any(key in r["config"] for r in rows) or not any(r["config"] for r in rows)
    if not known:
        raise WMError(f"{flag} {key!r}: no such column or config key; use one of {', '.join(COLUMNS)} "
                      "or a config key such as tokenizer_stage.lr")


def matches(v, want: str, key: str) -> bool:
    """Whether value `v` is what the filter text `want` names, compared as `v`'s type."""
    if key == "status" and isinstance(v, str):
        return want in (v, v.split()[0], v.split(":")[0])
    if v is None:
        return want.lower() in ("", "-", "none", "null")
    if isinstance(v, bool):
        return want.lower() in (("true", "1", "yes") if v else ("false", "0", "no"))
    if isinstance(v, (int, float)):
        try:
            return float(want) == float(v)
        except ValueError:
            return False
    if isinstance(v, (list, dict)):  # as JSON, or a list as its comma-separated items (data.grid=16,16,4)
        try:
            if json.loads(want) == v:
                return True
        except ValueError:
            pass
        return isinstance(v, list) and want == ",".join(str(x) for x in v)
    return want == str(v)


def order(rows: list[dict], key: str, desc: bool) -> list[dict]:
    """Sorted by `key`, missing values last whichever the direction."""
    def rank(v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return 0, float(v), ""
        return (1, 0.0, v) if isinstance(v, str) else (2, 0.0, json.dumps(v, sort_keys=True))

    have = [r for r in rows if value(r, key) is not None]
    return sorted(have, key=lambda r: rank(value(r, key)), reverse=desc) + [r for r in rows if value(r, key) is None]


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, values): COLUMNS with the differing config keys after `data`."""
    cols = COLUMNS[:3] + differing(rows) + COLUMNS[3:]
    return cols, [[value(r, c) for c in cols] for r in rows]


def cell(v, col: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}" if col == "gpu_hours" else f"{v:.2f}" if col in COLUMNS else f"{v:g}"
    if isinstance(v, (list, dict)):
        return ",".join(map(str, v)) if isinstance(v, list) else json.dumps(v)
    return str(v)


def render(cols: list[str], vals: list[list], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([dict(zip(cols, r)) for r in vals], indent=1)
    if fmt == "csv":
        csv.writer(buf := io.StringIO()).writerows([cols] + [
            ["" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else v for v in r] for r in vals])
        return buf.getvalue().rstrip("\n")
    text = [[cell(v, c) for v, c in zip(r, cols)] for r in vals]
    if fmt == "markdown":
        return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] +
                         ["| " + " | ".join(t.replace("|", "\\|") for t in r) + " |" for r in text])
    si, long = cols.index("status"), []
    for r in text:  # a long status (an error's line) below the table, the table stays readable
        if len(r[si]) > 40:
            long.append(f"{r[0]}: {r[si]}")
            r[si] = r[si][:37] + "..."
    width = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in [cols, *text]]
    return "\n".join(lines + ([""] + long if long else []))


def main(argv=None) -> int:
    ap = ArgParser(prog="tools/runs.py", description="One table of the wm run folders under a folder.")
    ap.add_argument("runs_dir", metavar="RUNS_DIR", help="the folder holding the run folders (sweeps nest them)")
    ap.add_argument("--sort", default="name", metavar="KEY", help="a column or config key; -KEY (--sort=-KEY) "
                    "sorts descending; missing values last")
    ap.add_argument("--desc", action="store_true", help="sort descending")
    ap.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                    help="keep runs whose KEY is VALUE, compared typed (repeatable: all must match)")
    fmt = ap.add_mutually_exclusive_group()
    for f in ("json", "csv", "markdown"):
        fmt.add_argument(f"--{f}", dest="fmt", action="store_const", const=f, help=f"print {f}")
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1):  # `--sort -iou`: the descending key is the option's value
        if argv[i] == "--sort" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"--sort={argv[i + 1]}"]
            break
    a = ap.parse_args(argv)
    rows = every = collect(Path(a.runs_dir))
    key, desc = (a.sort[1:], True) if a.sort.startswith("-") else (a.sort, a.desc)
    check_key(every, key, "--sort")
    for f in a.filter:
        k, eq, want = f.partition("=")
        if not eq or not k.strip():
            raise WMError(f"--filter {f!r}: write KEY=VALUE, e.g. --filter tokenizer_stage.lr=0.001")
        check_key(every, k.strip(), "--filter")
        rows = [r for r in rows if matches(value(r, k.strip()), want, k.strip())]
    if not every:
        print(f"note: no run folder (a folder holding config.json) under {a.runs_dir}", file=sys.stderr)
    print(render(*table(order(rows, key, desc)), a.fmt or "text"))
    return 0


if __name__ == "__main__":
    run_cli(main)
