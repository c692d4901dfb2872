"""A torch.compile'd step's activations (wm/training/compiled_activations.py): a toy's peak against a
hand count of what Inductor's partitioner saves and its in-place kernels reuse, and the memory plan
of a stage that compiles (checkpointing and value-dependent sizes included)."""

import pytest
import torch
from torch import nn

from helpers import TINY_SETTINGS
from wm.config.loading import load
from wm.training import activations as A, memory_plan as M
from wm.training.compiled_activations import CountingFakeMode, compiled_peak

CPU = torch.device("cpu")


class Sines(nn.Module):
    """A matmul, then a chain of pointwise ops down to a scalar loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 256)

    def forward(self, x):
        return {"loss": self.lin(x).sin().sin().sin().sin().sum()}


def _peaks(batch: int) -> tuple[int, int]:
    """(compiled, eager) peak bytes of one Sines step at `batch` rows, beyond weights, grads and input."""
    with torch.device("meta"):
        meta = Sines()
    mode = CountingFakeMode(lambda *a: None)
    with mode:
        model = A._fake(meta, CPU)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        x = torch.zeros(batch, 64)
        held = [*model.parameters(), *(p.grad for p in model.parameters()), x]
        compiled = compiled_peak(model, lambda f, b: f(b["x"]), {"x": x}, held, mode, CPU, None)
        with A.PeakBytes(held) as eager:
            model(x)["loss"].backward()
    return compiled, eager.peak


def test_a_compiled_chain_keeps_one_tensor_and_its_gradient_is_written_in_place():
    compiled, eager = _peaks(32)
    h, dw, db, scalars = 32 * 256 * 4, 256 * 64 * 4, 256 * 4, 2 * 4
    # the partitioner saves the matmul's output h alone and recomputes the sines from it; the backward's
    # one Triton kernel writes dh into h's buffer (h dies there), then the weight's and bias's gradients
    # come beside it; the loss and its gradient are a scalar each
    assert compiled == h + dw + db + scalars
    # eager mode saves every sine's input (h and three more of its size)
    assert eager >= 4 * h + dw
    # and only the saved tensor grows with the batch
    assert _peaks(64)[0] - compiled == h


def test_a_compiling_stage_is_planned_compiled_and_below_eager_mode():
    # the masked Lovasz's selection and the histogram's bincount break the graph: they run between
    # graphs, at their largest, as in eager mode
    cfg = load(None, [f"{k}={v}" for k, v in TINY_SETTINGS.items()] +
               ["data.grid=16,16,4", "data.use_mask=true", "kernels.lovasz_impl=histogram", "tokenizer.lovasz_weight=1"])
    eager = M.stage_plan(cfg, "tokenizer", 1, CPU, None)
    cfg.compile.enable = True
    p = M.plan(cfg, 1, CPU, None, todo=("tokenizer",))
    s = p.stages["tokenizer"]
    assert s.error == "" and s.compiled and not eager.compiled
    assert 0 < s.activations < eager.activations
    # activation checkpointing traced through Dynamo's checkpoint operator still saves less
    assert s.alt_every == 1 and 0 < s.alt_activations < s.activations
    assert "torch.compile'd" in M.stage_line(p, "tokenizer")
    # a compiled figure is kept apart from the eager one of the same config
    key = A._step_key(cfg, "tokenizer", s.micro, CPU, None, None, True)
    assert key != A._step_key(cfg, "tokenizer", s.micro, CPU, None, None, False)


def test_a_step_dynamo_cannot_trace_says_so():
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    mode = CountingFakeMode(lambda *a: None)
    with mode, pytest.raises(RuntimeError, match="traced no graph"):
        model = A._fake(meta, CPU)
        compiled_peak(model, lambda f, b: {"loss": b["x"].sum()}, {"x": torch.zeros(2, 2, requires_grad=True)}, [], mode, CPU, None)
