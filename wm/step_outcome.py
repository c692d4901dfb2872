"""What one training step hands the loop (StepResult: its loss terms and flags, left on the device,
read one step late through HostCopy) and how a step that went non-finite is skipped on the device
(step_unless). Shared by the loop's step (wm.loop.train_step) and the captured one (wm.step_graph)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class StepResult:
    """What one optimizer step tells the loop. Tensors stay on the device (no host sync for them)."""

    terms: dict  # the loss terms (0-dim tensors), averaged over the micro-batches
    grad_norm: torch.Tensor  # before clipping
    flags: "HostCopy"  # all ranks': [loss or gradient non-finite, SIGTERM/SIGINT received]
    fp16: bool  # under fp16 the GradScaler, not the flag, skips non-finite steps
    data_wait_s: float  # host seconds spent waiting for batches (loader + copy to the device)
    samples: int  # samples trained on in this step, all ranks together
    batch: dict  # the last micro-batch, on the device (count_flops measures with it)

    def outcome(self) -> tuple[bool, bool]:
        """(skipped: nothing was updated, preempt: stop at a step boundary), the same on every rank.
        Waits for this step's work on the GPU, not for what was queued after it."""
        bad, stop = (bool(x) for x in self.flags.read())
        return bad and not self.fp16, stop


class HostCopy:
    """A small device tensor copied to pinned host memory as soon as the stream reaches it: `read()`
    then waits for the work queued before the copy, not for the work queued since (the next step)."""

    def __init__(self, t: torch.Tensor):
        self.ready = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:  # CPU ops are synchronous: the value is there
            self.host = t

    def read(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def step_unless(opt: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`opt.step()` unless `skip` (0-dim float32 on the device, 1 = skip). Fused AdamW (CUDA) decides
    on the device: it takes the flag the way torch.amp.GradScaler hands it its inf check, as the
    `found_inf` attribute, and leaves parameters, moments and step counts as they were; so the host
    never waits for the GPU here. Other optimizers: the host reads the flag (on a CPU, where every
    op is synchronous, that costs nothing)."""
    if getattr(opt, "_step_supports_amp_scaling", False):
        opt.found_inf = skip
        try:
            opt.step()
        finally:
            del opt.found_inf
    elif not bool(skip):
        opt.step()
