"""wm.Forecaster: a trained run's forecast as a Python call, equal to --eval-only's rollout."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import windows_with_poses
from wm import Forecaster
from wm.checkpoint.files import load
from wm.checkpoint.trained import TrainedRunError, load_trained
from wm.evaluation.metrics import ConfusionMatrix
import wm.training.main as T
from wm.utils.errors import WMError


@pytest.mark.parametrize("motion,amp", [("given", "fp32"), ("predicted", "fp32"), ("given", "bf16")])
def test_forecast_equals_eval_only_rollout(ev, tmp_path, motion, amp):
    """Over every val window, the Forecaster's occupancy (from the shards' poses) fills exactly the
    confusion counts --eval-only reports for the same run, precision and ego-motion setting."""
    out = tmp_path / "eval.json"
    assert T.main(ev.args("--stage", "world", "--json", str(out), train__forecast_motion=motion, train__amp=amp)) == 0
    rep = json.loads(out.read_text())["world"]

    f = Forecaster.from_run(ev.run, dtype=amp)
    P, S = f.cfg.data.past, f.cfg.data.future
    cm = ConfusionMatrix(f.cfg.data.num_classes, f.cfg.data.free_class, S)
    n = 0
    for occ, poses in windows_with_poses(f, f.cfg.world_stage.batch_size):
        fut = poses[:, P:] if motion == "given" else None
        pred = f(occ[:, :P], poses[:, :P], future_poses=fut, steps=S)
        assert pred.occ.dtype == torch.uint8 and pred.occ.shape == occ[:, P:].shape
        cm.update(pred.occ.long(), occ[:, P:].long())
        n += len(occ)
    assert n == rep["windows"] == 9  # the tiny val scene's windows
    assert cm.counts.tolist() == rep["forecast"]["confusion"]


def test_numpy_in_numpy_out_one_window_codes_and_logits(ev):
    f = Forecaster.from_run(ev.run)
    occ, poses = next(windows_with_poses(f, 3))
    P = f.cfg.data.past
    batched = f(occ[:, :P].numpy(), poses[:, :P], logits=True)
    assert isinstance(batched.occ, np.ndarray) and batched.occ.dtype == np.uint8
    assert batched.occ.shape == (3, 2, *f.cfg.data.grid)
    assert batched.codes.shape == (3, 2, 4, 4) and batched.motion.shape == (3, 2, 3)
    assert batched.logits.shape == (3, 2, f.cfg.data.num_classes, *f.cfg.data.grid)
    assert np.array_equal(batched.logits.argmax(2), batched.occ)
    # the decoded codes are the occupancy
    with torch.no_grad():
        dec = f.tokenizer.decode(torch.from_numpy(batched.codes)).argmax(2)
    assert np.array_equal(dec.numpy(), batched.occ)
    # one window without a batch dimension: the same forecast as its row of the batch
    one = f(occ[0, :P], torch.from_numpy(poses[0, :P]))
    assert isinstance(one.occ, torch.Tensor) and one.logits is None
    assert one.occ.shape == (2, *f.cfg.data.grid)
    assert torch.equal(one.codes, torch.from_numpy(batched.codes[0]))
    # predicted motion by default; given future poses come back as the motion
    fut = f(occ[:1, :P], poses[:1, :P], future_poses=poses[:1, P:P + 1])
    assert fut.occ.shape[1] == 1 and fut.motion.shape == (1, 1, 3)


def test_bad_inputs_are_one_line_errors(ev):
    f = Forecaster.from_run(ev.run)
    occ, poses = next(windows_with_poses(f, 2))
    P = f.cfg.data.past
    o, p = occ[:, :P], poses[:, :P]
    cases = [
        ((o[..., :3], p), "occupancy must be"),
        ((o.float(), p), "integer class ids"),
        ((o.long() + 20, p), "class ids up to"),
        ((o.long() - 20, p), "class ids down to"),
        ((o, p[:, :1]), "1 past poses for 2 occupancy frames"),
        ((o, p[:1]), "poses are for 1 windows"),
        ((o, p[..., :3, :]), "poses must be 4x4"),
        ((o, np.full_like(p, np.nan)), "not finite"),
        ((o[:, :0], p[:, :0]), "at least one past frame"),
    ]
    for args, msg in cases:
        with pytest.raises(WMError, match=msg) as e:
            f(*args)
        assert "\n" not in str(e.value)
    with pytest.raises(WMError, match="3 future poses for 2 steps"):
        f(o, p, future_poses=np.concatenate([poses[:, P:], poses[:, P:P + 1]], 1), steps=2)
    with pytest.raises(WMError, match="dtype 'int8' must be one of"):
        Forecaster.from_run(ev.run, dtype="int8")
    with pytest.raises(WMError, match="compile 'fast' must be one of"):
        Forecaster.from_run(ev.run, compile="fast")
    if not torch.cuda.is_available():
        with pytest.raises(WMError, match="no CUDA device"):
            Forecaster.from_run(ev.run, device="cuda")
    with pytest.raises(WMError, match="cuda_graph=True needs a CUDA device"):
        Forecaster.from_run(ev.run, cuda_graph=True)
    with pytest.raises(WMError, match="does not exist"):
        Forecaster.from_run(ev.run / "nope")


def test_loader_refuses_a_tokenizer_trained_with_other_settings(ev, tmp_path):
    """Like --eval-only, the loader export and the Forecaster share checks the tokenizer checkpoint's
    own config against the world checkpoint's: here a key that changes the function, not the shapes."""
    run = tmp_path / "r"
    shutil.copytree(ev.run, run)
    wck = run / "world" / "checkpoints" / "best.pt"
    wst = load(wck)
    tname = Path(wst["tokenizer"]["path"]).name
    tst = load(run / "tokenizer" / "checkpoints" / tname)
    tst["config"]["tokenizer"]["attn_heads"] = 2  # same weights, other attention
    other = tmp_path / "tok" / "tokenizer" / "checkpoints" / tname
    other.parent.mkdir(parents=True)
    torch.save(tst, other)
    from wm.checkpoint.files import sha256_file

    wst["tokenizer"] = {"path": str(other), "sha256": sha256_file(other)}
    bad = tmp_path / "world.pt"
    torch.save(wst, bad)
    with pytest.raises(TrainedRunError, match=r"tokenizer\.attn_heads=2 .* records 1"):
        load_trained(run, bad)
    with pytest.raises(WMError, match=r"tokenizer\.attn_heads=2"):
        Forecaster.from_run(run, ckpt=bad)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,compile", [("fp32", None), ("bf16", None), ("bf16", "default")])
def test_cuda_graph_forecast_equals_the_launched_one(ev, dtype, compile):
    """The forecast recorded as one CUDA graph gives, replay after replay with other inputs and other
    batch sizes, the numbers of the same forecast launched kernel by kernel; its outputs are copies
    that a later call leaves alone."""
    eager = Forecaster.from_run(ev.run, device="cuda", dtype=dtype, compile=compile)
    graph = Forecaster.from_run(ev.run, device="cuda", dtype=dtype, compile=compile, cuda_graph=True)
    P = eager.cfg.data.past
    kept = []
    for occ, poses in windows_with_poses(eager, 2):
        for fut in (poses[:, P:], None):
            want = eager(occ[:, :P], poses[:, :P], future_poses=fut, logits=True)
            got = graph(occ[:, :P], poses[:, :P], future_poses=fut, logits=True)
            assert torch.equal(got.codes, want.codes) and torch.equal(got.occ, want.occ)
            torch.testing.assert_close(got.motion, want.motion)
            torch.testing.assert_close(got.logits, want.logits)
            kept.append((got, want))
    assert len(graph._graphs) == 4  # batch 2 and batch 1 (the last window), with and without future poses
    for got, want in kept:  # later replays did not overwrite what earlier calls returned
        assert torch.equal(got.occ, want.occ)


def test_a_compiled_forecaster_keeps_its_compile_cache_in_the_run(ev, tmp_path, monkeypatch):
    """With compile, from_run loads the run's forecast cache before anything compiles and writes it
    once per input shape (the compile itself replaced by a recorder: its cost is what is cached)."""
    import wm.training.compile_cache as C

    calls = []
    monkeypatch.setattr(C, "load", lambda d, dev, say, kind="train": calls.append(("load", Path(d), kind)))
    monkeypatch.setattr(C, "save", lambda d, dev, say, kind="train": calls.append(("save", Path(d), kind)))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(("compile",)) or fn)
    run = tmp_path / "run"
    shutil.copytree(ev.run, run)
    f = Forecaster.from_run(run, compile="default")
    assert calls[:2] == [("load", run, "forecast"), ("compile",)]  # loaded first
    occ, poses = next(windows_with_poses(f, 2))
    P = f.cfg.data.past
    for batch in (2, 2, 1):  # a new shape compiles (and is saved); a seen one does not
        f(occ[:batch, :P], poses[:batch, :P])
    assert [c for c in calls if c[0] == "save"] == [("save", run, "forecast")] * 2
    # without compile nothing is cached
    calls.clear()
    Forecaster.from_run(run)(occ[:1, :P], poses[:1, :P])
    assert calls == []


def test_inductor_options_are_the_modes_plus_the_given_ones(ev, monkeypatch):
    from torch._inductor import list_mode_options

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    t = load_trained(ev.run)
    Forecaster(t.cfg, t.tokenizer, t.world, compile="max-autotune-no-cudagraphs", inductor={"coordinate_descent_tuning": True})
    want = {**list_mode_options("max-autotune-no-cudagraphs"), "coordinate_descent_tuning": True}
    assert seen == [{"dynamic": False, "options": want}] * 3  # encode, world step, decode
    seen.clear()
    Forecaster(t.cfg, t.tokenizer, t.world, compile="default")
    assert seen == [{"dynamic": False, "mode": "default"}] * 3
