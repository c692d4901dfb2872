"""The model as training runs it: under DistributedDataParallel when there is more than one rank,
through torch.compile when the config says so, and `unwrap` to get the plain module back."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from wm.config.sections import Config
from wm.training import compile_cache
from wm.utils import distributed


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and/or torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def wrap_ddp(model: nn.Module, cfg: Config, device: torch.device, dist: distributed.Dist) -> nn.Module:
    """The model under DistributedDataParallel when there is more than one rank, else the model.
    Gradients are views into DDP's buckets (no copy in or out of them); bucket size and wire dtype
    from ddp.bucket_mib / ddp.grad_dtype."""
    if not dist.active:
        return model
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.ddp.bucket_mib, gradient_as_bucket_view=True)
    if cfg.ddp.grad_dtype == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp


def compiles(cfg: Config, device: torch.device, steps: Optional[int] = None) -> bool:
    """Whether training runs torch.compile'd: compile.enable, "auto" meaning on CUDA for a stage of
    `steps` >= compile.min_steps optimizer steps (None: any length)."""
    if cfg.compile.enable == "auto":
        return device.type == "cuda" and (steps is None or steps >= cfg.compile.min_steps)
    return bool(cfg.compile.enable)


def compiled(ddp: nn.Module, cfg: Config, inductor: Optional[dict] = None, steps: Optional[int] = None) -> nn.Module:
    """What the training forward goes through: the (DDP-wrapped) model, torch.compile'd when
    compile.enable (`compiles`, for a stage of `steps` optimizer steps), in compile.mode, with the
    stage's Inductor settings (`inductor`, the stage's `inductor_options()`; they hold for this
    model's compilation only)."""
    if not compiles(cfg, next(unwrap(ddp).parameters()).device, steps):
        return ddp
    compile_cache.prepare()  # what the run's compile cache holds is reused in full
    if isinstance(ddp, nn.parallel.DistributedDataParallel):
        # one graph, the one a single GPU runs: Dynamo's DDP graph splitting hands each piece
        # layouts its neighbours do not produce, and one piece's backward read out of bounds
        torch._dynamo.config.optimize_ddp = False
    return torch.compile(ddp, **compile_args(cfg.compile.mode, inductor))


def compile_args(mode: str, inductor: Optional[dict] = None) -> dict:
    """torch.compile's keyword for `mode` with `inductor` options on top: it takes a mode or
    options, not both, and a mode is a set of options."""
    if not inductor:
        return {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode), **inductor}}
