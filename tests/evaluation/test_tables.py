"""Every table of forecast steps says both the step and its time where the frame rate is known:
training's final table, --eval-only's table, the export report's table; class names are never cut."""

from wm.config.sections import Config
from wm.evaluation import evaluate as E
from wm.evaluation.final_report import final_table, make_summary
from wm.evaluation.metrics import step_label
from wm.export.int8_report import format_report


def test_step_labels_give_the_step_and_its_seconds():
    assert step_label(1, 0.5) == "t+1 (0.5s)" and step_label(2, 0.5) == "t+2 (1s)"
    assert step_label(3, 0.1) == "t+3 (0.3s)"  # not 0.30000000000000004
    assert step_label(4, None) == "t+4"  # rate unknown: the step alone


def test_final_table_labels_steps_in_seconds_and_keeps_whole_class_names():
    cfg = Config()
    cfg.data.future = 2
    r = {"val/iou_t1": 50.0, "val/miou_t1": 20.0, "val/iou_t2": 40.0, "val/miou_t2": 10.0,
         "val/class_iou/construction_vehicle_t1": 31.25, "val/class_iou/construction_vehicle_t2": 2.0,
         "val/class_iou/construction_vehicle": 16.625}
    lines = final_table(cfg, {"world": r}, moving=("car", "construction_vehicle"), step_s=0.5).splitlines()
    head = next(ln for ln in lines if ln.startswith("step"))
    assert head.split() == ["step", "t+1", "(0.5s)", "t+2", "(1s)", "avg"]
    moving = lines[lines.index("moving classes, IoU per future step, forecast / copy-last:") + 1:]
    assert moving[0].split()[0] == "step" and "t+2 (1s)" in moving[0]
    assert moving[1].split()[:4] == ["construction_vehicle", "31.2", "/", "-"]
    # unknown rate: steps only; no moving classes: said, with where to declare them
    plain = final_table(cfg, {"world": r})
    assert "(0.5s)" not in plain and "moving classes, IoU" not in plain
    assert plain.splitlines()[-1].startswith("(no moving classes: the data set declares none") and \
        "data.moving_classes" in plain
    assert make_summary(cfg, {"world": r}, step_s=0.5)["world"]["seconds"] == [0.5, 1.0]


def test_eval_table_labels_horizons_with_their_steps():
    b = {"iou": [40.0, 30.0], "miou": [20.0, 10.0], "iou_avg": 35.0, "miou_avg": 15.0,
         "per_class_avg": {"free": 1.0, "car": 61.5}, "per_class": {"free": [1.0, 1.0], "car": [23.125, 100.0]}}
    rep = {"split": "val", "mask": "none", "mode": "occworld", "world_size": 1, "device": "cpu", "precision": "fp32",
           "class_names": ["car", "free"], "free_class": 1, "moving_classes": ["car"],
           "world": {"checkpoint": "w.pt", "step": 3, "tokenizer_checkpoint": "t.pt", "tokenizer_sha256": "ab" * 32,
                     "windows": 4, "past": 2, "future": 4, "forecast_motion": "given", "horizons": ["1s", "2s"],
                     "steps": [1, 3], "horizons_why": "--horizons", "forecast": b, "copy_last": b}}
    lines = E.format_table(rep).splitlines()
    head = next(ln for ln in lines if "avg" in ln and "1s" in ln)
    assert head.split() == ["1s", "(t+2)", "2s", "(t+4)", "avg"]
    i = lines.index("  moving classes, IoU per horizon, forecast / copy-last:")
    assert lines[i + 2].split() == ["car", "23.1", "/", "23.1", "100.0", "/", "100.0", "61.5", "/", "61.5"]


def test_export_report_labels_steps_in_seconds():
    row = {"iou": [50.0, 40.0], "miou": [20.0, 10.0], "iou_avg": 45.0, "miou_avg": 15.0, "agreement_vs_pytorch": 1.0,
           "drop_iou_avg": 0.0, "drop_miou_avg": 0.0}
    d = {"windows": 3, "split": "val", "engine": "onnxruntime", "future_steps": 2, "step_s": 0.5,
         "models": {"pytorch_fp32": row}}
    lines = format_report(d).splitlines()
    assert lines[1].split()[:4] == ["model", "IoU", "t+1", "t+2"] and "s1" not in lines[1]
    assert lines[2].split()[:3] == ["(seconds)", "0.5s", "1s"]
    del d["step_s"]  # a report written without the rate: the steps alone
    assert "(seconds)" not in format_report(d)
