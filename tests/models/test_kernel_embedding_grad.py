"""wm.models.kernels.embedding_grad (an embedding's weight gradient as one Triton kernel) by hand: float32 and
bfloat16, ids outside [0, rows) ignored, a table of one block (the class embedding's size) and one of
several row and column blocks; torch.library's opcheck of the custom op. On CUDA with Triton the kernel
runs compiled; with Triton but no GPU in Triton's interpreter (a subprocess with TRITON_INTERPRET=1);
without Triton there is nothing to test."""

import pytest
import torch
from helpers import run_kernel_check

pytest.importorskip("triton")

CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}]
from wm.models.kernels.embedding_grad import embedding_grad
dev = {dev!r}
torch.manual_seed(0)
for rows, e in ((6, 8), (150, 80)):
    ids = torch.randint(-1, rows + 1, (3001,), device=dev, dtype=torch.int16)  # not a multiple of a tile
    for dtype in (torch.float32, torch.bfloat16):
        d = torch.randn(3001, e, device=dev).to(dtype)
        dw = embedding_grad(ids, d, rows)
        assert dw.dtype == torch.float32 and dw.shape == (rows, e)
        want = torch.zeros(rows, e, dtype=torch.float64, device=dev)
        for r in range(rows):
            want[r] = d[ids == r].double().sum(0)
        err = float((dw.double() - want).abs().max())
        assert err < 1e-4, (rows, dtype, err)
torch.library.opcheck(embedding_grad, (ids, torch.randn(3001, 80, device=dev), 150))
print("OK")
"""


@pytest.mark.cuda
def test_embedding_grad_matches_the_sum_by_hand_on_cuda():
    run_kernel_check(CHECK, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels are tested")
def test_embedding_grad_matches_the_sum_by_hand_in_the_interpreter():
    run_kernel_check(CHECK, "cpu")
