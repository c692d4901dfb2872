"""The histogram Lovasz-softmax (wm.models.lovasz, impl "histogram") as two fused Triton kernels, for CUDA.

The torch reference (wm.models.lovasz._histogram_terms) materialises, per chunk of classes, the errors, their
bins, int64 keys, the gathered gradients and their signs: about ten passes over C x P elements
(18 x 20 M at the occworld size, batch 32). Here each kernel reads a tile of points with all their
class probabilities once, keeps everything else in registers, and

1. `_histogram_kernel` adds each (class, error bin, foreground?) to a (C, bins, 2) int32 histogram
   with atomic adds;
2. (torch, on the small histogram) wm.models.lovasz.gradient_table turns it into each bin's gradients;
3. `_gradient_kernel` looks every point's gradient up in that table, writes d loss / d probs (P, C)
   and one partial loss sum per tile.

Same bins, same table as the reference: the gradient is the reference's to float rounding, and the
loss differs only by summation order (tests/models/test_kernel_lovasz_histogram.py). The tokenizer hands
`histogram_terms` to wm.models.lovasz.lovasz_softmax where its fused_lovasz flag is on and `supports` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from wm.models.lovasz import bin_layout, class_weights, gradient_table

BLOCK_POINTS = 128  # points per program (x the classes padded to a power of 2)


@triton.jit
def _tile(probs_ptr, labels_ptr, pid, P, C: tl.constexpr, CP: tl.constexpr, BINS: tl.constexpr,
          SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = tl.arange(0, CP)
    rmask = rows < P
    m = rmask[:, None] & (cols[None, :] < C)
    offs = rows[:, None] * C + cols[None, :]
    p = tl.load(probs_ptr + offs, mask=m, other=0.0)
    lab = tl.load(labels_ptr + rows, mask=rmask, other=-1)
    fg = lab[:, None] == cols[None, :]
    diff, err, key = error_keys(p, fg, cols, BINS, SHIFT)
    return offs, m, diff, err, key


@triton.jit
def error_keys(p, fg, cols, BINS: tl.constexpr, SHIFT: tl.constexpr):
    """(points, classes) probabilities and foreground flags -> fg - p, its absolute value (the Lovasz
    error) and each error's histogram slot (class, bin, foreground?) in a (C, BINS, 2) table.
    Shared with wm.models.kernels.tokenizer_head."""
    diff = tl.where(fg, 1.0, 0.0) - p
    err = tl.abs(diff)
    b = tl.minimum(err.to(tl.int32, bitcast=True) >> SHIFT, BINS - 1)  # NaN lands in the top bin
    key = (cols[None, :] * BINS + b) * 2 + fg.to(tl.int32)
    return diff, err, key


@triton.jit
def _histogram_kernel(probs_ptr, labels_ptr, hist_ptr, P, C: tl.constexpr, CP: tl.constexpr,
                      BINS: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs, m, diff, err, key = _tile(probs_ptr, labels_ptr, pid, P, C, CP, BINS, SHIFT, BLOCK)
    tl.atomic_add(hist_ptr + key, tl.full(key.shape, 1, tl.int32), mask=m, sem="relaxed")


@triton.jit
def _gradient_kernel(probs_ptr, labels_ptr, table_ptr, grad_ptr, partial_ptr, P, C: tl.constexpr,
                     CP: tl.constexpr, BINS: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs, m, diff, err, key = _tile(probs_ptr, labels_ptr, pid, P, C, CP, BINS, SHIFT, BLOCK)
    g = tl.load(table_ptr + key, mask=m, other=0.0)
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    tl.store(grad_ptr + offs, -sign * g, mask=m)  # d err / d p = -sign(fg - p)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(tl.where(m, err * g, 0.0), axis=1), axis=0))


def supports(probs: Tensor) -> bool:
    """Whether the kernels take these (P, C) class probabilities: float32 on CUDA."""
    return probs.is_cuda and probs.dtype == torch.float32


def histogram_terms(probs: Tensor, labels: Tensor, present_only: bool, bits: int) -> tuple[Tensor, Tensor]:
    """wm.models.lovasz._histogram_terms on CUDA: probs (P, C) float32, labels (P,) integer ->
    (loss, d loss / d probs (P, C))."""
    probs = probs.contiguous()
    labels = labels.contiguous()
    num_points, num_classes = probs.shape
    shift, bins = bin_layout(bits)
    cp = triton.next_power_of_2(num_classes)
    grid = (triton.cdiv(num_points, BLOCK_POINTS),)
    hist = torch.zeros(num_classes * bins * 2, device=probs.device, dtype=torch.int32)
    _histogram_kernel[grid](probs, labels, hist, num_points, num_classes, cp, bins, shift, BLOCK_POINTS)
    hist = hist.view(num_classes, bins, 2)
    # the foreground counts are the histogram's (no other pass over the labels)
    counts = hist[..., 1].sum(1)
    weight = class_weights(counts, present_only, probs.dtype)
    table = gradient_table(hist, counts, weight, torch.float32).contiguous()
    grad = torch.empty_like(probs)
    partial = torch.empty(grid[0], device=probs.device, dtype=torch.float32)
    _gradient_kernel[grid](probs, labels, table, grad, partial, num_points, num_classes, cp, bins, shift,
                           BLOCK_POINTS)
    return partial.sum(), grad
