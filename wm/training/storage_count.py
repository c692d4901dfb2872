"""Bytes of tensor storages, live and at their peak: each counted once when an op creates it and
subtracted when it is freed (a weak reference's callback), rounded up to the allocator's block.
What wm.training.activations and wm.training.compiled_activations add up their steps with."""

from __future__ import annotations

import weakref

import torch


class StorageCount:
    """Storages of `known` tensors (alive before) are not counted; `block`: the allocator's rounding."""

    def __init__(self, known=(), block: int = 1):
        self.block, self.live, self.peak = block, 0, 0
        self.known = {t.untyped_storage()._cdata for t in known}
        self.refs: dict[int, weakref.ref] = {}  # storage -> a reference whose callback frees its bytes

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.refs.pop(key, None)

    def add(self, t) -> None:
        """Count `t`'s storage, unless it is known or counted already (a view, an alias)."""
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.known or key in self.refs:
            return
        n = -(-storage.nbytes() // self.block) * self.block
        self.refs[key] = weakref.ref(storage, lambda _, key=key, n=n: self._free(key, n))
        self.live += n
        self.peak = max(self.peak, self.live)
