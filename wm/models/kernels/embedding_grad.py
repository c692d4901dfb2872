"""The weight gradient of an embedding lookup on CUDA, without a sort and without atomics.

An embedding's weight gradient is, for each row r of the table, the sum of the output gradients of
the positions that looked r up: onehot(ids)^T @ d. torch's CUDA embedding backward sorts all the ids
first (20 M class ids per 32 frames of 200x200x16 for the tokenizer's class embedding: 20 ms on an
H200), and the one-hot matmul in torch writes the (positions x rows) matrix first (0.7 GiB and 4.2
ms there). Here one Triton kernel builds one-hot tiles in registers and multiplies them on the tensor
cores (0.49 ms there): each program takes a run of positions and a block of rows and columns and
writes one float32 partial, and torch sums the partials, so the gradient is the same on every run.
Used by wm.models.tokenizer's class embedding (BENCHMARKS.md); tested by hand in
tests/models/test_kernel_embedding_grad.py (compiled on CUDA, in Triton's interpreter elsewhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 128  # positions per tile (the dot's inner dimension)
TILES = 8  # tiles per program
ROWS = 64  # table rows per program, at most
COLS = 64  # table columns per program, at most


@triton.jit
def _embedding_grad_kernel(ids_ptr, d_ptr, out_ptr, P, R: tl.constexpr, E: tl.constexpr, RB: tl.constexpr,
                           EB: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Program (run, row block, column block): onehot(ids)^T @ d over its positions, one (RB, EB)
    float32 partial. PRECISION "tf32" for 16-bit d (tf32 holds bf16 and fp16 values exactly), "ieee"
    for float32 d."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)
    cols = tl.program_id(2) * EB + tl.arange(0, EB)
    acc = tl.zeros((RB, EB), tl.float32)
    for t in range(TILES):
        v = ((pid * TILES + t) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        vmask = v < P
        ids = tl.load(ids_ptr + v, mask=vmask, other=-1).to(tl.int32)
        d = tl.load(d_ptr + v[:, None] * E + cols[None, :], mask=vmask[:, None] & (cols[None, :] < E),
                    other=0.0).to(tl.float32)
        onehot = (rows[:, None] == ids[None, :]).to(tl.float32)  # (RB, BLOCK)
        acc = tl.dot(onehot, d, acc, input_precision=PRECISION)
    tl.store(out_ptr + pid * R * E + rows[:, None] * E + cols[None, :], acc,
             mask=(rows[:, None] < R) & (cols[None, :] < E))


def supports(d: Tensor) -> bool:
    """Whether the kernel takes these output gradients (P, E): on CUDA."""
    return d.is_cuda


@torch.library.custom_op("wm::embedding_grad", mutates_args=())
def embedding_grad(ids: Tensor, d: Tensor, rows: int) -> Tensor:
    """ids (P,) integer row ids, d (P, E) float -> (rows, E) float32: row r is the sum of d's rows
    over the positions whose id is r (ids outside [0, rows) count nowhere). A custom op, so that
    torch.compile keeps it in the graph."""
    ids, d = ids.contiguous(), d.contiguous()
    num_points, e = d.shape
    rb = min(ROWS, max(16, triton.next_power_of_2(rows)))  # 16: tl.dot's smallest tile
    eb = min(COLS, max(16, triton.next_power_of_2(e)))
    grid = (triton.cdiv(num_points, BLOCK * TILES), triton.cdiv(rows, rb), triton.cdiv(e, eb))
    out = torch.empty(grid[0], rows, e, device=d.device, dtype=torch.float32)  # every block is written
    _embedding_grad_kernel[grid](ids, d, out, num_points, rows, e, rb, eb,
                                 "ieee" if d.dtype == torch.float32 else "tf32", BLOCK, TILES, num_warps=4)
    return out.sum(0)


@embedding_grad.register_fake
def _(ids, d, rows):
    return d.new_empty((rows, d.shape[1]), dtype=torch.float32)
