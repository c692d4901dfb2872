"""What runs OccWorld's recipe at speed: the captured training step (wm/training/step_graph.py) computes what
train_step computes (on a CPU its code runs uncaptured, bitwise equal to train_step on one process
and on 2 gloo ranks, where DDP is replaced by one all-reduce of the flat gradient buffer); the
global batch and its per-rank arithmetic (wm/training/batching.py); the preset; validation on a spread
subset; compile.min_steps; the compile cache's keying (wm/training/compile_cache.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import Proc, assert_same
from wm.checkpoint.files import latest_checkpoint, load_checked
from wm.config.loading import load as load_config
from wm.training.batching import planned_steps, resolved, stage_batch
from wm.utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def final(run_dir: Path, stage: str) -> dict:
    path = latest_checkpoint(run_dir / stage / "checkpoints")
    assert path is not None, run_dir
    return load_checked(path)


def losses(run_dir: Path) -> list:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["kind"], r["step"], r["loss/loss"]) for r in recs if r.get("kind", "").endswith("/train")]


def assert_runs_equal(a: Path, b: Path, stages=("tokenizer", "world")) -> None:
    assert losses(a) == losses(b) and losses(a)
    for stage in stages:
        x, y = final(a, stage), final(b, stage)
        assert x["step"] == y["step"] > 0
        assert_same(x["model"], y["model"], f"{stage}.model")
        assert_same(x["optimizer"]["state"], y["optimizer"]["state"], f"{stage}.optimizer")
        assert x["optimizer"]["param_groups"] == y["optimizer"]["param_groups"]


# the codebook reset (RNG, and a broadcast on 2 ranks), accumulation, and the world model's host-side crop
EXERCISE = dict(train__stages="tokenizer,world", tokenizer_stage__grad_accum=2, train__world_crop=4,
                tokenizer__dead_code_steps=1, world_stage__max_steps=3, tokenizer_stage__max_steps=3)


def trained_here(tiny, capsys, **over) -> str:
    """train.py's main in this process (these runs are about what a run computes and says, not its
    process; the DDP ones below are processes): it ends with 0; returns what it printed."""
    import wm.training.main as T

    capsys.readouterr()
    assert T.main(tiny.args(**over)) == 0
    out = capsys.readouterr()
    return out.out + out.err


def test_captured_step_code_is_train_step_bitwise_on_one_process(tiny, capsys, restore_signals):
    runs = {}
    for g in ("false", "true"):
        runs[g] = trained_here(tiny, capsys, name=g, compile__cuda_graphs=g, **EXERCISE)
    assert "compile.cuda_graphs: no GPU here, nothing is captured" in runs["true"]
    assert "compile.cuda_graphs" not in runs["false"]
    assert_runs_equal(tiny.run_dir(name="false"), tiny.run_dir(name="true"))
    # what a captured run saves loads anywhere: plain float rates, capturable off
    groups = final(tiny.run_dir(name="true"), "world")["optimizer"]["param_groups"]
    assert all(isinstance(g["lr"], float) and not g.get("capturable", False) for g in groups)


@pytest.mark.slow
def test_captured_step_code_on_two_gloo_ranks_is_ddp_bitwise(tiny):
    from helpers import free_port, torchrun

    outs = {}
    for g in ("false", "true"):
        p = Proc(torchrun("--nproc_per_node", "2", "--master_port", str(free_port()))
                 + tiny.args(name=g, compile__cuda_graphs=g, ddp__timeout_s=60, **EXERCISE))
        assert p.finish(300) == 0, p.output
        outs[g] = p.output
    assert "nothing is captured" in outs["true"]
    assert_runs_equal(tiny.run_dir(name="false"), tiny.run_dir(name="true"))


# ---------------------------------------------------------------------------------------------
# the global batch


def cfg_with(*sets):
    return load_config(None, list(sets))


def test_global_batch_splits_over_the_ranks_with_a_micro_batch_cap():
    cfg = cfg_with("tokenizer_stage.global_batch=80", "tokenizer_stage.batch_size=40")
    got = {w: (b.micro, b.accum, b.per_step) for w in (1, 2, 4, 8, 16)
           for b in [stage_batch(cfg, "tokenizer", w)]}
    assert got == {1: (40, 2, 80), 2: (40, 1, 80), 4: (20, 1, 80), 8: (10, 1, 80), 16: (5, 1, 80)}
    # a cap that does not divide the rank's share: the largest micro-batch under it that does
    cfg = cfg_with("tokenizer_stage.global_batch=80", "tokenizer_stage.batch_size=30")
    assert (stage_batch(cfg, "tokenizer", 1).micro, stage_batch(cfg, "tokenizer", 1).accum) == (20, 4)
    words = stage_batch(cfg, "tokenizer", 2).words
    assert words.startswith("80 samples a step (tokenizer_stage.global_batch) = 2 ranks x 40: 2 micro-batches of 20")
    s = resolved(cfg, "tokenizer", 2)
    assert (s.batch_size, s.grad_accum, s.global_batch) == (20, 2, 0)
    # without a global batch: per rank, and a step grows with the ranks
    cfg = cfg_with("world_stage.batch_size=4", "world_stage.grad_accum=3")
    b = stage_batch(cfg, "world", 2)
    assert (b.micro, b.accum, b.per_step) == (4, 3, 24)
    assert b.words == "batch 4 from world_stage.batch_size x grad_accum 3 x 2 ranks"


def test_global_batch_refusals_name_the_key():
    cfg = cfg_with("world_stage.global_batch=8")
    with pytest.raises(ConfigError, match=r"'world_stage.global_batch': 8 samples a step do not split over 3 ranks; "
                                          r"run on 1, 2, 4, 8 ranks"):
        stage_batch(cfg, "world", 3)
    with pytest.raises(ConfigError, match=r"'world_stage.grad_accum': 2: with global_batch=8 .* leave grad_accum at 1"):
        cfg_with("world_stage.global_batch=8", "world_stage.grad_accum=2")
    with pytest.raises(ConfigError, match="'world_stage.global_batch': -1 must be >= 0"):
        cfg_with("world_stage.global_batch=-1")


def test_a_global_batch_run_logs_its_arithmetic_and_counts_its_samples(tiny, capsys, restore_signals):
    out = trained_here(tiny, capsys, tokenizer_stage__global_batch=4, tokenizer_stage__batch_size=2,
                       tokenizer_stage__max_steps=2)
    assert "2 steps of 4 samples (4 samples a step (tokenizer_stage.global_batch) = 1 rank x 4: " \
           "2 micro-batches of 2, at most 2 at once (tokenizer_stage.batch_size))" in out
    st = final(tiny.run_dir(), "tokenizer")
    assert st["sampler"]["consumed"] == 8


def test_the_occworld_preset_is_occworlds_recipe_on_any_number_of_gpus():
    cfg = load_config(str(ROOT / "configs/occworld.json"), [])
    for w, tok, world in ((1, (80, 1), (8, 1)), (2, (40, 1), (4, 1)), (8, (10, 1), (1, 1))):
        t, m = stage_batch(cfg, "tokenizer", w), stage_batch(cfg, "world", w)
        assert ((t.micro, t.accum), (m.micro, m.accum)) == (tok, world), w
        assert (t.per_step, m.per_step) == (80, 8)
    tok, world = cfg.tokenizer_stage, cfg.world_stage
    # OccWorld: 200 epochs of 700 scenes x 5 windows at 8 samples a step, its lr, warm-up and clip
    assert tok.max_steps == world.max_steps == 200 * 700 * 5 // 8
    assert (tok.lr, tok.min_lr, tok.warmup_steps, tok.clip, tok.weight_decay) == (1e-3, 1e-6, 200, 35.0, 0.01)
    assert (world.lr, world.min_lr, world.warmup_steps, world.clip, world.weight_decay) == (1e-3, 1e-6, 50, 35.0, 0.01)
    assert cfg.synthetic.style == "occ3d"
    # validations over the whole schedule, the world's on a spread subset of the val windows
    assert tok.max_steps // tok.eval_every == 10 and world.max_steps // world.eval_every == 20
    assert (tok.val_windows, world.val_windows) == (0, 600)
    assert planned_steps(cfg, "world", 21000, 8) == world.max_steps


def test_val_windows_validates_on_a_spread_subset_and_may_change_on_resume(tiny, capsys, restore_signals):
    from wm.training.stages import val_windows

    cfg = cfg_with("world_stage.val_windows=4")
    assert val_windows(cfg, cfg.world_stage) == 4 and val_windows(cfg, cfg.tokenizer_stage) == 0
    assert val_windows(cfg_with("world_stage.val_windows=4", "data.max_windows=2"), cfg.world_stage) == 2
    steps = dict(train__stages="tokenizer,world", tokenizer_stage__max_steps=2, world_stage__max_steps=2)
    out = trained_here(tiny, capsys, world_stage__val_windows=4, **steps)
    assert "world validation: 4/4 windows" in out  # of the tiny val scene's 9
    assert "tokenizer validation: 12/12 windows" in out  # the tokenizer's: every val frame
    # a rerun may validate on another subset: the key may change without --allow-changed
    out = trained_here(tiny, capsys, world_stage__val_windows=0, **steps)
    assert "world stage already finished at step 2" in out


# ---------------------------------------------------------------------------------------------
# compile only where it pays


def test_compile_auto_skips_a_short_stage_on_cuda():
    from wm.training.wrappers import compiles

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    cfg = cfg_with()  # the demo: compile.enable auto, min_steps 2000
    assert compiles(cfg, cuda, 2000) and not compiles(cfg, cuda, 1999) and not compiles(cfg, cpu, 10**6)
    assert compiles(cfg_with("compile.enable=true"), cpu, 1)
    with pytest.raises(ConfigError, match="'compile.cuda_graphs': true captures the whole step"):
        cfg_with("compile.cuda_graphs=true", "compile.mode=reduce-overhead")


def test_a_captured_runs_optimizer_state_saves_as_plain_numbers():
    from wm.training.step_graph import plain_optimizer_state, set_lr

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    opt.param_groups[0]["lr"], opt.param_groups[0]["capturable"] = torch.tensor(0.1), True
    set_lr(opt.param_groups[0], 0.25)
    assert opt.param_groups[0]["lr"].item() == 0.25  # the same tensor, filled: a graph reads its address
    st = plain_optimizer_state(opt)
    assert st["param_groups"][0]["lr"] == 0.25 and st["param_groups"][0]["capturable"] is False
    assert torch.is_tensor(opt.param_groups[0]["lr"])  # the live optimizer keeps its tensor


# ---------------------------------------------------------------------------------------------
# the compile cache


def test_compile_cache_is_keyed_by_the_machine_and_says_why_it_compiles(tmp_path, monkeypatch):
    from wm.training import compile_cache as C

    monkeypatch.setattr(C, "_loaded", set())
    cpu = torch.device("cpu")
    loaded, said = [], []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: loaded.append(b))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts-1", None))
    assert C.load(tmp_path, cpu, said.append) is False and not said  # nothing saved yet: silent
    C.save(tmp_path, cpu, said.append)
    name = "train-" + C.key_name(C.machine_key(cpu))
    assert (tmp_path / "compile_cache" / f"{name}.bin").read_bytes() == b"artifacts-1"
    assert "compile cache: saved 0.0 MiB" in said[-1]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"less", None))
    C.save(tmp_path, cpu, said.append)  # artifacts only grow: a smaller set is not written over a larger
    assert (tmp_path / "compile_cache" / f"{name}.bin").read_bytes() == b"artifacts-1"

    monkeypatch.setattr(C, "_loaded", set())  # a fresh process on the same kind of machine
    assert C.load(tmp_path, cpu, said.append) is True and loaded == [b"artifacts-1"]
    assert said[-1].startswith("compile cache: loaded")

    # another kind of machine: its file stays, this one compiles, and the line says both
    other = dict(C.machine_key(cpu), device="NVIDIA H100 80GB HBM3", capability="9.0", torch="2.11.0")
    monkeypatch.setattr(C, "machine_key", lambda device: other)
    monkeypatch.setattr(C, "_loaded", set())
    assert C.load(tmp_path, cpu, said.append) is False
    assert said[-1].startswith(f"compile cache: {tmp_path / 'compile_cache'} holds artifacts of ")
    assert "this machine is NVIDIA H100 80GB HBM3 sm 9.0, torch 2.11.0" in said[-1] and "so the first step compiles" in said[-1]
    assert len(loaded) == 1
    # the Forecaster's artifacts are a file of their own: the training file is no forecast cache
    monkeypatch.setattr(C, "_loaded", set())
    assert C.load(tmp_path, cpu, said.append, kind="forecast") is False and len(loaded) == 1


def test_a_damaged_compile_cache_is_one_line_and_ignored(tmp_path, monkeypatch):
    from wm.training import compile_cache as C

    monkeypatch.setattr(C, "_loaded", set())
    cpu, said = torch.device("cpu"), []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    C.save(tmp_path, cpu, said.append)
    name = "train-" + C.key_name(C.machine_key(cpu))
    (tmp_path / "compile_cache" / f"{name}.bin").write_bytes(b"artifactz")  # a flipped byte
    monkeypatch.setattr(C, "_loaded", set())
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: pytest.fail("a damaged cache was loaded"))
    assert C.load(tmp_path, cpu, said.append) is False
    assert "is damaged (ValueError: its checksum does not match); ignored, the first step compiles" in said[-1]


def test_the_triton_kernels_the_first_step_built_travel_with_the_run(tmp_path, monkeypatch):
    import time as _time

    from wm.training import compile_cache as C

    monkeypatch.setattr(C, "_loaded", set())
    cpu, said = torch.device("cpu"), []
    built, fresh = tmp_path / "triton-here", tmp_path / "triton-fresh-node"
    monkeypatch.setattr(C, "triton_dir", lambda device: built)
    monkeypatch.setattr(C, "_STARTED", _time.time() - 5)

    def kernel(root, name, body):
        (root / name).mkdir(parents=True)
        (root / name / "k.cubin").write_bytes(body)
        (root / name / "__grp__k.json").write_text(json.dumps({"child_paths": {  # absolute, as Triton records them
            "k.cubin": str(root / name / "k.cubin"), "k.json": "k.json"}}))

    kernel(built, "older", b"another process's")
    os.utime(built / "older", (_time.time() - 100,) * 2)  # written before this process started
    kernel(built, "k1", b"\x01" * 100)
    kernel(built, "k2", b"\x02" * 100)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts-1", None))
    C.save(tmp_path, cpu, said.append)
    assert "and 2 Triton kernels to" in said[-1]
    kernel(built, "k3", b"\x03" * 100)  # the next stage's first step tuned another
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"less", None))
    C.save(tmp_path, cpu, said.append)  # the artifacts stay, the kernels merge
    tar = tmp_path / "compile_cache" / f"triton-{C.key_name(C.machine_key(cpu))}.tar"
    assert C._read_tar(tar) and sorted(C.pack_triton(tar, cpu) for _ in range(2)) == [3, 3]

    # a fresh node: its Triton cache holds one of them already (kept), the others arrive whole
    monkeypatch.setattr(C, "triton_dir", lambda device: fresh)
    monkeypatch.setattr(C, "_loaded", set())
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: None)
    kernel(fresh, "k1", b"its own")
    assert C.load(tmp_path, cpu, said.append) is True and said[-1].endswith("and 3 Triton kernels")
    assert sorted(p.name for p in fresh.iterdir()) == ["k1", "k2", "k3"]  # no temporary left
    assert (fresh / "k1" / "k.cubin").read_bytes() == b"its own"
    assert (fresh / "k3" / "k.cubin").read_bytes() == b"\x03" * 100
    # the group records name the files where they are now, not where they were built
    assert json.loads((fresh / "k2" / "__grp__k.json").read_text())["child_paths"] == {
        "k.cubin": str(fresh / "k2" / "k.cubin"), "k.json": "k.json"}

    # a damaged kernel file is said and nothing of it unpacked: Triton never loads a broken binary
    data = bytearray(tar.read_bytes())
    data[len(data) // 2] ^= 1
    tar.write_bytes(bytes(data))
    shutil.rmtree(fresh)
    monkeypatch.setattr(C, "_loaded", set())
    assert C.load(tmp_path, cpu, said.append) is True
    assert any("is damaged (ValueError: its checksum does not match); ignored, its kernels are rebuilt" in s for s in said)
    assert not fresh.exists() or not any(fresh.iterdir())
    assert said[-1].startswith("compile cache: loaded") and "Triton" not in said[-1]


def test_a_compiled_stage_logs_its_first_step_and_where_the_seconds_went(tiny, monkeypatch, capsys, restore_signals):
    import wm.training.main as T

    real = torch.compile  # Dynamo and AOTAutograd as on a GPU, without Inductor's C++ build
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="aot_eager"))
    assert T.main(tiny.args(tokenizer_stage__max_steps=2, compile__enable="true")) == 0
    out = capsys.readouterr().out
    assert re.search(r"^tokenizer: first step \d+\.\d s \(torch.compile compiling\)$", out, re.M), out
    recs = [json.loads(x) for x in (tiny.run_dir() / "metrics.jsonl").read_text().splitlines() if x.strip()]
    first = [r for r in recs if r.get("kind") == "tokenizer/compile"]
    assert len(first) == 1 and first[0]["perf/first_step_s"] > 0 and first[0]["perf/compile_cache_hit"] == 0.0
    times = (tiny.run_dir() / "tokenizer" / "compile_times.txt").read_text()
    assert "OutputGraph.call_user_compiler" in times  # Dynamo's hand-over to the backend, timed
    assert re.search(r"^cache counters:\n  stats\.unique_graphs [1-9]\d*$", times, re.M), times  # what the caches did (counted per process)


class _Cfg:
    def __init__(self, block):
        self.block, self.found_by_coordesc = block, False


class _Result:
    def __init__(self, block):
        self.config = _Cfg(block)


class _Kernel:
    """What tuned_recheck reads and writes of torch's CachingAutotuner: the reloaded compile
    results, its source function, and how it compiles one more config."""

    def __init__(self, blocks, fn=None):
        self.compile_results = [_Result(b) for b in blocks]
        self.filename, self.inductor_meta, self.fn = "k.py", {"coordinate_descent_tuning": True}, type("F", (), {"fn": fn})()
        self.compiled = []

    def _precompile_config(self, cfg):
        self.compiled.append(cfg.block)
        r = _Result(cfg.block)
        r.config = cfg
        return r


def _tuned(block, by_coordesc=True):
    c = _Cfg(block)
    c.found_by_coordesc = by_coordesc
    return c


@pytest.mark.parametrize("blocks", [[64], [32, 64, 128]])
def test_a_reloaded_kernel_keeps_its_cached_tuning(blocks):
    from wm.training.compile_cache import tuned_recheck

    buggy = lambda self, reload: None  # torch's recheck as 2.11 has it for one config: nothing marked
    asked = []
    check = lambda configs, f, meta: (asked.append([c.block for c in configs]) or [_tuned(64)], None, {})
    k = _Kernel(blocks)
    tuned_recheck(buggy, check, lambda c: c.block)(k, reload_kernel_from_src=None)
    assert asked == [blocks]  # asked about the configs the kernel was reloaded with
    assert [r.config.block for r in k.compile_results] == [64] and k.compile_results[0].config.found_by_coordesc
    assert k.compiled == []  # the tuned config was among the reloaded ones: nothing compiles


def test_a_tuned_config_not_reloaded_is_compiled_once_and_marked():
    from wm.training.compile_cache import tuned_recheck

    reloaded = []
    k = _Kernel([16], fn=None)
    reload = lambda: reloaded.append(1) or type("K", (), {"fn": "source"})()
    tuned_recheck(lambda self, r: None, lambda c, f, m: ([_tuned(256)], None, {}), lambda c: c.block)(k, reload)
    assert k.compiled == [256] and reloaded == [1] and k.fn == "source"
    assert [r.config.block for r in k.compile_results] == [256] and k.compile_results[0].config.found_by_coordesc


def test_an_untuned_or_missing_cache_entry_leaves_the_kernel_as_torch_left_it():
    from wm.training.compile_cache import tuned_recheck

    for cached in ([], [_tuned(64, by_coordesc=False)]):
        k = _Kernel([32, 64])
        tuned_recheck(lambda self, r: None, lambda c, f, m: (cached, None, {}), lambda c: c.block)(k, None)
        assert [r.config.block for r in k.compile_results] == [32, 64] and k.compiled == []
        assert not any(r.config.found_by_coordesc for r in k.compile_results)


def test_the_tuning_patch_is_applied_only_to_a_torch_that_needs_it():
    import inspect

    from torch._inductor.runtime import triton_heuristics as th
    from wm.training.compile_cache import fixes_tuning_reload, keep_tuned_configs

    assert fixes_tuning_reload("    compile_result.config.found_by_coordesc = found_by_coordesc\n")
    assert not fixes_tuning_reload("    if len(cached_configs) == 1 and len(configs) > 1:\n")
    before = th.CachingAutotuner.recheck_autotune_cache
    try:
        patched = keep_tuned_configs()
        assert patched == (not fixes_tuning_reload(inspect.getsource(before)))
        assert keep_tuned_configs() is False  # once is enough
    finally:
        th.CachingAutotuner.recheck_autotune_cache = before
