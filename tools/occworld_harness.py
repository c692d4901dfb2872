"""OccWorld's own model code, built at its config's sizes and run the way its evaluation and its
training run it, for `tools/bench_infer.py --occworld PATH` (the forecast) and `tools/bench_recipe.py
--occworld PATH` (the training step) (PATH: a checkout of https://github.com/wzzheng/OccWorld).

None of OccWorld's code is in this repository: its modules (model/, loss/, utils/freeze_model.py)
are imported from PATH and its configs read from PATH/config. What they import and a GPU host may
lack is replaced by minimal shims of ours, only where the real package is not installed:

- ``mmengine.registry.MODELS`` and ``mmengine.registry.Registry`` (register_module, build from a
  dict with ``type``: its model and its loss package's OPENOCC_LOSS), ``mmengine.model.BaseModule``
  (an nn.Module taking ``init_cfg``; ``init_weights`` keeps the layers' own random initialisation,
  what mmengine does when no init_cfg is given) and ``mmengine.MMLogger`` (what
  utils/freeze_model.py logs to: Python's logging);
- ``einops.rearrange`` for the axis patterns its model uses (groups, permutations, unit axes);
- ``utils.metric_stp3``: its planning metric (cv2, scikit-image, nuscenes-devkit), which its
  evaluation applies to the forecast after the model has run, and which is not timed.

The forecast (`forecast`): what its evaluation (eval_metric_stp3.py with config/occworld.py) runs per
validation sample: ``model.forward_autoreg_with_pose(x, metas, start_frame, mid_frame, end_frame)``
under torch.no_grad in fp32 with cudnn.benchmark, x the sample's ``end_frame + 1`` occupancy frames
(all of them encoded, as its code does), then ``end_frame - mid_frame`` autoregressive steps (each
re-runs the transformer over all frames so far: it has no cache), then the decoder.

The training step (`TrainStep`, `train_rate`): one iteration of its train.py's loop at its
loader's batch (1), for stage "tokenizer" config/train_vqvae.py (VAERes2D, MultiLoss of ReconLoss +
LovaszLoss + VQVAEEmbedLoss, 10-frame samples) and for stage "world" config/train_occworld.py
(TransVQVAE with its freeze_dict applied by its utils/freeze_model.py: the VAE frozen, run in train
mode without grad reaching it; CeLoss + PlanRegLossLidar; 16-frame windows: 15 frames in, each
frame's next one the target). Timed per step, as its loop runs it: the batch's host-to-device copy
(``input_occs.cuda()``, ``target_occs.cuda()`` from pinned memory), ``model(x=input_occs,
metas=metas)`` in train mode, ``loss_input_convertion`` and its loss (MultiLoss reads each term
with ``.item()``), ``optimizer.zero_grad()``, ``loss.backward()``, ``clip_grad_norm_(params,
grad_max_norm)``, AdamW's step (its config's lr and weight decay; mmengine's OptimWrapper is a
plain torch.optim.AdamW over all parameters), ``loss.detach().cpu().item()``. fp32 with PyTorch's
defaults as its train.py leaves them (cudnn.benchmark on; cuDNN may use TF32, matmuls do not),
wall clock with torch.cuda.synchronize after each step; the first `warmup` steps are not timed.
Not timed: its data loader (npz reads in a worker), its timm cosine schedule's per-iteration
``step_update`` (a few float operations), its logging every print_freq iterations.

Inputs are random class ids of its grid (int64, as its dataset stacks them) and metas as its dataset
gives them (per-frame ``rel_poses`` (F, 2) and one-hot ``gt_mode`` (F, 3), all its forward and
PlanRegLossLidar read); weights are random: the time depends on neither.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import logging
import math
import re
import runpy
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wm.utils.errors import WMError

MODEL_FILES = ("model/TransVQVAE.py", "model/transformer/PlanUtransformer.py", "config/occworld.py")
# its training: the config of each stage, and what the step imports besides its model package
TRAIN_CONFIGS = {"tokenizer": "config/train_vqvae.py", "world": "config/train_occworld.py"}
TRAIN_FILES = ("model/TransVQVAE.py", "model/VAE/vae_2d_resnet.py", "loss/__init__.py", "loss/multi_loss.py",
               "utils/freeze_model.py", *TRAIN_CONFIGS.values())
SHIM = "__wm_occworld_shim__"  # marks a module of ours in sys.modules


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
            raise WMError(f"OccWorld config names {self.name} type {kind!r}, which its {self.name} package did "
                          f"not register (registered: {', '.join(sorted(self.classes))})")
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


class MMLogger:
    """mmengine's MMLogger as utils/freeze_model.py uses it: Python's logging."""

    @classmethod
    def get_instance(cls, name="occworld", **kwargs):
        return logging.getLogger(f"occworld.{name}")

    @classmethod
    def get_current_instance(cls):
        return logging.getLogger("occworld")


def _ours(name: str) -> bool:
    return getattr(sys.modules.get(name), SHIM, False)


def install_shims() -> list[str]:
    """Shim modules for what is not installed; returns their names (also those a previous call put
    in place)."""
    done = []
    if _ours("mmengine"):
        done.append("mmengine")
    else:
        try:
            import mmengine  # noqa: F401
            import mmengine.model  # noqa: F401
            import mmengine.registry  # noqa: F401
        except ImportError:
            mm = types.ModuleType("mmengine")
            reg, model = types.ModuleType("mmengine.registry"), types.ModuleType("mmengine.model")
            reg.MODELS, reg.Registry, model.BaseModule = Registry("model"), Registry, BaseModule
            mm.registry, mm.model, mm.MMLogger = reg, model, MMLogger
            for m in (mm, reg, model):
                setattr(m, SHIM, True)
            sys.modules.update({"mmengine": mm, "mmengine.registry": reg, "mmengine.model": model})
            done.append("mmengine")
    if _ours("einops"):
        done.append("einops")
    else:
        try:
            import einops  # noqa: F401
        except ImportError:
            ein = types.ModuleType("einops")
            ein.rearrange = rearrange
            setattr(ein, SHIM, True)
            sys.modules["einops"] = ein
            done.append("einops")
    if "utils.metric_stp3" not in sys.modules or _ours("utils.metric_stp3"):
        if "utils.metric_stp3" not in sys.modules:
            stub = types.ModuleType("utils.metric_stp3")

            class PlanningMetric:
                def __init__(self, *a, **k):
                    raise WMError("the planning metric is not part of the timed forecast (tools/occworld_harness.py)")

            stub.PlanningMetric = PlanningMetric
            setattr(stub, SHIM, True)
            sys.modules["utils.metric_stp3"] = stub
        done.append("utils.metric_stp3")
    return done


def _checkout(path, files) -> Path:
    root = Path(path).expanduser().resolve()
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise WMError(f"--occworld {path}: not a checkout of wzzheng/OccWorld ({missing[0]} is missing); "
                      "git clone https://github.com/wzzheng/OccWorld and pass its folder")
    return root


def _import(root: Path, name: str):
    """Its package `name` (model, loss, utils.freeze_model) from the checkout: a module of that name
    imported from elsewhere is dropped first (with its submodules); one from this checkout is kept,
    so that its registries keep what its modules registered."""
    top = name.split(".")[0]
    have = sys.modules.get(top)
    if have is not None and not str(getattr(have, "__file__", "") or "").startswith(str(root) + "/"):
        for k in [k for k in sys.modules if (k == top or k.startswith(top + ".")) and not _ours(k)]:
            del sys.modules[k]
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))  # ahead of anything else named model, loss or utils
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return importlib.import_module(name)
    except ImportError as e:
        raise WMError(f"--occworld {root}: its {name} package does not import here ({e})") from None


def commit(root) -> str | None:
    """The checkout's git commit, where `root` is the top of a git work tree (not a folder inside
    another repository); None otherwise."""
    try:
        p = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = p.stdout.split()
    if p.returncode != 0 or len(out) != 2 or Path(out[0]).resolve() != Path(root).resolve():
        return None
    return out[1] if re.fullmatch(r"[0-9a-f]{40}", out[1]) else None


# ---------------------------------------------------------------------------------------------
# the model and its evaluation call


def load(path) -> dict:
    """Import OccWorld's model package from the checkout at `path` (registering its classes) and
    read config/occworld.py; returns {"model": its model dict, "frames": (start, mid, end), ...}."""
    root = _checkout(path, MODEL_FILES)
    shims = install_shims()
    _import(root, "model")
    cfg = runpy.run_path(str(root / "config" / "occworld.py"))
    return {"model": copy.deepcopy(cfg["model"]), "frames": (cfg.get("start_frame", 0), cfg.get("mid_frame", 5),
                                                            cfg.get("end_frame", 11)),
            "root": str(root), "shims": shims}


def _small_vae(vae: dict, side: int, depth: int, ch: int) -> int:
    """Shrink a VAERes2D dict in place; returns the token grid's side."""
    exp = vae["expansion"]
    tokens = side // 2 ** (len(vae["encoder_cfg"]["ch_mult"]) - 1)
    for k in ("encoder_cfg", "decoder_cfg"):
        vae[k].update(ch=ch, resolution=side, attn_resolutions=(tokens,), z_channels=2 * ch, in_channels=depth * exp)
    vae["encoder_cfg"]["out_ch"] = ch
    vae["decoder_cfg"]["out_ch"] = depth * exp
    vae["vqvae_cfg"].update(n_e=64, e_dim=2 * ch, z_channels=2 * ch)
    return tokens


def small(model: dict, side: int = 32, depth: int = 4, ch: int = 16) -> dict:
    """The config's model at a size a CPU runs in seconds (a check of the harness, not a benchmark):
    a side x side x depth grid, base width ch, one temporal layer. A TransVQVAE dict or (the
    tokenizer's config) a VAERes2D one."""
    m = copy.deepcopy(model)
    if m.get("type") == "VAERes2D":
        _small_vae(m, side, depth, ch)
        return m
    vae, tr = m["vae"], m["transformer"]
    tokens = _small_vae(vae, side, depth, ch)
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
    """(X, Y, Z) of the occupancy the config's VAE takes (a TransVQVAE dict or a VAERes2D one)."""
    vae = model_cfg.get("vae", model_cfg)
    e = vae["encoder_cfg"]
    return e["resolution"], e["resolution"], e["in_channels"] // vae["expansion"]


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


# ---------------------------------------------------------------------------------------------
# its training step


def load_train(path, stage: str) -> dict:
    """Import OccWorld's model and loss packages and its utils/freeze_model.py from the checkout at
    `path` and read the training config of `stage` ("tokenizer": config/train_vqvae.py, "world":
    config/train_occworld.py): its model and loss dicts, loss_input_convertion, optimizer, loader
    batch, frames per sample (its dataset's return_len), grad_max_norm and freeze_dict."""
    if stage not in TRAIN_CONFIGS:
        raise WMError(f"OccWorld's training has stages {', '.join(TRAIN_CONFIGS)}, not {stage!r}")
    root = _checkout(path, TRAIN_FILES)
    shims = install_shims()
    for name in ("model", "loss", "utils.freeze_model"):
        _import(root, name)
    cfg = runpy.run_path(str(root / TRAIN_CONFIGS[stage]))
    opt = dict(cfg["optimizer"]["optimizer"])
    if opt.pop("type", None) != "AdamW":
        raise WMError(f"--occworld {path}: {TRAIN_CONFIGS[stage]} does not train with AdamW; the harness runs its "
                      "released configs")
    data = cfg["train_dataset_config"]
    return {"stage": stage, "config": TRAIN_CONFIGS[stage], "model": copy.deepcopy(cfg["model"]),
            "loss": copy.deepcopy(cfg["loss"]), "loss_input_convertion": dict(cfg["loss_input_convertion"]),
            "optimizer": {"type": "AdamW", **opt}, "batch_size": cfg["train_loader"]["batch_size"],
            # its dataset returns input_occs[:return_len] and output_occs[offset:] of return_len + offset
            # loaded frames, and metas of all of them
            "frames": data["return_len"], "offset": data.get("offset", 0), "grad_max_norm": cfg["grad_max_norm"],
            "freeze_dict": dict(cfg["freeze_dict"]) if cfg.get("freeze_dict") else None,
            "max_epochs": cfg.get("max_epochs"), "root": str(root), "shims": shims, "commit": commit(root)}


def train_batch(info: dict, model_cfg: dict, seed: int = 0):
    """One batch as its loader gives it (custom_collate_fn_temporal at its batch size), on the host:
    input_occs and target_occs (B, frames, X, Y, Z) int64 class ids, and per sample the metas its
    dataset's get_meta_data gives (rel_poses (frames + offset, 2) displacements, gt_mode one-hot
    (frames + offset, 3)); pinned where CUDA is there, as its loader's pin_memory."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    b, n = info["batch_size"], info["frames"]
    vae = model_cfg.get("vae", model_cfg)
    occ = torch.randint(0, vae["num_classes"], (b, n, *grid(model_cfg)), generator=g)
    target = occ.clone()  # its dataset reads the same gts files again for the target (offset 0)
    if torch.cuda.is_available():
        occ, target = occ.pin_memory(), target.pin_memory()
    rows = n + info["offset"]
    metas = [{"rel_poses": np.stack([rng.uniform(0, 8, rows), rng.normal(0, 0.3, rows)], 1),
              "gt_mode": np.eye(3, dtype=np.int64)[rng.integers(0, 3, rows)]} for _ in range(b)]
    return occ, target, metas


class TrainStep:
    """Its model, loss and optimizer built as its train.py builds them (registry, init_weights,
    freeze_model with the config's freeze_dict, onto the device, AdamW over model.parameters()),
    and one iteration of its loop per call (returns the loss, as its loop reads it)."""

    def __init__(self, info: dict, device, small_size: bool = False, seed: int = 0):
        from mmengine.registry import MODELS

        loss_pkg = sys.modules["loss"]
        from utils.freeze_model import freeze_model

        self.info, self.device = info, torch.device(device)
        self.model_cfg = small(info["model"]) if small_size else copy.deepcopy(info["model"])
        torch.manual_seed(seed)
        with contextlib.redirect_stdout(io.StringIO()):  # its constructors print shapes
            model = MODELS.build(copy.deepcopy(self.model_cfg))
        model.init_weights()
        self.frozen = [k for k, v in (info["freeze_dict"] or {}).items() if v]
        if info["freeze_dict"]:
            freeze_model(model, info["freeze_dict"])
        self.model = model.to(self.device).train()
        self.loss_func = loss_pkg.OPENOCC_LOSS.build(copy.deepcopy(info["loss"])).to(self.device)
        opt = {k: v for k, v in info["optimizer"].items() if k != "type"}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **opt)
        self.batch = train_batch(info, self.model_cfg, seed)

    def params(self) -> dict:
        return {"params": sum(p.numel() for p in self.model.parameters()),
                "params_trained": sum(p.numel() for p in self.model.parameters() if p.requires_grad)}

    def __call__(self) -> float:
        occ, target, metas = self.batch
        input_occs, target_occs = occ.to(self.device), target.to(self.device)  # its .cuda() of the batch
        with _cuda_is_here(self.device):
            result_dict = self.model(x=input_occs, metas=metas)
        loss_input = {"inputs": input_occs, "target_occs": target_occs}
        for key, val in self.info["loss_input_convertion"].items():
            loss_input[key] = result_dict[val]
        loss, _ = self.loss_func(loss_input)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.info["grad_max_norm"])
        self.optimizer.step()
        return loss.detach().cpu().item()


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_rate(path, stage: str, device="cuda", steps: int = 30, warmup: int = 5, small: bool = False,
               seed: int = 0) -> dict:
    """Time `steps` iterations of its training step of `stage` after `warmup` untimed ones.
    samples_per_s is in OccWorld's units: frames/s for the tokenizer (frames per sample x samples),
    windows/s for the world model (one window of `window_frames` frames a sample); per_step of them
    a step, at ms_per_step (the timed steps' mean: their wall time / steps)."""
    if steps < 1 or warmup < 0:
        raise WMError(f"OccWorld's training step: steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    device = torch.device(device)
    info = load_train(path, stage)
    flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False  # its train.py
    try:
        step = TrainStep(info, device, small, seed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        losses, ends = [], []
        _sync(device)
        start = time.perf_counter()
        for i in range(warmup + steps):
            losses.append(step())
            _sync(device)
            ends.append(time.perf_counter())
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags
    t0 = ends[warmup - 1] if warmup else start
    each = [(b - a) * 1e3 for a, b in zip([t0, *ends[warmup:-1]], ends[warmup:])]
    step_s = (ends[-1] - t0) / steps
    tokenizer = stage == "tokenizer"
    per_step = info["batch_size"] * (info["frames"] if tokenizer else 1)
    out = {"stage": stage, "config": info["config"], "device": str(device),
           "size": "small (harness check)" if small else f"its {info['config']}",
           "batch_size": info["batch_size"], "frames_per_sample": info["frames"],
           "unit": "frames" if tokenizer else "windows", "per_step": per_step,
           "steps": steps, "warmup": warmup, "ms_per_step": step_s * 1e3,
           "median_ms": float(np.median(each)), "step_ms_each": [round(v, 3) for v in each],
           "samples_per_s": per_step / step_s, **step.params(), "frozen": step.frozen,
           "losses": losses, "losses_finite": all(math.isfinite(v) for v in losses),
           "peak_mem_gib": round(peak, 3) if peak is not None else None,
           "precision": "fp32", "cudnn_benchmark": True, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
           "grad_max_norm": info["grad_max_norm"], "optimizer": info["optimizer"],
           "root": info["root"], "commit": info["commit"], "shims": info["shims"]}
    if not tokenizer:
        out["window_frames"] = info["frames"]  # inputs frames[:-1], targets their next frames
    return out
