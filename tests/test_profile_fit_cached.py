"""The cached-prefix fit on known synthetic samples: its model and design, the cells it
needs, the fit and its leave-one-cell-out validation, its bounds and their messages, its
residual-bootstrap intervals and the sidecar forms (the decode fit's too)."""

from __future__ import annotations

import statistics

import attrs
import numpy as np
import pytest

from narwhal.profile.fit import (
    CachedFit,
    DecodePoint,
    bootstrap_cached,
    cached_fit_problem,
    cached_prefill_s,
    cached_rejection,
    fit_cached,
    fit_decode,
    nonneg_lstsq,
    samples_by_cell,
)

#: The true model: a + b*(L-k) + c*(L^2-k^2) + d*k.
TRUE = (0.02, 5e-5, 4e-8, 1e-5)
#: Plain lengths (k = 0) and cached cells, with unequal repeats: the plain cells have
#: fewer than any cached cell, and one cached cell has a one-token prefix.
REPEATS = {(256, 0): 2, (512, 0): 2, (1024, 0): 2, (2048, 0): 2,
           (512, 1): 3, (1024, 512): 4, (2048, 1024): 5, (2048, 1792): 4}  # fmt: skip


def _truth(n: int, k: int) -> float:
    a, b, c, d = TRUE
    return a + b * (n - k) + c * (n * n - k * k) + d * k


def _samples(noise: float = 0.05, seed: int = 4) -> list[tuple[int, int, float]]:
    """Noisy repeats of every cell, interleaved and not in cell order."""
    rng = np.random.default_rng(seed)
    out = [(n, k, _truth(n, k) * float(np.exp(rng.normal(0, noise))))
           for (n, k), count in REPEATS.items() for _ in range(count)]  # fmt: skip
    return out[1::2] + out[::2]


def test_the_model_and_its_design_are_the_documented_formula() -> None:
    # 0.5 + 0.25*(8-2) + 0.125*(64-4) + 2*2
    assert cached_prefill_s(0.5, 0.25, 0.125, 2.0, 8, 2) == 13.5
    assert cached_prefill_s(0.5, 0.25, 0.125, 2.0, 8, 0) == 0.5 + 2.0 + 8.0
    fit = _cached_fit()
    assert attrs.evolve(fit, a=0.5, b=0.25, c=0.125, d=2.0).predict(8, 2) == 13.5
    from narwhal.profile.fit import _cached_design

    design = _cached_design([(8, 2), (4, 0)])
    assert design.tolist() == [[1.0, 6.0, 60.0, 2.0], [1.0, 4.0, 16.0, 0.0]]
    assert design.dtype == np.float64


def test_samples_are_grouped_by_cell_cells_sorted() -> None:
    grouped = samples_by_cell([(512, 0, 0.3), (256, 64, 0.2), (256, 0, 0.1), (512, 0, 0.4),
                               (256, 64, 0.25)])  # fmt: skip
    assert list(grouped.items()) == [((256, 0), [0.1]), ((256, 64), [0.2, 0.25]),
                                     ((512, 0), [0.3, 0.4])]  # fmt: skip
    assert samples_by_cell([]) == {}


def test_the_fit_needs_four_plain_lengths_and_three_cached_cells() -> None:
    plain = [(256, 0), (512, 0), (1024, 0), (2048, 0)]
    cached = [(512, 1), (1024, 512), (2048, 1024)]  # a one-token prefix is a cached prefix
    assert cached_fit_problem(plain + cached) is None
    assert cached_fit_problem(iter(plain + cached)) is None  # any iterable, read once
    assert cached_fit_problem(plain[1:] + cached) == (
        "3 lengths without a cached prefix; the fit needs at least 4")
    assert cached_fit_problem(plain + cached[:2]) == (
        "2 cells with a cached prefix; the fit needs at least 3")
    # Both short: the plain lengths are named first.
    assert cached_fit_problem(plain[:1] + cached[:1]) == (
        "1 lengths without a cached prefix; the fit needs at least 4")
    with pytest.raises(ValueError, match=r"^2 cells with a cached prefix; the fit needs at least 3$"):
        fit_cached([(n, k, _truth(n, k)) for n, k in plain + cached[1:]])
    with pytest.raises(ValueError, match=r"^3 lengths without a cached prefix; the fit needs"):
        fit_cached([(n, k, _truth(n, k)) for n, k in plain[1:] + cached])


def _cached_fit() -> CachedFit:
    return fit_cached(_samples())


def test_the_fit_is_the_relative_nnls_of_the_cell_medians_with_each_cell_held_out() -> None:
    """An independent rendering: cells sorted, the median of each, a non-negative
    least-squares fit on relative residuals, each cell predicted by the fit without it,
    the out-of-sample figures over the cached cells only."""
    samples = _samples()
    fit = fit_cached(samples)
    cells = sorted(REPEATS)
    medians = [statistics.median([s for n, k, s in samples if (n, k) == cell]) for cell in cells]
    x = np.array([[1.0, n - k, n * n - k * k, k] for n, k in cells])
    y = np.array(medians)
    coef = nonneg_lstsq(x, y)
    assert fit.cells == tuple(cells)
    assert fit.medians == tuple(medians)
    assert fit.counts == tuple(REPEATS[c] for c in cells)
    assert (fit.a, fit.b, fit.c, fit.d) == pytest.approx(tuple(coef), rel=1e-9)
    assert fit.predicted == pytest.approx(tuple(x @ coef), rel=1e-9)
    errors = [abs(p - m) / m for p, m in zip(x @ coef, medians, strict=True)]
    assert fit.errors == pytest.approx(errors, rel=1e-9)
    assert fit.mean_error == pytest.approx(sum(errors) / len(errors), rel=1e-9)
    assert fit.worst_error == pytest.approx(max(errors), rel=1e-9)
    held = []
    for i in range(len(cells)):
        keep = [j for j in range(len(cells)) if j != i]
        held.append(float(x[i] @ nonneg_lstsq(x[keep], y[keep])))
    assert fit.loo_predicted == pytest.approx(held, rel=1e-9)
    loo = [abs(p - m) / m for p, m in zip(held, medians, strict=True)]
    assert fit.loo_errors == pytest.approx(loo, rel=1e-9)
    gated = [e for e, (_, k) in zip(loo, cells, strict=True) if k > 0]
    assert fit.loo_mean_error == pytest.approx(sum(gated) / len(gated), rel=1e-9)
    assert fit.loo_worst_error == pytest.approx(max(gated), rel=1e-9)
    # The samples make each figure tell: a plain length's held-out error (an extrapolation
    # at an end) is above every cached cell's, and the one-token prefix is a cached cell.
    assert max(loo) > max(gated) and cells[2] == (512, 1) and len(gated) == 4
    # A known model without noise is recovered.
    exact = fit_cached([(n, k, _truth(n, k)) for n, k in REPEATS])
    assert (exact.a, exact.b, exact.c, exact.d) == pytest.approx(TRUE, rel=1e-6)
    assert exact.worst_error < 1e-9 and exact.loo_worst_error < 1e-6


def test_medians_are_floats_whatever_numbers_the_samples_hold() -> None:
    # Whole seconds, three repeats a cell: statistics.median returns an int; the sidecar's
    # median_s is a float all the same.
    fit = fit_cached([(n, k, round(1000 * _truth(n, k)) + i) for n, k in REPEATS for i in range(3)])
    assert all(type(m) is float for m in fit.medians)
    assert fit.medians[0] == round(1000 * _truth(256, 0)) + 1


def _with_errors(errors: list[float], loo: list[float]) -> CachedFit:
    """The fit of :func:`_samples` with the given errors (in
    sample over every cell; out of sample gated over the cached cells)."""
    fit = _cached_fit()
    gated = [e for e, (_, k) in zip(loo, fit.cells, strict=True) if k > 0]
    return attrs.evolve(fit, errors=tuple(errors), mean_error=sum(errors) / len(errors),
                        worst_error=max(errors), loo_errors=tuple(loo),
                        loo_mean_error=sum(gated) / len(gated), loo_worst_error=max(gated))  # fmt: skip


# cells: (256,0) (512,0) (512,1) (1024,0) (1024,512) (2048,0) (2048,1024) (2048,1792)
def test_each_bound_rejects_on_its_own_and_names_its_worst_cell() -> None:
    clean = [0.0] * 8
    assert cached_rejection(_with_errors(clean, clean)) is None
    # In sample the worst cell is looked for among every cell, a plain one included.
    worst = _with_errors([0.1, 0.0, 0.0, 0.0, 0.0, 0.9, 0.2, 0.0], clean)
    assert cached_rejection(worst) == (
        "worst-cell error 90.0% (at 2048 tokens, 0 cached) is above the 50% bound")
    mean = _with_errors([0.25] * 8, clean)
    assert cached_rejection(mean) == "mean error 25.0% is above the 20% bound"
    # Out of sample only the cached cells count: a plain length's extrapolation does not.
    loo_mean = _with_errors(clean, [5.0, 0.0, 0.3, 0.0, 0.3, 5.0, 0.3, 0.3])
    assert cached_rejection(loo_mean) == (
        "leave-one-cell-out mean error 30.0% (cached cells) is above the 20% bound")
    loo_worst = _with_errors(clean, [9.0, 0.0, 0.7, 0.0, 0.0, 0.0, 0.1, 0.0])
    assert cached_rejection(loo_worst) == (
        "leave-one-cell-out worst error 70.0% (at 512 tokens, 1 cached) is above the 50% bound")
    assert cached_rejection(_with_errors(clean, [9.0, 0.0, 0.0, 9.0, 0.0, 9.0, 0.0, 0.0])) is None


def test_the_bounds_are_inclusive_and_can_be_set() -> None:
    at = _with_errors([0.2] * 8, [0.0, 0.0, 0.5, 0.0, 0.1, 0.0, 0.1, 0.1])
    assert (at.mean_error, at.loo_mean_error, at.loo_worst_error) == pytest.approx((0.2, 0.2, 0.5))
    at = attrs.evolve(at, mean_error=0.2, loo_mean_error=0.2, worst_error=0.5)
    assert cached_rejection(at) is None
    assert cached_rejection(at, max_mean_error=0.3, max_worst_error=0.6) is None
    every = cached_rejection(at, max_mean_error=0.1, max_worst_error=0.4)
    assert every == (
        "mean error 20.0% is above the 10% bound; worst-cell error 50.0% (at 2048 tokens, 1792 "
        "cached) is above the 40% bound; leave-one-cell-out mean error 20.0% (cached cells) is "
        "above the 10% bound; leave-one-cell-out worst error 50.0% (at 512 tokens, 1 cached) is "
        "above the 40% bound"
    )  # the in-sample tie is broken towards the largest cell, as max() of (error, cell) does


def test_the_cached_bootstrap_is_the_documented_residual_bootstrap() -> None:
    """An independent rendering, draw for draw: every sample's ratio to the fit at its
    cell, widened by sqrt(n / (n - 4)), medians of as many draws as the cell's repeats,
    percentile bands of the refitted coefficients and of the fit at the cached cells."""
    samples = _samples()
    fit = fit_cached(samples)
    iv = bootstrap_cached(samples, fit, resamples=50, level=0.8, seed=9)
    # The fewest repeats behind a cached cell's figure: the one-token prefix's three (the
    # plain cells have fewer).
    assert (iv.resamples, iv.level, iv.seed, iv.min_samples) == (50, 0.8, 9, 3)
    ratios = np.array([s / _model(fit, n, k) for n, k, s in samples])
    ratios = 1.0 + (ratios - 1.0) * np.sqrt(len(ratios) / (len(ratios) - 4))
    rng = np.random.default_rng(9)
    cells = sorted(REPEATS)
    x = np.array([[1.0, n - k, n * n - k * k, k] for n, k in cells])
    coefs = np.array([
        nonneg_lstsq(x, np.array([_model(fit, n, k) * np.median(rng.choice(ratios, size=REPEATS[(n, k)]))
                                  for n, k in cells]))
        for _ in range(50)
    ])  # fmt: skip
    for i, key in enumerate("abcd"):
        low, high = np.percentile(coefs[:, i], [10, 90])
        band = iv.coefficients[key]
        assert band.value == (fit.a, fit.b, fit.c, fit.d)[i]
        assert (band.low, band.high) == pytest.approx((min(low, band.value), max(high, band.value)))
    assert list(iv.coefficients) == ["a", "b", "c", "d"]
    cached = [(i, n, k) for i, (n, k) in enumerate(cells) if k > 0]
    assert [p for p, _ in iv.predictions] == [{"length": float(n), "cached": float(k)}
                                              for _, n, k in cached]  # fmt: skip
    for (i, _, _), (_, band) in zip(cached, iv.predictions, strict=True):
        low, high = np.percentile(coefs @ x[i], [10, 90])
        assert band.value == fit.predicted[i]
        assert (band.low, band.high) == pytest.approx((min(low, band.value), max(high, band.value)))
    # The defaults: 200 seeded resamples at 95 %, the same intervals for the same samples.
    default = bootstrap_cached(samples, fit)
    assert (default.resamples, default.level, default.seed) == (200, 0.95, 16)
    assert bootstrap_cached(list(samples), fit) == default
    assert default.worst_half_width > 0  # noisy samples: the bands are not points


def _model(fit: CachedFit, n: int, k: int) -> float:
    return fit.a + fit.b * (n - k) + fit.c * (n * n - k * k) + fit.d * k


def test_the_sidecar_forms_hold_every_figure() -> None:
    fit = _cached_fit()
    assert fit.as_dict() == {
        "model": "a + b*(L-k) + c*(L^2-k^2) + d*k",
        "coefficients": {"a": fit.a, "b": fit.b, "c": fit.c, "d": fit.d},
        "points": [
            {"length": n, "cached": k, "median_s": m, "repeats": r, "predicted_s": p,
             "error": e, "loo_predicted_s": lp, "loo_error": le}
            for (n, k), m, r, p, e, lp, le in zip(
                fit.cells, fit.medians, fit.counts, fit.predicted, fit.errors,
                fit.loo_predicted, fit.loo_errors, strict=True)
        ],
        "mean_error": fit.mean_error,
        "worst_error": fit.worst_error,
        "loo_mean_error": fit.loo_mean_error,
        "loo_worst_error": fit.loo_worst_error,
        "loo_scope": "cells with a cached prefix (k > 0)",
    }  # fmt: skip
    assert fit.counts == (2, 2, 3, 2, 4, 2, 5, 4)  # the repeats in the points above
    points = [DecodePoint(n, n * 300.0, 0.005 + 0.001 * n + 1e-7 * n * 300.0 + 0.0005 * (n % 3))
              for n in (1, 2, 4, 8, 16)]  # fmt: skip
    decode = fit_decode(points)
    assert decode.as_dict() == {
        "model": "c0 + c1*active + c2*resident_kv_tokens",
        "coefficients": {"c0": decode.c0, "c1": decode.c1, "c2": decode.c2},
        "fit_mape": decode.fit_mape,
        "cv_mape": decode.cv_mape,
        "points": [
            {"active": p.active, "kv_tokens": p.kv_tokens, "tpot_s": p.tpot_s, "predicted_s": f,
             "cv_predicted_s": cv, "cv_coefficients": {"c0": k[0], "c1": k[1], "c2": k[2]}}
            for p, f, cv, k in zip(points, decode.predicted, decode.cv_predicted,
                                   decode.cv_coefficients, strict=True)
        ],
        "domain": {"active": {"min": 1, "max": 16}, "kv_tokens": {"min": 300.0, "max": 4800.0}},
    }  # fmt: skip
    # Every fold's coefficients differ, so a swapped index shows.
    assert len({k for k in decode.cv_coefficients}) == len(points)
    assert all(len(set(k)) == 3 for k in decode.cv_coefficients)
