"""The config sections of what a run computes (run, data, synthetic, train, the stages) and Config.

Every key a user writes is checked: an unknown key names its full path and the closest valid one,
a wrong type names the key, the type wanted and the value given, and each section's `validate()`
says why a value is refused. The resolved config is written back as JSON and loads to an equal
object, so a run folder's `config.json` reproduces the run.

Field types understood: int, float, str, bool, Optional[...], tuple[int, ...] / tuple[float, ...],
list[str], dict[str, ...], and nested dataclasses (sections). Tuples are lists in JSON. A field named
`x_` is the key `x` (a Python keyword: `init.from`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from wm.config.init import InitConfig, check_prefixes
from wm.config.models import TokenizerConfig, WorldConfig
from wm.config.rules import ALLOWED, BATCH_WHY, FREE, MATCH, MAX_BATCH, at_most, rule
from wm.config.runtime import (ActivationCheckpointConfig, CheckpointConfig, CompileConfig, DDPConfig, KernelsConfig,
    LoaderConfig, LoggingConfig)
from wm.utils.errors import ConfigError

META_KEY = "meta"  # written by wm beside the sections (fingerprint, versions); ignored on load

KINDS = ("hdf5", "memmap")


# HDF5 compressions a shard may use. gzip is in every stock HDF5 build; zstd and lz4
# come from the hdf5plugin package (registered on import), which every wm reader imports. The
# default is chosen by measurement (read speed first, size second): BENCHMARKS.md, "Data", has
# the table; zstd3 reads ~4x faster than gzip1 at ~5x fewer bytes. h5py's lzf is
# left out: its output is not byte-reproducible (liblzf's hash table is not initialised), so a
# regenerated data set would get another fingerprint, and it reads slower than gzip1 here.
COMPRESSIONS = {  # name: (filter, level)
    "none": (None, None),
    "gzip1": ("gzip", 1),
    "gzip4": ("gzip", 4),
    "zstd1": ("zstd", 1),
    "zstd3": ("zstd", 3),
    "lz4": ("lz4", None),
}


DEFAULT_COMPRESSION = "zstd3"


# wm/data/synthetic/occ3d.py's Occ3D-like scenes | wm/data/synthetic/blocks.py's solid ones | wm/data/synthetic/airside.py's aprons
STYLES = ("occ3d", "blocks", "airside")

# ---------------------------------------------------------------------------------------------
# sections


@dataclass
class RunConfig:
    RESUME, EVALUATE = MATCH, FREE
    name: str = rule("demo", resume=FREE)  # the run folder is <out_dir>/<name>
    out_dir: str = rule("runs", resume=FREE, path=True)  # folder of run folders
    seed: int = 0  # initial weights, data order and every RNG stream follow from it

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ConfigError("name", f"{self.name!r} must be a plain folder name (no '/')")


@dataclass
class DataConfig:
    RESUME, EVALUATE = MATCH, FREE  # a checkpoint's grid and classes must be the evaluation's
    # A data set is a folder with manifest.json (wm/data/shards.py). Empty: the built-in synthetic
    # scenes (section `synthetic`), generated once into a cache folder.
    root: str = rule("", resume=FREE, path=True)  # data set folder (manifest.json + shards); empty: the built-in synthetic scenes
    train_split: str = "train"  # split the stages train on
    val_split: str = "val"  # split validation and --eval-only score
    # What the data must be; checked against the manifest before anything trains, so a
    # class-count or grid mismatch is found in the first second, not after hours.
    grid: tuple[int, ...] = rule((64, 64, 8), evaluate=MATCH)  # voxels [X, Y, Z] of every frame; X, Y divisible by tokenizer.downsample
    num_classes: int = rule(18, evaluate=MATCH)  # class ids 0..num_classes-1, the free class included
    free_class: int = rule(17, evaluate=MATCH)  # id of empty space (not in mIoU)
    # The classes whose forecast IoU is reported per step, and drawn over the pictures; empty: the data
    # set's (manifest moving_classes, else its nuScenes-named moving classes)
    moving_classes: tuple[str, ...] = ()  # class names that move (empty: the data set's own list)
    # Windows: `past` frames in, `future` frames to forecast, every `stride`-th frame of a scene;
    # a window starts at every `window_step`-th frame.
    past: int = 5  # frames the model sees
    future: int = 6  # frames it forecasts (evaluation horizons must lie within future x stride / frame rate)
    stride: int = 1  # take every stride-th frame: one model step = stride / frame_rate_hz seconds
    window_step: int = 1  # a window starts at every window_step-th frame of a scene
    # Seconds ahead this run forecasts for: training refuses, before the first step, windows that do
    # not reach them (naming a setting that does); --eval-only scores them unless --horizons says other.
    # `train.py --horizons 1,2` (without --eval-only) prints such a setting for the data set.
    horizons_s: tuple[float, ...] = ()  # forecast horizons in seconds the windows must reach (empty: no check)
    use_mask: bool = False  # return the visibility mask (the manifest must have one)
    # Which bits of the uint8 mask mean "visible": 0 = any nonzero value. tools/convert_occ3d.py
    # stores Occ3D's two masks as bits (camera = 1, lidar = 2; see the manifest's mask_bits), so
    # mask_bits=1 scores / trains on the camera mask, 2 on the lidar mask.
    mask_bits: int = 0  # bits of the mask that mean visible (0: any nonzero; Occ3D camera 1, lidar 2)
    max_windows: int = 0  # >0: use only this many windows (evenly spread) per split, for smoke runs
    batch_size: int = 8  # samples per rank and micro-step of both stages, unless <stage>_stage.batch_size is set

    @property
    def window(self) -> int:
        """Frames per sample."""
        return self.past + self.future

    @property
    def span(self) -> int:
        """Consecutive scene frames one window covers."""
        return (self.window - 1) * self.stride + 1

    def validate(self) -> None:
        if not 0 <= self.mask_bits <= 255:
            raise ConfigError("mask_bits", f"{self.mask_bits} must be in [0, 255] (bits of the uint8 mask; 0 = any nonzero)")
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ConfigError("grid", f"{list(self.grid)} must be three positive sizes [X, Y, Z]")
        if not 2 <= self.num_classes <= 256:
            raise ConfigError("num_classes", f"{self.num_classes} must be in [2, 256] (labels are uint8)")
        if not 0 <= self.free_class < self.num_classes:
            raise ConfigError("free_class", f"{self.free_class} must be a class id in [0, {self.num_classes})")
        for k in ("past", "future", "stride", "window_step", "batch_size"):
            if getattr(self, k) < 1:
                raise ConfigError(k, f"{getattr(self, k)} must be >= 1")
        at_most(self, ("batch_size",), MAX_BATCH, BATCH_WHY)
        if self.max_windows < 0:
            raise ConfigError("max_windows", f"{self.max_windows} must be >= 0")
        if not all(h > 0 for h in self.horizons_s):
            raise ConfigError("horizons_s", f"{list(self.horizons_s)}: horizons are seconds after the last past "
                              "frame, > 0")
        if len(set(self.moving_classes)) != len(self.moving_classes):
            raise ConfigError("moving_classes", f"{list(self.moving_classes)} names a class twice")
        if self.train_split == self.val_split:
            raise ConfigError("val_split", f"{self.val_split!r} is also the train split; "
                              "validating on training windows hides overfitting")


@dataclass
class SyntheticConfig:
    """The built-in procedural driving scenes (wm/data/synthetic/generate.py), used when data.root is empty."""

    RESUME, EVALUATE = MATCH, FREE
    train_scenes: int = 24  # scenes generated for the train split
    val_scenes: int = 6  # scenes generated for the val split
    frames: int = 40  # per scene (nuScenes scenes have ~40 at 2 Hz)
    seed: int = 0  # the scenes follow from it
    format: str = "memmap"  # memmap (the demo's: no decoding on 2 cores) | hdf5
    compression: str = "zstd3"  # HDF5 only: one of wm.config.sections.COMPRESSIONS (zstd needs hdf5plugin)
    with_mask: bool = True  # write sensor-style visibility masks
    # occ3d: observed surfaces, lidar-like masks, nuScenes-like traffic, Occ3D's statistics;
    # airside: airport aprons with their own 17 classes (free = 16; set data.num_classes, free_class);
    # blocks: solid columns, 37 % occupied (the first generator, far easier than Occ3D)
    style: str = "occ3d"  # which generator: occ3d | airside | blocks (wm/data/synthetic/occ3d.py, airside.py, blocks.py)
    # Generated once, into <cache_dir>/<hash of these settings>. Empty: $WM_CACHE or ~/.cache/wm.
    cache_dir: str = rule("", resume=FREE, path=True)  # where generated sets are kept (empty: $WM_CACHE or ~/.cache/wm)

    def validate(self) -> None:
        if self.train_scenes < 1:
            raise ConfigError("train_scenes", f"{self.train_scenes} must be >= 1")
        if self.val_scenes < 1:
            raise ConfigError("val_scenes", f"{self.val_scenes} must be >= 1 (validation needs scenes)")
        if self.frames < 2:
            raise ConfigError("frames", f"{self.frames} must be >= 2")
        if self.format not in KINDS:
            raise ConfigError("format", f"{self.format!r} must be one of {list(KINDS)}")
        if self.style not in STYLES:
            raise ConfigError("style", f"{self.style!r} must be one of {list(STYLES)} (occ3d: Occ3D-like road "
                              "scenes; airside: airport aprons; blocks: solid columns)")
        if self.compression not in COMPRESSIONS:
            raise ConfigError("compression", f"{self.compression!r} must be one of {list(COMPRESSIONS)}")


STAGES = ("tokenizer", "world")
AMP = ("auto", "bf16", "fp16", "fp32")


@dataclass
class TrainConfig:
    """What holds for the whole run (both stages)."""

    RESUME, EVALUATE = MATCH, FREE
    stages: tuple[str, ...] = rule(STAGES, resume=FREE)  # run these stages in this order
    device: str = "auto"  # auto (CUDA if present) | cuda | cpu
    # auto: bf16 autocast on CUDA and on CPUs with AMX (native bf16 matrices), fp32 on other CPUs
    amp: str = "auto"  # auto | bf16 | fp16 (with GradScaler) | fp32
    max_nonfinite: int = rule(5, resume=FREE)  # stop after this many non-finite steps in a row (each one is skipped)
    forecast_motion: str = "given"  # evaluation rollouts: "given" future ego motion, or "predicted"
    # The world model is convolutional and attends over time per cell, so it can learn from windows of
    # the token map: a random crop x crop square of every training batch (the same for all its frames)
    # costs about (crop / side)^2 of a full step. A map side shorter than crop is kept whole.
    # Validation always runs on the whole map.
    world_crop: int = 0  # world stage: train on random squares of at most crop x crop tokens (0: the whole map)

    def validate(self) -> None:
        if not self.stages or any(s not in STAGES for s in self.stages) or len(set(self.stages)) != len(self.stages):
            raise ConfigError("stages", f"{list(self.stages)} must be distinct names from {list(STAGES)}")
        if list(self.stages) != sorted(self.stages, key=STAGES.index):
            raise ConfigError("stages", "the tokenizer stage must come before the world stage")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError("device", f"{self.device!r} must be auto, cuda or cpu")
        if self.amp not in AMP:
            raise ConfigError("amp", f"{self.amp!r} must be one of {list(AMP)}")
        if self.max_nonfinite < 1:
            raise ConfigError("max_nonfinite", f"{self.max_nonfinite} must be >= 1")
        if self.world_crop < 0:
            raise ConfigError("world_crop", f"{self.world_crop} must be >= 0 (0: the whole token map)")
        if self.forecast_motion not in ("given", "predicted"):
            raise ConfigError("forecast_motion", f"{self.forecast_motion!r} must be given or predicted")


@dataclass
class StageConfig:
    """Optimisation of one stage (AdamW, linear warm-up then cosine to min_lr). A resumed run may
    change its schedule with --allow-changed; never the batch (the sampler's position) nor what picks
    the best checkpoint."""

    RESUME, EVALUATE = ALLOWED, FREE
    epochs: int = 10  # passes over the training samples (unless max_steps is set)
    max_steps: int = 0  # >0: the stage's length in optimizer steps (a recipe counted in steps, a smoke run), else epochs decide
    batch_size: int = rule(0, resume=MATCH)  # per rank and micro-step; 0: data.batch_size (the log says which applies)
    grad_accum: int = rule(1, resume=MATCH)  # micro-steps per optimizer step (with global_batch: follows from it)
    # a recipe's batch: the same samples a step on any number of ranks (wm/training/batching.py)
    global_batch: int = rule(0, resume=MATCH)  # >0: samples per optimizer step, all ranks; batch_size then caps the micro-batch
    lr: float = 1e-3  # peak AdamW learning rate
    min_lr: float = 1e-6  # where the cosine schedule ends
    warmup_steps: int = 50  # linear warm-up from 0 to lr
    weight_decay: float = 0.01  # AdamW weight decay on matrices and kernels
    betas: tuple[float, ...] = (0.9, 0.95)  # AdamW betas
    clip: float = 35.0  # gradient-norm clip (0: off; the norm is still logged)
    eval_every: int = 0  # optimizer steps between validations (0: at each epoch end; -1: only at the end)
    val_windows: int = rule(0, resume=FREE)  # >0: validate on this many windows spread evenly over the val split (0: all)
    best_metric: str = rule("val/miou", resume=MATCH)  # the validation metric that picks best.pt (see best_mode)
    best_mode: str = rule("max", resume=MATCH)  # max: higher best_metric is better; min: lower is better
    early_stop: int = 0  # stop after this many validations without improvement (0: never)
    # Fine-tuning (init.from): module prefixes of the stage's model, e.g. "encoder", "quantizer"
    freeze: tuple[str, ...] = rule((), resume=MATCH)  # module prefixes whose parameters stay fixed (each must have been loaded by init)
    lr_mult: dict[str, float] = rule({}, resume=MATCH)  # module prefix -> learning-rate multiplier (the longest matching prefix wins)

    def validate(self) -> None:
        check_prefixes(self.freeze, self.lr_mult)
        for k in ("epochs", "grad_accum"):
            if getattr(self, k) < 1:
                raise ConfigError(k, f"{getattr(self, k)} must be >= 1")
        if self.eval_every < -1:
            raise ConfigError("eval_every", f"{self.eval_every} must be >= 0, or -1 (only at the end)")
        if self.global_batch and self.grad_accum != 1:
            raise ConfigError("grad_accum", f"{self.grad_accum}: with global_batch={self.global_batch} the micro-steps "
                              "follow from it and batch_size; leave grad_accum at 1")
        for k in ("max_steps", "batch_size", "global_batch", "warmup_steps", "early_stop", "val_windows"):
            if getattr(self, k) < 0:
                raise ConfigError(k, f"{getattr(self, k)} must be >= 0")
        at_most(self, ("batch_size", "global_batch"), MAX_BATCH, BATCH_WHY)
        if not self.lr > 0:
            raise ConfigError("lr", f"{self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"{self.min_lr} must be in [0, lr={self.lr}]")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"{self.weight_decay} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", f"{list(self.betas)} must be two numbers in [0, 1)")
        if self.clip < 0:
            raise ConfigError("clip", f"{self.clip} must be >= 0 (0: off)")
        if self.best_mode not in ("max", "min"):
            raise ConfigError("best_mode", f"{self.best_mode!r} must be max or min")
        if not self.best_metric.startswith("val/"):
            raise ConfigError("best_metric", f"{self.best_metric!r} must be a validation metric (val/...)")


# The defaults are the demo (`python train.py` on 2 CPU cores in a few minutes); configs/occworld.json
# holds OccWorld's sizes and recipe.
# The stages' batch_size is 0: both inherit data.batch_size unless a config sets their own.
# Each choice below was measured on the occ3d scenes (BENCHMARKS.md).
def _tokenizer_stage() -> StageConfig:
    # validated once, at the end: the last epoch is the best, and each validation costs a 2-core CPU seconds
    return StageConfig(epochs=5, lr=4e-3, warmup_steps=30, batch_size=0, eval_every=-1, best_metric="val/miou")


def _world_stage() -> StageConfig:
    # more, smaller steps at a higher rate; one validation at the end (180 windows: ~45 s on 2 cores)
    return StageConfig(epochs=3, batch_size=4, lr=4e-3, warmup_steps=10, eval_every=-1, best_metric="val/miou")


def _demo_tokenizer() -> TokenizerConfig:
    # 2 levels: at the demo's 1.25 m voxels a pedestrian or a cone is one voxel, which a token of
    # 4x4 columns loses and one of 2x2 keeps (+10 to +18 reconstruction mIoU). Class-weighted CE keeps
    # the small classes; Lovasz-softmax off: on a CPU it is 60 % of a tokenizer step. No attention:
    # on a CPU the middle blocks' attention over the 32x32 map is a fifth of a step, for no mIoU.
    return TokenizerConfig(widths=(32, 64), lowest_attention=False, mid_attention=False, codebook_size=512,
                           code_dim=64, class_weight_power=0.5, lovasz_weight=0.0)


def _demo_train() -> TrainConfig:
    # the world model learns from 16x16 squares of the 32x32 token map: a quarter of the compute
    return TrainConfig(world_crop=16)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    tokenizer: TokenizerConfig = field(default_factory=_demo_tokenizer)
    world: WorldConfig = field(default_factory=WorldConfig)
    train: TrainConfig = field(default_factory=_demo_train)
    tokenizer_stage: StageConfig = field(default_factory=_tokenizer_stage)
    world_stage: StageConfig = field(default_factory=_world_stage)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    init: InitConfig = field(default_factory=InitConfig)

    def validate(self) -> "Config":
        """Validate every section, then what spans sections. Returns self."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            try:
                section.validate()
            except ConfigError as e:
                raise e.under(f.name) from None
        d = self.tokenizer.downsample
        if self.data.grid[0] % d or self.data.grid[1] % d:
            raise ConfigError("data.grid", f"{list(self.data.grid)}: X and Y must be divisible by {d} (the "
                              f"tokenizer downsamples {len(self.tokenizer.widths) - 1} times by 2, "
                              "tokenizer.widths); convert the data with tools/convert_frames.py --crop or --pad")
        if not self.data.root and self.data.span > self.synthetic.frames:
            raise ConfigError("data.past", f"a window of {self.data.window} frames at stride "
                              f"{self.data.stride} spans {self.data.span} frames, longer than the "
                              f"synthetic scenes (synthetic.frames={self.synthetic.frames})")
        if self.data.window > self.world.max_frames + 1:
            raise ConfigError("world.max_frames", f"{self.world.max_frames} is shorter than the "
                              f"{self.data.window - 1} input frames a window of data.past={self.data.past} + "
                              f"data.future={self.data.future} feeds; set --set world.max_frames={self.data.window - 1} "
                              "(or reach the horizons with fewer, farther frames: data.stride)")
        return self


def resolve_batch_sizes(d: dict) -> dict:
    """A config dict with each stage's batch_size 0 replaced by data.batch_size (what it means), so
    configs written before the stages inherited data.batch_size compare equal to today's."""
    d = json.loads(json.dumps(d))
    for sec in ("tokenizer_stage", "world_stage"):
        if isinstance(d.get(sec), dict) and d[sec].get("batch_size") == 0 and isinstance(d.get("data"), dict):
            d[sec]["batch_size"] = d["data"].get("batch_size")
    return d


def model_options(cfg: Config, stage: str) -> dict:
    """How the model of `stage` runs: the keyword arguments of Tokenizer / WorldModel that come from
    the sections kernels and activation_checkpoint."""
    k, ac = cfg.kernels, cfg.activation_checkpoint
    if stage == "tokenizer":
        return {"fused_head": k.tokenizer_head, "fused_lovasz": k.lovasz_histogram, "lovasz_impl": k.lovasz_impl,
                "fused_embedding_grad": k.embedding_grad, "checkpoint_every": ac.tokenizer_every}
    return {"fused_attention": k.temporal_attention, "channels_last": k.world_channels_last,
            "checkpoint_every": ac.world_every}


# ---------------------------------------------------------------------------------------------
# what may change on resume and for --eval-only (wm/config/rules.py)


# ---------------------------------------------------------------------------------------------
# generic machinery: dict <-> dataclass, overrides


