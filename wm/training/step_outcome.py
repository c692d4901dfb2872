"""What one training step hands the loop (StepResult: its loss terms and flags, left on the device,
read one step late through HostCopy), how the loop reads them (Outcomes: skipped steps, the stop
signal) and how a step that went non-finite is skipped on the device (step_unless). Shared by the
loop's step (wm.training.loop.train_step) and the captured one (wm.training.step_graph)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from wm.utils.errors import WMError


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


class Outcomes:
    """The steps taken whose outcome the host has not read yet. Read one step late (the previous
    step's, finished or nearly, while this one runs) so the GPU's queue never runs dry; a step that
    logs, validates or saves reads every outcome first, as does a stop. Too many non-finite steps in
    a row stop the run (`last_good` names the checkpoint to go back to)."""

    def __init__(self, name: str, max_nonfinite: int, logger, say, last_good: Callable[[], str]):
        self.name, self.max_nonfinite, self.logger, self.say = name, max_nonfinite, logger, say
        self.last_good = last_good
        self.unread: list = []
        self.nonfinite, self.preempt = 0, False  # skipped steps in a row; a stop signal was seen (every rank)

    def read(self, step: int, r: StepResult, everything: bool) -> None:
        """Take step `step`'s result and read what is due (`everything`: this step logs, validates or saves)."""
        name = self.name
        self.unread.append((step, r))
        while self.unread and (everything or self.preempt or len(self.unread) > 1):
            j, rj = self.unread.pop(0)
            skipped, stop = rj.outcome()
            self.preempt = self.preempt or stop
            if not skipped:
                self.nonfinite = 0
                continue
            self.nonfinite += 1  # nothing was updated
            self.logger.scalars(j, {"train/nonfinite_steps": self.nonfinite}, kind=f"{name}/skip")
            self.say(f"{name} step {j}: non-finite loss or gradient, step skipped ({self.nonfinite} in a row)")
            if self.nonfinite >= self.max_nonfinite:
                raise WMError(f"{name}: {self.nonfinite} non-finite steps in a row at step {j}; stopped. "
                              f"{self.last_good()}; lower {name}_stage.lr, check the data, or try train.amp=fp32")


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
