"""The config by concern: one rule per key for resume and for --eval-only, declared with the key
(wm/config/rules.py); config files and run folders whose keys sit where they were before the
sections of how a run runs (tests/config/config_old_layout.json: the demo's config.json in that
layout) read as this layout, each moved key named in one line, so such a run folder resumes and
evaluates."""

import json
import shutil
from pathlib import Path

import pytest

import wm.checkpoint.files as ck
from wm.config import loading as CL
from wm.config import upgrade as CU
from wm.config.rules import ALLOWED, FREE, MATCH
import wm.config.sections as C
from wm.training.loop import Preemption
import wm.training.main as T
from wm.utils.errors import ConfigError, WMError

from helpers import plant  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")

OLD = Path(__file__).resolve().parent / "config_old_layout.json"
STAGE_KEYS = ("epochs", "max_steps", "lr", "min_lr", "warmup_steps", "weight_decay", "betas", "clip", "eval_every",
              "early_stop")


def old_layout(d: dict, **values) -> dict:
    """Config dict `d` (this layout) written as tests/config/config_old_layout.json lays its keys out,
    the dropped knobs at their defaults unless `values` ("section.key": value) says otherwise."""
    out = {}
    for sec, keys in json.loads(OLD.read_text()).items():
        out[sec] = {}
        for k in keys:
            key = f"{sec}.{k}"
            if key in values:
                out[sec][k] = values[key]
            elif key in CU.DROPPED:
                out[sec][k] = CU.DROPPED[key][0]
            else:
                s, n = CU.MOVED.get(key, key).split(".")
                out[sec][k] = d[s][n]
    return out


# ---------------------------------------------------------------------------------------------
# the rules


def test_each_key_has_one_rule_for_resume_and_one_for_eval_only():
    rules = CL.key_rules()
    assert sorted(f"{s}.{k}" for s, ks in rules.items() for k in ks) == sorted(
        k for k in CL._all_keys(C.Config) if "." in k)
    assert all(r in (FREE, MATCH, ALLOWED) and e in (FREE, MATCH) for ks in rules.values() for r, e in ks.values())
    keys = {f"{s}.{k}": r for s, ks in rules.items() for k, r in ks.items()}
    # --allow-changed: a stage's schedule, nothing else
    assert {k for k, (r, _) in keys.items() if r == ALLOWED} == {
        f"{s}_stage.{k}" for s in ("tokenizer", "world") for k in STAGE_KEYS}
    # how a run runs may change on resume, but for the gradients' wire dtype (it changes them, as train.amp)
    runs = ("loader", "compile", "kernels", "activation_checkpoint", "ddp", "checkpoint", "logging")
    assert {k for k, (r, _) in keys.items() if k.split(".")[0] in runs and r != FREE} == {"ddp.grad_dtype"}
    # ... and what it validates on: a subset of the val split changes no training
    assert {k for k, (r, _) in keys.items() if r == FREE and k.split(".")[0] not in runs} == {
        "run.name", "run.out_dir", "data.root", "synthetic.cache_dir", "train.stages", "train.max_nonfinite",
        "tokenizer_stage.val_windows", "world_stage.val_windows"}
    # --eval-only: the function a checkpoint computes (its model, bar the loss terms; the grid and classes)
    loss = {"tokenizer.commitment", "tokenizer.ce_weight", "tokenizer.lovasz_weight", "tokenizer.vq_weight",
            "tokenizer.dead_code_steps", "tokenizer.class_weight_power", "tokenizer.class_weight_max",
            "world.ce_weight", "world.motion_weight"}
    model = {k for k in keys if k.split(".")[0] in ("tokenizer", "world")}
    assert {k for k, (_, e) in keys.items() if e == MATCH} == (model - loss) | {
        "data.grid", "data.num_classes", "data.free_class"}


def test_the_config_reference_shows_each_keys_rules():
    from wm.config.reference import reference

    ref = reference()
    assert "| `kernels.tokenizer_head` | bool | `true` | may change | may change |" in ref
    assert "| `tokenizer_stage.lr` | float | `0.004` | --allow-changed | may change |" in ref
    assert "| `data.grid` | tuple[int, ...] | `[64, 64, 8]` | must match | must match |" in ref


# ---------------------------------------------------------------------------------------------
# the old layout


def test_the_old_layout_reads_as_the_same_config_with_one_line_naming_each_moved_key():
    old = json.loads(OLD.read_text())
    d, notes = CU.upgrade(old)
    assert CL.to_dict(CL.from_dict(C.Config, d)) == CL.to_dict(C.Config())
    assert CL.from_dict(C.Config, old) == C.Config()
    moved = ", ".join(f"{a} -> {b}" for a, b in CU.MOVED.items())
    assert notes == [f"keys moved to sections of their own, read as the new ones: {moved}",
                     'tokenizer.checkpoint_policy is gone (only "full" remains), dropped',
                     'world.checkpoint_policy is gone (only "full" remains), dropped',
                     "tokenizer.channels_last is gone (only false remains), dropped"]
    assert len(CU.MOVED) == 25 and all(f"{k.split('.')[0]}" in old and k.split(".")[1] in old[k.split(".")[0]]
                                      for k in CU.MOVED)
    assert CU.upgrade(CL.to_dict(C.Config())) == (CL.to_dict(C.Config()), [])  # this layout: untouched


def test_a_dropped_knob_at_another_value_says_what_runs_now():
    _, notes = CU.upgrade({"tokenizer": {"checkpoint_policy": "selective", "channels_last": True},
                          "world": {"checkpoint_policy": "selective"}})
    assert notes == [
        'tokenizer.checkpoint_policy="selective" is gone: a checkpointed tokenizer block keeps only its input (full)',
        'world.checkpoint_policy="selective" is gone: a checkpointed world-model block keeps only its inputs (full)',
        "tokenizer.channels_last=true is gone: the tokenizer's encoder runs NCHW (its decoder NHWC); under "
        "torch.compile compile.tokenizer_channels_last lays its convolutions out NHWC"]


def test_a_config_file_in_the_old_layout_loads_with_one_note(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"train": {"compile": False, "log_every": 3}, "data": {"num_workers": 1, "past": 3}}))
    said = []
    cfg = CL.load(p, say=said.append)
    assert said == [f"note: {p}: keys moved to sections of their own, read as the new ones: data.num_workers -> "
                    "loader.num_workers, train.compile -> compile.enable, train.log_every -> logging.every"]
    assert (cfg.compile.enable, cfg.logging.every, cfg.loader.num_workers, cfg.data.past) == (False, 3, 1, 3)


@pytest.mark.parametrize("item, words", [
    ("train.compile=true", "unknown key: it is compile.enable now"),
    ("data.num_workers=0", "unknown key: it is loader.num_workers now"),
    ("tokenizer.checkpoint_policy=full", "unknown key: the knob is gone, a checkpointed tokenizer block keeps only"),
])
def test_set_of_a_moved_key_says_where_it_is(item, words):
    with pytest.raises(ConfigError) as e:
        CL.load(None, [item])
    assert words in str(e.value) and item.split("=")[0] in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# run folders


def test_eval_only_takes_a_config_that_differs_only_in_how_it_runs(ev, tmp_path):
    how = dict(kernels__tokenizer_head=False, kernels__embedding_grad=False, kernels__lovasz_impl="histogram",
               kernels__temporal_attention=False, kernels__world_channels_last=False, compile__enable=False,
               activation_checkpoint__tokenizer_every=1, activation_checkpoint__world_every=1,
               loader__persistent_workers=False, checkpoint__every=7, logging__every=3)
    assert T.main(ev.args("--stage", "all", "--horizons", "0.5", "--json", str(tmp_path / "r.json"), **how)) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["tokenizer"]["frames"] > 0 and rep["world"]["windows"] > 0
    with pytest.raises(WMError, match="tokenizer.embed_dim"):  # what the model computes: refused
        T.main(ev.args("--stage", "tokenizer", tokenizer__embed_dim=4))


def test_a_run_folder_in_the_old_layout_evaluates_and_resumes(tiny, capsys):
    args = tiny.args(tokenizer_stage__max_steps=2)
    assert T.main(args, stop=Preemption(requested=True)) == 0  # step 1 saved, as by SIGTERM
    rd = tiny.run_dir()
    folder = rd / "tokenizer" / "checkpoints"
    conf = rd / "config.json"
    new = json.loads(conf.read_text())
    conf.write_text(json.dumps({**old_layout(new, **{"tokenizer.checkpoint_policy": "selective"}),
                                "meta": new["meta"]}))
    ckpt_state = ck.load_checked(folder / ck.checkpoint_name(1))
    plant(folder, ck.checkpoint_name(1), {**ckpt_state, "config": old_layout(ckpt_state["config"])})
    assert "train" in ck.load_checked(folder / ck.checkpoint_name(1))["config"]  # the old layout's own keys
    assert "compile" in ck.load_checked(folder / ck.checkpoint_name(1))["config"]["train"]

    out = rd / "eval.json"
    assert T.main(args + ["--eval-only", "--json", str(out)]) == 0  # the old checkpoint, evaluated
    assert json.loads(out.read_text())["tokenizer"]["step"] == 1
    capsys.readouterr()
    assert T.main(args) == 0
    said = capsys.readouterr().out
    moved = ", ".join(f"{a} -> {b}" for a, b in CU.MOVED.items())
    assert f"note: {conf}: keys moved to sections of their own, read as the new ones: {moved}\n" in said, said
    assert (f'note: {conf}: tokenizer.checkpoint_policy="selective" is gone: a checkpointed tokenizer block keeps '
            "only its input (full)") in said, said
    assert f"tokenizer: resumed from {folder / ck.checkpoint_name(1)} at step 1/2" in said, said
    assert ck.load_checked(folder / ck.checkpoint_name(2))["step"] == 2
    now = json.loads(conf.read_text())  # written back in this layout: the next run says nothing
    assert "compile" not in now["train"] and now["compile"] == CL.to_dict(C.Config())["compile"]
    assert T.main(args) == 0 and "note:" not in capsys.readouterr().out


def test_an_old_layout_world_checkpoint_evaluates(ev, tmp_path):
    shutil.copytree(ev.run, tmp_path / "runs" / "r")
    folder = tmp_path / "runs" / "r" / "world" / "checkpoints"
    for p in ck.list_checkpoints(folder) + [folder / ck.BEST] * (folder / ck.BEST).exists():
        ckpt_state = ck.load_checked(p)
        plant(folder, p.name, {**ckpt_state, "config": old_layout(ckpt_state["config"])})
    args = ev.t.args(train__stages="tokenizer,world", run__out_dir=str(tmp_path / "runs"))
    out = tmp_path / "r.json"
    assert T.main(args + ["--eval-only", "--stage", "world", "--horizons", "0.5", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["world"]["windows"] > 0
