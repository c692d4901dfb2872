"""ONNX export of a trained run: the forecaster and the tokenizer, checked against PyTorch.

Graphs (batch dimension dynamic in all of them):

- `forecaster.onnx`: past occupancy uint8 (B, P, X, Y, Z) + past ego motion (B, P, 3) [+ future
  ego motion (B, S, 3) when the run forecasts with given motion] -> future occupancy uint8
  (B, S, X, Y, Z). Encode, the world model's rollout unrolled to the configured horizon, decode,
  argmax: one graph, what a deployment runs.
- `tokenizer_encode.onnx`: occupancy uint8 (B, X, Y, Z) -> codes int64 (B, X/4, Y/4).
- `tokenizer_decode.onnx`: codes int64 (B, X/4, Y/4) -> logits float32 (B, C, X, Y, Z).

Every file is written to a temporary name, checked with `onnx.checker`, then renamed: nothing
half-written ever sits under a final name.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from wm.atomic import discard, publish, tmp_path
from wm.checkpoint import latest_checkpoint, load
from wm.config import Config, from_dict
from wm.errors import ConfigError, WMError
from wm.tokenizer import Tokenizer
from wm.world import WorldModel


class ExportError(WMError):
    pass


# ---------------------------------------------------------------------------------------------
# what to export


@dataclass
class Trained:
    """A world-model checkpoint with its frozen tokenizer and config."""

    cfg: Config
    tokenizer: Tokenizer
    world: WorldModel
    ckpt: Path
    tokenizer_ckpt: Path
    data_fingerprint: str


def find_run(runs: str | os.PathLike = "runs") -> Path:
    """The run under `runs/` whose world stage saved most recently."""
    base = Path(runs)
    found = []
    for d in base.iterdir() if base.is_dir() else []:
        p = latest_checkpoint(d / "world" / "checkpoints")
        if p is not None:
            found.append((p.stat().st_mtime, d))
    if not found:
        raise ExportError(f"no world-model run under {base}/ (looked for */world/checkpoints/); "
                          "train one first, or name it with --run")
    return max(found)[1]


def load_trained(run: str | os.PathLike, ckpt: Optional[str | os.PathLike] = None) -> Trained:
    """The run's best world-model checkpoint (or `ckpt`), its tokenizer, and its config; refused
    with one line when a piece is missing, truncated, from the tokenizer stage only, or does not
    match its config."""
    run = Path(run)
    if not run.is_dir():
        raise ExportError(f"run folder {run} does not exist (--run)")
    if ckpt is None:
        folder = run / "world" / "checkpoints"
        best = folder / "best.pt"
        ckpt = best if best.is_file() else latest_checkpoint(folder)
        if ckpt is None:
            tok = latest_checkpoint(run / "tokenizer" / "checkpoints")
            what = "only the tokenizer stage" if tok else "no checkpoint"
            raise ExportError(f"{run} holds {what}: the forecaster needs a world-model checkpoint "
                              f"({folder}); train the world stage first")
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise ExportError(f"checkpoint {ckpt} does not exist (--ckpt)")
    st = load(ckpt)  # CheckpointError (a WMError) names a truncated or corrupt file
    if st.get("stage") != "world":
        raise ExportError(f"{ckpt} is a {st.get('stage', 'unknown')}-stage checkpoint; export needs a "
                          "world-model checkpoint (runs/<name>/world/checkpoints/)")
    try:
        cfg = from_dict(Config, st["config"]).validate()
    except ConfigError as e:
        raise ExportError(f"{ckpt}: its config is refused ({e})") from None
    tinfo = st.get("tokenizer") or {}
    tpath = Path(tinfo.get("path", ""))
    if not tpath.is_file():
        raise ExportError(f"{ckpt} was trained on tokenizer {tpath}, which is missing; restore it "
                          "(the world model's codes mean nothing without it)")
    tst = load(tpath)
    tok = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid))
    world = WorldModel(cfg.world, cfg.tokenizer.codebook_size)
    try:
        tok.load_state_dict(tst["model"])
        world.load_state_dict(st["model"])
    except (RuntimeError, KeyError) as e:
        raise ExportError(f"{ckpt}: the weights do not fit the model its config describes "
                          f"({str(e).splitlines()[0]})") from None
    return Trained(cfg, tok.eval(), world.eval(), ckpt, tpath, st.get("data_fingerprint", ""))


# ---------------------------------------------------------------------------------------------
# graph wrappers: plain modules whose forward is exactly what the graph computes


class Encode(nn.Module):
    def __init__(self, tok: Tokenizer):
        super().__init__()
        self.tok = tok

    def forward(self, occ):
        return self.tok.encode(occ)


class Decode(nn.Module):
    def __init__(self, tok: Tokenizer):
        super().__init__()
        self.tok = tok

    def forward(self, codes):
        return self.tok.decode(codes)


class Forecast(nn.Module):
    """Past occupancy (+ ego motion) -> future occupancy, the rollout unrolled `steps` times."""

    def __init__(self, tok: Tokenizer, world: WorldModel, steps: int, given_motion: bool):
        super().__init__()
        self.tok, self.world, self.steps, self.given = tok, world, steps, given_motion

    def forward(self, past_occ, past_motion, future_motion=None):
        codes = self.tok.encode(past_occ)
        fut, _ = self.world.rollout(codes, past_motion, self.steps,
                                    future_motion=future_motion if self.given else None)
        return self.tok.decode(fut).argmax(2).to(torch.uint8)


def example_inputs(t: Trained, batch: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Random but valid inputs of every graph (class ids in range, motion of driving size)."""
    cfg, g = t.cfg, torch.Generator().manual_seed(seed)
    X, Y, Z = cfg.data.grid
    P, S, C = cfg.data.past, cfg.data.future, cfg.data.num_classes
    h, w = X // 4, Y // 4
    occ = torch.randint(0, C, (batch, P, X, Y, Z), generator=g).to(torch.uint8)
    motion = torch.randn(batch, P + S, 3, generator=g) * torch.tensor([5.0, 0.5, 0.05])
    fc = {"past_occ": occ, "past_motion": motion[:, :P]}
    if cfg.train.forecast_motion == "given":
        fc["future_motion"] = motion[:, P:]
    return {"forecaster": fc,
            "tokenizer_encode": {"occ": occ[:, 0]},
            "tokenizer_decode": {"codes": torch.randint(0, cfg.tokenizer.codebook_size, (batch, h, w), generator=g)}}


def graphs(t: Trained) -> dict[str, tuple[nn.Module, list[str]]]:
    given = t.cfg.train.forecast_motion == "given"
    return {"forecaster": (Forecast(t.tokenizer, t.world, t.cfg.data.future, given).eval(), ["future_occ"]),
            "tokenizer_encode": (Encode(t.tokenizer).eval(), ["codes"]),
            "tokenizer_decode": (Decode(t.tokenizer).eval(), ["logits"])}


# ---------------------------------------------------------------------------------------------
# export, check, compare


@contextlib.contextmanager
def _exporter_quiet():
    """Silence the exporter's chatter that says nothing about our graphs (torchvision ops it skips,
    pytree deprecations, a dynamic-axis naming note); real errors still raise."""
    import logging
    import warnings

    lg = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=r".*axis name.*will not be used")
            yield
    finally:
        lg.setLevel(level)


def export_graph(module: nn.Module, inputs: dict[str, torch.Tensor], outputs: list[str], path: Path,
                 max_batch: int = 64, quiet: bool = True) -> float:
    """torch.onnx.export (dynamo) with a dynamic batch, checked, written atomically. Returns seconds."""
    import onnx

    path = Path(path)
    tmp = tmp_path(path)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    t0 = time.perf_counter()
    sink = io.StringIO()
    try:
        with torch.no_grad(), contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext(), \
                _exporter_quiet() if quiet else contextlib.nullcontext():
            torch.onnx.export(module, tuple(inputs.values()), str(tmp), input_names=list(inputs),
                              output_names=outputs, dynamic_shapes=tuple({0: batch} for _ in inputs),
                              dynamo=True, external_data=False)
        model = onnx.load(str(tmp))
        if fold_weight_transposes(model):
            onnx.save(model, str(tmp))
        onnx.checker.check_model(str(tmp), full_check=True)
        publish(tmp, path)
    except OSError as e:
        discard(tmp)
        raise ExportError(f"cannot write {path}: {e}") from None
    except Exception as e:
        discard(tmp)
        if isinstance(e, WMError):
            raise
        raise ExportError(f"exporting {path.name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    return time.perf_counter() - t0


def fold_weight_transposes(model) -> int:
    """Replace every Transpose of an initializer by the transposed initializer, in place; returns
    how many. The exporter leaves `Transpose(W)` in front of a MatMul where W is large (onnxscript's
    constant folding skips big tensors), e.g. every linear layer the rollout reuses. Downstream that
    would make W an activation: the INT8 step would calibrate it per tensor like data (clipping
    weights) instead of quantizing it per channel as a weight. TensorRT would fold it anyway."""
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    folded = []
    for n in g.node:
        if n.op_type == "Transpose" and len(n.input) == 1 and n.input[0] in inits:
            w = numpy_helper.to_array(inits[n.input[0]])
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(np.transpose(w, perm)), n.output[0]))
            folded.append(n)
    if not folded:
        return 0
    for n in folded:
        g.node.remove(n)
    done = {n.output[0] for n in folded}
    keep_vi = [vi for vi in g.value_info if vi.name not in done]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    used = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    unused = [i for i in g.initializer if i.name not in used]
    for i in unused:
        g.initializer.remove(i)
    return len(folded)


def session(path: Path, threads: int = 0):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def compare(module: nn.Module, path: Path, inputs: dict[str, torch.Tensor]) -> dict:
    """Run the graph in onnxruntime and the module in PyTorch on the same inputs: class agreement
    (integer outputs: fraction equal; logits: fraction of equal argmax over classes) and the max
    absolute difference of float outputs."""
    sess = session(path)
    got = sess.run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    with torch.no_grad():
        ref = module(*inputs.values()).numpy()
    if got.shape != ref.shape:
        raise ExportError(f"{path.name}: onnxruntime gives shape {got.shape}, PyTorch {ref.shape}")
    if np.issubdtype(ref.dtype, np.floating):
        return {"class_agreement": float((got.argmax(1) == ref.argmax(1)).mean()),
                "max_abs_diff": float(np.abs(got.astype(np.float64) - ref).max())}
    return {"class_agreement": float((got == ref).mean()), "max_abs_diff": None}
