"""wm.models.lovasz: the histogram-ranked Lovasz-softmax against the exact (sorted) one: the per-bin gradient
formula against every order of a bin's points, the loss bound, exact equality on tied errors, and the
gradient on a realistic problem. (The exact one is tested against Berman et al.'s loop in
test_tokenizer.py.)"""

import itertools

import pytest
import torch

import wm.models.lovasz as L
from wm.models.lovasz import HIST_BITS, lovasz_softmax


def exact_gradients(fg_sorted: list[int]) -> list[float]:
    """The Lovasz gradient g_k = J_k - J_(k-1) of one ranked list of points (1 = foreground)."""
    g_total = sum(fg_sorted)
    out, prev, f, b = [], 0.0, 0, 0
    for x in fg_sorted:
        f, b = f + x, b + (1 - x)
        u = g_total + b
        j = 1.0 - (g_total - f) / u if u > 0 else 0.0
        out.append(j - prev)
        prev = j
    return out


@pytest.mark.parametrize("bins", [
    [(1, 1), (2, 1), (1, 0)],  # (background, foreground) per bin, largest errors first
    [(0, 2), (3, 2), (2, 1), (0, 1)],
    [(2, 0), (1, 0)],  # an absent class (no foreground): the first point takes J from 0 to 1
    [(3, 3)],
])
def test_bin_gradients_are_the_mean_over_every_order_inside_the_bins(bins):
    """_bin_gradients gives each (bin, background/foreground) the mean of the exact gradients its
    points get over every order of the points inside each bin (enumerated)."""
    sums = {(i, t): 0.0 for i in range(len(bins)) for t in (0, 1)}
    orders = [set(itertools.permutations([0] * nb + [1] * nf)) for nb, nf in bins]
    n_orders = 0
    for combo in itertools.product(*orders):
        ranked = [(i, x) for i, seq in enumerate(combo) for x in seq]
        for (i, x), g in zip(ranked, exact_gradients([x for _, x in ranked])):
            sums[i, x] += g
        n_orders += 1
    hist = torch.tensor([bins], dtype=torch.long)  # (1 class, bins, 2)
    gts = torch.tensor([sum(nf for _, nf in bins)])
    got = L._bin_gradients(hist, gts)[0]
    for i, (nb, nf) in enumerate(bins):
        for t, n in ((0, nb), (1, nf)):
            if n:
                want = sums[i, t] / (n_orders * n)
                assert float(got[i, t]) == pytest.approx(want, rel=1e-12, abs=1e-15), (i, t)


def random_problem(points: int, classes: int, seed: int, sharp: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes - 1, (points,), generator=g)  # the last class absent
    logits = torch.randn(points, classes, generator=g, dtype=torch.float64) * sharp
    logits[torch.arange(points), labels] += sharp  # mostly right, as a trained model
    return logits, labels


@pytest.mark.parametrize("present_only", [True, False])
@pytest.mark.parametrize("chunk_elements", [1 << 27, 20000])  # all classes at once; a few per chunk
def test_histogram_loss_within_its_bound_and_gradient_close(present_only, chunk_elements, monkeypatch):
    """The loss within 2**-HIST_BITS of the exact one (relative); the gradient w.r.t. the
    probabilities of the present classes close to the exact one. (An absent class, present_only=False,
    has one point of gradient 1 in the exact loss, the top error; binned, the points of the top bin
    share it.)"""
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", chunk_elements)
    logits, labels = random_problem(30000, 6, seed=0)
    probs = logits.softmax(1).requires_grad_(True)
    exact = lovasz_softmax(probs, labels, present_only)
    (g_exact,) = torch.autograd.grad(exact, probs)
    hist = lovasz_softmax(probs, labels, present_only, impl="histogram")
    (g_hist,) = torch.autograd.grad(hist, probs)
    exact, hist = float(exact), float(hist)
    assert abs(hist - exact) <= 2.0 ** -HIST_BITS * exact
    assert abs(hist - exact) > 0  # not the same code path by accident
    g_hist, g_exact = g_hist[:, :-1], g_exact[:, :-1]  # the present classes
    cos = torch.nn.functional.cosine_similarity(g_hist.flatten(), g_exact.flatten(), dim=0)
    assert float(cos) > 0.999, float(cos)
    assert float((g_hist - g_exact).abs().max()) < 0.05 * float(g_exact.abs().max())


def test_histogram_equals_the_exact_loss_on_tied_errors():
    """When the errors inside every bin are equal (probabilities from a few values), ranking by bins
    loses nothing: the loss is the exact one and the gradient sums per class agree."""
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (5000,), generator=g)
    levels = torch.tensor([0.05, 0.1, 0.25, 0.6], dtype=torch.float64)
    probs = levels[torch.randint(0, 4, (5000, 4), generator=g)]
    probs.requires_grad_(True)
    exact = lovasz_softmax(probs, labels)
    (ge,) = torch.autograd.grad(exact, probs)
    hist = lovasz_softmax(probs, labels, impl="histogram")
    (gh,) = torch.autograd.grad(hist, probs)
    assert float(hist) == pytest.approx(float(exact), rel=1e-12)
    assert torch.allclose(gh.sum(0), ge.sum(0), rtol=1e-9)


def test_histogram_perfect_prediction_and_float32():
    logits, labels = random_problem(4000, 5, seed=2)
    perfect = torch.nn.functional.one_hot(labels, 5).float()
    assert float(lovasz_softmax(perfect, labels, impl="histogram")) == 0.0
    p32 = logits.float().softmax(1)
    a = float(lovasz_softmax(p32, labels, impl="histogram"))
    b = float(lovasz_softmax(p32, labels))
    assert abs(a - b) <= 2.0 ** -HIST_BITS * b + 1e-6


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl must be one of"):
        lovasz_softmax(torch.rand(4, 3), torch.zeros(4, dtype=torch.long), impl="bucket")
