"""The Lovasz-softmax loss (Berman et al. 2018, classes='present'), the tokenizer's second loss term.

For each class c the points' errors e_i = |[label_i = c] - p_i(c)| are ranked, largest first, and
the loss is sum_k e_(k) g_k, where g_k = J_k - J_(k-1) is the change of the Jaccard loss
J_k = 1 - I_k / U_k when the k-th ranked point joins the predicted foreground (I_k: foreground points
not yet taken, U_k: foreground points plus background points taken). The loss is the mean over the
classes present in the labels (or over all classes).

Two ways to rank, chosen by kernels.lovasz_impl:

- "sort" (`lovasz_softmax`): the exact loss and gradient, as Berman et al.'s per-class loop (tested
  against it). One torch.sort of all the errors of a chunk of classes, a gather and a scatter back:
  at the occworld size that is 18 x 20 M keys with their int64 indices per step of 32 frames, a
  large share of a tokenizer step (BENCHMARKS.md, Kernels).
- "histogram" (`lovasz_softmax(impl="histogram")`): no sort. The errors fall into bins by their float32 bits
  (exponent and the top HIST_BITS mantissa bits: every bin spans errors within a factor 1 + 2**-10
  of each other), a bincount gives each bin's foreground and background counts, and the ranks between
  bins follow from their cumulative sums. Inside a bin the order is left open: every point gets the
  gradient it has on average over the orders of its bin (exact sums per bin, closed form), and the
  loss is sum_i e_i g_i with those gradients. The bins make it differ from the exact loss by at most
  2**-10 of its value; the measured differences (loss and gradient, on a trained tokenizer's
  probabilities) are in BENCHMARKS.md and the bound is tested.

Both work class-major on chunks of classes so that temporaries stay near CHUNK_ELEMENTS whatever the
batch, keep counts as exact integers, and save one (P, C) gradient for backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from wm.config.runtime import LOVASZ_IMPLS

__all__ = ["lovasz_softmax", "HIST_BITS"]

CHUNK_ELEMENTS = 1 << 27  # class-chunk size bound of the temporaries (~33 B per element for "sort")
HIST_BITS = 10  # mantissa bits of an error that pick its histogram bin (bin width 2**-10 relative)


def _present_weights(labels: Tensor, num_classes: int, present_only: bool, dtype) -> tuple[Tensor, Tensor]:
    """Foreground count per class (long) and each class's weight in the mean (present classes only,
    or all)."""
    # a comparison and a sum per class, not an index_add_: on a GPU its atomic adds into C counters,
    # most of them into the free class's, serialise
    counts = (labels[None, :] == torch.arange(num_classes, device=labels.device)[:, None]).sum(1)
    return counts, class_weights(counts, present_only, dtype)


def class_weights(counts: Tensor, present_only: bool, dtype) -> Tensor:
    """Each class's weight in the loss's mean, from the foreground counts: the present classes', or all."""
    if present_only:
        weight = (counts > 0).to(dtype)
        return weight / weight.sum().clamp_min(1.0)
    return torch.full(counts.shape, 1.0 / counts.numel(), device=counts.device, dtype=dtype)


def _chunks(num_points: int, num_classes: int):
    step = max(1, min(num_classes, CHUNK_ELEMENTS // max(num_points, 1)))
    return ((c0, min(c0 + step, num_classes)) for c0 in range(0, num_classes, step))


def _row_cumsum(x: Tensor, block: int = 1024) -> Tensor:
    """Inclusive cumsum along dim 1 of a (R, P) integer tensor with few, very long rows, in x's dtype.
    Blocked (cumsum inside blocks, then over block totals) so that GPUs scan many short rows in parallel
    instead of R long ones."""
    r, p = x.shape
    if p <= 4 * block:
        return x.cumsum(1, dtype=x.dtype)
    xb = F.pad(x, (0, (-p) % block)).view(r, -1, block)
    inner = xb.cumsum(2, dtype=x.dtype)
    totals = inner[:, :, -1]
    offsets = totals.cumsum(1, dtype=x.dtype) - totals
    return (inner + offsets[:, :, None]).view(r, -1)[:, :p]


def _sort_terms(probs: Tensor, labels: Tensor, present_only: bool) -> tuple[Tensor, Tensor]:
    """Exact loss and its gradient w.r.t. `probs` (the Lovasz extension is piecewise linear: for a fixed
    sort order the gradient of each class's loss w.r.t. its sorted errors is the Lovasz gradient vector).

    The Lovasz gradient J_i - J_{i-1} is taken in closed form (1/U_i at a foreground point,
    I_i / (U_i (U_i - 1)) at a background one) instead of by subtracting neighbours, which cancels
    catastrophically in float32 once a class has millions of points."""
    num_points, num_classes = probs.shape
    dtype, dev = probs.dtype, probs.device
    counts, weight = _present_weights(labels, num_classes, present_only, dtype)
    rank = torch.arange(1, num_points + 1, device=dev, dtype=torch.int32)[None]  # points up to and incl. i
    grad = torch.empty(num_classes, num_points, device=dev, dtype=dtype)
    loss = probs.new_zeros(())
    for c0, c1 in _chunks(num_points, num_classes):
        fg = labels[None, :] == torch.arange(c0, c1, device=dev)[:, None]  # (c, P) bool
        diff = fg.to(dtype) - probs[:, c0:c1].t()
        errors_sorted, perm = torch.sort(diff.abs(), dim=1, descending=True)  # the chunk's classes in one sort
        fg_sorted = fg.gather(1, perm)
        del fg
        cum_fg = _row_cumsum(fg_sorted.to(torch.int32))
        gts = counts[c0:c1, None].to(torch.int32)
        inter = (gts - cum_fg).to(dtype)  # I_i = |gt minus predicted-so-far foreground|
        union = (gts + rank - cum_fg).to(dtype)  # U_i = |gt union points so far|
        del cum_fg
        g = torch.where(fg_sorted, 1.0 / union, inter / (union * (union - 1.0)).clamp_min(1.0))
        g[:, 0] = 1.0 - inter[:, 0] / union[:, 0]  # J_0 itself
        del fg_sorted, inter, union
        g.mul_(weight[c0:c1, None])
        loss = loss + (errors_sorted * g).sum()
        del errors_sorted
        # d loss / d errors (unsorted) = scatter of the weighted Lovasz gradient; d errors / d probs = -sign(diff)
        grad[c0:c1].scatter_(1, perm, g).mul_(diff.sign_().neg_())
    return loss, grad.t()


def _bin_gradients(hist: Tensor, gts: Tensor) -> Tensor:
    """hist (c, bins, 2) int64 background / foreground counts per error bin, bins in DESCENDING error
    order; gts (c,) foreground count per class -> (c, bins, 2) float64: the Lovasz gradient of a
    background / foreground point of each bin, averaged over the orders of the points inside the bin.

    Over any order of a bin's points their gradients sum to J(after the bin) - J(before it). A
    foreground point's gradient is 1 / U, U = gts + background points ranked before it; with k of its
    bin's nb background points before it, k is uniform on 0..nb over the orders, so its mean is
    (digamma(U0 + nb + 1) - digamma(U0)) / (nb + 1), U0 = gts + background points of earlier bins.
    The background points share the rest of the bin's sum equally."""
    h = hist.to(torch.float64)
    nb, nf = h[..., 0], h[..., 1]
    b_after, f_after = nb.cumsum(1), nf.cumsum(1)
    b_before, f_before = b_after - nb, f_after - nf
    g = gts.to(torch.float64)[:, None]

    def jaccard(f, b):  # J = 1 - I / U; J = 0 before any point (U = 0 only when gts = 0 and b = 0)
        u = g + b
        return torch.where(u > 0, 1.0 - (g - f) / u.clamp_min(1.0), 0.0)

    total = jaccard(f_after, b_after) - jaccard(f_before, b_before)
    u0 = (g + b_before).clamp_min(1.0)  # >= 1 wherever a foreground point exists (gts >= 1)
    g_fg = (torch.digamma(u0 + nb + 1.0) - torch.digamma(u0)) / (nb + 1.0)
    g_bg = (total - nf * g_fg) / nb.clamp_min(1.0)
    return torch.stack([g_bg, g_fg], -1)


def bin_layout(bits: int) -> tuple[int, int]:
    """(shift, bins): an error e in [0, 1] falls in bin float32_bits(e) >> shift, one of `bins`
    (exponent and the top `bits` mantissa bits; ascending in e)."""
    shift = 23 - bits
    return shift, (0x3F800000 >> shift) + 1  # float32 1.0's bits, shifted


@functools.lru_cache(maxsize=8)
def bin_centers(bits: int, device: torch.device) -> Tensor:
    """(bins,) float64: the centre of each bin's error range (bin_layout). The top bin holds only
    1.0 (errors never exceed it), bin 0 the subnormal errors (centre ~1e-38)."""
    shift, bins = bin_layout(bits)
    edges = (torch.arange(bins + 1, dtype=torch.int32) << shift).view(torch.float32).double()
    centers = (edges[:-1] + edges[1:]) / 2
    centers[-1] = 1.0
    return centers.to(device)


def gradient_table(hist: Tensor, counts: Tensor, weight: Tensor, dtype) -> Tensor:
    """hist (c, bins, 2) background / foreground counts per bin in ASCENDING error order, counts (c,)
    foreground per class, weight (c,) the classes' weights in the mean -> (c, bins, 2) in `dtype`: the
    weighted gradient of a point of each (class, bin, background/foreground)."""
    table = _bin_gradients(hist.flip(1), counts).flip(1)  # ranked from the largest error
    return table.mul_(weight[:, None, None].to(torch.float64)).to(dtype)


def _histogram_terms(probs: Tensor, labels: Tensor, present_only: bool) -> tuple[Tensor, Tensor]:
    """Loss and gradient w.r.t. `probs` with the errors ranked by histogram bins (module docstring).
    The torch reference of wm.models.kernels.lovasz_histogram."""
    num_points, num_classes = probs.shape
    dtype, dev = probs.dtype, probs.device
    counts, weight = _present_weights(labels, num_classes, present_only, dtype)
    shift, bins = bin_layout(HIST_BITS)
    grad = torch.empty(num_classes, num_points, device=dev, dtype=dtype)
    loss = probs.new_zeros(())
    for c0, c1 in _chunks(num_points, num_classes):
        n = c1 - c0
        fg = labels[None, :] == torch.arange(c0, c1, device=dev)[:, None]  # (c, P) bool
        diff = fg.to(dtype) - probs[:, c0:c1].t()
        err = diff.abs()
        # bins in ascending error order (float bits of a non-negative float are monotone in it);
        # NaN or > 1 (rounding) land in the top bin
        b = (err.float().view(torch.int32) >> shift).clamp_(max=bins - 1)
        key = (torch.arange(n, device=dev, dtype=torch.int64)[:, None] * bins + b) * 2 + fg
        del b
        hist = torch.bincount(key.view(-1), minlength=n * bins * 2).view(n, bins, 2)
        g = gradient_table(hist, counts[c0:c1], weight[c0:c1], dtype).view(-1)[key]  # each point's, (c, P)
        del key
        loss = loss + (err * g).sum()
        del err
        grad[c0:c1] = g.mul_(diff.sign_().neg_())
    return loss, grad.t()


class _Lovasz(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs: Tensor, labels: Tensor, present_only: bool, impl: str, kernel) -> Tensor:
        if impl == "sort":
            loss, grad = _sort_terms(probs.detach(), labels, present_only)
        elif kernel is not None:
            loss, grad = kernel(probs.detach(), labels, present_only, HIST_BITS)
        else:
            loss, grad = _histogram_terms(probs.detach(), labels, present_only)
        ctx.save_for_backward(grad)  # one (P, C) tensor instead of sort indices + errors + gradients
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (grad,) = ctx.saved_tensors
        return grad_out * grad, None, None, None, None


@torch.compiler.disable  # sort/scan code: nothing for a compiler to fuse (and Inductor's scan codegen fails on it)
def lovasz_softmax(probs: Tensor, labels: Tensor, present_only: bool = True, impl: str = "sort",
                   kernel=None) -> Tensor:
    """Multi-class Lovasz-softmax loss, vectorised over classes. probs: (P, C) class probabilities;
    labels: (P,) long. The mean over the classes present in `labels` (or over all classes).
    impl "sort": the exact loss (Berman et al.'s per-class loop, same value and gradient);
    "histogram": ranked by error bins without a sort, within 2**-HIST_BITS of the exact loss (module
    docstring). `kernel`, for "histogram": what computes its terms instead of the torch code here,
    called as kernel(probs, labels, present_only, HIST_BITS) -> (loss, d loss / d probs); the tokenizer
    passes wm.models.kernels.lovasz_histogram.histogram_terms where that kernel runs."""
    if impl not in LOVASZ_IMPLS:
        raise ValueError(f"lovasz_softmax: impl must be one of {LOVASZ_IMPLS}, got {impl!r}")
    return _Lovasz.apply(probs, labels.long(), present_only, impl, kernel)

