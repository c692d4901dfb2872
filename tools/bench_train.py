"""Training throughput of the real training step, per variant: precision and batch, torch.compile,
activation checkpointing, token cache vs encoding on the fly, and what a checkpoint save blocks.

    python tools/bench_train.py --cfg configs/occworld.json --set synthetic.compression=gzip1 --json one.json
    torchrun --nproc_per_node 2 tools/bench_train.py --cfg configs/occworld.json \\
        --set synthetic.compression=gzip1 --variants fp32-b1,bf16 --batches 8 --json two.json
    python tools/bench_train.py --scaling one.json two.json     # samples/s on 2 GPUs over 1, per variant
    python tools/bench_train.py --cfg configs/occworld.json --variants bf16-compile \
        --stage-batch tokenizer=32 --stage-batch world=16        # each stage at its own batch, one process
    python tools/bench_train.py --set train.device=cpu --variants fp32-b1,bf16 --steps 3 --warmup 1  # a CPU

Every variant times `wm.training.loop.train_step`, the body of train.py's loop (grad_accum micro-batches,
DDP no_sync, autocast, GradScaler, clipping, the all-reduced finite check, AdamW, after_step), fed
by the same sampler, DataLoader and BatchStream as `fit`, after `--warmup` steps (under DDP every rank
starts the timed steps together, as training's steps follow each other). Reported per
variant: step time (ms; the timed span ends with a CUDA synchronize; the median step from CUDA
events between step starts, since the host, as in `fit`, runs a step ahead of the GPU), samples/s
(all ranks; the tokenizer's samples are frames), TFLOP/s and MFU (FLOPs of one step counted with
torch.utils.flop_counter through wm.training.loop.count_flops, over the bf16 matrix-product peak this script
measures on the same card in the same run with a big matmul; fp32 variants also against the
fp32 peak as train.py runs it, i.e. with TF32; on a CPU the fp32 peak), max allocated memory (GiB,
reset per variant; "act" = that peak minus what was allocated before the timed steps), and the
data-wait fraction (host time the step waited for the loader, over the total). The JSON also
keeps every timed step (`step_ms_each`, from the GPU's clock, the slowest rank's; p90 and max) and
the host's time to queue each (`host_queue_ms_each`): a mean step above the median is a few slow
steps, and a queue time near the step time means the host, not the GPU, sets the pace; each step's
time in Python's garbage collector (`host_gc_ms_each`, the slowest rank's; the collector as `fit`
runs it: `--set ddp.gc_every=0` for Python's automatic one) says whether a collection was it; on
CUDA the allocator's device allocations and cache flushes in the timed steps (`cuda_malloc_calls`,
`alloc_retries`, the most on any rank; a steady step makes none). The on-the-fly
variants' FLOPs include the frozen encoder's forward: it is work the step does.

Variants (`--variants`, comma-separated; each runs for every stage of `--stages`):
  fp32-b1           OccWorld's own recipe: fp32 (TF32 matmuls on CUDA, as train.py), batch 1 in
                    OccWorld's units: one 10-frame sample (10 frames) for the tokenizer, one window
                    for the world model. The baseline.
  bf16              bf16 autocast at each batch of `--batches` in turn (default 1,2,4,...,64 on
                    CUDA, the config's batch on a CPU; a CUDA out-of-memory ends the sweep
                    cleanly); the best samples/s is kept and is "the best batch" below.
  bf16-compile      the best batch with torch.compile (compile.enable=true).
  graphs            bf16 + torch.compile + the captured step (compile.cuda_graphs, wm/training/step_graph.py)
                    at each batch of --stage-batch / --batches: what train.py runs on CUDA; the
                    small-batch checks compare its per-sample rates (world 4 and 1 against 16,
                    tokenizer 8 and 16 against 32).
  recipe            the config as it is: its global batch (micro-batches and accumulation at this
                    world size), precision, compile and capture. The schedule's hours come from it.
  bf16-ckpt1        the best batch with activation checkpointing on every block.
  bf16-ckptk        ... on every k-th block (`--ckpt-k`, default 2).
  onthefly          world only: the best batch without the token cache, occupancy windows encoded by
                    the frozen tokenizer (no grad) each step, then the same loss (what OccWorld does).
  onthefly-fp32-b1  world only: OccWorld's recipe as it runs: fp32, batch 1, encoder every step.
  save              checkpoint save of the best batch's training state (model, AdamW, sampler, RNG):
                    the time the loop is blocked per save with the async Checkpointer (training goes
                    on between saves until the background write is done) vs a synchronous
                    torch.save (+ fsync) of the same state, into the bench's run folder.
Variants that use "the best batch" take the largest of `--batches` when `bf16` is not run. The
default is every variant (on a CPU all but bf16-compile, whose compilation takes minutes there).
A variant that fails for another reason than memory is reported as an error and the rest still run.

The world stage needs a tokenizer checkpoint: the bench writes a randomly initialised one (timing
does not need a trained tokenizer) and builds the token cache from it with wm.training.token_cache's
build_token_cache. The bench's run folder is a temporary folder under run.out_dir (same disk as real
runs, for the save timing), removed at the end; the data set is the config's (data.root, or the
built-in synthetic scenes: pass `--set synthetic.compression=gzip1`, or `synthetic.format=memmap`,
where hdf5plugin is missing).

DDP: under torchrun every rank runs every variant, rank 0 prints and writes the JSON; samples/s is
global, step time the slowest rank's, memory the largest. Give the batch the 1-GPU run found
(`--batches 8`): an out-of-memory on one rank only would leave the other waiting in a collective
until ddp.timeout_s. `--scaling a.json b.json` then prints b's samples/s over a's per variant,
against 0.95x per GPU (1.9x on 2, 3.8x on 4), and the ratio the median steps give.

The schedule: with the `recipe` variant, the config's whole schedule on this many GPUs, each
stage's optimizer steps (max_steps, or its epochs over the data) x its samples a step, over the
samples/s measured at that batch; GPU-hours = hours x GPUs. No other batch's rate is extrapolated.
"""

import argparse
import copy
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.checkpoint.checkpointer import Checkpointer  # noqa: E402
from wm.checkpoint.files import latest_checkpoint, rng_state  # noqa: E402
from wm.checkpoint.run_folder import Run  # noqa: E402
from wm.config.loading import load as load_config, to_dict
from wm.config.sections import model_options  # noqa: E402
from wm.models.tokenizer import Tokenizer  # noqa: E402
from wm.training.host_gc import GCPauses, StepGC, freeze_imports  # noqa: E402
import wm.training.loop as L  # noqa: E402
import wm.training.main as T  # noqa: E402
import wm.training.stages as S  # noqa: E402
from wm.training.step_graph import WARMUP as GW, GraphedStep, plain_optimizer_state, set_lr  # noqa: E402
from wm.utils import distributed  # noqa: E402
from wm.utils.errors import WMError, run_cli  # noqa: E402

VARIANTS = ("fp32-b1", "bf16", "bf16-compile", "graphs", "recipe", "bf16-ckpt1", "bf16-ckptk", "onthefly",
            "onthefly-fp32-b1", "save")
WORLD_ONLY = ("onthefly", "onthefly-fp32-b1")

# OccWorld's own code, one H200: fp32 batch 1 (a tokenizer sample is 10 frames)
OCCWORLD = {"tokenizer_frames_per_sample": 10, "ref_card": "H200", "ref_tokenizer_frames_per_s": 67.6,
            "ref_world_samples_per_s": 5.0}
TARGETS = {"speedup_vs_occworld": 10.0, "mfu": 0.30, "data_wait": 0.05,
           "ckpt_blocked_ratio": 0.10, "ckpt_act_mem_ratio": 1 / 3, "ckpt_time_ratio": 1.25, "ddp_scaling_per_gpu": 0.95}


def say(d, *a, **k):
    if d.is_main:
        print(*a, **k, flush=True)


# ---------------------------------------------------------------------------------------------
# the matrix-product peak, measured here


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """Best of three timings of `reps` n x n x n matmuls, in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        torch.mm(a, b, out=c)
    sync()
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    del a, b, c
    return 2 * n ** 3 / best / 1e12


def measure_peaks(device: torch.device) -> dict:
    """{"bf16": .., "fp32": ..} TFLOP/s on CUDA (fp32 with TF32 allowed, as train.py runs fp32);
    {"fp32": ..} on a CPU."""
    if device.type != "cuda":
        return {"fp32": matmul_tflops(device, torch.float32, 1024, 5)}
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        peaks = {"bf16": matmul_tflops(device, torch.bfloat16, 8192, 30),
                 "fp32": matmul_tflops(device, torch.float32, 8192, 10)}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    torch.cuda.empty_cache()
    return peaks


# ---------------------------------------------------------------------------------------------
# the world stage without its token cache


class OnTheFlyWorld(S.Stage):
    """The world stage fed occupancy windows instead of the token cache: each step encodes them with
    the frozen tokenizer (no grad, under the step's autocast), then the same loss (WorldStage.loss)."""

    name = "world"

    def __init__(self, ws: S.WorldStage):
        self.ws, self.cfg, self.scfg, self.model = ws, ws.cfg, ws.scfg, ws.model
        self.tok_path, self.tok_sha = ws.tok_path, ws.tok_sha
        self.train_ds = ws.windows  # OccWindows: occ uint8 (T, X, Y, Z), motion

    def loss(self, model: nn.Module, batch: dict) -> dict:
        with torch.no_grad():
            codes = self.ws.tokenizer.encode(batch["occ"])  # (B, T, h, w)
        return self.ws.loss(model, {"codes": codes, "motion": batch["motion"]})

    def samples(self, batch: dict) -> int:
        return batch["occ"].shape[0]

    def inductor_options(self) -> dict:
        return self.ws.inductor_options()

    def after_step(self, model: nn.Module, dist: distributed.Dist, skipped: torch.Tensor) -> None:
        self.ws.after_step(model, dist, skipped)


# ---------------------------------------------------------------------------------------------
# what fit builds for a stage, and its step


class Runner:
    """fit's set-up for one stage, minus validation, checkpoints and logging: the model on the device,
    AdamW, the GradScaler, the resumable sampler, the DataLoader and BatchStream, the same seeding,
    DDP when world > 1 and torch.compile when compile.enable. `step()` sets the scheduled learning
    rate and runs wm.training.loop.train_step: the loop's step, nothing else."""

    def __init__(self, stage, cfg, dist: distributed.Dist, device: torch.device, dtype):
        self.stage, self.cfg, self.dist, self.device, self.dtype = stage, cfg, dist, device, dtype
        p = L.stage_parts(stage, cfg, dist, device, dtype)
        self.scfg, self.model, self.batch, self.opt, self.scaler = p.scfg, p.model, p.batch, p.opt, p.scaler
        self.sampler, self.loader, self.total = p.sampler, p.loader, p.total
        L.seed_all(cfg.run.seed * 1000 + dist.rank)
        self.run_step, self.compiling = L.make_step(stage, p, cfg, device, dtype, dist, say=lambda *a, **k: say(dist, *a, **k))
        self.graphed = isinstance(self.run_step, GraphedStep)
        self.next_batch = L.BatchStream(self.loader, self.sampler, self.batch * dist.world_size)
        self.step_no = 0
        self.model.train()

    def step(self) -> L.StepResult:
        for g in self.opt.param_groups:
            set_lr(g, self.scfg.lr * L.lr_factor(self.step_no, self.total, self.scfg))
        r = self.run_step(self.next_batch)
        self.step_no += 1
        return r

    def state(self) -> dict:
        """What fit checkpoints (every rank takes part: the RNG states are gathered)."""
        rng = distributed.gather_objects(rng_state(), self.dist)
        return {"model": self.model.state_dict(), "optimizer": plain_optimizer_state(self.opt),
                "scaler": self.scaler.state_dict(), "sampler": self.sampler.state_dict(),
                "step": self.step_no, "epoch": self.sampler.epoch, "rng": rng, "config": to_dict(self.cfg)}

    def close(self) -> None:
        self.next_batch.it = None  # ends the loader's worker processes
        self.loader = self.next_batch = None


# ---------------------------------------------------------------------------------------------
# one variant


class Bench:
    def __init__(self, run: Run, dist: distributed.Dist, device: torch.device, a, peaks: dict):
        self.run, self.dist, self.device, self.a, self.peaks = run, dist, device, a, peaks
        self.cuda = device.type == "cuda"

    def variant_cfg(self, stage: str, amp: str, batch: int, compile_: bool = False, ckpt_every: int = 0,
                    graphs: bool = False):
        """The config at one per-GPU batch (no accumulation, no global batch), precision, compile and capture."""
        cfg = copy.deepcopy(self.run.cfg)
        cfg.train.amp, cfg.compile.enable, cfg.compile.cuda_graphs = amp, compile_, graphs
        setattr(cfg.activation_checkpoint, f"{stage}_every", ckpt_every)
        s = getattr(cfg, f"{stage}_stage")
        s.batch_size, s.grad_accum, s.global_batch = batch, 1, 0
        return cfg.validate()

    def make_stage(self, stage: str, cfg, dtype, onthefly: bool = False):
        vrun = copy.copy(self.run)  # the same folder, data and logger; this variant's config
        vrun.cfg = cfg
        vrun.say = lambda *a, **k: None
        if stage == "tokenizer":
            return S.TokenizerStage(vrun)
        ws = S.WorldStage(vrun, self.device, dtype)
        return OnTheFlyWorld(ws) if onthefly else ws

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _agree(self, value: float, op: str) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        return float(distributed.all_reduce_(t, self.dist, op=op).item())

    def _agree_each(self, values: list) -> list:
        """Each value's maximum over the ranks, in one collective."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return distributed.all_reduce_(t, self.dist, op="max").tolist()

    def measure(self, stage: str, name: str, cfg, onthefly: bool = False) -> dict:
        """Build the variant, warm up, count the FLOPs of a step, time `--steps` steps."""
        a, dist, device = self.a, self.dist, self.device
        dtype = T.amp_dtype(cfg, device)
        st = self.make_stage(stage, cfg, dtype, onthefly)
        runner = Runner(st, cfg, dist, device, dtype)
        try:
            # at least one untimed step after the FLOP count: a one-off its eager pass leaves (on
            # CUDA, an allocator cache laid out for that pass) is not a training step
            warmup = max(a.warmup, 3 if cfg.compile.enable else 2, GW + 2 if runner.graphed else 0)
            t_first = time.perf_counter()
            r = runner.step()
            if self.cuda:
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - t_first  # compilation, when it compiles
            # FLOPs of one sample's forward + backward on a batch of this variant's shape (the plain
            # module: no compile, no recomputation from activation checkpointing: the model's FLOPs)
            flops_per_sample = L.count_flops(st, runner.model, r.batch, device, dtype)
            for _ in range(warmup - 1):
                r = runner.step()
            if self.cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                mallocs = allocator_calls(device)
            # every rank starts the timed steps together: else the first step's all-reduce holds the
            # ranks that finished the FLOP count early, a wait that training never has
            distributed.barrier(dist)
            per_step, host, wait, samples, skipped, marks, prev = [], [], 0.0, 0, 0, [], None
            gc_ms = []
            # the collector as fit runs it (ddp.gc_every), and the time each step spends in it
            with StepGC(cfg.ddp.gc_every) as collector, GCPauses() as pauses:
                t0 = time.perf_counter()
                for i in range(a.steps):
                    ts = time.perf_counter()
                    if self.cuda:  # the host runs ahead of the GPU: step times from the GPU's clock
                        marks.append(torch.cuda.Event(enable_timing=True))
                        marks[-1].record()
                    r = runner.step()
                    collector.step(warmup + i + 1)
                    host.append(time.perf_counter() - ts)  # on CUDA: the time to queue the step
                    gc_ms.append(pauses.take())
                    if prev is not None:  # as fit reads them: the previous step's, once this one is queued
                        skipped += prev.outcome()[0]
                    prev = r
                    if not self.cuda:  # a CPU runs the step synchronously: host times are step times
                        per_step.append(host[-1])
                    wait += r.data_wait_s
                    samples += r.samples
            if self.cuda:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
                torch.cuda.synchronize(device)
                per_step = [m0.elapsed_time(m1) / 1e3 for m0, m1 in zip(marks, marks[1:])]
                mallocs = [n - m for n, m in zip(allocator_calls(device), mallocs)]
            total = time.perf_counter() - t0
            skipped += r.outcome()[0]
            loss = float(r.terms["loss"])
            peak = torch.cuda.max_memory_allocated(device) if self.cuda else None
        finally:
            runner.close()
        # every rank's figures -> one: the slowest rank's time, the largest memory and wait
        total = self._agree(total, "max")
        wait_frac = self._agree(wait / total, "max")
        median = self._agree(statistics.median(per_step), "max")
        # each step's time, the slowest rank's: where a mean above the median comes from (one
        # stall, every epoch's first step, or a rank that lags at random)
        each = [1e3 * t for t in self._agree_each(per_step)]
        # the host's time to queue each step (slowest rank): near the step time, a host hiccup on
        # any rank stalls every GPU
        queued = [1e3 * t for t in self._agree_each(host)]
        in_gc = self._agree_each(gc_ms)  # the slowest rank's time in Python's garbage collector
        if peak is not None:
            act = self._agree((peak - before) / 2**30, "max")
            peak = self._agree(peak / 2**30, "max")
            # cudaMalloc/cuMemMap calls and cache flushes in the timed steps (the most on any rank):
            # a steady step allocates nothing new
            mallocs = [int(n) for n in self._agree_each(mallocs)]
        else:
            act, mallocs = None, [None, None]
        sps = samples / total
        achieved = flops_per_sample * sps  # all ranks together
        s = runner.scfg  # as this world size runs it: micro-batch and accumulation
        prec = "fp32" if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        rec = {"stage": stage, "variant": name, "status": "ok", "amp": prec, "batch": runner.batch,
               "grad_accum": s.grad_accum, "global_batch": runner.batch * s.grad_accum * dist.world_size,
               "world_size": dist.world_size, "compile": runner.compiling, "compile_mode": cfg.compile.mode,
               "cuda_graphs": runner.graphed, "first_step_s": self._agree(first_s, "max"), "stage_steps": runner.total,
               "checkpoint_every": getattr(cfg.activation_checkpoint, f"{stage}_every"),
               "data": ("occupancy windows, encoded each step" if onthefly else
                        "token cache" if stage == "world" else "occupancy frames"),
               "window_frames": 1 if stage == "tokenizer" else cfg.data.window,
               "steps": a.steps, "warmup": warmup,
               "step_ms": 1e3 * total / a.steps, "step_ms_median": 1e3 * median,
               "step_ms_p90": p90(each), "step_ms_max": max(each), "step_ms_each": each,
               "host_queue_ms_median": statistics.median(queued), "host_queue_ms_each": queued,
               "gc_every": cfg.ddp.gc_every, "host_gc_ms_each": in_gc, "host_gc_ms_max": max(in_gc),
               "cuda_malloc_calls": mallocs[0], "alloc_retries": mallocs[1],
               "samples_per_s": sps, "flops_per_sample": flops_per_sample,
               "flops_per_step": flops_per_sample * runner.batch * s.grad_accum * dist.world_size,
               "tflops_per_s": achieved / 1e12, "max_mem_gib": peak, "act_mem_gib": act,
               "data_wait_frac": wait_frac, "loss": loss, "skipped_steps": skipped}
        ref = "bf16" if "bf16" in self.peaks else "fp32"
        rec["mfu"] = achieved / (self.peaks[ref] * 1e12 * dist.world_size)
        rec["mfu_peak"] = ref
        if prec == "fp32" and ref != "fp32":  # fp32 (TF32) steps also against their own peak
            rec["mfu_fp32_peak"] = achieved / (self.peaks["fp32"] * 1e12 * dist.world_size)
        return rec

    def profile(self, stage: str, cfg, steps: int, top: int = 15) -> dict:
        """`steps` training steps under torch.profiler after warm-up: the top kernels by device time
        and the device time split by kind of kernel (what a missed target is explained with)."""
        from torch.profiler import ProfilerActivity, profile

        dtype = T.amp_dtype(cfg, self.device)
        st = self.make_stage(stage, cfg, dtype)
        runner = Runner(st, cfg, self.dist, self.device, dtype)
        try:
            for _ in range(max(self.a.warmup, 2)):
                runner.step()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    runner.step()
                if self.cuda:
                    torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - t0
        finally:
            runner.close()
        attr = "device_time_total" if self.cuda else "cpu_time_total"
        # on CUDA: kernels only (device-side events, less the ranges that record_function annotations such
        # as "Optimizer.step#AdamW.step" span on the GPU: their kernels are counted already); on a CPU: the operators
        ranges = {e.name for e in prof.events() if getattr(e, "is_user_annotation", False)}
        events = [e for e in prof.key_averages() if not self.cuda
                  or (e.device_type.name == "CUDA" and not e.key.startswith("cuda") and e.key not in ranges)]
        rows = sorted(((e.key, getattr(e, attr, 0) or 0, e.count) for e in events), key=lambda r: -r[1])
        busy = sum(r[1] for r in rows) if self.cuda else None
        # first match wins: attention before gemm/conv, whose "cudnn" would take cuDNN's SDPA kernels
        kinds = {"attention": r"flash|fmha|attention|sdpa|efficient",
                 "gemm/conv": r"gemm|conv|cutlass|xmma|sm\d+_|wgrad|dgrad|implicit|cudnn|nvjet",
                 "fused head/losses": r"head_loss|lovasz|histogram_kernel|gradient_kernel",
                 "norm": r"norm|welford", "optimizer": r"adam|foreach|multi_tensor",
                 "copy/cast": r"copy|cast|convert|memcpy|memset|fill|cat|index"}
        # ATen copies (what .contiguous() and layout changes inside operators launch) by the operators
        # that called them: the chain of callers up to the step, innermost first
        callers: dict[str, list] = {}
        for e in prof.events():
            t = getattr(e, attr, 0) or 0
            if e.name != "aten::copy_" or t <= 0:
                continue
            chain, parent = [], e.cpu_parent
            while parent is not None and len(chain) < 5:
                chain.append(parent.name)
                parent = parent.cpu_parent
            row = callers.setdefault(" < ".join(chain) or "(step)", [0.0, 0])
            row[0], row[1] = row[0] + t, row[1] + 1
        split = {}
        if self.cuda:
            for k, t, _ in rows:
                kind = next((n for n, rx in kinds.items() if re.search(rx, k, re.I)), "elementwise/other")
                split[kind] = split.get(kind, 0) + t
        return {"stage": stage, "batch": getattr(cfg, f"{stage}_stage").batch_size, "steps": steps,
                "wall_ms_per_step": 1e3 * wall / steps,
                "device_busy_ms_per_step": busy / 1e3 / steps if busy else None,
                "top": [{"kernel": k[:120], "ms_per_step": t / 1e3 / steps, "calls_per_step": c / steps}
                        for k, t, c in rows[:top]],
                "kernels": [{"kernel": k[:240], "ms_per_step": t / 1e3 / steps, "calls_per_step": c / steps}
                            for k, t, c in rows],  # all of them, for the JSON
                "copy_callers": [{"callers": k, "ms_per_step": t / 1e3 / steps, "calls_per_step": c / steps}
                                 for k, (t, c) in sorted(callers.items(), key=lambda r: -r[1][0])],
                "split_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(split.items(), key=lambda x: -x[1])}}

    def attempt(self, stage: str, name: str, cfg, onthefly: bool = False) -> dict:
        """measure() (save_variant() for "save"), with a CUDA out-of-memory or another failure
        turned into a record (every rank agrees on it)."""
        status = "ok"
        try:
            rec = self.save_variant(stage, cfg) if name == "save" else self.measure(stage, name, cfg, onthefly)
        except Exception as e:  # the traceback (and the tensors its frames hold) dies with this block
            if isinstance(e, WMError):
                raise
            # out of memory ends a batch sweep; anything else (a compiler failure, ...) is reported
            # and the other variants still run: the bench runs unattended
            status = "oom" if is_oom(e) else f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            if status != "oom":
                traceback.print_exc()
        self.free()
        if cfg.compile.enable:
            torch._dynamo.reset()
        # every rank takes the same path: 0 ok, 1 error, 2 out of memory on some rank
        code = self._agree({"ok": 0, "oom": 2}.get(status, 1), "max")
        if code:
            s = getattr(cfg, f"{stage}_stage")
            return {"stage": stage, "variant": name, "batch": s.batch_size, "amp": cfg.train.amp,
                    "status": "oom" if code == 2 else (status if status != "ok" else "error on another rank"),
                    "compile": cfg.compile.enable, "compile_mode": cfg.compile.mode,
                    "checkpoint_every": getattr(cfg.activation_checkpoint, f"{stage}_every"),
                    "world_size": self.dist.world_size}
        return rec

    # -- checkpoint save: the loop's blocked time, async vs synchronous

    def save_variant(self, stage: str, cfg) -> dict:
        a, dist, device = self.a, self.dist, self.device
        dtype = T.amp_dtype(cfg, device)
        st = self.make_stage(stage, cfg, dtype)
        runner = Runner(st, cfg, dist, device, dtype)
        folder = self.run.dir / "bench_saves" / stage
        try:
            for _ in range(max(1, a.warmup)):  # AdamW's state exists from the first step
                runner.step()
            # a synchronous torch.save (+ fsync) of the same state: what the loop would wait for
            sync_s, size = [], 0
            for i in range(a.saves):
                t = time.perf_counter()  # both ways timed from the state's gathering on
                state = runner.state()
                if dist.is_main:
                    folder.mkdir(parents=True, exist_ok=True)
                    path = folder / f"sync_{i}.pt"
                    with open(path, "wb") as f:
                        torch.save(state, f)
                        f.flush()
                        os.fsync(f.fileno())
                    sync_s.append(time.perf_counter() - t)
                    size = path.stat().st_size
                    path.unlink()
                del state
                runner.step()
            # the async Checkpointer as fit uses it: state copied to CPU, written in the background
            # while training goes on (at least --save-gap steps, and until the write is done, as
            # with checkpoint.every steps between saves)
            ck = Checkpointer(folder / "async", keep_last=2, async_save=True) if dist.is_main else None
            blocked, write_s, gap_ms = [], [], []
            for i in range(a.saves):
                t = time.perf_counter()
                state = runner.state()
                if ck:
                    ck.save(state, i + 1)
                blocked.append(time.perf_counter() - t)
                del state
                n = 0
                while n < a.save_gap or distributed.any_rank(bool(ck and getattr(ck, "_thread", None) is not None
                                                        and ck._thread.is_alive()), dist):
                    ts = time.perf_counter()
                    runner.step()
                    gap_ms.append(1e3 * (time.perf_counter() - ts))
                    n += 1
                    if n >= 10000:
                        break
                if ck:
                    ck.wait()
                    write_s.append(ck.last_write_s)
            if ck:
                ck.close()
        finally:
            runner.close()
            if dist.is_main:
                shutil.rmtree(folder, ignore_errors=True)
        rec = {"stage": stage, "variant": "save", "status": "ok", "batch": runner.batch, "amp": cfg.train.amp,
               "world_size": dist.world_size, "saves": a.saves, "checkpoint_mib": size / 2**20}
        if dist.is_main:
            rec.update({"sync_save_s": statistics.median(sync_s), "async_blocked_s": statistics.median(blocked),
                        "async_blocked_s_all": blocked, "async_write_s": statistics.median(write_s),
                        "step_ms_between_saves": statistics.median(gap_ms) if gap_ms else None})
            rec["blocked_ratio"] = rec["async_blocked_s"] / rec["sync_save_s"]
        return rec


# ---------------------------------------------------------------------------------------------
# report


def is_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory, also where a library reports it as its own allocation failure."""
    text = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def best_of(results: list, stage: str):
    ok = [r for r in results if r["stage"] == stage and r.get("status") == "ok" and "samples_per_s" in r]
    return max(ok, key=lambda r: r["samples_per_s"]) if ok else None


def find(results: list, stage: str, variant: str):
    return next((r for r in results if r["stage"] == stage and r["variant"] == variant and r.get("status") == "ok"), None)


def extrapolate(results: list) -> dict:
    """The config's whole schedule on this many GPUs from the `recipe` variant, the config's own batch:
    each stage's optimizer steps (max_steps, or its epochs over this data) x the samples a step takes,
    over the rate measured at that batch. Nothing here comes from another batch."""
    out = {"assumption": "each stage's optimizer steps x its samples a step, over the samples/s measured at "
                         "the config's own batch (variant recipe)"}
    total, complete = 0.0, True
    for stage in ("tokenizer", "world"):
        r = find(results, stage, "recipe")
        if r is None:
            complete = False
            continue
        hours = r["stage_steps"] * r["global_batch"] / r["samples_per_s"] / 3600
        out[stage] = {"variant": "recipe", "steps": r["stage_steps"], "global_batch": r["global_batch"],
                      "batch": r["batch"], "grad_accum": r["grad_accum"], "samples_per_s": r["samples_per_s"],
                      "world_size": r["world_size"], "hours": hours, "gpu_hours": hours * r["world_size"]}
        total += hours * r["world_size"]
    out["gpu_hours"] = total if complete else None
    return out


def small_batch_checks(results: list) -> list:
    """The captured step's per-sample rate at small batches against a large one's (variant graphs)."""
    out = []
    for stage, big, small in (("world", 16, ((4, 0.8), (1, 0.5))), ("tokenizer", 32, ((8, 0.8), (16, 0.8)))):
        rates = {r["batch"]: r["samples_per_s"] for r in results
                 if r["stage"] == stage and r["variant"] == "graphs" and r.get("status") == "ok"}
        for b, need in small:
            if big in rates and b in rates:
                out.append((f"{stage}: captured step at batch {b} {rates[b]:.1f}/s = {100 * rates[b] / rates[big]:.0f}% "
                            f"of batch {big}'s {rates[big]:.1f}/s (>= {100 * need:.0f}%)", rates[b] >= need * rates[big]))
    return out


def checks(results: list, extra: dict, cuda: bool, card: str) -> list:
    out = []
    o = OCCWORLD
    for stage, ref in (("tokenizer", o["ref_tokenizer_frames_per_s"]), ("world", o["ref_world_samples_per_s"])):
        b = best_of(results, stage)
        if b is None:
            continue
        if cuda:
            out.append((f"{stage}: best {b['samples_per_s']:.1f}/s >= {TARGETS['speedup_vs_occworld']:.0f}x "
                        f"OccWorld's fp32 batch-1 {ref}/s (its code on an {o['ref_card']}; this card: {card})",
                        b["samples_per_s"] / b["world_size"] >= TARGETS["speedup_vs_occworld"] * ref))
            out.append((f"{stage}: best MFU {100 * b['mfu']:.1f}% >= {100 * TARGETS['mfu']:.0f}%",
                        b["mfu"] >= TARGETS["mfu"]))
        out.append((f"{stage}: data wait {100 * b['data_wait_frac']:.1f}% < {100 * TARGETS['data_wait']:.0f}% "
                    f"of the step ({b['variant']})", b["data_wait_frac"] < TARGETS["data_wait"]))
        off = find(results, stage, "bf16")
        ck = find(results, stage, "bf16-ckpt1")
        if cuda and off and ck and off["act_mem_gib"]:
            ratio_m, ratio_t = ck["act_mem_gib"] / off["act_mem_gib"], ck["step_ms"] / off["step_ms"]
            out.append((f"{stage}: checkpointing every block: {100 * ratio_m:.0f}% of the activation memory "
                        f"(<= 33%) for {100 * (ratio_t - 1):+.0f}% time (<= +25%)",
                        ratio_m <= TARGETS["ckpt_act_mem_ratio"] and ratio_t <= TARGETS["ckpt_time_ratio"]))
        sv = find(results, stage, "save")
        if sv and "blocked_ratio" in sv:
            out.append((f"{stage}: a save blocks the loop {1e3 * sv['async_blocked_s']:.0f} ms = "
                        f"{100 * sv['blocked_ratio']:.1f}% of a synchronous torch.save "
                        f"({1e3 * sv['sync_save_s']:.0f} ms) <= {100 * TARGETS['ckpt_blocked_ratio']:.0f}%",
                        sv["blocked_ratio"] <= TARGETS["ckpt_blocked_ratio"]))
    cache, fly = find(results, "world", "bf16"), find(results, "world", "onthefly")
    if cache and fly:
        out.append((f"world: token cache {cache['samples_per_s']:.1f}/s vs encoding on the fly "
                    f"{fly['samples_per_s']:.1f}/s ({cache['samples_per_s'] / fly['samples_per_s']:.2f}x)",
                    cache["samples_per_s"] > fly["samples_per_s"]))
    return out + small_batch_checks(results)


def table(results: list) -> str:
    head = (f"{'stage':<10}{'variant':<18}{'amp':>5}{'batch':>6}{'ms/step':>10}{'samples/s':>11}{'TFLOP/s':>9}"
            f"{'MFU':>7}{'mem GiB':>9}{'act GiB':>9}{'data wait':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r["variant"] == "save":
            if "sync_save_s" in r:
                lines.append(f"{r['stage']:<10}{'save':<18}{r['amp']:>5}{r['batch']:>6}   blocked "
                             f"{1e3 * r['async_blocked_s']:.1f} ms per async save vs {1e3 * r['sync_save_s']:.1f} ms "
                             f"sync torch.save ({100 * r['blocked_ratio']:.1f}%), {r['checkpoint_mib']:.1f} MiB, "
                             f"background write {1e3 * r['async_write_s']:.0f} ms")
            continue
        if r.get("status") != "ok":
            lines.append(f"{r['stage']:<10}{r['variant']:<18}{str(r.get('amp')):>5}{str(r.get('batch')):>6}   {r['status']}")
            continue
        mem = f"{r['max_mem_gib']:>9.2f}{r['act_mem_gib']:>9.2f}" if r["max_mem_gib"] is not None else f"{'n/a':>9}{'n/a':>9}"
        lines.append(f"{r['stage']:<10}{r['variant']:<18}{r['amp']:>5}{r['batch']:>6}{r['step_ms']:>10.1f}"
                     f"{r['samples_per_s']:>11.2f}{r['tflops_per_s']:>9.3g}{100 * r['mfu']:>6.1f}%{mem}"
                     f"{100 * r['data_wait_frac']:>9.1f}%")
    return "\n".join(lines)


def allocator_calls(device) -> list:
    """[device allocations, failed-allocation cache flushes] the CUDA caching allocator has made so far."""
    m = torch.cuda.memory_stats(device)
    return [m.get("num_device_alloc", 0), m.get("num_alloc_retries", 0)]


def p90(xs: list) -> float:
    """The 90th percentile (linear between the closest ranks, as numpy's default)."""
    return statistics.quantiles(xs, n=10, method="inclusive")[8] if len(xs) > 1 else xs[0]


def scaling_report(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    wa, wb = a["machine"]["world_size"], b["machine"]["world_size"]
    # the targets: 1.9x on 2 GPUs, 3.8x on 4, ... over one
    target = TARGETS["ddp_scaling_per_gpu"] * wb / wa
    print(f"samples/s of {b_path} ({wb} GPUs) over {a_path} ({wa} GPUs), per variant "
          f"(target: >= {target:.2f}x)")
    print(f"{'stage':<10}{'variant':<18}{'batch/GPU':>10}{'samples/s a':>13}{'samples/s b':>13}{'ratio':>8}"
          f"{'per GPU':>9}{'by median':>11}   step ms b: mean / median / p90 / max")
    n = 0
    for rb in b["results"]:
        ra = find(a["results"], rb["stage"], rb["variant"])
        if ra is None or rb.get("status") != "ok" or "samples_per_s" not in rb:
            continue
        ratio = rb["samples_per_s"] / ra["samples_per_s"]
        eff = ratio * wa / wb
        # what the typical step gives: a mean above the median is a few slow steps, not every one
        by_median = (f"{wb / wa * ra['step_ms_median'] / rb['step_ms_median']:.2f}x"
                     if "step_ms_median" in ra and "step_ms_median" in rb else "-")
        spread = " / ".join(f"{rb[k]:.1f}" if k in rb else "-"
                            for k in ("step_ms", "step_ms_median", "step_ms_p90", "step_ms_max"))
        same = "" if ra["batch"] == rb["batch"] else f"  (batch per GPU {ra['batch']} vs {rb['batch']}: not comparable)"
        print(f"{rb['stage']:<10}{rb['variant']:<18}{rb['batch']:>10}{ra['samples_per_s']:>13.2f}"
              f"{rb['samples_per_s']:>13.2f}{ratio:>7.2f}x{100 * eff:>8.0f}%{by_median:>11}   {spread}{same}")
        n += 1
        if wb > wa and not same:
            print(f"{'PASS' if ratio >= target else 'FAIL'}  {rb['stage']} {rb['variant']}: {ratio:.2f}x >= {target:.2f}x")
    if not n:
        raise WMError(f"{a_path} and {b_path} have no variant in common")
    return 0


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", help="config JSON (default: the demo)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--stages", default="tokenizer,world", help="tokenizer,world or one of them")
    ap.add_argument("--variants", default=None,
                    help=f"subset of {','.join(VARIANTS)} (default: all; on a CPU all but bf16-compile, "
                         "whose compilation takes minutes there)")
    ap.add_argument("--batches", default=None,
                    help="per-GPU batches the bf16 sweep tries, in order (tokenizer: frames; world: windows); "
                         "default 1,2,4,8,16,32,64 on CUDA, the config's stage batch on a CPU")
    ap.add_argument("--stage-batch", action="append", default=[], metavar="STAGE=B",
                    help="this stage's batches instead of --batches, e.g. tokenizer=8,16,32 world=1,4,16 (repeatable): "
                         "both stages timed in one process at their own batches")
    ap.add_argument("--ckpt-k", type=int, default=2, help="checkpoint every k-th block in the bf16-ckptk variant")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (at least 2, compile: 3; the FLOP count runs after the first)")
    ap.add_argument("--saves", type=int, default=3, help="saves timed in the save variant, each way")
    ap.add_argument("--save-gap", type=int, default=3, help="training steps at least between two async saves")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the variants: N steps of the best bf16 batch under torch.profiler per "
                         "stage; prints the top kernels and the GPU time split by kind (into the JSON too)")
    ap.add_argument("--profile-compile", action="store_true",
                    help="profile the bf16 + torch.compile step instead of the eager bf16 one")
    ap.add_argument("--scaling", nargs=2, metavar=("A.json", "B.json"),
                    help="no benchmark: print B's samples/s over A's per variant (e.g. 2 GPUs over 1)")
    a = ap.parse_args(argv)
    if not a.scaling:
        a.stages = [s for s in a.stages.split(",") if s]
        a.variants = None if a.variants is None else [v for v in a.variants.split(",") if v]
        bad = [s for s in a.stages if s not in ("tokenizer", "world")] + [v for v in a.variants or () if v not in VARIANTS]
        if bad:
            ap.error(f"unknown stage or variant {bad}; stages: tokenizer, world; variants: {', '.join(VARIANTS)}")
        try:
            a.batches = None if a.batches is None else [int(b) for b in a.batches.split(",") if b]
        except ValueError:
            ap.error(f"--batches {a.batches!r} must be integers, e.g. 1,2,4,8")
        stage_batch = {}
        for kv in a.stage_batch:
            st, _, b = kv.partition("=")
            bs = b.split(",")
            if st not in ("tokenizer", "world") or not all(x.isdigit() and int(x) >= 1 for x in bs):
                ap.error(f"--stage-batch {kv!r} must be tokenizer=B[,B...] or world=B[,B...] with B >= 1")
            stage_batch[st] = [int(x) for x in bs]
        a.stage_batch = stage_batch
        if a.batches == [] or min(a.batches or [1]) < 1 or a.steps < 1 or a.warmup < 0 or a.saves < 1 or a.ckpt_k < 1:
            ap.error("--batches, --steps, --saves, --ckpt-k must be >= 1 and --warmup >= 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.scaling:
        return scaling_report(*a.scaling)
    cfg = load_config(a.cfg, a.set)
    cfg.logging.tensorboard, cfg.logging.images = False, False
    dist = distributed.init(cfg.train.device, cfg.ddp.timeout_s)
    base = None
    try:
        device = dist.device
        cuda = device.type == "cuda"
        if cuda:  # as train.py
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            if not torch.cuda.is_bf16_supported():
                raise WMError("this GPU has no bf16; the bf16 variants need it")
        # the bench's run folder: beside real runs (same disk: the save timing means something)
        if dist.is_main:
            Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
            base = tempfile.mkdtemp(prefix=".bench-train-", dir=cfg.run.out_dir)
        base = distributed.broadcast_object(base, dist)
        cfg.run.out_dir, cfg.run.name = base, "bench"
        run = Run(cfg, dist)
        card = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
        peaks = measure_peaks(device)
        peaks = distributed.broadcast_object(peaks, dist)
        say(dist, f"{card}, {dist.world_size} process(es); matmul peak measured: "
            + ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in peaks.items()), file=sys.stderr)
        bench = Bench(run, dist, device, a, peaks)
        if a.variants is None:
            a.variants = [v for v in VARIANTS if cuda or v != "bf16-compile"]
        results, sweeps, profiles = [], {}, {}
        tok_frames = OCCWORLD["tokenizer_frames_per_sample"]
        for stage in a.stages:
            if stage == "world":
                ensure_tokenizer_checkpoint(run, dist)
            base_batch = {"tokenizer": tok_frames, "world": 1}[stage]  # "batch 1" in OccWorld's units

            def report(rec):
                results.append(rec)
                if rec.get("status") == "ok" and "samples_per_s" in rec:
                    say(dist, f"  {stage} {rec['variant']} batch {rec['batch']}: {rec['step_ms']:.1f} ms/step, "
                        f"{rec['samples_per_s']:.2f} samples/s, MFU {100 * rec['mfu']:.1f}%", file=sys.stderr)
                else:
                    say(dist, f"  {stage} {rec['variant']}: {rec.get('status')}", file=sys.stderr)

            batches = a.stage_batch.get(stage) or a.batches or (
                [1, 2, 4, 8, 16, 32, 64] if cuda else [getattr(cfg, f"{stage}_stage").batch_size or cfg.data.batch_size])
            best_batch = max(batches)
            for v in a.variants:
                if stage == "tokenizer" and v in WORLD_ONLY:
                    continue
                if v == "fp32-b1":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "fp32", base_batch)))
                elif v == "onthefly-fp32-b1":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "fp32", base_batch), onthefly=True))
                elif v == "bf16":
                    sweep = []
                    for b in batches:
                        rec = bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", b))
                        sweep.append(rec)
                        say(dist, f"  {stage} bf16 batch {b}: " + (f"{rec['samples_per_s']:.2f} samples/s"
                                                                 if rec["status"] == "ok" else rec["status"]),
                            file=sys.stderr)
                        if rec["status"] != "ok":
                            break  # a larger batch will not fit either
                    sweeps[stage] = sweep
                    ok = [r for r in sweep if r["status"] == "ok"]
                    if not ok:
                        results.append(sweep[0])
                        continue
                    top = max(ok, key=lambda r: r["samples_per_s"])
                    best_batch = top["batch"]
                    results.append(top)
                elif v == "bf16-compile":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", best_batch, compile_=True)))
                elif v == "graphs":  # what train.py runs on CUDA, at each batch
                    for b in batches:
                        rec = bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", b, compile_=True, graphs=True))
                        report(rec)
                        if rec["status"] != "ok":
                            break
                elif v == "recipe":  # the config as it is: its batch, precision, compile and capture
                    report(bench.attempt(stage, v, copy.deepcopy(cfg)))
                elif v == "bf16-ckpt1":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", best_batch, ckpt_every=1)))
                elif v == "bf16-ckptk":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", best_batch, ckpt_every=a.ckpt_k)))
                elif v == "onthefly":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", best_batch), onthefly=True))
                elif v == "save":
                    report(bench.attempt(stage, v, bench.variant_cfg(stage, "bf16", best_batch)))

            if a.profile:
                pcfg = bench.variant_cfg(stage, "bf16" if cuda else "fp32", best_batch, compile_=a.profile_compile)
                p = bench.profile(stage, pcfg, a.profile)
                p["compile"] = a.profile_compile
                profiles[stage] = p
                if dist.is_main:
                    print(f"\nprofile, {stage} stage, batch {p['batch']}: {p['wall_ms_per_step']:.1f} ms/step wall"
                          + (f", GPU busy {p['device_busy_ms_per_step']:.1f} ms/step" if p["device_busy_ms_per_step"] else ""))
                    for kind, ms in p["split_ms_per_step"].items():
                        print(f"  {kind:<20}{ms:9.2f} ms/step")
                    for r in p["top"]:
                        print(f"  {r['ms_per_step']:9.2f} ms/step  {r['calls_per_step']:6.1f}x  {r['kernel']}")
                    for r in p["copy_callers"][:8]:
                        print(f"  copy {r['ms_per_step']:9.2f} ms/step  {r['calls_per_step']:6.1f}x  {r['callers'][:160]}")

        extra = extrapolate(results)
        found = checks(results, extra, cuda, card)
        if dist.is_main:
            print(f"\n{a.cfg or 'demo config'}: {card}, {dist.world_size} {'GPU(s)' if cuda else 'process(es)'}, "
                  f"torch {torch.__version__}; "
                  f"{a.steps} timed steps after {a.warmup} warm-up; batch = per GPU (tokenizer: frames, world: windows "
                  f"of {cfg.data.window} frames); MFU over the measured {'bf16' if cuda else 'fp32'} matmul peak "
                  f"({peaks['bf16' if cuda else 'fp32']:.3g} TFLOP/s{' per GPU' if cuda else ''})")
            print(table(results))
            if any(extra.get(st) for st in ("tokenizer", "world")):
                print(f"\nthe config's schedule ({extra['assumption']}):")
            for stage in ("tokenizer", "world"):
                e = extra.get(stage)
                if e:
                    print(f"  {stage:<10} {e['steps']} steps x {e['global_batch']} samples at {e['samples_per_s']:.2f}/s "
                          f"(batch {e['batch']} x {e['grad_accum']} x {e['world_size']} GPU): {e['gpu_hours']:.2f} GPU-hours")
            if extra["gpu_hours"] is not None:
                print(f"  total {extra['gpu_hours']:.2f} GPU-hours")
            for name, ok in found:
                print(f"{'PASS' if ok else 'FAIL'}  {name}")
            if a.json:
                out = {"machine": {"device": card, "world_size": dist.world_size, "cpus": os.cpu_count(),
                                   "torch": torch.__version__, "cuda": torch.version.cuda,
                                   "platform": platform.platform()},
                       "settings": {"cfg": a.cfg, "set": a.set, "stages": a.stages, "variants": a.variants,
                                    "batches": a.batches or "default", "steps": a.steps, "warmup": a.warmup,
                                    "ckpt_k": a.ckpt_k, "saves": a.saves, "save_gap": a.save_gap},
                       "peaks_tflops": peaks, "results": results, "sweeps": sweeps,
                       "extrapolation": extra, "checks": {n: ok for n, ok in found}, "profiles": profiles}
                Path(a.json).write_text(json.dumps(out, indent=1))
                print(f"wrote {a.json}")
        distributed.barrier(dist)
        run.log.close()
        return 0
    finally:
        if dist.is_main and base:
            shutil.rmtree(base, ignore_errors=True)
        distributed.close(dist)


def ensure_tokenizer_checkpoint(run: Run, dist: distributed.Dist) -> None:
    """A randomly initialised tokenizer checkpoint for the world stage (timing needs no trained one)."""
    folder = run.stage_dir("tokenizer") / "checkpoints"
    if dist.is_main and latest_checkpoint(folder) is None:
        cfg = run.cfg
        torch.manual_seed(cfg.run.seed)
        tok = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **model_options(cfg, "tokenizer"))
        with Checkpointer(folder, async_save=False) as ck:
            ck.save({"model": tok.state_dict(), "stage": "tokenizer", "config": to_dict(cfg),
                     "data_fingerprint": run.fingerprint}, 0)
    distributed.barrier(dist)


if __name__ == "__main__":
    freeze_imports()  # as train.py does: the collector's pauses timed as training has them
    run_cli(main)
