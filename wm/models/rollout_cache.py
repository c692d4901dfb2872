"""The world model's key/value caches for rollouts (wm.models.world): the attention keys and values of
the frames already run, so that each rollout step runs only its new frames through the trunk.

- RolloutCache: per attention layer a pair of fixed-length buffers written in place, and the
  position on the device (WorldModel.rollout, wm.Forecaster: what compiles and CUDA-graphs well);
- PackedCache: every layer's keys and values of a frame in one row of one (B, L, F) tensor that is
  read, never written (WorldModel.cached_step: what the exported world_step graph takes and gives).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

class RolloutCache:
    """The attention keys and values of a rollout's frames so far (WorldModel.rollout_cache): one
    zeroed pair of buffers per attention layer, `length` frames long (the rollout's longest input),
    and `pos`, the frames written (a 0-d long tensor on the device). Fixed lengths and a position on
    the device make every step after the first the same computation on the same shapes: a compiled
    step is two graphs (the past frames, then one frame), and a CUDA graph records it as it is."""

    def __init__(self, buffers: list[tuple[Tensor, Tensor]], device: torch.device):
        self.buffers = buffers
        self.pos = torch.zeros((), dtype=torch.long, device=device)


class PackedCache:
    """A rollout's keys and values as ONE tensor and nothing written in place: what the exported
    `world_step` graph takes and gives (a graph input cannot be updated, and one (B, L, F) tensor
    is one buffer for the host loop and one binding for TensorRT instead of two per layer).

    `kv` (B, L, F): L frame slots; a slot's row holds every attention layer's keys then values for
    that frame, flattened in each layer's frame layout and laid out layer after layer in cache_slot
    order (WorldModel.kv_layout). Slots 0..pos-1 hold the frames before the new ones; later slots
    are ignored (masked), whatever they hold, if finite. The new frames' rows are collected in
    `rows` as the layers run (WorldModel.cached_step returns them; the host writes them at pos)."""

    def __init__(self, kv: Tensor, pos, layout: list[tuple[int, ...]]):
        self.kv, self.pos, self.rows = kv, pos, {}
        self.offsets, o = [], 0
        for shape in layout:
            n = math.prod(shape)
            self.offsets.append((o, n, shape))
            o += 2 * n
        if kv.shape[-1] != o:
            raise ValueError(f"world model: the key/value cache has rows of {kv.shape[-1]} values, this model's "
                             f"layers need {o}")

    def keys_values(self, slot: int, k: Tensor, v: Tensor, at: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(keys, values, key positions) for layer `slot`: the cached slots then the new frames
        (k, v: (B, ..., N, d), frames on axis -2); slots not yet written get a position after every
        query's, so the causal mask hides them."""
        o, n, shape = self.offsets[slot]
        b, length = self.kv.shape[:2]
        new_k, new_v = k.movedim(-2, 1), v.movedim(-2, 1)  # (B, N, ...): the rows' frame layout
        self.rows[slot] = torch.cat([new_k.reshape(b, -1, n), new_v.reshape(b, -1, n)], -1)
        past_k = self.kv[:, :, o:o + n].reshape(b, length, *shape).movedim(1, -2).to(k.dtype)
        past_v = self.kv[:, :, o + n:o + 2 * n].reshape(b, length, *shape).movedim(1, -2).to(v.dtype)
        slots = torch.arange(length, device=k.device)
        past_at = torch.where(slots < self.pos, slots, slots + (1 << 30))
        return torch.cat([past_k, k], -2), torch.cat([past_v, v], -2), torch.cat([past_at, at])

    def new_rows(self) -> Tensor:
        """(B, N, F) the new frames' rows, every layer's in slot order."""
        return torch.cat([self.rows[i] for i in range(len(self.offsets))], -1)


# a rollout's cache as the attention layers see it in one call: the cache and the new frames' positions
KV = tuple["RolloutCache | PackedCache", Tensor]


def cached_keys_values(kv: KV | None, layer: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Keys, values (..., T, d) and the keys' positions (None: 0..T-1) for the attention. A
    RolloutCache: the new frames' written into the layer's buffers at their positions, and the whole
    buffers returned (slots not yet written are masked). A PackedCache: see keys_values."""
    if kv is None:
        return k, v, None
    cache, at = kv
    if isinstance(cache, PackedCache):
        return cache.keys_values(layer.cache_slot, k, v, at)
    kb, vb = cache.buffers[layer.cache_slot]
    kb.index_copy_(kb.dim() - 2, at, k.to(kb.dtype))
    vb.index_copy_(vb.dim() - 2, at, v.to(vb.dtype))
    return kb, vb, None
