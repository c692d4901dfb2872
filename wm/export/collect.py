"""INT8 calibration data: real windows of the run's training split, streamed through the three
graphs, and the 2048-bin |x| histograms of every tensor that feeds a quantized node.

One loop for every engine (wm.export.deployed): per batch of windows, ``tokenizer_encode`` on all
frames of the windows, ``world_step`` teacher-forced on the first min(P + S - 1, max_frames) frames
(their codes and motion: one pass covers every position the rollout's steps see, on real rather
than predicted codes) and ``tokenizer_decode`` on the codes of the future frames. The engine's taps
see the tensors:

- :class:`ProgramGraphs` (the torch.export programs, node by node): on the GPU where there is one,
  which makes calibration at the `occworld` size minutes instead of hours; every ONNX tensor of
  interest is an FX node of the same name (wm.export.onnx exports attention in explicit form);
- :class:`TappedOrt` (the ONNX files with extra outputs) (onnxruntime on the CPU): the fallback where there is no
  GPU, and the reference the torch path is tested against.

Two passes over the windows, as before: the exact max |x| of each tensor first, then its histogram
over [0, max] in 2048 bins, i.e. pytorch-quantization's histogram of the whole calibration set taken
as one batch. Nothing is kept between batches but the running max and the counts (int64, on the
engine's device): memory does not grow with the number of windows.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from wm.export.calib import NUM_BINS, HistogramCollector
from wm.export.quantizable import Int8Error
from wm.models.world import kv_row_width
from wm.utils.logs import Progress

_CHUNK = 1 << 25  # values binned at once (bounds the int64 index temporary: 256 MiB)


# ---------------------------------------------------------------------------------------------
# windows


def windows(trained, root, split: str, n: int, what: str, log: Callable[[str], None] = print):
    """(OccWindows of `split`, `n` evenly spread window indices, data root). `n` <= 0, or more
    windows than the split has: every window of the split (the latter said in one line)."""
    from wm.data.windows import OccWindows, resolve_root

    cfg = trained.cfg
    root = Path(root) if root else resolve_root(cfg, log=lambda *a, **k: None)
    dcfg = dataclasses.replace(cfg.data, max_windows=0)
    # DataError (one line) for a missing split or a data/config mismatch
    ds = OccWindows(root, split, dcfg, h5_cache_mib=cfg.loader.h5_cache_mib)
    total = len(ds)
    if total == 0:
        raise Int8Error(f"split {split!r} of {root} has no window of {cfg.data.past + cfg.data.future} "
                        "frames; export needs at least one")
    if n is None or n <= 0:
        n = total
    elif n > total:
        log(f"note: {what} {n} but split {split!r} has {total} windows ({root}); using all {total}")
        n = total
    idx = np.unique(np.linspace(0, total - 1, n).round().astype(np.int64))
    return ds, idx, root


def batches(ds, idx: np.ndarray, batch: int) -> Iterable[dict[str, torch.Tensor]]:
    """Stacked batches of windows: occ uint8 (B, T, X, Y, Z), motion float32 (B, T, 3)[, mask]."""
    for s in range(0, len(idx), batch):
        items = [ds[int(i)] for i in idx[s:s + batch]]
        yield {k: torch.stack([it[k] for it in items]) for k in items[0] if k != "index"}


_FRAME_VOXELS = 1 << 22  # voxels per tokenizer call in calibration: 6 frames of 200x200x16


def _frames(run, name: str, x: torch.Tensor, grid, keep: bool = True) -> list:
    """`name` over the frames `x` (N, ...) in groups of at most _FRAME_VOXELS voxels of the
    occupancy `grid` (the encoder's input, the decoder's output). The
    tokenizer graphs treat frames independently (no batch statistics), so the taps see the same
    values as in one call, while the full-resolution activations of 22 frames (2 windows of 11) no
    longer sit in memory together: 8.3 -> 5.1 GiB peak at the occworld size on the CPU."""
    n = max(1, _FRAME_VOXELS // int(np.prod(grid)))
    outs = [run(name, x[s:s + n]) for s in range(0, len(x), n)]
    return [torch.cat([o[i] for o in outs]) for i in range(len(outs[0]))]


def calibrate_batch(run, cfg, occ: torch.Tensor, motion: torch.Tensor) -> None:
    """Run one batch of windows through the three graphs the way calibration feeds them."""
    B, T = occ.shape[:2]
    P, maxf = cfg.data.past, cfg.world.max_frames
    grid = occ.shape[2:]
    codes = _frames(run, "tokenizer_encode", occ.reshape(B * T, *grid), grid)[0]
    codes = codes.reshape(B, T, *codes.shape[1:])
    t = min(T - 1, maxf)
    h, w = codes.shape[-2:]
    kv = torch.zeros(1, 1, kv_row_width(cfg.world, cfg.tokenizer.codebook_size, h, w), device=codes.device)
    for i in range(B):  # an empty cache, all t frames new; window by window: their cache rows are 0.65 GB
        run("world_step", codes[i:i + 1, :t], motion[i:i + 1, :t].float(), kv)  # a window at the occworld size
    _frames(run, "tokenizer_decode", codes[:, P:].reshape(B * (T - P), *codes.shape[2:]), grid, keep=False)


# ---------------------------------------------------------------------------------------------
# taps: what each pass keeps of a value


class _MaxTap:
    def __init__(self, wanted: Mapping[str, Sequence[str]]):
        self.wanted = {g: set(v) for g, v in wanted.items()}
        self.top: dict[tuple, torch.Tensor] = {}

    def __call__(self, graph: str, name: str, v: torch.Tensor) -> None:
        if name not in self.wanted.get(graph, ()) or not v.is_floating_point():
            return
        m = v.detach().abs().amax().float() if v.numel() else torch.zeros((), device=v.device)
        k = (graph, name)
        self.top[k] = torch.maximum(self.top[k], m) if k in self.top else m

    def maxima(self) -> dict[tuple, float]:
        out = {k: float(v) for k, v in self.top.items()}
        bad = [k for k, v in out.items() if not np.isfinite(v)]
        if bad:
            raise Int8Error(f"{bad[0][0]}: tensor {bad[0][1]!r} holds NaN or inf values on the calibration "
                            "windows; check the checkpoint (train.py --eval-only) before exporting")
        return out


class _HistTap:
    def __init__(self, ranges: Mapping[tuple, float], bins: int = NUM_BINS):
        self.ranges = {k: r for k, r in ranges.items() if r > 0}
        self.bins = bins
        self.counts: dict[tuple, torch.Tensor] = {}

    def __call__(self, graph: str, name: str, v: torch.Tensor) -> None:
        k = (graph, name)
        r = self.ranges.get(k)
        if r is None:
            return
        x = v.detach().reshape(-1)
        c = self.counts.get(k)
        if c is None:
            c = self.counts[k] = torch.zeros(self.bins, dtype=torch.int64, device=x.device)
        for s in range(0, x.numel(), _CHUNK):  # bin i holds [i*w, (i+1)*w), the top value in the last bin
            i = (x[s:s + _CHUNK].abs().float() * (self.bins / r)).long().clamp_(max=self.bins - 1)
            c += torch.bincount(i, minlength=self.bins)


# ---------------------------------------------------------------------------------------------
# the two passes


def collect(make_engine: Callable[[Callable], Callable], wanted: Mapping[str, Sequence[str]], cfg, ds,
            idx: np.ndarray, batch: int, log: Callable[[str], None] = print,
            first: Optional[Callable[[float], None]] = None) -> dict[str, HistogramCollector]:
    """{graph: HistogramCollector} of the `wanted` tensors ({graph: [tensor names]}) over the
    windows `idx` of `ds`, in two streamed passes. `make_engine(taps)` returns an engine that calls
    taps(graph, name, value) with its values (ProgramGraphs, or TappedOrt). `first(seconds per
    window)` is called once the first batch has run (export.py's time estimate)."""
    n_batches = (len(idx) + batch - 1) // batch
    tap1 = _MaxTap(wanted)

    def one_pass(tap, what: str):
        nonlocal first
        run = make_engine(tap)
        p = Progress(f"calibration {what}", len(idx), "windows", log)
        for b in batches(ds, idx, batch):
            t0 = time.perf_counter()
            calibrate_batch(run, cfg, b["occ"], b["motion"])
            p.step(len(b["occ"]))
            if first is not None and tap is tap1:
                first((time.perf_counter() - t0) / len(b["occ"]))
                first = None

    one_pass(tap1, "pass 1/2 (ranges)")
    ranges = tap1.maxima()
    tap2 = _HistTap(ranges)
    one_pass(tap2, "pass 2/2 (histograms)")
    out = {g: HistogramCollector() for g in wanted}
    for g, names in wanted.items():
        col = out[g]
        for name in names:
            k = (g, name)
            if k not in ranges:
                continue  # never produced (a branch the windows did not reach)
            if ranges[k] <= 0:
                col.update(name, np.zeros(1, np.float32))  # zero in every batch: stays float
                continue
            col.set_range(name, ranges[k])
            col.add_counts(name, tap2.counts[k].cpu().numpy(), ranges[k], batches=n_batches)
    return out


class TappedOrt:
    """onnxruntime over calibration copies of the graphs: each copy outputs the wanted tensors too,
    and taps(graph, name, value) sees them; the engine returns the graph's own outputs."""

    def __init__(self, files: Mapping[str, Path], wanted: Mapping[str, Sequence[str]], taps, threads: int = 0):
        self.files, self.wanted, self.taps, self.threads = dict(files), wanted, taps, threads
        self.sessions: dict[str, tuple] = {}

    def _session(self, name: str):
        if name not in self.sessions:
            import onnx
            import onnxruntime as ort

            from wm.export.quantizable import _elem_types, _load

            model = _load(self.files[name])
            n_out = len(model.graph.output)
            types = _elem_types(model)
            have = {o.name for o in model.graph.output}
            extra = [t for t in self.wanted.get(name, ()) if t not in have and t in types]
            for t in extra:
                model.graph.output.append(onnx.helper.make_tensor_value_info(t, types[t], None))
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.enable_cpu_mem_arena = False  # see wm.export.onnx.session
            if self.threads:
                so.intra_op_num_threads = self.threads
            try:
                sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            except Exception as e:
                raise Int8Error(f"{self.files[name]}: onnxruntime cannot load the calibration copy: "
                                f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
            self.sessions[name] = (sess, n_out, [o.name for o in model.graph.output])
        return self.sessions[name]

    def __call__(self, name: str, *inputs: torch.Tensor) -> tuple:
        sess, n_out, names = self._session(name)
        feed = {i.name: x.detach().cpu().numpy() for i, x in zip(sess.get_inputs(), inputs)}
        outs = sess.run(None, feed)
        for t, v in zip(names[n_out:], outs[n_out:]):
            self.taps(name, t, torch.from_numpy(v))
        for t, v in zip(names[:n_out], outs[:n_out]):  # a graph output that is also wanted
            if t in self.wanted.get(name, ()):
                self.taps(name, t, torch.from_numpy(v))
        return tuple(torch.from_numpy(np.ascontiguousarray(v)) for v in outs[:n_out])
