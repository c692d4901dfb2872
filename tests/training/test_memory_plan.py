"""The memory plan (wm/training/memory_plan.py): its model-state bytes against a hand count, its activations
against what the same step allocates on real tensors, the refusal of a config no machine holds
before anything runs, the demo let through, and the first step's line beside it. Also
tools/gpu_check.py on a machine without a GPU: one line at once, nothing checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TINY_SETTINGS
from wm.config.loading import load
from wm.config.sections import model_options
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.training import activations as A, memory_plan as M
from wm.training.optim import make_optimizer
from wm.utils.errors import ConfigError
from wm.utils.precision import autocast

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
GIB = 2**30

# one level of width 4, no attention, one voxel of height and embedding, 2 classes, 2 codes of 1 value
SMALL = ["tokenizer.widths=[4]", "tokenizer.embed_dim=1", "tokenizer.lowest_attention=false",
         "tokenizer.mid_attention=false", "tokenizer.codebook_size=2", "tokenizer.code_dim=1", "data.grid=4,4,1",
         "data.num_classes=2", "data.free_class=1", "train.stages=tokenizer"]


def tiny(*extra: str):
    return load(None, [f"{k}={v}" for k, v in TINY_SETTINGS.items()] + list(extra))


def test_weights_grads_and_adamw_state_against_a_hand_count():
    cfg = load(None, SMALL)
    # parameters: class embedding 2x1; conv in 1->4 3x3: 36+4; a ResBlock(4, 4): two GroupNorms of 4+4 and
    # two 4->4 3x3 convs of 144+4 = 312, three in the encoder (one at the level, two in the middle) and
    # three in the decoder; encoder norm 8, conv out 4->1: 36+1; codebook 2x1; decoder conv in 1->4: 36+4;
    # decoder norm 8, conv out 4->1: 36+1
    numel = 2 + 40 + 3 * 312 + 8 + 37 + 2 + 40 + 3 * 312 + 8 + 37
    tensors = 1 + 2 + 3 * 8 + 2 + 2 + 1 + 2 + 3 * 8 + 2 + 2  # AdamW keeps a step count per parameter tensor
    assert numel == 2046
    s = M.stage_plan(cfg, "tokenizer", 1, CPU, None)
    buffers = 2 * 8 + 2 * 4  # code_age int64 (2 codes), class_weights float32 (2 classes)
    assert s.weights == 4 * numel + buffers
    assert s.grads == 4 * numel
    assert s.optimizer == 2 * 4 * numel + 4 * tensors
    # and torch's own AdamW after a step holds exactly that
    model = Tokenizer(cfg.tokenizer, 2, (4, 4, 1), **model_options(cfg, "tokenizer"))
    assert sum(p.numel() for p in model.parameters()) == numel
    opt = make_optimizer(model, cfg.tokenizer_stage, CPU)
    model(torch.zeros(2, 4, 4, 1, dtype=torch.uint8), logits=False)["loss"].backward()
    opt.step()
    assert sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()) == s.optimizer


def real_peak(cfg, name: str, micro: int, dtype=None, every=None) -> int:
    """The step measure_step plans, on real CPU tensors, counted by the same PeakBytes."""
    opts = model_options(cfg, name)
    if every is not None:
        opts["checkpoint_every"] = every
    torch.manual_seed(0)
    if name == "tokenizer":
        model = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **opts)
    else:
        model = WorldModel(cfg.world, cfg.tokenizer.codebook_size, **opts)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    batch = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in A.batch_shapes(cfg, name, micro).items()}
    held = [*model.parameters(), *model.buffers(), *(p.grad for p in params), *batch.values()]
    with A.PeakBytes(held) as peak:
        with autocast(CPU, dtype):
            out = A._loss(name, model, batch)
        out["loss"].backward()
    return peak.peak


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32-meta", "bf16-fake"])
@pytest.mark.parametrize("name", ["tokenizer", "world"])
def test_activations_are_what_the_real_step_allocates(name, dtype):
    # within a few per cent: meta strides (a GroupNorm's output is NCHW there, NHWC on a CPU) cost a copy
    # the CPU skips, and a CPU kernel's scalar may keep a larger buffer; the attention's math path is more
    cfg = tiny("tokenizer.lovasz_weight=1")
    for every in (0, 1):
        got, real = A.measure_step(cfg, name, 3, CPU, dtype, every), real_peak(cfg, name, 3, dtype, every)
        assert 0.99 * real <= got <= 1.05 * real, (every, got, real)


@pytest.mark.parametrize("name", ["tokenizer", "world"])
def test_activations_scale_with_the_batch_and_drop_with_checkpointing(name):
    cfg = load(None, ["data.grid=32,32,8"])
    a2, a4, a8 = (A.measure_step(cfg, name, n, CPU, None) for n in (2, 4, 8))
    assert 1.8 < a4 / a2 < 2.05 and 1.9 < a8 / a4 < 2.05, (a2, a4, a8)
    assert A.measure_step(cfg, name, 8, CPU, None, every=1) < 0.7 * a8
    s = M.stage_plan(cfg, name, 1, CPU, None)  # the plan's line carries both
    assert s.alt_every == 1 and s.alt_activations < 0.7 * s.activations


def test_a_value_dependent_size_is_planned_at_its_largest():
    # the masked Lovasz selects the visible voxels, at most all of them; the histogram's bincount its bins
    cfg = tiny("data.use_mask=true", "kernels.lovasz_impl=histogram", "tokenizer.mid_attention=false")
    s = M.stage_plan(cfg, "tokenizer", 1, CPU, None)
    assert s.error == "" and s.activations > 0
    real = real_peak(cfg, "tokenizer", 2)  # zeros: every voxel visible, the largest selection
    assert 0.99 * real <= A.measure_step(cfg, "tokenizer", 2, CPU, None) <= 1.05 * real


def test_planning_leaves_the_rng_as_it_found_it():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    M.plan(tiny(), 1, CPU, torch.bfloat16)
    assert torch.equal(before, torch.get_rng_state())


def test_a_grid_no_machine_holds_is_refused_in_one_line_naming_the_key(tmp_path):
    cfg = load(None, ["data.grid=2000,2000,64", "data.batch_size=64", f"data.root={tmp_path / 'none'}"])
    p = M.plan(cfg, 1, CPU, None)
    with pytest.raises(ConfigError) as e:
        M.check(cfg, p, host=64 * GIB)
    assert e.value.key == "data.grid" and "\n" not in str(e.value)
    assert "the tokenizer stage needs" in str(e.value) and "one frame alone takes" in str(e.value)
    # 2 TiB holds some of the 64 frames: each takes its share of the activations (x1.5 with the heap), of
    # the device's two batches and of the loader's 2 workers x (4 in flight + 1 being collated)
    s, frame = p.stages["tokenizer"], 2000 * 2000 * 64 + 3 * 4 + 8  # occ, motion, index
    assert s.batch == 2 * 64 * frame and s.host == 10 * 64 * frame
    m = int((2048 * GIB - s.state) // (1.5 * s.activations / 64 + 12 * frame))
    assert 1 < m < 64
    with pytest.raises(ConfigError) as e:
        M.check(cfg, p, host=2048 * GIB)
    assert e.value.key == "tokenizer_stage.batch_size" and "\n" not in str(e.value)
    assert f"set tokenizer_stage.batch_size={m} (with tokenizer_stage.grad_accum={-(-64 // m)} " in str(e.value)


def test_a_batch_too_large_is_refused_with_the_micro_batch_that_fits():
    cfg = load(None)
    p = M.plan(cfg, 1, CPU, None)
    s = p.stages["tokenizer"]
    per = s.heap * s.activations / s.micro
    with pytest.raises(ConfigError) as e:  # room for about 3 of the 8 frames' activations
        M.check(cfg, p, host=int(s.state + 3.5 * (per + (s.batch + s.host) / s.micro)))
    assert e.value.key == "activation_checkpoint.tokenizer_every" or e.value.key == "tokenizer_stage.batch_size"
    glob = load(None, ["tokenizer_stage.global_batch=8"])
    with pytest.raises(ConfigError) as e:
        M.check(glob, M.plan(glob, 1, CPU, None), host=int(s.state + 2.5 * (per + (s.batch + s.host) / s.micro)))
    assert e.value.key == "tokenizer_stage.batch_size" and "set tokenizer_stage.batch_size=2 (micro-batches of 2, " \
        "accumulated to the 8 samples of tokenizer_stage.global_batch)" in str(e.value)


def test_the_demo_is_not_refused_and_says_one_line_a_stage():
    cfg = load(None)
    p = M.plan(cfg, 1, CPU, None)
    assert M.check(cfg, p, host=8 * GIB) == []
    lines = M.lines(p)
    assert [ln.split(":")[1].strip().split()[0] for ln in lines] == ["data", "tokenizer", "world"]
    assert "activation_checkpoint.tokenizer_every=1" in lines[1] and "frozen tokenizer" in lines[2]
    close = M.check(cfg, p, host=int(p.stages["tokenizer"].device / 0.9) + p.stages["tokenizer"].host)
    assert len(close) == 1 and "the tokenizer stage needs" in close[0] and "close" in close[0]


def test_a_resume_reads_the_activations_its_run_measured_instead_of_tracing_again(tmp_path, monkeypatch):
    traced = []
    real = A.measure_step
    monkeypatch.setattr(A, "measure_step", lambda *a, **k: traced.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(A, "_measured", {})
    cfg = tiny()
    first = M.plan(cfg, 1, CPU, None)
    each = [n for n in cfg.train.stages for _ in "ab"]
    assert traced == each and each  # each stage with and without activation checkpointing
    A.keep_measured(tmp_path)
    monkeypatch.setattr(A, "_measured", {})  # a fresh process on another node
    A.read_measured(tmp_path)
    again = M.plan(cfg, 1, CPU, None)
    assert traced == each and again.stages == first.stages
    # the run moved, its data copied to another disk, its schedule longer: no trace reads them
    moved = tiny("run.name=elsewhere", "run.out_dir=/mnt/other", "data.root=/mnt/fast/copy",
                 "tokenizer_stage.max_steps=99", "tokenizer_stage.lr=1e-5", "world_stage.epochs=7")
    assert M.plan(moved, 1, CPU, None).stages == first.stages and traced == each
    M.plan(tiny("tokenizer_stage.freeze=encoder"), 1, CPU, None, todo=("tokenizer",))  # fewer gradients
    M.plan(tiny("data.use_mask=true"), 1, CPU, None, todo=("tokenizer",))  # another batch
    assert traced[len(each):] == ["tokenizer"] * 4
    del traced[len(each):]
    M.plan(tiny("tokenizer.widths=[8]"), 1, CPU, None)  # what the model computes changed: traced anew
    assert traced[len(each):] == each
    (tmp_path / A.MEASURED).write_text('{"activations": [1, 2]}')
    monkeypatch.setattr(A, "_measured", {})
    A.read_measured(tmp_path)  # not such a record: it costs the tracing, nothing else
    assert A._measured == {} and M.plan(cfg, 1, CPU, None).stages == first.stages and len(traced) == 3 * len(each)


def test_device_gib_reads_each_stage_off_a_config_file():
    got = M.device_gib(ROOT / "configs" / "demo.json", device="cpu")
    p = M.plan(load(ROOT / "configs" / "demo.json"), 1, CPU, None)
    assert got == {n: round(s.device / GIB, 3) for n, s in p.stages.items()}


def test_train_refuses_an_absurd_grid_before_it_generates_anything(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--set", "data.grid=2000,2000,64", "--set", "data.batch_size=64",
                        "--set", f"synthetic.cache_dir={tmp_path / 'cache'}", "--set", f"run.out_dir={tmp_path / 'runs'}",
                        "--set", "train.device=cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config key 'data.grid': "), r.stderr
    assert r.stdout.startswith("memory plan: data: synthetic occ3d") and "generating synthetic" not in r.stdout
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_first_step_says_its_memory_beside_the_estimate(tmp_path, restore_signals, capsys):
    from wm.training.main import main

    sets = [a for k, v in {**TINY_SETTINGS, "tokenizer_stage.max_steps": "1", "run.out_dir": str(tmp_path / "runs"),
                           "synthetic.cache_dir": str(tmp_path / "cache"), "synthetic.train_scenes": "2",
                           "synthetic.val_scenes": "1"}.items() for a in ("--set", f"{k}={v}")]
    assert main(sets) == 0
    out = capsys.readouterr().out
    assert out.index("memory plan: tokenizer on cpu: ") < out.index("generating synthetic")
    assert "tokenizer: memory after the first step " in out and " measured (peak RSS), " in out and " estimated (" in out


def test_gpu_check_without_a_gpu_says_so_at_once_and_checks_nothing():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "tools/gpu_check.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no CUDA GPU is visible here") and "--device cpu" in err[0]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tokenizer", "world"])
def test_on_cuda_the_planned_step_is_what_the_real_step_allocates(name):
    """Fake CUDA tensors under bf16 autocast, with the Triton kernels' fake outputs: the same bytes."""
    cfg = tiny("train.device=cuda")
    dev = torch.device("cuda")
    want = A.measure_step(cfg, name, 2, dev, torch.bfloat16)
    opts = model_options(cfg, name)
    model = (Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **opts) if name == "tokenizer"
             else WorldModel(cfg.world, cfg.tokenizer.codebook_size, **opts)).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    batch = {k: torch.zeros(shape, dtype=dt, device=dev) for k, (shape, dt) in A.batch_shapes(cfg, name, 2).items()}
    with A.PeakBytes([*model.parameters(), *model.buffers(), *(p.grad for p in params), *batch.values()],
                     A.CUDA_BLOCK) as peak:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = A._loss(name, model, batch)
        out["loss"].backward()
    assert peak.peak == want


def test_a_stage_is_freed_before_the_next_is_built(tiny, restore_signals, monkeypatch):
    # the world stage's peak must not hold the tokenizer stage's model, optimizer and captured graphs
    # (22 GiB at the occworld preset's tokenizer batch on one GPU)
    import weakref

    from wm.training import main as T

    made, real_tok, real_world = [], T.TokenizerStage, T.WorldStage

    def tokenizer_stage(run):
        s = real_tok(run)
        made.append(weakref.ref(s.model))
        return s

    def world_stage(*a):
        assert made and made[0]() is None, "the tokenizer stage's model outlived its stage"
        return real_world(*a)

    monkeypatch.setattr(T, "TokenizerStage", tokenizer_stage)
    monkeypatch.setattr(T, "WorldStage", world_stage)
    assert T.main(tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=1, world_stage__max_steps=1)) == 0
    assert made


def test_on_cuda_each_stage_is_compared_with_its_own_estimate():
    # release() resets CUDA's peak between stages; a CPU's peak RSS cannot be, so there it accumulates
    cfg = load(None, [f"{k}={v}" for k, v in TINY_SETTINGS.items()] + ["train.stages=tokenizer,world"])
    p = M.plan(cfg, device=CPU)
    tok, world = p.stages["tokenizer"], p.stages["world"]
    cuda = M.Plan("cuda:0", p.data_words, 0, False, p.stages, 0, 1)
    assert cuda.expected_peak("tokenizer") == tok.device and cuda.expected_peak("world") == world.device
    assert p.expected_peak("world") == p.baseline + max(p.data_host if p.data_in_process else 0,
                                                         tok.device + tok.host_in_process,
                                                         world.device + world.host_in_process)
