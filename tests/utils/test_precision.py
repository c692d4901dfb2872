"""wm.utils.precision: the inference copy with its matmul weights cast once gives autocast's outputs."""

import torch
from torch import nn

from wm.utils.precision import autocast, cast_for_inference


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.lin = nn.Linear(8, 6)

    def forward(self, idx):
        h = self.embed(idx).permute(0, 3, 1, 2)
        h = self.norm(self.conv(h)).permute(0, 2, 3, 1)
        return self.lin(h)


def test_cast_once_equals_autocast_and_leaves_the_original_alone():
    torch.manual_seed(0)
    net = Net().eval().requires_grad_(False)
    idx = torch.randint(0, 5, (2, 6, 6))
    dev = torch.device("cpu")
    with torch.no_grad(), autocast(dev, torch.bfloat16):
        want = net(idx)
    cast = cast_for_inference(net, torch.bfloat16)
    assert cast is not net and all(p.dtype == torch.float32 for p in net.parameters())
    assert {n: p.dtype for n, p in cast.named_parameters()} == {
        "embed.weight": torch.float32, "conv.weight": torch.bfloat16, "conv.bias": torch.bfloat16,
        "norm.weight": torch.float32, "norm.bias": torch.float32,
        "lin.weight": torch.bfloat16, "lin.bias": torch.bfloat16}
    with torch.no_grad(), autocast(dev, torch.bfloat16):
        got = cast(idx)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert cast_for_inference(net, None) is net  # fp32: nothing to cast
