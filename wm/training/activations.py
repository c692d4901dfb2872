"""Activation memory measured, not counted by hand: one forward and backward of a stage's loss on
fake tensors (FakeTensorMode: shapes, dtypes and strides, no memory, no arithmetic) on the training
device, under its autocast and with its kernels, while a dispatch mode adds up the storages ops
create and subtracts them when they are freed. In fp32 on a CPU the meta device does the same 3-5x
faster (its attention is the math path's: an upper bound). A torch.compile'd step keeps fewer
tensors: wm.training.compiled_activations measures that one. Validation (no gradients) is not in it.

What was measured is kept in the run folder (`memory_plan.json`, keyed by what a trace reads: the
model's sections and options, the batch's shapes, the device kind, the precision and torch's
version), so a resume reads it instead of tracing again, wherever the run and its data now lie.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from wm.config.init import matches
from wm.config.loading import to_dict
from wm.config.sections import Config, model_options
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.training.compiled_activations import CountingFakeMode, compiled_peak
from wm.training.storage_count import StorageCount
from wm.utils.atomic import write_bytes
from wm.utils.precision import autocast

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


class PeakBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while it is on, live and at their peak; a storage
    counts until it is freed. Storages of `known` tensors (alive before) are not counted, nor are
    outputs that alias an input. Ops whose output size depends on values (bincount, boolean masks)
    get the largest output they can have. `block`: the allocator's rounding."""

    def __init__(self, known=(), block: int = 1):
        super().__init__()
        self.storages = StorageCount(known, block)

    @property
    def peak(self) -> int:
        return self.storages.peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, NotImplementedError):  # value-dependent sizes; meta has no bincount
            out = _largest(func, args, kwargs)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            self.storages.add(t)
        return out


def _largest(func, args, kwargs):
    """The largest output of an op whose output size depends on its input's values."""
    x = args[0]
    if func is torch.ops.aten.bincount.default:
        n = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        if n:  # the callers' ids lie below minlength
            w = kwargs.get("weights", args[1] if len(args) > 1 else None)
            return torch.zeros(n, dtype=torch.int64 if w is None else w.dtype, device=x.device)
    if func is torch.ops.aten.nonzero.default:  # at most every element
        return torch.empty(x.numel(), x.dim(), dtype=torch.int64, device=x.device)
    if func is torch.ops.aten.index.Tensor:  # a boolean mask selects at most all it covers
        shape, dim = [], 0
        for i in args[1]:
            if i is not None and i.dtype == torch.bool:
                shape.append(i.numel())
                dim += i.dim()
            else:
                shape.append(x.shape[dim] if i is None else i.numel())
                dim += 1
        return torch.empty(*shape, *x.shape[dim:], dtype=x.dtype, device=x.device)
    return func(*args, **kwargs)  # raises again


def _fake(model: nn.Module, device: torch.device) -> nn.Module:
    """`model`, built on the meta device, with fake parameters and buffers on `device` (strides kept)."""
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for group in (mod._parameters, mod._buffers):
            for k, t in group.items():
                if t is not None:
                    if id(t) not in made:
                        new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                        made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                    group[k] = made[id(t)]
    return model


def _model(cfg: Config, name: str, every: Optional[int] = None) -> nn.Module:
    """The stage's model as it trains (on the meta device), activation-checkpointed every `every` blocks."""
    opts = model_options(cfg, name)
    if every is not None:
        opts["checkpoint_every"] = every
    with torch.device("meta"):
        if name == "tokenizer":
            m = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **opts)
        else:
            m = WorldModel(cfg.world, cfg.tokenizer.codebook_size, **opts)
    s = getattr(cfg, f"{name}_stage")
    for n, p in m.named_parameters():  # <stage>_stage.freeze, as wm.checkpoint.init_from.freeze applies it
        if any(matches(n, f) for f in s.freeze):
            p.requires_grad_(False)
    return m


def token_map(cfg: Config) -> tuple[int, int]:
    """The world model's (h, w) token map as it trains: the tokenizer's, cropped by train.world_crop."""
    h, w = cfg.data.grid[0] // cfg.tokenizer.downsample, cfg.data.grid[1] // cfg.tokenizer.downsample
    c = cfg.train.world_crop
    return (h, w) if not c or c >= max(h, w) else (min(c, h), min(c, w))


def batch_shapes(cfg: Config, name: str, n: int, device_side: bool = True) -> dict:
    """{key: (shape, dtype)} of a batch of `n` samples as the loader makes it (device_side: after
    WorldStage.prepare's crop)."""
    if name == "tokenizer":
        out = {"occ": ((n, 1, *cfg.data.grid), torch.uint8), "motion": ((n, 1, 3), torch.float32)}
        if cfg.data.use_mask:
            out["mask"] = out["occ"]
    else:
        t = cfg.data.window
        hw = token_map(cfg) if device_side else (cfg.data.grid[0] // cfg.tokenizer.downsample,
                                                  cfg.data.grid[1] // cfg.tokenizer.downsample)
        out = {"codes": ((n, t, *hw), torch.int16), "motion": ((n, t, 3), torch.float32)}
        if cfg.data.use_mask:
            out["mask"] = ((n, t, *hw), torch.uint8)
    out["index"] = ((n,), torch.int64)
    return out


def nbytes(shapes: dict) -> int:
    return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in shapes.values())


def _loss(name: str, model, b: dict) -> dict:
    # as TokenizerStage.loss and WorldStage.loss call the models
    if name == "tokenizer":
        return model(b["occ"][:, 0], mask=b["mask"][:, 0] if "mask" in b else None, logits=False)
    codes, motion, mask = b["codes"].long(), b["motion"], b.get("mask")
    return model(codes[:, :-1], motion[:, :-1], codes[:, 1:], motion[:, 1:], None if mask is None else mask[:, 1:])


def measure_step(cfg: Config, name: str, micro: int, device: torch.device, dtype,
                 every: Optional[int] = None, compiled: bool = False) -> int:
    """Peak bytes that one forward and backward of stage `name` at `micro` samples on `device`
    under `dtype` autocast holds beyond the weights, gradients, optimizer state and batch;
    `compiled`: as torch.compile runs it (wm.training.compiled_activations)."""
    model = _model(cfg, name, every)
    # autocast, CUDA's kernels and Dynamo need fake tensors of the device; fp32 eager on a CPU runs on meta
    fake = device.type != "cpu" or dtype is not None or compiled
    on = device if fake else torch.device("meta")
    block = CUDA_BLOCK if device.type == "cuda" else 1
    mode = CountingFakeMode(_largest, block) if compiled else FakeTensorMode() if fake else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), mode:
        model = (_fake(model, device) if fake else model).train()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # held throughout, as the captured step's flat buffer and accumulation hold them
            p.grad = torch.zeros_like(p)
        batch = {k: torch.zeros(shape, dtype=dt, device=on) for k, (shape, dt) in batch_shapes(cfg, name, micro).items()}
        held = [*model.parameters(), *model.buffers(), *(p.grad for p in params), *batch.values()]
        if compiled:
            return compiled_peak(model, functools.partial(_loss, name), batch, held, mode, device, dtype)
        with PeakBytes(held, block) as peak:
            with autocast(device, dtype):
                out = _loss(name, model, batch)
            out["loss"].backward()
        return peak.peak


# measured activations by what they depend on, so a resume (a fresh node's included, its data.root
# and run folder elsewhere) reads the traces its first process ran instead of running them again
# (seconds of fake-tensor tracing each)
MEASURED = "memory_plan.json"
_measured: dict[str, int] = {}


def _step_key(cfg: Config, name: str, micro: int, device: torch.device, dtype, every: Optional[int],
              compiled: bool) -> str:
    """What measure_step reads (_model, batch_shapes and how the step runs), and nothing else: the
    run's name, folders, schedule and logging never reach a trace."""
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    what = {"tokenizer": to_dict(cfg.tokenizer), "world": to_dict(cfg.world), "classes": cfg.data.num_classes,
            "grid": list(cfg.data.grid), "options": model_options(cfg, name),
            "freeze": list(getattr(cfg, f"{name}_stage").freeze), "batch": batch_shapes(cfg, name, micro),
            "stage": name, "micro": micro, "device": dev, "dtype": str(dtype), "every": every,
            "torch": torch.__version__, **({"compiled": True} if compiled else {})}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def measured_step(cfg: Config, name: str, micro: int, device: torch.device, dtype,
                  every: Optional[int] = None, compiled: bool = False) -> int:
    """measure_step, read from what this run measured before where it can."""
    key = _step_key(cfg, name, micro, device, dtype, every, compiled)
    if key not in _measured:
        _measured[key] = measure_step(cfg, name, micro, device, dtype, every, compiled)
    return _measured[key]


def read_measured(run_dir: Path) -> None:
    """Take in the activations a run's earlier process measured (`<run>/memory_plan.json`); a file
    that is not such a record only costs the tracing again."""
    try:
        got = json.loads((Path(run_dir) / MEASURED).read_text())
        _measured.update({k: int(v) for k, v in got["activations"].items() if isinstance(k, str)})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass


def keep_measured(run_dir: Path) -> None:
    """Write what was measured into the run folder (rank 0, once the run's folder is its own)."""
    if not _measured:
        return
    try:
        write_bytes(Path(run_dir) / MEASURED, json.dumps({"activations": _measured}, indent=1, sort_keys=True) + "\n")
    except OSError:  # a resume then traces again; the run's own writes say what is wrong with the folder
        pass
