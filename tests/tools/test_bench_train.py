"""tools/bench_train.py on a CPU: the figures it writes, and that the step it times is train.py's step
(the bench's set-up and wm.training.loop.train_step reproduce fit bitwise)."""

import importlib.util
import json
import math
import time
from pathlib import Path

import pytest
import torch

from wm.checkpoint.files import latest_checkpoint, load
from wm.checkpoint.run_folder import Run
from wm.config.loading import load as load_config
import wm.training.loop as L
import wm.training.main as T
from wm.training.stages import TokenizerStage, WorldStage
from wm.utils import distributed as D

ROOT = Path(__file__).resolve().parents[2]

from helpers import assert_same  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")





@pytest.fixture(scope="module")
def B():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "tools" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sets(args: list[str]) -> list[str]:
    """The KEY=VALUE items of a `--set` argument list."""
    return [v for k, v in zip(args, args[1:]) if k == "--set"]





# ---------------------------------------------------------------------------------------------
# the figures


def test_bench_writes_every_figure_with_sane_values(tiny, tmp_path, B):
    out = tmp_path / "bench.json"
    args = tiny.args(out="bench") + ["--steps", "2", "--warmup", "1", "--batches", "1,2", "--stage-batch", "world=2",
                                     "--variants", "fp32-b1,bf16,recipe,onthefly,save", "--json", str(out),
                                     "--set", "tokenizer_stage.global_batch=4", "--set", "tokenizer_stage.batch_size=2"]
    t = time.perf_counter()
    assert B.main(args) == 0
    took = time.perf_counter() - t
    d = json.loads(out.read_text())
    assert not list((tiny.base / "bench").glob(".bench-train-*")), "the bench's run folder was left behind"

    assert d["machine"]["world_size"] == 1 and d["peaks_tflops"]["fp32"] > 0
    got = {(r["stage"], r["variant"]): r for r in d["results"]}
    assert set(got) == {("tokenizer", "fp32-b1"), ("tokenizer", "bf16"), ("tokenizer", "recipe"), ("tokenizer", "save"),
                        ("world", "fp32-b1"), ("world", "bf16"), ("world", "recipe"), ("world", "onthefly"),
                        ("world", "save")}
    # the recipe variant is the config as it is: its global batch of 4 in 2 micro-batches of 2
    rt = got["tokenizer", "recipe"]
    assert (rt["batch"], rt["grad_accum"], rt["global_batch"], rt["stage_steps"]) == (2, 2, 4, 4)
    assert rt["cuda_graphs"] is False and rt["compile"] is False and rt["first_step_s"] > 0
    assert [r["batch"] for r in d["sweeps"]["tokenizer"]] == [1, 2]
    assert [r["batch"] for r in d["sweeps"]["world"]] == [2]  # --stage-batch world=2 instead of --batches
    assert got["tokenizer", "fp32-b1"]["batch"] == 10  # OccWorld's batch 1: one 10-frame sample
    assert got["world", "fp32-b1"]["batch"] == 1
    for (stage, v), r in got.items():
        assert r["status"] == "ok", r
        if v == "save":
            assert r["sync_save_s"] > 0 and r["async_blocked_s"] > 0 and r["async_write_s"] > 0
            assert r["blocked_ratio"] == pytest.approx(r["async_blocked_s"] / r["sync_save_s"])
            assert len(r["async_blocked_s_all"]) == 3 and r["checkpoint_mib"] > 0
            continue
        assert r["amp"] == ("fp32" if "fp32" in v or v == "recipe" else "bf16")  # recipe: the config's train.amp
        assert r["step_ms"] > 0 and r["step_ms_median"] > 0 and r["samples_per_s"] > 0
        # samples/s is what the timed steps trained on over their time
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] / (r["step_ms"] / 1e3), rel=1e-6)
        assert 0 <= r["data_wait_frac"] <= 1
        assert r["flops_per_sample"] > 0
        assert r["flops_per_step"] == pytest.approx(r["flops_per_sample"] * r["global_batch"])
        assert r["tflops_per_s"] == pytest.approx(r["flops_per_sample"] * r["samples_per_s"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / d["peaks_tflops"]["fp32"]) and r["mfu_peak"] == "fp32"
        assert r["max_mem_gib"] is None and r["act_mem_gib"] is None  # no CUDA memory on a CPU
        assert math.isfinite(r["loss"]) and r["skipped_steps"] == 0 and r["steps"] == 2
        assert r["gc_every"] == 50 and len(r["host_gc_ms_each"]) == 2 and all(x >= 0 for x in r["host_gc_ms_each"])
        assert r["host_gc_ms_max"] == max(r["host_gc_ms_each"])
    assert got["world", "onthefly"]["data"].startswith("occupancy") and got["world", "bf16"]["data"] == "token cache"

    # the schedule's time from the recipe variant only: its steps x its samples a step over its rate
    x = d["extrapolation"]
    for stage in ("tokenizer", "world"):
        r = got[stage, "recipe"]
        assert x[stage]["samples_per_s"] == r["samples_per_s"] and x[stage]["steps"] == 4
        assert x[stage]["gpu_hours"] == pytest.approx(4 * r["global_batch"] / r["samples_per_s"] / 3600)
    assert x["gpu_hours"] == pytest.approx(x["tokenizer"]["gpu_hours"] + x["world"]["gpu_hours"])
    assert d["checks"] and all(isinstance(ok, bool) for ok in d["checks"].values())

    # FLOPs: wm.training.loop.count_flops of a batch of the same shape through the same stage
    cfg = load_config(None, sets(tiny.args(out="flops")))
    d1 = D.Dist()
    run = Run(cfg, d1)
    B.ensure_tokenizer_checkpoint(run, d1)
    tok = TokenizerStage(run)
    world = WorldStage(run, torch.device("cpu"), None)
    for stage, rec in ((tok, got["tokenizer", "bf16"]), (world, got["world", "fp32-b1"]),
                       (B.OnTheFlyWorld(world), got["world", "onthefly"])):
        batch = next(iter(torch.utils.data.DataLoader(stage.train_ds, batch_size=rec["batch"])))
        dtype = torch.bfloat16 if rec["amp"] == "bf16" else None
        flops = L.count_flops(stage, stage.model, batch, torch.device("cpu"), dtype)
        assert rec["flops_per_sample"] == flops, (rec["stage"], rec["variant"])
    run.log.close()
    print(f"bench took {took:.1f} s")


@pytest.mark.parametrize("bad", ["foo=2", "world=0", "world=two", "world", "world=1,0", "world=4,"])
def test_a_bad_stage_batch_is_one_line(B, bad, capsys):
    with pytest.raises(SystemExit):
        B.parse_args(["--stage-batch", bad])
    assert f"--stage-batch {bad!r} must be tokenizer=B[,B...] or world=B[,B...] with B >= 1" in capsys.readouterr().err


def test_stage_batch_takes_a_list_per_stage(B):
    a = B.parse_args(["--stage-batch", "tokenizer=8,16,32", "--stage-batch", "world=1"])
    assert a.stage_batch == {"tokenizer": [8, 16, 32], "world": [1]}


def test_scaling_report_divides_samples_per_s(tmp_path, B, capsys):
    def fake(ws, sps, median_ms):
        return {"machine": {"world_size": ws},
                "results": [{"stage": "world", "variant": "bf16", "status": "ok", "batch": 4, "samples_per_s": sps,
                             "step_ms": 4 * ws / sps * 1e3, "step_ms_median": median_ms}]}

    paths = {}
    for ws, sps, median in ((1, 10.0, 400.0), (2, 19.5, 400.0), (4, 35.0, 420.0)):
        paths[ws] = tmp_path / f"{ws}.json"
        paths[ws].write_text(json.dumps(fake(ws, sps, median)))
    assert B.main(["--scaling", str(paths[1]), str(paths[2])]) == 0
    text = capsys.readouterr().out
    assert "1.95x" in text and "PASS  world bf16: 1.95x >= 1.90x" in text
    # 4 GPUs are held to 3.8x; the median steps (400 vs 420 ms) say 4 x 400 / 420 = 3.81x
    assert B.main(["--scaling", str(paths[1]), str(paths[4])]) == 0
    text = capsys.readouterr().out
    assert "FAIL  world bf16: 3.50x >= 3.80x" in text and "3.81x" in text and "457.1 / 420.0" in text


# ---------------------------------------------------------------------------------------------
# the step it times is train.py's


def test_bench_runner_reproduces_fit_bitwise(tiny, B):
    # grad_accum 2 (no_sync path, loss scaling), dead-code resets every step (the torch RNG),
    # the warm-up + cosine schedule: the bench's Runner must build and step exactly as fit does
    over = dict(tokenizer_stage__max_steps=4, tokenizer_stage__grad_accum=2)
    assert T.main(tiny.args(**over)) == 0
    ref = load(latest_checkpoint(tiny.run_dir() / "tokenizer" / "checkpoints"))
    assert ref["step"] == 4

    cfg = load_config(None, sets(tiny.args(out="runner", **over)))
    d = D.Dist()
    run = Run(cfg, d)
    runner = B.Runner(TokenizerStage(run), cfg, d, torch.device("cpu"), None)
    for _ in range(4):
        r = runner.step()
        assert r.outcome() == (False, False) and r.samples == 4 and 0 <= r.data_wait_s
    runner.close()
    run.log.close()
    assert_same(ref["model"], runner.model.state_dict(), "model")
    assert_same(ref["optimizer"], runner.opt.state_dict(), "optimizer")
    assert ref["sampler"] == runner.sampler.state_dict()


@pytest.mark.cuda
@pytest.mark.parametrize("stage_name", ["tokenizer", "world"])
def test_train_step_on_cuda_never_waits_for_the_gpu(tiny, B, stage_name):
    # a host sync in the step would leave the GPU idle while the host queues the next one: torch's
    # sync debug mode turns any into an error; the outcome is then read while later work still runs
    over = {"train__stages": "tokenizer,world", "tokenizer_stage__max_steps": 2, "world_stage__max_steps": 2,
            "compile__enable": "false"}  # the eager step (tools/gpu_check.py runs the compiled one)
    cfg = load_config(None, sets(tiny.args(out=f"cuda-{stage_name}", **over)))
    d, dev = D.Dist(), torch.device("cuda")
    run = Run(cfg, d)
    if stage_name == "tokenizer":
        stage = TokenizerStage(run)
    else:
        B.ensure_tokenizer_checkpoint(run, d)
        stage = WorldStage(run, dev, torch.bfloat16)
    runner = B.Runner(stage, cfg, d, dev, torch.bfloat16)
    try:
        runner.step()  # the first step may wait (lazy initialisation, cuDNN's and cuBLAS's choices)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            r = runner.step()
            torch.cuda._sleep(1 << 30)  # about half a second of GPU time queued after the step
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert r.outcome() == (False, False)
        assert not torch.cuda.current_stream().query()  # read while the later work still ran
    finally:
        runner.close()
        run.log.close()
        torch.cuda.synchronize()


def test_a_one_off_cost_the_flop_count_leaves_is_not_timed(tiny, tmp_path, B, monkeypatch):
    # the count's eager pass can leave the next step a one-off (on CUDA: the allocator's cache laid
    # out for the eager pass, refilled by the next compiled step): an untimed step must take it
    import wm.training.loop as L

    count, step, armed, one_offs = L.count_flops, L.train_step, [False], []
    clock = time.perf_counter  # the one-off: the clock moves on 1.5 s in that step
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + 1.5 * len(one_offs))

    def counting(*a, **k):
        armed[0] = True
        return count(*a, **k)

    def stepping(*a, **k):
        if armed[0]:
            armed[0] = False
            one_offs.append(True)
        return step(*a, **k)

    monkeypatch.setattr(L, "count_flops", counting)
    monkeypatch.setattr(L, "train_step", stepping)
    out = tmp_path / "one.json"
    assert B.main(tiny.args(out="bench1") + ["--stages", "tokenizer", "--variants", "fp32-b1", "--steps", "3",
                                             "--warmup", "1", "--json", str(out)]) == 0
    r = [r for r in json.loads(out.read_text())["results"] if r.get("status") == "ok"][0]
    assert one_offs == [True]
    assert max(r["step_ms_each"]) < 1000, r["step_ms_each"]  # a tiny step takes milliseconds
    assert r["warmup"] == 2  # the step after the count is untimed
    assert r["cuda_malloc_calls"] is None and r["alloc_retries"] is None  # CUDA's allocator only


@pytest.mark.slow
def test_a_rank_late_to_the_timed_steps_is_not_timed_as_a_slow_step(tiny, tmp_path):
    # rank 1 counts FLOPs 3 s longer than rank 0 (as ranks do when they finish their warm-up apart):
    # the timed steps must start together, else rank 0's first step waits in the all-reduce for it
    from helpers import run_two_ranks

    out = tmp_path / "two.json"
    args = tiny.args(out="bench2") + ["--stages", "tokenizer", "--variants", "fp32-b1", "--steps", "3",
                                      "--warmup", "1", "--json", str(out)]
    script = f"""
import importlib.util, json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
import wm.training.loop as L
count = L.count_flops
def late(*a, **k):
    if os.environ["RANK"] == "1":
        time.sleep(3)
    return count(*a, **k)
L.count_flops = late
spec = importlib.util.spec_from_file_location("bench_train", {str(ROOT / "tools" / "bench_train.py")!r})
B = importlib.util.module_from_spec(spec); spec.loader.exec_module(B)
assert B.main({args!r}) == 0
print("RESULT", json.dumps(json.loads(open({str(out)!r}).read()) if os.environ["RANK"] == "0" else {{}}))
"""
    rank0, _ = run_two_ranks(script, threads=1)
    r = [r for r in rank0["results"] if r.get("status") == "ok"][0]
    assert r["world_size"] == 2 and len(r["step_ms_each"]) == 3
    # a tiny step takes milliseconds; a wait for the late rank would be 3000 ms in the first
    assert max(r["step_ms_each"]) < 1500, r["step_ms_each"]
