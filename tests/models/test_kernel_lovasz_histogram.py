"""wm.models.kernels.lovasz_histogram (the histogram Lovasz as two Triton kernels) against the torch reference
(wm.models.lovasz._histogram_terms): same gradient, same loss up to summation order. On CUDA with Triton
the kernels run compiled; with Triton but no GPU they run in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1); without Triton (a CPU build of torch, as CI) there is nothing to test."""

import pytest
import torch
from helpers import run_kernel_check

triton = pytest.importorskip("triton")

CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_lovasz import random_problem
import wm.models.lovasz as L
from wm.models.kernels import lovasz_histogram
dev = {dev!r}
for points, classes, present in ((1000, 6, True), (1000, 6, False), (1500, 18, True)):
    logits, labels = random_problem(points, classes, seed=points + classes)
    probs = logits.float().softmax(1).to(dev)
    labels = labels.to(dev)
    ref_loss, ref_grad = L._histogram_terms(probs.cpu(), labels.cpu(), present)
    loss, grad = lovasz_histogram.histogram_terms(probs, labels, present, L.HIST_BITS)
    assert grad.shape == ref_grad.shape, (grad.shape, ref_grad.shape)
    assert torch.allclose(grad.cpu(), ref_grad, rtol=1e-6, atol=1e-12), float((grad.cpu() - ref_grad).abs().max())
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss), (float(loss), float(ref_loss))
print("OK")
"""


@pytest.mark.cuda
def test_kernels_match_the_reference_on_cuda():
    run_kernel_check(CHECK, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels are tested")
def test_kernels_match_the_reference_in_the_interpreter():
    run_kernel_check(CHECK, "cpu")


def test_the_tokenizer_uses_the_kernels_on_cuda_only(monkeypatch):
    """The tokenizer's histogram Lovasz on CPU tensors takes the torch path (no Triton call)."""
    from wm.models.kernels import lovasz_histogram
    from wm.models.tokenizer import Tokenizer
    from wm.config.models import TokenizerConfig

    def boom(*a, **k):
        raise AssertionError("the Triton path ran for a CPU tensor")

    monkeypatch.setattr(lovasz_histogram, "histogram_terms", boom)
    tok = Tokenizer(TokenizerConfig(widths=(8,), lovasz_impl="histogram"), 4, (8, 8, 2))
    occ = torch.randint(0, 4, (2, 8, 8, 2))
    assert tok(occ)["lovasz"] > 0
