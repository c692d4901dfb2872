"""Layers both models use (wm.models.tokenizer and wm.models.world): GroupNorm as OccWorld's, the pre-activation
ResBlock, channels-last gradients, activation checkpointing, the masked
cross-entropy and the parameter count."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ResBlock", "norm", "channels_last_grad", "checkpointed", "masked_cross_entropy", "count_parameters"]


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


# ------------------------------------------------------------------------------------------ blocks


def _groups(c: int) -> int:
    """GroupNorm groups as OccWorld's Normalize: 32 for wide layers, c/4 for narrow ones (always divides c)."""
    return math.gcd(c, 32 if c > 32 else max(c // 4, 1))


def norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(_groups(c), c, eps=1e-6)


def _is_channels_last(x: Tensor) -> bool:
    """A (N, C, H, W) tensor whose channels are adjacent in memory (C > 1: one channel says nothing)."""
    return x.dim() == 4 and x.shape[1] > 1 and x.stride(1) == 1


class _ChannelsLastGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g.contiguous(memory_format=torch.channels_last)


def channels_last_grad(x: Tensor) -> Tensor:
    """x, whose gradient, when x is channels-last, is handed on channels-last too. For a convolution's
    output: cuDNN's convolution backward converts its grad_output to its input's layout, and under
    torch.compile a gradient is laid out by its meta strides (GroupNorm's backward: NCHW), so a
    channels-last model (the world model's) would copy the gradient once per convolution; with this
    Inductor writes it channels-last in the first place. x itself (no autograd node) for NCHW x or
    without autograd (export)."""
    if x.requires_grad and torch.is_grad_enabled() and _is_channels_last(x):
        return _ChannelsLastGrad.apply(x)
    return x


class ResBlock(nn.Module):
    """Pre-activation residual block: GN-SiLU-conv3x3-GN-SiLU-conv3x3 (+ 1x1 shortcut when widths differ)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = norm(cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.conv2 = norm(cout), nn.Conv2d(cout, cout, 3, 1, 1)
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        # the convolutions' inputs in x's layout: GroupNorm's result does not say channels-last (its
        # meta strides are NCHW), so under torch.compile a channels-last model (the world model's) would
        # get NCHW activations and a copy per convolution each way; a no-op for NCHW x
        # (and their outputs' gradients, channels_last_grad: the sum's is both conv2's and the shortcut's)
        fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
        h = channels_last_grad(self.conv1(F.silu(self.norm1(x)).contiguous(memory_format=fmt)))
        h = self.conv2(F.silu(self.norm2(h)).contiguous(memory_format=fmt))
        return channels_last_grad(self.shortcut(x) + h)


# ------------------------------------------------------------------------------------------ checkpointing

def checkpointed(fn, *args: Tensor) -> Tensor:
    """fn(*args) with its activations recomputed in the backward pass (only its inputs kept). Shared by
    the tokenizer and the world model; the results and gradients equal an unchecked call
    (tests/models/test_tokenizer.py)."""
    return checkpoint(fn, *args, use_reentrant=False)


# ------------------------------------------------------------------------------------------ losses


def masked_cross_entropy(logits: Tensor, target: Tensor, mask: Tensor, weight: Tensor | None = None) -> Tensor:
    """Cross-entropy averaged over the positions where `mask` (shaped like `target`) is nonzero:
    logits (N, C, ...), target (N, ...) long. A masked-out position's label has no effect on the
    value or the gradient (its gradient is exactly 0); all masked out gives 0, not NaN. With
    `weight` (C,) class weights, the kept terms are weighted and still divided by the number of
    kept positions (not by the sum of their weights)."""
    keep = mask != 0
    per = F.cross_entropy(logits, target, weight=weight, reduction="none")
    return torch.where(keep, per, 0.0).sum() / keep.sum().clamp_min(1)
