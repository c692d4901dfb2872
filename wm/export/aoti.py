"""The whole forecast compiled ahead of time (AOTInductor): a `.pt2` package that loads in seconds.

torch.compile of the Forecaster costs minutes on a fresh machine (Inductor writes and tunes every
kernel); a deployment should not wait for it. `export.py --aoti` traces the forecast once with
torch.export (encode the past frames, roll the world model out with its key/value cache, decode,
argmax: what wm.forecaster computes, at one batch size, past length and horizon) and compiles it
with `torch._inductor.aoti_compile_and_package`: the package holds the compiled kernels with their
tuned launch settings, so loading it compiles and tunes nothing.

A package runs only where it was compiled for: the same device kind, torch and (on a GPU) Triton
and CUDA versions (wm.training.compile_cache.machine_key). Its name carries the shape and dtype and a
16-digit key of the machine; `<package>.json` beside it records the key, the shapes, the
checkpoints it was built from and its sha256. `load_package` refuses, in one line, a package of
another machine, a damaged one, or one built from other checkpoints than the run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from wm.checkpoint.files import sha256_file
import wm.training.compile_cache as compile_cache
from wm.utils.atomic import write_bytes
from wm.utils.errors import WMError
from wm.utils.precision import cast_for_inference

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Inductor's options of a tuned package: coordinate-descent launch settings per kernel and NHWC
# convolutions, as the training tokenizer compiles (minutes more of compilation, once per machine kind)
TUNED = {"coordinate_descent_tuning": True, "force_layout_optimization": True}


class WholeForecast(nn.Module):
    """past occupancy (B, P, X, Y, Z) uint8, motion (B, P, 3) and, for a `given` package, the future
    motion (B, S, 3) -> future occupancy (B, S, X, Y, Z) uint8, motion (B, S, 3) and codes (B, S, h, w):
    the Forecaster's computation as one module (under autocast to `amp` when set)."""

    def __init__(self, tokenizer: nn.Module, world: nn.Module, steps: int, amp: Optional[torch.dtype]):
        super().__init__()
        self.tokenizer, self.world, self.steps, self.amp = tokenizer, world, steps, amp

    def forward(self, occ: Tensor, motion: Tensor, future_motion: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        amp = (torch.autocast(occ.device.type, dtype=self.amp) if self.amp is not None
               else contextlib.nullcontext())
        with amp:
            past = self.tokenizer.encode(occ)
            codes, future_motion = self.world.rollout(past, motion, self.steps, future_motion=future_motion)
            pred = self.tokenizer.decode(codes).argmax(2).to(torch.uint8)
        return pred, future_motion.float(), codes


def package_name(batch: int, past: int, steps: int, dtype: str, given: bool, device: torch.device) -> str:
    motion = "given" if given else "predicted"
    return (f"forecast-b{batch}-p{past}-s{steps}-{motion}-{dtype}-"
            f"{compile_cache.key_name(compile_cache.machine_key(device))}.pt2")


def build(trained, out: Path, device: torch.device, dtype: str = "bf16", batch: int = 1,
          steps: Optional[int] = None, given: Optional[bool] = None, say=print, tuned: bool = False) -> dict:
    """Export and compile the forecast of `trained` (wm.export.onnx.Trained) for `device` into
    `out`, with the future ego motion given (default: as the run evaluates, train.forecast_motion)
    or predicted, its kernels `tuned` (TUNED); returns what export.json records (file, seconds,
    agreement with PyTorch)."""
    if dtype not in DTYPES:
        raise WMError(f"--aoti-dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    if batch < 1:
        raise WMError(f"--aoti-batch must be >= 1, got {batch}")
    cfg = trained.cfg
    P, S = cfg.data.past, steps or cfg.data.future
    given = cfg.train.forecast_motion == "given" if given is None else given
    amp = DTYPES[dtype]  # the matmul weights in the autocast dtype once, as the Forecaster holds them
    module = WholeForecast(cast_for_inference(trained.tokenizer.to(device).eval(), amp),
                           cast_for_inference(trained.world.to(device).eval(), amp), S, amp)
    gen = torch.Generator().manual_seed(0)
    occ = torch.randint(0, cfg.data.num_classes, (batch, P, *cfg.data.grid), generator=gen, dtype=torch.uint8).to(device)
    motion = (torch.randn(batch, P, 3, generator=gen) * 0.5).to(device)
    args = (occ, motion) + (((torch.randn(batch, S, 3, generator=gen) * 0.5).to(device),) if given else ())
    path = Path(out) / package_name(batch, P, S, dtype, given, device)
    compile_cache.prepare()
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, args)
        export_s = time.perf_counter() - t0
        say(f"  AOTInductor: traced the forecast (batch {batch}, {P} past -> {S} future frames, "
            f"{'given' if given else 'predicted'} ego motion, {dtype}{', tuned kernels' if tuned else ''}) in "
            f"{export_s:.1f} s; compiling for {compile_cache.describe(compile_cache.machine_key(device))} ...")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # AOTInductor wants a name ending .pt2
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp),
                                                 **({"inductor_configs": dict(TUNED)} if tuned else {}))
        tmp.replace(path)  # a killed compile leaves no package that looks whole
        compile_s = time.perf_counter() - t0 - export_s
        ref = module(*args)
    blob = path.read_bytes()
    meta = {"key": compile_cache.machine_key(device), "batch": batch, "past": P, "steps": S, "dtype": dtype, "given": given,
            "tuned": tuned,
            "grid": list(cfg.data.grid), "checkpoint": str(trained.ckpt),
            "checkpoint_sha256": None if trained.ckpt is None else sha256_file(trained.ckpt),  # random weights: none
            "tokenizer_checkpoint": str(trained.tokenizer_ckpt),
            "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    write_bytes(path.with_name(path.name + ".json"), json.dumps(meta, indent=1))
    runner, load_s = load_package(path, device, trained.ckpt)
    with torch.no_grad():
        got = runner(*args)
    agree = float((got[0] == ref[0]).float().mean())
    return {"file": path.name, "bytes": len(blob), "export_s": round(export_s, 1), "compile_s": round(compile_s, 1),
            "load_s": round(load_s, 2), "class_agreement": round(agree, 6),
            **{k: meta[k] for k in ("batch", "past", "steps", "dtype", "given", "tuned")}}


def find_package(folder: Path, device: torch.device, batch: int, past: int, steps: int, dtype: str,
                 given: bool) -> Path:
    """The package in `folder` for this machine and shape, or one line saying what is there instead."""
    want = Path(folder) / package_name(batch, past, steps, dtype, given, device)
    if want.is_file():
        return want
    others = sorted(p.name for p in Path(folder).glob("forecast-*.pt2")) if Path(folder).is_dir() else []
    there = f"{folder} holds {', '.join(others)}" if others else f"{folder} holds no AOTInductor package"
    motion = "given" if given else "predicted"
    raise WMError(f"no AOTInductor package for batch {batch}, {past} past -> {steps} future frames, {motion} "
                  f"ego motion, {dtype} on "
                  f"{compile_cache.describe(compile_cache.machine_key(device))} ({want.name}); {there}: run "
                  f"python export.py --run <run> --aoti --aoti-batch {batch} --aoti-dtype {dtype} --aoti-motion {motion} "
                  "on this kind of machine")


def load_package(path: Path, device: torch.device, checkpoint: Optional[Path] = None, graph: bool = False):
    """(callable, seconds to load) of a package, checked against its record: its sha256, the
    machine it was compiled for, and (given) the world-model checkpoint it was built from.
    `graph`: the call is recorded into a CUDA graph, so the runner must not wait on its own events
    (which a capturing stream forbids)."""
    path = Path(path)
    meta_path = path.with_name(path.name + ".json")
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("key"), dict):
            raise ValueError("not a package record")
    except (OSError, ValueError) as e:
        raise WMError(f"AOTInductor package {path}: its record {meta_path.name} is missing or damaged "
                      f"({type(e).__name__}); rebuild it with export.py --aoti") from None
    here = compile_cache.machine_key(device)
    if meta["key"] != here:
        raise WMError(f"AOTInductor package {path} was compiled for {compile_cache.describe(meta['key'])}; this "
                      f"machine is {compile_cache.describe(here)}: build one here with export.py --aoti")
    if hashlib.sha256(path.read_bytes()).hexdigest() != meta.get("sha256"):
        raise WMError(f"AOTInductor package {path} does not match its recorded sha256 (damaged or replaced); "
                      "rebuild it with export.py --aoti")
    if checkpoint is not None and meta.get("checkpoint_sha256") != sha256_file(checkpoint):
        raise WMError(f"AOTInductor package {path} was built from {meta.get('checkpoint')}, not {checkpoint}; "
                      "rebuild it with export.py --aoti")
    t0 = time.perf_counter()
    runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=graph)
    return runner, time.perf_counter() - t0
