"""wm/utils/logs.py: metrics.jsonl is strict JSON (NaN/inf -> null), TensorBoard scalars/images/hparams
read back with tensorboard's reader, a failing sink warns once and is switched off while the others
go on, a disabled (non-zero rank) logger writes nothing, the console line and eta()."""

import io
import json
import math
import warnings

import numpy as np
import pytest

from wm.utils.logs import Logger, _clean, eta


def strict(line: str) -> dict:
    def no_constants(c):
        raise ValueError(f"non-JSON constant {c}")

    return json.loads(line, parse_constant=no_constants)


def records(d) -> list[dict]:
    return [strict(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]


def our_warnings(rec, sink="tensorboard") -> list[str]:
    return [str(w.message) for w in rec if f"logging to {sink} failed" in str(w.message)]


def test_nan_and_inf_become_null_in_strict_json(tmp_path):
    log = Logger(tmp_path, tensorboard=False)
    log.scalars(3, {"loss/loss": float("nan"), "a": float("inf"), "b": -float("inf"), "c": 1.5,
                    "d": np.float32(2.5), "e": np.int64(7), "f": np.float64("nan")}, kind="k")
    log.record(4, "table", {"per_class": [1.0, float("nan"), np.float32(0.25)], "nested": {"x": math.inf}})
    log.close()
    r1, r2 = records(tmp_path)
    assert r1["kind"] == "k" and r1["step"] == 3 and isinstance(r1["time"], float)
    assert r1["loss/loss"] is None and r1["a"] is None and r1["b"] is None and r1["f"] is None
    assert r1["c"] == 1.5 and r1["d"] == 2.5 and r1["e"] == 7 and isinstance(r1["e"], int)
    assert r2 == {"kind": "table", "step": 4, "per_class": [1.0, None, 0.25], "nested": {"x": None}}


def test_clean_leaves_other_values_alone():
    assert _clean({"a": [1, "x", None, True], "b": (2.0,)}) == {"a": [1, "x", None, True], "b": [2.0]}


def test_metrics_jsonl_appends_across_loggers(tmp_path):
    for step in (1, 2):
        log = Logger(tmp_path, tensorboard=False)
        log.scalars(step, {"x": float(step)})
        log.close()
    assert [r["step"] for r in records(tmp_path)] == [1, 2]


def test_disabled_logger_writes_nothing(tmp_path):
    out = io.StringIO()
    log = Logger(tmp_path, enabled=False, tensorboard=True, stream=out)
    log.scalars(1, {"x": 1.0})
    log.record(1, "k", {"y": 2})
    log.image("img", 1, np.zeros((4, 4, 3), np.uint8))
    log.hparams_start({"lr": 1e-3}, ["m"], "r")
    log.hparams_end("success")
    log.console("hello")
    log.close()
    assert list(tmp_path.iterdir()) == [] and out.getvalue() == ""


def test_tensorboard_scalars_images_hparams_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = Logger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        log.scalars(step, {"loss/loss": 1.0 / step, "train/lr": 1e-3, "skip": float("nan")})
    rgb = np.zeros((6, 10, 3), np.uint8)
    rgb[:, :5, 0] = 255
    log.image("val/bev", 3, rgb)
    log.hparams_start({"lr": 1e-3, "widths": (8, 16), "name": "x", "flag": True}, ["val/iou"], "trial")
    log.hparams_end("success")
    log.close()
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    assert [e.value for e in ea.Scalars("loss/loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.step for e in ea.Scalars("loss/loss")] == [1, 2, 3]
    assert "skip" not in ea.Tags()["scalars"]  # non-finite values are left out of TensorBoard
    img = ea.Images("val/bev")[0]
    assert (img.width, img.height, img.step) == (10, 6, 3)
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    content = ea.PluginTagToContent("hparams")  # in the run's own event file: no sub-run
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in exp.metric_infos] == ["val/iou"]
    assert {h.name: h.type for h in exp.hparam_infos} == {
        "lr": api_pb2.DATA_TYPE_FLOAT64, "widths": api_pb2.DATA_TYPE_STRING, "name": api_pb2.DATA_TYPE_STRING,
        "flag": api_pb2.DATA_TYPE_BOOL}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.group_name == "trial" and start.hparams["flag"].bool_value is True
    assert start.hparams["widths"].string_value == "(8, 16)" and start.hparams["lr"].number_value == 1e-3
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == api_pb2.STATUS_SUCCESS
    assert [p.name for p in tmp_path.joinpath("tb").iterdir() if p.is_dir()] == []
    assert records(tmp_path)[0]["skip"] is None


def test_summary_writer_that_cannot_start_warns_once_and_jsonl_goes_on(tmp_path, monkeypatch):
    import torch.utils.tensorboard as tb

    def broken(*a, **k):
        raise ImportError("no tensorboard here")

    monkeypatch.setattr(tb, "SummaryWriter", broken)
    with pytest.warns(RuntimeWarning) as rec:
        log = Logger(tmp_path, tensorboard=True)
        for step in range(5):
            log.scalars(step, {"x": 1.0})
            log.image("i", step, np.zeros((2, 2, 3), np.uint8))
            log.hparams_start({"a": 1}, ["m"], "r")
            log.hparams_end("failure")
        log.close()
    assert len(our_warnings(rec)) == 1
    assert "no tensorboard here" in our_warnings(rec)[0] and "training goes on" in our_warnings(rec)[0]
    assert len(records(tmp_path)) == 5


def test_tb_folder_that_is_a_file_warns_once(tmp_path):
    (tmp_path / "tb").write_text("x")
    with pytest.warns(RuntimeWarning) as rec:
        log = Logger(tmp_path, tensorboard=True)
        for step in range(3):
            log.scalars(step, {"x": 1.0})
            log.image("i", step, np.zeros((2, 2, 3), np.uint8))
        log.close()
    assert len(our_warnings(rec)) == 1
    assert len(records(tmp_path)) == 3


def test_sink_failing_mid_run_warns_once_then_is_switched_off(tmp_path):
    class Flaky:
        def __init__(self):
            self.calls = 0

        def add_scalar(self, *a):
            self.calls += 1
            raise OSError(28, "No space left on device")

        add_image = add_scalar

        def flush(self):
            raise OSError(28, "No space left on device")

        close = flush

    log = Logger(tmp_path, tensorboard=False)
    flaky = log._tb = Flaky()
    with pytest.warns(RuntimeWarning) as rec:
        for step in range(4):
            log.scalars(step, {"x": 1.0, "y": 2.0})
        log.image("i", 4, np.zeros((2, 2, 3), np.uint8))
    log.close()  # flush/close failures of a switched-off sink are not raised either
    assert len(our_warnings(rec)) == 1 and "No space left" in our_warnings(rec)[0]
    assert flaky.calls == 1  # switched off after the first failure
    assert len(records(tmp_path)) == 4


def test_unwritable_metrics_jsonl_warns_once_and_tensorboard_goes_on(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "metrics.jsonl").mkdir()  # cannot be opened as a file
    with pytest.warns(RuntimeWarning) as rec:
        log = Logger(tmp_path, tensorboard=True)
        for step in range(3):
            log.scalars(step, {"x": float(step)})
            log.record(step, "k", {"y": 1})
        log.close()
    assert len(our_warnings(rec, "metrics.jsonl")) == 1
    assert not our_warnings(rec, "tensorboard")
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert len(ea.Scalars("x")) == 3


def test_each_failing_sink_warns_once_on_its_own(tmp_path, monkeypatch):
    import torch.utils.tensorboard as tb

    monkeypatch.setattr(tb, "SummaryWriter", lambda *a, **k: (_ for _ in ()).throw(OSError("tb down")))
    (tmp_path / "metrics.jsonl").mkdir()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        log = Logger(tmp_path, tensorboard=True)
        for step in range(3):
            log.scalars(step, {"x": 1.0})
        log.close()
    assert len(our_warnings(rec, "tensorboard")) == 1
    assert len(our_warnings(rec, "metrics.jsonl")) == 1


def test_console_line_and_rate_limit(tmp_path):
    out = io.StringIO()
    log = Logger(tmp_path, tensorboard=False, stream=out)
    log.console("first")
    log.console("dropped", every_s=3600)
    log.console("always")
    log.close()
    assert out.getvalue().splitlines() == ["first", "always"]


def test_console_on_a_closed_stream_does_not_raise(tmp_path):
    out = io.StringIO()
    out.close()
    log = Logger(tmp_path, tensorboard=False, stream=out)
    log.console("nobody listens")
    log.close()


def test_eta():
    assert eta(0) == "0m00s"
    assert eta(-5) == "0m00s"
    assert eta(61.9) == "1m01s"
    assert eta(3600 + 120 + 5) == "1h02m"

