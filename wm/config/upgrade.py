"""Config dicts of earlier run folders (config.json, a checkpoint's config) read as this layout: the
keys that moved to the sections of how a run runs (wm/config/runtime.py) are taken from where they
were, the knobs that were dropped are dropped, and each change is said in one line, so such a run
folder still resumes and evaluates."""

from __future__ import annotations

import json

# a key where it was -> where it is
MOVED = {
    "data.num_workers": "loader.num_workers", "data.prefetch_factor": "loader.prefetch_factor",
    "data.pin_memory": "loader.pin_memory", "data.persistent_workers": "loader.persistent_workers",
    "data.h5_cache_mib": "loader.h5_cache_mib",
    "train.compile": "compile.enable", "train.compile_mode": "compile.mode",
    "tokenizer.compile_channels_last": "compile.tokenizer_channels_last",
    "tokenizer.compile_tuning": "compile.tokenizer_tuning",
    "tokenizer.fused_head": "kernels.tokenizer_head", "tokenizer.lovasz_impl": "kernels.lovasz_impl",
    "world.fused_attention": "kernels.temporal_attention", "world.channels_last": "kernels.world_channels_last",
    "tokenizer.checkpoint_every": "activation_checkpoint.tokenizer_every",
    "world.checkpoint_every": "activation_checkpoint.world_every",
    "train.timeout_s": "ddp.timeout_s", "train.ddp_bucket_mib": "ddp.bucket_mib",
    "train.ddp_grad_dtype": "ddp.grad_dtype",
    "train.ckpt_every": "checkpoint.every", "train.keep_last": "checkpoint.keep_last",
    "train.async_ckpt": "checkpoint.async_save",
    "train.log_every": "logging.every", "train.tensorboard": "logging.tensorboard", "train.images": "logging.images",
    "train.peak_tflops": "logging.peak_tflops",
}
# knob -> (the value that still runs, what runs at any other value)
DROPPED = {
    "tokenizer.checkpoint_policy": ("full", "a checkpointed tokenizer block keeps only its input (full)"),
    "world.checkpoint_policy": ("full", "a checkpointed world-model block keeps only its inputs (full)"),
    "tokenizer.channels_last": (False, "the tokenizer's encoder runs NCHW (its decoder NHWC); under torch.compile "
                                       "compile.tokenizer_channels_last lays its convolutions out NHWC"),
}


def upgrade(d: dict) -> tuple[dict, list[str]]:
    """A config dict (config.json, a checkpoint's config) in this layout, and what was done to it:
    one line naming every moved key, a line for each dropped knob. A dict in this layout comes back
    unchanged, with no notes."""
    d = json.loads(json.dumps(d))
    moved, notes = [], []
    for old, new in MOVED.items():
        (s0, k0), (s1, k1) = old.split("."), new.split(".")
        if isinstance(d.get(s0), dict) and k0 in d[s0] and isinstance(d.setdefault(s1, {}), dict):
            d[s1].setdefault(k1, d[s0].pop(k0))
            moved.append(f"{old} -> {new}")
    if moved:
        notes.append(f"keys moved to sections of their own, read as the new ones: {', '.join(moved)}")
    for old, (kept, now) in DROPPED.items():
        sec, k = old.split(".")
        if isinstance(d.get(sec), dict) and k in d[sec]:
            v = d[sec].pop(k)
            notes.append(f"{old} is gone (only {json.dumps(kept)} remains), dropped" if v == kept else
                         f"{old}={json.dumps(v)} is gone: {now}")
    return d, notes
