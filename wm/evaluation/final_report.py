"""What a finished run prints and writes: the final table (reconstruction, the forecast beside
copy-last per future step, the moving classes' IoU) and summary.json, the same figures for scripts."""

from __future__ import annotations

import math
from typing import Any, Optional

from wm.config.sections import Config
from wm.evaluation.metrics import step_label


def final_table(cfg: Config, results: dict, moving=(), step_s: Optional[float] = None,
                before: Optional[dict] = None, times: Optional[dict] = None) -> str:
    """The table printed when training ends: reconstruction, the forecast and copy-last per future
    step (labelled in seconds where `step_s` is known), the `moving` classes' IoU per step; with
    `before` ({stage: metrics} of the stages init.from initialised) the source model's own figures
    on this data before the first step; with `times` ({stage or "run": {wall_s, gpu_hours}}) a line of
    the training time of each."""
    lines, before = [], before or {}
    if "tokenizer" in results:
        for word, r in (("", results["tokenizer"]), (" before fine-tuning", before.get("tokenizer"))):
            if r is not None:
                lines.append(f"tokenizer reconstruction (val){word}: IoU {r.get('val/iou', float('nan')):.2f}  "
                             f"mIoU {r.get('val/miou', float('nan')):.2f}  codes used {100 * r.get('val/code_usage', 0):.0f}%")
    if "world" in results:
        r = results["world"]
        S = cfg.data.future
        head = f"{'step':<10}" + "".join(f"{step_label(t + 1, step_s):>14}" for t in range(S)) + f"{'avg':>14}"
        lines.append(f"world-model forecast (val, {cfg.train.forecast_motion} ego motion), IoU / mIoU per future step:")
        lines.append(head)
        rows = [("forecast", "val/", r), ("copy-last", "val/copy_last_", r)]
        if before.get("world") is not None:
            rows.insert(1, ("before", "val/", before["world"]))
        for name, pre, m in rows:
            cells = "".join(f"{m.get(f'{pre}iou_t{t + 1}', float('nan')):>7.2f}/{m.get(f'{pre}miou_t{t + 1}', float('nan')):<6.2f}"
                            for t in range(S))
            lines.append(f"{name:<10}{cells}{m.get(pre + 'iou', float('nan')):>7.2f}/{m.get(pre + 'miou', float('nan')):<6.2f}")
        if before.get("world") is not None:
            lines.append("(before: the init.from source's world model on this data, before fine-tuning)")
        lines += moving_table(r, S, moving, head) if moving else [
            "(no moving classes: the data set declares none and has no nuScenes-named ones; set "
            "data.moving_classes, or moving_classes in classes.json at conversion)"]
    if times:
        lines.append("training time (its processes, gaps between them left out): " + ", ".join(
            f"{n} {t['wall_s'] / 60:.1f} min, {t['gpu_hours']:.4f} GPU-hours" for n, t in times.items()))
    return "\n".join(lines)


def moving_table(r: dict, S: int, moving, head: str) -> list[str]:
    """Rows of the moving classes' forecast IoU per future step, forecast / copy-last, under `head`
    (widened to the longest name; the classes the validation windows hold; '-' where a step has none)."""
    def cell(v):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"

    w = max([10] + [len(n) + 1 for n in moving])
    rows = []
    for n in moving:
        vals = [(r.get(f"val/class_iou/{n}_t{t + 1}"), r.get(f"val/copy_last_class_iou/{n}_t{t + 1}")) for t in range(S)]
        if all(a is None and b is None for a, b in vals):
            continue
        avg = (r.get(f"val/class_iou/{n}"), r.get(f"val/copy_last_class_iou/{n}"))
        rows.append(f"{n:<{w}}" + "".join(f"{cell(a) + ' / ' + cell(b):>14}" for a, b in vals + [avg]))
    if rows:
        rows[:0] = ["moving classes, IoU per future step, forecast / copy-last:", f"{'step':<{w}}{head[10:]}"]
    return rows


def make_summary(cfg: Config, results: dict, moving=(), step_s: Optional[float] = None) -> dict:
    """The figures of the final table, for scripts: summary.json in the run folder."""
    out: dict[str, Any] = {}
    if "tokenizer" in results:
        r = results["tokenizer"]
        out["tokenizer"] = {"recon_iou": r.get("val/iou"), "recon_miou": r.get("val/miou"),
                            "code_usage": r.get("val/code_usage"),
                            "recon_class_iou": {k[len("val/class_iou/"):]: v for k, v in r.items()
                                                if k.startswith("val/class_iou/")}}
    if "world" in results:
        r, S = results["world"], cfg.data.future
        out["world"] = {"forecast_motion": cfg.train.forecast_motion,
                        "steps": [f"t+{t + 1}" for t in range(S)],
                        "seconds": [round((t + 1) * step_s, 6) for t in range(S)] if step_s else None,
                        "iou": [r.get(f"val/iou_t{t + 1}") for t in range(S)],
                        "miou": [r.get(f"val/miou_t{t + 1}") for t in range(S)],
                        "copy_last_iou": [r.get(f"val/copy_last_iou_t{t + 1}") for t in range(S)],
                        "copy_last_miou": [r.get(f"val/copy_last_miou_t{t + 1}") for t in range(S)],
                        "iou_avg": r.get("val/iou"), "miou_avg": r.get("val/miou"),
                        "copy_last_iou_avg": r.get("val/copy_last_iou"),
                        "copy_last_miou_avg": r.get("val/copy_last_miou"),
                        "class_iou": {n: [r.get(f"val/class_iou/{n}_t{t + 1}") for t in range(S)]
                                      for n in moving},
                        "copy_last_class_iou": {n: [r.get(f"val/copy_last_class_iou/{n}_t{t + 1}")
                                                for t in range(S)] for n in moving}}
    return out
