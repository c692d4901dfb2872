"""torchrun / DDP plumbing: who am I, which device, and the few collectives the loop needs.

`python train.py` is a world of one (no process group). Under torchrun the environment gives
RANK / WORLD_SIZE / LOCAL_RANK; the backend is NCCL on CUDA and gloo on CPU. Every collective
here is called by every rank at the same point (there are no rank-0-only barriers), and the
process group has a timeout, so a rank that dies ends the job with an error instead of leaving the
others waiting forever. Multi-node runs use torchrun's c10d rendezvous (docs/TRAINING.md).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from wm.utils.errors import WMError


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init(device: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Set up the process group from torchrun's environment (or a world of one).

    device: "auto" (CUDA if present), "cuda" or "cpu". timeout_s bounds every collective: a rank
    that stops answering (crashed, killed, hung) fails the others after this long."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise WMError("train.device is 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise WMError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices are "
                          "visible; start fewer processes per node (--nproc_per_node)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    d = Dist(rank, world, local, dev)
    if world > 1:
        d.backend = "nccl" if use_cuda else "gloo"
        # NCCL: fail fast on a dead peer instead of hanging inside a kernel
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        kw: dict[str, Any] = {}
        if use_cuda:
            kw["device_id"] = dev  # binds the group to this GPU and allows eager NCCL init
        dist.init_process_group(d.backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return d


def close(d: Dist) -> None:
    if d.active and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(t: torch.Tensor, d: Dist, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum, max or min); identity in a world of one."""
    if d.active:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                               "min": dist.ReduceOp.MIN}[op])
    return t


def mean_scalars(values: dict[str, float], d: Dist) -> dict[str, float]:
    """Average a dict of floats over ranks (one collective for all of them)."""
    if not d.active or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return {k: v / d.world_size for k, v in zip(keys, t.tolist())}


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank if it is true on any rank (e.g. 'SIGTERM received': all stop together)."""
    if not d.active:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj: Any, d: Dist) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (small objects: RNG states, counters)."""
    if not d.active:
        return [obj]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, d: Dist, src: int = 0) -> Any:
    if not d.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()
