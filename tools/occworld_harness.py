"""OccWorld's own model code, built at its config's sizes and run the way its evaluation runs it, for
`tools/bench_infer.py --occworld PATH` (PATH: a checkout of https://github.com/wzzheng/OccWorld).

None of OccWorld's code is in this repository: its modules are imported from PATH. What they import
and a GPU host may lack is replaced by minimal shims of ours, only where the real package is not
installed:

- ``mmengine.registry.MODELS`` (register_module, build from a dict with ``type``) and
  ``mmengine.model.BaseModule`` (an nn.Module taking ``init_cfg``; ``init_weights`` keeps the layers'
  own random initialisation, what mmengine does when no init_cfg is given);
- ``einops.rearrange`` for the axis patterns its model uses (groups, permutations, unit axes);
- ``utils.metric_stp3``: its planning metric (cv2, scikit-image, nuscenes-devkit), which its
  evaluation applies to the forecast after the model has run, and which is not timed.

The timed call is what its evaluation (eval_metric_stp3.py with config/occworld.py) runs per
validation sample: ``model.forward_autoreg_with_pose(x, metas, start_frame, mid_frame, end_frame)``
under torch.no_grad in fp32 with cudnn.benchmark, x the sample's ``end_frame + 1`` occupancy frames
(all of them encoded, as its code does), then ``end_frame - mid_frame`` autoregressive steps (each
re-runs the transformer over all frames so far: it has no cache), then the decoder. Weights are
random: the time does not depend on them.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import re
import runpy
import sys
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wm.errors import WMError

MODEL_FILES = ("model/TransVQVAE.py", "model/transformer/PlanUtransformer.py", "config/occworld.py")


# ---------------------------------------------------------------------------------------------
# shims


class Registry:
    """mmengine's registry, as far as OccWorld's model uses it."""

    def __init__(self, name: str):
        self.name, self.classes = name, {}

    def register_module(self, name=None, force=False, module=None):
        def add(cls):
            self.classes[name or cls.__name__] = cls
            return cls

        return add(module) if module is not None else add

    def build(self, cfg: dict):
        cfg = dict(cfg)
        kind = cfg.pop("type", None)
        if kind not in self.classes:
            raise WMError(f"OccWorld config names model type {kind!r}, which its model package did not register "
                          f"(registered: {', '.join(sorted(self.classes))})")
        return self.classes[kind](**cfg)


class BaseModule(nn.Module):
    """mmengine's BaseModule without an init_cfg: the layers keep PyTorch's default initialisation."""

    def __init__(self, init_cfg=None):
        super().__init__()
        self.init_cfg = init_cfg

    def init_weights(self):
        pass


def _tokens(side: str) -> list[list[str]]:
    """'(b f) c 1' -> [['b', 'f'], ['c'], ['1']]: one list of axis names per dimension."""
    dims, group = [], None
    for tok in re.findall(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|\d+", side):
        if tok == "(":
            group = []
        elif tok == ")":
            dims.append(group)
            group = None
        elif group is not None:
            group.append(tok)
        else:
            dims.append([tok])
    return dims


def rearrange(t: torch.Tensor, pattern: str, **sizes) -> torch.Tensor:
    """einops.rearrange for patterns of named axes, parenthesised groups and unit axes ('1')."""
    left, right = (_tokens(s) for s in pattern.split("->"))
    if len(left) != t.dim():
        raise ValueError(f"rearrange {pattern!r}: {t.dim()}-d input")
    names, shape = [], []
    for dim, group in zip(t.shape, left):
        known = [sizes.get(a, 1 if a == "1" else None) for a in group]
        missing = [i for i, k in enumerate(known) if k is None]
        if missing:
            known[missing[0]] = dim // int(np.prod([k for k in known if k is not None]))
        names += group
        shape += known
    kept = [a for a in names if a != "1"]
    size = dict(zip(names, shape))
    x = t.reshape([size[a] for a in kept]).permute([kept.index(a) for g in right for a in g if a != "1"])
    return x.reshape([int(np.prod([1 if a == "1" else size[a] for a in g])) for g in right])


def install_shims() -> list[str]:
    """Shim modules for what is not installed; returns their names."""
    done = []
    try:
        import mmengine.model  # noqa: F401
        import mmengine.registry  # noqa: F401
    except ImportError:
        mm = types.ModuleType("mmengine")
        reg, model = types.ModuleType("mmengine.registry"), types.ModuleType("mmengine.model")
        reg.MODELS, model.BaseModule = Registry("model"), BaseModule
        mm.registry, mm.model = reg, model
        sys.modules.update({"mmengine": mm, "mmengine.registry": reg, "mmengine.model": model})
        done.append("mmengine")
    try:
        import einops  # noqa: F401
    except ImportError:
        ein = types.ModuleType("einops")
        ein.rearrange = rearrange
        sys.modules["einops"] = ein
        done.append("einops")
    if "utils.metric_stp3" not in sys.modules:
        stub = types.ModuleType("utils.metric_stp3")

        class PlanningMetric:
            def __init__(self, *a, **k):
                raise WMError("the planning metric is not part of the timed forecast (tools/occworld_harness.py)")

        stub.PlanningMetric = PlanningMetric
        sys.modules["utils.metric_stp3"] = stub
        done.append("utils.metric_stp3")
    return done


# ---------------------------------------------------------------------------------------------
# the model and its evaluation call


def load(path) -> dict:
    """Import OccWorld's model package from the checkout at `path` (registering its classes) and
    read config/occworld.py; returns {"model": its model dict, "frames": (start, mid, end), ...}."""
    root = Path(path).expanduser().resolve()
    missing = [f for f in MODEL_FILES if not (root / f).is_file()]
    if missing:
        raise WMError(f"--occworld {path}: not a checkout of wzzheng/OccWorld ({missing[0]} is missing); "
                      "git clone https://github.com/wzzheng/OccWorld and pass its folder")
    shims = install_shims()
    sys.path.insert(0, str(root))
    try:
        sys.modules.pop("model", None)
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module("model")
    except ImportError as e:
        raise WMError(f"--occworld {path}: its model package does not import here ({e})") from None
    cfg = runpy.run_path(str(root / "config" / "occworld.py"))
    return {"model": copy.deepcopy(cfg["model"]), "frames": (cfg.get("start_frame", 0), cfg.get("mid_frame", 5),
                                                            cfg.get("end_frame", 11)),
            "root": str(root), "shims": shims}


def small(model: dict, side: int = 32, depth: int = 4, ch: int = 16) -> dict:
    """The config's model at a size a CPU runs in seconds (a check of the harness, not a benchmark):
    a side x side x depth grid, base width ch, one temporal layer."""
    m = copy.deepcopy(model)
    vae, tr = m["vae"], m["transformer"]
    exp = vae["expansion"]
    tokens = side // 2 ** (len(vae["encoder_cfg"]["ch_mult"]) - 1)
    for k in ("encoder_cfg", "decoder_cfg"):
        vae[k].update(ch=ch, resolution=side, attn_resolutions=(tokens,), z_channels=2 * ch, in_channels=depth * exp)
    vae["encoder_cfg"]["out_ch"] = ch
    vae["decoder_cfg"]["out_ch"] = depth * exp
    vae["vqvae_cfg"].update(n_e=64, e_dim=2 * ch, z_channels=2 * ch)
    tr.update(img_shape=(2 * ch, tokens, tokens), pose_shape=(1, 2 * ch), pose_output_channel=2 * ch, tpe_dim=2 * ch,
              channels=(2 * ch, 4 * ch, 8 * ch), temporal_attn_layers=1, output_channel=64)
    m["pose_encoder"]["out_channels"] = 2 * ch
    m["pose_decoder"]["in_channels"] = 2 * ch
    return m


def build(model_cfg: dict, device) -> nn.Module:
    """TransVQVAE from the config dict through the registry, random weights, eval mode."""
    from mmengine.registry import MODELS

    with contextlib.redirect_stdout(io.StringIO()):  # its constructors print shapes
        m = MODELS.build(copy.deepcopy(model_cfg))
    m.init_weights()
    return m.to(device).eval()


def grid(model_cfg: dict) -> tuple[int, int, int]:
    """(X, Y, Z) of the occupancy the config's VAE takes."""
    e = model_cfg["vae"]["encoder_cfg"]
    return e["resolution"], e["resolution"], e["in_channels"] // model_cfg["vae"]["expansion"]


def inputs(model_cfg: dict, frames: tuple, batch: int, device, seed: int = 0):
    """One evaluation batch as its data loader gives it: x (B, end_frame + 1, X, Y, Z) class ids and
    the metas its forward reads (rel_poses (F, 2) per-frame displacements, gt_mode (F, 3) one-hot)."""
    g = torch.Generator().manual_seed(seed)
    n = frames[2] + 1
    C = model_cfg["vae"]["num_classes"]
    x = torch.randint(0, C, (batch, n, *grid(model_cfg)), generator=g).to(device)
    rel = np.tile(np.array([[5.0, 0.0]], np.float32), (n, 1))  # 5 m straight ahead per frame
    mode = np.tile(np.array([[0, 0, 1]]), (n, 1))
    return x, [{"rel_poses": rel.copy(), "gt_mode": mode.copy()} for _ in range(batch)]


@contextlib.contextmanager
def _cuda_is_here(device: torch.device):
    """Its forward calls .cuda() on its outputs; on a CPU run that is the identity."""
    if device.type == "cuda":
        yield
        return
    orig = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = orig


def forecast(model: nn.Module, x, metas, frames: tuple, mark=lambda name: None) -> dict:
    """Its evaluation's forward on one batch; `mark(name)` at the end of its encoder ("encode"), of
    each autoregressive transformer step ("step"), of its decoder ("decode") and of the call
    ("outputs": argmax and its copies of the prediction)."""
    start, mid, end = frames
    vae, tr = model.vae, model.transformer

    def timed(fn, name):
        def run(*a, **k):
            out = fn(*a, **k)
            mark(name)
            return out
        return run

    vae.forward_encoder = timed(type(vae).forward_encoder.__get__(vae), "encode")
    tr.forward_autoreg_step = timed(type(tr).forward_autoreg_step.__get__(tr), "step")
    vae.forward_decoder = timed(type(vae).forward_decoder.__get__(vae), "decode")
    try:
        with torch.no_grad(), _cuda_is_here(x.device):
            out = model.forward_autoreg_with_pose(x, metas, start_frame=start, mid_frame=mid, end_frame=end)
        mark("outputs")
    finally:
        for m, k in ((vae, "forward_encoder"), (tr, "forward_autoreg_step"), (vae, "forward_decoder")):
            del m.__dict__[k]
    return out
