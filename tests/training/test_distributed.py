"""wm/utils/distributed.py and DDP training on CPU (gloo): a world of one, the collectives across two
processes, torchrun --nproc_per_node 2 against one process with the same global batch, SIGTERM
to one rank, two torchrun agents rendezvousing through c10d, and a killed rank ending the job."""

import contextlib
import json
import os
import shutil
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import free_port, run_two_ranks, torchrun
from wm.checkpoint.files import latest_checkpoint, load
from wm.config.loading import from_dict
from wm.config.sections import Config
import wm.utils.distributed as D

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def worker_of(agent_pid: int, rank: int, timeout: float = 60) -> int:
    """The pid of the training process with RANK=`rank` under a torchrun agent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children(agent_pid):
            try:
                env = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return c
        time.sleep(0.1)
    raise AssertionError(f"no RANK={rank} worker under torchrun agent {agent_pid}")


def final(run_dir: Path, stage: str) -> dict:
    path = latest_checkpoint(run_dir / stage / "checkpoints")
    assert path is not None, run_dir
    return load(path)


# ---------------------------------------------------------------------------------------------
# wm.utils.distributed in a world of one, and its collectives across two gloo processes


def test_world_of_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    d = D.init("cpu", 5)
    assert (d.rank, d.world_size, d.is_main, d.active, d.device.type) == (0, 1, True, False, "cpu")
    t = torch.tensor([1.0, 2.0])
    assert D.all_reduce_(t, d, op="max") is t and t.tolist() == [1.0, 2.0]
    assert D.mean_scalars({"a": 1.5}, d) == {"a": 1.5}
    assert D.any_rank(True, d) and not D.any_rank(False, d)
    assert D.gather_objects({"x": 1}, d) == [{"x": 1}]
    assert D.broadcast_object("hi", d) == "hi"
    D.barrier(d)
    D.close(d)


def test_cuda_requested_without_cuda_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    from wm.utils.errors import WMError

    with pytest.raises(WMError, match="no CUDA device"):
        D.init("cuda")


COLLECTIVES = textwrap.dedent("""
    import json, sys, torch
    import wm.utils.distributed as D
    d = D.init("cpu", 30)
    r = d.rank
    t = torch.tensor([float(r + 1), 10.0 * r])
    out = {"rank": r, "world": d.world_size, "backend": d.backend,
           "sum": D.all_reduce_(t.clone(), d).tolist(),
           "max": D.all_reduce_(t.clone(), d, op="max").tolist(),
           "min": D.all_reduce_(t.clone(), d, op="min").tolist(),
           "mean": D.mean_scalars({"a": float(r), "b": 2.0 * r + 1}, d),
           "any": [D.any_rank(r == 1, d), D.any_rank(False, d)],
           "gather": D.gather_objects({"r": r}, d),
           "bcast": D.broadcast_object("from %d" % r, d)}
    D.barrier(d)
    D.close(d)
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.slow
def test_collectives_across_two_gloo_processes():
    outs = run_two_ranks(COLLECTIVES, threads=1)
    for o in outs:
        assert o["world"] == 2 and o["backend"] == "gloo"
        assert o["sum"] == [3.0, 10.0] and o["max"] == [2.0, 10.0] and o["min"] == [1.0, 0.0]
        assert o["mean"] == {"a": 0.5, "b": 2.0}
        assert o["any"] == [True, False]
        assert o["gather"] == [{"r": 0}, {"r": 1}]
        assert o["bcast"] == "from 0"


# ---------------------------------------------------------------------------------------------
# DDP training


def key_bias_free(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor without the attention key biases: their gradient is zero in exact arithmetic
    (softmax is shift invariant), so AdamW turns float noise in it into lr-sized steps whose sign
    depends on the reduction order; everything else must agree."""
    if name.endswith("qkv.bias"):
        c = t.numel() // 3
        return torch.cat([t[:c], t[2 * c:]])
    if name.endswith(".kv.bias"):
        return t[t.numel() // 2:]
    return t


def assert_params_close(a: dict, b: dict, init: dict, atol=2e-5, rtol=1e-4) -> None:
    moved = 0.0
    for k in a:
        if not a[k].is_floating_point():
            continue
        x, y = key_bias_free(k, a[k]).double(), key_bias_free(k, b[k]).double()
        assert torch.allclose(x, y, atol=atol, rtol=rtol), \
            f"{k}: max |diff| {(x - y).abs().max().item():.3g}"
        moved = max(moved, (y - key_bias_free(k, init[k]).double()).abs().max().item())
    assert moved > 50 * atol, f"the parameters hardly moved ({moved:.3g}): the comparison means nothing"


def initial_weights(st: dict, stage: str) -> dict:
    cfg = from_dict(Config, st["config"])
    torch.manual_seed(cfg.run.seed)  # what the loop does before building a model
    if stage == "tokenizer":
        from wm.models.tokenizer import Tokenizer

        return Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid)).state_dict()
    from wm.models.world import WorldModel

    return WorldModel(cfg.world, cfg.tokenizer.codebook_size).state_dict()


# the Lovasz loss is computed over a rank's batch and is not a sum over samples, so 2 ranks x b
# and 1 rank x 2b genuinely differ with it; dead-code resets are decided from rank 0's batch only
DDP_EXACT = dict(tokenizer__lovasz_weight=0, tokenizer__dead_code_steps=0, ddp__timeout_s=60)


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process_with_the_same_global_batch(tiny):
    from helpers import Proc

    steps = dict(tokenizer_stage__max_steps=4, world_stage__max_steps=4, **DDP_EXACT)
    one = tiny.spawn(out="one", train__stages="tokenizer,world", tokenizer_stage__batch_size=4,
                     world_stage__batch_size=4, **steps)
    assert one.finish(240) == 0, one.output

    # tokenizer: 2 ranks x 2
    two = Proc(torchrun("--nproc_per_node", "2", "--master_port", str(free_port()))
               + tiny.args(out="two", **steps))
    assert two.finish(240) == 0, two.output
    assert "4 steps of 4 samples" in two.output
    meta = json.loads((tiny.run_dir("two") / "config.json").read_text())["meta"]
    assert meta["world_size"] == 2
    a, b = final(tiny.run_dir("two"), "tokenizer"), final(tiny.run_dir("one"), "tokenizer")
    assert a["step"] == b["step"] == 4
    assert_params_close(a["model"], b["model"], initial_weights(b, "tokenizer"))
    assert a["sampler"]["consumed"] == b["sampler"]["consumed"] == 16
    assert len(a["rng"]) == 2 and not torch.equal(a["rng"][0]["torch"], a["rng"][1]["torch"])

    # world model, on the very same frozen tokenizer: 2 ranks x 2
    w = tiny.run_dir("two_world")
    w.mkdir(parents=True)
    shutil.copytree(tiny.run_dir("one") / "tokenizer", w / "tokenizer")
    two = Proc(torchrun("--nproc_per_node", "2", "--master_port", str(free_port()))
               + tiny.args(out="two_world", train__stages="tokenizer,world", **steps))
    assert two.finish(240) == 0, two.output
    a, b = final(w, "world"), final(tiny.run_dir("one"), "world")
    assert a["tokenizer"]["sha256"] == b["tokenizer"]["sha256"]
    assert_params_close(a["model"], b["model"], initial_weights(b, "world"))


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_and_the_ddp_resume_is_exact(tiny):
    from helpers import Proc

    over = dict(tokenizer_stage__max_steps=12, **DDP_EXACT)
    ref = Proc(torchrun("--nproc_per_node", "2", "--master_port", str(free_port()))
               + tiny.args(out="straight", **over))
    assert ref.finish(240) == 0, ref.output

    cmd = torchrun("--nproc_per_node", "2", "--master_port", str(free_port())) + tiny.args(out="cut", **over)
    p = Proc(cmd)
    assert p.wait_for(r"^tokenizer step 2/12 ", 120), p.output
    os.kill(worker_of(p.pid, 1), signal.SIGTERM)  # only rank 1 is told; rank 0 must agree
    assert p.finish(120) == 0, p.output
    assert "preempted (SIGTERM/SIGINT); saved step" in p.output, p.output
    stopped = final(tiny.run_dir("cut"), "tokenizer")["step"]
    assert 2 < stopped < 12

    p = Proc(torchrun("--nproc_per_node", "2", "--master_port", str(free_port())) + tiny.args(out="cut", **over))
    assert p.finish(240) == 0, p.output
    assert f"at step {stopped}/12" in p.output
    a, b = final(tiny.run_dir("straight"), "tokenizer"), final(tiny.run_dir("cut"), "tokenizer")
    for part in ("model", "optimizer"):
        for k, v in (a[part] if part == "model" else a[part]["state"]).items():
            w = b[part][k] if part == "model" else b[part]["state"][k]
            if isinstance(v, dict):
                assert all(torch.equal(v[j], w[j]) for j in v), (part, k)
            else:
                assert torch.equal(v, w), (part, k)


def agents(tiny, port: int, out: str, **over):
    from helpers import Proc

    args = tiny.args(out=out, **over)
    return [Proc([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                  "--node_rank", str(r), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                  "--rdzv_id", f"wm-test-{port}", "--max_restarts", "0", "train.py", *args])
            for r in range(2)]


def ranks_of(nodes: list) -> dict:
    """{RANK: (index of its node in `nodes`, pid)} of the training processes under each node's
    launcher (torchrun's children, or its grandchildren under a script)."""
    found = {}
    for i, p in enumerate(nodes):
        for c in children(p.pid) + [g for c in children(p.pid) for g in children(c)]:
            try:
                env = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
            if rank:
                found.setdefault(rank[0], (i, c))  # the shallowest: not a DataLoader worker of it
    return found


def stop_one_rank(tiny, sig, timeout_s, out):
    """Start two agents, wait for training, send `sig` to the rank-1 worker; returns (exit code of
    the other agent, seconds it took to end after the signal, its output)."""
    ps = agents(tiny, free_port(), out, tokenizer_stage__max_steps=5000, ddp__timeout_s=timeout_s,
                tokenizer__lovasz_weight=0)
    workers = set()
    try:
        deadline = time.monotonic() + 180
        while not any(p.wait_for(r"^tokenizer step 3/", 0.2) for p in ps):  # rank 0 is either one
            assert time.monotonic() < deadline and all(p.p.poll() is None for p in ps), \
                ps[0].output + ps[1].output
        ranks = ranks_of(ps)  # assigned by the rendezvous
        workers.update(pid for _, pid in ranks.values())
        (_, victim), survivor = ranks[1], ps[1 - ranks[1][0]]
        t0 = time.monotonic()
        os.kill(victim, sig)
        rc = survivor.finish(timeout_s + 90)  # raises if it hangs
        return rc, time.monotonic() - t0, survivor.output
    finally:
        # the workers may sit in their own process groups, and a stopped one ignores everything but
        # SIGKILL: kill each by pid so no rank outlives the test
        for c in workers:
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
                pass
        for p in ps:
            p.kill_group()


@pytest.mark.slow
def test_killing_one_rank_ends_the_other_with_an_error_within_the_timeout(tiny):
    rc, took, out = stop_one_rank(tiny, signal.SIGKILL, 30, "killed")
    assert rc != 0, out
    assert took < 30 + 15, f"the surviving rank took {took:.0f}s to fail:\n{out[-3000:]}"
    assert "tokenizer step 5000/5000" not in out
    # the survivor says what happened in one line, not a traceback
    assert re.search(r"error: rank 0: a collective (failed|timed out) .*another rank died or hung", out), out[-3000:]


@pytest.mark.slow
def test_a_hung_rank_ends_the_other_with_an_error_after_the_timeout(tiny):
    # SIGSTOP: the peer's sockets stay open, so only the process-group timeout can end the wait
    rc, took, out = stop_one_rank(tiny, signal.SIGSTOP, 10, "hung")
    assert rc != 0, out
    # one line, whichever collective waited (gloo words the timeout differently in each)
    assert re.search(r"error: rank 0: a collective timed out after ddp.timeout_s=10 s .*another rank died or hung",
                     out), out[-3000:]
    assert took < 10 + 30, f"the surviving rank took {took:.0f}s to fail:\n{out[-3000:]}"
    assert "tokenizer step 5000/5000" not in out


COMPILED_DDP = textwrap.dedent("""
    import json, sys, types
    import torch, torch._dynamo
    import torch._functorch._aot_autograd.runtime_wrappers as RW
    from wm.utils import distributed as D
    from wm.config.loading import load
    import wm.training.loop as L
    import wm.training.wrappers as W
    from wm.training.stages import WorldStage
    from wm.models.world import WorldModel

    tangents = []  # every activation gradient a compiled backward is handed (the loss terms are 0-dim)
    coerce = RW.coerce_to_expected_memory_format
    RW.coerce_to_expected_memory_format = lambda x, mf: (tangents.append(list(x.shape)) if x.dim() else None) or coerce(x, mf)
    compile_ = torch.compile  # Dynamo and AOTAutograd as on a GPU, without Inductor's C++ build
    torch.compile = lambda m, **kw: compile_(m, backend="aot_eager")
    cfg = load(None, ["world.widths=64,128", "world.heads=2", "world.temporal_layers=1", "compile.enable=true",
                      "ddp.bucket_mib=1", "train.world_crop=0"])  # buckets: the splits
    d = D.init("cpu", 60)
    out = {}
    for compiled in (True, False):
        torch.manual_seed(0)
        model = WorldModel(cfg.world, 16)
        opt = L.make_optimizer(model, cfg.world_stage, d.device)
        ddp = W.wrap_ddp(model, cfg, d.device, d)
        fwd = W.compiled(ddp, cfg, {}) if compiled else ddp
        st = types.SimpleNamespace(cfg=cfg, name="world", after_step=lambda *a: None, prepare=lambda b: b)
        st.loss, st.samples = types.MethodType(WorldStage.loss, st), types.MethodType(WorldStage.samples, st)
        g = torch.Generator().manual_seed(1 + d.rank)
        batches = iter([{"codes": torch.randint(0, 16, (2, 4, 8, 8), generator=g),
                         "motion": torch.randn(2, 4, 3, generator=g)} for _ in range(2)])
        for _ in range(2):
            parts = types.SimpleNamespace(opt=opt, scaler=torch.amp.GradScaler("cpu", enabled=False), scfg=cfg.world_stage)
            L.train_step(st, L.Handles(model, ddp, fwd), parts, L.Env(d.device, None, d), lambda: next(batches))
        out[compiled] = {k: v.tolist() for k, v in model.state_dict().items()}
    print("RESULT " + json.dumps({"tangents": tangents, "compiled": out[True], "eager": out[False]}))
    D.close(d)
""")


# ---------------------------------------------------------------------------------------------
# DDP's gradient buckets: every gradient arrives with its bucket view's strides

BUCKETS = textwrap.dedent("""
    import json, sys, warnings, torch
    import wm.utils.distributed as D
    from wm.config.sections import Config
    from wm.training.wrappers import wrap_ddp
    from wm.models.tokenizer import Tokenizer, TokenizerConfig
    from wm.models.world import WorldConfig, WorldModel
    torch.set_num_threads(2)  # oneDNN takes the 1x1 convolutions (one thread: another kernel, NCHW gradients)
    d = D.init("cpu", 30)
    cfg = Config()
    torch.manual_seed(0)
    occ = torch.randint(0, 6, (4, 16, 16, 4), dtype=torch.uint8)
    codes, motion = torch.randint(0, 16, (4, 3, 8, 8)), torch.randn(4, 3, 3)

    def tok():
        return Tokenizer(TokenizerConfig(widths=(8, 16), codebook_size=16, code_dim=8, lovasz_weight=0,
                                         dead_code_steps=0), 6, (16, 16, 4))

    def world():
        return WorldModel(WorldConfig(widths=(8, 16), heads=2), 16)

    def tok_loss(m, i):
        return m(occ[i], logits=False)["loss"]

    def world_loss(m, i):
        return m(codes[i, :-1], motion[i, :-1], codes[i, 1:], motion[i, 1:])["loss"]

    out = {"warnings": [], "max_rel_diff": {}}
    for name, make, loss in (("tokenizer", tok, tok_loss), ("world", world, world_loss)):
        torch.manual_seed(1)
        ref = make()  # one process, the whole batch
        torch.manual_seed(1)
        model = make()
        ddp = wrap_ddp(model, cfg, d.device, d)
        half = slice(2 * d.rank, 2 * d.rank + 2)
        for step in range(2):  # set_to_none between steps, as the training loop does
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                loss(ddp, half).backward()
            out["warnings"] += [str(w.message).splitlines()[0] for w in seen if "stride" in str(w.message)]
            loss(ref, slice(0, 4)).backward()
            worst = 0.0
            for (k, a), b in zip(model.named_parameters(), ref.parameters()):
                err = (a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-12)
                worst = max(worst, float(err))
            out["max_rel_diff"][f"{name}{step}"] = worst
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    D.close(d)
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.slow
def test_compiled_ddp_runs_the_one_graph_a_single_gpu_runs():
    """Under DDP the model compiles as one graph, as on one GPU: no piece of a split graph is handed
    activation gradients across a bucket boundary (where Dynamo's DDP splitting fed one piece of the
    world model's backward layouts it did not trace, and a CUDA kernel read out of bounds), and two
    compiled steps give the eager DDP parameters."""
    for o in run_two_ranks(COMPILED_DDP, threads=1, timeout=300):
        assert o["tangents"] == [], o["tangents"][:5]
        for k, v in o["eager"].items():
            assert torch.allclose(torch.tensor(o["compiled"][k]), torch.tensor(v), atol=1e-5, rtol=1e-4), k


@pytest.mark.slow
def test_resume_on_one_rank_from_two_says_what_changed_and_still_ends_after_the_epochs(tiny):
    from helpers import Proc

    over = dict(tokenizer_stage__max_steps=0, tokenizer_stage__epochs=2, ddp__timeout_s=60)
    p = Proc(torchrun("--nproc_per_node", "2", "--master_port", str(free_port())) + tiny.args(**over))
    assert p.wait_for(r"^tokenizer step 2/12 ", 120), p.output  # 24 frames, 2 ranks x 2: 6 steps an epoch
    os.kill(worker_of(p.pid, 1), signal.SIGTERM)
    assert p.finish(120) == 0, p.output
    st = final(tiny.run_dir(), "tokenizer")
    step, consumed = st["step"], st["sampler"]["consumed"]
    assert st["sampler"]["epoch"] == 0 and consumed == 4 * step and len(st["rng"]) == 2

    one = tiny.spawn(**over)
    assert one.finish(240) == 0, one.output
    # on one rank a step takes 2 samples: the rest of epoch 0, then all of epoch 1
    total = step + (24 - consumed) // 2 + 12
    assert f"at step {step}/{total} (epoch 0)" in one.output, one.output
    assert (f"note: resumed on 1 rank from 2: a step now takes 2 samples (it took 4); the data order goes "
            f"on at sample {consumed} of epoch 0") in one.output, one.output
    assert f"{total} steps of 2 samples (batch 2 from tokenizer_stage.batch_size x grad_accum 1 x 1 rank)" in one.output
    end = final(tiny.run_dir(), "tokenizer")
    assert end["step"] == total and (end["sampler"]["epoch"], end["sampler"]["consumed"]) == (2, 0)


@pytest.mark.slow
def test_ddp_gradients_match_their_bucket_views_and_one_process():
    # a gradient whose strides differ from its bucket view's is copied into the bucket (DDP warns
    # "Grad strides do not match bucket view strides"): the tokenizer's decoder runs channels-last
    for o in run_two_ranks(BUCKETS, threads=2):
        assert o["warnings"] == [], o["warnings"]
        for k, v in o["max_rel_diff"].items():
            assert v < 1e-5, (k, v)


@pytest.mark.slow
def test_sigterm_to_one_nodes_launcher_saves_on_both_and_the_rerun_resumes(tiny):
    # tools/launch_multinode.sh as two "nodes" of one process each, a localhost c10d rendezvous;
    # SIGTERM to the process group of rank 0's node, as a preemption of that node sends it; the rerun
    # rendezvouses again and trains to the end as one run of two ranks
    n = 80  # steps: the SIGTERM lands after step 3, with seconds of steps to spare on a loaded 2-core machine
    over = dict(tokenizer_stage__max_steps=n, **DDP_EXACT)

    def nodes():
        from helpers import Proc

        port = free_port()
        env = {"RDZV_ENDPOINT": f"127.0.0.1:{port}", "NNODES": "2", "NPROC": "1", "MAX_RESTARTS": "0",
               "RDZV_ID": f"wm-test-{port}"}
        return [Proc(["bash", "tools/launch_multinode.sh", *tiny.args(out="nodes", **over)], env=env) for _ in range(2)]

    ps, workers = nodes(), set()
    try:
        deadline = time.monotonic() + 180
        while not any(p.wait_for(r"^tokenizer step 3/", 0.2) for p in ps):
            assert time.monotonic() < deadline and all(p.p.poll() is None for p in ps), ps[0].output + ps[1].output
        ranks = ranks_of(ps)
        workers.update(pid for _, pid in ranks.values())
        os.killpg(ps[ranks[0][0]].pid, signal.SIGTERM)
        rcs = [p.finish(60) for p in ps]  # each node saves and exits; finish fails the test on a hang
    finally:
        for c in workers:
            with contextlib.suppress(OSError):
                os.kill(c, signal.SIGKILL)
        for p in ps:
            p.kill_group()
    out = ps[0].output + ps[1].output
    assert rcs == [0, 0], (rcs, out[-4000:])
    m = re.search(r"tokenizer: preempted \(SIGTERM/SIGINT\); saved step (\d+)\.", out)
    assert m, out[-4000:]
    stopped = int(m.group(1))
    assert 3 <= stopped < n and final(tiny.run_dir("nodes"), "tokenizer")["step"] == stopped

    ps = nodes()
    try:
        rcs = [p.finish(240) for p in ps]
    finally:
        for p in ps:
            p.kill_group()
    out = ps[0].output + ps[1].output
    assert rcs == [0, 0], out[-4000:]
    assert f"at step {stopped}/{n}" in out and out.count(f"tokenizer step {n}/{n} ") == 1  # rank 0 alone speaks
    rd = tiny.run_dir("nodes")
    assert json.loads((rd / "config.json").read_text())["meta"]["world_size"] == 2
    assert json.loads((rd / "tokenizer" / "done.json").read_text())["step"] == n
    st = final(rd, "tokenizer")
    assert st["step"] == n and len(st["rng"]) == 2


DEAD_CODES = textwrap.dedent("""
    import json, types, torch
    import wm.utils.distributed as D
    from wm.models.tokenizer import Tokenizer, TokenizerConfig
    from wm.training.stages import TokenizerStage
    d = D.init("cpu", 30)
    torch.manual_seed(0)
    m = Tokenizer(TokenizerConfig(widths=(8, 16), codebook_size=4, code_dim=8, dead_code_steps=3), 6, (16, 16, 4))
    before = m.quantizer.codebook.weight.detach().clone()
    # code 0 was last used 5 forwards ago on rank 0 and just now on rank 1: it is alive;
    # code 1 has gone unused on both ranks for 4 forwards: it is dead
    m.quantizer.code_age.copy_(torch.tensor([5, 4, 0, 0]) if d.rank == 0 else torch.tensor([0, 4, 0, 1]))
    m.quantizer._recent_z = torch.randn(16, 8)
    TokenizerStage.after_step(types.SimpleNamespace(), m, d, torch.tensor(False))
    changed = (m.quantizer.codebook.weight != before).any(1).tolist()
    out = {"changed": changed, "age": m.quantizer.code_age.tolist()}
    D.close(d)
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.slow
def test_a_code_used_on_any_rank_is_not_reset_as_dead():
    for o in run_two_ranks(DEAD_CODES, threads=1):
        assert o["changed"] == [False, True, False, False], o
        assert o["age"] == [0, 0, 0, 0], o  # the reset code starts afresh; the others: the youngest rank's age


@pytest.mark.parametrize("text,timed_out", [
    ("Application timeout caused pair closure", True),  # gloo, a broadcast waiting on a stopped peer
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 10000ms for recv operation", True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:123", False),
])
def test_each_wording_of_a_lost_peer_is_a_collective_failure(text, timed_out):
    import wm.training.main as T

    assert T._collective_failure(RuntimeError(text)) and T._timed_out(RuntimeError(text)) == timed_out
    assert not T._collective_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
