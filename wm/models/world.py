"""Forecasting model over token maps + ego motion (OccWorld's, see wzzheng/OccWorld model/transformer/*).

Inputs: codes (B, T, h, w) integer token maps of consecutive frames, motion (B, T, 3) float = (x, y, yaw)
of each frame relative to the last past frame (metres, radians). Position t sees frames 0..t only and
predicts frame t+1: code logits (B, T, K, h, w) and ego motion (B, T, 3).

Architecture (L = len(widths) levels, OccWorld: 128/256/512 over the 50x50 token map):

    scene stream  x (B, T, C, h, w): code embedding (K x widths[0]) + learned frame embedding
    pose stream   p (B, T, C): MLP of motion features (pose and per-frame displacement) + frame embedding
    encoder level i < L-1 (width c_in):   x += Linear(p)  (ego-motion token conditions every cell)
                                          temporal_layers x [causal self-attention over T per spatial cell + FFN]
                                          pose_layers x [causal self-attention of p over T, cross-attention of
                                                         p_t to the h*w cells of frame t, FFN]
                                          blocks_per_level ResBlocks -> widths[i]; p: MLP -> widths[i]
                                          stride-2 conv (skip kept)
    bottom:                               blocks_per_level ResBlocks -> widths[-1]; p: MLP
    decoder level i (mirror):             transposed conv -> widths[i], concat skip (2*widths[i]), same
                                          temporal / pose layers at 2*widths[i], ResBlocks -> widths[i]
    heads:                                GN-SiLU-conv3x3 -> K code logits; LayerNorm-Linear -> displacement
                                          (dx, dy, dyaw) in frame t's own axes, added to the last observed
                                          displacement (constant-velocity prior) and composed with pose t.

Everything per frame (convs, GroupNorm over one frame) or causal over T, so no output at t depends on
any input after t. Model code knows nothing of devices, DDP or AMP.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wm.config.models import WorldConfig
from wm.models import kernels
from wm.models.layers import ResBlock, channels_last_grad, checkpointed, masked_cross_entropy, norm
from wm.models.rollout_cache import KV, PackedCache, RolloutCache, cached_keys_values

# ONNX export must not meet the Triton op. (Not torch.compiler.is_exporting: torch 2.11's Dynamo answers
# True to it inside torch.compile too, which kept the kernel out of every compiled step.)
_exporting = torch.onnx.is_in_onnx_export


__all__ = ["WorldModel", "motion_features", "compose_motion"]


# ------------------------------------------------------------------------------------------ config


# ------------------------------------------------------------------------------------------ motion


def _wrap(a: Tensor) -> Tensor:
    return torch.atan2(torch.sin(a), torch.cos(a))


def displacement(motion: Tensor) -> Tensor:
    """motion (..., T, 3) poses -> (..., T, 3) displacement of frame t from frame t-1 in frame t-1's axes
    (dx, dy, dyaw); zero for t = 0."""
    prev = torch.cat([motion[..., :1, :], motion[..., :-1, :]], dim=-2)
    dx, dy = motion[..., 0] - prev[..., 0], motion[..., 1] - prev[..., 1]
    c, s = torch.cos(prev[..., 2]), torch.sin(prev[..., 2])
    return torch.stack([c * dx + s * dy, -s * dx + c * dy, _wrap(motion[..., 2] - prev[..., 2])], dim=-1)


def compose_motion(pose: Tensor, delta: Tensor) -> Tensor:
    """pose (..., 3) composed with a displacement (..., 3) given in pose's own axes -> (..., 3)."""
    c, s = torch.cos(pose[..., 2]), torch.sin(pose[..., 2])
    x = pose[..., 0] + c * delta[..., 0] - s * delta[..., 1]
    y = pose[..., 1] + s * delta[..., 0] + c * delta[..., 1]
    return torch.stack([x, y, pose[..., 2] + delta[..., 2]], dim=-1)


def motion_features(motion: Tensor, scale: float) -> Tensor:
    """(B, T, 3) poses -> (B, T, 8): x, y, sin yaw, cos yaw, dx, dy, sin dyaw, cos dyaw (lengths / scale)."""
    d = displacement(motion)
    return torch.stack(
        [
            motion[..., 0] / scale,
            motion[..., 1] / scale,
            torch.sin(motion[..., 2]),
            torch.cos(motion[..., 2]),
            d[..., 0] / scale,
            d[..., 1] / scale,
            torch.sin(d[..., 2]),
            torch.cos(d[..., 2]),
        ],
        dim=-1,
    )


NUM_MOTION_FEATURES = 8


# ------------------------------------------------------------------------------------------ blocks


def _ffn(c: int, mult: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(c, mult * c), nn.GELU(), nn.Linear(mult * c, c))


def short_causal_attention(q: Tensor, k: Tensor, v: Tensor, at: Tensor | None = None,
                           key_at: Tensor | None = None) -> Tensor:
    """Causal softmax attention over a SHORT sequence (the frames of one window: T <= 16), written as
    two batched matmuls. Same function as F.scaled_dot_product_attention(..., is_causal=True), but
    for T = 11 and head dims 16-64 the fused kernels (flash, cuDNN, mem-efficient), tiled for long
    sequences, waste most of each tile, so two small matmuls beat each of them. On CUDA,
    TemporalLayer takes the Triton kernels of wm.models.kernels.temporal_attention instead
    (kernels.temporal_attention; the timings: BENCHMARKS.md, Kernels). Long sequences (the tokenizer's and the pose layer's spatial attention) keep SDPA. `at`
    (tq,) long: the queries' frame positions among the keys' (a rollout step against the cached
    keys and values, RolloutCache; keys after a query's position are masked); default: q, k, v are
    the same frames. `key_at` (tk,) long: the keys' frame positions (default 0..tk-1; PackedCache
    gives slots not yet written a position after every query's)."""
    tq, tk = q.shape[-2], k.shape[-2]
    a = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if at is None:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(1)
    else:  # a tensor, not a host int: every rollout step after the first has the same shapes and graph
        key_at = torch.arange(tk, device=q.device) if key_at is None else key_at
        mask = key_at[None, :] > at[:, None]
    a = a.masked_fill(mask, float("-inf")).softmax(-1)
    return a.to(v.dtype) @ v


class TemporalLayer(nn.Module):
    """Pre-norm causal self-attention over time per spatial cell + FFN. x: (B, T, S, C), S cells a frame
    (the scene features in their channels-last memory order: no permute to (cells, T, C) and back)."""

    def __init__(self, c: int, heads: int, ffn_mult: int, fused: bool = False):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.norm1, self.qkv, self.proj = nn.LayerNorm(c), nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.norm2, self.ffn = nn.LayerNorm(c), _ffn(c, ffn_mult)

    def kv_shape(self, batch: int, cells: int, length: int) -> tuple[int, ...]:
        """The shape of this layer's rollout keys (and values): (B, cells, heads, frames, d)."""
        return batch, cells, self.heads, length, self.proj.out_features // self.heads

    def _use_kernel(self, qkv: Tensor, cache: KV | None) -> bool:
        """The Triton kernel (the fused_attention flag) where it takes qkv, for a whole window (no rollout
        cache: the kernel's queries and keys are the same frames); never while exporting (ONNX has no such op)."""
        return cache is None and kernels.use(kernels.temporal_attention, self.fused, qkv, self.heads) and not _exporting()

    def forward(self, x: Tensor, cache: KV | None = None) -> Tensor:
        b, t, s, c = x.shape
        qkv = self.qkv(self.norm1(x))
        if self._use_kernel(qkv, cache):
            o = kernels.temporal_attention.causal_time_attention(qkv, self.heads)  # (B, T, S, C), no permutes
        else:  # q, k, v (B, S, heads, T, d): attention over the frame axis
            q, k, v = qkv.reshape(b, t, s, 3, self.heads, c // self.heads).permute(3, 0, 2, 4, 1, 5)
            k, v, key_at = cached_keys_values(cache, self, k, v)
            at = None if cache is None else cache[1]
            o = short_causal_attention(q, k, v, at, key_at).permute(0, 3, 1, 2, 4).reshape(b, t, s, c)
        x = x + self.proj(o)
        return x + self.ffn(self.norm2(x))


class PoseLayer(nn.Module):
    """Ego-motion token layer (OccWorld's pose attention): causal self-attention of the pose tokens over
    time, cross-attention of each frame's pose token to that frame's h*w scene cells, FFN.
    p: (B, T, C); x: (B*T, C, h, w) scene features of the same width."""

    def __init__(self, c: int, heads: int, ffn_mult: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj1 = nn.LayerNorm(c), nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.norm_q, self.norm_kv = nn.LayerNorm(c), nn.LayerNorm(c)
        self.q, self.kv, self.proj2 = nn.Linear(c, c), nn.Linear(c, 2 * c), nn.Linear(c, c)
        self.norm3, self.ffn = nn.LayerNorm(c), _ffn(c, ffn_mult)

    def kv_shape(self, batch: int, cells: int, length: int) -> tuple[int, ...]:
        """The shape of this layer's rollout keys (and values) over time: (B, heads, frames, d)."""
        return batch, self.heads, length, self.proj1.out_features // self.heads

    def forward(self, p: Tensor, x: Tensor, cache: KV | None = None) -> Tensor:
        b, t, c = p.shape
        hd, d = self.heads, c // self.heads
        q, k, v = self.qkv(self.norm1(p)).reshape(b, t, 3, hd, d).permute(2, 0, 3, 1, 4)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the cached frames' keys: the queries sit at the cache's positions
            k, v, key_at = cached_keys_values(cache, self, k, v)
            o = short_causal_attention(q, k, v, cache[1], key_at)
        p = p + self.proj1(o.transpose(1, 2).reshape(b, t, c))
        cells = self.norm_kv(x.flatten(2).transpose(1, 2))  # (B*T, hw, C)
        k, v = self.kv(cells).reshape(b * t, -1, 2, hd, d).permute(2, 0, 3, 1, 4)
        q = self.q(self.norm_q(p)).reshape(b * t, 1, hd, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)  # (B*T, heads, 1, d)
        p = p + self.proj2(o.reshape(b, t, c))
        return p + self.ffn(self.norm3(p))


def _pose_mlp(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cin, cout), nn.GELU(), nn.Linear(cout, cout))


class _Level(nn.Module):
    """One U-Net level's time/ego part: scene conditioning, temporal layers, pose layers at width c."""

    def __init__(self, c: int, cfg: WorldConfig, fused_attention: bool):
        super().__init__()
        self.cond = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, c))
        self.temporal = nn.ModuleList(TemporalLayer(c, cfg.heads, cfg.ffn_mult, fused_attention)
                                      for _ in range(cfg.temporal_layers))
        self.pose = nn.ModuleList(PoseLayer(c, cfg.heads, cfg.ffn_mult) for _ in range(cfg.pose_layers))


# ------------------------------------------------------------------------------------------ model


class WorldModel(nn.Module):
    """OccWorld-style forecaster over token maps.

    WorldModel(cfg, num_codes) — num_codes = the tokenizer's codebook size K. Any token map size works
    (odd sizes are padded before each stride-2 conv and cropped after each transposed conv).

    - forward(codes (B,T,h,w), motion (B,T,3)) -> dict(logits (B,T,K,h,w), motion (B,T,3)); teacher forced,
      position t predicts frame t+1; forward(codes, motion, target_codes, target_motion, mask=None) ->
      loss(...)'s dict (the loss inside the forward, as training calls it)
    - loss(out, target_codes (B,T,h,w), target_motion (B,T,3)) -> dict(loss, ce, motion_l2, acc)
    - window_loss(codes (B,T+1,h,w), motion (B,T+1,3)) -> forward on frames 0..T-1, loss against 1..T,
      plus copy_last_acc (accuracy of copying the previous frame's codes) for reference
    - rollout(past_codes (B,P,h,w), past_motion (B,P,3), steps, future_motion=None (B,steps,3))
      -> (codes (B,steps,h,w) long, motion (B,steps,3)): autoregressive argmax; motion predicted, or the
      given future_motion is used (and returned) instead
    - init_code_embedding(codebook (K, widths[0]), freeze=False)

    How it runs (the config's kernels and activation_checkpoint sections): fused_attention runs the
    temporal attention's Triton kernel on CUDA; channels_last lays the conv weights out NHWC;
    checkpoint_every > 0 recomputes the activations of every k-th block in the backward pass.
    """

    def __init__(self, cfg: WorldConfig, num_codes: int, fused_attention: bool = True, channels_last: bool = True,
                 checkpoint_every: int = 0):
        super().__init__()
        cfg.validate()
        if num_codes < 2:
            raise ValueError(f"world model: num_codes must be >= 2, got {num_codes}")
        self.cfg, self.num_codes, self.checkpoint_every = cfg, num_codes, checkpoint_every
        widths, nb = cfg.widths, cfg.blocks_per_level
        c0 = widths[0]
        self.code_embed = nn.Embedding(num_codes, c0)
        self.frame_embed = nn.Parameter(torch.zeros(cfg.max_frames, c0))
        self.pose_frame_embed = nn.Parameter(torch.zeros(cfg.max_frames, c0))
        self.pose_in = _pose_mlp(NUM_MOTION_FEATURES, c0)
        nn.init.normal_(self.code_embed.weight, std=1.0)
        nn.init.normal_(self.frame_embed, std=0.02)
        nn.init.normal_(self.pose_frame_embed, std=0.02)

        self.enc_levels, self.enc_blocks, self.enc_pose, self.downs = (nn.ModuleList() for _ in range(4))
        c = c0
        for w in widths[:-1]:
            self.enc_levels.append(_Level(c, cfg, fused_attention))
            self.enc_blocks.append(nn.ModuleList(ResBlock(c if j == 0 else w, w) for j in range(nb)))
            self.enc_pose.append(_pose_mlp(c, w))
            self.downs.append(nn.Conv2d(w, w, 2, 2))
            c = w
        self.mid_blocks = nn.ModuleList(ResBlock(c if j == 0 else widths[-1], widths[-1]) for j in range(nb))
        self.mid_pose = _pose_mlp(c, widths[-1])
        c = widths[-1]
        self.ups, self.pose_ups, self.dec_levels, self.dec_blocks, self.dec_pose = (nn.ModuleList() for _ in range(5))
        for w in reversed(widths[:-1]):
            self.ups.append(nn.ConvTranspose2d(c, w, 2, 2))
            self.pose_ups.append(nn.Linear(c, w))
            self.dec_levels.append(_Level(2 * w, cfg, fused_attention))
            self.dec_blocks.append(nn.ModuleList(ResBlock(2 * w if j == 0 else w, w) for j in range(nb)))
            self.dec_pose.append(_pose_mlp(2 * w, w))
            c = w
        self.out_norm = norm(c0)
        self.out_conv = nn.Conv2d(c0, num_codes, 3, 1, 1)
        self.motion_head = nn.Sequential(nn.LayerNorm(c0), nn.Linear(c0, 3))
        nn.init.zeros_(self.motion_head[1].weight)  # start as the constant-velocity prediction
        nn.init.zeros_(self.motion_head[1].bias)
        # number the checkpointable blocks in the order forward runs them (static: no counter in forward)
        order: list[nn.Module] = []
        for lvl, blocks in zip(self.enc_levels, self.enc_blocks):
            order += [*lvl.temporal, *lvl.pose, *blocks]
        order += [*self.mid_blocks]
        for lvl, blocks in zip(self.dec_levels, self.dec_blocks):
            order += [*lvl.temporal, *lvl.pose, *blocks]
        for i, blk in enumerate(order):
            blk.block_index = i
        # each attention layer's pair of buffers in a RolloutCache, in the order rollout_cache lays them out
        for i, layer in enumerate(a for lvl in [*self.enc_levels, *self.dec_levels] for a in [*lvl.temporal, *lvl.pose]):
            layer.cache_slot = i
        if channels_last:  # .to(device) and load_state_dict keep it
            self.to(memory_format=torch.channels_last)

    # -- embedding from the tokenizer
    @torch.no_grad()
    def init_code_embedding(self, codebook: Tensor, freeze: bool = False) -> None:
        """Copy a tokenizer codebook (K, widths[0]) into the code embedding (OccWorld feeds the frozen
        codebook vectors). With freeze=True the embedding stops requiring grad (build the optimizer from
        parameters with requires_grad)."""
        w = self.code_embed.weight
        if tuple(codebook.shape) != tuple(w.shape):
            raise ValueError(
                f"world model: codebook of shape {tuple(codebook.shape)} does not fit the code embedding "
                f"{tuple(w.shape)} (num_codes x widths[0]); set world widths[0] = tokenizer code_dim"
            )
        w.copy_(codebook.detach().to(w.device, w.dtype))
        w.requires_grad_(not freeze)

    # -- trunk
    def _ckpt_active(self) -> bool:
        return self.checkpoint_every > 0 and self.training and torch.is_grad_enabled()

    def _call(self, blk: nn.Module, *args: Tensor, cache: KV | None = None) -> Tensor:
        """Run one block, activation-checkpointed if it is every k-th block (by its block_index);
        `cache` (attention layers, rollout only) holds the earlier frames' keys and values."""
        if self._ckpt_active() and blk.block_index % self.checkpoint_every == 0:
            return checkpointed(blk, *args)
        return blk(*args) if cache is None else blk(*args, cache=cache)

    def _level(self, lvl: _Level, x: Tensor, p: Tensor, b: int, t: int,
               cache: KV | None = None) -> tuple[Tensor, Tensor]:
        """x (B*T, C, h, w), p (B, T, C) -> same shapes after conditioning, temporal and pose layers."""
        _, c, h, w = x.shape
        x = x + lvl.cond(p).reshape(b * t, c, 1, 1)
        if len(lvl.temporal):
            # (B*T, C, h, w) -> (B, T, h*w, C): a view of channels-last x, whose memory is (B, T, h, w, C)
            y = x.permute(0, 2, 3, 1).reshape(b, t, h * w, c)
            for layer in lvl.temporal:
                y = self._call(layer, y, cache=cache)
            x = y.reshape(b * t, h, w, c).permute(0, 3, 1, 2)  # channels-last again, no copy
        for layer in lvl.pose:
            p = self._call(layer, p, x, cache=cache)
        return x, p

    def _trunk(self, codes: Tensor, motion: Tensor, cache: RolloutCache | None = None) -> tuple[Tensor, Tensor]:
        """codes (B,T,h,w), motion (B,T,3) -> scene features (B*T, widths[0], h, w), pose tokens (B,T,widths[0]).

        With `cache` (a rollout's, see rollout), codes are only the frames after the cache.pos that
        earlier calls processed, motion their poses and, after the first call, the pose before them
        (a displacement needs it; a PackedCache: every pose so far): every layer is per frame or
        causal over time, so the earlier frames' outputs cannot change, and the attention layers
        take their keys and values from the cache."""
        b, t, h, w = codes.shape
        if t > self.cfg.max_frames:
            raise ValueError(f"world model: {t} input frames exceed max_frames={self.cfg.max_frames}")
        # a PackedCache's motion is every frame so far (cached_step checks it)
        if not isinstance(cache, PackedCache) and \
                tuple(motion.shape) not in ([(b, t, 3)] if cache is None else [(b, t, 3), (b, t + 1, 3)]):
            raise ValueError(f"world model: motion must be {(b, t, 3)}, got {tuple(motion.shape)}")
        if cache is None:
            kv, frame, pose_frame = None, self.frame_embed[:t], self.pose_frame_embed[:t]
        else:
            at = cache.pos + torch.arange(t, device=codes.device)  # the new frames' positions
            kv, frame, pose_frame = (cache, at), self.frame_embed[at], self.pose_frame_embed[at]
            if isinstance(cache, RolloutCache):
                cache.pos.add_(t)
        x = self.code_embed(codes.long()) + frame[:, None, None, :]  # (B, T, h, w, C)
        feats = motion_features(motion.to(x.dtype), self.cfg.motion_scale)[:, -t:]
        x = x.permute(0, 1, 4, 2, 3).reshape(b * t, -1, h, w)
        p = self.pose_in(feats) + pose_frame
        skips = []
        for lvl, blocks, pmlp, down in zip(self.enc_levels, self.enc_blocks, self.enc_pose, self.downs):
            x, p = self._level(lvl, x, p, b, t, kv)
            for blk in blocks:
                x = self._call(blk, x)
            p = pmlp(p)
            skips.append((x, p))
            if x.shape[-1] % 2 or x.shape[-2] % 2:  # odd sizes only: a zero pad is still a copy
                x = F.pad(x, (0, x.shape[-1] % 2, 0, x.shape[-2] % 2))
            x = channels_last_grad(down(x))
        for blk in self.mid_blocks:
            x = self._call(blk, x)
        p = self.mid_pose(p)
        for up, pup, lvl, blocks, pmlp, (sx, sp) in zip(
            self.ups, self.pose_ups, self.dec_levels, self.dec_blocks, self.dec_pose, reversed(skips)
        ):
            x = channels_last_grad(up(x))[..., : sx.shape[-2], : sx.shape[-1]]
            x = torch.cat([x, sx], 1)
            p = torch.cat([pup(p), sp], -1)
            x, p = self._level(lvl, x, p, b, t, kv)
            for blk in blocks:
                x = self._call(blk, x)
            p = pmlp(p)
        return x, p

    def _next_motion(self, p: Tensor, motion: Tensor, last_disp: Tensor) -> Tensor:
        s = self.cfg.motion_scale
        raw = self.motion_head(p)
        # not raw * raw.new_tensor([s, s, 1]): a host list copied to the GPU waits for its queue
        delta = last_disp + torch.cat([raw[..., :2] * s, raw[..., 2:]], -1)
        return compose_motion(motion, delta)

    # -- public API
    def forward(self, codes: Tensor, motion: Tensor, target_codes: Tensor | None = None,
                target_motion: Tensor | None = None, mask: Tensor | None = None) -> dict[str, Tensor]:
        """Teacher-forced pass. codes (B,T,h,w) integer, motion (B,T,3) float. Returns
        logits (B,T,K,h,w) for frames 1..T and motion (B,T,3) predicted for frames 1..T; with the
        targets (what training passes), loss(...)'s terms instead: the loss then is part of the one
        graph torch.compile makes of the forward (no float32 logits written, their gradient laid out
        as the logits are)."""
        x, p = self._trunk(codes, motion)
        b, t = codes.shape[:2]
        logits = channels_last_grad(self.out_conv(F.silu(self.out_norm(x))))
        m = motion.to(p.dtype)
        out = {"logits": logits.reshape(b, t, self.num_codes, *codes.shape[-2:]),
               "motion": self._next_motion(p, m, displacement(m))}
        if target_codes is None:
            return out
        if target_motion is None:
            raise ValueError("world model: target_codes given without target_motion")
        return self.loss(out, target_codes, target_motion, mask)

    def loss(self, out: dict[str, Tensor], target_codes: Tensor, target_motion: Tensor,
             mask: Tensor | None = None) -> dict[str, Tensor]:
        """out from forward; targets aligned with it (frame t+1 at position t). Returns loss (weighted sum,
        what to backward), ce, motion_l2 (mean squared error over x, y and wrapped yaw) and acc (detached).
        `mask` (B, T, h, w), when given (data.use_mask): CE over the nonzero cells only (Tokenizer.token_mask)."""
        cfg = self.cfg
        logits = out["logits"]
        target = target_codes.long()
        lg, tg, m = logits.flatten(0, 1), target.flatten(0, 1), None if mask is None else mask.flatten(0, 1)
        rows = lg.permute(0, 2, 3, 1)  # (B*T, h, w, K)
        if rows.is_contiguous():
            # channels-last logits (kernels.world_channels_last): a cell's K scores are one contiguous row, so the
            # CE runs over (cells, K) rows; over dim 1 of the (B*T, K, h, w) view torch's log-softmax
            # would copy the logits to NCHW first, and their gradient back
            lg, tg, m = rows.reshape(-1, self.num_codes), tg.reshape(-1), None if m is None else m.reshape(-1)
        ce = F.cross_entropy(lg, tg) if m is None else masked_cross_entropy(lg, tg, m)
        err = out["motion"] - target_motion.to(out["motion"].dtype)
        err = torch.cat([err[..., :2], _wrap(err[..., 2:])], -1)
        l2 = err.pow(2).mean()
        acc = (logits.detach().argmax(2) == target).float().mean()
        return {"loss": cfg.ce_weight * ce + cfg.motion_weight * l2, "ce": ce, "motion_l2": l2, "acc": acc}

    def window_loss(self, codes: Tensor, motion: Tensor) -> dict[str, Tensor]:
        """codes (B, T+1, h, w), motion (B, T+1, 3) of one window: teacher-forced forward on frames 0..T-1,
        loss against frames 1..T. Adds copy_last_acc (copying frame t's codes as the forecast of t+1)."""
        out = self.forward(codes[:, :-1], motion[:, :-1])
        res = self.loss(out, codes[:, 1:], motion[:, 1:])
        res["copy_last_acc"] = (codes[:, 1:].long() == codes[:, :-1].long()).float().mean()
        res["logits"], res["motion"] = out["logits"], out["motion"]
        return res

    def step(self, codes: Tensor, motion: Tensor, cache: RolloutCache | None = None) -> tuple[Tensor, Tensor]:
        """One rollout step: codes (B,T,h,w), motion (B,T,3) of the frames so far (2 <= T <= max_frames)
        -> the next frame's argmax codes (B,h,w) long and predicted motion (B,3). What export's
        `world_step` graph computes; the host loop (or rollout) appends and calls it again. With
        `cache` (rollout_cache): only the frames not yet in it, see _trunk."""
        x, p = self._trunk(codes, motion, cache)
        b = codes.shape[0]
        x_last = x.reshape(b, -1, *x.shape[1:])[:, -1]
        nxt = self.out_conv(F.silu(self.out_norm(x_last))).argmax(1)
        m = motion.to(p.dtype)
        return nxt, self._next_motion(p[:, -1], m[:, -1], displacement(m[:, -2:])[:, -1])

    def cached_step(self, codes: Tensor, motion: Tensor, kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One rollout step against a PackedCache, nothing written in place: what export's
        `world_step` graph computes. codes (B,N,h,w): the frames not yet in the cache; motion
        (B,T,3): the poses of every frame so far, the new ones last (T = pos + N, pos = the
        frames in the cache); kv (B,L,F) (L >= T, F = kv_width(h, w)): the cache, its first pos
        slots written. -> the next frame's argmax codes (B,h,w), its predicted motion (B,3), and
        the new frames' cache rows (B,N,F), for the caller to write at slots pos..T-1. With pos = 0
        (any kv, e.g. zeros) the same function as step(codes, motion)."""
        b, n, h, w = codes.shape
        if motion.shape[0] != b or motion.shape[-1] != 3 or motion.shape[1] < n or kv.shape[0] != b:
            raise ValueError(f"world model: codes {tuple(codes.shape)}, motion {tuple(motion.shape)} and cache "
                             f"{tuple(kv.shape)} do not fit (motion: every frame so far, the codes' last)")
        cache = PackedCache(kv, motion.shape[1] - n, self.kv_layout(h, w))
        x, p = self._trunk(codes, motion, cache)
        x_last = x.reshape(b, n, *x.shape[1:])[:, -1]
        nxt = self.out_conv(F.silu(self.out_norm(x_last))).argmax(1)
        m = motion.to(p.dtype)
        return nxt, self._next_motion(p[:, -1], m[:, -1], displacement(m[:, -2:])[:, -1]), cache.new_rows()

    def _kv_shapes(self, batch: int, h: int, w: int, length: int) -> list[tuple[int, ...]]:
        """Every attention layer's key (and value) shape in a rollout, in cache_slot order."""
        sizes = [(h, w)]  # each level's map: the stride-2 convs halve it, rounding up
        for _ in self.enc_levels[1:]:
            sizes.append(((sizes[-1][0] + 1) // 2, (sizes[-1][1] + 1) // 2))
        return [layer.kv_shape(batch, lh * lw, length)
                for lvl, (lh, lw) in zip([*self.enc_levels, *self.dec_levels], [*sizes, *reversed(sizes)])
                for layer in [*lvl.temporal, *lvl.pose]]

    def kv_layout(self, h: int, w: int) -> list[tuple[int, ...]]:
        """Each attention layer's keys of ONE frame, in a PackedCache row's order (frame axis dropped)."""
        return [s[1:-2] + s[-1:] for s in self._kv_shapes(1, h, w, 1)]

    def kv_width(self, h: int, w: int) -> int:
        """F: the values of one frame's PackedCache row (keys and values of every attention layer)."""
        return sum(2 * math.prod(s) for s in self.kv_layout(h, w))

    def rollout_cache(self, batch: int, h: int, w: int, length: int, device: torch.device,
                      dtype: torch.dtype) -> RolloutCache:
        """Zeroed key/value buffers of `length` frames for every attention layer, for rollouts of
        `batch` (h, w) token maps (zeros: a masked slot must still be finite, 0 x NaN is NaN)."""
        buffers = [(torch.zeros(s, device=device, dtype=dtype), torch.zeros(s, device=device, dtype=dtype))
                   for s in self._kv_shapes(batch, h, w, length)]
        return RolloutCache(buffers, device)

    def rollout(
        self, past_codes: Tensor, past_motion: Tensor, steps: int, future_motion: Tensor | None = None,
        cache: bool = True, step=None,
    ) -> tuple[Tensor, Tensor]:
        """Autoregressive forecast of `steps` frames (argmax codes). Each step runs the model on the last
        max_frames frames and appends its prediction for the next one; ego motion is predicted, or taken
        from future_motion (B, steps, 3) when given. Fixed Python loop over `steps`, no data-dependent
        control flow. Returns codes (B, steps, h, w) long and motion (B, steps, 3).

        With `cache` (while the frames fit max_frames, so no window slides and no frame changes its
        position embedding), the first step runs the past frames through the trunk and each later
        step only the new frame, its attention layers reading the earlier frames' keys and values
        from a RolloutCache: P + steps - 1 frame passes instead of P + (P + 1) + ... (5 past + 6
        future: 10 instead of 45), and the steps after the first all alike (one compiled graph). The
        same function as cache=False, up to float rounding (tested).

        `step`: what to call for one step instead of self.step (same arguments: a compiled or timed
        self.step, see wm.forecaster)."""
        step = self.step if step is None else step
        codes = past_codes.long()
        motion = past_motion.float()
        b, p_len, h, w = codes.shape
        kv = None
        if cache and p_len + steps - 1 <= self.cfg.max_frames:
            dev = codes.device  # the keys' dtype: what the attention computes in (autocast's, if on)
            dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else self.frame_embed.dtype
            kv = self.rollout_cache(b, h, w, p_len + steps - 1, dev, dtype)
        for s in range(steps):
            if kv is None:
                nxt, m_next = step(codes[:, -self.cfg.max_frames :], motion[:, -self.cfg.max_frames :], None)
            elif s == 0:
                nxt, m_next = step(codes, motion, kv)
            else:  # the new frame, and the pose before it for its displacement (copies: a compiled
                # step is specialised to its inputs' strides, and slices of the growing tensors differ)
                nxt, m_next = step(codes[:, -1:].contiguous(), motion[:, -2:].contiguous(), kv)
            if future_motion is not None:
                m_next = future_motion[:, s].to(motion.dtype)
            codes = torch.cat([codes, nxt[:, None]], 1)
            motion = torch.cat([motion, m_next[:, None].to(motion.dtype)], 1)
        return codes[:, p_len:], motion[:, p_len:]


def kv_row_width(cfg: WorldConfig, num_codes: int, h: int, w: int) -> int:
    """WorldModel(cfg, num_codes).kv_width(h, w) without its weights (built on the meta device, once
    per config: the export's host loop asks at every forecast)."""
    fields = tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(cfg))
    return _kv_row_width(fields, num_codes, h, w)


@functools.lru_cache(maxsize=16)
def _kv_row_width(fields: tuple, num_codes: int, h: int, w: int) -> int:
    with torch.device("meta"):
        model = WorldModel(WorldConfig(*fields), num_codes, fused_attention=False, channels_last=False)
        return model.kv_width(h, w)
