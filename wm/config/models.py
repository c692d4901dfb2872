"""The config sections of the two models, what each computes (wm.models.tokenizer, wm.models.world build
from them): sizes, loss weights, and the checks of each value."""

from __future__ import annotations

import math
from dataclasses import dataclass

from wm.config.rules import FREE, MATCH, rule
from wm.utils.errors import ConfigError


@dataclass
class TokenizerConfig:
    """Tokenizer hyper-parameters: what the model computes. Defaults give a small CPU model;
    configs/occworld.json holds OccWorld's. A checkpoint's function: a resumed run and --eval-only
    keep them, but for the loss terms, which --eval-only does not use."""

    RESUME, EVALUATE = MATCH, MATCH
    embed_dim: int = 8  # class embedding dim per voxel (channels in = Z * embed_dim)
    # encoder widths. OccWorld: 3 levels, a token per 4x4 columns; 2 levels: a token per 2x2 columns,
    # 4x the tokens, which keeps one-voxel objects at the demo's 1.25 m voxels (BENCHMARKS.md)
    widths: tuple[int, ...] = (16, 32, 64)  # one per level; L levels: a token per 2**(L-1) columns in X and Y
    blocks_per_level: int = 1  # ResBlocks per level (encoder and decoder)
    attn_heads: int = 1  # heads of the spatial attention at the lowest resolution
    lowest_attention: bool = True  # attention after every block of the lowest level
    mid_attention: bool = True  # attention between the two middle blocks of the encoder and decoder
    codebook_size: int = 128  # number of codes K
    code_dim: int = 32  # dim of each code
    commitment: float = rule(0.25, evaluate=FREE)  # beta: VQ loss = |sg(z)-e|^2 + beta * |z-sg(e)|^2
    ce_weight: float = rule(10.0, evaluate=FREE)  # weight of the cross-entropy loss
    lovasz_weight: float = rule(1.0, evaluate=FREE)  # weight of the Lovasz-softmax loss (0: off)
    vq_weight: float = rule(1.0, evaluate=FREE)  # weight of the vector-quantizer loss
    dead_code_steps: int = rule(100, evaluate=FREE)  # reset codes unused for this many training forwards; 0 = never
    # Frequency-weighted cross-entropy: class c weighs (share of c in the training data) ** -power,
    # capped at class_weight_max times the lightest class (the free class), the weighted terms
    # averaged over voxels. 0: plain CE (OccWorld); 0.5: inverse square root of the frequency; 1:
    # inverse frequency. Small dynamic objects are a few voxels in thousands: plain CE can ignore
    # them at almost no cost.
    class_weight_power: float = rule(0.0, evaluate=FREE)  # CE class weight = (class share) ** -power; 0 = plain CE
    class_weight_max: float = rule(100.0, evaluate=FREE)  # cap on a class's CE weight, relative to the lightest class

    @property
    def downsample(self) -> int:
        """Voxel columns per token along X and along Y."""
        return 2 ** (len(self.widths) - 1)

    def validate(self) -> None:
        for name in ("embed_dim", "blocks_per_level", "attn_heads", "code_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 1 <= len(self.widths) <= 4:
            raise ConfigError("widths", f"needs 1 to 4 levels (0 to 3 stride-2 downsamples; OccWorld: 3), got "
                              f"{list(self.widths)}")
        for w in self.widths:
            if w < 4 or w % 4:
                raise ConfigError("widths", f"every width must be a multiple of 4 (GroupNorm), got {self.widths}")
        if self.widths[-1] % self.attn_heads:
            raise ConfigError("attn_heads", f"must divide the lowest-level width {self.widths[-1]}")
        if not 2 <= self.codebook_size <= 1 << 15:  # the token cache stores a code as int16 (wm/training/token_cache.py)
            raise ConfigError("codebook_size", f"must be in [2, 32768] (the token cache stores codes as int16), got "
                              f"{self.codebook_size}")
        for name in ("commitment", "ce_weight", "lovasz_weight", "vq_weight"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(name, f"must be a finite number >= 0, got {v}")
        if not (0 <= self.class_weight_power <= 2):
            raise ConfigError("class_weight_power", f"must be in [0, 2] (0 = plain CE), got {self.class_weight_power}")
        if not (self.class_weight_max >= 1 and math.isfinite(self.class_weight_max)):
            raise ConfigError("class_weight_max", f"must be a finite number >= 1, got {self.class_weight_max}")
        if self.dead_code_steps < 0:
            raise ConfigError("dead_code_steps", f"must be >= 0 (0 = off), got {self.dead_code_steps}")


@dataclass
class WorldConfig:
    """World-model hyper-parameters: what the model computes. Defaults give the small CPU demo model;
    configs/occworld.json holds OccWorld's. A checkpoint's function: a resumed run and --eval-only keep
    them, but for the loss weights, which --eval-only does not use."""

    RESUME, EVALUATE = MATCH, MATCH

    widths: tuple[int, ...] = (32, 64, 128)  # U-Net widths, one per resolution level (>= 2 levels)
    blocks_per_level: int = 1  # spatial ResBlocks per level
    temporal_layers: int = 1  # causal temporal attention + FFN layers per encoder/decoder level
    pose_layers: int = 1  # ego-motion token layers per encoder/decoder level
    heads: int = 4  # attention heads (must divide every width)
    ffn_mult: int = 4  # FFN hidden = ffn_mult * width
    max_frames: int = 16  # longest input sequence (learned frame embeddings); rollout keeps the last ones
    motion_scale: float = 10.0  # metres per unit of the motion input features and displacement head
    ce_weight: float = rule(1.0, evaluate=FREE)  # weight of the next-frame code cross-entropy
    motion_weight: float = rule(0.1, evaluate=FREE)  # weight of the ego-motion L2 loss

    def validate(self) -> None:
        if len(self.widths) < 2:
            raise ConfigError("widths", f"needs at least 2 levels, got {self.widths}")
        for w in self.widths:
            if w < 4 or w % 4:
                raise ConfigError("widths", f"every width must be a multiple of 4 (GroupNorm), got {self.widths}")
        if self.heads < 1:
            raise ConfigError("heads", f"must be >= 1, got {self.heads}")
        for w in self.widths:
            if w % self.heads:
                raise ConfigError("heads", f"must divide every width, {self.heads} does not divide {w}")
        for name in ("blocks_per_level", "ffn_mult", "max_frames"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("temporal_layers", "pose_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not (self.motion_scale > 0 and math.isfinite(self.motion_scale)):
            raise ConfigError("motion_scale", f"must be a finite number > 0, got {self.motion_scale}")
        for name in ("ce_weight", "motion_weight"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(name, f"must be a finite number >= 0, got {v}")
