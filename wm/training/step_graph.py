"""The training step recorded as CUDA graphs (compile.cuda_graphs) and replayed: one launch for the
whole step instead of one per kernel, so a small per-GPU batch (OccWorld's recipe on 8 GPUs is one
world window and 10 tokenizer frames per GPU) runs at the speed of a large one.

The step computes what wm.training.loop.train_step computes, in the same order, from the same batches:
- inputs are copied into static device buffers (the graph reads fixed addresses); the learning
  rate is a device tensor of each parameter group (fused AdamW reads it there, `set_lr` fills it);
- the gradients are views into one flat fp32 buffer, zeroed at the step's start, with two more
  values at its end: [loss non-finite, stop signal]. On several ranks that buffer is all-reduced
  in one collective between two graphs (forward+backward, then clip + AdamW), which is what DDP's
  buckets do, without DDP; so every rank skips and stops at the same steps, as train_step's flags;
- clipping, the non-finite skip (AdamW's `found_inf`, wm.training.loop.step_unless) and the stage's
  after_step are inside the graph on one rank; after_step's collectives (the tokenizer's codebook
  sync) run between graphs on several.

The first `WARMUP` steps run the same code uncaptured on a side stream (torch.compile compiles,
cuDNN and Triton pick their kernels, AdamW makes its state), then the step is captured once and
replayed from then on. On a CPU nothing is captured: the same code runs as it is (what the tests
hold against train_step, also under DDP on gloo). fp16's GradScaler decides on the host, so fp16
steps run train_step; a capture that fails says why in one line and the run goes on uncaptured.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from wm.config.runtime import GRAPH_MODES
from wm.training.step_outcome import HostCopy, StepResult, step_unless
from wm.utils import distributed
from wm.utils.errors import WMError
from wm.utils.precision import autocast

WARMUP = 3  # uncaptured steps before the capture


def set_lr(group: dict, value: float) -> None:
    """A parameter group's learning rate: filled into its device tensor when a captured step reads
    it from there (a kernel with the value as argument: no host sync), else set."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def plain_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """opt.state_dict() with each group's lr a float and `capturable` off: a checkpoint that any run
    loads, captured or not, on a GPU or a CPU (a captured run makes them device tensors again)."""
    opt_state = opt.state_dict()
    opt_state["param_groups"] = [{**g, "lr": float(g["lr"]), **({"capturable": False} if "capturable" in g else {})}
                          for g in opt_state["param_groups"]]
    return opt_state


def use_graphs(cfg, device: torch.device, dtype, say=print) -> bool:
    """Whether the step runs as GraphedStep (compile.cuda_graphs: auto = on CUDA unless fp16). On a
    CPU with `true` its code runs uncaptured (what the tests hold against train_step)."""
    g = cfg.compile.cuda_graphs
    if g is False or g == "auto" and cfg.compile.mode in GRAPH_MODES:  # no capture inside a capture
        return False
    if dtype == torch.float16:  # GradScaler reads its inf check on the host
        if g is True:
            say("compile.cuda_graphs: fp16's GradScaler decides on the host, so the step is not captured "
                "(train.amp=bf16 needs no scaler)")
        return False
    if device.type != "cuda":
        if g is True:
            say("compile.cuda_graphs: no GPU here, nothing is captured; the captured step's code runs as it is")
        return g is True
    return True


class GraphedStep:
    """Callable like wm.training.loop.train_step (`step(next_batch, stop) -> StepResult`), captured on CUDA.
    `fwd`: what the forward goes through (the model, or torch.compile of it; no DDP wrapper)."""

    def __init__(self, stage, model: nn.Module, opt: torch.optim.Optimizer, scfg, device: torch.device, dtype,
                 dist: distributed.Dist, fwd: nn.Module, grad_dtype: str = "fp32", capture: bool = True, say=print):
        self.stage, self.model, self.opt, self.scfg, self.device, self.dtype, self.dist = stage, model, opt, scfg, device, dtype, dist
        self.fwd, self.grad_dtype, self.say = fwd, grad_dtype, say
        self.capture = capture and device.type == "cuda"
        self.params = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(n + 2, dtype=torch.float32, device=device)
        self.tail = self.flat[n:]  # [loss non-finite, stop], reduced with the gradients
        self.views, off = [], 0
        for p in self.params:  # each gradient laid out as its parameter (channels-last kernels too)
            self.views.append(self.flat.as_strided(p.shape, p.stride(), off))
            off += p.numel()
        self.stop_flag = torch.zeros((), device=device)
        self.static: Optional[list] = None  # the micro-batches' device buffers, made from the first step's
        self.calls, self.graphs, self.out = 0, None, None
        if device.type == "cuda":
            for g in opt.param_groups:  # fused AdamW reads the rate from the device (its step counts are there)
                g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)
        if dist.active:  # what DDP does at its construction: every rank starts from rank 0's state
            for t in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(t.data, 0)

    # ------------------------------------------------------------------ the step's parts

    def _bind(self) -> None:
        """Gradients as views of the flat buffer (something may have set them to None: count_flops)."""
        for p, v in zip(self.params, self.views):
            if p.grad is not v:
                p.grad = v

    def _forward_backward(self) -> None:
        accum, stage = len(self.static), self.stage
        self.flat.zero_()
        terms: dict[str, torch.Tensor] = {}
        for b in self.static:
            with autocast(self.device, self.dtype):
                out = stage.loss(self.fwd, b)
            (out["loss"] / accum).backward()
            for k, v in out.items():
                if v.ndim == 0:
                    terms[k] = terms.get(k, 0) + v.detach().float() / accum
        self.keys = sorted(terms)
        self.terms = torch.stack([terms[k] for k in self.keys])
        self.tail[0] = (~torch.isfinite(terms["loss"])).float()
        self.tail[1] = self.stop_flag
        if self.dist.active:  # DDP's order: each rank's share scaled before the sum
            self.flat.mul_(1.0 / self.dist.world_size)

    def _reduce(self) -> None:
        if self.grad_dtype == "bf16":  # half the bytes on the wire, as ddp.grad_dtype=bf16 under DDP
            wire = self.flat.to(torch.bfloat16)
            distributed.all_reduce_(wire, self.dist)
            self.flat.copy_(wire)
        else:
            distributed.all_reduce_(self.flat, self.dist)

    def _update(self) -> None:
        clip = self.scfg.clip if self.scfg.clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        bad = (self.tail[0] > 0) | ~torch.isfinite(gnorm)
        self.flags = torch.stack([bad.float(), (self.tail[1] > 0).float()])
        step_unless(self.opt, self.flags[0])
        if not self.dist.active:
            self.stage.after_step(self.model, self.dist, self.flags[0] > 0)
        self.out = torch.cat([self.terms, gnorm.float()[None], self.flags])

    def _after_reduce(self) -> None:
        if self.dist.active:  # the tokenizer's codebook sync: collectives, outside any graph
            self.stage.after_step(self.model, self.dist, self.flags[0] > 0)

    def _eager(self) -> None:
        self._bind()
        self._forward_backward()
        self._reduce()
        self._update()
        self._after_reduce()

    # ------------------------------------------------------------------ capture and replay

    def _record(self) -> None:
        """Capture the step: one graph on one rank; forward+backward and the update on several,
        the all-reduce between them (eager NCCL: the launch is one call either way)."""
        pool = torch.cuda.graph_pool_handle()
        self._bind()
        for g in self.opt.param_groups:  # AdamW refuses a capture otherwise (set now: uncaptured, it warns)
            g["capturable"] = True
        torch.cuda.synchronize(self.device)
        a = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread goes on allocating while this thread captures
        with torch.cuda.graph(a, pool=pool, capture_error_mode="thread_local"):
            self._forward_backward()
            if not self.dist.active:
                self._update()
        graphs = [a]
        if self.dist.active:
            b = torch.cuda.CUDAGraph()
            with torch.cuda.graph(b, pool=pool, capture_error_mode="thread_local"):
                self._update()
            graphs.append(b)
        self.graphs = graphs

    def _replay(self) -> None:
        self.graphs[0].replay()
        if self.dist.active:
            self._reduce()
            self.graphs[1].replay()
            self._after_reduce()

    def _load(self, next_batch) -> float:
        """The step's micro-batches into the static buffers; returns the host's wait (s)."""
        t0 = time.perf_counter()
        host = [self.stage.prepare(next_batch())
                for _ in range(self.scfg.grad_accum)]
        if self.static is None:
            self.static = [{k: torch.empty(v.shape, dtype=v.dtype, device=self.device) for k, v in b.items()}
                           for b in host]
        for buf, b in zip(self.static, host):
            for k, v in b.items():
                if k not in buf or buf[k].shape != v.shape or buf[k].dtype != v.dtype:
                    raise WMError(f"compile.cuda_graphs: a batch of {k} {tuple(v.shape)} {v.dtype} after batches of "
                                  f"{tuple(buf[k].shape) if k in buf else 'none'}; a captured step needs one shape "
                                  "(set compile.cuda_graphs=false)")
                buf[k].copy_(v, non_blocking=True)
        return time.perf_counter() - t0

    def __call__(self, next_batch, stop=None):
        wait = self._load(next_batch)
        self.stop_flag.fill_(float(stop is not None and stop.requested))
        self.calls += 1
        if self.graphs is not None:
            self._replay()
        elif not self.capture or self.calls <= WARMUP:
            self._warm() if self.capture else self._eager()
        else:
            try:
                self._record()
            except Exception as e:  # noqa: BLE001 - any capture failure: the run goes on uncaptured
                self.capture, self.graphs = False, None
                for g in self.opt.param_groups:
                    g["capturable"] = False
                torch.cuda.synchronize(self.device)
                self.say(f"compile.cuda_graphs: the step could not be captured ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); it runs uncaptured")
                self._eager()
            else:
                self._replay()
        out = self.out.clone()  # the next replay overwrites the graph's outputs
        n = len(self.keys)
        terms = {k: out[i] for i, k in enumerate(self.keys)}
        samples = sum(self.stage.samples(b) for b in self.static) * self.dist.world_size
        return StepResult(terms, out[n], HostCopy(out[n + 1:]), False, wait, samples, self.static[-1])

    def _warm(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._eager()
        torch.cuda.current_stream(self.device).wait_stream(side)
