"""The profiler's fits: TTFT curve and bounds, NNLS decode model, leave-one-cell-out."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from narwhal.profile.fit import (
    DecodePoint,
    TTFTFit,
    decode_fit_problem,
    fit_decode,
    fit_ttft,
    median_by_length,
    tpot_kv_limit,
    ttft_rejection,
)


def _fit_with(errors: list[float]) -> TTFTFit:
    lengths = tuple(range(100, 100 * (len(errors) + 1), 100))
    return TTFTFit(a=0.0, b=0.0, c=0.0, lengths=lengths, medians=(1.0,) * len(errors),
                   predicted=(1.0,) * len(errors), errors=tuple(errors),
                   mean_error=sum(errors) / len(errors), worst_error=max(errors))  # fmt: skip


def test_ttft_fit_recovers_a_quadratic_curve() -> None:
    a, b, c = 0.02, 5e-5, 2e-8
    medians = {n: a + b * n + c * n * n for n in (128, 512, 1024, 2048, 4000)}
    fit = fit_ttft(medians)
    assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-6)
    assert fit.mean_error < 1e-9 and fit.worst_error < 1e-9
    assert fit.predict(3000) == pytest.approx(a + b * 3000 + c * 9e6, rel=1e-6)


def test_ttft_fit_is_non_negative_where_free_least_squares_is_not() -> None:
    # A concave curve: unconstrained least squares gives c < 0 (TTFT falling for long prompts).
    medians = {100: 0.010, 1000: 0.050, 2000: 0.070, 4000: 0.080}
    ls = np.array(sorted(medians), dtype=float)
    free = np.linalg.lstsq(np.column_stack([np.ones_like(ls), ls, ls**2]),
                           np.array([medians[int(n)] for n in ls]), rcond=None)[0]  # fmt: skip
    assert free[2] < 0
    fit = fit_ttft(medians)
    assert min(fit.a, fit.b, fit.c) >= 0
    assert all(fit.predict(n) <= fit.predict(n + 1) for n in range(0, 5000, 250))


def test_ttft_fit_needs_four_lengths() -> None:
    # Three lengths leave a leave-one-length-out fold two points for three coefficients.
    with pytest.raises(ValueError, match="at least 4"):
        fit_ttft({100: 0.01, 200: 0.02, 300: 0.03})


def test_median_is_taken_per_exact_length() -> None:
    samples = [(100, 0.3), (100, 0.1), (100, 0.2), (200, 0.5), (200, 0.4)]
    assert median_by_length(samples) == {100: 0.2, 200: 0.45}


def test_mean_error_bound_rejects_on_its_own() -> None:
    reason = ttft_rejection(_fit_with([0.25, 0.25, 0.25, 0.25]))
    assert reason is not None and "mean error 25.0%" in reason and "worst" not in reason


def test_worst_point_bound_rejects_on_its_own() -> None:
    reason = ttft_rejection(_fit_with([0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert reason is not None and "worst-point error 60.0%" in reason and "mean" not in reason


def test_bounds_are_inclusive_limits() -> None:
    assert ttft_rejection(_fit_with([0.2, 0.2])) is None
    assert ttft_rejection(_fit_with([0.5, 0.0, 0.0, 0.1])) is None
    assert ttft_rejection(_fit_with([0.1, 0.1]), max_mean_error=0.05) is not None


def _grid(c0: float, c1: float, c2: float) -> list[DecodePoint]:
    return [DecodePoint(n, n * (length + 20), c0 + c1 * n + c2 * n * (length + 20))
            for length, n in itertools.product((256, 1024), (1, 4, 8))]  # fmt: skip


def test_decode_fit_recovers_coefficients_and_records_the_domain() -> None:
    points = _grid(0.005, 0.0008, 2e-7)
    fit = fit_decode(points)
    assert (fit.c0, fit.c1, fit.c2) == pytest.approx((0.005, 0.0008, 2e-7), rel=1e-6)
    assert fit.fit_mape < 1e-9 and fit.cv_mape < 1e-9
    assert (fit.active_min, fit.active_max) == (1, 8)
    assert (fit.kv_min, fit.kv_max) == (276, 8 * 1044)
    assert fit.predict(4, 1000) == pytest.approx(0.005 + 0.0032 + 2e-4)


def _kkt_optimal(points: list[DecodePoint], coef: tuple[float, float, float]) -> bool:
    """Whether ``coef`` minimises the relative squared error over coefficients >= 0."""
    x = np.array([[1, p.active, p.kv_tokens] for p in points], dtype=float)
    y = np.array([p.tpot_s for p in points])
    a = x / y[:, None]
    a = a / np.max(np.abs(a), axis=0)  # compare gradients on one scale
    scaled = np.array(coef) * np.max(np.abs(x / y[:, None]), axis=0)
    gradient = -a.T @ (1.0 - a @ scaled)
    return all(
        g > -1e-9 if c == 0 else abs(g) < 1e-9 for c, g in zip(scaled, gradient, strict=True)
    )


def test_decode_fit_and_every_leave_one_out_fold_stay_non_negative() -> None:
    # TPOT that falls with the active count at fixed KV: free least squares gives c1 < 0.
    points = [DecodePoint(n, kv, 0.02 - 0.001 * n + 1e-6 * kv)
              for n, kv in ((1, 1000), (2, 3000), (4, 2000), (8, 9000), (6, 12000))]  # fmt: skip
    x = np.array([[1, p.active, p.kv_tokens] for p in points], dtype=float)
    y = np.array([p.tpot_s for p in points])
    assert np.linalg.lstsq(x, y, rcond=None)[0][1] < 0
    fit = fit_decode(points)
    assert min(fit.c0, fit.c1, fit.c2) >= 0
    assert len(fit.cv_coefficients) == len(points)
    assert _kkt_optimal(points, (fit.c0, fit.c1, fit.c2))  # constrained optimum, not a clip
    for i, fold in enumerate(fit.cv_coefficients):
        assert min(fold) >= 0
        assert _kkt_optimal(points[:i] + points[i + 1 :], fold)
    assert fit.fit_mape > 0 and fit.cv_mape >= fit.fit_mape


def test_leave_one_cell_out_predicts_each_cell_without_it() -> None:
    points = _grid(0.005, 0.0008, 2e-7)
    points[0] = DecodePoint(points[0].active, points[0].kv_tokens, points[0].tpot_s * 2)
    fit = fit_decode(points)
    others = fit_decode([*points[1:], points[1]]).predict(points[0].active, points[0].kv_tokens)
    assert fit.cv_predicted[0] == pytest.approx(others, rel=1e-6)
    assert fit.cv_mape > fit.fit_mape


def test_decode_fit_needs_two_points_on_each_axis() -> None:
    assert "at least 4" in (decode_fit_problem(_grid(0.005, 0.001, 1e-7)[:3]) or "")
    same_active = [DecodePoint(4, kv, 0.01) for kv in (1, 2, 3, 4)]
    assert "active" in (decode_fit_problem(same_active) or "")
    same_kv = [DecodePoint(n, 100, 0.01) for n in (1, 2, 3, 4)]
    assert "resident-KV" in (decode_fit_problem(same_kv) or "")
    with pytest.raises(ValueError):
        fit_decode(same_kv)


def test_tpot_derived_kv_limit() -> None:
    assert tpot_kv_limit(0.005, 0.001, 1e-6, tpot_s=0.02, active=5) == pytest.approx(10_000)
    assert tpot_kv_limit(0.005, 0.001, 0.0, tpot_s=0.02, active=5) is None
    assert tpot_kv_limit(0.005, 0.01, 1e-6, tpot_s=0.02, active=5) is None
