"""Visibility masks in training: with data.use_mask the tokenizer's cross-entropy and Lovasz and the
world model's cross-entropy count only visible voxels (token cells that see one); a masked-out
voxel's label has no effect on the loss or its gradient. Without it (the default, OccWorld's
protocol) every voxel counts."""

import json

import pytest
import torch
import torch.nn.functional as F

from wm.config.models import TokenizerConfig
from wm.config.models import WorldConfig
from wm.data.shards import OCC3D_CLASSES
from wm.data.stats import NUSCENES_MOVING
from wm.models.lovasz import lovasz_softmax
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
import wm.training.main as T
from wm.training.stages import val_metrics

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")

C, GRID = 5, (8, 8, 2)


def tokenizer() -> Tokenizer:
    torch.manual_seed(0)
    return Tokenizer(TokenizerConfig(widths=(8, 8, 8), codebook_size=16, code_dim=8, lovasz_weight=1.0), C, GRID)


def grads(loss_fn, logits, *args, **kw):
    x = logits.detach().clone().requires_grad_(True)
    out = loss_fn(x, *args, **kw)
    out["loss"].backward()
    return out, x.grad


def test_tokenizer_masked_out_labels_change_neither_loss_nor_gradient():
    tok = tokenizer()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, C, *GRID, generator=g)
    occ = torch.randint(0, C, (2, *GRID), generator=g)
    mask = torch.rand(2, *GRID, generator=g) < 0.5
    relabelled = torch.where(mask, occ, (occ + 1 + torch.randint(0, C - 1, occ.shape, generator=g)) % C)
    assert (relabelled != occ)[~mask].all()
    vq = torch.tensor(0.5)
    a, ga = grads(tok.loss, logits, occ, vq, mask=mask)
    b, gb = grads(tok.loss, logits, relabelled, vq, mask=mask)
    for k in ("loss", "ce", "lovasz"):
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(ga, gb)
    assert (ga.movedim(1, -1)[~mask] == 0).all()  # no gradient reaches a masked-out voxel at all
    # the terms are the plain ones over the visible voxels, by hand
    vis_logits, vis_target = logits.movedim(1, -1)[mask], occ[mask]
    torch.testing.assert_close(a["ce"], F.cross_entropy(vis_logits, vis_target))
    torch.testing.assert_close(a["lovasz"], lovasz_softmax(vis_logits.softmax(-1), vis_target))
    # the same change without the mask does move the gradient (the test above can fail)
    _, ua = grads(tok.loss, logits, occ, vq)
    _, ub = grads(tok.loss, logits, relabelled, vq)
    assert not torch.equal(ua, ub)
    # and a visible voxel's label matters with the mask too
    flip = occ.clone()
    i = mask.nonzero()[0].tolist()
    flip[tuple(i)] = (flip[tuple(i)] + 1) % C
    _, gf = grads(tok.loss, logits, flip, vq, mask=mask)
    assert not torch.equal(ga, gf)


def test_tokenizer_without_mask_is_unchanged_and_all_masked_is_zero_not_nan():
    tok = tokenizer()
    occ = torch.randint(0, C, (2, *GRID))
    logits = torch.randn(2, C, *GRID)
    vq = torch.tensor(0.0)
    plain = tok.loss(logits, occ, vq)
    torch.testing.assert_close(plain["ce"], F.cross_entropy(logits, occ), rtol=0, atol=0)
    everything = tok.loss(logits, occ, vq, mask=torch.ones_like(occ, dtype=torch.uint8))
    torch.testing.assert_close(everything["ce"], plain["ce"])
    torch.testing.assert_close(everything["lovasz"], plain["lovasz"])
    out, g = grads(tok.loss, logits, occ, vq, mask=torch.zeros_like(occ, dtype=torch.bool))
    assert out["loss"].item() == 0 and torch.equal(g, torch.zeros_like(g))


def test_tokenizer_forward_passes_the_mask_to_the_loss():
    tok = tokenizer()
    occ = torch.randint(0, C, (3, *GRID))
    mask = torch.rand(3, *GRID) < 0.5
    out = tok(occ, mask=mask)
    ref = tok.loss(out["logits"], occ, out["vq"], mask=mask)
    torch.testing.assert_close(out["ce"], ref["ce"])
    torch.testing.assert_close(out["lovasz"], ref["lovasz"])


def test_token_mask_marks_cells_that_see_a_visible_voxel():
    tok = tokenizer()
    mask = torch.zeros(1, *GRID, dtype=torch.uint8)
    mask[0, 5, 1, 1] = 3  # cell (1, 0) of the 2x2 token map (4x4 voxels per cell)
    cells = tok.token_mask(mask)
    assert cells.dtype == torch.bool and cells.shape == (1, 2, 2)
    assert cells.nonzero().tolist() == [[0, 1, 0]]


def test_world_masked_out_cells_change_neither_loss_nor_gradient():
    torch.manual_seed(0)
    world = WorldModel(WorldConfig(widths=(8, 16), heads=2), 16)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 16, 4, 4, generator=g)
    target = torch.randint(0, 16, (2, 3, 4, 4), generator=g)
    mask = torch.rand(2, 3, 4, 4, generator=g) < 0.5
    other = torch.where(mask, target, (target + 5) % 16)
    motion = torch.randn(2, 3, 3, generator=g)

    def loss(lg, tgt, **kw):
        return world.loss({"logits": lg, "motion": motion}, tgt, motion, **kw)

    a, ga = grads(loss, logits, target, mask=mask)
    b, gb = grads(loss, logits, other, mask=mask)
    assert torch.equal(a["ce"], b["ce"]) and torch.equal(ga, gb)
    torch.testing.assert_close(a["ce"], F.cross_entropy(logits.movedim(2, -1)[mask], target[mask]))
    _, ua = grads(loss, logits, target)
    _, ub = grads(loss, logits, other)
    assert not torch.equal(ua, ub)
    plain = loss(logits, target)
    torch.testing.assert_close(plain["ce"], F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("use_mask", [True, False])
def test_training_hands_the_mask_to_both_losses_when_asked(tiny, monkeypatch, capsys, use_mask):
    seen = {"tokenizer": [], "world": []}
    tok_loss, world_loss = Tokenizer.loss, WorldModel.loss

    def spy_tok(self, logits, occ, vq, mask=None):
        if torch.is_grad_enabled():
            seen["tokenizer"].append(None if mask is None else tuple(mask.shape))
        return tok_loss(self, logits, occ, vq, mask=mask)

    def spy_world(self, out, codes, motion, mask=None):
        seen["world"].append(None if mask is None else tuple(mask.shape))
        return world_loss(self, out, codes, motion, mask=mask)

    monkeypatch.setattr(Tokenizer, "loss", spy_tok)
    monkeypatch.setattr(WorldModel, "loss", spy_world)
    assert T.main(tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                            world_stage__max_steps=2, data__use_mask=use_mask)) == 0
    out = capsys.readouterr().out
    if use_mask:  # tokenizer: 2 frames of 16x16x4; world: 2 windows, 3 target frames of 4x4 cells
        assert seen["tokenizer"] and set(seen["tokenizer"]) == {(2, 16, 16, 4)}, seen
        assert seen["world"] and set(seen["world"]) == {(2, 3, 4, 4)}, seen
        assert "training and validation use only visible voxels" in out
        assert list((tiny.run_dir() / "token_cache").glob("*/cell_mask.npy"))
    else:
        assert set(seen["tokenizer"]) == {None} and set(seen["world"]) == {None}, seen
        assert "training uses every voxel (OccWorld's protocol)" in out
        assert not list((tiny.run_dir() / "token_cache").glob("*/cell_mask.npy"))
    # the validation metrics the stages report are the ones check_stages accepts as best_metric
    recs = [json.loads(ln) for ln in (tiny.run_dir() / "metrics.jsonl").read_text().splitlines()]
    for stage in ("tokenizer", "world"):
        keys = {k for r in recs if r.get("kind") == f"{stage}/val" for k in r if k.startswith("val/")}
        assert keys == set(val_metrics(stage, 2, OCC3D_CLASSES, OCC3D_CLASSES.index("free"), NUSCENES_MOVING)), \
            (stage, keys)
