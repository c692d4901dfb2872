"""wm.lovasz_cuda (the histogram Lovasz as two Triton kernels) against the torch reference
(wm.lovasz._histogram_terms): same gradient, same loss up to summation order. On CUDA with Triton
the kernels run compiled; with Triton but no GPU they run in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1); without Triton (a CPU build of torch, as CI) there is nothing to test."""

from pathlib import Path

import pytest
import torch
from conftest import run_in_triton_interpreter

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_lovasz import random_problem
import wm.lovasz as L
from wm import lovasz_cuda
dev = {dev!r}
for points, classes, present in ((1000, 6, True), (1000, 6, False), (1500, 18, True)):
    logits, labels = random_problem(points, classes, seed=points + classes)
    probs = logits.float().softmax(1).to(dev)
    labels = labels.to(dev)
    ref_loss, ref_grad = L._histogram_terms(probs.cpu(), labels.cpu(), present)
    loss, grad = lovasz_cuda.histogram_terms(probs, labels, present, L.HIST_BITS)
    assert grad.shape == ref_grad.shape, (grad.shape, ref_grad.shape)
    assert torch.allclose(grad.cpu(), ref_grad, rtol=1e-6, atol=1e-12), float((grad.cpu() - ref_grad).abs().max())
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss), (float(loss), float(ref_loss))
print("OK")
"""


def _script(dev: str) -> str:
    return CHECK.format(root=str(ROOT), tests=str(ROOT / "tests"), dev=dev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_the_reference_on_cuda():
    exec(_script("cuda"), {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels are tested")
def test_kernels_match_the_reference_in_the_interpreter():
    run_in_triton_interpreter(_script("cpu"))


def test_autograd_uses_the_kernels_on_cuda_only(monkeypatch):
    """lovasz_softmax(impl="histogram") on a CPU tensor takes the torch path (no Triton call)."""
    import wm.lovasz as L
    from wm import lovasz_cuda

    def boom(*a, **k):
        raise AssertionError("the Triton path ran for a CPU tensor")

    monkeypatch.setattr(lovasz_cuda, "histogram_terms", boom)
    probs = torch.rand(50, 4).softmax(1)
    L.lovasz_softmax(probs, torch.randint(0, 4, (50,)), impl="histogram")
