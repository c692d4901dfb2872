"""INT8 activation calibration the way TensorRT's EntropyCalibrator2 does it, computed by us (numpy only).

TensorRT 11 removed implicit INT8 calibration and 10.x deprecated it, so wm picks the activation
thresholds itself, writes them into a Q/DQ ONNX, and also writes a TensorRT calibration cache for the
10.x implicit path. Nothing here imports TensorRT.

Sources followed (public reference for TensorRT's entropy calibration; TensorRT's own calibrator is
closed source):

* NVIDIA/TensorRT ``tools/pytorch-quantization/pytorch_quantization/calib/histogram.py``
  (``HistogramCalibrator.collect``, ``_compute_amax_entropy``, ``_compute_amax_percentile``),
  read at commit 1637a26ebea458f810ec219cdcdaaac17603d9f9.

  - Collection (``HistogramCollector``) follows the default ``torch_hist=True`` branch of
    ``collect``: the histogram is of ``|x|`` (as float32), over ``[0, max]`` in ``num_bins=2048``
    equal bins on the first batch; a later batch whose max is larger than the top edge keeps the
    bin width and extends the bin count to ``ceil(max / width)``; every batch is binned over the
    current ``[0, top]`` and the earlier counts are added into the first bins. Values equal to the
    top edge go into the last bin (``torch.histc`` / ``np.histogram`` both close the last bin).
    Zeros are kept (``skip_zeros=False``, the default).
    Deviations, all in cases the reference mishandles: the top edge after growth is exactly
    ``nbins * width`` (the reference takes the last point of ``torch.arange(0, max + width, width)``,
    which float rounding can make one bin longer than its ``nbins``); if ``nbins * width`` rounds
    below the new max, one more bin is added (the reference would drop that value); a tensor whose
    first batches are all zero gets its histogram when the first non-zero batch arrives, with those
    zeros counted in bin 0 (the reference builds a zero-width histogram and then divides by zero);
    NaN/inf activations are refused.
  - ``entropy_threshold`` is ``_compute_amax_entropy`` step by step: ``bins[0] = bins[1]`` (the
    zero bin's count is replaced by its neighbour's, so a ReLU spike at 0 does not weigh in; the
    reference does this on a view of the calibrator's histogram; here on a copy), ``nbins =
    1 << (num_bits - 1 + unsigned)`` (128 levels for signed int8), candidates ``i`` in
    ``range(start_bin, len(bins) + 1, stride)``; for each, P = ``bins[:i]`` with ``sum(bins[i:])``
    added to its last bin; Q = the non-zero bins of ``bins[:i]`` grouped by
    ``np.digitize(range(i), np.linspace(0, i, nbins + 1)) - 1``, each group's total spread evenly
    over its non-zero bins, zero bins staying zero; the divergence is ``scipy.stats.entropy(P, Q)``
    (both normalised, natural log, ``rel_entr``: a bin with P > 0 and Q == 0 makes it +inf; P == 0
    contributes 0); the count check raises like the reference; the chosen candidate is the LAST
    index of the minimum (``len(d) - 1 - argmin(d[::-1])``) and the amax is
    ``calib_bin_edges[last_argmin * stride + start_bin]``, i.e. the upper edge of the last bin
    kept. The loops over bins are vectorised (``np.bincount``); the grouping uses the same
    ``np.linspace``/``np.digitize`` calls so bin membership is identical. Faithful also where the
    reference is odd: when the first candidates see only empty bins (a tensor whose values all sit
    near its max), Q sums to 0, their divergence is NaN, and ``np.argmin`` then picks a NaN entry,
    exactly as the reference does.
  - ``percentile_threshold`` is ``_compute_amax_percentile``: ``edges[searchsorted(cumsum(counts /
    total), percentile / 100)]``.

* The calibration cache text format (what TensorRT's ``IInt8EntropyCalibrator2`` writes):
  a header ``TRT-<NV_TENSORRT_VERSION>-EntropyCalibration2`` and one ``<tensor name>: <hex>`` line
  per tensor, the hex being the IEEE-754 float32 bit pattern of the scale ``amax / 127`` written as
  an integer (most significant byte first). Checked against onnxruntime
  ``onnxruntime/core/providers/tensorrt/tensorrt_execution_provider.cc`` (``ReadDynamicRange``:
  ``strtoul(hex, 16)`` reinterpreted as float, ``dynamic_range = scale * 127``, example
  ``TRT-7103-EntropyCalibration2`` / ``data_0: 4000889d``), NVIDIA TAO's cache writer
  (``hex(struct.unpack("i", struct.pack("f", amax / 127.0)))``) and caches TensorRT wrote, which
  contain lines such as ``(Unnamed Layer* 64) [Shuffle]_output: 0`` (names with spaces and
  unpadded hex). ``NV_TENSORRT_VERSION`` is ``major*1000 + minor*100 + patch`` up to 8.x (8601)
  and ``major*10000 + minor*100 + patch`` from 10.x (100300 for 10.3.0), per NVIDIA/TensorRT
  ``include/NvInferRuntimeBase.h`` / ``NvInferVersion.h``.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from wm.utils.atomic import write_bytes
from wm.utils.errors import WMError

__all__ = [
    "CacheError",
    "HistogramCollector",
    "entropy_threshold",
    "max_threshold",
    "percentile_threshold",
    "scale_from_amax",
    "trt_version_number",
    "scale_to_hex",
    "hex_to_scale",
    "write_cache",
    "read_cache",
]

NUM_BINS = 2048


# ---------------------------------------------------------------------------------------------
# histogram collection


class _Hist:
    __slots__ = ("counts", "width", "amax", "zeros", "preset")

    def __init__(self):
        self.counts: np.ndarray | None = None  # int64, len == nbins
        self.width = 0.0  # bin width, fixed once the histogram exists
        self.amax = 0.0  # exact max |x| seen
        self.zeros = 0  # values seen before the histogram existed (all of them 0)
        self.preset = 0.0  # range given by set_range(), used for the first histogram

    @property
    def top(self) -> float:
        return len(self.counts) * self.width


class HistogramCollector:
    """Per-tensor 2048-bin histograms of |x| over many batches (pytorch-quantization's collect()).

    ``update(name, x)`` for each calibration batch; then ``histograms()`` / ``thresholds()``.
    ``max_bins`` bounds growth: a batch whose max is more than ``max_bins / num_bins`` times the
    first batch's would need that many bins (and entropy_threshold is quadratic in the bin count);
    it is refused with a message instead. ``set_range(name, amax)`` before the first update makes
    the first histogram cover ``[0, amax]`` (for a two-pass calibration that knows the ranges).
    """

    def __init__(self, num_bins: int = NUM_BINS, max_bins: int = 8 * NUM_BINS):
        if int(num_bins) != num_bins or num_bins < 1:
            raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
        if int(max_bins) != max_bins or max_bins < num_bins:
            raise ValueError(f"max_bins must be an integer >= num_bins ({num_bins}), got {max_bins!r}")
        self.num_bins, self.max_bins = int(num_bins), int(max_bins)
        self._h: dict[str, _Hist] = {}
        self._batches: dict[str, int] = {}

    # -- collection ---------------------------------------------------------------------------

    def set_range(self, name: str, amax: float) -> None:
        """Make the first histogram of `name` span [0, amax] instead of [0, first batch's max]."""
        amax = float(amax)
        if not (math.isfinite(amax) and amax > 0):
            raise ValueError(f"tensor {name!r}: range must be a finite positive number, got {amax!r}")
        h = self._h.setdefault(name, _Hist())
        if h.counts is not None:
            raise ValueError(f"tensor {name!r}: set_range after its histogram was started")
        h.preset = amax

    def update(self, name: str, x) -> None:
        """Add one batch of tensor `name` (numpy array, or anything with .detach().cpu().numpy())."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if hasattr(x, "detach"):  # a torch tensor, without importing torch
            x = x.detach().cpu().numpy()
        a = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        h = self._h.setdefault(name, _Hist())
        self._batches[name] = self._batches.get(name, 0) + 1
        if a.size == 0:
            return
        m = float(a.max())
        if not math.isfinite(m):  # max is NaN if any value is NaN, inf if any is inf
            raise ValueError(
                f"tensor {name!r}: calibration batch {self._batches[name]} holds NaN or inf values"
            )
        h.amax = max(h.amax, m)

        if h.counts is None:
            top = max(h.preset, m)
            if top == 0.0:  # all zeros so far: no range to bin over yet
                h.zeros += a.size
                return
            counts, _ = np.histogram(a, bins=self.num_bins, range=(0.0, top))
            h.counts = counts.astype(np.int64)
            h.width = top / self.num_bins
            h.counts[0] += h.zeros
            h.zeros = 0
            return

        n = len(h.counts)
        if m > h.top:  # grow: same width, more bins
            n = int(math.ceil(m / h.width))
            while n * h.width < m:
                n += 1
            if n > self.max_bins:
                raise ValueError(
                    f"tensor {name!r}: max |x| {m:.6g} in batch {self._batches[name]} is "
                    f"{m / h.top:.1f}x the histogram's range {h.top:.6g} and would need {n} bins "
                    f"(max_bins={self.max_bins}); calibrate with representative first batches, "
                    f"call set_range({name!r}, amax) first, or raise max_bins"
                )
        counts, _ = np.histogram(a, bins=n, range=(0.0, n * h.width))
        counts = counts.astype(np.int64)
        counts[: len(h.counts)] += h.counts
        h.counts = counts

    def add_counts(self, name: str, counts, amax: float, batches: int = 1) -> None:
        """Add counts binned elsewhere (on the GPU: wm.export.collect) over the preset range [0, r]
        of set_range(name, r) in num_bins equal bins, values equal to r in the last bin; `amax` is
        their exact max |x| (at most r). The same histogram update() builds from the raw values."""
        h = self._h.get(name)
        if h is None or not h.preset:
            raise ValueError(f"tensor {name!r}: add_counts needs set_range first")
        c = np.asarray(counts, dtype=np.int64).ravel()
        if c.size != self.num_bins:
            raise ValueError(f"tensor {name!r}: {c.size} counts, expected {self.num_bins}")
        amax = float(amax)
        if not math.isfinite(amax) or amax > h.preset * (1 + 1e-6):
            raise ValueError(f"tensor {name!r}: max {amax!r} outside the preset range {h.preset!r}")
        self._batches[name] = self._batches.get(name, 0) + int(batches)
        h.amax = max(h.amax, amax)
        if h.counts is None:
            h.counts, h.width = np.zeros(self.num_bins, np.int64), h.preset / self.num_bins
        h.counts[: c.size] += c

    # -- results ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor seen, in first-update order."""
        return [k for k in self._h if k in self._batches]

    def amax(self, name: str) -> float:
        """Exact max |x| of `name` over all batches (0.0 for a tensor that was always zero)."""
        return self._h[name].amax

    def amaxes(self) -> dict[str, float]:
        return {k: self._h[k].amax for k in self.names()}

    def histogram(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(counts int64[nbins], bin_edges float64[nbins + 1]) of `name`, edges from 0.

        KeyError for an unknown tensor, ValueError for one that was zero in every batch (it has no
        range, hence no histogram, and cannot be given an int8 scale: leave it in float)."""
        h = self._h[name]
        if h.counts is None:
            raise ValueError(f"tensor {name!r} was zero in every calibration batch: no histogram")
        return h.counts.copy(), np.linspace(0.0, h.top, len(h.counts) + 1)

    def histograms(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{name: (counts, bin_edges)} for every tensor with a non-zero value; see histogram()."""
        return {k: self.histogram(k) for k in self.names() if self._h[k].counts is not None}

    def zero_tensors(self) -> list[str]:
        """Tensors that were zero in every batch (absent from histograms())."""
        return [k for k in self.names() if self._h[k].counts is None]

    def thresholds(self, method: str = "entropy", **kw) -> dict[str, float]:
        """{name: amax} for every tensor in histograms(): method 'entropy' (entropy_threshold, kw
        num_bits/unsigned/stride/start_bin), 'percentile' (kw percentile) or 'max' (exact max)."""
        out = {}
        for k, (counts, edges) in self.histograms().items():
            if method == "entropy":
                out[k] = entropy_threshold(counts, edges, **kw)
            elif method == "percentile":
                out[k] = percentile_threshold(counts, edges, **kw)
            elif method == "max":
                out[k] = self.amax(k)
            else:
                raise ValueError(f"unknown calibration method {method!r} (entropy, percentile, max)")
        return out


# ---------------------------------------------------------------------------------------------
# thresholds


def _check_hist(counts, edges) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(counts)
    e = np.asarray(edges, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"histogram counts must be a non-empty 1-D array, got shape {c.shape}")
    if e.shape != (c.size + 1,):
        raise ValueError(f"bin_edges must have len(counts) + 1 = {c.size + 1} entries, got shape {e.shape}")
    c = c.astype(np.float64)
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("histogram counts must be finite and non-negative")
    if not np.all(np.isfinite(e)) or np.any(np.diff(e) <= 0):
        raise ValueError("bin_edges must be finite and strictly increasing")
    if c.sum() <= 0:
        raise ValueError("histogram is empty (all counts are zero)")
    return c, e


def _rel_entr_sum(p: np.ndarray, q: np.ndarray) -> float:
    """scipy.stats.entropy(p, q): both normalised, sum of scipy.special.rel_entr (natural log)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = p / np.sum(p)
        q = q / np.sum(q)
        vec = np.full(p.shape, np.inf)
        pos = (p > 0) & (q > 0)
        vec[pos] = p[pos] * np.log(p[pos] / q[pos])
        vec[(p == 0) & (q >= 0)] = 0.0
        vec[np.isnan(p) | np.isnan(q)] = np.nan
    return float(np.sum(vec))


def entropy_threshold(counts, edges, num_bits: int = 8, unsigned: bool = False,
                      stride: int = 1, start_bin: int = 128) -> float:
    """amax minimising KL(P || Q) over cut-offs: pytorch-quantization's _compute_amax_entropy.

    `counts`/`edges` as np.histogram returns them, edges starting at 0 (an |x| histogram). The
    result is one of the edges: ``edges[i]`` for the chosen cut-off of ``i`` bins. See the module
    docstring for the exact rules followed."""
    bins, edges = _check_hist(counts, edges)
    if int(stride) != stride or stride < 1:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    if int(start_bin) != start_bin or not 1 <= start_bin <= len(bins):
        raise ValueError(f"start_bin must be an integer in [1, {len(bins)}] (the bin count), got {start_bin!r}")
    if int(num_bits) != num_bits or num_bits < 2:
        raise ValueError(f"num_bits must be an integer >= 2, got {num_bits!r}")
    stride, start_bin = int(stride), int(start_bin)
    bins = bins.copy()
    if len(bins) > 1:
        bins[0] = bins[1]
    total_data = np.sum(bins)
    nbins = 1 << (int(num_bits) - 1 + int(bool(unsigned)))
    tail = np.concatenate([np.cumsum(bins[::-1])[::-1], [0.0]])  # tail[i] == sum(bins[i:])

    divergences = []
    for i in range(start_bin, len(bins) + 1, stride):
        space = np.linspace(0, i, num=nbins + 1)
        digitized = np.digitize(np.arange(i), space) - 1
        head = bins[:i]
        nz = head != 0
        groups = digitized[nz]
        sums = np.bincount(groups, weights=head[nz], minlength=nbins)
        members = np.bincount(groups, minlength=nbins)
        new_density = np.zeros(i, dtype=np.float64)
        new_density[nz] = sums[groups] / members[groups]

        total_counts_new = np.sum(new_density) + tail[i]
        reference_density = head.copy()
        reference_density[-1] += tail[i]
        total_counts_old = np.sum(reference_density)
        if round(total_counts_new) != round(total_data) or round(total_counts_old) != round(total_data):
            raise RuntimeError(
                f"count mismatch: total_counts_new={total_counts_new}, "
                f"total_counts_old={total_counts_old}, total_data={total_data}"
            )
        divergences.append(_rel_entr_sum(reference_density, new_density))

    divergences = np.array(divergences)
    last_argmin = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    return float(edges[last_argmin * stride + start_bin])


def threshold_job(job) -> float:
    """One (counts, edges, method) job of the INT8 step: "entropy" or 99.99 "percentile"."""
    counts, edges, method = job
    if method == "entropy":
        return entropy_threshold(counts, edges)
    return percentile_threshold(counts, edges, 99.99)


def worker_main() -> None:
    """Threshold worker process (wm.export.int8 starts it): a pickled list of jobs on stdin ->
    the amaxes, pickled, on stdout. Imports numpy only."""
    import pickle
    import sys

    jobs = pickle.load(sys.stdin.buffer)
    pickle.dump([threshold_job(j) for j in jobs], sys.stdout.buffer)
    sys.stdout.flush()


def max_threshold(counts, edges) -> float:
    """Upper edge of the last non-empty bin (>= the true max; HistogramCollector.amax is exact)."""
    c, e = _check_hist(counts, edges)
    return float(e[np.flatnonzero(c)[-1] + 1])


def percentile_threshold(counts, edges, percentile: float = 99.99) -> float:
    """pytorch-quantization's _compute_amax_percentile: edges[searchsorted(cdf, percentile / 100)].

    Note: that is the LOWER edge of the bin where the cumulative fraction reaches the percentile."""
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {percentile!r}")
    c, e = _check_hist(counts, edges)
    cdf = np.cumsum(c / c.sum())
    return float(e[np.searchsorted(cdf, percentile / 100)])


def scale_from_amax(amax: float, num_bits: int = 8) -> float:
    """Symmetric quantisation scale: amax / (2**(num_bits-1) - 1), i.e. amax / 127 for int8."""
    amax = float(amax)
    if not (math.isfinite(amax) and amax > 0):
        raise ValueError(f"amax must be finite and > 0 to give a scale, got {amax!r}")
    return amax / ((1 << (int(num_bits) - 1)) - 1)


# ---------------------------------------------------------------------------------------------
# TensorRT calibration cache


class CacheError(WMError, ValueError):
    """A calibration cache that cannot be read or written; the message names the file (and line)."""


_HEADER = re.compile(r"TRT-(\d+)-([A-Za-z0-9_]+)")
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")
ALGORITHM = "EntropyCalibration2"


def trt_version_number(version) -> int:
    """'10.3.0' / (10, 3, 0) -> 100300; '8.6.1' -> 8601 (NV_TENSORRT_VERSION, as in the header)."""
    parts = version.split(".") if isinstance(version, str) else list(version)
    try:
        major, minor, patch = (int(p) for p in (list(parts) + [0, 0])[:3])
    except (TypeError, ValueError):
        raise ValueError(f"TensorRT version must look like '10.3.0', got {version!r}") from None
    if min(major, minor, patch) < 0 or minor > 99 or patch > 99:
        raise ValueError(f"TensorRT version must look like '10.3.0', got {version!r}")
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def scale_to_hex(scale: float) -> str:
    """float32 bit pattern of `scale`, most significant byte first, 8 lowercase hex digits."""
    return struct.pack(">f", scale).hex()


def hex_to_scale(h: str) -> float:
    """Inverse of scale_to_hex; accepts TensorRT's unpadded form ('0')."""
    return struct.unpack(">f", int(h, 16).to_bytes(4, "big"))[0]


def write_cache(path, scales: Mapping[str, float], version: int) -> None:
    """Write a TensorRT calibration cache: ``TRT-<version>-EntropyCalibration2`` then one
    ``name: <hex>`` line per tensor in `scales` order; `version` is NV_TENSORRT_VERSION as an
    integer (trt_version_number('10.3.0') == 100300). Atomic: a temp file beside `path`, fsynced,
    then os.replace; on any failure `path` is left as it was. Scales must be finite and > 0 as
    float32 (amax / 127); names non-empty without line breaks."""
    path = Path(path)
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise CacheError(f"calibration cache {path}: version must be a non-negative integer "
                         f"like 100300 (TensorRT 10.3.0), got {version!r}")
    lines = [f"TRT-{int(version)}-{ALGORITHM}"]
    for name, s in scales.items():
        if not isinstance(name, str) or not name or "\n" in name or "\r" in name:
            raise CacheError(f"calibration cache {path}: tensor name {name!r} is empty or has a line break")
        with np.errstate(over="ignore", invalid="ignore"):
            s32 = np.float32(s)
        if not (np.isfinite(s32) and s32 > 0):
            raise CacheError(f"calibration cache {path}: scale of {name!r} must be finite and > 0 "
                             f"as float32, got {s!r}")
        lines.append(f"{name}: {scale_to_hex(float(s32))}")
    data = ("\n".join(lines) + "\n").encode("utf-8")

    write_bytes(path, data)


def read_cache(path) -> tuple[str, dict[str, float]]:
    """Read a TensorRT calibration cache: (header line, {tensor name: scale}).

    Accepts what TensorRT writes (any ``TRT-<digits>-<algorithm>`` header, names with spaces or
    colons, unpadded hex such as ``0``, CRLF line ends, a trailing newline); refuses anything else
    with a CacheError (a ValueError) naming the file and line: no header, a line without
    ``: <hex>``, hex of more than 8 digits, a NaN/inf/negative scale, a repeated tensor name, a
    blank line before the end."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CacheError(f"calibration cache {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise CacheError(f"calibration cache {path}: empty file, expected a 'TRT-<version>-<algorithm>' header")
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]

    header = lines[0]
    if not _HEADER.fullmatch(header):
        raise CacheError(f"calibration cache {path}, line 1: expected a header like "
                         f"'TRT-100300-EntropyCalibration2', got {header[:80]!r}")
    scales: dict[str, float] = {}
    for no, line in enumerate(lines[1:], start=2):
        name, sep, value = line.rpartition(":")
        value = value.strip()
        if not sep or not name:
            raise CacheError(f"calibration cache {path}, line {no}: expected '<tensor name>: <hex scale>', "
                             f"got {line[:80]!r}")
        if not _HEX.fullmatch(value):
            raise CacheError(f"calibration cache {path}, line {no}: scale of {name!r} is not 1-8 hex digits "
                             f"(a float32 bit pattern), got {value[:80]!r}")
        s = hex_to_scale(value)
        if not math.isfinite(s) or s < 0 or (s == 0 and math.copysign(1.0, s) < 0):
            raise CacheError(f"calibration cache {path}, line {no}: scale of {name!r} decodes to {s!r}; "
                             f"a scale must be finite and >= 0")
        if name in scales:
            raise CacheError(f"calibration cache {path}, line {no}: tensor {name!r} appears twice")
        scales[name] = s
    return header, scales
