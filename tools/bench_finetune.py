"""Does fine-tuning work? A road-style run fine-tuned on the airside scenes against the same schedule
from scratch: validation mIoU against optimizer steps for both arms, per stage.

    python tools/bench_finetune.py --size demo --out runs/bench_finetune \
        --json benchmarks/finetune.json --png benchmarks/finetune.png        # ~16 min on 2 CPU cores
    python tools/bench_finetune.py --size demo --pretrained runs/demo      # reuse the demo's run
    python tools/bench_finetune.py --size occworld --steps-tok 2000 --steps-world 1500 --evals 8
    python tools/bench_finetune.py --out runs/bench_finetune --report-only --png f.png   # read, plot

1. Pretrain (unless --pretrained): the size's road-style preset (demo: configs/demo.json, occworld:
   configs/occworld_20min.json) into <out>/pretrain, its own schedule.
2. Two arms on the airside data (configs/airside_scratch.json, configs/airside_finetune.json with
   init.from=<the pretrained run>) into <out>/scratch and <out>/finetune. Each arm's config is
   layered: the size's preset gives the model sections (tokenizer, world), data.grid, compile,
   kernels, activation_checkpoint and loader (so the models are the pretrained run's), the airside
   preset everything else, then the bench's keys: run.name / out_dir, <stage>_stage.max_steps
   (--steps-tok / --steps-world), <stage>_stage.eval_every = steps // --evals (--evals-tok,
   --evals-world; default 6 and 2), synthetic.cache_dir (--cache-dir), --set (every run) and
   --arm-set (the arms). The layered config is written to
   <arm>/bench_config.json and trained with `train.py --cfg` in a subprocess, its output in
   <arm>/train.log. Running the tool again resumes or reuses the runs (train.py does).
3. Reads both arms' metrics.jsonl: the <stage>/val records (val/miou, val/iou; the world stage's
   val/copy_last_miou), the fine-tuned arm's <stage>/before record (its source model on the target
   data at step 0), the last step from <stage>/done.json.
4. Targets, computed and printed, never asserted: (a) the fine-tuned arm is ahead of scratch at
   every validation both arms have (same steps), per stage; (b) the fine-tuned arm reaches
   scratch's final mIoU (tokenizer: reconstruction, world: forecast) at S_ft <= 50 % of scratch's
   steps (S_ft: the first fine-tuned validation, its before point included, at or above it; an
   upper bound at the resolution of the validations).
5. A markdown table (printed last), a PNG (--png: the two stages' mIoU against steps, one line
   per arm, the before point, copy-last dashed) and a JSON (--json: the machine, the commands, wall
   time per run, the curves, the targets). A benchmark, not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wm.utils.errors import WMError  # noqa: E402  (after the path: the tool runs from any folder)

STAGES = ("tokenizer", "world")
ARMS = ("scratch", "finetune")
SIZES = {"demo": "configs/demo.json", "occworld": "configs/occworld_20min.json"}
ARM_PRESETS = {"scratch": "configs/airside_scratch.json", "finetune": "configs/airside_finetune.json"}
# what the size's preset decides in an arm: the models and how they run, so the fine-tuned arm
# loads the pretrained weights and both arms train the same networks
BASE_SECTIONS = ("tokenizer", "world", "compile", "kernels", "activation_checkpoint", "loader")
BASE_DATA_KEYS = ("grid",)
# steps per stage of each arm. demo: sized on 2 cores (Xeon, AMX: bf16; a tokenizer step ~0.37 s, a world
# step ~0.38 s, a tokenizer validation ~3.5 s, a world one ~33 s): measured, the pretraining (the demo)
# 494 s, scratch 189 s, fine-tune 262 s, 15.8 min in all; occworld: occworld_20min's schedule
DEFAULT_STEPS = {"demo": {"tokenizer": 120, "world": 120}, "occworld": {"tokenizer": 2000, "world": 1500}}
# validations per stage (the last at the stage's end): an even count puts one at 50 % of the steps,
# target (b)'s mark; the world model's cost ~10 tokenizer ones each, so it gets fewer
DEFAULT_EVALS = {"tokenizer": 6, "world": 2}
TARGET_FRACTION = 0.5
_UNSET = object()  # target (b): the fine-tuned arm reaches scratch's final by half its steps


# ---------------------------------------------------------------------------------------------
# configs


def read_json(path) -> dict:
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise WMError(f"{p} does not exist") from None
    except json.JSONDecodeError as e:
        raise WMError(f"{p} is not valid JSON: {e}") from None


def set_key(d: dict, key: str, value) -> None:
    """d['a']['b'] = value for key 'a.b', making the sections on the way."""
    *secs, last = key.split(".")
    for s in secs:
        d = d.setdefault(s, {})
    d[last] = value


def layer(base: dict, preset: dict) -> tuple[dict, list[str]]:
    """An arm's config from the size's preset `base` and the airside `preset`: BASE_SECTIONS and
    data.grid come from the base (whole; a section the base leaves out is left out: the defaults,
    as the pretrained run had), every other key from the preset. Returns (config, the preset's keys
    there whose value the base replaced, for a note)."""
    out = json.loads(json.dumps({k: v for k, v in preset.items() if k not in BASE_SECTIONS and k != "meta"}))
    for sec in BASE_SECTIONS:
        if sec in base:
            out[sec] = json.loads(json.dumps(base[sec]))
    data = out.setdefault("data", {})
    for k in BASE_DATA_KEYS:
        data.pop(k, None)
        if k in base.get("data", {}):
            data[k] = base["data"][k]
    given = [(sec, k, v) for sec in BASE_SECTIONS for k, v in (preset.get(sec) or {}).items()]
    given += [("data", k, preset["data"][k]) for k in BASE_DATA_KEYS if k in preset.get("data", {})]
    dropped = [f"{sec}.{k}" for sec, k, v in given if out.get(sec, {}).get(k, _UNSET) != v]
    return out, dropped


def apply_sets(d: dict, items) -> dict:
    """The `--set a.b=value` items into config dict `d`, each value typed as train.py types it
    (wm.config.sections: a list key takes 'a,b', a bool 'on'...); an unknown key is refused there."""
    if not items:
        return d
    from wm.config import sections as C
    from wm.config import loading as CL

    cfg = CL.from_dict(C.Config, {k: v for k, v in d.items() if k != C.META_KEY})
    for item in items:
        CL.apply_override(cfg, item)
        key = item.split("=", 1)[0].strip()
        v = cfg
        for part in key.split("."):
            v = getattr(v, part) if hasattr(v, part) else getattr(v, part + "_")  # init.from: field from_
        set_key(d, key, json.loads(json.dumps(v)))
    return d


def eval_every(steps: int, evals: int) -> int:
    """Optimizer steps between validations for `evals` validations in `steps` (the last at the end)."""
    return -1 if evals <= 1 else max(1, steps // evals)


def arm_config(arm: str, base: dict, preset: dict, out: Path, steps: dict, evals: dict,
               pretrained: Optional[str], cache_dir: Optional[str], sets=()) -> tuple[dict, list[str]]:
    cfg, dropped = layer(base, preset)
    own = {"run.name": arm, "run.out_dir": str(out)}
    for st in STAGES:
        own[f"{st}_stage.max_steps"] = steps[st]
        own[f"{st}_stage.eval_every"] = eval_every(steps[st], evals[st])
    if arm == "finetune":
        own["init.from"] = pretrained
    if cache_dir:
        own["synthetic.cache_dir"] = cache_dir
    for k, v in own.items():
        set_key(cfg, k, v)
    return apply_sets(cfg, sets), dropped


def pretrain_config(base: dict, out: Path, cache_dir: Optional[str], sets=()) -> dict:
    cfg = json.loads(json.dumps({k: v for k, v in base.items() if k != "meta"}))
    set_key(cfg, "run.name", "pretrain")
    set_key(cfg, "run.out_dir", str(out))
    if cache_dir:
        set_key(cfg, "synthetic.cache_dir", cache_dir)
    return apply_sets(cfg, sets)


def preset_path(p: str) -> Path:
    """A preset as given, else under the checkout (configs/... from any folder)."""
    q = Path(p)
    return q if q.is_file() or q.is_absolute() else ROOT / q


# ---------------------------------------------------------------------------------------------
# running


PROGRESS = re.compile(r"^(tokenizer|world)[ :]|^resuming|^generating|^run .* finished|error|warning|init",
                      re.IGNORECASE)


def stages_done(run: Path) -> bool:
    return all((run / st / "done.json").is_file() for st in STAGES)


def train(name: str, run: Path, cfg: dict, fresh: bool = False) -> dict:
    """Write `cfg` to <run>/bench_config.json and train it with train.py (a subprocess, its output
    into <run>/train.log, the progress lines echoed). A run whose stages were finished already is
    reused (train.py finds them done): its wall time is the one recorded when it trained."""
    if fresh and run.exists():
        aside = run.with_name(f"{run.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(run, aside)
        print(f"[{name}] --fresh: moved {run} to {aside}", flush=True)
    run.mkdir(parents=True, exist_ok=True)
    cfg_path, log_path, rec_path = run / "bench_config.json", run / "train.log", run / "bench_run.json"
    cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")
    cmd = [sys.executable, str(ROOT / "train.py"), "--cfg", str(cfg_path)]
    was_done, started = stages_done(run), (run / "config.json").is_file()
    prev = json.loads(rec_path.read_text()) if rec_path.is_file() else {}
    print(f"[{name}] {' '.join(cmd)}  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})  # its lines as they come
        tail: list[tuple[str, bool]] = []  # the last lines, and whether each was echoed
        for line in p.stdout:
            log.write(line)
            echo = bool(PROGRESS.search(line))
            tail = (tail + [(line.rstrip(), echo)])[-40:]
            if echo:
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = p.wait()
    wall = round(time.perf_counter() - t0, 1)
    if rc:  # the failure's context: the last lines not echoed already
        for t in (t for t, echoed in tail if not echoed):
            print(f"[{name}] | {t}", flush=True)
        raise WMError(f"{name}: train.py exited {rc} (its last lines above); the log is {log_path}")
    reused = was_done and bool(prev.get("wall_s"))
    rec = {"command": cmd, "config": str(cfg_path), "log": str(log_path), "rc": rc,
           "wall_s": prev["wall_s"] if reused else wall, "this_call_s": wall, "reused": was_done,
           "resumed": started and not was_done}  # resumed: wall_s is only this call's part of it
    if not reused:
        rec_path.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


# ---------------------------------------------------------------------------------------------
# reading the runs


def read_curves(run: Path) -> dict:
    """{stage: {"val": [{"step", "miou", "iou"(, "copy_last_miou", "copy_last_iou")}, ...] by step,
    "before": the same for the <stage>/before record (else <stage>/before.json) or None, "steps":
    done.json's step or None}} from <run>/metrics.jsonl; a step validated twice (a resumed run)
    keeps its last record."""
    recs: dict[str, dict[int, dict]] = {st: {} for st in STAGES}
    before: dict[str, Optional[dict]] = {st: None for st in STAGES}
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        stage, _, what = str(r.get("kind", "")).partition("/")
        if stage not in recs or what not in ("val", "before") or not isinstance(r.get("step"), int):
            continue
        row = {"step": r["step"], "miou": r.get("val/miou"), "iou": r.get("val/iou")}
        if "val/copy_last_miou" in r:
            row.update(copy_last_miou=r.get("val/copy_last_miou"), copy_last_iou=r.get("val/copy_last_iou"))
        if what == "before":
            before[stage] = row
        else:
            recs[stage][r["step"]] = row
    out = {}
    for st in STAGES:
        done = run / st / "done.json"
        steps = None
        if done.is_file():
            try:
                steps = json.loads(done.read_text()).get("step")
            except json.JSONDecodeError:
                pass
        b = run / st / "before.json"  # the same figures as the before record, should metrics.jsonl lack it
        if before[st] is None and b.is_file():
            try:
                m = json.loads(b.read_text()).get("metrics") or {}
                before[st] = {"step": 0, "miou": m.get("val/miou"), "iou": m.get("val/iou")}
                if "val/copy_last_miou" in m:
                    before[st].update(copy_last_miou=m["val/copy_last_miou"], copy_last_iou=m.get("val/copy_last_iou"))
            except (json.JSONDecodeError, AttributeError):
                pass
        out[st] = {"val": [recs[st][k] for k in sorted(recs[st])], "before": before[st], "steps": steps}
    return out


def ahead(scratch: list[dict], ft: list[dict]) -> dict:
    """Target (a): at each validation step both arms have, the fine-tuned arm's mIoU minus
    scratch's; met when every one is > 0 (and there is one)."""
    s = {r["step"]: r["miou"] for r in scratch if r["miou"] is not None}
    f = {r["step"]: r["miou"] for r in ft if r["miou"] is not None}
    common = sorted(set(s) & set(f))
    margins = [round(f[k] - s[k], 4) for k in common]
    return {"steps": common, "margins": margins, "ahead": sum(m > 0 for m in margins), "of": len(common),
            "min_margin": min(margins) if margins else None,
            "met": bool(margins) and all(m > 0 for m in margins)}


def steps_to_reach(scratch: list[dict], scratch_steps: Optional[int], ft: list[dict],
                   before: Optional[dict], fraction: float = TARGET_FRACTION) -> dict:
    """Target (b): scratch's final mIoU (its last validation), the first fine-tuned validation
    (the before point at step 0 included) at or above it, S_ft / scratch's steps."""
    sv = [r for r in scratch if r["miou"] is not None]
    if not sv:
        return {"scratch_final": None, "scratch_steps": scratch_steps, "s_ft": None, "ft_miou": None,
                "fraction": None, "met": False, "why": "scratch has no validation"}
    final = sv[-1]
    total = scratch_steps or final["step"]
    pts = ([before] if before and before.get("miou") is not None else []) + [r for r in ft if r["miou"] is not None]
    hit = next((r for r in sorted(pts, key=lambda r: r["step"]) if r["miou"] >= final["miou"]), None)
    frac = hit["step"] / total if hit is not None and total else None
    best = max(pts, key=lambda r: r["miou"], default=None)
    return {"scratch_final": final["miou"], "scratch_final_step": final["step"], "scratch_steps": total,
            "ft_best": best["miou"] if best else None, "ft_best_step": best["step"] if best else None,
            "s_ft": hit["step"] if hit else None, "ft_miou": hit["miou"] if hit else None,
            "fraction": round(frac, 4) if frac is not None else None, "limit": fraction,
            "met": frac is not None and frac <= fraction,
            "why": None if hit else "the fine-tuned arm never reached it"}


def targets(curves: dict) -> dict:
    out = {}
    sc, ft = curves.get("scratch"), curves.get("finetune")
    if not sc or not ft:
        return out
    for st in STAGES:
        out[st] = {"ahead_every_validation": ahead(sc[st]["val"], ft[st]["val"]),
                   "steps_to_scratch_final": steps_to_reach(sc[st]["val"], sc[st]["steps"], ft[st]["val"],
                                                            ft[st]["before"])}
    return out


def copy_last(curves: dict) -> Optional[float]:
    """The world stage's copy-last mIoU (of the data, not of a model: the last record of any arm)."""
    for arm in ARMS:
        rows = [r for r in curves.get(arm, {}).get("world", {}).get("val", []) if r.get("copy_last_miou") is not None]
        if rows:
            return rows[-1]["copy_last_miou"]
    return None


# ---------------------------------------------------------------------------------------------
# reporting


def f2(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def target_lines(tg: dict) -> list[str]:
    what = {"tokenizer": "reconstruction", "world": "forecast"}
    lines = []
    for st, t in tg.items():
        a, b = t["ahead_every_validation"], t["steps_to_scratch_final"]
        lines.append(f"target (a) {st}: fine-tune ahead of scratch at every validation: "
                     f"{'met' if a['met'] else 'missed'} ({a['ahead']}/{a['of']} validations ahead, "
                     f"smallest margin {f2(a['min_margin'])} mIoU)")
        if b["s_ft"] is None:
            fig = b["why"] + (f"; its best {f2(b['ft_best'])} at step {b['ft_best_step']}"
                              if b.get("ft_best") is not None else "")
        else:
            fig = (f"S_ft {b['s_ft']} / {b['scratch_steps']} steps = {100 * b['fraction']:.0f} % "
                   f"(fine-tune {f2(b['ft_miou'])} at step {b['s_ft']})")
        lines.append(f"target (b) {st}: fine-tune reaches scratch's final {what[st]} mIoU "
                     f"{f2(b['scratch_final'])} within {100 * TARGET_FRACTION:.0f} % of its steps: "
                     f"{'met' if b['met'] else 'missed'} ({fig})")
    return lines


def table(curves: dict) -> str:
    """One markdown table: per stage and validation step, both arms' mIoU / IoU, the difference,
    and copy-last (world)."""
    cl = copy_last(curves)
    head = ("| stage | step | scratch mIoU | fine-tune mIoU | fine-tune - scratch | scratch IoU | fine-tune IoU "
            "| copy-last mIoU |")
    lines = [head, "|" + "---|" * 8]
    for st in STAGES:
        rows: dict[int, dict] = {}
        for arm in ARMS:
            for r in curves.get(arm, {}).get(st, {}).get("val", []):
                rows.setdefault(r["step"], {})[arm] = r
        b = curves.get("finetune", {}).get(st, {}).get("before")
        keys = ([("before", b["step"])] if b else []) + [("", k) for k in sorted(rows)]
        for tag, k in keys:
            s, f = (None, b) if tag else (rows[k].get("scratch"), rows[k].get("finetune"))
            sm, fm = (s or {}).get("miou"), (f or {}).get("miou")
            d = fm - sm if sm is not None and fm is not None else None
            lines.append(f"| {st} | {k}{' (before)' if tag else ''} | {f2(sm)} | {f2(fm)} | "
                         f"{'-' if d is None else f'{d:+.2f}'} | {f2((s or {}).get('iou'))} | "
                         f"{f2((f or {}).get('iou'))} | {f2(cl) if st == 'world' else '-'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the plot: numpy into an RGB array, wm.data.viz for the text and the PNG

COLOURS = {"scratch": (31, 119, 180), "finetune": (230, 85, 13)}
AXIS, GRID, COPY_LAST = (0, 0, 0), (225, 225, 225), (110, 110, 110)
LABELS = {"scratch": "scratch", "finetune": "fine-tune"}


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k apart) covering [lo, hi]."""
    if not hi > lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    return [round(first + i * step, 10) for i in range(int(math.ceil((hi - first) / step)) + 1)]


def line(img: np.ndarray, x0, y0, x1, y1, colour, width: int = 2, dash: int = 0) -> None:
    """A segment, `width` px thick, dashed (`dash` px on, `dash` off) where dash > 0; clipped."""
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    t = np.linspace(0, 1, n)
    xs, ys = np.round(x0 + (x1 - x0) * t).astype(int), np.round(y0 + (y1 - y0) * t).astype(int)
    if dash:
        keep = (np.arange(n) // dash) % 2 == 0
        xs, ys = xs[keep], ys[keep]
    h, w = img.shape[:2]
    for dy in range(-(width // 2), width - width // 2):
        for dx in range(-(width // 2), width - width // 2):
            xx, yy = xs + dx, ys + dy
            ok = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
            img[yy[ok], xx[ok]] = colour


def marker(img: np.ndarray, x, y, colour, r: int = 5) -> None:
    """A filled square with a black border."""
    h, w = img.shape[:2]
    x, y = int(round(x)), int(round(y))
    img[max(0, y - r - 1):min(h, y + r + 2), max(0, x - r - 1):min(w, x + r + 2)] = AXIS
    img[max(0, y - r):min(h, y + r + 1), max(0, x - r):min(w, x + r + 1)] = colour


def panel(title: str, series: dict, before: Optional[tuple], hline: Optional[float], width: int, height: int,
          ylabel: str = "miou %", xlabel: str = "optimizer step") -> np.ndarray:
    """One chart: `series` {arm: [(step, value)]} as lines, `before` (step, value) a marker,
    `hline` a dashed horizontal line (copy-last), axes with tick labels, a title."""
    from wm.data.viz import GLYPH_H, draw_text, text_width

    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 70, 16, 34, 46
    pw, ph = width - left - right, height - top - bottom
    pts = [p for s in series.values() for p in s] + ([before] if before else [])
    xs = [p[0] for p in pts] or [0]
    ys = [p[1] for p in pts] + ([hline] if hline is not None else []) or [0.0]
    xt = nice_ticks(0, max(max(xs), 1), 6)
    yt = nice_ticks(max(0.0, min(ys) - 1), min(100.0, max(ys) + 1))  # mIoU lies in [0, 100]
    x_lo, x_hi, y_lo, y_hi = xt[0], xt[-1], yt[0], yt[-1]

    def px(x):
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def py(y):
        return top + ph - (y - y_lo) / (y_hi - y_lo) * ph

    for v in yt:
        line(img, left, py(v), left + pw, py(v), GRID, 1)
        s = f"{v:g}"
        draw_text(img, s, left - 6 - text_width(s, 1), int(py(v)) - GLYPH_H // 2, AXIS, 1)
    for v in xt:
        line(img, px(v), top + ph, px(v), top + ph + 4, AXIS, 1)
        s = f"{v:g}"
        draw_text(img, s, int(px(v)) - text_width(s, 1) // 2, top + ph + 8, AXIS, 1)
    line(img, left, top, left, top + ph, AXIS, 1)
    line(img, left, top + ph, left + pw, top + ph, AXIS, 1)
    draw_text(img, title, left, 8, AXIS, 2)
    draw_text(img, xlabel, left + (pw - text_width(xlabel, 1)) // 2, height - 14, AXIS, 1)
    draw_text(img, ylabel, 4, top - 14, AXIS, 1)
    if hline is not None:
        line(img, left, py(hline), left + pw, py(hline), COPY_LAST, 2, dash=8)
    for arm, s in series.items():
        s = sorted(s)
        if arm == "finetune" and before:
            s = [before] + s
        for (a, b), (c, d) in zip(s, s[1:]):
            line(img, px(a), py(b), px(c), py(d), COLOURS[arm], 3)
        for a, b in s:  # each validation a dot
            x, y = int(round(px(a))), int(round(py(b)))
            img[max(0, y - 3):y + 4, max(0, x - 3):x + 4] = COLOURS[arm]
    if before:
        marker(img, px(before[0]), py(before[1]), COLOURS["finetune"])
    return img


def legend_strip(width: int, with_copy_last: bool) -> np.ndarray:
    from wm.data.viz import draw_text, text_width

    img = np.full((30, width, 3), 255, np.uint8)
    x = 16
    items = [(LABELS[a], "line", COLOURS[a]) for a in ARMS]
    items.append(("fine-tune before (step 0)", "marker", COLOURS["finetune"]))
    if with_copy_last:
        items.append(("copy-last (world)", "dash", COPY_LAST))
    for label, kind, c in items:
        if kind == "line":
            line(img, x, 15, x + 28, 15, c, 3)
        elif kind == "dash":
            line(img, x, 15, x + 28, 15, c, 2, dash=8)
        else:
            marker(img, x + 14, 15, c)
        draw_text(img, label, x + 36, 11, AXIS, 1)
        x += 36 + text_width(label, 1) + 24
    return img


def plot(curves: dict, width: int = 560, height: int = 360) -> np.ndarray:
    """Two panels side by side (tokenizer reconstruction mIoU, world forecast mIoU against optimizer
    steps) over a legend: (height + 30, 2 * width, 3) uint8."""
    titles = {"tokenizer": "tokenizer reconstruction", "world": "world forecast"}
    panels = []
    for st in STAGES:
        series = {arm: [(r["step"], r["miou"]) for r in curves[arm][st]["val"] if r["miou"] is not None]
                  for arm in ARMS if arm in curves}
        b = curves.get("finetune", {}).get(st, {}).get("before")
        before = (b["step"], b["miou"]) if b and b.get("miou") is not None else None
        panels.append(panel(titles[st], series, before, copy_last(curves) if st == "world" else None, width, height))
    cl = copy_last(curves) is not None
    return np.concatenate([np.concatenate(panels, axis=1), legend_strip(2 * width, cl)], axis=0)


# ---------------------------------------------------------------------------------------------
# the machine and the command line


def machine() -> dict:
    import torch

    cpu, flags = None, set()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k.strip() == "model name" and cpu is None:
                cpu = v.strip()
            elif k.strip() == "flags" and not flags:
                flags = set(v.split())
    except OSError:
        pass
    if cpu is None:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            cpu = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), None)
        except (OSError, subprocess.SubprocessError):
            pass
    out = {"cpu": cpu or platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "cpu_cores_usable": len(os.sched_getaffinity(0)), "amx": "amx_tile" in flags,
           "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_count"] = torch.cuda.device_count()
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="demo", help="the model sizes and pretraining preset")
    ap.add_argument("--out", default="runs/bench_finetune", help="folder of the runs (pretrain, scratch, finetune)")
    ap.add_argument("--pretrained", help="an existing road-style run folder (or checkpoint) to fine-tune; "
                    "no pretraining")
    ap.add_argument("--arms", default="scratch,finetune",
                    help="which arms to train (the report reads both); pretrain: the pretraining alone")
    ap.add_argument("--steps-tok", type=int, help="tokenizer optimizer steps of each arm (default: per --size)")
    ap.add_argument("--steps-world", type=int, help="world-model optimizer steps of each arm (default: per --size)")
    ap.add_argument("--evals", type=int, help="validations per stage of each arm, the last at its end (default: "
                    f"tokenizer {DEFAULT_EVALS['tokenizer']}, world {DEFAULT_EVALS['world']}; even: one at 50 %%)")
    ap.add_argument("--evals-tok", type=int, help="the tokenizer's validations (over --evals)")
    ap.add_argument("--evals-world", type=int, help="the world model's validations (over --evals)")
    ap.add_argument("--cache-dir", help="synthetic.cache_dir of every run (where the generated scenes are kept)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key of every run")
    ap.add_argument("--arm-set", action="append", default=[], metavar="KEY=VALUE", help="a config key of the arms")
    ap.add_argument("--base-cfg", help="the size's preset (default: configs/demo.json / configs/occworld_20min.json)")
    ap.add_argument("--scratch-cfg", default=ARM_PRESETS["scratch"], help="the scratch arm's preset")
    ap.add_argument("--finetune-cfg", default=ARM_PRESETS["finetune"], help="the fine-tuned arm's preset")
    ap.add_argument("--fresh", action="store_true", help="move the runs this call trains aside first (start over)")
    ap.add_argument("--report-only", action="store_true", help="train nothing: read <out>'s arms and report")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--png", help="write the plot here")
    a = ap.parse_args(argv)
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in a.arms if x not in (*ARMS, "pretrain")]
    if bad:
        ap.error(f"--arms: {bad[0]!r} is not one of {','.join(ARMS)},pretrain")
    if "pretrain" in a.arms and a.pretrained:
        ap.error("--arms pretrain trains the source that --pretrained gives: leave one out")
    a.evals = {st: next(v for v in (own, a.evals, DEFAULT_EVALS[st]) if v is not None)
               for st, own in (("tokenizer", a.evals_tok), ("world", a.evals_world))}
    if min(a.evals.values()) < 1:
        ap.error("--evals must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    steps = {"tokenizer": a.steps_tok or DEFAULT_STEPS[a.size]["tokenizer"],
             "world": a.steps_world or DEFAULT_STEPS[a.size]["world"]}
    base_path = preset_path(a.base_cfg or SIZES[a.size])
    runs: dict[str, dict] = {}
    t0 = time.perf_counter()
    if not a.report_only:
        base = read_json(base_path)
        pretrained = a.pretrained
        if pretrained is None and ("finetune" in a.arms or "pretrain" in a.arms):
            runs["pretrain"] = train("pretrain", out / "pretrain", pretrain_config(base, out, a.cache_dir, a.set),
                                     a.fresh)
            pretrained = str(out / "pretrain")
        for arm in (x for x in ARMS if x in a.arms):
            preset = read_json(preset_path(a.scratch_cfg if arm == "scratch" else a.finetune_cfg))
            cfg, dropped = arm_config(arm, base, preset, out, steps, a.evals, pretrained, a.cache_dir,
                                      [*a.set, *a.arm_set])
            if dropped:
                print(f"[{arm}] note: the {a.size} preset's sections replace the airside preset's "
                      f"{', '.join(dropped)}", flush=True)
            runs[arm] = train(arm, out / arm, cfg, a.fresh)
    for name in ("pretrain", *ARMS):  # the runs of earlier calls: their recorded wall times
        rec = out / name / "bench_run.json"
        if name not in runs and rec.is_file():
            runs[name] = {**json.loads(rec.read_text()), "reused": True, "this_call_s": 0.0}
    curves = {arm: read_curves(out / arm) for arm in ARMS if (out / arm / "metrics.jsonl").is_file()}
    missing = [arm for arm in ARMS if arm not in curves]
    if missing:
        print(f"note: no metrics.jsonl in {', '.join(str(out / m) for m in missing)}; the targets need both arms")
    tg = targets(curves)
    summaries = {arm: json.loads((out / arm / "summary.json").read_text())
                 for arm in curves if (out / arm / "summary.json").is_file()}
    if a.png and curves:
        from wm.data.viz import write_png

        write_png(a.png, plot(curves))
        print(f"wrote {a.png}")
    every = {st: eval_every(steps[st], a.evals[st]) for st in STAGES}
    ran = out / "scratch" / "bench_config.json"
    if a.report_only and ran.is_file():  # the steps and validations the arms ran with, not the defaults
        c = json.loads(ran.read_text())
        steps = {st: c.get(f"{st}_stage", {}).get("max_steps", steps[st]) for st in STAGES}
        every = {st: c.get(f"{st}_stage", {}).get("eval_every", every[st]) for st in STAGES}
        a.evals = {st: None for st in STAGES}
    if a.json:
        res = {"size": a.size, "out": str(out), "steps": steps, "evals": a.evals,
               "eval_every": every,
               "pretrained": a.pretrained or (str(out / "pretrain") if "pretrain" in runs else None),
               "machine": machine(), "argv": sys.argv[1:] if argv is None else list(argv),
               "runs": runs, "configs": {n: json.loads((out / n / "bench_config.json").read_text())
                                         for n in runs if (out / n / "bench_config.json").is_file()},
               "bench_wall_s": round(time.perf_counter() - t0, 1), "curves": curves,
               "copy_last_miou": copy_last(curves), "targets": tg,
               "final": {arm: {"tokenizer_recon_miou": s.get("tokenizer", {}).get("recon_miou"),
                               "world_miou_avg": s.get("world", {}).get("miou_avg"),
                               "world_copy_last_miou_avg": s.get("world", {}).get("copy_last_miou_avg"),
                               "minutes": s.get("minutes")} for arm, s in summaries.items()}}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.json}")
    for name, r in runs.items():
        print(f"{name}: {r['wall_s']:.0f} s{' (reused)' if r['reused'] else ''}")
    print("\n".join(target_lines(tg)))
    print()
    print(table(curves))
    return 0


if __name__ == "__main__":
    from wm.utils.errors import run_cli

    run_cli(main)
