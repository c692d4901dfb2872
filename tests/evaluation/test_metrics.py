"""wm.evaluation.metrics against hand-counted tiny grids. 4 classes, free = 3; IoUs are percentages."""

import json
import math

import pytest
import torch

from wm.evaluation.metrics import OCCWORLD_STEPS, ConfusionMatrix, binary_counts, copy_last

C, FREE = 4, 3


def grid(*vals: int) -> torch.Tensor:
    """A (B=1, S=1, X=len, Y=1, Z=1) uint8 grid: one row of voxels."""
    return torch.tensor(vals, dtype=torch.uint8).view(1, 1, -1, 1, 1)


def steps(*grids: torch.Tensor) -> torch.Tensor:
    """Stack single-step grids along S."""
    return torch.cat(grids, dim=1)


# Base example, voxel by voxel (target, pred):
#   v0 (0,0)  v1 (0,1)  v2 (1,1)  v3 (2,3)  v4 (3,3)  v5 (3,0)
# class 0: tp 1 (v0), seen 2 (v0 v1), pred 2 (v0 v5) -> union 3 -> 1/3 = 33.33 %
# class 1: tp 1 (v2), seen 1 (v2),    pred 2 (v1 v2) -> union 2 -> 1/2 = 50 %
# class 2: tp 0,      seen 1 (v3),    pred 0         -> union 1 -> 0 %
# class 3 (free): tp 1 (v4), seen 2 (v4 v5), pred 2 (v3 v4) -> 1/3 = 33.33 %
# mIoU (classes 0..2) = (33.33 + 50 + 0) / 3 = 27.78 %
# binary: occupied target v0..v3, occupied pred v0 v1 v2 v5: tp 3, union 5 -> 60 %
T0 = grid(0, 0, 1, 2, 3, 3)
P0 = grid(0, 1, 1, 3, 3, 0)


def test_counts_and_ious_single_step():
    cm = ConfusionMatrix(C, FREE)
    cm.update(P0, T0)
    expected = torch.zeros(C, C, dtype=torch.int64)
    for t, p in [(0, 0), (0, 1), (1, 1), (2, 3), (3, 3), (3, 0)]:
        expected[t, p] += 1
    assert cm.counts.dtype == torch.int64 and cm.counts.shape == (1, C, C)
    assert torch.equal(cm.counts[0], expected)
    pc = cm.per_class_iou()[0].tolist()
    assert pc == pytest.approx([100 / 3, 50.0, 0.0, 100 / 3])
    assert cm.miou()[0].item() == pytest.approx((100 / 3 + 50 + 0) / 3)
    assert cm.iou()[0].item() == pytest.approx(60.0)
    # binary folding: [target free/occ, pred free/occ]: free->free v4, free->occ v5,
    # occ->free v3, occ->occ v0 v1 v2
    assert binary_counts(cm.counts, FREE)[0].tolist() == [[1, 1], [1, 3]]


def test_four_dim_input_is_one_step():
    cm = ConfusionMatrix(C, FREE)
    cm.update(P0[:, 0], T0[:, 0])  # (B, X, Y, Z)
    assert cm.miou()[0].item() == pytest.approx((100 / 3 + 50) / 3)
    with pytest.raises(ValueError, match="future steps"):
        ConfusionMatrix(C, FREE, num_steps=2).update(P0[:, 0], T0[:, 0])


def test_per_step_values_and_step_average():
    # step 0: the base example (mIoU 27.78, IoU 60).
    # step 1: target 0 0 1 2 3 3, pred = target (perfect): every class 100, IoU 100.
    # step 2: target 0 0 1 2 3 3, pred all free (3):
    #   classes 0,1,2: tp 0 with seen > 0 -> 0; mIoU 0; binary: no occupied prediction -> tp 0,
    #   union 4 -> IoU 0.
    target = steps(T0, T0, T0)
    pred = steps(P0, T0, grid(3, 3, 3, 3, 3, 3))
    cm = ConfusionMatrix(C, FREE, num_steps=3)
    cm.update(pred, target)
    m0 = (100 / 3 + 50) / 3
    assert cm.miou().tolist() == pytest.approx([m0, 100.0, 0.0])
    assert cm.iou().tolist() == pytest.approx([60.0, 100.0, 0.0])
    s = cm.summary(steps=(0, 2))
    assert s["steps"] == [0, 2]
    assert s["miou_avg"] == pytest.approx((m0 + 0.0) / 2)
    assert s["iou_avg"] == pytest.approx(30.0)
    # class 1 over steps 0 and 2: (50 + 0) / 2
    assert s["per_class_avg"][1] == pytest.approx(25.0)
    assert cm.summary()["miou_avg"] == pytest.approx((m0 + 100 + 0) / 3)


def test_mask_drops_voxels():
    # Mask out v1 (0->1) and v5 (3->0): left v0 (0,0) v2 (1,1) v3 (2,3) v4 (3,3)
    # class 0: 1/1 = 100; class 1: 1/1 = 100; class 2: 0/1 = 0 -> mIoU 66.67
    # binary: occupied target v0 v2 v3, pred v0 v2 -> tp 2, union 3 -> 66.67
    mask = grid(1, 0, 1, 1, 1, 0)
    cm = ConfusionMatrix(C, FREE)
    cm.update(P0, T0, mask=mask.bool())
    assert int(cm.counts.sum()) == 4
    assert cm.per_class_iou()[0, :3].tolist() == pytest.approx([100.0, 100.0, 0.0])
    assert cm.miou()[0].item() == pytest.approx(200 / 3)
    assert cm.iou()[0].item() == pytest.approx(200 / 3)


def test_absent_class_exclude_vs_occworld():
    # target 0 0 3 3, pred 0 1 3 3
    # class 0: tp 1, seen 2, pred 1 -> 50
    # class 1: seen 0, one false positive -> exclude 0;  occworld 100 (seen == 0)
    # class 2: seen 0, never predicted     -> exclude NaN (left out); occworld 100
    # exclude  mIoU = (50 + 0) / 2 = 25
    # occworld mIoU = (50 + 100 + 100) / 3 = 83.33
    cm = ConfusionMatrix(C, FREE)
    cm.update(grid(0, 1, 3, 3), grid(0, 0, 3, 3))
    ex = cm.per_class_iou("exclude")[0]
    assert ex[0].item() == pytest.approx(50.0) and ex[1].item() == 0.0 and math.isnan(ex[2].item())
    assert cm.per_class_iou("occworld")[0, :3].tolist() == pytest.approx([50.0, 100.0, 100.0])
    assert cm.miou("exclude")[0].item() == pytest.approx(25.0)
    assert cm.miou("occworld")[0].item() == pytest.approx(250 / 3)
    # JSON: the undefined class is None in exclude mode, 100 in occworld mode
    assert cm.summary(mode="exclude")["per_class"][0][2] is None
    assert cm.summary(mode="occworld")["per_class"][0][2] == pytest.approx(100.0)


def test_binary_iou_absent_occupied():
    # All-free ground truth. pred with one occupied voxel: exclude 0/1 -> 0, occworld 100.
    # pred all free: exclude 0/0 -> NaN (None in summary), occworld 100.
    cm = ConfusionMatrix(C, FREE, num_steps=2)
    cm.update(steps(grid(3, 2, 3), grid(3, 3, 3)), steps(grid(3, 3, 3), grid(3, 3, 3)))
    ex = cm.iou("exclude")
    assert ex[0].item() == 0.0 and math.isnan(ex[1].item())
    assert cm.iou("occworld").tolist() == [100.0, 100.0]
    s = cm.summary(mode="exclude")
    assert s["iou"] == [0.0, None] and s["iou_avg"] == 0.0  # the undefined step is skipped
    assert cm.summary(mode="exclude", steps=[1])["iou_avg"] is None


def _occworld_reference(pred, target, free):
    """OccWorld's multi_step_MeanIou loop (utils/metric_util.py), written out on small tensors:
    per step, per class seen/correct/positive; seen == 0 -> IoU 1; mean over non-free classes;
    binary: map != free -> 1, == free -> 0 and take class 1."""
    mious, ious = [], []
    for t in range(pred.shape[1]):
        o, g = pred[:, t], target[:, t]

        def iou(c, o=o, g=g):
            seen, correct, pos = (g == c).sum(), ((g == c) & (o == c)).sum(), (o == c).sum()
            return 1.0 if seen == 0 else float(correct / (seen + pos - correct))

        mious.append(100 * sum(iou(c) for c in range(C) if c != free) / (C - 1))
        ob, gb = (o != free).long(), (g != free).long()
        ious.append(100 * iou(1, ob, gb))
    return mious, ious


def test_occworld_mode_matches_reference_loop():
    g = torch.Generator().manual_seed(0)
    # classes 0..2 (class 2 never in the target at step 1) so the seen == 0 rule is exercised
    target = torch.randint(0, C, (2, 3, 4, 3, 2), generator=g)
    target[:, 1][target[:, 1] == 2] = 0
    pred = torch.randint(0, C, target.shape, generator=g)
    cm = ConfusionMatrix(C, FREE, num_steps=3)
    cm.update(pred, target)
    mious, ious = _occworld_reference(pred, target, FREE)
    assert cm.miou("occworld").tolist() == pytest.approx(mious)
    assert cm.iou("occworld").tolist() == pytest.approx(ious)
    assert cm.miou("exclude")[1].item() != pytest.approx(mious[1])  # the modes differ here


def test_two_updates_equal_one_on_concatenation():
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, C, (4, 2, 3, 3, 2), generator=g)
    t = torch.randint(0, C, (4, 2, 3, 3, 2), generator=g)
    m = torch.randint(0, 2, (4, 2, 3, 3, 2), generator=g)
    a, b = ConfusionMatrix(C, FREE, 2), ConfusionMatrix(C, FREE, 2)
    a.update(p[:1], t[:1], m[:1])
    a.update(p[1:], t[1:], m[1:])
    b.update(p, t, m)
    assert torch.equal(a.counts, b.counts)
    assert int(b.counts.sum()) == int(m.sum())  # every scored voxel counted once
    a.reset()
    assert int(a.counts.sum()) == 0


def test_reduce_and_merge():
    g = torch.Generator().manual_seed(2)
    p = torch.randint(0, C, (2, 2, 3, 2, 2), generator=g)
    t = torch.randint(0, C, (2, 2, 3, 2, 2), generator=g)
    whole = ConfusionMatrix(C, FREE, 2)
    whole.update(p, t)
    # Two "ranks", each with half the batch; summing their counts (what all_reduce does) = whole.
    r0, r1 = ConfusionMatrix(C, FREE, 2), ConfusionMatrix(C, FREE, 2)
    r0.update(p[:1], t[:1])
    r1.update(p[1:], t[1:])
    assert torch.equal((r0 + r1).counts, whole.counts)
    r0.reduce_(lambda counts: counts.add_(r1.counts))  # an in-place fake all_reduce
    assert torch.equal(r0.counts, whole.counts)
    # Doubling all counts (two identical ranks) leaves every IoU unchanged.
    before = whole.summary()
    whole.reduce_(lambda counts: counts * 2)  # a reducer that returns a new tensor
    assert torch.equal(whole.counts, 2 * r0.counts)
    assert whole.summary() == before
    r1_before = r1.counts.clone()
    r1 += r0  # in-place merge
    assert torch.equal(r1.counts, r1_before + r0.counts)
    with pytest.raises(ValueError, match="merge"):
        r1 += ConfusionMatrix(C, FREE, 3)


def test_invalid_inputs_raise():
    cm = ConfusionMatrix(C, FREE)
    with pytest.raises(ValueError, match="outside"):
        cm.update(grid(0, 4), grid(0, 1))  # pred id 4 >= C
    with pytest.raises(ValueError, match="outside"):
        cm.update(grid(0, 1).long(), torch.tensor([0, -1]).view(1, 1, 2, 1, 1))  # negative target
    with pytest.raises(ValueError, match="shape"):
        cm.update(grid(0, 1), grid(0, 1, 2))
    with pytest.raises(ValueError, match="mask shape"):
        cm.update(grid(0, 1), grid(0, 1), mask=grid(1))
    with pytest.raises(ValueError, match="integer"):
        cm.update(grid(0, 1).float(), grid(0, 1))
    with pytest.raises(ValueError, match="mode"):
        cm.miou("nope")
    with pytest.raises(ValueError, match="steps"):
        cm.summary(steps=OCCWORLD_STEPS)  # only one step exists
    assert int(cm.counts.sum()) == 0  # nothing was half-counted


def test_summary_occworld_protocol_is_json():
    # 6 future steps; step s: pred = target at steps 1, 3, 5 (IoU 100), all free elsewhere (IoU 0).
    target = steps(*[grid(0, 1, 2, 3)] * 6)
    pred = steps(*[grid(0, 1, 2, 3) if s % 2 else grid(3, 3, 3, 3) for s in range(6)])
    cm = ConfusionMatrix(C, FREE, num_steps=6)
    cm.update(pred, target)
    s = cm.summary(steps=OCCWORLD_STEPS)
    json.dumps(s, allow_nan=False)
    assert OCCWORLD_STEPS == (1, 3, 5)
    assert s["iou"] == [0.0, 100.0, 0.0, 100.0, 0.0, 100.0]
    assert s["iou_avg"] == 100.0 and s["miou_avg"] == 100.0
    assert cm.summary()["miou_avg"] == pytest.approx(50.0)


def test_copy_last_repeats_last_frame_without_copy():
    past = torch.arange(2 * 3 * 2 * 2 * 1, dtype=torch.uint8).view(2, 3, 2, 2, 1)
    out = copy_last(past, 4)
    assert out.shape == (2, 4, 2, 2, 1)
    for s in range(4):
        assert torch.equal(out[:, s], past[:, 2])
    assert not torch.equal(out[:, 0], past[:, 1])  # it is the last frame, not another one
    assert out.stride(1) == 0 and out.data_ptr() == past[:, 2].data_ptr()  # a view, no copy
    with pytest.raises(ValueError):
        copy_last(past[:, 0], 4)
