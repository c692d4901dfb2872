"""wm.models.world: shapes (demo and OccWorld sizes on meta), learning a constant-velocity scene, causality,
rollout, activation checkpointing."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import OCCWORLD, count_checkpoints
from wm.config.loading import load
from wm.config.models import TokenizerConfig
from wm.config.models import WorldConfig
from wm.config.runtime import ActivationCheckpointConfig
from wm.models.layers import ResBlock, channels_last_grad, count_parameters, masked_cross_entropy
from wm.models.tokenizer import Tokenizer
from wm.models.world import TemporalLayer, WorldModel, compose_motion, displacement
from wm.utils.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on one thread: see conftest.one_thread


def tiny_cfg(**kw) -> WorldConfig:
    base = dict(widths=(16, 32, 32), temporal_layers=1, pose_layers=1, heads=4, blocks_per_level=1, max_frames=8)
    base.update(kw)
    return WorldConfig(**base)


def constant_velocity(n: int, k: int, size: int, frames: int, g: torch.Generator, cell: float = 1.6):
    """Random code texture seen by an ego moving one cell per frame in one of 4 directions (per sample):
    the token map shifts by one cell per frame. Motion = (x, y, yaw) relative to frame `frames // 2`."""
    canvas = torch.randint(0, k, (n, size + 2 * frames, size + 2 * frames), generator=g)
    dirs = torch.tensor([[1, 0], [-1, 0], [0, 1], [0, -1]])[torch.randint(0, 4, (n,), generator=g)]
    codes = torch.empty(n, frames, size, size, dtype=torch.long)
    motion = torch.zeros(n, frames, 3)
    ref = frames // 2
    for i in range(n):
        for t in range(frames):
            ox, oy = frames + int(dirs[i, 0]) * t, frames + int(dirs[i, 1]) * t
            codes[i, t] = canvas[i, ox : ox + size, oy : oy + size]
            motion[i, t, :2] = dirs[i].float() * (t - ref) * cell
    return codes.to(torch.int16), motion  # int16 like the token cache


def test_demo_shapes():
    torch.manual_seed(0)
    m = WorldModel(WorldConfig(), 128)
    codes = torch.randint(0, 128, (2, 6, 16, 16))
    motion = torch.randn(2, 6, 3)
    out = m(codes[:, :5], motion[:, :5])
    assert out["logits"].shape == (2, 5, 128, 16, 16)
    assert out["motion"].shape == (2, 5, 3)
    res = m.window_loss(codes, motion)
    for k in ("loss", "ce", "motion_l2", "acc", "copy_last_acc"):
        assert res[k].shape == () and torch.isfinite(res[k]), k
    res["loss"].backward()
    m.eval()
    with torch.no_grad():
        c, mo = m.rollout(codes[:, :3].to(torch.uint8), motion[:, :3], steps=4)
    assert c.shape == (2, 4, 16, 16) and c.dtype == torch.long and mo.shape == (2, 4, 3)
    # odd token maps (padding before stride-2 convs, crop after transposed convs)
    assert m(codes[:, :2, :13, :11], motion[:, :2])["logits"].shape == (2, 2, 128, 13, 11)


def test_occworld_sizes_on_meta():
    with torch.device("meta"):
        m = WorldModel(load(OCCWORLD).world, 512)
        out = m(torch.zeros(1, 15, 50, 50, dtype=torch.long), torch.zeros(1, 15, 3))
    n = count_parameters(m, trainable_only=True)
    assert 55e6 <= n <= 58e6, n  # OccWorld's world model: ~58 M trainable
    assert out["logits"].shape == (1, 15, 512, 50, 50)
    assert out["motion"].shape == (1, 15, 3)


def test_learns_constant_velocity_beats_copy_last():
    """Teacher-forced accuracy and a 2-step rollout from true past frames both beat copy-last clearly."""
    torch.manual_seed(0)
    k, size, frames = 16, 8, 6
    m = WorldModel(tiny_cfg(widths=(32, 64), heads=4), k)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    codes, motion = constant_velocity(32, k, size, frames, torch.Generator().manual_seed(123))
    copy_roll = float((codes[:, 3:4].long() == codes[:, 4:].long()).float().mean())
    for step in range(1, 151):  # ~20-30 steps needed; ~0.8 accuracy by 150
        r = m.window_loss(*constant_velocity(16, k, size, frames, g))
        opt.zero_grad()
        r["loss"].backward()
        opt.step()
        if step % 10 == 0:
            m.eval()
            with torch.no_grad():
                e = m.window_loss(codes, motion)
                pred, _ = m.rollout(codes[:, :4], motion[:, :4], steps=2)
            m.train()
            acc, copy_acc = float(e["acc"]), float(e["copy_last_acc"])
            rollout_acc = float((pred == codes[:, 4:].long()).float().mean())
            if acc > copy_acc + 0.2 and rollout_acc > copy_roll + 0.1:
                break
    assert acc > copy_acc + 0.2, f"after {step} steps: accuracy {acc:.3f} vs copy-last {copy_acc:.3f}"
    assert rollout_acc > copy_roll + 0.1, f"after {step} steps: rollout {rollout_acc:.3f} vs copy-last {copy_roll:.3f}"


def test_scene_features_stay_channels_last_and_the_layouts_agree():
    """kernels.world_channels_last: every temporal layer reads the scene features as a (B, T, h*w, C) view of the
    channels-last (B*T, C, h, w) tensor (no copy), every convolution reads channels-last input, and the
    model with NCHW conv weights is the same function of the same parameters."""
    torch.manual_seed(0)
    cl = WorldModel(tiny_cfg(), 32)
    nchw = WorldModel(tiny_cfg(), 32, channels_last=False)
    nchw.load_state_dict(cl.state_dict())
    assert cl.out_conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert nchw.out_conv.weight.is_contiguous() and not nchw.out_conv.weight.is_contiguous(memory_format=torch.channels_last)
    seen = []
    for mod in cl.modules():
        if isinstance(mod, (TemporalLayer, nn.Conv2d, nn.ConvTranspose2d)):
            mod.register_forward_pre_hook(lambda m, a: seen.append((type(m).__name__, a[0])))
    codes = torch.randint(0, 32, (2, 5, 8, 8))
    motion = torch.randn(2, 5, 3)
    outs = [m(codes, motion) for m in (cl, nchw)]
    temporal = [x for kind, x in seen if kind == "TemporalLayer"]
    convs = [x for kind, x in seen if kind != "TemporalLayer"]
    assert len(temporal) == 4 and len(convs) >= 10  # one temporal layer on each of 2 encoder + 2 decoder levels
    for x in temporal:
        assert x.dim() == 4 and x.shape[:2] == (2, 5) and x.is_contiguous() and x._base is not None, x.shape
    for x in convs:
        assert x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 1, x.shape
    for k in ("logits", "motion"):
        assert torch.allclose(outs[0][k], outs[1][k], atol=1e-5, rtol=1e-5), k
    # torch.compile lays tensors out by their meta strides, and on meta GroupNorm's result is NCHW: the
    # residual blocks still hand their convolutions input in x's layout (else a copy per convolution)
    blk = ResBlock(8, 16).to("meta", memory_format=torch.channels_last)
    convs.clear()
    for conv in (blk.conv1, blk.conv2, blk.shortcut):
        conv.register_forward_pre_hook(lambda m, a: convs.append(a[0]))
    blk(torch.empty(2, 8, 4, 4, device="meta").contiguous(memory_format=torch.channels_last))
    blk(torch.empty(2, 8, 4, 4, device="meta"))
    assert [x.is_contiguous(memory_format=torch.channels_last) for x in convs] == [True] * 3 + [False] * 3


def test_convolutions_get_their_output_gradients_channels_last():
    """cuDNN's convolution backward converts grad_output to its input's layout: every convolution of the
    channels-last model gets it channels-last already (channels_last_grad; NCHW tensors pass through
    untouched), and both models' parameter gradients agree."""
    torch.manual_seed(0)
    cl = WorldModel(tiny_cfg(), 32)
    nchw = WorldModel(tiny_cfg(), 32, channels_last=False)
    nchw.load_state_dict(cl.state_dict())
    codes, motion = torch.randint(0, 32, (2, 6, 8, 8)), torch.randn(2, 6, 3)
    grads = {}
    for name, m in (("cl", cl), ("nchw", nchw)):
        seen = grads[name] = []
        for mod in m.modules():
            if isinstance(mod, (nn.Conv2d, nn.ConvTranspose2d)):
                mod.register_full_backward_pre_hook(lambda mod, g, seen=seen: seen.append(g[0]))
        m(codes[:, :-1], motion[:, :-1], codes[:, 1:], motion[:, 1:])["loss"].backward()
    n = sum(isinstance(mod, (nn.Conv2d, nn.ConvTranspose2d)) for mod in cl.modules())
    assert len(grads["cl"]) == len(grads["nchw"]) == n > 10
    assert all(g.is_contiguous(memory_format=torch.channels_last) and not g.is_contiguous() for g in grads["cl"])
    x = torch.randn(2, 8, 4, 4, requires_grad=True)  # NCHW: x itself, no autograd node
    assert channels_last_grad(x) is x and channels_last_grad(x.contiguous(memory_format=torch.channels_last)) is not x
    for (k, a), b in zip(cl.named_parameters(), nchw.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), k


def _ancestors(e) -> list[str]:
    names, p = [], e.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    return names


@pytest.mark.parametrize("masked", [False, True])
def test_channels_last_logits_take_the_cross_entropy_by_rows(masked):
    """With channels-last logits the CE runs over (cells, K) rows, a view: its log-softmax copies
    nothing, where the CE over dim 1 of the same logits copies them, and value and gradient are that
    CE's. Training's call (the targets passed to forward) gives the same terms."""
    torch.manual_seed(0)
    m = WorldModel(tiny_cfg(), 32)
    codes, motion = torch.randint(0, 32, (2, 6, 8, 8)), torch.randn(2, 6, 3)
    mask = (torch.rand(2, 5, 8, 8) < 0.5) if masked else None
    out = m(codes[:, :-1], motion[:, :-1])
    logits = out["logits"]
    assert logits.flatten(0, 1).is_contiguous(memory_format=torch.channels_last) and not logits.is_contiguous()

    def softmax_copies(fn):
        with torch.profiler.profile() as prof:
            r = fn()
        return r, [e for e in prof.events() if e.name == "aten::copy_" and "aten::_log_softmax" in _ancestors(e)]

    r, copies = softmax_copies(lambda: m.loss(out, codes[:, 1:], motion[:, 1:], mask))
    assert copies == []
    lg, tg = logits.flatten(0, 1), codes[:, 1:].flatten(0, 1)  # (B*T, K, h, w): the CE over dim 1
    ref, copies = softmax_copies(lambda: F.cross_entropy(lg, tg) if mask is None
                                 else masked_cross_entropy(lg, tg, mask.flatten(0, 1)))
    assert len(copies) == 1
    assert torch.allclose(r["ce"], ref, rtol=1e-6, atol=1e-6), (r["ce"], ref)
    (g,) = torch.autograd.grad(r["ce"], logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-8)
    inside = m(codes[:, :-1], motion[:, :-1], codes[:, 1:], motion[:, 1:], mask)
    assert inside.keys() == r.keys() and all(torch.equal(inside[k], r[k]) for k in r)


def test_teacher_forced_forward_is_causal():
    torch.manual_seed(0)
    m = WorldModel(tiny_cfg(), 32).eval()
    codes = torch.randint(0, 32, (2, 6, 8, 8))
    motion = torch.randn(2, 6, 3)
    base = m(codes, motion)
    for t in (0, 2, 4):  # change frame t+1 (codes and motion): outputs at <= t must not move
        c2, m2 = codes.clone(), motion.clone()
        c2[:, t + 1] = torch.randint(0, 32, (2, 8, 8))
        m2[:, t + 1] += 1.0
        out = m(c2, m2)
        assert torch.allclose(out["logits"][:, : t + 1], base["logits"][:, : t + 1], atol=1e-6)
        assert torch.allclose(out["motion"][:, : t + 1], base["motion"][:, : t + 1], atol=1e-6)
        assert not torch.allclose(out["logits"][:, t + 1], base["logits"][:, t + 1])  # and it does matter


def test_rollout_horizon_and_causality():
    torch.manual_seed(0)
    m = WorldModel(tiny_cfg(max_frames=6), 32).eval()
    past = torch.randint(0, 32, (2, 4, 8, 8))
    past_motion = torch.randn(2, 4, 3)
    fut = torch.randn(2, 5, 3)
    with torch.no_grad():
        c5, m5 = m.rollout(past, past_motion, steps=5)
        c2, m2 = m.rollout(past, past_motion, steps=2)
        assert c5.shape == (2, 5, 8, 8) and m5.shape == (2, 5, 3)
        assert torch.equal(c2, c5[:, :2]) and torch.allclose(m2, m5[:, :2])  # shorter horizon = prefix
        # the first step equals the teacher-forced prediction at the last past frame
        tf = m(past, past_motion)
        assert torch.equal(c5[:, 0], tf["logits"][:, -1].argmax(1))
        assert torch.allclose(m5[:, 0], tf["motion"][:, -1], atol=1e-6)
        # given future motion is returned as is and only affects later steps
        cg, mg = m.rollout(past, past_motion, steps=5, future_motion=fut)
        assert torch.equal(mg, fut)
        assert torch.equal(cg[:, 0], c5[:, 0])  # step 0 sees no future motion
        for s in range(4):
            fut2 = fut.clone()
            fut2[:, s] += 3.0
            cs, ms = m.rollout(past, past_motion, steps=5, future_motion=fut2)
            assert torch.equal(cs[:, : s + 1], cg[:, : s + 1]), s
            assert torch.equal(ms[:, :s], mg[:, :s])


def test_cached_rollout_is_the_full_recompute():
    """rollout's key/value cache (only the new frame runs through the trunk) gives the rollout that
    recomputes every frame at every step: the same codes, motion to float rounding, with predicted and
    with given motion, 1 and 2 pose/temporal layers; a rollout past max_frames slides the window and
    does not use the cache; step() with a cache returns the full pass's last-frame prediction."""
    torch.manual_seed(0)
    for kw in (dict(), dict(temporal_layers=2, pose_layers=2, blocks_per_level=2)):
        m = WorldModel(tiny_cfg(max_frames=8, **kw), 32).eval()
        for p in m.parameters():  # a trained model's scale: argmax margins as a real rollout sees
            p.data.mul_(3.0) if p.dim() > 1 else None
        past, past_motion = torch.randint(0, 32, (3, 4, 8, 8)), torch.randn(3, 4, 3)
        fut = torch.randn(3, 5, 3)
        with torch.no_grad():
            for given in (None, fut):
                c1, m1 = m.rollout(past, past_motion, 5, future_motion=given, cache=True)
                c0, m0 = m.rollout(past, past_motion, 5, future_motion=given, cache=False)
                assert torch.equal(c1, c0)
                assert torch.allclose(m1, m0, atol=1e-5)
            kv = m.rollout_cache(3, 8, 8, 8, torch.device("cpu"), torch.float32)
            codes, motion = torch.randint(0, 32, (3, 7, 8, 8)), torch.randn(3, 7, 3)
            for t0, t in ((0, 3), (3, 4), (4, 7)):  # frames 0..2 at once, then one, then three more
                # the new frames' codes; their poses and, after the first call, the one before them
                got = m.step(codes[:, t0:t], motion[:, max(t0 - 1, 0):t], kv)
                ref = m.step(codes[:, :t], motion[:, :t])
                assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5), t
            assert int(kv.pos) == 7
    # past 4 + 6 steps needs 9 > max_frames=8 input frames: the window slides, no cache, same as before
    with torch.no_grad():
        c1, _ = m.rollout(past, past_motion, 6, cache=True)
        c0, _ = m.rollout(past, past_motion, 6, cache=False)
    assert torch.equal(c1, c0)


def test_packed_cache_step_is_the_full_recompute():
    """cached_step (the exported world_step's function): the new frames against a (B, L, F) cache
    they do not write, their rows returned; with the rows written back at their slots, any split of
    the frames into calls gives step()'s prediction on all of them, whatever the unwritten slots
    hold. The host loop over it (wm.export.deployed.world_steps) is rollout(cache=False), also
    where the window slides past max_frames."""
    from wm.export.deployed import world_steps
    from wm.models.world import kv_row_width

    torch.manual_seed(0)
    cfg = tiny_cfg(max_frames=8, temporal_layers=2, pose_layers=2)
    m = WorldModel(cfg, 32).eval()
    for p in m.parameters():
        p.data.mul_(3.0) if p.dim() > 1 else None
    F = m.kv_width(8, 8)
    # by hand: per level (8x8, 4x4 maps; decoder at twice the width) 2 temporal layers of cells x
    # width keys and values per frame, and 2 pose layers of width
    assert F == 2 * 2 * (64 * 16 + 16 * 16 + 16 * 64 + 64 * 32) + 2 * 2 * (16 + 16 + 64 + 32)
    assert kv_row_width(cfg, 32, 8, 8) == F
    codes, motion = torch.randint(0, 32, (3, 7, 8, 8)), torch.randn(3, 7, 3)
    with torch.no_grad():
        kv = torch.randn(3, 8, F) * 100  # unwritten slots: any finite values
        for t0, t in ((0, 3), (3, 4), (4, 7)):
            nxt, mot, rows = m.cached_step(codes[:, t0:t], motion[:, :t], kv)
            assert rows.shape == (3, t - t0, F)
            ref = m.step(codes[:, :t], motion[:, :t])
            assert torch.equal(nxt, ref[0]) and torch.allclose(mot, ref[1], atol=1e-5), t
            kv[:, t0:t] = rows
        with pytest.raises(ValueError, match="rows of 5 values, this model's layers need"):
            m.cached_step(codes[:, :2], motion[:, :2], torch.zeros(3, 1, 5))

        class Torch:  # the graph runner protocol of wm.export.deployed over the module itself
            def __call__(self, name, *x):
                return m.cached_step(*x)

        run = Torch()
        wcfg = SimpleNamespace(world=cfg, tokenizer=SimpleNamespace(codebook_size=32))
        past, past_motion = codes[:, :4], motion[:, :4]
        for steps in (4, 6):  # 4 + 4 - 1 frames fit max_frames=8; 4 + 6 - 1 slide
            got, got_m = world_steps(run, wcfg, past, past_motion, steps)
            ref, ref_m = m.rollout(past, past_motion, steps, cache=False)
            assert torch.equal(got[:, 4:], ref) and torch.allclose(got_m[:, 4:], ref_m, atol=1e-5), steps


def test_a_compiled_rollout_is_two_graphs_whatever_its_length():
    # with the rollout cache every step after the first has the same shapes: compiled, a 6-step
    # rollout is the past frames' graph and one frame's, and the next rollout compiles nothing
    torch.manual_seed(0)
    m = WorldModel(tiny_cfg(max_frames=16, temporal_layers=2, pose_layers=2), 32).eval()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(m.step, backend=count, dynamic=False)
    past, past_motion = torch.randint(0, 32, (2, 5, 8, 8)), torch.randn(2, 5, 3)
    try:
        with torch.no_grad():
            ref = m.rollout(past, past_motion, 6)
            got = m.rollout(past, past_motion, 6, step=step)
            assert len(graphs) == 2
            m.rollout(torch.randint(0, 32, (2, 5, 8, 8)), torch.randn(2, 5, 3), 6, step=step)
            assert len(graphs) == 2
    finally:
        torch._dynamo.reset()
    assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5)


def test_motion_helpers_and_constant_velocity_prior():
    poses = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.5, 0.1], [1.9, 1.2, 0.2]]])
    d = displacement(poses)
    assert torch.allclose(d[:, 0], torch.zeros(1, 3))
    assert torch.allclose(compose_motion(poses[:, :-1], d[:, 1:]), poses[:, 1:], atol=1e-6)
    # an untrained model predicts constant velocity (zero-initialised displacement head)
    m = WorldModel(tiny_cfg(), 8).eval()
    traj = torch.stack([torch.tensor([t * 2.0, 0.0, 0.0]) for t in range(-3, 1)])[None]  # 2 m / frame along x
    with torch.no_grad():
        _, fut = m.rollout(torch.zeros(1, 4, 8, 8, dtype=torch.long), traj, steps=3)
    assert torch.allclose(fut, torch.tensor([[[2.0, 0, 0], [4.0, 0, 0], [6.0, 0, 0]]]), atol=1e-5)


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_same_gradients(every, monkeypatch):
    import wm.models.layers

    calls = count_checkpoints(monkeypatch, wm.models.layers)
    torch.manual_seed(0)
    base = WorldModel(tiny_cfg(widths=(16, 32), blocks_per_level=2, temporal_layers=2), 32)
    ck = copy.deepcopy(base)
    ck.checkpoint_every = every
    codes = torch.randint(0, 32, (2, 5, 8, 8))
    motion = torch.randn(2, 5, 3)
    ra = base.window_loss(codes, motion)
    assert not calls
    rb = ck.window_loss(codes, motion)
    # blocks: per level (1 encoder, 1 decoder) temporal 2 + pose 1 + res 2, plus 2 bottom res blocks = 12
    assert len(calls) == (12 + every - 1) // every
    ra["loss"].backward()
    rb["loss"].backward()
    assert torch.allclose(ra["loss"], rb["loss"], atol=1e-6)
    for (name, pa), pb in zip(base.named_parameters(), ck.parameters()):
        assert pa.grad is not None, name
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6, rtol=0), name
    calls.clear()
    with torch.no_grad():
        ck.window_loss(codes, motion)
    assert not calls


def test_init_code_embedding_from_tokenizer():
    tok = Tokenizer(TokenizerConfig(widths=(8, 8, 16), codebook_size=32, code_dim=16), 6, (16, 16, 2))
    m = WorldModel(tiny_cfg(), 32)
    m.init_code_embedding(tok.codebook, freeze=True)
    assert torch.equal(m.code_embed.weight, tok.codebook)
    assert not m.code_embed.weight.requires_grad
    assert count_parameters(m, trainable_only=True) == count_parameters(m) - 32 * 16
    with pytest.raises(ValueError):
        WorldModel(tiny_cfg(widths=(32, 32)), 32).init_code_embedding(tok.codebook)


def test_validate():
    WorldConfig().validate()
    load(OCCWORLD).world.validate()
    for kw, key in (
        (dict(widths=(32,)), "widths"),
        (dict(heads=3), "heads"),
        (dict(max_frames=0), "max_frames"),
        (dict(motion_weight=-1.0), "motion_weight"),
    ):
        with pytest.raises(ConfigError) as e:
            WorldConfig(**kw).validate()
        assert e.value.key == key
    with pytest.raises(ConfigError) as e:
        ActivationCheckpointConfig(world_every=-1).validate()
    assert e.value.key == "world_every"
    m = WorldModel(tiny_cfg(max_frames=4), 8)
    with pytest.raises(ValueError):
        m(torch.zeros(1, 5, 8, 8, dtype=torch.long), torch.zeros(1, 5, 3))
    # rollout slides a max_frames window, so long pasts and horizons still work
    with torch.no_grad():
        c, _ = m.eval().rollout(torch.zeros(1, 6, 8, 8, dtype=torch.long), torch.zeros(1, 6, 3), steps=3)
    assert c.shape == (1, 3, 8, 8)


def test_short_causal_attention_is_sdpa_causal():
    """The temporal layers' matmul attention computes what SDPA's causal attention does (float64)."""
    import torch.nn.functional as F

    from wm.models.world import short_causal_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 4, 11, 16, dtype=torch.float64, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(short_causal_attention(q, k, v), want, rtol=1e-12, atol=1e-12)
    # causal: the first frame's output depends on nothing after it
    v2 = v.clone()
    v2[:, :, 1:] += 1.0
    assert torch.equal(short_causal_attention(q, k, v2)[:, :, 0], short_causal_attention(q, k, v)[:, :, 0])
