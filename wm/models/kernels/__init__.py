"""Triton kernels for CUDA: optional fast paths of the models, each the same function as the torch code
it replaces (README.md in this folder: what each replaces, its torch reference, its test).

One convention for all four. A kernel module `k` has `k.supports(...)`, which says whether it takes
these inputs (CUDA tensors of the dtypes and sizes it handles), and its op. A model holds one flag per
kernel (on by default) and runs the op where `use(k, flag, ...)` is true, its torch reference
elsewhere:

    kernel              model's flag                                  config key
    tokenizer_head      Tokenizer(..., fused_head=...)                kernels.tokenizer_head
    lovasz_histogram    Tokenizer(..., fused_lovasz=...)              kernels.lovasz_histogram
    embedding_grad      Tokenizer(..., fused_embedding_grad=...)      kernels.embedding_grad
    temporal_attention  WorldModel(..., fused_attention=...)          kernels.temporal_attention

The modules need Triton, which ships with torch's CUDA builds; without it (CPU builds) each name
below is None and the models take their torch paths.
"""

from __future__ import annotations

try:  # Triton ships with torch's CUDA builds; without it every model takes its torch path
    from wm.models.kernels import embedding_grad, lovasz_histogram, temporal_attention, tokenizer_head
except ImportError:
    embedding_grad = lovasz_histogram = temporal_attention = tokenizer_head = None

__all__ = ["use", "embedding_grad", "lovasz_histogram", "temporal_attention", "tokenizer_head"]


def use(kernel, flag: bool, *inputs) -> bool:
    """Whether a model runs `kernel` (a module of this package, None without Triton) on `inputs`: its
    flag for the kernel is on, and the kernel takes them (`kernel.supports(*inputs)`)."""
    return bool(flag) and kernel is not None and kernel.supports(*inputs)
