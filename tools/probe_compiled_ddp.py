"""Compiled DDP against eager DDP of the world model: the loss and every parameter's gradient after
each of a few steps, and the tangents the compiled backward pieces receive at run time against the
layout they were traced with (AOTAutograd copies a tangent whose strides differ: "restrided").

    torchrun --nproc_per_node 2 tools/probe_compiled_ddp.py --device cpu            # gloo, tiny model
    torchrun --nproc_per_node 2 tools/probe_compiled_ddp.py --device cuda --occworld --amp bf16 \\
        --variants compile_ddp --grid 50 --frames 11 --batch 16 --bucket-mib 100

Variants (each against eager DDP with the same weights and batches):
  compile_ddp          torch.compile(DDP(model)), what train.py runs (Dynamo's DDPOptimizer splits
                       the graph at the gradient buckets, AOTAutograd compiles each piece)
  compile_ddp_nosplit  the same with torch._dynamo.config.optimize_ddp = False (one graph)
  compile_ddp_nolayout the same with Inductor's layout optimisation off
  ddp_compile          DDP(torch.compile(model))
A CUDA error ends the process: give one variant per run on a GPU. Prints one JSON report (rank 0).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import wm.train as T  # noqa: E402
from wm import distributed as D  # noqa: E402
from wm.config import Config  # noqa: E402
from wm.world import WorldConfig, WorldModel  # noqa: E402

VARIANTS = ("compile_ddp", "compile_ddp_nosplit", "compile_ddp_nolayout", "ddp_compile")


def spy_tangents(log: list, echo: bool) -> None:
    """Record every tangent AOTAutograd hands a compiled backward: shape, strides, offset, dtype, the
    traced layout, and whether it had to be copied into that layout; `echo`: also print each one as
    it comes (a CUDA error may end the process before the report)."""
    import torch._functorch._aot_autograd.runtime_wrappers as rw

    real = rw.coerce_to_expected_memory_format

    def spy(x, mf):
        y = real(x, mf)
        log.append({"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape), "stride": list(x.stride()),
                    "offset": x.storage_offset(),
                    "traced": str(mf.memory_format) if mf.memory_format is not None else list(mf.stride),
                    "restrided": y is not x})
        if echo:
            print("tangent " + json.dumps(log[-1]), file=sys.stderr, flush=True)
        return y

    rw.coerce_to_expected_memory_format = spy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--channels-last", default="1,0", help="world.channels_last values to try")
    ap.add_argument("--occworld", action="store_true", help="OccWorld's world model (else a small one)")
    ap.add_argument("--bucket-mib", type=float, default=1.0, help="DDP bucket size (>= 1: DDPOptimizer's first bucket)")
    ap.add_argument("--grid", type=int, default=10, help="token map side")
    ap.add_argument("--frames", type=int, default=5, help="window frames (input frames + 1)")
    ap.add_argument("--batch", type=int, default=2, help="windows per rank")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--amp", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--codes", type=int, default=512)
    ap.add_argument("--echo", action="store_true", help="print every tangent as it comes (rank 0, stderr)")
    a = ap.parse_args(argv)
    d = D.init(a.device, 900)
    dev, dtype = d.device, {"fp32": None, "bf16": torch.bfloat16}[a.amp]
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tangents: list = []
    spy_tangents(tangents, echo=a.echo and d.is_main)
    g = torch.Generator().manual_seed(100 + d.rank)
    data = [(torch.randint(0, a.codes, (a.batch, a.frames, a.grid, a.grid), generator=g).to(dev),
             torch.randn(a.batch, a.frames, 3, generator=g).to(dev)) for _ in range(a.steps)]
    cfg = Config()
    cfg.train.ddp_bucket_mib = a.bucket_mib

    def run(variant: str, cl: bool):
        import torch._dynamo
        import torch._inductor.config as ic

        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = variant != "compile_ddp_nosplit"
        ic.layout_optimization = variant != "compile_ddp_nolayout"
        torch.manual_seed(0)
        wc = WorldConfig.occworld() if a.occworld else WorldConfig(widths=(32, 64, 128), blocks_per_level=2,
                                                                   temporal_layers=2, pose_layers=1, heads=4)
        wc.channels_last = cl
        model = WorldModel(wc, a.codes).to(dev)
        if variant == "ddp_compile":
            fwd = T.wrap_ddp(torch.compile(model), cfg, dev, d)
        else:
            ddp = T.wrap_ddp(model, cfg, dev, d)
            fwd = ddp if variant == "eager" else torch.compile(ddp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out, t0 = [], time.perf_counter()
        del tangents[:]
        for codes, motion in data:
            with T.autocast(dev, dtype):
                res = fwd(codes[:, :-1], motion[:, :-1], codes[:, 1:], motion[:, 1:])
            res["loss"].backward()
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
            out.append((float(res["loss"].detach()), grads))
            opt.step()
            opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0, list(tangents)

    report = {}
    for cl in [bool(int(c)) for c in a.channels_last.split(",")]:
        ref, _, _ = run("eager", cl)
        for v in a.variants.split(","):
            got, took, tang = run(v, cl)
            steps = []
            for (l0, g0), (l1, g1) in zip(ref, got):
                rel = {n: ((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-12)).item() for n in g0 if n in g1}
                worst = max(rel, key=rel.get)
                steps.append({"loss_eager": l0, "loss": l1, "grad_max_rel_diff": rel[worst], "worst": worst,
                              "missing_grads": sorted(set(g0) - set(g1))})
            report[f"{v}/channels_last={int(cl)}"] = {
                "seconds": round(took, 1), "steps": steps, "tangents": len(tang),
                "restrided": [t for t in tang if t["restrided"]][:12]}
    if d.is_main:
        print(json.dumps({"torch": torch.__version__, "device": str(dev), "world_size": d.world_size,
                          "amp": a.amp, "report": report}, indent=1))
    D.close(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
