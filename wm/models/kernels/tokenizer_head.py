"""The tokenizer's head and both voxel losses in two Triton kernels, for CUDA: no logits in memory.

The torch path (Tokenizer._head, then Tokenizer.loss) turns the decoder output h (N, Z*E, X, Y) into
logits (N, C, X, Y, Z) with the transposed class embedding, then runs cross-entropy, a float32
softmax, a layout change to (points, C) and the Lovasz-softmax over them; each step reads and writes
C values per voxel (18 x 20 M at the occworld size, batch 32), and autograd keeps several of those
tensors for the backward pass (9 GiB at that size). Here h is read as a (P, E) matrix, one row per
voxel in the labels' order (a view when h is channels-last, one copy otherwise); each program takes
tiles of voxels, computes their C logits in registers (an E-long dot product per class, E = 8) and

- forward (`_head_loss_forward`): the cross-entropy of each voxel (summed per program) and, for the
  histogram Lovasz (wm.models.lovasz, impl "histogram"), adds each (class, error bin, foreground?) to the
  (C, bins, 2) count histogram: one int32 atomic add per voxel and class, most of the kernel's cost
  (no error sum per slot beside it: that would double the atomics);
- (torch, on the small tables) wm.models.lovasz.gradient_table gives each slot's Lovasz gradient; the loss
  is sum(counts x bin centres x gradients): the torch path's sum_i e_i g_i with each error at the
  centre of its bin. A bin spans a factor 1 + 2**-10 and every g_i >= 0, so the two differ by at
  most 2**-11 of the loss (tested); the gradient (from the counts alone) is the same;
- backward (`_head_loss_backward`): recomputes the tile's logits and softmax, looks each point's Lovasz
  gradient up in the table, goes back through the softmax and the cross-entropy to d loss / d logits,
  and from there to d h (written in h's dtype) and to d class-embedding (one partial per program,
  summed in torch: no float atomics, the same gradient on every run).

Only h, the labels and the small tables are saved for backward (0.4 GiB of temporaries at the occworld
size instead of 9). Equality with the torch path (loss and gradients, float32) is tested in
tests/models/test_kernel_tokenizer_head.py, compiled on CUDA, in Triton's interpreter elsewhere. Voxels whose
label is -1 (masked out) count in neither loss. Tile sizes: BENCHMARKS.md has the sweep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from wm.models.kernels.lovasz_histogram import error_keys
from wm.models.lovasz import bin_centers, bin_layout, class_weights, gradient_table

BLOCK = 128  # voxels per tile
TILES = 8  # tiles per program (one partial sum per program)
WARPS = 4  # warps per program


@triton.jit
def _tile(h_ptr, lab_ptr, w_ptr, v0, P, C: tl.constexpr, E: tl.constexpr, CP: tl.constexpr,
          EP: tl.constexpr, BLOCK: tl.constexpr):
    """Voxels v0 .. v0+BLOCK: h (BLOCK, EP) float32 (rows of the (P, E) decoder output), labels,
    validity, float32 logits (BLOCK, CP) (padding classes at -inf), softmax and log-sum-exp."""
    v = (v0 + tl.arange(0, BLOCK)).to(tl.int64)
    vmask = v < P
    ecols = tl.arange(0, EP)
    cols = tl.arange(0, CP)
    ht = tl.load(h_ptr + v[:, None] * E + ecols[None, :], mask=vmask[:, None] & (ecols[None, :] < E),
                 other=0.0).to(tl.float32)
    logits = tl.zeros((BLOCK, CP), tl.float32)
    for e in tl.static_range(E):  # an E-long dot product per class, E small (8): unrolled FMAs
        h_e = tl.sum(tl.where(ecols[None, :] == e, ht, 0.0), 1)
        w_e = tl.load(w_ptr + cols * E + e, mask=cols < C, other=0.0).to(tl.float32)
        logits += h_e[:, None] * w_e[None, :]
    logits = tl.where(cols[None, :] < C, logits, float("-inf"))
    lab = tl.load(lab_ptr + v, mask=vmask, other=-1).to(tl.int32)
    valid = vmask & (lab >= 0) & (lab < C)
    mx = tl.max(logits, 1)
    ex = tl.exp(logits - mx[:, None])
    se = tl.sum(ex, 1)
    p = ex / se[:, None]
    lse = mx + tl.log(se)
    return v, vmask, ht, lab, valid, logits, p, lse


@triton.jit
def _head_loss_forward(h_ptr, w_ptr, lab_ptr, cw_ptr, hist_ptr, ce_ptr, P,
                    C: tl.constexpr, E: tl.constexpr, CP: tl.constexpr, EP: tl.constexpr,
                    BINS: tl.constexpr, SHIFT: tl.constexpr, LOVASZ: tl.constexpr,
                    BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, CP)
    ce = tl.zeros((BLOCK,), tl.float32)
    for t in range(TILES):
        v, vmask, ht, lab, valid, logits, p, lse = _tile(h_ptr, lab_ptr, w_ptr, (pid * TILES + t) * BLOCK, P,
                                                         C, E, CP, EP, BLOCK)
        fg = lab[:, None] == cols[None, :]
        logit_y = tl.sum(tl.where(fg, logits, 0.0), 1)
        cw = tl.load(cw_ptr + lab, mask=valid, other=0.0)
        ce += tl.where(valid, cw * (lse - logit_y), 0.0)
        if LOVASZ:
            diff, err, key = error_keys(p, fg, cols, BINS, SHIFT)
            m = valid[:, None] & (cols[None, :] < C)
            tl.atomic_add(hist_ptr + key, tl.full(key.shape, 1, tl.int32), mask=m, sem="relaxed")
    tl.store(ce_ptr + pid, tl.sum(ce, 0))


@triton.jit
def _head_loss_backward(h_ptr, w_ptr, lab_ptr, cw_ptr, table_ptr, scale_ptr, dh_ptr, dw_ptr, P,
                     C: tl.constexpr, E: tl.constexpr, CP: tl.constexpr, EP: tl.constexpr,
                     BINS: tl.constexpr, SHIFT: tl.constexpr, LOVASZ: tl.constexpr,
                     BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, CP)
    ecols = tl.arange(0, EP)
    s_ce = tl.load(scale_ptr)  # d loss / d ce over the number of voxels counted
    s_lov = tl.load(scale_ptr + 1)  # d loss / d lovasz
    dw = tl.zeros((CP, EP), tl.float32)
    for t in range(TILES):
        v, vmask, ht, lab, valid, logits, p, lse = _tile(h_ptr, lab_ptr, w_ptr, (pid * TILES + t) * BLOCK, P,
                                                         C, E, CP, EP, BLOCK)
        fg = lab[:, None] == cols[None, :]
        m = valid[:, None] & (cols[None, :] < C)
        cw = tl.load(cw_ptr + lab, mask=valid, other=0.0)
        dl = (s_ce * cw)[:, None] * (p - tl.where(fg, 1.0, 0.0))  # cross-entropy
        if LOVASZ:
            diff, err, key = error_keys(p, fg, cols, BINS, SHIFT)
            g = tl.load(table_ptr + key, mask=m, other=0.0)
            q = tl.where(diff > 0, -g, tl.where(diff < 0, g, 0.0))  # d loss / d p = -sign(fg - p) g
            dl += s_lov * p * (q - tl.sum(p * q, 1)[:, None])  # back through the softmax
        dl = tl.where(m, dl, 0.0)
        dh = tl.zeros((BLOCK, EP), tl.float32)
        for e in tl.static_range(E):
            w_e = tl.load(w_ptr + cols * E + e, mask=cols < C, other=0.0).to(tl.float32)
            dh += tl.where(ecols[None, :] == e, tl.sum(dl * w_e[None, :], 1)[:, None], 0.0)
            h_e = tl.sum(tl.where(ecols[None, :] == e, ht, 0.0), 1)
            dw += tl.where(ecols[None, :] == e, tl.sum(dl * h_e[:, None], 0)[:, None], 0.0)
        tl.store(dh_ptr + v[:, None] * E + ecols[None, :], dh.to(dh_ptr.dtype.element_ty),
                 mask=vmask[:, None] & (ecols[None, :] < E))
    tl.store(dw_ptr + pid * C * E + cols[:, None] * E + ecols[None, :], dw,
             mask=(cols[:, None] < C) & (ecols[None, :] < E))


def _layout(num_points: int, weight: Tensor):
    c, e = weight.shape
    return c, e, triton.next_power_of_2(c), triton.next_power_of_2(e), (triton.cdiv(num_points, BLOCK * TILES),)


@torch.library.custom_op("wm::head_losses", mutates_args=())
def _head_losses(h: Tensor, weight: Tensor, labels: Tensor, class_w: Tensor, lovasz: bool, present_only: bool,
                 bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (cross-entropy, Lovasz, the (C*bins*2,) Lovasz gradient table, counted voxels): the last two
    are for the backward pass. A custom op, so torch.compile keeps the model and its loss in one
    graph (a graph break here made Inductor hand the decoder output and its gradient across)."""
    h, weight, labels, class_w = h.contiguous(), weight.contiguous(), labels.contiguous(), class_w.contiguous()
    num_points = labels.numel()
    c, e, cp, ep, grid = _layout(num_points, weight)
    shift, bins = bin_layout(bits)
    dev = h.device
    ce_part = torch.empty(grid[0], device=dev, dtype=torch.float32)
    size = c * bins * 2 if lovasz else 1
    hist = torch.zeros(size, device=dev, dtype=torch.int32)
    _head_loss_forward[grid](h, weight, labels, class_w, hist, ce_part, num_points, c, e, cp, ep, bins,
                             shift, lovasz, BLOCK, TILES, num_warps=WARPS)
    if lovasz:
        hist = hist.view(c, bins, 2)
        counts = hist[..., 1].sum(1)  # foreground voxels per class (the counted ones only)
        voxels = counts.sum()
        table = gradient_table(hist, counts, class_weights(counts, present_only, torch.float32), torch.float64)
        lov = (hist.double() * bin_centers(bits, dev)[:, None] * table).sum().float()
        table = table.float().reshape(-1)
    else:
        voxels = (labels >= 0).sum()
        table, lov = hist.new_zeros((1,), dtype=torch.float32), ce_part.new_zeros(())
    voxels = voxels.clamp_min(1).float()
    return ce_part.sum() / voxels, lov, table, voxels


@_head_losses.register_fake
def _(h, weight, labels, class_w, lovasz, present_only, bits):
    size = weight.shape[0] * bin_layout(bits)[1] * 2 if lovasz else 1
    scalar = h.new_empty((), dtype=torch.float32)
    return scalar, scalar.clone(), h.new_empty(size, dtype=torch.float32), scalar.clone()


@torch.library.custom_op("wm::head_losses_backward", mutates_args=())
def _head_losses_backward(h: Tensor, weight: Tensor, labels: Tensor, class_w: Tensor, table: Tensor,
                          scale: Tensor, lovasz: bool, bits: int) -> tuple[Tensor, Tensor]:
    """scale: [d loss / d ce over the counted voxels, d loss / d lovasz] -> (d h, d weight)."""
    h, weight, labels, class_w = h.contiguous(), weight.contiguous(), labels.contiguous(), class_w.contiguous()
    num_points = labels.numel()
    c, e, cp, ep, grid = _layout(num_points, weight)
    shift, bins = bin_layout(bits)
    dh = torch.empty_like(h)
    dw = torch.empty(grid[0], c, e, device=h.device, dtype=torch.float32)
    _head_loss_backward[grid](h, weight, labels, class_w, table.contiguous(), scale.contiguous(), dh, dw,
                              num_points, c, e, cp, ep, bins, shift, lovasz, BLOCK, TILES, num_warps=WARPS)
    return dh, dw.sum(0).to(weight.dtype)


@_head_losses_backward.register_fake
def _(h, weight, labels, class_w, table, scale, lovasz, bits):
    return h.new_empty(h.shape), torch.empty_like(weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    h, weight, labels, class_w, lovasz, _present_only, bits = inputs
    _ce, _lov, table, voxels = output
    ctx.save_for_backward(h, weight, labels, class_w, table, voxels)
    ctx.lovasz, ctx.bits = lovasz, bits


def _backward(ctx, d_ce: Tensor | None, d_lov: Tensor | None, _d_table, _d_voxels):
    h, weight, labels, class_w, table, voxels = ctx.saved_tensors
    zero = voxels.new_zeros(())
    scale = torch.stack([(zero if d_ce is None else d_ce.float()) / voxels, zero if d_lov is None else d_lov.float()])
    dh, dw = _head_losses_backward(h, weight, labels, class_w, table, scale, ctx.lovasz, ctx.bits)
    return dh, dw, None, None, None, None, None


_head_losses.register_autograd(_backward, setup_context=_setup_context)


def supports(h: Tensor) -> bool:
    """Whether the kernels take this decoder output: on CUDA (float32 or bfloat16, any layout)."""
    return h.is_cuda


def head_losses(h: Tensor, weight: Tensor, labels: Tensor, class_w: Tensor, lovasz: bool,
                present_only: bool, bits: int) -> tuple[Tensor, Tensor]:
    """h (P, E) the decoder output of P voxels (float32 or bfloat16), weight (C, E) the class
    embedding, labels (P,) int16 class ids (-1: not counted), class_w (C,) float32 cross-entropy class
    weights -> (cross-entropy, Lovasz-softmax (histogram; 0 when not `lovasz`)), both float32 scalars
    with gradients to h and weight: the cross-entropy is sum(class_w[y] * -log p_y) over the counted
    voxels divided by their number, as Tokenizer.loss. The kernels choose their own precision
    (autocast does not reach a custom op)."""
    if h.dim() != 2 or labels.shape != h.shape[:1] or weight.shape[1] != h.shape[1]:
        raise ValueError(f"head_losses: h (P, E), labels (P,), weight (C, E), got {tuple(h.shape)}, "
                         f"{tuple(labels.shape)}, {tuple(weight.shape)}")
    ce, lov, _table, _voxels = _head_losses(h, weight, labels, class_w.float(), lovasz, present_only, bits)
    return ce, lov
