"""A checkpoint that is intact (its checksum matches) but does not belong: another program's file,
another stage's, a state lacking a key or shaped for another model, another run's (config, data,
the step its name says), or one holding NaN. Each is named and skipped for the previous checkpoint,
or refused in one line when none is left; a state with NaN is never saved nor called good."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import wm.checkpoint.files as ck
from wm.config.sections import Config
from wm.models.tokenizer import Tokenizer
import wm.training.loop as L
import wm.training.main as T
from wm.utils.errors import WMError

from helpers import cdir, plant, stop_after  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")

OVER = dict(tokenizer_stage__max_steps=5, checkpoint__every=1, checkpoint__keep_last=10)


@pytest.fixture(scope="module")
def three(tiny_factory):
    """A tiny tokenizer run stopped (as by SIGTERM) after step 3 of 5, a checkpoint per step."""
    import signal

    t = tiny_factory()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    mp = pytest.MonkeyPatch()
    try:
        stop_after(mp, 3)
        assert T.main(t.args(**OVER)) == 0
    finally:
        mp.undo()
        for s, h in saved.items():
            signal.signal(s, h)
    assert ck.load_checked(ck.latest_checkpoint(cdir(t.run_dir())))["step"] == 3
    return t


@pytest.fixture
def run(three, tmp_path):
    """A copy of `three`'s run folder: (args resuming it, its checkpoints folder)."""
    shutil.copytree(three.run_dir(), tmp_path / "runs" / "r")
    conf = tmp_path / "runs" / "r" / "config.json"  # the folder moved: its config says where to
    c = json.loads(conf.read_text())
    c["run"]["out_dir"] = str(tmp_path / "runs")
    conf.write_text(json.dumps(c))
    args = three.args(**OVER)
    i = args.index(f"run.out_dir={three.base / 'runs'}")
    args[i] = f"run.out_dir={tmp_path / 'runs'}"
    return args, cdir(tmp_path / "runs" / "r")


def step3(folder: Path) -> dict:
    return ck.load_checked(folder / ck.checkpoint_name(3))


def foreign(kind: str, st: dict):
    if kind == "other-program":
        return {"weight": torch.ones(3, 3), "bias": torch.zeros(3)}
    if kind == "other-stage":
        return dict(st, stage="world", step=4)
    if kind == "missing-key":
        return {k: v for k, v in dict(st, step=4).items() if k != "optimizer"}
    if kind == "wrong-shape":
        model = dict(st["model"])
        k = next(k for k, v in model.items() if v.ndim == 4)
        model[k] = torch.zeros(model[k].shape[0] + 1, *model[k].shape[1:])
        return dict(st, model=model, step=4)
    if kind == "moment-shape":
        opt = {"state": {i: dict(s) for i, s in st["optimizer"]["state"].items()},
               "param_groups": st["optimizer"]["param_groups"]}
        opt["state"][0]["exp_avg"] = torch.zeros(7)
        return dict(st, optimizer=opt, step=4)
    raise AssertionError(kind)


WHY = {"other-program": "is not a wm training checkpoint", "other-stage": "is a world checkpoint, not a tokenizer one",
       "missing-key": "is not a wm training checkpoint (it has no optimizer)", "wrong-shape": "does not fit the model",
       "moment-shape": "does not fit the optimizer"}


@pytest.mark.parametrize("kind", list(WHY))
def test_foreign_newest_checkpoint_with_a_matching_checksum_is_named_and_skipped(run, capsys, kind):
    args, folder = run
    bad = plant(folder, ck.checkpoint_name(4), foreign(kind, step3(folder)))
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"warning: skipped {bad}: it {WHY[kind]}" in out, out
    assert "at step 3/5" in out, out
    assert ck.load_checked(ck.latest_checkpoint(folder))["step"] == 5


def test_a_foreign_checkpoint_that_is_the_only_one_is_refused_in_one_line(run):
    args, folder = run
    for p in list(folder.iterdir()):
        p.unlink()
    bad = plant(folder, ck.checkpoint_name(3), {"weight": torch.ones(3)})
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = str(e.value)
    assert "\n" not in msg and f"no valid checkpoint in {folder}" in msg and bad.name in msg, msg
    assert "is not a wm training checkpoint" in msg and "--fresh" in msg, msg
    assert sorted(p.name for p in folder.iterdir()) == sorted([bad.name, "latest", f"{bad.name}.sha256"])


@pytest.mark.parametrize("kind,why", [
    ("name", "holds step 3, not the step 4 its name says"),
    ("seed", "was saved by another run (run.seed is 7, this run's 0)"),
    ("widths", "was saved by another run (tokenizer.widths is [8, 8, 16], this run's [8, 8, 8])"),
    ("data", "was trained on other data (fingerprint ffffffffffffffff, this run's"),
])
def test_another_runs_checkpoint_of_the_same_shapes_is_named_and_skipped(run, capsys, kind, why):
    args, folder = run
    st = step3(folder)
    if kind == "seed":
        st = dict(st, step=4, config=dict(st["config"], run=dict(st["config"]["run"], seed=7)))
    elif kind == "widths":  # another model's config, the weights of this one (renamed and re-hashed)
        st = dict(st, step=4, config=dict(st["config"], tokenizer=dict(st["config"]["tokenizer"], widths=[8, 8, 16])))
    elif kind == "data":
        st = dict(st, step=4, data_fingerprint="f" * 64)
    bad = plant(folder, ck.checkpoint_name(4), st)
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"warning: skipped {bad}: it {why}" in out, out
    assert "at step 3/5" in out, out


@pytest.mark.parametrize("where", ["model", "moment"])
def test_a_checkpoint_holding_nan_is_named_with_its_tensor_and_skipped(run, capsys, where):
    args, folder = run
    st = step3(folder)
    if where == "model":
        k = "model.enc_in.weight"
        st["model"]["enc_in.weight"].view(-1)[5] = float("nan")
    else:
        k = "optimizer.state.1.exp_avg_sq"
        st["optimizer"]["state"][1]["exp_avg_sq"].view(-1)[0] = float("inf")
    bad = plant(folder, ck.checkpoint_name(4), dict(st, step=4))
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"warning: skipped {bad}: it holds non-finite values (first: {k}" in out, out
    if where == "moment":  # the moment is named with its parameter
        names = [n for n, p in Tokenizer(Config().tokenizer, 18, (16, 16, 4)).named_parameters()]
        assert f"(the moment of " in out and any(f"the moment of {n})" in out for n in names), out
    assert "at step 3/5" in out, out


def test_a_state_that_turned_nan_is_never_saved_and_the_good_one_is_named(run, monkeypatch):
    """A weight turns NaN during step 4 (nothing it computes is finite from then on): the save of
    step 4 is refused, naming the tensor, and the message names step 3, which is finite."""
    args, folder = run
    real = L.train_step

    def step(stage, net, *a, **kw):
        r = real(stage, net, *a, **kw)
        with torch.no_grad():
            net.model.dec_out.weight.view(-1)[0] = float("nan")
        return r

    monkeypatch.setattr(L, "train_step", step)
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = str(e.value)
    assert "\n" not in msg and "step 4 holds non-finite values (first: model.dec_out.weight)" in msg, msg
    assert f"The last good checkpoint is {folder / ck.checkpoint_name(3)}" in msg, msg
    assert not (folder / ck.checkpoint_name(4)).exists()
    for p in ck.list_checkpoints(folder) + [folder / ck.BEST] * (folder / ck.BEST).exists():
        st = ck.load_checked(p)
        for t in list(st["model"].values()) + [t for s in st["optimizer"]["state"].values() for t in s.values()]:
            assert torch.isfinite(t.float()).all(), p


def test_the_world_stage_skips_a_foreign_tokenizer_best_for_the_newest_good_step(tiny, capsys):
    args = tiny.args(train__stages="tokenizer", tokenizer_stage__max_steps=2, checkpoint__every=1)
    assert T.main(args) == 0
    folder = cdir(tiny.run_dir())
    bad = plant(folder, ck.BEST, {"weight": torch.ones(2)})
    capsys.readouterr()
    assert T.main(tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                            world_stage__max_steps=1)) == 0
    out = capsys.readouterr().out
    assert f"warning: skipped {bad}: it is not a wm training checkpoint" in out, out
    assert f"world stage: frozen tokenizer {folder / ck.checkpoint_name(2)}" in out, out


def test_eval_and_export_skip_a_foreign_best_for_the_newest_good_step(trained_tiny, tmp_path, capsys):
    from wm.evaluation.evaluate import stage_checkpoint
    from wm.checkpoint.trained import load_trained

    run = tmp_path / "run"
    shutil.copytree(trained_tiny.run_dir(), run)
    for stage in ("tokenizer", "world"):
        st = ck.load_checked(cdir(run, stage) / ck.BEST)
        st["model"] = dict(st["model"])
        k = next(iter(st["model"]))
        st["model"][k] = torch.full_like(st["model"][k], float("nan"))
        plant(cdir(run, stage), ck.BEST, st)
        capsys.readouterr()
        p, got = stage_checkpoint(run, stage, say=print)
        out = capsys.readouterr().out
        assert f"skipped {cdir(run, stage) / ck.BEST}: it holds non-finite values (first: model.{k})" in out, out
        assert p.name.startswith("step_") and torch.isfinite(next(iter(got["model"].values()))).all()
    plant(cdir(run, "world"), ck.BEST, {"weight": torch.ones(2)})
    t = load_trained(run)
    assert f"skipped {cdir(run, 'world') / ck.BEST}: it is not a wm training checkpoint" in capsys.readouterr().out
    assert t.ckpt.name.startswith("step_")


def test_a_named_checkpoint_holding_nan_is_refused_by_eval_and_export(trained_tiny, tmp_path):
    from wm.evaluation.evaluate import load_stage
    from wm.checkpoint.trained import load_trained

    st = ck.load_checked(cdir(trained_tiny.run_dir(), "world") / ck.BEST)
    k = next(iter(st["model"]))
    st["model"][k] = torch.full_like(st["model"][k], float("inf"))
    torch.save(st, tmp_path / "x.pt")
    for load in (lambda: load_stage(tmp_path / "x.pt", "world"), lambda: load_trained(trained_tiny.run_dir(), tmp_path / "x.pt")):
        with pytest.raises(WMError) as e:
            load()
        msg = str(e.value)
        assert "\n" not in msg and str(tmp_path / "x.pt") in msg and f"holds non-finite values (first: model.{k})" in msg, msg
