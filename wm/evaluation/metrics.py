"""Occupancy forecasting metrics: confusion-matrix IoU / mIoU per class and per future step.

Everything is computed from one int64 confusion matrix per future step, `counts[s, target, pred]`,
shape (S, C, C), accumulated with `torch.bincount` on the device of the inputs. The matrix is the
whole state: summing matrices (across batches, ranks or accumulators) and then computing IoU gives
the same numbers as one pass over all the data, which is why evaluation over a data set is
"accumulate, all-reduce `counts`, then summarise" and never an average of per-batch IoUs.

Units: every IoU this module returns is a **percentage** in [0, 100] (OccWorld reports
percentages), as float64 tensors from the functions and plain floats from `summary`.

Definitions (per future step s, from counts[s]):
    tp[c]   = counts[c, c]                  voxels of class c predicted as c
    seen[c] = sum_j counts[c, j]            ground-truth voxels of class c   (row sum)
    pos[c]  = sum_i counts[i, c]            predicted voxels of class c      (column sum)
    IoU[c]  = tp / (seen + pos - tp)
    mIoU    = mean of IoU[c] over the non-free classes
    IoU (geometry, "binary") = IoU of the class "occupied" after folding every class != free into
              one class and `free` into the other (occupied vs free), from the same counts.

Classes absent from the ground truth, `mode=`:
    "exclude" (default): IoU[c] = tp / union as written; a class with no ground truth and no
        prediction (union 0) is NaN and left out of the mean; a class with no ground truth but
        false-positive predictions gets 0. The binary IoU follows the same rule.
    "occworld": reproduces OccWorld's evaluation, see `_iou_from_counts` for the source and the
        exact differences.

OccWorld's protocol (Occ3D-nuScenes, 2 Hz): 5 past frames -> 6 future frames, report the 2nd, 4th
and 6th future frames (1 s, 2 s, 3 s) and their average: `summary(steps=OCCWORLD_STEPS)`, with
0-based step indices (1, 3, 5).

No torch.distributed here: the caller all-reduces `ConfusionMatrix.counts` (int64, sums) or hands
a function to `reduce_`.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

MODES = ("exclude", "occworld")

# 0-based future-step indices of OccWorld's reported frames: 2nd, 4th, 6th future frame = 1 s, 2 s, 3 s
# at 2 Hz (OccWorld eval_metric_stp3.py averages val_iou[1], val_iou[3], val_iou[5]).
OCCWORLD_STEPS: tuple[int, ...] = (1, 3, 5)


def step_label(k: int, step_s: Optional[float] = None) -> str:
    """How tables name future step k (1-based): "t+2 (1s)" where a step's length in seconds is known
    (data.stride / frame_rate_hz), else "t+2"."""
    return f"t+{k}" if not step_s or step_s <= 0 else f"t+{k} ({round(k * step_s, 6):g}s)"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"metrics mode must be one of {MODES}, got {mode!r}")


def _iou_from_counts(tp: Tensor, seen: Tensor, pos: Tensor, mode: str) -> Tensor:
    """IoU in percent from per-class tp / ground-truth / predicted counts (any matching shapes).

    "exclude": tp / (seen + pos - tp); 0/0 gives NaN (class absent from both ground truth and
    prediction), seen == 0 with pos > 0 gives 0.

    "occworld": reproduces wzzheng/OccWorld utils/metric_util.py, class `multi_step_MeanIou`
    (used by train.py and eval_metric_stp3.py):
      * per step t it accumulates, over the whole evaluation set, total_seen[t, c] = #(target == c),
        total_correct[t, c] = #(target == c & pred == c), total_positive[t, c] = #(pred == c), after
        dropping voxels whose target equals `ignore_label` (default -100 and set by no shipped
        config, so in practice nothing is dropped; our `mask` plays that role when given);
      * `_after_epoch`: if total_seen[t, c] == 0 the class IoU is **1** (100 %), whatever was
        predicted; else correct / (seen + positive - correct);
      * mIoU[t] = np.mean over `class_indices` = `unique_label` = [0 .. 16], i.e. every class but
        free (17); returned x 100, and the protocol average is (m[1] + m[3] + m[5]) / 3;
      * binary IoU: target and prediction are mapped to 1 where != 17 and 0 where == 17, and the
        same class is run with class_indices [1]: the IoU of "occupied", again 1 when the
        ground truth of that step has no occupied voxel.
    Differences from "exclude", exactly:
      1. seen == 0: occworld gives 100 % (false positives of an absent class go unpunished, and the
         class counts as perfect in the mean); exclude gives NaN (left out of the mean) when the
         class was not predicted either, and 0 when it was.
      2. Hence occworld's mean always divides by all C-1 non-free classes; exclude's by the classes
         with a defined IoU. Where every class has ground truth, the two modes are identical.
      3. Same rule for binary IoU (step with no occupied ground truth: 100 % vs NaN/0).
      4. Numerics only: OccWorld accumulates in float32 (inexact past 2**24 voxels per class);
         here counts are exact int64, so very large sets may differ in the last decimals.
    """
    tp, seen, pos = tp.double(), seen.double(), pos.double()
    iou = tp / (seen + pos - tp)  # 0/0 -> NaN: undefined
    if mode == "occworld":
        iou = torch.where(seen == 0, torch.ones_like(iou), iou)
    return iou * 100.0


def per_class_iou(counts: Tensor, mode: str = "exclude") -> Tensor:
    """Per-class IoU (percent), shape (S, C) from counts (S, C, C); NaN where undefined ("exclude").

    Index = class id. The free class's own IoU is included for information; it is never part of mIoU.
    """
    _check_mode(mode)
    tp = torch.diagonal(counts, dim1=-2, dim2=-1)
    return _iou_from_counts(tp, counts.sum(-1), counts.sum(-2), mode)


def miou(counts: Tensor, free: int, mode: str = "exclude") -> Tensor:
    """mIoU (percent) over the non-free classes, shape (S,). "exclude" skips NaN classes (a step
    with no defined class is NaN); "occworld" averages all C-1 non-free classes."""
    iou = per_class_iou(counts, mode)
    keep = torch.arange(iou.shape[-1], device=iou.device) != free
    return iou[:, keep].nanmean(-1)  # no NaN can occur in occworld mode, so nanmean == mean there


def binary_counts(counts: Tensor, free: int) -> Tensor:
    """Fold (S, C, C) counts into (S, 2, 2) free(0) / occupied(1) counts, same [target, pred] layout."""
    group = (torch.arange(counts.shape[-1], device=counts.device) != free).long()
    s = counts.shape[0]
    rows = counts.new_zeros(s, 2, counts.shape[-1]).index_add_(1, group, counts)
    return counts.new_zeros(s, 2, 2).index_add_(2, group, rows)


def binary_iou(counts: Tensor, free: int, mode: str = "exclude") -> Tensor:
    """Geometry IoU (percent) of "occupied" (any class != free) vs free, shape (S,)."""
    return per_class_iou(binary_counts(counts, free), mode)[:, 1]


def copy_last(past: Tensor, num_future: int) -> Tensor:
    """Copy-last-frame baseline: (B, P, X, Y, Z) past -> (B, S, X, Y, Z) forecast.

    Every future step is the last past frame; a broadcast view (stride 0 over S), no copy, so it
    costs nothing even at Occ3D sizes. Do not write into it.
    """
    if past.dim() != 5 or past.shape[1] < 1:
        raise ValueError(f"copy_last: past must be (B, P>=1, X, Y, Z), got shape {tuple(past.shape)}")
    if num_future < 1:
        raise ValueError(f"copy_last: num_future must be >= 1, got {num_future}")
    b, _, x, y, z = past.shape
    return past[:, -1:].expand(b, num_future, x, y, z)


def _finite_mean(values: Tensor) -> float:
    """Mean of the non-NaN entries as a float (NaN when there are none)."""
    return float(values.double().nanmean()) if values.numel() else math.nan


def _json(v: float) -> float | None:
    """NaN -> None so summaries are strict JSON (json.dumps(allow_nan=False) works)."""
    return None if math.isnan(v) else v


class ConfusionMatrix:
    """Per-future-step confusion matrix `counts[s, target, pred]`, int64, shape (S, C, C).

    `counts` lives on the device of the inputs of the last `update` (moved there, with its totals,
    if it was elsewhere). To all-reduce across ranks: `dist.all_reduce(cm.counts)` (sum), or
    `cm.reduce_(dist.all_reduce)`. Accumulators combine with `merge`, `+=` and `+`.
    """

    def __init__(self, num_classes: int, free: int, num_steps: int = 1,
                 device: torch.device | str | None = None):
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if not 0 <= free < num_classes:
            raise ValueError(f"free class {free} is not in [0, {num_classes})")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.num_classes, self.free, self.num_steps = num_classes, free, num_steps
        self.counts = torch.zeros(num_steps, num_classes, num_classes, dtype=torch.int64, device=device)

    # ---- accumulation -------------------------------------------------------------------------

    def reset(self) -> None:
        self.counts.zero_()

    def _check(self, name: str, t: Tensor, shape: torch.Size, device: torch.device) -> None:
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match pred shape {tuple(shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but pred is on {device}")
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"{name} must be an integer (class id) tensor, got {t.dtype}")

    @torch.no_grad()
    def update(self, pred: Tensor, target: Tensor, mask: Tensor | None = None) -> None:
        """Add one batch. pred/target: (B, S, X, Y, Z) or (B, X, Y, Z) (= one step) integer class ids;
        mask: optional, same shape, nonzero = scored (e.g. Occ3D's camera visibility mask)."""
        if pred.dim() not in (4, 5):
            raise ValueError(f"pred must be (B, S, X, Y, Z) or (B, X, Y, Z), got shape {tuple(pred.shape)}")
        self._check("target", target, pred.shape, pred.device)
        self._check("pred", pred, pred.shape, pred.device)
        if mask is not None:
            if mask.shape != pred.shape:
                raise ValueError(f"mask shape {tuple(mask.shape)} does not match pred shape {tuple(pred.shape)}")
            if mask.device != pred.device:
                raise ValueError(f"mask is on {mask.device} but pred is on {pred.device}")
        if pred.dim() == 4:  # a single step: add S = 1
            pred, target = pred.unsqueeze(1), target.unsqueeze(1)
            mask = None if mask is None else mask.unsqueeze(1)
        if pred.shape[1] != self.num_steps:
            raise ValueError(f"inputs have {pred.shape[1]} future steps, the metric was built for {self.num_steps}")
        c = self.num_classes
        for name, t in (("pred", pred), ("target", target)):
            # One reduction + one sync per tensor; an out-of-range id would silently land in another
            # class's bin (or raise deep inside bincount), so refuse it here with the range.
            if t.numel() and bool(((t < 0) | (t >= c)).any()):
                raise ValueError(f"{name} has class ids outside [0, {c}): min {int(t.min())}, max {int(t.max())}")
        if self.counts.device != pred.device:
            self.counts = self.counts.to(pred.device)
        # Loop over steps (not voxels) so the int64 index tensor is one step's size, not S times it.
        for s in range(self.num_steps):
            idx = target[:, s].long() * c + pred[:, s].long()
            if mask is not None:
                idx = idx[mask[:, s] != 0]
            self.counts[s] += torch.bincount(idx.reshape(-1), minlength=c * c).view(c, c)

    def reduce_(self, fn: Callable[[Tensor], object]) -> "ConfusionMatrix":
        """Apply a reduction to `counts`, e.g. `cm.reduce_(torch.distributed.all_reduce)` (in place,
        sums). If `fn` returns a tensor instead, that tensor becomes the new counts."""
        out = fn(self.counts)
        if isinstance(out, Tensor):
            if out.shape != self.counts.shape:
                raise ValueError(f"reduce_ returned shape {tuple(out.shape)}, expected {tuple(self.counts.shape)}")
            self.counts = out.to(torch.int64)
        return self

    def merge(self, other: "ConfusionMatrix") -> "ConfusionMatrix":
        """Add another accumulator's counts into this one (in place)."""
        if (other.num_classes, other.free, other.num_steps) != (self.num_classes, self.free, self.num_steps):
            raise ValueError(
                "cannot merge confusion matrices of different (num_classes, free, num_steps): "
                f"{(self.num_classes, self.free, self.num_steps)} vs {(other.num_classes, other.free, other.num_steps)}")
        self.counts += other.counts.to(self.counts.device)
        return self

    def __iadd__(self, other: "ConfusionMatrix") -> "ConfusionMatrix":
        return self.merge(other)

    def __add__(self, other: "ConfusionMatrix") -> "ConfusionMatrix":
        out = ConfusionMatrix(self.num_classes, self.free, self.num_steps, device=self.counts.device)
        out.counts = self.counts.clone()
        return out.merge(other)

    # ---- results (percent) --------------------------------------------------------------------

    def per_class_iou(self, mode: str = "exclude") -> Tensor:
        """(S, C) per-class IoU in percent; NaN where undefined ("exclude")."""
        return per_class_iou(self.counts, mode)

    def miou(self, mode: str = "exclude") -> Tensor:
        """(S,) mIoU in percent over the non-free classes."""
        return miou(self.counts, self.free, mode)

    def iou(self, mode: str = "exclude") -> Tensor:
        """(S,) binary (occupied vs free) IoU in percent."""
        return binary_iou(self.counts, self.free, mode)

    def _steps(self, steps: Iterable[int] | None) -> list[int]:
        chosen = list(range(self.num_steps)) if steps is None else [int(s) for s in steps]
        bad = [s for s in chosen if not 0 <= s < self.num_steps]
        if bad or not chosen:
            raise ValueError(f"steps {chosen} must be non-empty 0-based indices in [0, {self.num_steps})")
        return chosen

    def summary(self, steps: Sequence[int] | None = None, mode: str = "exclude") -> dict:
        """JSON-ready results, all IoUs in percent, undefined values as None.

        steps: 0-based future-step indices averaged into the `*_avg` keys (default: all steps);
        OccWorld's protocol is `steps=OCCWORLD_STEPS` = (1, 3, 5), i.e. 1 s, 2 s, 3 s at 2 Hz.
        The per-step lists always cover every step. Averages are means of the per-step values
        (as OccWorld does), skipping undefined ones.

        Keys: mode, unit, steps, iou [S], miou [S], per_class [S][C], iou_avg, miou_avg,
        per_class_avg [C] (each class averaged over the chosen steps).
        """
        _check_mode(mode)
        chosen = self._steps(steps)
        iou, mi, pc = self.iou(mode).cpu(), self.miou(mode).cpu(), self.per_class_iou(mode).cpu()
        idx = torch.tensor(chosen)
        return {
            "mode": mode,
            "unit": "percent",
            "steps": chosen,
            "iou": [_json(float(v)) for v in iou],
            "miou": [_json(float(v)) for v in mi],
            "per_class": [[_json(float(v)) for v in row] for row in pc],
            "iou_avg": _json(_finite_mean(iou[idx])),
            "miou_avg": _json(_finite_mean(mi[idx])),
            "per_class_avg": [_json(_finite_mean(pc[idx, k])) for k in range(self.num_classes)],
        }


# ---- paired bootstrap over groups of windows ----------------------------------------------------


def resample_weights(n: int, resamples: int, seed: int = 0) -> Tensor:
    """(resamples, n) float64: how many times each of `n` groups is drawn in each bootstrap resample
    (n draws with replacement), from a generator seeded with `seed`, so a report is reproducible."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(n, (resamples, n), generator=g)
    ones = torch.ones(resamples, n, dtype=torch.float64)
    return torch.zeros(resamples, n, dtype=torch.float64).scatter_add_(1, pick, ones)


def resampled_ious(counts: Tensor, weight: Tensor, free: int, mode: str = "exclude") -> tuple[Tensor, Tensor]:
    """IoU and mIoU (percent), each (resamples, S), of every resample: the groups' counts
    (G, S, C, C) summed with that resample's weights (resamples, G), then scored as one set (a
    ratio of sums, never a mean of per-group IoUs)."""
    r, (g, s, c) = weight.shape[0], (counts.shape[0], counts.shape[1], counts.shape[-1])
    boot = torch.einsum("bw,wx->bx", weight, counts.reshape(g, -1).double()).reshape(r * s, c, c)
    return binary_iou(boot, free, mode).view(r, s), miou(boot, free, mode).view(r, s)


def paired_bootstrap(a: Tensor, b: Tensor, free: int, mode: str = "exclude", resamples: int = 1000,
                     seed: int = 0) -> Optional[dict[str, Tensor]]:
    """The bootstrap distribution of b - a, in points: {"iou", "miou": (resamples, S) per future step,
    "iou_avg", "miou_avg": (resamples,) their mean over the steps}. a, b: (G, S, C, C) counts of the
    same G groups (windows, or scenes: whatever may be drawn independently) under two models. Paired:
    each resample draws the same groups for both, so what both get wrong alike cancels out of the
    difference. None with fewer than two groups (no spread to resample)."""
    if a.shape != b.shape:
        raise ValueError(f"paired counts must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] < 2:
        return None
    weight = resample_weights(a.shape[0], resamples, seed)
    (a_iou, a_miou), (b_iou, b_miou) = resampled_ious(a, weight, free, mode), resampled_ious(b, weight, free, mode)
    d_iou, d_miou = b_iou - a_iou, b_miou - a_miou
    return {"iou": d_iou, "miou": d_miou, "iou_avg": d_iou.nanmean(1), "miou_avg": d_miou.nanmean(1)}
