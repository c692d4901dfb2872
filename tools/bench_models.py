"""Parameter counts, and forward+backward time and memory of the two models of a config.

    python tools/bench_models.py --cfg configs/occworld.json                 # counts (meta device)
    python tools/bench_models.py --cfg configs/occworld.json --time --batch 1 --ckpt 0 1 --json out.json
    python tools/bench_models.py --cfg configs/occworld.json --time --models world --ckpt 0 1 --compile

With --time (CUDA): one training forward+backward per iteration under autocast (bf16 unless
--amp), after warm-up, for each activation-checkpointing setting given (`--ckpt 0 1 2`: off, every
block, every 2nd block). Reported per model: ms per step, samples/s, peak allocated memory, and the
activation memory (peak during the step minus what was allocated before it: parameters and
optimizer-free state). World-model samples are windows of `--frames` input frames (default: the
config's data.past + data.future - 1, what one teacher-forced window feeds).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wm.config.loading import load
from wm.config.sections import model_options  # noqa: E402
from wm.models.layers import count_parameters  # noqa: E402
from wm.models.tokenizer import Tokenizer  # noqa: E402
from wm.models.world import WorldModel  # noqa: E402
from wm.utils.errors import WMError, run_cli  # noqa: E402


def build(cfg, ckpt_every=None):
    over = {} if ckpt_every is None else {"checkpoint_every": ckpt_every}
    tok = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **{**model_options(cfg, "tokenizer"), **over})
    world = WorldModel(cfg.world, cfg.tokenizer.codebook_size, **{**model_options(cfg, "world"), **over})
    return tok, world


def time_step(fn, params, iters: int, warmup: int = 3) -> tuple[float, float, float]:
    """(seconds per step, peak GiB, activation GiB) of fn() -> loss, backward included."""
    for _ in range(warmup):
        fn().backward()
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(iters):
        fn().backward()
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / iters
    peak = torch.cuda.max_memory_allocated()
    return dt, peak / 2**30, (peak - base) / 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", default=None, help="config file (default: the demo)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--time", action="store_true", help="time forward+backward on CUDA")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--frames", type=int, default=0, help="world-model input frames (0: from the config)")
    ap.add_argument("--ckpt", type=int, nargs="*", default=[0, 1], help="checkpoint_every values to time")
    ap.add_argument("--compile", action="store_true", help="torch.compile each step (warm-up compiles)")
    ap.add_argument("--models", nargs="+", choices=("tokenizer", "world"), default=["tokenizer", "world"],
                    help="which models to time")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--amp", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    cfg = load(a.cfg, a.set)
    with torch.device("meta"):
        tok, world = build(cfg)
    counts = {"tokenizer_params": count_parameters(tok), "world_params": count_parameters(world)}
    print(f"{a.cfg or 'demo'}: tokenizer {counts['tokenizer_params'] / 1e6:.2f} M parameters, "
          f"world model {counts['world_params'] / 1e6:.2f} M parameters "
          f"(grid {'x'.join(map(str, cfg.data.grid))}, codebook {cfg.tokenizer.codebook_size})")
    out = {"config": a.cfg, **counts, "timings": []}
    if a.time:
        if not torch.cuda.is_available():
            raise WMError("--time needs a CUDA device")
        dev = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[a.amp]
        X, Y, Z = cfg.data.grid
        T = a.frames or cfg.data.window - 1
        g = torch.Generator(device=dev).manual_seed(0)
        occ = torch.randint(0, cfg.data.num_classes, (a.batch, X, Y, Z), device=dev, generator=g).to(torch.uint8)
        h, w = X // cfg.tokenizer.downsample, Y // cfg.tokenizer.downsample
        codes = torch.randint(0, cfg.tokenizer.codebook_size, (a.batch, T + 1, h, w), device=dev, generator=g)
        motion = torch.randn(a.batch, T + 1, 3, device=dev, generator=g)
        print(f"{'model':<10}{'ckpt':>14}{'ms/step':>10}{'samples/s':>11}{'peak GiB':>10}{'activ. GiB':>11}"
              f"   (batch {a.batch}, {a.amp}, world {T} input frames, {torch.cuda.get_device_name()})")
        for ck in a.ckpt:
            tok, world = build(cfg, ck)
            for name, m in (("tokenizer", tok), ("world", world)):
                if name not in a.models:
                    continue
                m = m.to(dev).train()
                params = list(m.parameters())
                ctx = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype else torch.enable_grad
                if name == "tokenizer":
                    def fn():
                        with ctx():
                            return m(occ, logits=False)["loss"]
                else:
                    def fn():
                        with ctx():
                            return m.window_loss(codes, motion)["loss"]
                if a.compile:
                    torch._dynamo.reset()
                    fn = torch.compile(fn)
                dt, peak, act = time_step(fn, params, a.iters)
                out["timings"].append({"model": name, "checkpoint_every": ck,
                                       "compile": a.compile, "batch": a.batch,
                                       "frames": 1 if name == "tokenizer" else T, "amp": a.amp,
                                       "ms_per_step": dt * 1e3, "samples_per_s": a.batch / dt,
                                       "peak_gib": peak, "activation_gib": act,
                                       "device": torch.cuda.get_device_name()})
                print(f"{name:<10}{ck:>14}{dt * 1e3:>10.1f}{a.batch / dt:>11.2f}{peak:>10.2f}{act:>11.2f}",
                      flush=True)
                if a.json:  # after every setting: a run cut short keeps what it measured
                    Path(a.json).write_text(json.dumps(out, indent=1))
                m.to("cpu")
                del m, params
                torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    run_cli(main)
