"""wm.models.kernels.temporal_attention (the world model's causal attention over time, one Triton kernel each way)
against the torch path (wm.models.world.short_causal_attention on the permuted q, k, v): the same outputs and
the same gradient of the q/k/v projection, float32, for head dims 16 and 32, 1 to 16 frames and cell counts
that do not fill the last program; the whole TemporalLayer with and without it; torch.library's opcheck
of the custom ops (fake tensors, autograd registration).
On CUDA with Triton the kernels run compiled; with Triton but no GPU in Triton's interpreter (a
subprocess with TRITON_INTERPRET=1); without Triton there is nothing to test."""

import pytest
import torch
from helpers import run_kernel_check

pytest.importorskip("triton")

CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}]
from wm.models import world
from wm.models.kernels import temporal_attention as tac
from wm.models.kernels.temporal_attention import causal_time_attention, _attention
dev = {dev!r}
torch.manual_seed(0)
# (windows, frames, cells a frame, heads, head dim): one cell a frame (frames adjacent in memory), many
# (frames h*w rows apart, the model's layout), cell counts that do not fill the last program (33)
for b, t, s, heads, d in ((5, 11, 1, 2, 16), (1, 11, 6, 2, 16), (3, 1, 2, 1, 16), (2, 16, 4, 2, 32), (3, 5, 11, 1, 16)):
    c = heads * d
    qkv = (2 * torch.randn(b, t, s, 3 * c, device=dev)).requires_grad_()
    do = torch.randn(b, t, s, c, device=dev)
    o = causal_time_attention(qkv, heads)
    (o * do).sum().backward()
    g, qkv.grad = qkv.grad, None
    q, k, v = qkv.reshape(b, t, s, 3, heads, d).permute(3, 0, 2, 4, 1, 5)  # (B, S, heads, T, d)
    ref = world.short_causal_attention(q, k, v).permute(0, 3, 1, 2, 4).reshape(b, t, s, c)
    (ref * do).sum().backward()
    case = (b, t, s, heads, d)
    assert float((o - ref).detach().abs().max()) < 1e-5 * float(ref.detach().abs().max()), case
    assert float((g - qkv.grad).abs().max()) < 1e-5 * float(qkv.grad.abs().max()), case
    assert float(qkv.grad.abs().max()) > 0, case
# and against attention written out per cell: frame t of cell (b, s) sees frames 0..t of that cell only
b, t, s, heads, d = 2, 4, 3, 1, 16
qkv = torch.randn(b, t, s, 3 * d, device=dev)
o = causal_time_attention(qkv, heads)
for bi in range(b):
    for si in range(s):
        q, k, v = qkv[bi, :, si].split(d, -1)
        for ti in range(t):
            w = torch.softmax(q[ti] @ k[: ti + 1].T / d ** 0.5, -1)
            assert torch.allclose(o[bi, ti, si], w @ v[: ti + 1], atol=1e-5), (bi, ti, si)

# the whole temporal layer, kernel vs torch path (the same weights), and that fused=True took the kernel
if dev == "cpu":  # the interpreter runs the kernels on CPU tensors: let the layer hand them over
    tac.supports = lambda qkv, heads: True
calls = []
kernel = tac.causal_time_attention
tac.causal_time_attention = lambda qkv, heads: calls.append(heads) or kernel(qkv, heads)
layer = world.TemporalLayer(32, 2, 2, fused=True).to(dev)
x = torch.randn(2, 11, 3, 32, device=dev, requires_grad=True)
outs = []
for fused in (True, False):
    layer.fused = fused
    y = layer(x)
    (y.square().sum()).backward()
    outs.append((y.detach(), x.grad.clone(), layer.qkv.weight.grad.clone()))
    x.grad = None
    layer.zero_grad()
assert calls == [2], calls
for a, b in zip(*outs):
    assert float((a - b).abs().max()) < 1e-5 * float(b.abs().max()), float((a - b).abs().max())
tac.causal_time_attention = kernel

torch.library.opcheck(_attention, (torch.randn(3, 4, 2, 96, device=dev, requires_grad=True), 2),
                      test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
# inputs in another layout (as Inductor may lay them out): the fakes still say what the kernels write
from wm.models.kernels.temporal_attention import _attention_backward
odd = torch.randn(96, 3, 4, 2, device=dev).permute(1, 2, 3, 0)  # (3, 4, 2, 96), dense, not contiguous
torch.library.opcheck(_attention, (odd.clone().requires_grad_(), 2), test_utils=("test_faketensor",))
torch.library.opcheck(_attention_backward, (odd, torch.randn(3, 4, 2, 32, device=dev), torch.randn(3, 4, 2, 2, device=dev),
                                            torch.randn(96, 3, 4, 2, device=dev)[:32].permute(1, 2, 3, 0), 2),
                      test_utils=("test_faketensor",))
print("OK")
"""


COMPILED = r"""
import sys, torch
sys.path[:0] = [{root!r}]
from wm.models import world
from wm.models.kernels import temporal_attention as tac
launches = []
for name in ("_time_attention_forward", "_time_attention_backward"):
    k = getattr(tac, name)
    counted = {{"__getitem__": lambda self, g, k=k, n=name: launches.append(n) or k[g]}}
    setattr(tac, name, type("Counted", (), counted)())
model = world.WorldModel(world.WorldConfig(widths=(32, 64), heads=2, temporal_layers=1, pose_layers=1), 16).cuda()
codes = torch.randint(0, 16, (2, 6, 8, 8), device="cuda")
motion = torch.randn(2, 6, 3, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = torch.compile(model)(codes, motion)
model.loss(out, codes, motion)["loss"].backward()
# one temporal layer on each of the two levels, each way: the compiled graph calls the kernels
assert sorted(launches) == ["_time_attention_backward"] * 2 + ["_time_attention_forward"] * 2, launches
print("OK")
"""


@pytest.mark.cuda
def test_fused_temporal_attention_matches_the_torch_path_on_cuda():
    run_kernel_check(CHECK, "cuda")


@pytest.mark.cuda
def test_compiled_world_model_launches_the_kernels():
    run_kernel_check(COMPILED, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels are tested")
def test_fused_temporal_attention_matches_the_torch_path_in_the_interpreter():
    run_kernel_check(CHECK, "cpu")
