"""TensorBoard's HParams records in the run's own event file (wm/utils/logs.py, wm/training/main.py): a finished, a
running and a failed run read back through TensorBoard's own loading show their session start (trial
id, typed hparams) and end status; the training time per stage and per run (done.json, summary.json)
sums a preempted run's two processes and leaves out the gap between them."""

import json
import time

import pytest
import torch

from wm.training.loop import Preemption
import wm.training.main as T


def hparams_records(run_dir) -> dict:
    """{tag: HParamsPluginData} of the hparams plugin in the run's tb/, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(str(run_dir / "tb"))
    ea.Reload()
    return {tag: plugin_data_pb2.HParamsPluginData.FromString(c)
            for tag, c in ea.PluginTagToContent("hparams").items()}


def check_start(recs, name):
    from tensorboard.plugins.hparams import api_pb2

    exp = recs["_hparams_/experiment"].experiment
    assert "run/gpu_hours" in [m.name.tag for m in exp.metric_infos]
    types = {h.name: h.type for h in exp.hparam_infos}
    assert types["logging.tensorboard"] == api_pb2.DATA_TYPE_BOOL
    assert types["tokenizer_stage.lr"] == api_pb2.DATA_TYPE_FLOAT64
    assert types["train.stages"] == api_pb2.DATA_TYPE_STRING
    start = recs["_hparams_/session_start_info"].session_start_info
    assert start.group_name == name  # the trial id
    hp = start.hparams
    assert set(hp) == set(types)
    assert hp["logging.tensorboard"].WhichOneof("kind") == "bool_value" and hp["logging.tensorboard"].bool_value is True
    assert hp["tokenizer.mid_attention"].WhichOneof("kind") == "bool_value"
    assert hp["tokenizer_stage.max_steps"].number_value == 2
    assert hp["train.device"].string_value == "cpu"


def test_finished_running_and_failed_runs(tiny, restore_signals, one_thread, monkeypatch):
    from tensorboard.plugins.hparams import api_pb2

    assert T.main(tiny.args(name="done", logging__tensorboard=True, tokenizer_stage__max_steps=2)) == 0
    recs = hparams_records(tiny.run_dir(name="done"))
    check_start(recs, "done")
    assert recs["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_SUCCESS
    assert not (tiny.run_dir(name="done") / "tb" / "hparams").exists()

    # running: read back when the stage starts, before the run ends (the start records are flushed at once)
    import wm.training.loop as L

    seen, real_fit = {}, L.fit

    def fit_and_look(run, stage, *a, **k):
        seen.update(hparams_records(run.dir))
        return real_fit(run, stage, *a, **k)

    monkeypatch.setattr(T, "fit", fit_and_look)
    assert T.main(tiny.args(name="going", logging__tensorboard=True, tokenizer_stage__max_steps=2)) == 0
    check_start(seen, "going")
    assert "_hparams_/session_end_info" not in seen

    def boom(*a, **k):
        raise RuntimeError("boom: the stage fell over")

    monkeypatch.setattr(T, "fit", boom)
    with pytest.raises(RuntimeError, match="boom"):
        T.main(tiny.args(name="failed", logging__tensorboard=True, tokenizer_stage__max_steps=2))
    recs = hparams_records(tiny.run_dir(name="failed"))
    check_start(recs, "failed")
    assert recs["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_FAILURE


def test_preempted_run_counts_its_processes_not_the_gap(tiny, restore_signals, one_thread, monkeypatch):
    from tensorboard.plugins.hparams import api_pb2

    args = tiny.args(logging__tensorboard=True, tokenizer_stage__max_steps=3)
    t = time.perf_counter()
    assert T.main(args, stop=Preemption(requested=True)) == 0  # stops after step 1, saved
    first = time.perf_counter() - t
    rd = tiny.run_dir()
    assert not (rd / "tokenizer" / "done.json").exists()
    assert "_hparams_/session_end_info" not in hparams_records(rd)  # preempted: the run goes on
    ckpt = torch.load(sorted((rd / "tokenizer" / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert 0 < ckpt["time"]["wall_s"] <= first
    # the gap between the processes: a fake 1000 s on both clocks, not a sleep (the run measures its own time)
    real_perf, real_time = time.perf_counter, time.time
    monkeypatch.setattr(time, "perf_counter", lambda: real_perf() + 1000.0)
    monkeypatch.setattr(time, "time", lambda: real_time() + 1000.0)
    t = time.perf_counter()
    assert T.main(args) == 0
    second = time.perf_counter() - t
    done = json.loads((rd / "tokenizer" / "done.json").read_text())
    assert done["step"] == 3
    # the stage's time is its two processes' share: more than the first's, within both, the gap left out
    assert ckpt["time"]["wall_s"] < done["wall_s"] <= first + second + 0.01
    assert done["gpu_hours"] == pytest.approx(done["wall_s"] / 3600, rel=1e-3, abs=0.0005 / 3600)  # one rank; wall_s in ms
    s = json.loads((rd / "summary.json").read_text())
    assert s["tokenizer"]["wall_s"] == done["wall_s"] and s["wall_s"] == done["wall_s"]
    assert s["gpu_hours"] == pytest.approx(done["gpu_hours"])
    recs = hparams_records(rd)
    assert recs["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_SUCCESS
