"""The world model's causal attention over time in one Triton kernel each way, for CUDA.

A temporal layer attends, for every spatial cell and head, over the T <= 16 frames of a window: at the
occworld size 40 000 cells x 8 heads x 11 frames x head dim 16-64. The torch path
(wm.models.world.short_causal_attention) permutes q, k, v out of the q/k/v projection, runs two
batched matmuls of 11 x 16 matrices (cuBLAS/cutlass tiles of 64 or more waste most of each tile), a
masked softmax between them, and permutes the result back: 33 of 208 GPU-ms of a compiled world step
on an H200 (BENCHMARKS.md), plus the copies.

Here each program takes BLOCK rows (BLOCK // TP cells, their T frames padded to TP, a power of 2) of
one head, reads q, k, v straight out of the (B, T, S, 3C) projection (B windows, S = h*w cells a frame;
cell n = b*S + s, frame t at row (b*T + t)*S + s: q of head h at h*D, k at C + h*D, v at 2C + h*D) and
keeps the rest in registers. That is the scene features' own memory order, channels-last (B*T, C, h,
w), so the temporal layers need no (cells, T, C) copy of them either way. The (BLOCK, BLOCK) scores
of all its rows against all its rows come from one tensor-core product; a cell's frames are one
diagonal block, so the mask is block-diagonal and causal, and the products outside the blocks are the
price of using the tensor cores at T = 11 (cheap next to reading q, k, v and writing the results).

- forward (`_time_attention_forward`): scores, masked softmax, o = P v; writes o straight into the (B, T, S, C)
  layout the output projection reads, and each row's log-sum-exp (B, T, S, H) float32;
- backward (`_time_attention_backward`): the probabilities again from the log-sum-exp, then dv = P^T dO,
  dP = dO v^T, dS = P (dP - rowsum(dO o)), dq = dS k, dk = dS^T q; a program owns all T frames of
  its cells, so every gradient row is written once (no atomics), into one (B, T, S, 3C) tensor.

Products in the input dtype with float32 sums (float32 inputs keep float32 products), softmax in
float32; outputs in the input's dtype. Tile size: BENCHMARKS.md has the sweep. Registered
as torch custom ops (wm::causal_time_attention and its backward) so torch.compile treats them as single
opaque calls with no graph break. Equality with the torch path (values and gradients) is tested in
tests/models/test_kernel_temporal_attention.py, compiled on CUDA, in Triton's interpreter elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_FRAMES = 16  # one cell's frames are one diagonal block of a tile: longer sequences take the torch path
BLOCK = 64  # rows (cells x frames padded to a power of 2) per program: one (BLOCK, BLOCK) score tile
WARPS = 4  # warps per program


@triton.jit
def _tile(qkv_ptr, N, S, T: tl.constexpr, TP: tl.constexpr, C: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
          BLOCK: tl.constexpr):
    """This program's head and rows: BLOCK // TP cells, TP (>= T) rows each. Returns the head, the rows'
    numbers in the (B, T, S, .) tensors (cell n = b*S + s, frame t: row (b*T + t)*S + s), which rows
    exist, the (BLOCK, D) offsets of the head's q in (B, T, S, 3C) and of its slice of (B, T, S, C), q, k,
    v (BLOCK, D) in the input dtype, and which (query row, key row) pairs attend: the same cell, key
    frame <= query frame, key frame < T. Every row attends to its cell's frame 0, so no row is all -inf."""
    pid = tl.program_id(0)
    h = pid % H  # the H heads of a block of cells run next to each other: they share cache lines
    r = tl.arange(0, BLOCK)
    g, t = r // TP, r % TP
    cells = ((pid // H) * (BLOCK // TP) + g).to(tl.int64)
    rows = ((cells // S) * T + t) * S + cells % S
    rmask = (cells < N) & (t < T)
    dd = tl.arange(0, D)
    off = rows[:, None] * (3 * C) + h * D + dd[None, :]
    ooff = rows[:, None] * C + h * D + dd[None, :]
    q = tl.load(qkv_ptr + off, mask=rmask[:, None], other=0.0)
    k = tl.load(qkv_ptr + off + C, mask=rmask[:, None], other=0.0)
    v = tl.load(qkv_ptr + off + 2 * C, mask=rmask[:, None], other=0.0)
    attend = (g[:, None] == g[None, :]) & (t[None, :] <= t[:, None]) & (t[None, :] < T)
    return h, rows, rmask, off, ooff, q, k, v, attend


@triton.jit
def _time_attention_forward(qkv_ptr, o_ptr, lse_ptr, N, S, scale, T: tl.constexpr, TP: tl.constexpr,
                    C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                    PREC: tl.constexpr):
    h, rows, rmask, off, ooff, q, k, v, attend = _tile(qkv_ptr, N, S, T, TP, C, H, D, BLOCK)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # (BLOCK, BLOCK), float32 accumulation
    s = tl.where(attend, s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp(s - m[:, None])
    total = tl.sum(p, 1)
    o = tl.dot(p.to(v.dtype), v, input_precision=PREC) / total[:, None]
    tl.store(o_ptr + ooff, o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(lse_ptr + rows * H + h, m + tl.log(total), mask=rmask)


@triton.jit
def _time_attention_backward(qkv_ptr, o_ptr, lse_ptr, do_ptr, dqkv_ptr, N, S, scale, T: tl.constexpr, TP: tl.constexpr,
                     C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     PREC: tl.constexpr):
    h, rows, rmask, off, ooff, q, k, v, attend = _tile(qkv_ptr, N, S, T, TP, C, H, D, BLOCK)
    do = tl.load(do_ptr + ooff, mask=rmask[:, None], other=0.0)
    o = tl.load(o_ptr + ooff, mask=rmask[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # rowsum(dO * O)
    lse = tl.load(lse_ptr + rows * H + h, mask=rmask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    p = tl.exp(tl.where(attend & rmask[:, None], s - lse[:, None], float("-inf")))  # the forward's probabilities
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    dscore = (p * (dp - delta[:, None])).to(q.dtype)  # softmax backward
    dq = tl.dot(dscore, k, input_precision=PREC) * scale
    dk = tl.dot(tl.trans(dscore), q, input_precision=PREC) * scale
    ty = dqkv_ptr.dtype.element_ty
    tl.store(dqkv_ptr + off, dq.to(ty), mask=rmask[:, None])
    tl.store(dqkv_ptr + off + C, dk.to(ty), mask=rmask[:, None])
    tl.store(dqkv_ptr + off + 2 * C, dv.to(ty), mask=rmask[:, None])


def _fits(frames: int, width: int, heads: int) -> bool:
    """Whether the kernels take `frames` frames of `width` channels in `heads` heads: T <= 16 (a cell's
    frames fit one tile) and a power-of-2 head dim of 16 to 128 (tensor-core dot sizes)."""
    d = width // heads
    return 1 <= frames <= MAX_FRAMES and d * heads == width and d == triton.next_power_of_2(d) and 16 <= d <= 128


def supports(qkv: Tensor, heads: int) -> bool:
    """Whether the kernels take this (B, T, S, 3C) q/k/v projection in `heads` heads: on CUDA, of a
    size `_fits` takes."""
    return qkv.is_cuda and qkv.dim() == 4 and _fits(qkv.shape[1], qkv.shape[3] // 3, heads)


def _layout(qkv: Tensor, heads: int):
    """Shapes and launch sizes: (B, T, S, C, D, T padded to a power of 2, grid)."""
    if qkv.dim() != 4:
        raise ValueError(f"causal_time_attention: qkv {tuple(qkv.shape)} must be (B, T, S, 3C)")
    b, t, s, c3 = qkv.shape
    c = c3 // 3
    d = c // heads
    if c3 != 3 * c or not _fits(t, c, heads):
        raise ValueError(f"causal_time_attention: qkv {tuple(qkv.shape)} with {heads} heads: needs (B, T<=16, S, 3C) "
                         "with a power-of-2 head dim of 16 to 128")
    tp = triton.next_power_of_2(t)
    return b, t, s, c, d, tp, (triton.cdiv(b * s, BLOCK // tp) * heads,)


def _precision(qkv: Tensor) -> str:
    """float32 inputs keep float32 products (tl.dot would round them to tf32); bf16/fp16 take the tensor cores'
    native products with float32 sums."""
    return "ieee" if qkv.dtype == torch.float32 else "tf32"


@torch.library.custom_op("wm::causal_time_attention", mutates_args=())
def _attention(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    qkv = qkv.contiguous()
    b, t, s, c, d, tp, grid = _layout(qkv, heads)
    o = qkv.new_empty(b, t, s, c)
    lse = torch.empty(b, t, s, heads, device=qkv.device, dtype=torch.float32)
    _time_attention_forward[grid](qkv, o, lse, b * s, s, d ** -0.5, T=t, TP=tp, C=c, H=heads, D=d, BLOCK=BLOCK,
                          PREC=_precision(qkv), num_warps=WARPS)
    return o, lse


@_attention.register_fake
def _(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    b, t, s, c3 = qkv.shape
    return qkv.new_empty(b, t, s, c3 // 3), qkv.new_empty(b, t, s, heads, dtype=torch.float32)


@torch.library.custom_op("wm::causal_time_attention_backward", mutates_args=())
def _attention_backward(qkv: Tensor, o: Tensor, lse: Tensor, do: Tensor, heads: int) -> Tensor:
    qkv, o, do = qkv.contiguous(), o.contiguous(), do.contiguous()
    b, t, s, c, d, tp, grid = _layout(qkv, heads)
    dqkv = torch.empty_like(qkv)
    _time_attention_backward[grid](qkv, o, lse, do, dqkv, b * s, s, d ** -0.5, T=t, TP=tp, C=c, H=heads, D=d, BLOCK=BLOCK,
                           PREC=_precision(qkv), num_warps=WARPS)
    return dqkv


@_attention_backward.register_fake
def _(qkv: Tensor, o: Tensor, lse: Tensor, do: Tensor, heads: int) -> Tensor:
    # contiguous, as the kernel writes it: not empty_like(qkv), whose strides follow a qkv that
    # Inductor laid out otherwise (it then read the gradient with the wrong strides)
    return qkv.new_empty(qkv.shape)


def _setup_context(ctx, inputs, output):
    ctx.heads = inputs[1]
    ctx.save_for_backward(inputs[0], *output)  # o is the output projection's input: autograd keeps it anyway


def _backward(ctx, do: Tensor, _dlse: Tensor):
    qkv, o, lse = ctx.saved_tensors
    return _attention_backward(qkv, o, lse, do, ctx.heads), None


_attention.register_autograd(_backward, setup_context=_setup_context)


def causal_time_attention(qkv: Tensor, heads: int) -> Tensor:
    """qkv (B, T, S, 3C), the fused q/k/v projection of B windows of T <= 16 frames of S cells each ->
    (B, T, S, C): per cell and head (C/heads, a power of 2) causal softmax attention, frame t over
    frames 0..t. The same function as wm.models.world.short_causal_attention on the permuted q, k, v;
    differentiable in qkv. The frames of a cell lie S rows apart: the world model's scene features in
    their own (B, T, h, w, C) memory order, with no permute (S = 1 is the (cells, T, 3C) layout)."""
    return _attention(qkv, heads)[0]
