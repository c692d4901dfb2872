"""The one switch convention of wm.models.kernels: a model runs a kernel's op exactly where its flag for that
kernel is on and the kernel's `supports` takes the inputs, and its torch reference elsewhere. Each
kernel is replaced by a stand-in that takes any tensor and records its calls (computing the reference),
so this runs on any CPU, with or without Triton."""

from types import SimpleNamespace

import pytest
import torch

from wm.config.models import TokenizerConfig
from wm.models import kernels, world
import wm.models.lovasz as L
from wm.models.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

GRID, CLASSES = (8, 8, 2), 4


def stand_in(monkeypatch, name: str, op: str, reference):
    """Replace wm.models.kernels.<name> by a module whose supports() says yes and whose `op` records each call
    and returns `reference(*args)`; returns the list of calls."""
    calls = []

    def run(*args):
        calls.append(args)
        return reference(*args)

    monkeypatch.setattr(kernels, name, SimpleNamespace(supports=lambda *a: True, **{op: run}))
    return calls


def tokenizer(**kw) -> Tokenizer:
    torch.manual_seed(0)
    return Tokenizer(TokenizerConfig(widths=(8,)), CLASSES, GRID, **{"lovasz_impl": "histogram", **kw})


def occupancy() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, CLASSES, (2, *GRID), dtype=torch.uint8)


@pytest.mark.parametrize("flag", [True, False])
def test_tokenizer_head_runs_where_fused_head_is_on(monkeypatch, flag):
    class Ran(Exception):
        pass

    def head_losses(*args):
        raise Ran

    stand_in(monkeypatch, "tokenizer_head", "head_losses", head_losses)
    tok = tokenizer(fused_head=flag)
    if flag:
        with pytest.raises(Ran):
            tok(occupancy())
    else:
        assert tok(occupancy())["loss"] > 0


@pytest.mark.parametrize("flag", [True, False])
def test_lovasz_kernel_runs_where_fused_lovasz_is_on(monkeypatch, flag):
    calls = stand_in(monkeypatch, "lovasz_histogram", "histogram_terms",
                     lambda probs, labels, present, bits: L._histogram_terms(probs, labels, present))
    want = tokenizer(fused_head=False, fused_lovasz=False)(occupancy())["lovasz"]
    assert not calls
    got = tokenizer(fused_head=False, fused_lovasz=flag)(occupancy())["lovasz"]
    assert len(calls) == flag
    assert torch.equal(got, want)
    # the exact (sorted) Lovasz has no kernel: the flag does not reach it
    tokenizer(fused_head=False, fused_lovasz=flag, lovasz_impl="sort")(occupancy())
    assert len(calls) == flag


@pytest.mark.parametrize("flag", [True, False])
def test_embedding_gradient_kernel_runs_where_fused_embedding_grad_is_on(monkeypatch, flag):
    def embedding_grad(ids, d, rows):
        return d.new_zeros((rows, d.shape[1]), dtype=torch.float32).index_add_(0, ids.long(), d.float())

    calls = stand_in(monkeypatch, "embedding_grad", "embedding_grad", embedding_grad)
    grads = []
    for fused in (False, flag):
        tok = tokenizer(fused_head=False, fused_embedding_grad=fused)
        tok(occupancy())["loss"].backward()
        grads.append(tok.class_embed.weight.grad)
    assert len(calls) == flag
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("flag", [True, False])
def test_temporal_attention_kernel_runs_where_fused_attention_is_on(monkeypatch, flag):
    def causal_time_attention(qkv, heads):
        b, t, s, c3 = qkv.shape
        q, k, v = qkv.reshape(b, t, s, 3, heads, c3 // 3 // heads).permute(3, 0, 2, 4, 1, 5)
        return world.short_causal_attention(q, k, v).permute(0, 3, 1, 2, 4).reshape(b, t, s, c3 // 3)

    calls = stand_in(monkeypatch, "temporal_attention", "causal_time_attention", causal_time_attention)
    torch.manual_seed(0)
    layer = world.TemporalLayer(32, 2, 2, fused=flag)
    x = torch.randn(2, 5, 3, 32)
    out = layer(x)
    assert len(calls) == flag
    layer.fused = False
    assert torch.equal(out, layer(x))
    # a rollout step with cached keys and values never takes it (the kernel's queries are all its frames)
    layer.fused = flag
    layer.cache_slot = 0
    shape = layer.kv_shape(2, 3, 5)
    cache = world.RolloutCache([(torch.zeros(shape), torch.zeros(shape))], torch.device("cpu"))
    assert torch.allclose(layer(x, cache=(cache, torch.arange(5))), out, atol=1e-6)  # the past frames at once
    assert len(calls) == flag


def test_each_kernels_key_switches_its_models_flag():
    """The config's kernels section reaches the models: each key off turns exactly its flag off."""
    from wm.config.sections import Config, model_options

    flags = {"tokenizer_head": ("tokenizer", "fused_head"), "lovasz_histogram": ("tokenizer", "fused_lovasz"),
             "embedding_grad": ("tokenizer", "fused_embedding_grad"),
             "temporal_attention": ("world", "fused_attention")}
    on = {s: model_options(Config(), s) for s in ("tokenizer", "world")}
    assert all(on[s][f] is True for s, f in flags.values())
    for key, (stage, flag) in flags.items():
        cfg = Config()
        setattr(cfg.kernels, key, False)
        want = {s: {**o, flag: False} if s == stage else o for s, o in on.items()}
        assert {s: model_options(cfg, s) for s in on} == want, key
