"""Activation memory of a torch.compile'd step, measured on fake tensors as wm.training.activations
measures eager mode's.

torch.compile keeps other tensors than eager mode: AOTAutograd splits the traced forward and
backward with Inductor's partitioner, which saves the few tensors the backward cannot cheaply
recompute, and Inductor fuses chains of pointwise ops into kernels that write no buffer between
them. So here Dynamo traces the stage's loss as training compiles it (graph breaks included), a
backend splits each graph with Inductor's own partitioner and decompositions, and runs the forward
and backward graphs op by op on fake tensors while a fake-tensor mode adds up the storages. Inductor's
fusion is approximated: an op's output takes memory where Inductor writes a buffer (a graph's outputs,
library kernels such as matmuls, convolutions and attention, the tensors those read); pointwise ops,
views and reductions are fused into whatever reads them, and the buffers a fused chain reads live
until the kernel that ends the chain; a Triton kernel writes into an input buffer of its output's
size that dies with it (Inductor's in-place reuse). What runs between graphs (a graph break) counts
in full.

Dynamo's caches are cleared before and after (torch._dynamo.reset): the measurement's compiles
neither meet a model compiled earlier in the process (which would count against Dynamo's recompile
limit) nor stay behind. Planning runs before anything is compiled, so nothing of the run's is lost.
"""

from __future__ import annotations

import operator
import sys

import torch
from torch import fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

from wm.training.storage_count import StorageCount
from wm.utils.precision import autocast

aten = torch.ops.aten
# ops Inductor lowers into the kernels that read them (besides those torch tags pointwise and views)
_FUSED = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var_mean, aten.prod, aten.max, aten.min, aten.argmax,
          aten.argmin, aten.any, aten.all, aten._to_copy, aten.clone, aten.copy, aten.index, aten.gather,
          aten.embedding, aten.cat, aten.constant_pad_nd, aten.where, aten.slice_scatter, aten.select_scatter,
          aten.full, aten.full_like, aten.zeros_like, aten.arange, aten.scalar_tensor, aten.empty}


def fused(node: fx.Node) -> bool:
    """Whether Inductor computes `node` inside the kernel of whatever reads it (no buffer of its own)."""
    t = node.target
    if node.op != "call_function":
        return False
    if t is operator.getitem:
        return True
    return isinstance(t, torch._ops.OpOverload) and (
        torch.Tag.pointwise in t.tags or t.is_view or t.overloadpacket in _FUSED)


class CountingFakeMode(FakeTensorMode):
    """A FakeTensorMode that adds up the bytes of the storages ops create while `counting`, live and
    at their peak (a storage counts until it is freed); storages alive before (`known`) and ops run
    `fused` are not counted. Being a fake-tensor mode, Dynamo compiles under it (it runs eagerly under
    any other dispatch mode). An op whose output size depends on values (bincount) gets the output
    `largest(func, args, kwargs)` makes of meta copies of its arguments."""

    def __init__(self, largest, block: int = 1):
        super().__init__(allow_non_fake_inputs=True)  # a recomputed dropout's saved rng state is a real tensor
        self.largest, self.block = largest, block
        self.counting, self.fused = False, False
        self.storages = StorageCount()

    def start(self, known) -> None:
        self.storages = StorageCount(known, self.block)
        self.counting = True

    @property
    def peak(self) -> int:
        return self.storages.peak

    # higher-order ops (checkpoint's rng state, ...) register their fake-tensor rule for FakeTensorMode
    # itself, not for subclasses: take theirs (a rule that hands the op back to the mode gets the parent's)
    supports_higher_order_operators = True
    _hop = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rule = func.python_key_table.get(FakeTensorMode) if isinstance(func, torch._ops.HigherOrderOperator) else None
        if rule is None or func is self._hop:
            return super().__torch_dispatch__(func, types, args, kwargs or {})
        outer, self._hop = self._hop, func
        try:
            return rule(self, *args, **(kwargs or {}))
        finally:
            self._hop = outer

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = super().dispatch(func, types, args, kwargs)
        except DynamicOutputShapeException:
            out = self._largest(func, args, kwargs)
        if self.counting and not self.fused:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                self.storages.add(t)
        return out

    def _largest(self, func, args, kwargs):
        def meta(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") \
                if isinstance(t, torch.Tensor) else t
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        got = self.largest(func, torch.utils._pytree.tree_map(meta, args), torch.utils._pytree.tree_map(meta, kwargs))
        return FakeTensor(self, got, device)


class _Backend:
    """A torch.compile backend: AOTAutograd with Inductor's partitioner and decompositions, each
    forward and backward graph run by `_runner` under the counting mode."""

    def __init__(self, mode: CountingFakeMode):
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        self.mode, self.graphs = mode, 0
        partition = getattr(compile_fx, "partition_fn", None)  # Inductor's joint-graph passes, then its min-cut
        if partition is None:
            import functools

            from torch._functorch.partitioners import min_cut_rematerialization_partition
            partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
        self.aot = aot_autograd(fw_compiler=self._compile, bw_compiler=self._compile, partition_fn=partition,
                                decompositions=select_decomp_table())

    def __call__(self, gm, example_inputs):
        return self.aot(gm, example_inputs)

    def _compile(self, gm: fx.GraphModule, example_inputs):
        self.graphs += 1
        return _runner(gm, self.mode)


def _runner(gm: fx.GraphModule, mode: CountingFakeMode):
    """`gm` as a boxed callable (it frees its inputs as it goes, as Inductor's code does) that runs op by
    op, each fused op uncounted, and drops each buffer after the kernel that last reads it. A Triton
    kernel (a fused chain ending in a buffer) writes into an input buffer of its output's size that
    dies with it, as Inductor's in-place reuse does; a library kernel (matmul, convolution) does not."""
    nodes = list(gm.graph.nodes)
    outputs: list[fx.Node] = []
    fx.node.map_arg(nodes[-1].args, outputs.append)
    kept = set(outputs)
    buffer: dict[fx.Node, bool] = {}  # whether a node's value is materialised: a kernel writes it, or it aliases one
    for n in reversed(nodes):
        if n.op == "call_function":
            buffer[n] = not fused(n) or n in kept or any(
                u.op == "call_function" and (not fused(u) or (_view(u) and buffer[u])) for u in n.users)
    at = {n: i for i, n in enumerate(nodes)}
    last: dict[fx.Node, int] = {}  # where a value is last read: through fused readers, by the kernel ending them
    for n in reversed(nodes):
        last[n] = max([at[n]] + [at[u] if u.op == "output" or buffer.get(u) else last[u] for u in n.users])
    drop: dict[int, list[fx.Node]] = {}
    for n in nodes:
        if n not in kept:
            drop.setdefault(last[n], []).append(n)

    def run(args: list):
        env, i = {}, 0
        for n in nodes:
            if n.op == "placeholder":
                env[n], args[i] = args[i], None
                i += 1
            elif n.op == "output":
                return list(fx.node.map_arg(n.args[0], env.__getitem__))
            else:
                a, k = fx.node.map_arg(n.args, env.__getitem__), fx.node.map_arg(n.kwargs, env.__getitem__)
                triton = buffer[n] and fused(n) and not _view(n)
                mode.fused = not buffer[n] or triton  # a Triton kernel's output is counted below
                try:
                    env[n] = n.target(*a, **k)
                finally:
                    mode.fused = False
                del a, k
                if triton:
                    out = env[n] if isinstance(env[n], torch.Tensor) else None
                    size = None if out is None else out.untyped_storage().nbytes()
                    dying = [d for d in drop.get(at[n], ()) if d is not n and isinstance(env.get(d), torch.Tensor)]
                    reused = next((d for d in dying if env[d].untyped_storage().nbytes() == size
                                   and sys.getrefcount(env[d]) <= 2), None)
                    if reused is not None:
                        del env[reused]  # freed before the output is counted: the kernel writes in place
                    if out is not None:
                        mode.storages.add(out)
                    del out
            for d in drop.get(at[n], ()):
                env.pop(d, None)
        raise AssertionError("a graph without an output")

    run._boxed_call = True  # AOTAutograd passes the inputs as one list the callee may empty
    return run


def _view(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target.is_view


def compiled_peak(model: torch.nn.Module, loss, batch: dict, held, mode: CountingFakeMode, device: torch.device,
                  dtype) -> int:
    """Peak bytes that one compiled forward (`loss(compiled model, batch)`, a dict with "loss") and
    backward hold beyond `held`, `model` and `batch` being fake tensors of `mode` (entered). One step
    compiles (uncounted), the next is counted."""
    backend = _Backend(mode)
    torch._dynamo.reset()
    try:
        fwd = torch.compile(model, backend=backend)
        for measure in (False, True):
            if measure:
                mode.start(held)
            with autocast(device, dtype):
                out = loss(fwd, batch)
            out["loss"].backward()
            del out
        mode.counting = False
        if not backend.graphs:
            raise RuntimeError("torch.compile traced no graph of the step")
        return mode.peak
    finally:
        torch._dynamo.reset()
