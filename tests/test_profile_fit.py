"""The profiler's fits: TTFT curve and bounds, NNLS decode model, leave-one-cell-out."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest

from narwhal.profile.fit import (
    Band,
    DecodeFit,
    DecodePoint,
    Intervals,
    TTFTFit,
    bootstrap_decode,
    bootstrap_ttft,
    cell_figures,
    decode_fit_problem,
    fit_decode,
    fit_ttft,
    interval_rejection,
    mape,
    median_by_length,
    nonneg_lstsq,
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


def test_lengths_are_squared_in_floating_point_and_medians_kept_as_floats() -> None:
    # int64 squares wrap beyond 3.04e9 tokens; a float design does not. (Coefficients
    # for which every term shows at these lengths.)
    a, b, c = 20.0, 2e-8, 2e-17
    huge = {n: a + b * n + c * n * n for n in (1_000_000_000, 2_000_000_000, 4_000_000_000,
                                                8_000_000_000)}  # fmt: skip
    fit = fit_ttft(huge)
    assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-6)
    iv = bootstrap_ttft([(n, t) for n, t in huge.items() for _ in range(3)], fit, resamples=5)
    for _, band in iv.predictions:  # noise-free repeats: every refit is the fit
        assert (band.low, band.high) == pytest.approx((band.value, band.value), rel=1e-6)
    whole = fit_ttft({128: 1, 512: 2, 1024: 3, 2048: 5})  # whole seconds: stored as floats
    assert all(type(m) is float for m in whole.medians)


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


TRUE = (0.02, 5e-5, 2e-8)
LENGTHS = (128, 512, 1024, 2048)


def _truth(n: float) -> float:
    a, b, c = TRUE
    return a + b * n + c * n * n


def _repeats(noise: float, per_length: int, seed: int = 1) -> list[tuple[int, float]]:
    rng = np.random.default_rng(seed)
    return [(n, _truth(n) * float(np.exp(rng.normal(0, noise))))
            for n in LENGTHS for _ in range(per_length)]  # fmt: skip


def test_leave_one_length_out_predicts_each_length_without_it_and_gates_the_interior() -> None:
    medians = {128: 0.030, 512: 0.060, 1024: 0.080, 2048: 0.180}
    fit = fit_ttft(medians)
    for i, n in enumerate(fit.lengths):
        rest = {k: v for k, v in medians.items() if k != n}
        x = np.array([[1.0, k, k * k] for k in sorted(rest)])
        coef = nonneg_lstsq(x, np.array([rest[k] for k in sorted(rest)]))
        held = float(coef @ np.array([1.0, n, n * n]))
        assert fit.loo_predicted[i] == pytest.approx(held)
        assert fit.loo_errors[i] == pytest.approx(abs(held - medians[n]) / medians[n])
    interior = fit.loo_errors[1:-1]
    assert fit.loo_mean_error == pytest.approx(sum(interior) / 2)
    assert fit.loo_worst_error == max(interior)
    assert fit.loo_worst_length == fit.lengths[1 + interior.index(max(interior))]
    points = fit.as_dict()["points"]
    assert [p["loo_kind"] for p in points] == ["extrapolation", "interpolation",
                                               "interpolation", "extrapolation"]  # fmt: skip


def test_the_leave_one_length_out_bounds_reject_on_their_own() -> None:
    base = _fit_with([0.0, 0.0, 0.0, 0.0])
    worse = attrs.evolve(base, loo_errors=(9.0, 0.3, 0.3, 9.0), loo_mean_error=0.3,
                         loo_worst_error=0.3)  # fmt: skip
    reason = ttft_rejection(worse)
    assert reason is not None and "leave-one-length-out mean error 30.0%" in reason
    assert "worst" not in reason
    worst = attrs.evolve(base, loo_errors=(0.0, 0.6, 0.0, 0.0), loo_mean_error=0.1,
                         loo_worst_error=0.6)  # fmt: skip
    reason = ttft_rejection(worst)
    assert reason is not None and "leave-one-length-out worst error 60.0% (at 200 tokens)" in reason
    assert "mean" not in reason
    edge = attrs.evolve(base, loo_errors=(0.0, 0.5, 0.2, 0.0), loo_mean_error=0.2,
                        loo_worst_error=0.5)  # fmt: skip
    assert ttft_rejection(edge) is None


def test_ttft_intervals_cover_the_truth_and_narrow_with_more_repeats() -> None:
    wide = bootstrap_ttft(r := _repeats(0.05, 3), fit_ttft(median_by_length(r)))
    narrow = bootstrap_ttft(r := _repeats(0.05, 15), fit_ttft(median_by_length(r)))
    for iv in (wide, narrow):
        assert [p["length"] for p, _ in iv.predictions] == list(LENGTHS)
        for point, band in iv.predictions:
            assert band.low <= _truth(point["length"]) <= band.high
            assert band.low <= band.value <= band.high
        for key, truth in zip("abc", TRUE, strict=True):
            assert iv.coefficients[key].low <= truth <= iv.coefficients[key].high
        widths = [b.relative_half_width for _, b in iv.predictions]
        assert iv.worst_half_width == max(widths)
        assert iv.mean_half_width == pytest.approx(sum(widths) / len(widths))
        assert iv.upper_factor == max(b.high / b.value for _, b in iv.predictions) > 1
    assert (wide.min_samples, narrow.min_samples) == (3, 15)
    assert narrow.mean_half_width < 0.6 * wide.mean_half_width
    # Seeded: the same samples give the same intervals.
    r = _repeats(0.05, 3)
    assert bootstrap_ttft(r, fit_ttft(median_by_length(r))) == wide
    assert wide.as_dict()["mean_half_width"] == wide.mean_half_width


def test_one_stalled_repeat_does_not_span_its_lengths_interval() -> None:
    r = _repeats(0.02, 5)
    stalled = list(r)
    stalled[15] = (2048, r[15][1] * 3.0)  # one of the five at 2048 took three times as long
    iv = bootstrap_ttft(stalled, fit_ttft(median_by_length(stalled)))
    assert iv.worst_half_width < 0.5 and interval_rejection(iv) is None


def _intervals(widths: list[float], samples: int = 5) -> Intervals:
    bands = tuple(({"length": float(n)}, Band(1.0, 1.0 - w, 1.0 + w))
                  for n, w in zip(LENGTHS, widths, strict=False))  # fmt: skip
    return Intervals({}, bands, samples)


def test_the_interval_bounds_and_the_repeats_rule_reject_on_their_own() -> None:
    assert interval_rejection(_intervals([0.2, 0.2, 0.2, 0.2])) is None
    assert interval_rejection(_intervals([0.5, 0.05, 0.05, 0.1])) is None
    mean = interval_rejection(_intervals([0.25, 0.25, 0.25, 0.25]))
    assert mean is not None and "mean prediction-interval half-width 25.0%" in mean
    assert "widest" not in mean and "repeat" in mean  # the advice: more --repeats
    widest = interval_rejection(_intervals([0.6, 0.0, 0.0, 0.0]))
    assert widest is not None and "widest prediction-interval half-width 60.0%" in widest
    assert "mean prediction" not in widest
    few = interval_rejection(_intervals([0.0, 0.0, 0.0, 0.0], samples=2))
    assert few is not None and few.startswith("2 repeat(s) at a length cannot bound")
    assert interval_rejection(_intervals([0.0] * 4, samples=3)) is None
    assert interval_rejection(_intervals([0.3] * 4), max_mean_width=0.35) is None


def test_a_band_measures_its_larger_side_relative_to_the_value() -> None:
    assert Band(2.0, 1.0, 2.5).relative_half_width == 0.5
    assert Band(2.0, 1.9, 3.0).relative_half_width == 0.5
    assert Band(0.0, 0.0, 0.0).relative_half_width == 0.0
    assert Band(0.0, 0.0, 1.0).relative_half_width == float("inf")


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


# ------------------------------------------------- what mutation testing asked for


def test_the_bootstrap_is_the_documented_residual_bootstrap() -> None:
    """An independent rendering of the documented method, draw for draw: ratios to the
    curve, widened by sqrt(n / (n - 3)), medians of as many draws as repeats, percentile
    bands at 2.5 / 97.5 of 200 seeded resamples."""
    r = _repeats(0.05, 4, seed=3)
    fit = fit_ttft(median_by_length(r))
    iv = bootstrap_ttft(r, fit)
    assert (iv.resamples, iv.level, iv.seed, iv.min_samples) == (200, 0.95, 16, 4)
    ratios = np.array([s / fit.predict(n) for n, s in r])
    ratios = 1.0 + (ratios - 1.0) * np.sqrt(len(ratios) / (len(ratios) - 3))
    rng = np.random.default_rng(16)
    x = np.array([[1.0, n, n * n] for n in LENGTHS])
    coefs = np.array([
        nonneg_lstsq(x, np.array([fit.predict(n) * np.median(rng.choice(ratios, size=4))
                                  for n in LENGTHS]))
        for _ in range(200)
    ])  # fmt: skip
    for i, key in enumerate("abc"):
        low, high = np.percentile(coefs[:, i], [2.5, 97.5])
        band = iv.coefficients[key]
        assert band.value == (fit.a, fit.b, fit.c)[i]
        assert (band.low, band.high) == pytest.approx((min(low, band.value), max(high, band.value)))
    for i, (point, band) in enumerate(iv.predictions):
        low, high = np.percentile(coefs @ x[i], [2.5, 97.5])
        assert point == {"length": float(LENGTHS[i])}
        assert (band.low, band.high) == pytest.approx((min(low, band.value), max(high, band.value)))


def test_the_sidecar_forms_hold_every_figure() -> None:
    fit = fit_ttft({128: 0.030, 512: 0.090, 1024: 0.080, 2048: 0.180})
    assert fit.loo_errors[1] > fit.loo_errors[2]  # the worst interior error is the first
    assert fit.loo_worst_error == fit.loo_errors[1] and fit.loo_worst_length == 512
    doc = fit.as_dict()
    assert doc == {
        "model": "a + b*L + c*L^2",
        "coefficients": {"a": fit.a, "b": fit.b, "c": fit.c},
        "points": [
            {"length": n, "median_s": m, "predicted_s": p, "error": e, "loo_predicted_s": lp,
             "loo_error": le, "loo_kind": kind}
            for n, m, p, e, lp, le, kind in zip(
                fit.lengths, fit.medians, fit.predicted, fit.errors, fit.loo_predicted,
                fit.loo_errors,
                ("extrapolation", "interpolation", "interpolation", "extrapolation"),
                strict=True)
        ],
        "mean_error": fit.mean_error,
        "worst_error": fit.worst_error,
        "loo_mean_error": fit.loo_mean_error,
        "loo_worst_error": fit.loo_worst_error,
    }  # fmt: skip
    assert fit.medians == (0.030, 0.090, 0.080, 0.180)
    iv = _intervals([0.1, 0.3, 0.2, 0.0], samples=4)
    iv = attrs.evolve(iv, coefficients={"a": Band(1.0, 0.5, 2.0)})
    assert iv.as_dict() == {
        "method": "percentile bootstrap of the raw samples, refitted",
        "resamples": 200, "level": 0.95, "seed": 16,
        "coefficients": {"a": {"value": 1.0, "low": 0.5, "high": 2.0}},
        "predictions": [{"length": float(n), "value": 1.0, "low": 1.0 - w, "high": 1.0 + w}
                        for n, w in zip(LENGTHS, (0.1, 0.3, 0.2, 0.0), strict=True)],
        "min_samples": 4, "upper_factor": 1.3, "mean_half_width": pytest.approx(0.15),
        "worst_half_width": pytest.approx(0.3),
    }  # fmt: skip


def test_a_percentile_band_is_at_the_tails_of_its_level() -> None:
    from narwhal.profile.fit import _band

    draws = np.linspace(0.0, 2.0, 2001)
    assert _band(1.0, draws, 0.95) == Band(1.0, pytest.approx(0.05), pytest.approx(1.95))
    assert _band(1.0, draws, 0.5) == Band(1.0, pytest.approx(0.5), pytest.approx(1.5))
    assert _band(3.0, draws, 0.95).high == 3.0  # the value is inside its band


def test_rules_at_their_limits_and_their_messages() -> None:
    assert interval_rejection(_intervals([0.25] * 4), max_mean_width=0.25) is None
    both = interval_rejection(_intervals([0.6, 0.6, 0.6, 0.6], samples=2))
    assert both == (
        "2 repeat(s) at a length cannot bound its median (at least 3 are needed; raise "
        "--repeats); mean prediction-interval half-width 60.0% is above the 20% bound; "
        "widest prediction-interval half-width 60.0% is above the 50% bound (noisy samples: "
        "measure again on a quieter host or with more --repeats)"
    )
    # Too few repeats of clean samples are not noise: the message says what to raise.
    assert interval_rejection(_intervals([0.1] * 4, samples=2)) == (
        "2 repeat(s) at a length cannot bound its median (at least 3 are needed; raise --repeats)"
    )
    assert ttft_rejection(_fit_with([0.6, 0.6])) == (
        "mean error 60.0% is above the 20% bound; worst-point error 60.0% (at 100 tokens) is "
        "above the 50% bound"
    )
    two = [DecodePoint(n, kv, 0.01) for n, kv in ((1, 100), (1, 200), (4, 100), (4, 200))]
    assert decode_fit_problem(two) is None  # two values on each axis are enough
    same_active = [DecodePoint(4, kv, 0.01) for kv in (1, 2, 3, 4)]
    assert decode_fit_problem(same_active) == (
        "the usable cells measure only one active-request count; the fit needs two")
    same_kv = [DecodePoint(n, 100, 0.01) for n in (1, 2, 3, 4)]
    assert decode_fit_problem(same_kv) == (
        "the usable cells measure only one resident-KV size; the fit needs two")
    with pytest.raises(ValueError, match="only one resident-KV size"):
        fit_decode(same_kv)
    points = _grid(0.005, 0.001, 1e-7)
    fit = fit_decode(points)
    assert fit.points == tuple(points) and len(fit.predicted) == len(points)
    assert tpot_kv_limit(0.01, 0.001, 1e-6, tpot_s=0.02, active=10) is None  # no room left
    assert tpot_kv_limit(0.01, 0.001, 1e-6, tpot_s=0.03, active=10) == pytest.approx(10_000)


def test_relative_least_squares_and_the_error_figure() -> None:
    with pytest.raises(ValueError, match=r"^relative least squares needs positive observations$"):
        nonneg_lstsq(np.array([[1.0, 1.0], [1.0, 2.0]]), np.array([0.0, 1.0]))
    # A column of zeros (no KV measured) gets a zero coefficient, the rest are solved.
    x = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 0.0], [1.0, 4.0, 0.0]])
    coef = nonneg_lstsq(x, np.array([3.0, 5.0, 9.0]))
    assert coef == pytest.approx([1.0, 2.0, 0.0])
    from narwhal.profile.fit import mape

    assert mape([1.1, 2.2, 2.0], [1.0, 2.0, 2.0]) == pytest.approx(0.2 / 3)
    assert mape([], []) == 0.0


def test_mape_refuses_series_of_unequal_length() -> None:
    assert mape([1.1, 1.8], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        mape([1.0], [1.0, 2.0])


def test_no_more_ratios_than_coefficients_are_pooled_as_they_are() -> None:
    """The widening by sqrt(n / (n - dof)) needs more ratios than coefficients; with as
    many, the ratios are drawn unwidened (no division by zero)."""
    from narwhal.profile.fit import _residual_bootstrap

    x = np.array([[1.0, 1.0], [1.0, 2.0]])
    coefs = _residual_bootstrap(x, [3.0, 5.0], [1, 1], [1.0, 1.2], resamples=40, seed=1)
    rng = np.random.default_rng(1)
    expected = [nonneg_lstsq(x, np.array([3.0 * rng.choice([1.0, 1.2]), 5.0 * rng.choice([1.0, 1.2])]))
                for _ in range(40)]  # fmt: skip
    assert coefs == pytest.approx(np.array(expected))
    # One more ratio: widened by sqrt(3 / 1) about 1.
    wide = _residual_bootstrap(x, [3.0, 5.0], [1, 1], [1.0, 1.2, 0.8], resamples=40, seed=1)
    rng = np.random.default_rng(1)
    ratios = 1.0 + (np.array([1.0, 1.2, 0.8]) - 1.0) * np.sqrt(3.0)
    expected = [nonneg_lstsq(x, np.array([3.0 * rng.choice(ratios), 5.0 * rng.choice(ratios)]))
                for _ in range(40)]  # fmt: skip
    assert wide == pytest.approx(np.array(expected))


def test_a_bootstrap_keeps_the_seed_it_was_made_with() -> None:
    repeats = [(128, 0.03), (256, 0.035), (512, 0.05), (1024, 0.09)]
    fit = fit_ttft(median_by_length(repeats))
    intervals = bootstrap_ttft(repeats, fit, resamples=20, seed=11)
    assert (intervals.seed, intervals.resamples, intervals.min_samples) == (11, 20, 1)


def _cells(noise: float, wobble: float = 1.0, seed: int = 7) -> list[list[dict[str, float]]]:
    """Window intervals of six decode cells: three streams of unequal length in each,
    with the load seen by each interval varying (by ``wobble``) around the cell's."""
    rng = np.random.default_rng(seed)
    cells = []
    for n, length in itertools.product((1, 4, 8), (256, 1024)):
        cell = []
        for stream, count in ((3, 5), (7, 3), (11, 4)):
            for i in range(count):
                active, kv = n + wobble * 0.25 * (i % 2), n * (length + 20) + wobble * 40.0 * i
                tpot = (0.005 + 0.0008 * active + 2e-7 * kv) * float(np.exp(rng.normal(0, noise)))
                cell.append({"stream": stream, "seconds": tpot, "active": active, "kv_tokens": kv})
        cells.append(cell)
    return cells


def _decode_fit(cells: list[list[dict[str, float]]]) -> DecodeFit:
    return fit_decode([DecodePoint(a, k, t) for t, a, k in map(cell_figures, cells)])


def test_the_decode_bootstrap_is_the_documented_window_bootstrap() -> None:
    """An independent rendering, draw for draw: in every cell one draw of window positions
    for all its streams, each stream's own intervals at those positions, TPOT the median of
    the streams' mean interval, the load the mean over every drawn interval; a refit with an
    intercept of one; percentile bands at the given level of as many resamples as asked,
    stored with how they were made."""
    cells = _cells(0.1)
    fit = _decode_fit(cells)
    iv = bootstrap_decode(cells, fit, resamples=60, level=0.8, seed=5)
    assert (iv.resamples, iv.level, iv.seed, iv.min_samples) == (60, 0.8, 5, 12)
    rng = np.random.default_rng(5)
    coefs = []
    for _ in range(60):
        x, y = [], []
        for cell in cells:
            streams = [[c for c in cell if c["stream"] == s] for s in (3, 7, 11)]
            u = rng.random(max(len(s) for s in streams))
            drawn = [[s[int(v * len(s))] for v in u[: len(s)]] for s in streams]
            y.append(float(np.median([np.mean([c["seconds"] for c in d]) for d in drawn])))
            load = np.mean([[c["active"], c["kv_tokens"]] for d in drawn for c in d], axis=0)
            x.append([1.0, *load])
        coefs.append(nonneg_lstsq(np.array(x), np.array(y)))
    draws = np.array(coefs)
    for i, key in enumerate(("c0", "c1", "c2")):
        low, high = np.percentile(draws[:, i], [10, 90])
        band = iv.coefficients[key]
        assert band.value == (fit.c0, fit.c1, fit.c2)[i]
        assert (band.low, band.high) == pytest.approx((min(low, band.value), max(high, band.value)))
    corners = [(p.active, p.kv_tokens) for p in fit.points] + [(fit.active_max, fit.kv_max)]
    points = [{"active": a, "kv_tokens": k} for a, k in corners]
    assert [point for point, _ in iv.predictions] == points
    for (a, k), (_, band) in zip(corners, iv.predictions, strict=True):
        low, high = np.percentile(draws @ np.array([1.0, a, k]), [10, 90])
        assert band.value == fit.predict(a, k)
        assert (band.low, band.high) == pytest.approx((min(low, band.value), max(high, band.value)))


def test_noise_free_decode_cells_give_bands_that_are_their_point_values() -> None:
    cells = _cells(0.0, wobble=0.0)
    fit = _decode_fit(cells)
    iv = bootstrap_decode(cells, fit, resamples=20)
    for band in [*iv.coefficients.values(), *(b for _, b in iv.predictions)]:
        assert (band.low, band.high) == pytest.approx((band.value, band.value), rel=1e-6, abs=1e-12)


def test_a_decode_cell_is_the_median_stream_and_the_mean_load() -> None:
    def iv(stream: int, seconds: float, active: float, kv: float) -> dict[str, float]:
        return {"stream": stream, "seconds": seconds, "active": active, "kv_tokens": kv}

    # Per-stream means 0.01, 0.03 and 0.02: the median is 0.02; pooling the seven
    # intervals would give 0.11 / 7.
    cell = [iv(0, 0.01, 3, 100), iv(0, 0.01, 3, 100), iv(0, 0.01, 3, 100), iv(0, 0.01, 3, 100),
            iv(1, 0.03, 2, 300), iv(2, 0.02, 1, 200), iv(2, 0.02, 1, 200)]  # fmt: skip
    assert cell_figures(cell) == pytest.approx((0.02, 16 / 7, 1100 / 7))
    with pytest.raises(ValueError, match=r"^a decode cell needs at least one interval$"):
        cell_figures([])
