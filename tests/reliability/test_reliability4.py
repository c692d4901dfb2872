"""Reliability: the cases an attack on tiny runs found, each reproduced here and ended in one line
(or held) without losing a file.

1 another run's world checkpoint copied in as the newest step   4 bad input: a non-wm --ckpt, a huge batch,
2 a codebook larger than the int16 token cache holds              a NUL byte, a too long run.name, a read-only
3 damaged small files: done.json, config.json, a folder           WM_CACHE, ~ in a path
  that is a file                                                5 partial writes: a failed save of a replayed
                                                                  step, a cut metrics.jsonl line, a report
                                                                  folder or run folder that cannot be written
"""

import builtins
import errno
import importlib.util
import io
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import wm.checkpoint.checkpointer as cpr
from wm.checkpoint.checkpointer import Checkpointer
import wm.checkpoint.files as ck
from wm.config.loading import load as load_config
import wm.training.main as T
from wm.utils.errors import ConfigError, DataError, WMError
from wm.utils.logs import Logger

from helpers import ROOT, one_line

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")

BOTH = dict(train__stages="tokenizer,world", tokenizer_stage__max_steps=2, world_stage__max_steps=2,
            checkpoint__every=1)


def cdir(run_dir: Path, stage: str = "tokenizer") -> Path:
    return run_dir / stage / "checkpoints"


@pytest.fixture(scope="module")
def runs(tiny_factory):
    """r: both stages, 2 + 2 steps, a checkpoint every step; r2: the same config but a tokenizer
    trained a step longer, so its world checkpoints name another tokenizer."""
    t = tiny_factory()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert T.main(t.args(name="r", **BOTH)) == 0
        assert T.main(t.args(name="r2", **dict(BOTH, tokenizer_stage__max_steps=3, world_stage__max_steps=3))) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return t


def copy_of(t, tmp_path: Path, name: str = "r") -> tuple[Path, list]:
    """A copy of run `name` under tmp_path/runs, and the train.py arguments that resume it."""
    dst = tmp_path / "runs" / "r"
    shutil.copytree(t.run_dir(name=name), dst)
    return dst, t.args(out=str(tmp_path / "runs"), name="r", **BOTH)


# ---------------------------------------------------------------------------------------------
# 1. a stray world checkpoint is named and set aside; the run's own stay and are resumed


def _foreign_config(src: Path, dst: Path) -> None:
    """Another run's world checkpoint: r2's step 3 with another run.seed in its config."""
    st = torch.load(src, weights_only=True)
    st["config"]["run"]["seed"] = 7
    size, sha = ck.write_hashed(dst, lambda f: torch.save(st, f))
    ck.write_sums(dst, sha)


@pytest.mark.parametrize("stray", ["other-tokenizer", "other-tokenizer-no-pointer", "other-run"])
@pytest.mark.parametrize("finished", [True, False])
def test_1_a_stray_world_checkpoint_is_named_once_and_set_aside_never_the_runs_own(runs, tmp_path, capsys, stray,
                                                                                  finished):
    run, args = copy_of(runs, tmp_path)
    world, src = cdir(run, "world"), cdir(runs.run_dir(name="r2"), "world")
    own = {p.name: p.read_bytes() for p in world.iterdir() if p.name != ck.POINTER}
    name = ck.checkpoint_name(3)
    if stray == "other-run":
        _foreign_config(src / name, world / name)
    else:
        for n in (name, name + ".sha256") + ((ck.POINTER,) if stray == "other-tokenizer" else ()):
            shutil.copy2(src / n, world / n)
    copied = (world / name).read_bytes()
    if not finished:
        (run / "world" / "done.json").unlink()
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if str(world / name) in ln]
    assert len(lines) == 1, out  # named once: not again by the resume
    why = "was saved by another run (run.seed is 7" if stray == "other-run" else "was trained on another tokenizer"
    assert lines[0].startswith(f"warning: {world / name} is not this run's world checkpoint: it {why}"), lines[0]
    assert "starts over" not in out and not list(run.glob("world.*")), out
    aside = list((run / "world").glob("foreign-*"))
    assert len(aside) == 1 and (aside[0] / name).read_bytes() == copied and (aside[0] / (name + ".sha256")).is_file()
    assert {n: (world / n).read_bytes() for n in own} == own  # the run's own files, as they were
    assert not (world / name).exists()
    latest = ck.latest_checkpoint(world)
    assert latest.name == ck.checkpoint_name(2) and ck.load(latest)["step"] == 2
    if finished:
        assert "world stage already finished at step 2" in out, out
    else:
        assert f"world: resumed from {world / ck.checkpoint_name(2)} at step 2/2" in out, out
        assert json.loads((run / "world" / "done.json").read_text())["step"] == 2
    assert T.main(args) == 0  # and the next run finds nothing to say
    assert "not this run's" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 2. a codebook the int16 token cache cannot hold


def test_2_a_codebook_beyond_int16_is_refused_naming_the_key(tiny):
    with pytest.raises(ConfigError) as e:
        T.main(tiny.args(tokenizer__codebook_size=40000))
    msg = one_line(e.value)
    assert "tokenizer.codebook_size" in msg and "int16" in msg and "32768" in msg, msg
    assert not tiny.run_dir().exists()
    assert load_config(None, ["tokenizer.codebook_size=32768"]).tokenizer.codebook_size == 32768


# ---------------------------------------------------------------------------------------------
# 3. damaged small files


@pytest.mark.parametrize("content", ['"finished"', "[1, 2]", '{"step": 2}', '{"step": "2", "metrics": {}}',
                                     '{"step": 2, "metrics": {"val/iou": "high"}}', '{"step": 2, "metrics": [], ',
                                     "folder"])
def test_3_a_damaged_done_json_is_kept_aside_and_the_stage_is_checked_from_its_checkpoints(runs, tmp_path,
                                                                                          capsys, content):
    run, args = copy_of(runs, tmp_path)
    done = run / "world" / "done.json"
    good = json.loads(done.read_text())
    done.unlink()
    if content == "folder":
        done.mkdir()
        (done / "x").write_text("kept")
    else:
        done.write_text(content)
    capsys.readouterr()
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"note: {done} " in out and "the world stage is checked again from its checkpoints" in out, out
    assert f"world: resumed from {cdir(run, 'world') / ck.checkpoint_name(2)} at step 2/2" in out, out
    aside = list(done.parent.glob("done.json.damaged-*"))
    assert len(aside) == 1
    assert (aside[0] / "x").read_text() == "kept" if content == "folder" else aside[0].read_text() == content
    rec = json.loads(done.read_text())
    assert rec["step"] == 2 and rec["metrics"] == good["metrics"]  # the checkpoint's validation, as before
    assert "nan" not in out.split("finished in")[-1], out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"]["iou_avg"] == pytest.approx(good["metrics"]["val/iou"])


@pytest.mark.parametrize("content", ["[1]", "null", '"config"', '{"meta": [1]}', '{"meta": {"history": "x"}}'])
def test_3_a_config_json_of_another_shape_is_one_line_and_left_as_it_is(runs, tmp_path, content):
    run, args = copy_of(runs, tmp_path)
    (run / "config.json").write_text(content)
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = one_line(e.value)
    assert str(run / "config.json") in msg and "--fresh" in msg, msg
    assert (run / "config.json").read_text() == content


@pytest.mark.parametrize("where", ["token_cache", "world/checkpoints", "tokenizer"])
def test_3_a_file_where_the_run_keeps_a_folder_is_one_line_and_kept(runs, tmp_path, where):
    run, args = copy_of(runs, tmp_path)
    shutil.rmtree(run / where)
    (run / where).write_text("a user's file")
    (run / "world" / "done.json").unlink(missing_ok=True)
    with pytest.raises(WMError) as e:
        T.main(args)
    msg = one_line(e.value)
    assert f"{run / where} is a file" in msg and "move the file away" in msg, msg
    assert (run / where).read_text() == "a user's file"


def test_3_a_checkpoint_folder_that_is_a_file_is_one_line_for_every_reader(tmp_path):
    (tmp_path / "checkpoints").write_text("x")
    with pytest.raises(ck.CheckpointError) as e:
        ck.newest_valid(tmp_path / "checkpoints", say=lambda *a: None)
    assert f"{tmp_path / 'checkpoints'} is a file" in one_line(e.value)


# ---------------------------------------------------------------------------------------------
# 4. bad input


def _non_wm_files(tmp_path: Path, world: Path) -> dict:
    good = torch.load(world / "best.pt", weights_only=True)
    files = {"str": "hello", "list": [1, 2], "dict": {"a": 1}, "stage-list": {"stage": [1], "model": {}, "config": {}},
             "stage-only": {"stage": "world"}, "config-str": dict(good, config="x"),
             "tokenizer-str": dict(good, tokenizer="x"), "model-str": dict(good, model="x")}
    out = {}
    for k, v in files.items():
        torch.save(v, tmp_path / f"{k}.pt")
        out[k] = tmp_path / f"{k}.pt"
    return out


def test_4_a_non_wm_ckpt_is_one_line_in_eval_only_and_export(ev, tmp_path):
    spec = importlib.util.spec_from_file_location("export_cli", ROOT / "export.py")
    export_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_cli)
    for kind, f in _non_wm_files(tmp_path, cdir(ev.run, "world")).items():
        for run in (lambda: T.main(ev.args("--ckpt", str(f))),
                    lambda: export_cli.main(["--run", str(ev.run), "--ckpt", str(f), "--out", str(tmp_path / "x")])):
            with pytest.raises(WMError) as e, torch.enable_grad():  # export turns autograd off for the process
                run()
            assert str(f) in one_line(e.value), (kind, str(e.value))
    assert torch.is_grad_enabled()
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("key", ["data.batch_size", "tokenizer_stage.batch_size", "world_stage.global_batch"])
def test_4_a_huge_batch_is_refused_naming_the_key(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=100000000000000000000"])
    msg = one_line(e.value)
    assert f"'{key}'" in msg and "65536" in msg, msg
    assert load_config(None, [f"{key}=65536"])


@pytest.mark.parametrize("key", ["run.name", "run.out_dir", "data.root", "synthetic.cache_dir", "init.from"])
def test_4_a_nul_byte_in_a_path_key_is_refused_naming_it(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=a\0b"])
    assert f"'{key}'" in one_line(e.value) and "NUL" in str(e.value)


def test_4_a_run_name_longer_than_the_file_system_takes_is_refused(tiny):
    limit = os.pathconf(tiny.base, "PC_NAME_MAX")
    with pytest.raises(ConfigError) as e:
        T.main(tiny.args(name="n" * 300))
    msg = one_line(e.value)
    assert "'run.name'" in msg and "PC_NAME_MAX" in msg and f"at most {limit - 19} bytes" in msg, msg
    assert T.main(tiny.args(name="n" * (limit - 19), tokenizer_stage__max_steps=1)) == 0
    assert T.main(tiny.args(name="n" * (limit - 19), tokenizer_stage__max_steps=1, flags=["--fresh"])) == 0


SYNTHETIC = dict(data__root="", synthetic__train_scenes=2, synthetic__val_scenes=1, synthetic__frames=12,
                 tokenizer_stage__max_steps=1)


def test_4_a_read_only_wm_cache_is_one_line_naming_it(tiny, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("WM_CACHE", str(cache))
    real = os.mkdir

    def read_only(p, *a, **kw):  # what a read-only file system answers (root writes through chmod)
        if Path(p).parent == cache:
            raise OSError(errno.EROFS, "Read-only file system", str(p))
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "mkdir", read_only)
    for argv in (tiny.args(**SYNTHETIC), tiny.args(**SYNTHETIC, flags=["--horizons", "1"])):  # train; plan
        with pytest.raises(DataError) as e:
            T.main(argv)
        msg = one_line(e.value)
        assert f"synthetic data cache {cache} ($WM_CACHE): Read-only file system" in msg, msg
        assert "set synthetic.cache_dir or $WM_CACHE" in msg, msg
    assert list(cache.iterdir()) == []


def test_4_a_tilde_in_a_path_means_the_home_folder(tiny, tmp_path, monkeypatch, capsys):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WM_CACHE", "~/cache")  # quoted: the shell left the ~
    monkeypatch.chdir(cwd)
    assert T.main(tiny.args(run__out_dir="~/runs", **SYNTHETIC)) == 0
    out = capsys.readouterr().out
    assert f"run {home / 'runs' / 'r'} finished" in out, out
    assert list(cwd.iterdir()) == []  # no folder named '~'
    assert list((home / "cache").glob("synthetic-*/manifest.json"))
    assert (home / "runs" / "r" / "tokenizer" / "done.json").is_file()
    assert load_config(None, ["init.from=~/src"]).init.from_ == str(home / "src")


# ---------------------------------------------------------------------------------------------
# 5. partial writes


def _state(v: float, step: int) -> dict:
    return {"model": {"w": torch.full((8,), v)}, "step": step}


@pytest.mark.parametrize("fails", ["sums", "pointer", "best"])
def test_5_a_failed_save_of_a_step_saved_before_keeps_the_earlier_file_and_its_pointer(tmp_path, monkeypatch, fails):
    c = Checkpointer(tmp_path, keep_last=3, best_metric="iou", async_save=False)
    c.save(_state(1, 10), 10, {"iou": 0.1})
    c.save(_state(2, 11), 11, {"iou": 0.2})
    name = ck.checkpoint_name(11)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails == "sums":
        monkeypatch.setattr(cpr, "write_sums", full)
    elif fails == "pointer":  # after the new .sha256 was written
        real = cpr.write_json_atomic
        monkeypatch.setattr(cpr, "write_json_atomic",
                            lambda p, o: full() if Path(p).name == ck.POINTER else real(p, o))
    else:
        monkeypatch.setattr(cpr, "publish", full)
    with pytest.raises(ck.CheckpointError) as e:
        c.save(_state(3, 11), 11, {"iou": 0.9})  # the same step again, a new best
    msg = one_line(e.value)
    assert f"the new {name} was removed and the earlier one put back" in msg, msg
    monkeypatch.undo()
    # nothing lost, no temporary left; a best that was updated holds the new state whole, checked by best.json
    best = () if fails == "best" else (ck.BEST, ck.BEST_JSON)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name not in best} == \
        {k: v for k, v in before.items() if k not in best}
    ck.verify(tmp_path / ck.BEST)
    pointed = tmp_path / json.loads((tmp_path / ck.POINTER).read_text())["file"]
    assert pointed.name == name and pointed.is_file()
    path, st = ck.newest_valid(tmp_path, say=lambda *a: None)
    assert path == pointed and torch.equal(st["model"]["w"], torch.full((8,), 2.0))
    c.save(_state(3, 11), 11, {"iou": 0.9})  # the same save once the disk has room
    assert torch.equal(ck.load(tmp_path / name)["model"]["w"], torch.full((8,), 3.0))
    assert json.loads((tmp_path / ck.BEST_JSON).read_text())["step"] == 11
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_5_a_cut_metrics_line_is_dropped_before_the_next_record(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "st')  # a full disk mid-record
    stream = io.StringIO()
    log = Logger(tmp_path, tensorboard=False, stream=stream)
    log.scalars(2, {"loss": 1.0})
    log.close()
    recs = [json.loads(ln) for ln in f.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert f"note: {f} ended in a record cut short (21 bytes" in stream.getvalue()
    stream = io.StringIO()
    Logger(tmp_path, tensorboard=False, stream=stream).close()  # a whole file is left as it is
    assert stream.getvalue() == "" and len(f.read_text().splitlines()) == 2


def test_5_an_eval_report_that_cannot_be_written_is_refused_before_the_evaluation(ev, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    with pytest.raises(WMError) as e:
        T.main(ev.args("--json", str(tmp_path / "file" / "report.json")))
    msg = one_line(e.value)
    assert f"cannot write the evaluation report {tmp_path / 'file' / 'report.json'}" in msg and "--json" in msg, msg
    import wm.checkpoint.run_folder as R

    monkeypatch.setattr(R.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    with pytest.raises(WMError) as e:
        T.main(ev.args())
    assert "its disk has 0 KiB free" in one_line(e.value), str(e.value)
    out = capsys.readouterr().out
    assert "frames" not in out and "windows" not in out, out  # nothing was evaluated


def test_5_a_stage_folder_that_cannot_be_written_is_refused_before_training(tiny, monkeypatch, capsys):
    args = tiny.args(tokenizer_stage__max_steps=2, checkpoint__every=1)
    assert T.main(args, stop=T.Preemption(requested=True)) == 0  # step 1 saved
    folder = cdir(tiny.run_dir())
    before = sorted(p.name for p in folder.iterdir())
    real_open = builtins.open

    def read_only(file, mode="r", *a, **kw):  # a folder made read-only (root writes through chmod)
        if Path(str(file)).parent == folder and ("w" in mode or "+" in mode or "a" in mode):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", read_only)
    monkeypatch.setattr(io, "open", read_only)
    capsys.readouterr()
    with pytest.raises(WMError) as e:
        T.main(args)
    monkeypatch.undo()
    msg = one_line(e.value)
    assert f"cannot write in {folder} (Read-only file system), where the tokenizer stage saves" in msg, msg
    assert "tokenizer step" not in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == before
