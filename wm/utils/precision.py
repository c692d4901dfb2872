"""Precision: autocast to a dtype on a device (or nothing for fp32), and an inference copy of a model
with its matmul weights already in that dtype."""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """Autocast to `dtype` on `device`, or nothing for fp32 (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# the layers autocast runs in its low precision: their weights can be cast once, ahead, to the same effect
_MATMUL_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                  torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def cast_for_inference(module: torch.nn.Module, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """A copy of `module` whose linear and convolution weights and biases are already in the autocast
    `dtype` (the module itself untouched); None: the module as it is.

    Without grad, autocast caches no cast weight, so each call casts every weight again (a kernel
    per weight per call); cast once, the same rounding gives the same outputs under autocast, with
    norms and embeddings left in float32 as autocast computes them."""
    if dtype is None:
        return module
    out = copy.deepcopy(module)
    for m in out.modules():
        if isinstance(m, _MATMUL_LAYERS):
            for name in ("weight", "bias"):
                p = getattr(m, name, None)
                if p is not None and p.is_floating_point():
                    setattr(m, name, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))
    return out
