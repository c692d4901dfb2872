"""wm.models.kernels.tokenizer_head (the tokenizer's head, cross-entropy and histogram Lovasz fused in two Triton
kernels) against the torch path (Tokenizer._head, then Tokenizer.loss): the same loss terms and the same
gradients to the decoder output and the class embedding, float32, with and without a mask, class weights and
the Lovasz term; torch.library's opcheck of the custom ops, and that the model with them traces as one
graph (no graph break). On CUDA with Triton the kernels run compiled;
with Triton but no GPU in Triton's interpreter (a subprocess with TRITON_INTERPRET=1); without Triton there
is nothing to test."""

import pytest
import torch
from helpers import run_kernel_check

pytest.importorskip("triton")

CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}]
from wm.config.models import TokenizerConfig
from wm.models.tokenizer import Tokenizer
dev = {dev!r}
grid, classes = (8, 16, 3), 6
for weighted, masked, lovasz in ((False, False, 1.0), (True, False, 1.0), (False, True, 1.0), (True, True, 0.0)):
    torch.manual_seed(int(weighted) + 2 * int(masked))
    cfg = TokenizerConfig(widths=(8,), lovasz_weight=lovasz, ce_weight=3.0,
                          class_weight_power=0.5 if weighted else 0.0)
    tok = Tokenizer(cfg, classes, grid, lovasz_impl="histogram").to(dev)
    if weighted:
        tok.set_class_frequencies(torch.tensor([500.0, 120, 30, 0, 7, 1]))
    occ = torch.randint(0, classes, (2, *grid), device=dev)
    occ[occ == 3] = 0  # a class absent from the labels: not in the Lovasz mean
    mask = (torch.rand(2, *grid, device=dev) > 0.3) if masked else None
    h = (2 * torch.randn(2, grid[2] * cfg.embed_dim, grid[0], grid[1], device=dev)).requires_grad_()
    vq = torch.zeros((), device=dev)
    got, want = {{}}, {{}}
    for out, terms in ((want, lambda: tok.loss(tok._head(h), occ, vq, mask=mask)),
                       (got, lambda: tok._fused_loss(h, occ, vq, mask))):
        h.grad = tok.class_embed.weight.grad = None
        t = terms()
        t["loss"].backward()
        out.update(ce=t["ce"].item(), lovasz=t["lovasz"].item(), dh=h.grad.clone(),
                   dw=tok.class_embed.weight.grad.clone())
    case = (weighted, masked, lovasz)
    # the fused Lovasz puts each error at its bin's centre: within 2**-11 of the exact sum (the module's bound)
    for k, tol in (("ce", 1e-5), ("lovasz", 2.0 ** -11)):
        assert abs(got[k] - want[k]) <= tol * abs(want[k]) + 1e-7, (case, k, got[k], want[k])
    assert want["lovasz"] > 0 or lovasz == 0, case
    for k in ("dh", "dw"):
        err = float((got[k] - want[k]).abs().max() / want[k].abs().max())
        assert err < 1e-5, (case, k, err)

# custom ops (schema, fake tensors, autograd registration) ...
from wm.models.kernels.tokenizer_head import _head_losses
p = 2 * 8 * 16 * 3
torch.library.opcheck(_head_losses, (torch.randn(p, 8, device=dev, requires_grad=True),
                                     torch.randn(classes, 8, device=dev, requires_grad=True),
                                     torch.randint(-1, classes, (p,), device=dev, dtype=torch.int16),
                                     torch.rand(classes, device=dev), True, True, 10),
                      test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
torch.library.opcheck(_head_losses, (torch.randn(8, p, device=dev).t().requires_grad_(),  # (P, E), not contiguous
                                     torch.randn(classes, 8, device=dev, requires_grad=True),
                                     torch.randint(-1, classes, (p,), device=dev, dtype=torch.int16),
                                     torch.rand(classes, device=dev), True, True, 10),
                      test_utils=("test_faketensor", "test_autograd_registration"))
# ... so the model and its fused loss trace as one graph (a graph break there cost layout copies)
if dev == "cpu":  # the interpreter runs the kernels on CPU tensors: let the model hand them over
    Tokenizer._fused = lambda self, h: True
tok = Tokenizer(TokenizerConfig(widths=(8,)), classes, grid, lovasz_impl="histogram").to(dev)
explained = torch._dynamo.explain(tok)(torch.randint(0, classes, (2, *grid), device=dev), logits=False)
assert explained.graph_break_count == 0, explained.break_reasons
print("OK")
"""


@pytest.mark.cuda
def test_fused_head_matches_the_torch_path_on_cuda():
    run_kernel_check(CHECK, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels are tested")
def test_fused_head_matches_the_torch_path_in_the_interpreter():
    run_kernel_check(CHECK, "cpu")
