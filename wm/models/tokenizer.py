"""VQ-VAE tokenizer over occupancy frames (OccWorld's, see wzzheng/OccWorld model/VAE/*).

Data flow for one frame `occ` (X, Y, Z) uint8 class ids:

    class embedding (num_classes x embed_dim) per voxel -> (Z*embed_dim, X, Y)   height folded into channels
    2D ResNet encoder: conv_in, L = len(widths) levels of `blocks_per_level` ResBlocks with a stride-2
        conv between levels (OccWorld: L = 3, X -> X/2 -> X/4), attention after every block of the lowest
        level, mid ResBlock/Attn/ResBlock, GroupNorm + SiLU + conv_out -> (code_dim, X/d, Y/d), d = 2**(L-1)
    vector quantizer (codebook_size x code_dim, straight-through) -> codes (X/d, Y/d)
    mirrored decoder -> (Z*embed_dim, X, Y) -> per voxel dot product with the class embedding table
        (the "transposed class embedding" head) -> logits (num_classes, X, Y, Z)

Loss = ce_weight * CE + lovasz_weight * Lovasz-softmax + vq_weight * (codebook + commitment * commit).

Frames may carry any number of leading dims: (B, X, Y, Z) or (B, T, X, Y, Z); outputs keep them.
Model code knows nothing of devices, DDP or AMP.

Dead-code reset: a training forward ages every code (buffer `code_age`, saved in checkpoints) and keeps
a reference to its encoder outputs; `reset_dead_codes()` (call it after `optimizer.step()`) re-initialises
codes unused for `dead_code_steps` training forwards (micro-batches) from those outputs, using the torch
RNG. DDP does not sync in-place parameter edits: call it on rank 0 only, then broadcast
`quantizer.codebook.weight` and `quantizer.code_age` from rank 0 to all ranks (DDP's default buffer
broadcast already makes rank 0's `code_age` everyone's at each forward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wm.config.models import TokenizerConfig
from wm.models import kernels
from wm.models.layers import ResBlock, checkpointed, masked_cross_entropy, norm
from wm.models.lovasz import HIST_BITS, lovasz_softmax
from wm.utils.errors import DataError

__all__ = ["Tokenizer", "VectorQuantizer"]


# ------------------------------------------------------------------------------------------ config


# ------------------------------------------------------------------------------------------ blocks


class AttnBlock(nn.Module):
    """Spatial self-attention over all H*W positions (residual), via F.scaled_dot_product_attention.
    q, k, v are laid out (N, heads, HW, d) with contiguous d, so the fused (flash / memory-efficient)
    kernels apply instead of the float32 math fallback."""

    def __init__(self, c: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = norm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        t = self.norm(x).flatten(2).transpose(1, 2)  # (N, HW, C)
        q, k, v = self.qkv(t).reshape(n, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # (N, heads, HW, d)
        o = self.proj(o.transpose(1, 2).reshape(n, h * w, c))
        return x + o.transpose(1, 2).reshape(n, c, h, w)


class Downsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and torch.compiler.is_compiling():
            # the same values as a broadcast: Inductor lowers interpolate's backward to float atomic adds
            # into the input's gradient, which serialise on a GPU; a broadcast's
            # backward is a plain sum over the copies. Eager (and export) keep interpolate, whose
            # backward kernel in ATen sums without atomics.
            n, c, h, w = x.shape
            x = x[:, :, :, None, :, None].expand(n, c, h, 2, w, 2).reshape(n, c, 2 * h, 2 * w)
        else:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(x)


# ------------------------------------------------------------------------------------------ checkpointing


def _run_blocks(blocks: nn.ModuleList, x: Tensor, every: int, active: bool, start: int = 0) -> tuple[Tensor, int]:
    """Apply `blocks` in order; ResBlock/AttnBlock number i (counted from `start`) is activation-checkpointed
    when `active` and i % every == 0. Returns the output and the next block number."""
    i = start
    for blk in blocks:
        if isinstance(blk, (ResBlock, AttnBlock)):
            if active and every > 0 and i % every == 0:
                x = checkpointed(blk, x)
            else:
                x = blk(x)
            i += 1
        else:
            x = blk(x)
    return x, i


# ------------------------------------------------------------------------------------------ quantizer


class VectorQuantizer(nn.Module):
    """Nearest-neighbour codebook lookup with straight-through gradients and usage tracking.

    Distances are ||e||^2 - 2 z.e (the ||z||^2 term does not change the argmin): one (N, K) matrix from
    one matmul, no (N, K, D) broadcast, computed without grad; the few best candidates per row are
    re-scored exactly (N, refine, D).
    """

    refine = 4  # candidates re-scored exactly per row (see `nearest`)

    def __init__(self, codebook_size: int, code_dim: int, commitment: float, dead_code_steps: int):
        super().__init__()
        self.codebook = nn.Embedding(codebook_size, code_dim)
        nn.init.uniform_(self.codebook.weight, -1.0 / codebook_size, 1.0 / codebook_size)  # as OccWorld
        self.commitment = commitment
        self.dead_code_steps = dead_code_steps
        # training forwards since each code was last selected (checkpointed with the model)
        self.register_buffer("code_age", torch.zeros(codebook_size, dtype=torch.long))
        self._recent_z: Tensor | None = None  # last training batch's encoder outputs (N, D), for resets

    @property
    def size(self) -> int:
        return self.codebook.num_embeddings

    def nearest(self, z: Tensor) -> Tensor:
        """z (N, D) -> code ids (N,) long.

        One (N, K) matmul ranks the codes; the best `refine` of each row are then re-scored exactly in
        float32 with elementwise ops, so a low-precision matmul (e.g. under bf16 autocast, or an FP16/INT8
        export) cannot flip near-ties between codes."""
        with torch.no_grad():
            e = self.codebook.weight
            d = torch.addmm((e * e).sum(1).to(z.dtype)[None], z, e.t().to(z.dtype), alpha=-2.0)
            k = min(self.refine, self.size)
            if k <= 1:
                return d.argmin(1)
            cand = d.topk(k, dim=1, largest=False).indices  # (N, k)
            exact = (z.float()[:, None, :] - e.float()[cand]).pow(2).sum(-1)  # (N, k)
            return cand.gather(1, exact.argmin(1, keepdim=True)).squeeze(1)

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """z (N, D, h, w) -> (z_q (N, D, h, w) straight-through, codes (N, h, w), vq loss, usage stats)."""
        n, d, h, w = z.shape
        zf = z.permute(0, 2, 3, 1).reshape(-1, d)
        idx = self.nearest(zf)
        zq = self.codebook(idx)
        vq = F.mse_loss(zq, zf.detach()) + self.commitment * F.mse_loss(zf, zq.detach())
        zq = zf + (zq - zf).detach()  # straight-through estimator
        counts = torch.zeros(self.size, device=z.device, dtype=torch.float32).index_add_(
            0, idx, torch.ones_like(idx, dtype=torch.float32)
        )
        if self.training:
            with torch.no_grad():
                self.code_age.add_(1).masked_fill_(counts > 0, 0)
            self._recent_z = zf.detach()
        p = counts / idx.numel()
        stats = {
            "perplexity": torch.exp(-(p * torch.log(p.clamp_min(1e-10))).sum()).detach(),
            "code_usage": (counts > 0).float().mean().detach(),
        }
        zq = zq.reshape(n, h, w, d).permute(0, 3, 1, 2)
        return zq, idx.reshape(n, h, w), vq, stats

    def lookup(self, codes: Tensor) -> Tensor:
        """codes (N, h, w) long -> (N, D, h, w)."""
        return self.codebook(codes).permute(0, 3, 1, 2)

    @torch.no_grad()
    def reset_dead_codes(self, candidates: Tensor | None = None, skip: Tensor | None = None) -> Tensor | int:
        """Re-initialise codes whose age reached `dead_code_steps` from rows of `candidates` (M, D) (default:
        the last training forward's encoder outputs), drawn without replacement where possible with the
        torch RNG. Returns how many codes were reset (a 0-d tensor; 0 when off or no forward yet).
        `skip` (a 0-d bool, on any device): when true nothing changes (the training loop's skipped
        step, whose encoder outputs may be non-finite); the RNG draw happens either way.

        Sync-free: it runs after every optimizer step, and a host sync there (`nonzero`, `.item()`)
        would leave the GPU idle while the next step is launched. So every step draws one permutation and overwrites the dead rows
        with `torch.where`, whether or not any code is dead."""
        if self.dead_code_steps <= 0:
            return 0
        cand = self._recent_z if candidates is None else candidates
        if cand is None or cand.numel() == 0:
            return 0
        cand = cand.reshape(-1, self.codebook.embedding_dim)
        k, m = self.size, cand.shape[0]
        if m >= k:
            pick = torch.randperm(m, device=cand.device)[:k]
        else:
            pick = torch.randint(0, m, (k,), device=cand.device)
        w = self.codebook.weight
        dead = self.code_age >= self.dead_code_steps  # (K,)
        if skip is not None:
            dead = dead & ~skip.to(dead.device)
        w.copy_(torch.where(dead.to(w.device)[:, None], cand[pick].to(w.device, w.dtype), w))
        self.code_age.masked_fill_(dead, 0)
        return dead.sum()


# ------------------------------------------------------------------------------------------ class embedding


class _ClassEmbed(torch.autograd.Function):
    """The class embedding's rows for every voxel, w[occ] in `dtype`, keeping only the uint8 labels
    for the backward pass. torch's embedding backward on CUDA sorts all N*X*Y*Z indices first (20 M
    per 32 frames at 200x200x16); here the weight's gradient is the sum of the output gradients per
    class: on CUDA wm.models.kernels.embedding_grad (one-hot tiles in registers, without the (P, C) matrix
    the one-hot matmul in torch writes first; timings in BENCHMARKS.md, Kernels), elsewhere an
    index_add_ in float32. `fused`: the model's flag for that kernel."""

    @staticmethod
    def forward(ctx, occ: Tensor, w: Tensor, dtype: torch.dtype, fused: bool) -> Tensor:
        ctx.save_for_backward(occ)
        ctx.classes, ctx.wdtype, ctx.fused = w.shape[0], w.dtype, fused
        return F.embedding(occ.long(), w.to(dtype))

    @staticmethod
    def backward(ctx, dh: Tensor):
        (occ,) = ctx.saved_tensors
        dh = dh.reshape(occ.numel(), -1)
        if kernels.use(kernels.embedding_grad, ctx.fused, dh):
            dw = kernels.embedding_grad.embedding_grad(occ.reshape(-1), dh, ctx.classes)
        else:
            dw = dh.new_zeros((ctx.classes, dh.shape[1]), dtype=torch.float32).index_add_(
                0, occ.reshape(-1).long(), dh.float())
        return None, dw.to(ctx.wdtype), None, None


# ------------------------------------------------------------------------------------------ model


class Tokenizer(nn.Module):
    """VQ-VAE over occupancy frames.

    Tokenizer(cfg, num_classes, grid) with grid = (X, Y, Z), X and Y divisible by d = cfg.downsample
    (2**(levels-1); OccWorld's 4). How it runs (the config's kernels and activation_checkpoint
    sections): fused_head, fused_lovasz, fused_embedding_grad run wm.models.kernels.tokenizer_head,
    lovasz_histogram and embedding_grad where they can (wm/models/kernels/__init__.py); lovasz_impl ranks the
    Lovasz loss's errors (wm.models.lovasz); checkpoint_every > 0 recomputes the activations of every k-th
    block in the backward pass.

    - encode(occ (..., X, Y, Z) uint8/long) -> codes (..., X/d, Y/d) long
    - decode(codes (..., X/d, Y/d)) -> logits (..., C, X, Y, Z) float
    - forward(occ) -> dict (see `forward`)
    - loss(logits, occ, vq) -> dict(loss, ce, lovasz, vq)
    - reset_dead_codes(candidates=None) -> int, to call after optimizer.step()
    - codebook -> (K, code_dim) weight, e.g. for WorldModel.init_code_embedding
    """

    def __init__(self, cfg: TokenizerConfig, num_classes: int, grid: tuple[int, int, int],
                 fused_head: bool = True, fused_lovasz: bool = True, fused_embedding_grad: bool = True,
                 lovasz_impl: str = "sort", checkpoint_every: int = 0):
        super().__init__()
        cfg.validate()
        grid = tuple(int(g) for g in grid)
        if len(grid) != 3 or min(grid) < 1:
            raise DataError(f"tokenizer: grid must be (X, Y, Z) of positive sizes, got {grid}")
        d = cfg.downsample
        if grid[0] % d or grid[1] % d:
            raise DataError(f"tokenizer: grid {grid}: X and Y must be divisible by {d} ({len(cfg.widths) - 1} "
                            "stride-2 downsamples, tokenizer.widths)")
        if num_classes < 2:
            raise DataError(f"tokenizer: num_classes must be >= 2, got {num_classes}")
        self.cfg, self.num_classes, self.grid = cfg, num_classes, grid
        self.fused_head, self.fused_lovasz, self.fused_embedding_grad = fused_head, fused_lovasz, fused_embedding_grad
        self.lovasz_impl, self.checkpoint_every = lovasz_impl, checkpoint_every
        e, w0, w2 = cfg.embed_dim, cfg.widths[0], cfg.widths[-1]
        low = len(cfg.widths) - 1  # the lowest-resolution level
        cin = grid[2] * e
        nb = cfg.blocks_per_level

        self.class_embed = nn.Embedding(num_classes, e)

        # encoder
        self.enc_in = nn.Conv2d(cin, w0, 3, 1, 1)
        enc: list[nn.Module] = []
        c = w0
        for level, w in enumerate(cfg.widths):
            for _ in range(nb):
                enc.append(ResBlock(c, w))
                c = w
                if level == low and cfg.lowest_attention:
                    enc.append(AttnBlock(c, cfg.attn_heads))
            if level < low:
                enc.append(Downsample(c))
        enc += [ResBlock(c, c), *([AttnBlock(c, cfg.attn_heads)] if cfg.mid_attention else []), ResBlock(c, c)]
        self.encoder = nn.ModuleList(enc)
        self.enc_norm = norm(w2)
        self.enc_out = nn.Conv2d(w2, cfg.code_dim, 3, 1, 1)

        self.quantizer = VectorQuantizer(cfg.codebook_size, cfg.code_dim, cfg.commitment, cfg.dead_code_steps)

        # decoder (mirror)
        self.dec_in = nn.Conv2d(cfg.code_dim, w2, 3, 1, 1)
        dec: list[nn.Module] = [ResBlock(w2, w2), *([AttnBlock(w2, cfg.attn_heads)] if cfg.mid_attention else []),
                                ResBlock(w2, w2)]
        c = w2
        for level in reversed(range(len(cfg.widths))):
            w = cfg.widths[level]
            for _ in range(nb):
                dec.append(ResBlock(c, w))
                c = w
                if level == low and cfg.lowest_attention:
                    dec.append(AttnBlock(c, cfg.attn_heads))
            if level > 0:
                dec.append(Upsample(c))
        self.decoder = nn.ModuleList(dec)
        self.dec_norm = norm(w0)
        self.dec_out = nn.Conv2d(w0, cin, 3, 1, 1)
        # per-class CE weights (set_class_frequencies); not saved: they follow from the data and config
        self.register_buffer("class_weights", torch.ones(num_classes), persistent=False)
        # the decoder's conv weights NHWC, as its convolutions run from the quantizer's channels-last z_q
        # (.to(device) and load_state_dict keep it): each weight's gradient comes with the weight's strides
        # (no copy, and DDP's bucket views match)
        for part in [self.dec_in, self.decoder]:
            part.to(memory_format=torch.channels_last)

    # -- helpers
    @property
    def codebook(self) -> Tensor:
        return self.quantizer.codebook.weight

    @property
    def downsample(self) -> int:
        """Voxel columns per token along X and along Y (cfg.downsample)."""
        return self.cfg.downsample

    @property
    def token_shape(self) -> tuple[int, int]:
        return self.grid[0] // self.downsample, self.grid[1] // self.downsample

    def _ckpt_active(self) -> bool:
        return self.checkpoint_every > 0 and self.training and torch.is_grad_enabled()

    def _check_occ(self, occ: Tensor) -> None:
        if occ.dim() < 4 or tuple(occ.shape[-3:]) != self.grid:
            want = ", ".join(map(str, self.grid))
            raise ValueError(f"tokenizer: occupancy must be (..., {want}), got {tuple(occ.shape)}")

    def _encode_z(self, occ: Tensor) -> Tensor:
        """occ (N, X, Y, Z) -> continuous z (N, code_dim, X/d, Y/d)."""
        n, x, y, zz = occ.shape
        w = self.class_embed.weight
        if torch.is_grad_enabled() and w.requires_grad:
            dev = occ.device.type
            auto = dev in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(dev)
            dtype = torch.get_autocast_dtype(dev) if auto else w.dtype
            h = _ClassEmbed.apply(occ, w, dtype, self.fused_embedding_grad)  # (N, X, Y, Z, E)
            h = h.reshape(n, x, y, zz * self.cfg.embed_dim).permute(0, 3, 1, 2)  # channels-last memory
        else:
            # the layout exported graphs have always had (Gather on the (N, Z, X, Y) labels): the
            # exported programs' calibration is tested against onnxruntime's on it (tests/export/test_int8.py)
            h = self.class_embed(occ.long().permute(0, 3, 1, 2))  # (N, Z, X, Y, E)
            h = h.permute(0, 1, 4, 2, 3).reshape(n, zz * self.cfg.embed_dim, x, y)
        # (N, Z*E, X, Y), channel z*E + e
        h = h.contiguous()
        h = self.enc_in(h)
        h, _ = _run_blocks(self.encoder, h, self.checkpoint_every, self._ckpt_active())
        return self.enc_out(F.silu(self.enc_norm(h)))

    def _decode_h(self, zq: Tensor) -> Tensor:
        """zq (N, code_dim, h, w) -> the decoder's output (N, Z*E, X, Y), channel z*E + e."""
        h = self.dec_in(zq)
        start = self._n_enc_blocks()
        h, _ = _run_blocks(self.decoder, h, self.checkpoint_every, self._ckpt_active(), start)
        return self.dec_out(F.silu(self.dec_norm(h)))

    def _head(self, h: Tensor) -> Tensor:
        """Decoder output (N, Z*E, X, Y) -> logits (N, C, X, Y, Z): the transposed class embedding."""
        n, _, x, y = h.shape
        h = h.reshape(n, self.grid[2], self.cfg.embed_dim, x, y)
        return torch.einsum("nzexy,ce->ncxyz", h, self.class_embed.weight)

    def _fused(self, h: Tensor) -> bool:
        """Whether forward scores `h` with wm.models.kernels.tokenizer_head (the fused_head flag): its Lovasz
        term is the histogram one."""
        return (self.lovasz_impl == "histogram" or self.cfg.lovasz_weight == 0) \
            and kernels.use(kernels.tokenizer_head, self.fused_head, h)

    def set_class_frequencies(self, counts) -> Tensor:
        """Set the CE class weights from per-class voxel counts of the training data (see
        TokenizerConfig.class_weight_power); classes never seen get the cap. Returns the weights."""
        cfg = self.cfg
        f = torch.as_tensor(counts, dtype=torch.float64)
        if f.shape != (self.num_classes,):
            raise DataError(f"tokenizer: class counts must have {self.num_classes} entries, got {tuple(f.shape)}")
        f = f / f.sum().clamp_min(1)
        w = torch.where(f > 0, f.clamp_min(1e-12) ** -cfg.class_weight_power, torch.full_like(f, math.inf))
        w = (w / w.min()).clamp_max(cfg.class_weight_max)
        self.class_weights.copy_(w.to(self.class_weights))
        return self.class_weights

    def _n_enc_blocks(self) -> int:
        return sum(isinstance(b, (ResBlock, AttnBlock)) for b in self.encoder)

    # -- public API
    def encode(self, occ: Tensor) -> Tensor:
        """occ (..., X, Y, Z) uint8/long class ids -> codes (..., X/d, Y/d) long."""
        self._check_occ(occ)
        lead = occ.shape[:-3]
        z = self._encode_z(occ.reshape(-1, *self.grid))
        n, d, h, w = z.shape
        idx = self.quantizer.nearest(z.permute(0, 2, 3, 1).reshape(-1, d))
        return idx.reshape(*lead, h, w)

    def decode(self, codes: Tensor) -> Tensor:
        """codes (..., X/d, Y/d) integer -> logits (..., C, X, Y, Z)."""
        lead = codes.shape[:-2]
        c = codes.long().reshape(-1, *codes.shape[-2:])
        logits = self._head(self._decode_h(self.quantizer.lookup(c)))
        return logits.reshape(*lead, *logits.shape[1:])

    def forward(self, occ: Tensor, mask: Tensor | None = None, logits: bool = True) -> dict[str, Tensor]:
        """Reconstruct `occ` (..., X, Y, Z) and score it (on the voxels where `mask`, shaped like
        occ, is nonzero, when given; see `loss`). Returns:

        - logits      (..., C, X, Y, Z) float; only with `logits` (training needs none: on CUDA the
                      fused head then never materialises them)
        - codes       (..., X/d, Y/d) long
        - loss        scalar, ce_weight*ce + lovasz_weight*lovasz + vq_weight*vq (what to backward)
        - ce, lovasz, vq   the unweighted loss terms (scalars, with grad)
        - perplexity  exp(entropy) of the batch's code histogram (detached; K when all codes equally used)
        - code_usage  fraction of the K codes used in this batch (detached)
        - dead_codes  number of codes unused for >= dead_code_steps training forwards (detached, float)
        """
        self._check_occ(occ)
        lead = occ.shape[:-3]
        flat = occ.reshape(-1, *self.grid)
        z = self._encode_z(flat)
        zq, codes, vq, stats = self.quantizer(z)
        h = self._decode_h(zq)
        mask = None if mask is None else mask.reshape(flat.shape)
        lg = None
        if self._fused(h):
            out = self._fused_loss(h, flat, vq, mask)
        else:
            lg = self._head(h)
            out = self.loss(lg, flat, vq, mask=mask)
        out.update(stats)
        steps = self.quantizer.dead_code_steps
        out["dead_codes"] = (self.quantizer.code_age >= steps).sum().float() if steps > 0 else vq.new_zeros(())
        if logits:
            lg = self._head(h) if lg is None else lg
            out["logits"] = lg.reshape(*lead, *lg.shape[1:])
        out["codes"] = codes.reshape(*lead, *codes.shape[1:])
        return out

    def loss(self, logits: Tensor, occ: Tensor, vq: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
        """logits (N, C, X, Y, Z), occ (N, X, Y, Z) integer, vq scalar -> dict(loss, ce, lovasz, vq).
        With `mask` (shaped like occ; data.use_mask), CE and Lovasz cover only the voxels where it is
        nonzero: a masked-out voxel's label changes neither the loss nor its gradient. Without it
        (the default, OccWorld's protocol) every voxel counts."""
        cfg = self.cfg
        logits = logits.reshape(-1, *logits.shape[-4:])
        target = occ.long().reshape(-1, *occ.shape[-3:])
        weight = self.class_weights.to(logits.dtype) if cfg.class_weight_power > 0 else None
        if mask is not None:
            ce = masked_cross_entropy(logits, target, mask.reshape(target.shape), weight)
        elif weight is not None:
            # sum of weighted terms over the number of voxels (not over the sum of weights): the
            # normaliser does not depend on what a batch holds, so every rank's loss averages to the
            # whole batch's, as with plain CE
            ce = F.cross_entropy(logits, target, weight=weight, reduction="sum") / target.numel()
        else:
            ce = F.cross_entropy(logits, target)
        if cfg.lovasz_weight > 0:
            probs = logits.float().softmax(1).movedim(1, -1).reshape(-1, self.num_classes)
            labels = target.reshape(-1)
            if mask is not None:  # the visible points only (Lovasz ranks errors over whatever it is given)
                keep = mask.reshape(-1) != 0
                probs, labels = probs[keep], labels[keep]
            kernel = None
            if self.lovasz_impl == "histogram" and kernels.use(kernels.lovasz_histogram, self.fused_lovasz, probs):
                kernel = kernels.lovasz_histogram.histogram_terms
            lov = lovasz_softmax(probs, labels, impl=self.lovasz_impl, kernel=kernel) if labels.numel() else probs.sum() * 0.0
        else:
            lov = ce.new_zeros(())
        total = cfg.ce_weight * ce + cfg.lovasz_weight * lov + cfg.vq_weight * vq
        return {"loss": total, "ce": ce, "lovasz": lov, "vq": vq}

    def _fused_loss(self, h: Tensor, occ: Tensor, vq: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """`loss` from the decoder output h (N, Z*E, X, Y) through wm.models.kernels.tokenizer_head: the same
        terms (tests/models/test_kernel_tokenizer_head.py), without the logits."""
        cfg = self.cfg
        labels = occ.to(torch.int16)
        if mask is not None:  # a masked-out voxel counts in neither loss (label -1)
            labels = torch.where(mask != 0, labels, -1)
        weight = self.class_weights if cfg.class_weight_power > 0 else torch.ones_like(self.class_weights)
        # (N, Z*E, X, Y) -> (N, X, Y, Z, E) -> (P, E): voxels in occ's order (a view if h is channels-last)
        h = h.permute(0, 2, 3, 1).reshape(-1, cfg.embed_dim)
        ce, lov = kernels.tokenizer_head.head_losses(h, self.class_embed.weight, labels.reshape(-1), weight,
                                                     cfg.lovasz_weight > 0, True, HIST_BITS)
        total = cfg.ce_weight * ce + cfg.lovasz_weight * lov + cfg.vq_weight * vq
        return {"loss": total, "ce": ce, "lovasz": lov, "vq": vq}

    def reset_dead_codes(self, candidates: Tensor | None = None, skip: Tensor | None = None) -> int:
        """See VectorQuantizer.reset_dead_codes; call after optimizer.step()."""
        return self.quantizer.reset_dead_codes(candidates, skip)

    def token_mask(self, mask: Tensor) -> Tensor:
        """Voxel mask (..., X, Y, Z) -> (..., X/d, Y/d) bool: the token cells whose column holds
        at least one visible (nonzero) voxel, the cells a masked world-model loss counts."""
        d, (x, y, z) = self.downsample, self.grid
        m = (mask != 0).reshape(*mask.shape[:-3], x // d, d, y // d, d, z)
        return m.any(-1).any(-1).any(-2)  # over z, then the cell's y, then its x
