"""A stage's batch arithmetic, in one place: how many samples a rank takes per micro-step, how many
micro-steps make an optimizer step, how many steps an epoch and the stage have (also from a resume
point, `stage_total`), and how many samples a step took before a change of world size.

A stage sets its batch one of two ways:
- `<stage>_stage.global_batch` G (a recipe: G samples an optimizer step whatever the number of
  ranks): each of W ranks takes G / W samples a step, in micro-batches of at most
  `<stage>_stage.batch_size` (0: all of them at once), grad_accum following;
- else `<stage>_stage.batch_size` (or data.batch_size) per rank and micro-step, times grad_accum,
  times the ranks: a step grows with the ranks.
"""

from __future__ import annotations

import dataclasses

from wm.config.sections import Config
from wm.utils.errors import ConfigError, WMError


@dataclasses.dataclass(frozen=True)
class StageBatch:
    micro: int  # samples per rank and micro-step
    accum: int  # micro-steps per optimizer step
    world_size: int
    words: str  # where the numbers came from, for the log

    @property
    def per_step(self) -> int:
        """Samples an optimizer step trains on, all ranks together."""
        return self.micro * self.accum * self.world_size


def stage_batch(cfg: Config, stage: str, world_size: int = 1) -> StageBatch:
    """The batch of stage "tokenizer" or "world" on `world_size` ranks (see the module docstring).
    A global batch that does not split evenly over the ranks is refused in one line."""
    s = getattr(cfg, f"{stage}_stage")
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    if s.global_batch:
        g = s.global_batch
        if g % world_size:
            fits = [n for n in range(1, g + 1) if g % n == 0]
            raise ConfigError(f"{stage}_stage.global_batch", f"{g} samples a step do not split over {ranks}; "
                              f"run on {', '.join(map(str, fits[:12]))} ranks, or change global_batch")
        per_rank = g // world_size
        cap = s.batch_size or per_rank
        micro = max(m for m in range(1, min(cap, per_rank) + 1) if per_rank % m == 0)
        capped = f", at most {s.batch_size} at once ({stage}_stage.batch_size)" if s.batch_size else ""
        words = (f"{g} samples a step ({stage}_stage.global_batch) = {ranks} x {per_rank}: "
                 f"{per_rank // micro} micro-batch{'es' if per_rank // micro != 1 else ''} of {micro}{capped}")
        return StageBatch(micro, per_rank // micro, world_size, words)
    micro, key = (s.batch_size, f"{stage}_stage.batch_size") if s.batch_size else (cfg.data.batch_size, "data.batch_size")
    unset = f" [{stage}_stage.batch_size is 0]" if key == "data.batch_size" else ""
    words = f"batch {micro} from {key}{unset} x grad_accum {s.grad_accum} x {ranks}"
    return StageBatch(micro, s.grad_accum, world_size, words)


def resolved(cfg: Config, stage: str, world_size: int):
    """The stage's config as this world size runs it: batch_size the micro-batch, grad_accum the
    micro-steps, global_batch 0 (its arithmetic done)."""
    b = stage_batch(cfg, stage, world_size)
    return dataclasses.replace(getattr(cfg, f"{stage}_stage"), batch_size=b.micro, grad_accum=b.accum, global_batch=0)


def batches_per_rank(name: str, samples: int, world_size: int, batch: int, grad_accum: int) -> int:
    """Full batches of `batch` each rank draws from `samples` training samples per epoch; fewer
    than one optimizer step's worth is refused."""
    n = samples // world_size // batch
    if n < grad_accum:
        raise WMError(f"{name} stage: {samples} training samples give {n} batches of {batch} per rank, "
                      f"fewer than grad_accum={grad_accum}; use a smaller {name}_stage.batch_size or more data")
    return n


def planned_steps(cfg: Config, stage: str, samples: int, world_size: int) -> int:
    """Optimizer steps a fresh stage takes: max_steps, else `epochs` passes over `samples`."""
    s, b = getattr(cfg, f"{stage}_stage"), stage_batch(cfg, stage, world_size)
    if s.max_steps:
        return s.max_steps
    return s.epochs * (samples // world_size // b.micro) // b.accum


def steps_per_epoch(name: str, samples: int, world_size: int, batch: int, grad_accum: int) -> int:
    """Optimizer steps in one pass over `samples` at this world size (batches_per_rank's refusal first)."""
    return batches_per_rank(name, samples, world_size, batch, grad_accum) // grad_accum


def stage_total(s, step: int, sampler, batch: int) -> int:
    """The stage's last step: max_steps, else the end of epoch `epochs` from the sampler's position
    (the rest of its epoch at this world size, then whole epochs, in micro-batches of `batch` a rank,
    grad_accum to a step). The same from every resume point at one world size; after a change of
    world size the stage still ends after `epochs` passes over the data."""
    if s.max_steps:
        return s.max_steps
    per_epoch = sampler.n // sampler.world_size // batch
    left = (sampler.n - sampler.consumed) // sampler.world_size // batch + (s.epochs - sampler.epoch - 1) * per_epoch
    return step + max(0, left) // s.grad_accum


def samples_a_step(cfg: Config, stage: str, world_size: int) -> int:
    """Samples an optimizer step took on `world_size` ranks (a resume names them when the ranks changed):
    a global batch is the same on any number of ranks, else the per-rank batch times the ranks."""
    s = getattr(cfg, f"{stage}_stage")
    if s.global_batch:
        return s.global_batch
    return stage_batch(cfg, stage, world_size).per_step
