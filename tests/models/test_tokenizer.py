"""wm.models.tokenizer: shapes (demo and OccWorld sizes on meta), overfitting, Lovasz, VQ, checkpointing."""

import copy

import pytest
import torch

from helpers import OCCWORLD, count_checkpoints
from wm.config.loading import load
from wm.config.models import TokenizerConfig
from wm.config.runtime import ActivationCheckpointConfig
from wm.models.layers import count_parameters
from wm.models.lovasz import lovasz_softmax
from wm.models.tokenizer import Tokenizer
from wm.utils.errors import ConfigError, DataError

FREE = 5  # free class of the synthetic test frames (6 classes: 0 ground, 1-4 objects, 5 free)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on one thread: see conftest.one_thread


def tiny_cfg(**kw) -> TokenizerConfig:
    base = dict(widths=(8, 8, 16), blocks_per_level=1, codebook_size=16, code_dim=8)
    base.update(kw)
    return TokenizerConfig(**base)


def synthetic_frames(n: int, x: int = 32, y: int = 32, z: int = 4, seed: int = 1) -> torch.Tensor:
    """Ground layer (class 0), a few boxes of classes 1-4 on it, free (5) elsewhere. uint8 (n, x, y, z)."""
    g = torch.Generator().manual_seed(seed)
    occ = torch.full((n, x, y, z), FREE, dtype=torch.uint8)
    occ[..., 0] = 0
    for i in range(n):
        for _ in range(5):
            cls = int(torch.randint(1, 5, (1,), generator=g))
            x0, y0 = torch.randint(0, x - 6, (2,), generator=g).tolist()
            sx, sy = torch.randint(2, 7, (2,), generator=g).tolist()
            hz = int(torch.randint(1, z, (1,), generator=g))
            occ[i, x0 : x0 + sx, y0 : y0 + sy, 1 : 1 + hz] = cls
    return occ


def iou(pred: torch.Tensor, target: torch.Tensor) -> float:
    p, t = pred != FREE, target != FREE
    return float((p & t).sum() / (p | t).sum())


def test_demo_shapes_and_outputs():
    torch.manual_seed(0)
    cfg = TokenizerConfig()
    m = Tokenizer(cfg, 18, (64, 64, 8))
    occ = torch.randint(0, 18, (2, 3, 64, 64, 8), dtype=torch.uint8)  # (B, T, X, Y, Z)
    out = m(occ)
    assert out["logits"].shape == (2, 3, 18, 64, 64, 8)
    assert out["codes"].shape == (2, 3, 16, 16) and out["codes"].dtype == torch.long
    for k in ("loss", "ce", "lovasz", "vq", "perplexity", "code_usage", "dead_codes"):
        assert out[k].shape == () and torch.isfinite(out[k]), k
    assert 1.0 <= float(out["perplexity"]) <= cfg.codebook_size
    assert 0.0 < float(out["code_usage"]) <= 1.0
    m.eval()
    with torch.no_grad():
        codes = m.encode(occ[:, 0])
        assert codes.shape == (2, 16, 16) and codes.dtype == torch.long
        assert int(codes.min()) >= 0 and int(codes.max()) < cfg.codebook_size
        assert torch.equal(codes, m.encode(occ[:, 0].long()))  # uint8 and long inputs agree
        logits = m.decode(codes)
        assert logits.shape == (2, 18, 64, 64, 8)
        assert torch.equal(m.encode(occ), m(occ)["codes"])  # eval forward codes == encode
    assert m.codebook.shape == (cfg.codebook_size, cfg.code_dim)


@pytest.mark.parametrize("widths,d", [((8,), 1), ((8, 16), 2), ((8, 8, 16), 4), ((8, 8, 8, 16), 8)])
def test_levels_set_the_token_grid(widths, d):
    """len(widths) levels: len - 1 stride-2 downsamples, a token per d x d columns, and a decoder that
    mirrors them back to the full grid; the token mask pools the same d x d cells."""
    torch.manual_seed(0)
    m = Tokenizer(tiny_cfg(widths=widths), 6, (16, 16, 2))
    assert m.downsample == m.cfg.downsample == d and m.token_shape == (16 // d, 16 // d)
    occ = torch.randint(0, 6, (2, 16, 16, 2), dtype=torch.uint8)
    out = m(occ)
    assert out["codes"].shape == (2, 16 // d, 16 // d) and out["logits"].shape == (2, 6, 16, 16, 2)
    out["loss"].backward()
    assert all(p.grad is not None for p in m.encoder.parameters())
    n_attn = sum(type(b).__name__ == "AttnBlock" for b in m.encoder)
    assert n_attn == 2  # the lowest level's block (one per level) and the middle one
    mask = torch.zeros(1, 16, 16, 2, dtype=torch.uint8)
    mask[0, 15, 0, 1] = 1
    assert m.token_mask(mask).nonzero().tolist() == [[0, 15 // d, 0]]


def test_occworld_sizes_on_meta():
    cfg = load(OCCWORLD).tokenizer
    with torch.device("meta"):
        m = Tokenizer(cfg, 18, (200, 200, 16))
        out = m(torch.zeros(1, 2, 200, 200, 16, dtype=torch.uint8))
    n = count_parameters(m)
    assert 13.5e6 < n < 14.5e6, n  # OccWorld's VQ-VAE: ~14 M
    assert out["logits"].shape == (1, 2, 18, 200, 200, 16)
    assert out["codes"].shape == (1, 2, 50, 50)
    assert m.codebook.shape == (512, 128)


def test_overfits_small_batch():
    """Reconstruction IoU (occupied vs free) > 0.9, also on the box layers alone (ground excluded)."""
    torch.manual_seed(0)
    occ = synthetic_frames(4)
    m = Tokenizer(TokenizerConfig(dead_code_steps=20), 6, (32, 32, 4))  # demo sizes otherwise
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    best = (0.0, 0.0)
    for step in range(1, 401):  # converges in ~160-200 steps
        out = m(occ)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        m.reset_dead_codes()
        if step % 20 == 0:
            m.eval()
            with torch.no_grad():
                pred = m.decode(m.encode(occ)).argmax(1)
            m.train()
            best = (iou(pred, occ), iou(pred[..., 1:], occ[..., 1:]))
            if min(best) > 0.9:
                break
    assert min(best) > 0.9, f"IoU (all, boxes) after {step} steps: {best}"


def reference_lovasz(probs, labels, classes="present"):
    """Berman et al.'s lovasz_softmax_flat (classes='present' or 'all'), one class at a time."""
    losses = []
    for c in range(probs.shape[1]):
        fg = (labels == c).to(probs.dtype)
        if classes == "present" and fg.sum() == 0:
            continue
        errors = (fg - probs[:, c]).abs()
        errors_sorted, perm = torch.sort(errors, 0, descending=True)
        fg_sorted = fg[perm]
        gts = fg_sorted.sum()
        jaccard = 1.0 - (gts - fg_sorted.cumsum(0)) / (gts + (1 - fg_sorted).cumsum(0))
        jaccard[1:] = jaccard[1:] - jaccard[:-1]
        losses.append(torch.dot(errors_sorted, jaccard))
    return torch.stack(losses).mean()


@pytest.mark.parametrize(
    "points,chunk_elements",
    [(500, 1 << 27), (500, 1000), (9000, 1 << 27)],  # all classes at once; 2 classes a chunk; blocked scans
)
def test_lovasz_matches_reference_value_and_grad(points, chunk_elements, monkeypatch):
    import wm.models.lovasz

    monkeypatch.setattr(wm.models.lovasz, "CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    logits = torch.randn(points, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (points,))  # class 5 absent: excluded as in classes='present'
    ours = lovasz_softmax(logits.softmax(1), labels)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = reference_lovasz(logits.softmax(1), labels)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(ours, ref, atol=1e-12)
    assert torch.allclose(g_ours, g_ref, atol=1e-12)
    ours_all = lovasz_softmax(logits.softmax(1), labels, present_only=False)
    assert torch.allclose(ours_all, reference_lovasz(logits.softmax(1), labels, "all"), atol=1e-12)
    # perfect prediction -> zero loss
    perfect = torch.nn.functional.one_hot(labels, 6).double()
    assert float(lovasz_softmax(perfect, labels)) == 0.0


def test_quantizer_picks_exact_nearest_code():
    torch.manual_seed(0)
    q = Tokenizer(tiny_cfg(codebook_size=64, code_dim=16), 6, (16, 16, 2)).quantizer
    with torch.no_grad():
        q.codebook.weight.normal_()
    z = torch.randn(2000, 16)
    expected = torch.cdist(z.double(), q.codebook.weight.double()).argmin(1)
    assert torch.equal(q.nearest(z), expected)
    # straight-through output equals the selected codes, with the commitment/codebook loss
    zq, codes, vq, stats = q(z.t().reshape(1, 16, 40, 50))
    assert torch.allclose(zq.reshape(16, -1).t(), q.codebook.weight[expected], atol=1e-6)
    assert torch.equal(codes.flatten(), expected)
    assert float(vq.detach()) > 0 and 1 <= float(stats["perplexity"]) <= 64


def test_straight_through_gradient_reaches_encoder():
    torch.manual_seed(0)
    m = Tokenizer(tiny_cfg(vq_weight=0.0), 6, (16, 16, 2))  # no VQ term: only the decoder path remains
    out = m(synthetic_frames(2, 16, 16, 2))
    out["loss"].backward()
    for p in (m.enc_in.weight, m.enc_out.weight, m.class_embed.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    # and the codebook gets its gradient from the VQ term only
    assert m.quantizer.codebook.weight.grad is None or m.quantizer.codebook.weight.grad.abs().sum() == 0


def test_dead_code_reset_replaces_unused_codes():
    def run(seed):
        torch.manual_seed(seed)
        m = Tokenizer(tiny_cfg(dead_code_steps=2, codebook_size=64), 6, (16, 16, 2))
        occ = synthetic_frames(2, 16, 16, 2)
        before = m.codebook.detach().clone()
        with torch.no_grad():
            m(occ)
            assert m.reset_dead_codes() == 0  # nothing is 2 forwards old yet
            out = m(occ)
        age = m.quantizer.code_age.clone()
        dead = age >= 2
        assert int(out["dead_codes"]) == int(dead.sum()) > 0
        z = m.quantizer._recent_z
        # the training loop's skipped step (flag on the device): nothing changes, the codes stay dead
        assert m.reset_dead_codes(skip=torch.tensor(True)) == 0
        assert torch.equal(m.codebook, before) and torch.equal(m.quantizer.code_age, age)
        n = m.reset_dead_codes(skip=torch.tensor(False))
        assert n == int(dead.sum())
        after = m.codebook.detach()
        assert torch.equal(after[~dead], before[~dead])  # used codes untouched
        assert not torch.equal(after[dead], before[dead])
        # every reset code is one of the current encoder outputs
        assert bool((after[dead][:, None, :] == z[None]).all(-1).any(1).all())
        assert int(m.quantizer.code_age[dead].sum()) == 0
        assert m.reset_dead_codes() == 0
        return after.clone()

    assert torch.equal(run(0), run(0))  # deterministic given the torch RNG


def test_dead_code_reset_off():
    torch.manual_seed(0)
    m = Tokenizer(tiny_cfg(dead_code_steps=0), 6, (16, 16, 2))
    before = m.codebook.detach().clone()
    with torch.no_grad():
        for _ in range(3):
            m(synthetic_frames(1, 16, 16, 2))
    assert m.reset_dead_codes() == 0 and torch.equal(m.codebook, before)


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_same_gradients(every, monkeypatch):
    import wm.models.layers as layers
    import wm.models.tokenizer as tk

    calls = count_checkpoints(monkeypatch, layers)
    torch.manual_seed(0)
    base = Tokenizer(tiny_cfg(blocks_per_level=2), 6, (16, 16, 2))
    ck = copy.deepcopy(base)
    ck.checkpoint_every = every
    occ = synthetic_frames(2, 16, 16, 2)
    out_a = base(occ)
    assert not calls
    out_b = ck(occ)
    n_blocks = sum(isinstance(b, (layers.ResBlock, tk.AttnBlock)) for b in [*ck.encoder, *ck.decoder])
    assert len(calls) == (n_blocks + every - 1) // every
    out_a["loss"].backward()
    out_b["loss"].backward()
    assert torch.equal(out_a["codes"], out_b["codes"])
    assert torch.allclose(out_a["loss"], out_b["loss"], atol=1e-6)
    for (name, pa), pb in zip(base.named_parameters(), ck.parameters()):
        assert pa.grad is not None, name
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6, rtol=0), name
    calls.clear()
    with torch.no_grad():  # never when grad is off
        ck(occ)
    ck.eval()
    ck(occ)  # nor in eval mode
    assert not calls


def test_validate_and_grid_errors():
    with pytest.raises(ConfigError, match="1 to 4 levels") as e:
        TokenizerConfig(widths=(8, 8, 8, 8, 8)).validate()
    assert e.value.key == "widths"
    with pytest.raises(ConfigError) as e:
        TokenizerConfig(widths=(16, 30)).validate()
    assert e.value.key == "widths"
    with pytest.raises(ConfigError) as e:
        TokenizerConfig(codebook_size=1).validate()
    assert e.value.key == "codebook_size"
    with pytest.raises(ConfigError) as e:
        ActivationCheckpointConfig(tokenizer_every=-1).validate()
    assert e.value.key == "tokenizer_every"
    with pytest.raises(ConfigError) as e:
        TokenizerConfig(attn_heads=3).validate()
    assert e.value.key == "attn_heads"
    TokenizerConfig().validate()
    load(OCCWORLD).tokenizer.validate()
    with pytest.raises(DataError, match="divisible by 4"):
        Tokenizer(tiny_cfg(), 6, (30, 32, 4))
    with pytest.raises(DataError, match="divisible by 2"):
        Tokenizer(tiny_cfg(widths=(8, 16)), 6, (31, 32, 4))
    Tokenizer(tiny_cfg(widths=(8, 16)), 6, (30, 32, 4))  # one downsample: 30 is fine
    m = Tokenizer(tiny_cfg(), 6, (16, 16, 2))
    with pytest.raises(ValueError):
        m.encode(torch.zeros(1, 16, 16, 3, dtype=torch.uint8))


def test_class_weights_from_frequencies_by_hand():
    """class_weight_power p: weight (share) ** -p relative to the most frequent class, capped at
    class_weight_max; a class never seen gets the cap."""
    m = Tokenizer(tiny_cfg(class_weight_power=0.5, class_weight_max=20.0), 4, (8, 8, 2))
    w = m.set_class_frequencies([900, 100, 1, 0])
    # shares .9, .1, .001, 0 -> (.9/.1) ** .5 = 3, (.9/.001) ** .5 = 30 -> capped 20, unseen -> 20
    assert w.tolist() == pytest.approx([1.0, 3.0, 20.0, 20.0])
    assert "class_weights" not in m.state_dict()  # follows from data + config, not saved
    with pytest.raises(DataError):
        m.set_class_frequencies([1, 2, 3])


def test_class_weighted_ce_by_hand_and_power_0_is_plain_ce():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 8, 8, 2)
    occ = torch.randint(0, 4, (2, 8, 8, 2))
    vq = torch.tensor(0.0)
    plain = Tokenizer(tiny_cfg(lovasz_weight=0.0), 4, (8, 8, 2))
    plain.set_class_frequencies([900, 100, 1, 0])  # ignored at power 0: OccWorld's plain CE
    assert plain.loss(logits, occ, vq)["ce"].item() == pytest.approx(torch.nn.functional.cross_entropy(logits, occ).item())
    m = Tokenizer(tiny_cfg(lovasz_weight=0.0, class_weight_power=1.0, class_weight_max=5.0), 4, (8, 8, 2))
    w = m.set_class_frequencies([900, 100, 1, 0])  # 1, 9, 5 (cap), 5
    nll = -torch.log_softmax(logits, 1).gather(1, occ[:, None])[:, 0]
    by_hand = (w[occ] * nll).mean()  # over voxels: a batch-independent normaliser (DDP-exact)
    assert m.loss(logits, occ, vq)["ce"].item() == pytest.approx(by_hand.item(), rel=1e-5)
    for bad in ({"class_weight_power": -0.1}, {"class_weight_power": 3.0}, {"class_weight_max": 0.5}):
        with pytest.raises(ConfigError) as e:
            TokenizerConfig(**bad).validate()
        assert e.value.key == next(iter(bad))


def test_class_embedding_keeps_labels_only_and_has_the_lookups_gradient():
    """The training path's class embedding (_ClassEmbed): the rows of F.embedding, the same weight
    gradient (not the sort-based embedding backward), and it saves only the uint8 labels for backward
    (no (P, C) one-hot matrix kept from the forward pass)."""
    import wm.models.tokenizer as tk

    torch.manual_seed(0)
    occ = torch.randint(0, 6, (2, 8, 8, 3), dtype=torch.uint8)
    w = torch.randn(6, 4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = tk._ClassEmbed.apply(occ, w, torch.float32, True)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.uint8, (2, 8, 8, 3))]
    dh = torch.randn_like(h)
    (dw,) = torch.autograd.grad(h, w, dh)
    ref = torch.nn.functional.embedding(occ.long(), w)
    assert torch.equal(h, ref)
    (want,) = torch.autograd.grad(ref, w, dh)
    assert torch.allclose(dw, want, rtol=1e-5, atol=1e-6)
    # by hand: class 2's row gets the sum of dh over the voxels labelled 2
    assert torch.allclose(dw[2], dh[occ == 2].sum(0), rtol=1e-5, atol=1e-6)


def test_forward_without_logits():
    """forward(logits=False), what training calls: the same losses, no logits in the output."""
    torch.manual_seed(0)
    m = Tokenizer(tiny_cfg(), 6, (16, 16, 2))
    occ = synthetic_frames(2, 16, 16, 2)
    full, lean = m(occ), m(occ, logits=False)
    assert "logits" in full and "logits" not in lean
    for k in ("loss", "ce", "lovasz", "vq"):
        assert torch.equal(full[k], lean[k]), k


def test_compiled_upsample_is_the_same_function():
    """Under torch.compile in training, Upsample broadcasts instead of interpolating (Inductor turns
    interpolate's backward into atomic adds): the traced graph holds the broadcast, with the same
    values and gradients as eager (a recording backend, then aot_eager: no Inductor code generation,
    seconds on a CPU)."""
    from wm.models.tokenizer import Upsample

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch.manual_seed(0)
    up = Upsample(3)
    x = torch.randn(2, 3, 5, 4, requires_grad=True)
    dy = torch.randn(2, 3, 10, 8)
    outs = []
    for fn in (up, torch.compile(up, backend=record, fullgraph=True), torch.compile(up, backend="aot_eager")):
        x.grad = None
        y = fn(x)
        y.backward(dy)
        outs.append((y.detach(), x.grad.clone()))
    assert "interpolate" not in graphs[0] and "expand" in graphs[0], graphs[0]
    for y, g in outs[1:]:
        assert torch.equal(y, outs[0][0])
        assert torch.allclose(g, outs[0][1], rtol=1e-5, atol=1e-6)
    up.eval()  # inference and export keep interpolate
    torch.compile(up, backend=record, fullgraph=True)(x)
    assert "interpolate" in graphs[-1], graphs[-1]
