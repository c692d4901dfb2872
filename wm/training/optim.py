"""The optimizer of a stage and its schedule: AdamW over the trainable parameters in groups by weight
decay and learning-rate multiplier (<stage>_stage.lr_mult), linear warm-up then cosine to min_lr."""

from __future__ import annotations

import math

import torch
from torch import nn

from wm.config.init import matches
from wm.config.sections import StageConfig


def lr_factor(step: int, total: int, s: StageConfig) -> float:
    """Linear warm-up to lr, then cosine to min_lr at `total` steps (as a multiple of lr)."""
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    p = min(1.0, (step - s.warmup_steps) / span)
    lo = s.min_lr / s.lr
    return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p))


def lr_mult(name: str, mults: dict) -> float:
    """The learning-rate multiplier of parameter `name`: its longest matching prefix's (1 if none)."""
    best = max((p for p in mults if matches(name, p)), key=len, default=None)
    return 1.0 if best is None else float(mults[best])


def make_optimizer(model: nn.Module, s: StageConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; weight decay on matrices and kernels only (not on norms,
    biases, embeddings of 1 dim); one group per decay and lr_mult (the schedule scales each)."""
    groups: dict[tuple, list] = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, lr_mult(n, s.lr_mult)), []).append(p)
    order = sorted(groups, key=lambda g: (not g[0], g[1] != 1.0, g[1]))  # without multipliers: the two groups as ever
    return torch.optim.AdamW([{"params": groups[g], "weight_decay": s.weight_decay if g[0] else 0.0, "lr_mult": g[1]}
                              for g in order], lr=s.lr, betas=tuple(s.betas), fused=device.type == "cuda")
