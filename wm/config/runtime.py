"""The config sections of how a run runs, apart from what it computes: the data loader, torch.compile,
the Triton kernels and layouts, activation checkpointing, DDP, the checkpoint and logging cadence.
Each section checks its own values (`validate`, one line saying why a value is refused) and declares
its rule for resume and --eval-only (wm/config/rules.py): all may change freely, but for
ddp.grad_dtype, which changes the gradients a run computes as train.amp does."""

from __future__ import annotations

from dataclasses import dataclass

from wm.config.rules import FREE, MATCH, rule
from wm.utils.errors import ConfigError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that record CUDA graphs themselves

LOVASZ_IMPLS = ("sort", "histogram")


@dataclass
class LoaderConfig:
    """How batches are read (the same batches either way)."""

    RESUME, EVALUATE = FREE, FREE
    num_workers: int = 2  # DataLoader worker processes per rank
    prefetch_factor: int = 4  # batches each worker loads ahead
    pin_memory: bool = True  # page-locked host batches (faster copies to a GPU)
    persistent_workers: bool = True  # keep the workers between epochs
    # One chunk is one frame, and random windows never re-read a frame, so a large cache only costs
    # memory (it grows per worker).
    h5_cache_mib: float = 1.0  # HDF5 chunk cache per open dataset and worker, MiB

    def validate(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("num_workers", f"{self.num_workers} must be >= 0")
        if self.prefetch_factor < 1:
            raise ConfigError("prefetch_factor", f"{self.prefetch_factor} must be >= 1")
        if self.h5_cache_mib < 0:
            raise ConfigError("h5_cache_mib", f"{self.h5_cache_mib} must be >= 0")


@dataclass
class CompileConfig:
    """torch.compile of the training forward and backward."""

    RESUME, EVALUATE = FREE, FREE
    # auto: on for CUDA (the first step compiles, minutes; the log says how long), off on a CPU,
    # where compiling costs more than it saves
    enable: bool | str = "auto"  # torch.compile the models: auto (CUDA, stages of min_steps or more) | true | false
    # a compilation costs minutes once per machine kind (the run keeps its artifacts); a short stage
    # (the demo's) finishes sooner without it
    min_steps: int = 2000  # compile.enable=auto compiles a stage of at least this many optimizer steps
    # the whole step (forward, backward, clip, AdamW) replayed as CUDA graphs: one launch instead of
    # one per kernel, so small per-GPU batches are not launch-bound (wm/training/step_graph.py)
    cuda_graphs: bool | str = "auto"  # capture the training step: auto (CUDA, not fp16) | true | false
    # reduce-overhead: CUDA graphs (one launch per graph instead of one per kernel; static shapes,
    # more memory); max-autotune: inductor's kernel search (minutes of compilation)
    mode: str = "default"  # torch.compile's mode: default | reduce-overhead | max-autotune[-no-cudagraphs]
    # Inductor's heuristic turns its layout optimisation off for any model with a convolution that
    # halves the channels (every U-Net decoder); forced on, the tokenizer's convolutions run NHWC
    # without copying their inputs to NHWC in each backward
    tokenizer_channels_last: bool = True  # Inductor lays the tokenizer's conv activations out NHWC
    # coordinate-descent tuning of the block sizes of the kernels Inductor writes (norms,
    # activations): about 3 more minutes of compilation at the start of a run
    tokenizer_tuning: bool = True  # Inductor tunes the block sizes of the tokenizer's kernels

    def validate(self) -> None:
        if isinstance(self.enable, str) and self.enable != "auto":
            raise ConfigError("enable", f"{self.enable!r} must be true, false or auto (on for CUDA, off on a CPU)")
        if self.mode not in COMPILE_MODES:
            raise ConfigError("mode", f"{self.mode!r} must be one of {list(COMPILE_MODES)}")
        if isinstance(self.cuda_graphs, str) and self.cuda_graphs != "auto":
            raise ConfigError("cuda_graphs", f"{self.cuda_graphs!r} must be true, false or auto (on CUDA unless fp16)")
        if self.min_steps < 0:
            raise ConfigError("min_steps", f"{self.min_steps} must be >= 0")
        if self.cuda_graphs is True and self.mode in GRAPH_MODES:
            raise ConfigError("cuda_graphs", f"true captures the whole step, and mode {self.mode!r} captures the "
                              "forward in graphs of its own; set mode=default or cuda_graphs=false")


@dataclass
class KernelsConfig:
    """The Triton kernels (wm/models/kernels/, CUDA only) and memory layouts the models run: each the same
    function as its torch path, float rounding apart. On a CPU the torch paths run."""

    RESUME, EVALUATE = FREE, FREE
    # the class-embedding head, cross-entropy and Lovasz in two fused kernels that never hold the
    # (N, C, X, Y, Z) logits; with the histogram Lovasz (or none)
    tokenizer_head: bool = True  # tokenizer: fused head + losses on CUDA; false: the torch path
    embedding_grad: bool = True  # tokenizer: the class embedding's gradient in one kernel on CUDA; false: index_add_
    lovasz_histogram: bool = True  # tokenizer: the histogram Lovasz's terms in one kernel on CUDA; false: torch ops
    # "histogram" ranks the errors by bins of relative width 2**-10 instead of a sort: the loss
    # within 2**-10 of the exact one (wm/models/lovasz.py), fused kernels on CUDA
    lovasz_impl: str = "sort"  # how the Lovasz loss ranks errors: sort (exact, OccWorld's) | histogram
    # reads q, k, v straight from the projection, no permutes
    temporal_attention: bool = True  # world model: temporal attention in one kernel each way on CUDA; false: batched matmuls
    # the scene features are laid out (B, T, h, w, C) from the code embedding on, which the temporal
    # layers read as (B, T, h*w, C) without a copy; NHWC conv weights keep cuDNN's outputs in that layout
    world_channels_last: bool = True  # world model: conv weights channels-last (NHWC); false: NCHW

    def validate(self) -> None:
        if self.lovasz_impl not in LOVASZ_IMPLS:
            raise ConfigError("lovasz_impl", f"must be one of {', '.join(LOVASZ_IMPLS)} (exact, or ranked by "
                              f"error bins without a sort), got {self.lovasz_impl!r}")


@dataclass
class ActivationCheckpointConfig:
    """Blocks whose activations are recomputed in the backward pass instead of kept: less memory for
    more compute, the same gradients."""

    RESUME, EVALUATE = FREE, FREE
    tokenizer_every: int = 0  # tokenizer blocks: 0 off, 1 every block, k every k-th block
    world_every: int = 0  # world-model blocks: 0 off, 1 every block, k every k-th block

    def validate(self) -> None:
        for k in ("tokenizer_every", "world_every"):
            if getattr(self, k) < 0:
                raise ConfigError(k, f"must be >= 0 (0 = off), got {getattr(self, k)}")


@dataclass
class DDPConfig:
    """More than one rank: the collectives' timeout, DDP's gradient all-reduce, the ranks in step."""

    RESUME, EVALUATE = FREE, FREE
    timeout_s: float = 900.0  # collective timeout: a dead rank fails the job after this long
    # larger buckets, fewer collectives; the last bucket is what cannot overlap the backward
    bucket_mib: float = 100.0  # gradient all-reduce bucket size, MiB (DDP's own default: 25)
    # bf16 halves the bytes on the wire; the gradients are averaged in bf16, then used in fp32
    grad_dtype: str = rule("fp32", resume=MATCH)  # gradient all-reduce dtype: fp32 | bf16
    # Python's automatic collection pauses one rank at a time, and the others wait for it at the
    # all-reduce; off while training, it runs at the same steps on every rank instead
    gc_every: int = 50  # steps between Python garbage collections, all ranks at once (0: Python's automatic ones)

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"{self.timeout_s} must be > 0")
        if not self.bucket_mib > 0:
            raise ConfigError("bucket_mib", f"{self.bucket_mib} must be > 0")
        if self.grad_dtype not in ("fp32", "bf16"):
            raise ConfigError("grad_dtype", f"{self.grad_dtype!r} must be fp32 or bf16")
        if self.gc_every < 0:
            raise ConfigError("gc_every", f"{self.gc_every} must be >= 0 (0: Python's automatic collection)")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    RESUME, EVALUATE = FREE, FREE
    every: int = 200  # optimizer steps between checkpoints (also at stage end and on SIGTERM)
    keep_last: int = 3  # step checkpoints kept (>= 2); the best is kept apart
    async_save: bool = True  # write checkpoints in a background thread

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError("every", f"{self.every} must be >= 1")
        if self.keep_last < 2:
            raise ConfigError("keep_last", f"{self.keep_last} must be >= 2: the newest checkpoint may be "
                              "the one a crash interrupted, so the one before it must survive")


@dataclass
class LoggingConfig:
    """What is logged, and how often."""

    RESUME, EVALUATE = FREE, FREE
    every: int = 10  # optimizer steps between console/TensorBoard records
    tensorboard: bool = True  # write TensorBoard logs into <run>/tb
    images: bool = True  # BEV pictures of ground truth vs forecast at each validation
    peak_tflops: float = 0.0  # the device's matrix peak, for MFU (0: MFU not reported)

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError("every", f"{self.every} must be >= 1")
        if self.peak_tflops < 0:
            raise ConfigError("peak_tflops", f"{self.peak_tflops} must be >= 0")
