"""wm.export.calib: TensorRT-style entropy calibration (EntropyCalibrator2) and the calibration cache."""

import math
import os
import struct
from collections import Counter

import numpy as np
import pytest

from wm.export.calib import (CacheError, HistogramCollector, entropy_threshold, hex_to_scale, max_threshold,
    percentile_threshold, read_cache, scale_from_amax, scale_to_hex, trt_version_number, write_cache)


# ---------------------------------------------------------------------------------------------
# independent reference: a plain, loop-based transcription of pytorch-quantization's
# _compute_amax_entropy (NVIDIA/TensorRT, tools/pytorch-quantization/pytorch_quantization/calib/
# histogram.py, commit 1637a26ebea458f810ec219cdcdaaac17603d9f9), with scipy.stats.entropy(p, q)
# written out as its definition: normalise both, sum rel_entr (p*log(p/q); 0 where p == 0;
# +inf where p > 0 and q == 0).


def _kl_reference(pk, qk):
    sp, sq = sum(pk), sum(qk)
    total = 0.0
    for p, q in zip(pk, qk):
        p, q = p / sp, q / sq
        if p > 0 and q > 0:
            total += p * math.log(p / q)
        elif p == 0 and q >= 0:
            pass
        else:
            total += math.inf
    return total


def reference_amax_entropy(calib_hist, calib_bin_edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    bins = [int(c) for c in calib_hist]  # the original writes bins[0] into the calibrator's array
    bins[0] = bins[1]
    total_data = sum(bins)
    divergences = []
    nbins = 1 << (num_bits - 1 + int(unsigned))
    starting = start_bin
    stop = len(bins)
    for i in range(starting, stop + 1, stride):
        new_density_counts = [0.0] * nbins
        space = np.linspace(0, i, num=nbins + 1)
        digitized_space = list(np.digitize(range(i), space) - 1)
        for idx in range(i):
            if bins[idx] == 0:
                digitized_space[idx] = -1
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density_counts[digitized] += bins[idx]
        counter = Counter(digitized_space)
        for key, val in counter.items():
            if key != -1:
                new_density_counts[key] = new_density_counts[key] / val
        new_density = [0.0] * i
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density[idx] = new_density_counts[digitized]
        total_counts_new = sum(new_density) + sum(bins[i:])
        reference_density = list(bins[:i])
        reference_density[-1] += sum(bins[i:])
        assert round(total_counts_new) == total_data and sum(reference_density) == total_data
        divergences.append(_kl_reference(reference_density, new_density))
    # last index of the minimum
    best = min(divergences)
    last_argmin = max(k for k, d in enumerate(divergences) if d == best)
    return float(calib_bin_edges[last_argmin * stride + starting])


def _abs_hist(x, bins=2048):
    a = np.abs(np.asarray(x, dtype=np.float32))
    return np.histogram(a, bins=bins, range=(0.0, float(a.max())))


# ---------------------------------------------------------------------------------------------
# entropy threshold vs the reference


def test_entropy_uniform_is_near_the_max():
    rng = np.random.default_rng(0)
    x = rng.uniform(-3.0, 3.0, 200_000)
    counts, edges = _abs_hist(x)
    got = entropy_threshold(counts, edges)
    ref = reference_amax_entropy(counts, edges)
    assert got == ref
    assert got > 0.9 * np.abs(x).max()


def test_entropy_heavy_tail_clips_well_below_the_max():
    rng = np.random.default_rng(1)
    x = rng.standard_t(3, 200_000)  # Cauchy-like tail (Student t, 3 dof)
    counts, edges = _abs_hist(x)
    got = entropy_threshold(counts, edges)
    ref = reference_amax_entropy(counts, edges)
    assert got == ref
    assert got < 0.5 * np.abs(x).max()
    # a Laplace tail is lighter: still clipped, but less
    y = rng.laplace(0.0, 1.0, 200_000)
    counts, edges = _abs_hist(y)
    got = entropy_threshold(counts, edges, stride=4)
    assert got == reference_amax_entropy(counts, edges, stride=4)
    assert got < 0.9 * np.abs(y).max()


def test_entropy_relu_spike_at_zero_full_stride():
    # ReLU of a Gaussian: 60 % exact zeros. Collected with zeros (as TensorRT does), then the
    # reference replaces bin 0's count by bin 1's, so the spike does not weigh in.
    rng = np.random.default_rng(2)
    x = np.maximum(rng.normal(-0.25, 1.0, 100_000), 0.0)
    assert (x == 0).mean() > 0.55
    counts, edges = _abs_hist(x, bins=512)  # fewer bins so the loop reference can run stride 1
    assert counts[0] > 50 * counts[1]
    got = entropy_threshold(counts, edges)
    ref = reference_amax_entropy(counts, edges)
    assert math.isfinite(got) and got == ref
    assert 0 < got <= x.max()
    spike_free = counts.copy()
    spike_free[0] = 7  # bin 0's count is overwritten by bin 1's: the threshold cannot depend on it
    assert entropy_threshold(spike_free, edges) == got


def test_entropy_relu_2048_bins_and_unsigned():
    rng = np.random.default_rng(3)
    x = np.maximum(rng.standard_t(3, 150_000), 0.0)
    counts, edges = _abs_hist(x)
    for unsigned in (False, True):
        got = entropy_threshold(counts, edges, unsigned=unsigned, stride=8)
        ref = reference_amax_entropy(counts, edges, unsigned=unsigned, stride=8)
        assert math.isfinite(got) and got == ref


def test_entropy_hand_histogram_empty_bins_and_inf_divergence():
    # Sparse histogram: many empty bins, so some candidates have P > 0 where Q == 0 (KL = inf) and
    # groups of Q that mix empty and non-empty bins.
    counts = np.zeros(300, dtype=np.int64)
    counts[[0, 1, 2, 5, 40, 41, 130, 131, 200, 260, 299]] = [900, 50, 30, 12, 9, 9, 3, 2, 1, 1, 1]
    edges = np.linspace(0.0, 3.0, 301)
    got = entropy_threshold(counts, edges)
    assert got == reference_amax_entropy(counts, edges)
    got2 = entropy_threshold(counts, edges, num_bits=6, start_bin=40, stride=3)
    assert got2 == reference_amax_entropy(counts, edges, num_bits=6, start_bin=40, stride=3)


def test_kl_matches_scipy_entropy():
    scipy_stats = pytest.importorskip("scipy.stats")
    from wm.export.calib import _rel_entr_sum

    rng = np.random.default_rng(4)
    p = rng.integers(0, 50, 400).astype(np.float64)
    q = p * rng.uniform(0.5, 1.5, 400)
    q[rng.random(400) < 0.1] = 0.0
    p[rng.random(400) < 0.1] = 0.0
    q[p == 0] = 0.0  # keep it finite
    assert _rel_entr_sum(p, q) == pytest.approx(float(scipy_stats.entropy(p, q)), rel=1e-12)
    q2 = q.copy()
    q2[np.flatnonzero(p)[0]] = 0.0
    assert _rel_entr_sum(p, q2) == math.inf == float(scipy_stats.entropy(p, q2))


def test_entropy_rejects_bad_histograms():
    edges = np.linspace(0, 1, 2049)
    with pytest.raises(ValueError, match="empty"):
        entropy_threshold(np.zeros(2048), edges)
    with pytest.raises(ValueError, match="bin_edges"):
        entropy_threshold(np.ones(2048), edges[:-1])
    with pytest.raises(ValueError, match="start_bin"):
        entropy_threshold(np.ones(100), np.linspace(0, 1, 101))


def test_max_percentile_and_scale():
    counts = np.array([5, 0, 3, 2, 0, 0])
    edges = np.linspace(0.0, 6.0, 7)
    assert max_threshold(counts, edges) == 4.0
    # cdf = .5 .5 .8 1 1 1: 80 % is reached in bin 2 -> its lower edge, as pytorch-quantization does
    assert percentile_threshold(counts, edges, 80.0) == 2.0
    assert percentile_threshold(counts, edges, 81.0) == 3.0
    assert scale_from_amax(12.7) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        scale_from_amax(0.0)


# ---------------------------------------------------------------------------------------------
# histogram collection


def test_histogram_growth_equals_one_histogram_over_the_final_range():
    # Values on bin centres of width 1/256 (exact in binary), so every value's bin is unambiguous.
    rng = np.random.default_rng(5)
    w = 1.0 / 256
    a = np.concatenate([(rng.integers(0, 2048, 30_000) + 0.5) * w, [8.0]])  # max 8 -> width 8/2048
    a *= rng.choice([-1.0, 1.0], a.size)
    b = (rng.integers(0, 3149, 40_000) + 0.5) * w
    b = np.concatenate([b, [-12.3]])  # larger max: ceil(12.3 * 256) = 3149 bins
    c = (rng.integers(0, 3000, 5_000) + 0.5) * w  # smaller max: no growth

    col = HistogramCollector()
    for batch in (a, b, c):
        col.update("t", batch.astype(np.float32))
    counts, edges = col.histogram("t")
    assert len(counts) == 3149 and edges[0] == 0.0
    assert edges[-1] == pytest.approx(3149 * w, rel=1e-12)
    assert col.amax("t") == pytest.approx(12.3, rel=1e-6)

    allv = np.abs(np.concatenate([a, b, c]).astype(np.float32))
    direct, _ = np.histogram(allv, bins=3149, range=(0.0, 3149 * w))
    # the only boundary effect: batch A's max (8.0) closed its first histogram's last bin (2047);
    # over the final range 8.0 is the lower edge of bin 2048
    expected = direct.copy()
    expected[2048] -= 1
    expected[2047] += 1
    np.testing.assert_array_equal(counts, expected)
    assert counts.sum() == allv.size
    assert entropy_threshold(counts, edges) == entropy_threshold(direct, edges)


def test_collector_zero_batches_dict_and_errors():
    torch = pytest.importorskip("torch")
    col = HistogramCollector()
    col.update("relu", np.zeros((4, 8)))  # all zero: no range yet
    assert col.histograms() == {} and col.zero_tensors() == ["relu"]
    col.update("relu", torch.tensor([[0.0, 2.0], [1.0, 0.0]]))
    counts, edges = col.histograms()["relu"]
    assert counts.sum() == 36 and counts[0] == 34 and counts[-1] == 1 and edges[-1] == 2.0
    col.update("dead", np.zeros(5))
    assert col.zero_tensors() == ["dead"] and col.amaxes() == {"relu": 2.0, "dead": 0.0}
    th = col.thresholds("max")
    assert th == {"relu": 2.0}

    with pytest.raises(ValueError, match="NaN or inf"):
        col.update("relu", np.array([1.0, np.nan]))
    small = HistogramCollector(max_bins=4096)
    small.update("x", np.array([1.0]))
    with pytest.raises(ValueError, match="max_bins"):
        small.update("x", np.array([2.5]))
    preset = HistogramCollector()
    preset.set_range("x", 4.0)
    preset.update("x", np.array([1.0, -3.0]))
    counts, edges = preset.histogram("x")
    assert len(counts) == 2048 and edges[-1] == 4.0 and counts[512] == 1 and counts[1536] == 1


def test_collector_entropy_on_real_batches_matches_reference():
    rng = np.random.default_rng(6)
    col = HistogramCollector()
    for k in range(4):
        col.update("act", ((0.5 + 0.1 * k) * rng.standard_t(3, (32, 500))).astype(np.float32))
    counts, edges = col.histogram("act")
    assert len(counts) >= 2048
    got = col.thresholds("entropy", stride=16)["act"]
    assert got == reference_amax_entropy(counts, edges, stride=16)
    assert got < 0.5 * col.amax("act")


# ---------------------------------------------------------------------------------------------
# TensorRT calibration cache


def test_version_numbers():
    assert trt_version_number("10.3.0") == 100300
    assert trt_version_number((10, 14, 1)) == 101401
    assert trt_version_number("8.6.1") == 8601
    assert trt_version_number("7.1.3") == 7103


def test_cache_round_trip_and_byte_order(tmp_path):
    amaxes = {"input": 127.0, "/enc/conv1/Conv_output_0": 3.217, "(Unnamed Layer* 64) [Shuffle]_output": 0.05}
    scales = {k: scale_from_amax(v) for k, v in amaxes.items()}
    p = tmp_path / "calib.cache"
    write_cache(p, scales, version=100300)

    lines = p.read_text().splitlines()
    assert lines[0] == "TRT-100300-EntropyCalibration2"
    assert lines[1] == "input: 3f800000"  # scale 1.0: float32 bits 0x3f800000, big-endian hex
    assert len(lines) == 4
    for line, (name, s) in zip(lines[1:], scales.items()):
        n, h = line.rsplit(": ", 1)
        assert n == name and len(h) == 8 and h == h.lower()
        (decoded,) = struct.unpack(">f", bytes.fromhex(h))
        assert decoded == float(np.float32(s))
        assert decoded * 127 == pytest.approx(amaxes[name], rel=1e-6)

    header, back = read_cache(p)
    assert header == "TRT-100300-EntropyCalibration2"
    assert list(back) == list(scales)
    assert all(back[k] == float(np.float32(scales[k])) for k in scales)
    assert scale_to_hex(0.5) == "3f000000" and hex_to_scale("4000889d") == pytest.approx(2.00833, rel=1e-5)
    assert not [f for f in os.listdir(tmp_path) if f != "calib.cache"]  # no temp file left


def test_read_cache_accepts_what_tensorrt_writes(tmp_path):
    p = tmp_path / "trt.cache"
    p.write_bytes(b"TRT-8401-EntropyCalibration2\r\ninput: 3caa54fc\r\n"
                  b"(Unnamed Layer* 64) [Shuffle]_output: 0\r\nx:0: 3F800000\r\n")
    header, scales = read_cache(p)
    assert header == "TRT-8401-EntropyCalibration2"
    assert scales["(Unnamed Layer* 64) [Shuffle]_output"] == 0.0
    assert scales["x:0"] == 1.0
    assert scales["input"] == pytest.approx(0.0208, rel=1e-3)


@pytest.mark.parametrize("text,line,what", [
    ("", None, "empty"),
    ("calibration\ninput: 3f800000\n", 1, "header"),
    ("TRT-100300-EntropyCalibration2\ninput 3f800000\n", 2, "expected"),
    ("TRT-100300-EntropyCalibration2\ninput: 3f80000000\n", 2, "hex"),
    ("TRT-100300-EntropyCalibration2\ninput: 1.0\n", 2, "hex"),
    ("TRT-100300-EntropyCalibration2\na: 3f800000\n\nb: 3f800000\n", 3, "expected"),
    ("TRT-100300-EntropyCalibration2\na: 3f800000\na: 40000000\n", 3, "twice"),
    ("TRT-100300-EntropyCalibration2\na: 7fc00000\n", 2, "finite"),
    ("TRT-100300-EntropyCalibration2\na: bf800000\n", 2, "finite"),
])
def test_read_cache_refuses_malformed(tmp_path, text, line, what):
    p = tmp_path / "bad.cache"
    p.write_text(text)
    with pytest.raises(ValueError, match=what) as e:
        read_cache(p)
    assert isinstance(e.value, CacheError) and str(p) in str(e.value)
    if line is not None:
        assert f"line {line}:" in str(e.value)


def test_write_cache_refuses_bad_scales_and_keeps_the_old_file(tmp_path):
    p = tmp_path / "calib.cache"
    write_cache(p, {"a": 1.0}, version=100300)
    before = p.read_bytes()
    for bad in ({"a": 0.0}, {"a": float("nan")}, {"a": 1e39}, {"a\nb": 1.0}, {"": 1.0}):
        with pytest.raises(CacheError):
            write_cache(p, bad, version=100300)
    with pytest.raises(CacheError, match="version"):
        write_cache(p, {"a": 1.0}, version="10.3")
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["calib.cache"]
