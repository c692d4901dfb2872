"""Fine-tuning (init.from, wm/checkpoint/init_from.py): a stage's weights from another run, which is not resuming.
One tiny source run (both stages) is shared by the module; each test fine-tunes from it in its own
folder: the weights it starts from and the provenance it records, the rerun that resumes the
fine-tune, the class remap (exact), another grid height and frame count, freezing (also under DDP),
lr_mult, a world-only run on the source's tokenizer, and the one-line refusals."""

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from wm.checkpoint.files import latest_checkpoint, load
import wm.checkpoint.init_from as I
from wm.checkpoint.run_folder import Run
from wm.config.loading import from_saved, load as load_config
from wm.config.sections import Config, StageConfig
from wm.models.tokenizer import Tokenizer
import wm.training.loop as L
import wm.training.main as T
from wm.training.optim import lr_factor, make_optimizer
from wm.training.stages import TokenizerStage, check_stages
from wm.utils.distributed import Dist
from wm.utils.errors import ConfigError, WMError

from helpers import Proc, Tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")

OCC3D = ("others", "barrier", "bicycle", "bus", "car", "construction_vehicle", "motorcycle", "pedestrian",
         "traffic_cone", "trailer", "truck", "driveable_surface", "other_flat", "sidewalk", "terrain", "manmade",
         "vegetation", "free")  # the tiny data's classes, free = 17
FREE = 17
SRC_TOK_STEPS, SRC_WORLD_STEPS = 3, 2
TOK_LR, MIN_LR = 4e-3, 1e-6  # the tokenizer stage's defaults (wm.config.sections._tokenizer_stage)


# ---------------------------------------------------------------------------------------------
# helpers


def train(args) -> str:
    """wm.training.main.main(args) in this process; its stdout (also echoed, for a failing test's report).
    A refusal raises as in train.py before run_cli prints it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            assert T.main(args) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        sys.stdout.write(buf.getvalue())
    return buf.getvalue()


def refused(args, exc=WMError) -> str:
    """The one line a refused train.py run says (run_cli prints it as `error: <line>`)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            with pytest.raises(exc) as e:
                T.main(args)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def sets(args) -> list[str]:
    return [v for k, v in zip(args, args[1:]) if k == "--set"]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def final(run_dir: Path, stage: str) -> dict:
    path = latest_checkpoint(run_dir / stage / "checkpoints")
    assert path is not None, f"no {stage} checkpoint in {run_dir}"
    return load(path)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def provenance(path: Path, stage: str, step: int, fingerprint: str, class_names) -> dict:
    """What a fine-tune records of its source checkpoint, computed here from the file itself."""
    return {"path": str(Path(path).resolve()), "sha256": sha256(path), "stage": stage, "step": step,
            "data_fingerprint": fingerprint, "class_names": list(class_names) if class_names else None}


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def flip(path: Path, at: int = 4096) -> None:
    """Damage a file in place (a few bytes in its middle inverted)."""
    b = bytearray(path.read_bytes())
    for i in range(at, at + 8):
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def fake_run(class_names, free_class: int, class_map=None, new_classes="mean"):
    """What class_plan reads of a run: the data's classes and the init section."""
    cfg = Config()
    cfg.init.from_ = "source"
    cfg.init.class_map = class_map or {}
    cfg.init.new_classes = new_classes
    return SimpleNamespace(manifest=SimpleNamespace(info=SimpleNamespace(class_names=tuple(class_names),
                                                                          free_class=free_class)), cfg=cfg)


def tiny_cfg(t: Tiny, **over) -> Config:
    return load_config(None, sets(t.args(**over)))


# ---------------------------------------------------------------------------------------------
# the shared source run


@pytest.fixture(scope="module")
def src(tiny_factory, one_thread):
    """A source run through both stages (tokenizer 3 steps, world 2) on the tiny data set (16x16x4)."""
    t = tiny_factory()
    train(t.args(name="src", train__stages="tokenizer,world", tokenizer_stage__max_steps=SRC_TOK_STEPS,
                 world_stage__max_steps=SRC_WORLD_STEPS))
    d = t.run_dir(name="src")
    tok, world = d / "tokenizer" / "checkpoints" / "best.pt", d / "world" / "checkpoints" / "best.pt"
    tst, wst = load(tok), load(world)
    assert tst["step"] == SRC_TOK_STEPS and wst["step"] == SRC_WORLD_STEPS
    assert tuple(tst["class_names"]) == OCC3D and tst["init"] is None
    fp = json.loads((d / "config.json").read_text())["meta"]["data_fingerprint"]
    assert tst["data_fingerprint"] == wst["data_fingerprint"] == fp
    return SimpleNamespace(t=t, dir=d, tok=tok, world=world, tst=tst, wst=wst, fp=fp,
                           tok_prov=provenance(tok, "tokenizer", SRC_TOK_STEPS, fp, OCC3D),
                           world_prov=provenance(world, "world", SRC_WORLD_STEPS, fp, None))


@pytest.fixture(scope="module")
def z8(tmp_path_factory):
    """A second tiny data set, 8 voxels high (the source's is 4)."""
    from wm.data.synthetic.generate import write_synthetic

    folder = tmp_path_factory.mktemp("z8") / "data"
    write_synthetic(folder, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 8))
    return folder


def renamed_data(src, folder: Path, rename: dict) -> Path:
    """A copy of the source's data set whose manifest names some classes otherwise."""
    shutil.copytree(src.t.data, folder)
    m = json.loads((folder / "manifest.json").read_text())
    m["class_names"] = [rename.get(n, n) for n in m["class_names"]]
    (folder / "manifest.json").write_text(json.dumps(m, indent=1))
    return folder


# ---------------------------------------------------------------------------------------------
# 1. init, not resume: the weights it starts from, what it records, the rerun that resumes it


def test_a_fresh_init_starts_from_the_source_weights_with_an_empty_optimizer(src):
    t = src.t
    cfg = tiny_cfg(t, name="step0", init__from=str(src.dir))
    run = Run(cfg, Dist())
    try:
        check_stages(run)
        assert set(run.init_plan.sources) == {"tokenizer"} and run.init_plan.tokenizer is None
        stage = TokenizerStage(run)
        rep, mine, theirs = stage.init.report, stage.model.state_dict(), src.tst["model"]
        # every tensor but the class rows (remapped, here by name onto themselves) and the codes' ages
        assert set(rep["loaded"]) == set(theirs) - {"class_embed.weight", "quantizer.code_age"}
        for k in theirs:
            if k != "quantizer.code_age":
                assert torch.equal(mine[k], theirs[k]), k
        assert theirs["quantizer.code_age"].any(), "the source's codes should have aged"
        assert torch.equal(mine["quantizer.code_age"], torch.zeros(16, dtype=torch.int64))
        assert rep["restarted"] == ["quantizer.code_age"]
        assert rep["reinitialised"] == rep["not_in_source"] == rep["unused"] == [] and rep["reinit_share"] == 0
        (remap,) = rep["remapped"]
        assert remap["name"] == "class_embed.weight" and remap["from"] == remap["to"] == [18, 8]
        assert [(c["class"], c["source"], c["how"]) for c in remap["classes"]] == \
            [(i, i, "name") for i in range(17)] + [(17, 17, "free")]
        # weights only: no optimizer state, step 0, the data order at its start
        lp = L.StageLoop(run, stage, torch.device("cpu"), None)
        lp.resume()
        assert lp.resumed is None and lp.step == 0 and lp.best is None
        assert len(lp.opt.state) == 0
        assert (lp.sampler.epoch, lp.sampler.consumed) == (0, 0)
        assert lp.ckpt.last_path is None and latest_checkpoint(run.stage_dir("tokenizer") / "checkpoints") is None
    finally:
        run.log.close()
        run.close()


@pytest.fixture(scope="module")
def ft(src):
    """A fine-tune of both stages from the source (2 + 2 steps)."""
    out = train(src.t.args(name="ft", train__stages="tokenizer,world", init__from=str(src.dir),
                           tokenizer_stage__max_steps=2, world_stage__max_steps=2))
    return SimpleNamespace(dir=src.t.run_dir(name="ft"), out=out)


def test_the_fine_tune_records_its_sources_everywhere(src, ft):
    d = ft.dir
    # the init report, printed and saved, once per stage
    assert ft.out.count("tokenizer: init from ") == 1 and ft.out.count("world: init from ") == 1
    assert f"tokenizer: init from {src.tok} (sha256 {src.tok_prov['sha256'][:12]}, step {SRC_TOK_STEPS}, data " \
           f"{src.fp[:12]}); weights only, optimizer and schedule start fresh" in ft.out
    tok_rep = json.loads((d / "tokenizer" / "init_report.json").read_text())
    world_rep = json.loads((d / "world" / "init_report.json").read_text())
    assert tok_rep["source"] == src.tok_prov and world_rep["source"] == src.world_prov
    assert set(world_rep["loaded"]) == set(src.wst["model"]) and world_rep["reinit_share"] == 0
    # every checkpoint carries the provenance: path, the file's sha256, its data and classes
    for stage, prov in (("tokenizer", src.tok_prov), ("world", src.world_prov)):
        st = final(d, stage)
        assert st["step"] == 2 and st["init"] == prov, stage
        # a fresh optimizer and sampler: 2 steps of their own (the source's 3 do not carry over)
        steps = {float(s["step"]) for s in st["optimizer"]["state"].values()}
        assert steps == {2.0}, (stage, steps)
        assert st["sampler"]["consumed"] == 4 and st["sampler"]["epoch"] == 0
    assert final(d, "tokenizer")["class_names"] == list(OCC3D)
    # config.json's meta and summary.json name the sources
    meta = json.loads((d / "config.json").read_text())["meta"]
    assert meta["init"] == {"tokenizer": src.tok_prov, "world": src.world_prov}
    summary = json.loads((d / "summary.json").read_text())
    assert summary["init"] == meta["init"]
    # one "<stage>/before" record at step 0 per initialised stage: the source model on this data
    before = [r for r in records(d) if r["kind"].endswith("/before")]
    assert [(r["kind"], r["step"]) for r in before] == [("tokenizer/before", 0), ("world/before", 0)]
    tb = json.loads((d / "tokenizer" / "before.json").read_text())
    assert tb["step"] == 0 and tb["source"] == src.tok_prov
    # the same weights on the same validation frames: the source's own last validation, exactly
    src_val = json.loads((src.dir / "tokenizer" / "done.json").read_text())["metrics"]
    for k in ("val/iou", "val/miou", "val/code_usage", "val/perplexity"):
        assert tb["metrics"][k] == src_val[k] == before[0][k], k
    assert summary["before"]["tokenizer"]["recon_miou"] == src_val["val/miou"]
    assert summary["before"]["tokenizer"]["recon_iou"] == src_val["val/iou"]
    wb = json.loads((d / "world" / "before.json").read_text())["metrics"]
    assert summary["before"]["world"]["miou_avg"] == wb["val/miou"] == before[1]["val/miou"]
    assert summary["before"]["world"]["iou"] == [wb["val/iou_t1"], wb["val/iou_t2"]]
    assert "tokenizer reconstruction (val) before fine-tuning: IoU " in ft.out
    assert re.search(r"^before +\d", ft.out, re.M), ft.out


def test_rerunning_the_command_resumes_the_fine_tune_and_does_not_init_again(src, tmp_path):
    # a private copy of the source: moved away before the rerun, which must not need it
    own = tmp_path / "source"
    shutil.copytree(src.dir, own)
    t = src.t
    args = dict(out=str(tmp_path / "runs"), name="again", init__from=str(own))
    out = train(t.args(**args, tokenizer_stage__max_steps=2, world_stage__max_steps=2))
    d = tmp_path / "runs" / "again"
    prov = provenance(own / "tokenizer" / "checkpoints" / "best.pt", "tokenizer", SRC_TOK_STEPS, src.fp, OCC3D)
    assert out.count("tokenizer: init from ") == 1 and final(d, "tokenizer")["init"] == prov
    report, before = d / "tokenizer" / "init_report.json", d / "tokenizer" / "before.json"
    kept = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (report, before)}
    os.replace(own, tmp_path / "source.moved")

    out = train(t.args(**args, tokenizer_stage__max_steps=3, world_stage__max_steps=3,
                       flags=["--allow-changed", "tokenizer_stage.max_steps,world_stage.max_steps"]))
    assert "tokenizer: resumed from " in out and "step_000000002.pt at step 2/3" in out, out
    assert "init from" not in out and "before fine-tuning" not in out.split("\nrun ")[0], out
    for p, (b, mtime) in kept.items():
        assert p.read_bytes() == b and p.stat().st_mtime_ns == mtime, p
    st = final(d, "tokenizer")
    assert st["step"] == 3 and st["init"] == prov  # still names its source
    assert {float(s["step"]) for s in st["optimizer"]["state"].values()} == {3.0}
    assert [r["step"] for r in records(d) if r["kind"] == "tokenizer/before"] == [0]
    meta = json.loads((d / "config.json").read_text())["meta"]
    assert meta["init"] == {"tokenizer": prov}
    assert json.loads((d / "summary.json").read_text())["init"] == {"tokenizer": prov}


def test_a_world_stage_started_over_after_its_tokenizer_went_on_is_initialised_from_the_source_again(src, tmp_path):
    # both stages fine-tuned; the tokenizer stage then goes on, its best changes, so the world stage's
    # checkpoints are moved aside and it starts over: it has no checkpoint of its own again, so init.from
    # applies to it as at the first start (not a world model from scratch under a record naming the source)
    t = src.t
    args = dict(out=str(tmp_path / "runs"), name="over", train__stages="tokenizer,world", init__from=str(src.dir),
                world_stage__max_steps=2)
    train(t.args(**args, tokenizer_stage__max_steps=1))
    d = tmp_path / "runs" / "over"
    assert final(d, "world")["init"] == src.world_prov
    out = train(t.args(**args, tokenizer_stage__max_steps=3, flags=["--allow-changed", "tokenizer_stage.max_steps"]))
    assert "the world stage starts over" in out, "the tokenizer's best was meant to change: " + out
    assert json.loads((d / "config.json").read_text())["meta"]["init"]["world"] == src.world_prov
    assert "world: init from " in out, out
    assert final(d, "world")["init"] == src.world_prov
    assert json.loads((d / "world" / "init_report.json").read_text())["source"] == src.world_prov


# ---------------------------------------------------------------------------------------------
# 2. classes: remapped row by row, exactly


def source_tokenizer(src):
    s = I.find_source(str(src.dir), "tokenizer", say=lambda *a: None)
    assert s.path == src.tok and s.class_names == OCC3D
    m = Tokenizer(from_saved(s.state["config"]).tokenizer, 18, (16, 16, 4))
    m.load_state_dict(s.state["model"])
    return s, m.eval()


def target_tokenizer(src_cfg, num_classes: int) -> Tokenizer:
    torch.manual_seed(0)
    return Tokenizer(src_cfg.tokenizer, num_classes, (16, 16, 4))


@pytest.mark.parametrize("renamed", [False, True], ids=["permuted-names", "renamed-with-class-map"])
def test_a_permuted_class_set_decodes_to_exactly_the_source_logits_of_each_mapped_class(src, renamed):
    s, source = source_tokenizer(src)
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(17, generator=g).tolist()  # the non-free classes, in another order
    # this data's classes: free first (id 0, the source's is 17), then the others permuted
    names = ["void" if renamed else "free"] + [f"my_{OCC3D[i]}" if renamed else OCC3D[i] for i in order]
    cmap = {n: OCC3D[a] for n, a in zip(names, [FREE] + order)} if renamed else {}
    run = fake_run(names, 0, cmap)
    rows = I.class_plan(run, s)
    want_src = [FREE] + order  # this data's class t <- the source's class want_src[t]
    assert [(ti, si) for ti, si, _ in rows] == list(enumerate(want_src))
    assert [how for _, _, how in rows] == (["map"] * 18 if renamed else ["free"] + ["name"] * 17)
    target = target_tokenizer(from_saved(s.state["config"]), 18)
    state, rep = I.build_state(target, s, rows, "mean")
    target.load_state_dict(state)
    target.eval()
    assert rep["reinit_share"] == 0 and rep["restarted"] == ["quantizer.code_age"]
    # the same scenes in this data's labels: source class a is this data's class t
    occ = torch.randint(0, 18, (3, 16, 16, 4), generator=g, dtype=torch.uint8)
    occ[0, :8] = FREE  # plenty of free space, as in real frames
    to_target = torch.empty(18, dtype=torch.long)
    to_target[torch.tensor(want_src)] = torch.arange(18)
    relabelled = to_target[occ.long()].to(torch.uint8)
    with torch.no_grad():
        a, b = source(occ), target(relabelled)
    assert torch.equal(b["codes"], a["codes"])
    assert torch.equal(b["logits"], a["logits"][:, want_src])  # every class t: the source's logits of its class
    assert torch.equal(b["logits"].argmax(1), to_target[a["logits"].argmax(1)])


def test_a_class_map_naming_an_unknown_class_is_refused_in_one_line_listing_both_sides(src):
    s, _ = source_tokenizer(src)
    mine = list(OCC3D[:3]) + ["aircraft"] + list(OCC3D[4:])
    for cmap, bad in (({"helicopter": "bus"}, "'helicopter' is not a class of this run's data"),
                      ({"aircraft": "airplane"}, "'airplane' is not a class of the source")):
        with pytest.raises(ConfigError) as e:
            I.class_plan(fake_run(mine, FREE, cmap), s)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config key 'init.class_map': ") and bad in msg, msg
        assert ", ".join(mine) in msg and ", ".join(OCC3D) in msg, msg  # the valid names, both sides
        assert e.value.key == "init.class_map"
    # free maps to free and nothing else does
    with pytest.raises(ConfigError, match="the free class maps to the source's free class"):
        I.class_plan(fake_run(mine, FREE, {"aircraft": "free"}), s)


def test_a_class_without_a_source_class_starts_as_the_mean_of_the_sources_others_or_fresh(src):
    s, _ = source_tokenizer(src)
    w = s.state["model"]["class_embed.weight"].double()  # (18, 8), free = 17
    mine = list(OCC3D[:17]) + ["aircraft", "free"]  # a new class before free: 19 classes, free = 18
    rows = I.class_plan(fake_run(mine, 18), s)
    assert rows == [(i, i, "name") for i in range(17)] + [(17, None, "new"), (18, FREE, "free")]
    cfg = from_saved(s.state["config"])
    for rule in ("mean", "fresh"):
        target = target_tokenizer(cfg, 19)
        own = target.class_embed.weight.detach().clone()
        state, rep = I.build_state(target, s, rows, rule)
        got = state["class_embed.weight"]
        assert got.shape == (19, 8) and got.dtype == torch.float32
        assert torch.equal(got[:17], s.state["model"]["class_embed.weight"][:17])
        assert torch.equal(got[18], s.state["model"]["class_embed.weight"][FREE])
        if rule == "mean":  # the 17 non-free source rows, summed by hand
            by_hand = (w.sum(0) - w[FREE]) / 17
            assert torch.allclose(got[17].double(), by_hand, rtol=0, atol=1e-6), (got[17], by_hand)
            assert not torch.allclose(got[17], own[17])
        else:
            assert torch.equal(got[17], own[17])  # the new model's own initial row
        (remap,) = rep["remapped"]
        assert remap["from"] == [18, 8] and remap["to"] == [19, 8]
        assert remap["classes"][17] == {"class": 17, "source": None, "how": "new"}
        total = sum(v.numel() for k, v in target.state_dict().items() if k != "quantizer.code_age")
        assert rep["reinit_share"] == 8 / total  # one row of 8 from scratch, either way
        target.load_state_dict(state)


def test_a_source_checkpoint_without_class_names_takes_them_from_its_runs_data_manifest(src, tmp_path):
    # checkpoints saved before they recorded their classes: the source run's config.json names its data
    own = tmp_path / "old"
    shutil.copytree(src.dir, own)
    st = load(own / "tokenizer" / "checkpoints" / "best.pt")
    del st["class_names"]
    old = own / "tokenizer" / "checkpoints" / "old.pt"
    torch.save(st, old)
    s = I.find_source(str(old), "tokenizer", say=lambda *a: None)
    assert s.path == old and s.class_names == OCC3D
    assert I.class_plan(fake_run(OCC3D, FREE), s) == [(i, i, "name") for i in range(17)] + [(17, 17, "free")]
    meta = json.loads((own / "config.json").read_text())
    meta["meta"]["data_root"] = str(tmp_path / "gone")
    (own / "config.json").write_text(json.dumps(meta))
    s = I.find_source(str(old), "tokenizer", say=lambda *a: None)
    assert s.class_names is None
    with pytest.raises(WMError) as e:
        I.class_plan(fake_run(OCC3D, FREE), s)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"init.from: cannot tell which classes {old} was trained on"), msg


# ---------------------------------------------------------------------------------------------
# 3. another grid height, another frame count, another model size


def test_another_grid_height_reinitialises_exactly_the_first_and_last_convolutions(src, z8, tmp_path):
    t = src.t
    out = train(t.args(out=str(tmp_path / "runs"), name="z8", init__from=str(src.dir), data__root=str(z8),
                       data__grid="16,16,8", tokenizer_stage__max_steps=1))
    d = tmp_path / "runs" / "z8"
    rep = json.loads((d / "tokenizer" / "init_report.json").read_text())
    # Z * embed_dim input channels: 4 * 8 = 32 in the source, 8 * 8 = 64 here; widths[0] = 8
    assert rep["reinitialised"] == [{"name": "enc_in.weight", "from": [8, 32, 3, 3], "to": [8, 64, 3, 3]},
                                    {"name": "dec_out.weight", "from": [32, 8, 3, 3], "to": [64, 8, 3, 3]},
                                    {"name": "dec_out.bias", "from": [32], "to": [64]}]
    assert set(rep["loaded"]) == set(src.tst["model"]) - {"enc_in.weight", "dec_out.weight", "dec_out.bias",
                                                          "class_embed.weight", "quantizer.code_age"}
    assert "enc_in.bias" in rep["loaded"] and rep["not_in_source"] == rep["unused"] == []
    total = sum(v.numel() for k, v in final(d, "tokenizer")["model"].items() if k != "quantizer.code_age")
    assert rep["reinit_share"] == (8 * 64 * 9 + 64 * 8 * 9 + 64) / total
    assert "re-initialised (shape changed): enc_in.weight [8, 32, 3, 3] -> [8, 64, 3, 3], dec_out.weight " \
           "[32, 8, 3, 3] -> [64, 8, 3, 3], dec_out.bias [32] -> [64]" in out
    assert f"{100 * rep['reinit_share']:.1f} % of the model's values start from scratch" in out
    assert final(d, "tokenizer")["init"]["sha256"] == src.tok_prov["sha256"]


def test_another_max_frames_reinitialises_exactly_the_frame_embeddings(src, tmp_path):
    out = train(src.t.args(out=str(tmp_path / "runs"), name="frames", train__stages="world", world__max_frames=8,
                           init__from=str(src.dir), world_stage__max_steps=1))
    rep = json.loads((tmp_path / "runs" / "frames" / "world" / "init_report.json").read_text())
    assert rep["reinitialised"] == [{"name": "frame_embed", "from": [16, 8], "to": [8, 8]},
                                    {"name": "pose_frame_embed", "from": [16, 8], "to": [8, 8]}]
    assert set(rep["loaded"]) == set(src.wst["model"]) - {"frame_embed", "pose_frame_embed"}
    assert rep["source"] == src.world_prov
    assert "re-initialised (shape changed): frame_embed [16, 8] -> [8, 8], pose_frame_embed [16, 8] -> [8, 8]" in out


@pytest.mark.parametrize("key,value,theirs,mine", [("tokenizer.widths", "8,8,16", "[8, 8, 8]", "[8, 8, 16]"),
                                                   ("world.widths", "8,24", "[8, 16]", "[8, 24]")])
def test_another_model_size_is_refused_in_one_line_naming_the_key(src, tmp_path, key, value, theirs, mine):
    over = {key.replace(".", "__"): value}
    msg = refused(src.t.args(out=str(tmp_path / "runs"), train__stages="tokenizer,world", init__from=str(src.dir),
                             **over))
    stage = key.split(".")[0]
    assert msg.startswith(f"init.from: {src.dir / stage / 'checkpoints' / 'best.pt'} "), msg
    assert f"{key}={theirs}" in msg and mine in msg.split(f"{key}={theirs}", 1)[1], msg
    assert latest_checkpoint(tmp_path / "runs" / "r" / "tokenizer" / "checkpoints") is None  # before any step


# ---------------------------------------------------------------------------------------------
# 4. freezing


FROZEN = ("encoder", "quantizer")


def test_frozen_modules_stay_bitwise_as_loaded_and_the_rest_trains(src, tmp_path):
    out = train(src.t.args(out=str(tmp_path / "runs"), name="frozen", init__from=str(src.dir),
                           tokenizer_stage__max_steps=3, tokenizer_stage__freeze=",".join(FROZEN)))
    st = final(tmp_path / "runs" / "frozen", "tokenizer")
    assert st["step"] == 3
    theirs = src.tst["model"]
    model = Tokenizer(from_saved(st["config"]).tokenizer, 18, (16, 16, 4))
    names = [n for n, _ in model.named_parameters()]
    frozen = [n for n in names if under(n, FROZEN)]
    assert "quantizer.codebook.weight" in frozen and any(n.startswith("encoder.") for n in frozen)
    assert not any(n.startswith(("enc_in", "enc_out", "enc_norm")) for n in frozen)  # prefixes, not substrings
    for n in names:
        same = torch.equal(st["model"][n], theirs[n])
        assert same == (n in frozen), f"{n}: {'unchanged' if same else 'changed'}"
    # the optimizer holds the trainable parameters only
    assert sum(len(g["params"]) for g in st["optimizer"]["param_groups"]) == len(names) - len(frozen)
    n_frozen = sum(p.numel() for n, p in model.named_parameters() if n in frozen)
    n_all = sum(p.numel() for p in model.parameters())
    assert 0 < n_frozen < n_all
    line = (f"tokenizer: {(n_all - n_frozen) / 1e6:.2f} M parameters trainable, {n_frozen / 1e6:.2f} M frozen "
            "(encoder, quantizer)")
    assert line in out.splitlines(), out


def test_freeze_is_refused_on_a_scratch_run_on_a_reinitialised_tensor_and_for_an_unknown_module(src, z8, tmp_path):
    t = src.t
    runs = str(tmp_path / "runs")
    msg = refused(t.args(out=runs, name="scratch", tokenizer_stage__freeze="encoder"), ConfigError)
    assert msg.startswith("config key 'tokenizer_stage.freeze': ") and "not initialised from a source" in msg, msg
    msg = refused(t.args(out=runs, name="z", init__from=str(src.dir), data__root=str(z8), data__grid="16,16,8",
                         tokenizer_stage__freeze="enc_in"), ConfigError)
    assert msg.startswith("config key 'tokenizer_stage.freeze': enc_in.weight is frozen but was re-initialised"), msg
    msg = refused(t.args(out=runs, name="typo", init__from=str(src.dir), tokenizer_stage__freeze="encoders"),
                  ConfigError)
    assert msg.startswith("config key 'tokenizer_stage.freeze': 'encoders' names no parameter of the tokenizer "
                          "model"), msg
    assert "(its modules: class_embed, dec_in, dec_norm, dec_out, decoder, enc_in, enc_norm, enc_out, encoder, " \
           "quantizer)" in msg, msg
    msg = refused(t.args(out=runs, name="mult", init__from=str(src.dir), tokenizer_stage__lr_mult='{"decoders": 0.1}'),
                  ConfigError)
    assert msg.startswith("config key 'tokenizer_stage.lr_mult': 'decoders' names no parameter of the tokenizer "
                          "model (its modules: class_embed, "), msg
    # a class row that has no source class is not loaded either
    data = renamed_data(src, tmp_path / "data", {"bus": "airport_bus"})
    msg = refused(t.args(out=runs, name="rows", init__from=str(src.dir), data__root=str(data),
                         tokenizer_stage__freeze="class_embed"), ConfigError)
    assert msg.startswith("config key 'tokenizer_stage.freeze': class_embed.weight is frozen but was "
                          "re-initialised"), msg
    with pytest.raises(ConfigError, match=r"^config key 'tokenizer_stage.lr_mult': 'decoder': 0.0 must be > 0"):
        load_config(None, ['tokenizer_stage.lr_mult={"decoder": 0}'])
    for name in ("scratch", "z", "typo", "mult", "rows"):
        assert latest_checkpoint(tmp_path / "runs" / name / "tokenizer" / "checkpoints") is None, name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_frozen_modules_stay_bitwise_under_ddp_on_two_ranks(src, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "train.py"] + src.t.args(
        out=str(tmp_path / "runs"), name="ddp", init__from=str(src.dir), tokenizer_stage__max_steps=2,
        tokenizer_stage__freeze="encoder,quantizer", ddp__timeout_s=60)
    p = Proc(cmd)
    assert p.finish(240) == 0, p.output
    assert "2 steps of 4 samples" in p.output and p.output.count("tokenizer: init from ") == 1, p.output
    st = final(tmp_path / "runs" / "ddp", "tokenizer")
    assert st["step"] == 2 and len(st["rng"]) == 2 and st["init"] == src.tok_prov
    theirs = src.tst["model"]
    names = [n for n in theirs if n not in ("quantizer.code_age",)]
    for n in names:
        same = torch.equal(st["model"][n], theirs[n])
        assert same == under(n, FROZEN), f"{n}: {'unchanged' if same else 'changed'}"


# ---------------------------------------------------------------------------------------------
# 5. lr_mult


def test_lr_mult_groups_and_the_schedule_keeps_the_ratio(src, tmp_path):
    cfg = from_saved(src.tst["config"])
    model = Tokenizer(cfg.tokenizer, 18, (16, 16, 4))
    s = StageConfig(lr=TOK_LR, min_lr=MIN_LR, weight_decay=0.01, lr_mult={"decoder": 0.1, "decoder.0": 0.5})
    opt = make_optimizer(model, s, torch.device("cpu"))
    name = {id(p): n for n, p in model.named_parameters()}
    seen = []
    for g in opt.param_groups:
        for p in g["params"]:
            n = name[id(p)]
            seen.append(n)
            want = 0.5 if n.startswith("decoder.0.") else 0.1 if n.startswith("decoder.") else 1.0  # longest prefix
            assert g["lr_mult"] == want, n
            assert g["weight_decay"] == (0.01 if p.ndim >= 2 else 0.0), n
            assert g["lr"] == TOK_LR
    assert sorted(seen) == sorted(name.values())  # each trainable parameter once
    assert [(g["weight_decay"] > 0, g["lr_mult"]) for g in opt.param_groups] == \
        [(True, 1.0), (True, 0.1), (True, 0.5), (False, 1.0), (False, 0.1), (False, 0.5)]

    # the loop: 4 steps, warm-up 2; the last step's lr is lr * (cosine at step 3 of 4) * the multiplier
    train(src.t.args(out=str(tmp_path / "runs"), name="mult", init__from=str(src.dir), tokenizer_stage__max_steps=4,
                     tokenizer_stage__lr_mult='{"decoder": 0.1}'))
    d = tmp_path / "runs" / "mult"
    st = final(d, "tokenizer")
    base = TOK_LR * (MIN_LR / TOK_LR + (1 - MIN_LR / TOK_LR) * 0.5 * (1 + math.cos(math.pi * 0.5)))  # 2.0005e-3
    assert base == pytest.approx(2.0005e-3, rel=1e-12)
    assert lr_factor(3, 4, from_saved(st["config"]).tokenizer_stage) == pytest.approx(base / TOK_LR, rel=1e-12)
    groups = st["optimizer"]["param_groups"]
    assert [g["lr_mult"] for g in groups] == [1.0, 0.1, 1.0, 0.1]
    for g in groups:
        assert g["lr"] == pytest.approx(base * g["lr_mult"], rel=1e-12), g["lr_mult"]
    assert groups[1]["lr"] / groups[0]["lr"] == pytest.approx(0.1, rel=1e-12)
    # which parameters: the decoder's, by the optimizer's own order
    ref = make_optimizer(model, from_saved(st["config"]).tokenizer_stage, torch.device("cpu"))
    order = [name[id(p)] for g in ref.param_groups for p in g["params"]]
    for g in groups:
        assert all(order[i].startswith("decoder.") == (g["lr_mult"] == 0.1) for i in g["params"])
    lrs = [r["train/lr"] for r in records(d) if r["kind"] == "tokenizer/train"]
    assert lrs[-1] == pytest.approx(base, rel=1e-12)  # the log's lr is the schedule's, before multipliers


# ---------------------------------------------------------------------------------------------
# 6. a world-only run on the source's tokenizer


def test_a_world_only_run_reuses_the_source_tokenizer_and_export_loads_it(src, tmp_path):
    from wm.checkpoint.trained import load_trained

    out = train(src.t.args(out=str(tmp_path / "runs"), name="world", train__stages="world", init__from=str(src.dir),
                           world_stage__max_steps=2))
    d = tmp_path / "runs" / "world"
    tok = d / "tokenizer" / "checkpoints" / "step_000000000.pt"
    assert tok.is_file(), out
    tst = load(tok)
    assert tst["stage"] == "tokenizer" and tst["step"] == 0 and tst["init"] == src.tok_prov
    theirs = src.tst["model"]
    assert set(tst["model"]) == set(theirs)
    for k, v in theirs.items():
        if k == "quantizer.code_age":
            assert torch.equal(tst["model"][k], torch.zeros_like(v))
        else:
            assert torch.equal(tst["model"][k], v), k
    # the world stage trained, on this tokenizer
    wst = final(d, "world")
    assert wst["step"] == 2 and wst["init"] == src.world_prov
    assert wst["tokenizer"]["sha256"] == sha256(tok)
    assert not all(torch.equal(wst["model"][k], v) for k, v in src.wst["model"].items())
    assert (d / "world" / "done.json").is_file() and not (d / "tokenizer" / "done.json").exists()
    # the source's world model on its own tokenizer and validation: the source's last validation, exactly
    wb = json.loads((d / "world" / "before.json").read_text())["metrics"]
    src_val = json.loads((src.dir / "world" / "done.json").read_text())["metrics"]
    assert wb["val/miou"] == src_val["val/miou"] and wb["val/iou"] == src_val["val/iou"]
    tr = load_trained(d)
    assert tr.tokenizer_ckpt == tok and tr.init == {"tokenizer": src.tok_prov, "world": src.world_prov}
    for k, v in tst["model"].items():
        assert torch.equal(tr.tokenizer.state_dict()[k], v), k


def test_a_world_only_run_whose_classes_the_source_tokenizer_lacks_is_refused_in_one_line(src, tmp_path):
    data = renamed_data(src, tmp_path / "data", {"bus": "airport_bus"})
    msg = refused(src.t.args(out=str(tmp_path / "runs"), train__stages="world", init__from=str(src.dir),
                             data__root=str(data)))
    assert msg.startswith("init: train.stages=['world'] takes the source's tokenizer as it is, but classes "
                          "['airport_bus'] have no source class;") and "init.class_map" in msg, msg
    assert not (tmp_path / "runs" / "r" / "tokenizer" / "checkpoints").exists()
    # mapped, it runs (the class rows from the source's bus)
    train(src.t.args(out=str(tmp_path / "runs"), name="mapped", train__stages="world", init__from=str(src.dir),
                     data__root=str(data), init__class_map='{"airport_bus": "bus"}', world_stage__max_steps=1))
    tst = load(tmp_path / "runs" / "mapped" / "tokenizer" / "checkpoints" / "step_000000000.pt")
    assert torch.equal(tst["model"]["class_embed.weight"], src.tst["model"]["class_embed.weight"])
    assert tst["class_names"][3] == "airport_bus"


# ---------------------------------------------------------------------------------------------
# 7. refusals, each one line


def test_a_damaged_best_checkpoint_falls_back_to_the_newest_valid_one_and_all_damaged_is_refused(src, tmp_path):
    own = tmp_path / "source"
    shutil.copytree(src.dir, own)  # best.pt and step_3.pt become two files (in the source, one hard link)
    ck = own / "tokenizer" / "checkpoints"
    step = ck / "step_000000003.pt"
    assert (ck / "best.pt").read_bytes() == step.read_bytes() and not os.path.samefile(ck / "best.pt", step)
    flip(ck / "best.pt")
    runs = str(tmp_path / "runs")
    out = train(src.t.args(out=runs, name="fallback", init__from=str(own), tokenizer_stage__max_steps=1))
    assert f"warning: skipped {ck / 'best.pt'}: it is truncated or corrupt (its sha256 is " in out, out
    rep = json.loads((tmp_path / "runs" / "fallback" / "tokenizer" / "init_report.json").read_text())
    assert rep["source"] == provenance(step, "tokenizer", SRC_TOK_STEPS, src.fp, OCC3D)
    assert final(tmp_path / "runs" / "fallback", "tokenizer")["init"]["path"] == str(step.resolve())

    flip(step)  # now every checkpoint of the folder is damaged: refused, never a start from scratch
    msg = refused(src.t.args(out=runs, name="none", init__from=str(own)))
    assert msg.startswith(f"init.from: no valid checkpoint in {ck}: best.pt is truncated or corrupt"), msg
    assert "step_000000003.pt is truncated or corrupt" in msg, msg
    assert not (tmp_path / "runs" / "none" / "tokenizer").exists()
    # one damaged checkpoint file named directly
    msg = refused(src.t.args(out=runs, name="file", init__from=str(step)))
    assert msg.startswith(f"init.from: checkpoint {step} is truncated or corrupt"), msg


def test_refusals_before_the_first_step_are_one_line_naming_the_path_or_key(src, tmp_path):
    t, runs = src.t, str(tmp_path / "runs")
    nowhere = tmp_path / "no" / "such_run"
    msg = refused(t.args(out=runs, name="a", init__from=str(nowhere)))
    assert msg == f"init.from: {nowhere} does not exist; give a run folder (runs/<name>) or one checkpoint file"

    tok_only = tmp_path / "tok_only"
    shutil.copytree(src.dir, tok_only, ignore=shutil.ignore_patterns("world"))
    msg = refused(t.args(out=runs, name="b", train__stages="tokenizer,world", init__from=str(tok_only),
                         init__stages="world"))
    assert msg.startswith(f"init.from: {tok_only} has no world checkpoint ({tok_only / 'world' / 'checkpoints'}), "
                          "but init.stages names world;"), msg

    bad = tmp_path / "classes.json"
    bad.write_text('{"bus": "bus",')
    cfg = tiny_cfg(t, init__from=str(src.dir), init__class_map=str(bad))
    assert cfg.init.class_map == str(bad)  # a path on the command line stays a path
    msg = refused(t.args(out=runs, name="c", init__from=str(src.dir), init__class_map=str(bad)), ConfigError)
    assert msg.startswith(f"config key 'init.class_map': {bad} is not valid JSON ("), msg
    for name in "abc":
        assert latest_checkpoint(tmp_path / "runs" / name / "tokenizer" / "checkpoints") is None, name
