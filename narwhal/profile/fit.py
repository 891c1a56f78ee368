"""Profile fits: the TTFT curve, the NNLS decode model, leave-one-cell-out validation.

TTFT curve: ``ttft(L) = a + b*L + c*L**2`` with ``a, b, c >= 0``, fitted to the median
latency at each exact prompt length. It is the shape prefill has (a fixed cost per
request, work linear in L in the projections and MLP, attention quadratic in L); with
non-negative coefficients it is never negative and never decreases for L >= 0, so a
router pricing a longer prompt is never told it is cheaper. Both fits minimise
*relative* residuals, because their acceptance bounds are relative errors.

Decode model: ``tpot = c0 + c1*active + c2*resident_kv_tokens`` with every coefficient
non-negative (``scipy.optimize.nnls``), fitted to cell medians; leave-one-cell-out
refits without each cell (non-negative as well) and predicts it.

Cached prefixes: ``ttft(L, k) = a + b*(L-k) + c*(L**2 - k**2) + d*k`` for a prompt of L
tokens whose first k are served from the engine's prefix cache, fitted (non-negative,
relative residuals) to the median at every ``(L, k)`` cell, the plain prefill sweep's
lengths being the cells with ``k = 0``; leave-one-cell-out refits without each cell and
predicts it (see :class:`CachedFit`).

Out of sample: with three lengths a three-coefficient curve passes through the medians
exactly, so its in-sample errors prove nothing. :func:`fit_ttft` therefore also fits
the curve without each length and predicts that length (leave-one-length-out; at least
:data:`MIN_PREFILL_LENGTHS` lengths, so every fold has three points for three
coefficients). The acceptance bounds apply to the interior lengths' errors: there the
held-out curve interpolates, as placement does inside the swept range. Holding out the
shortest or the longest length extrapolates a quadratic from three points, which
magnifies the measurement noise of its anchors (on a loaded host, 10 % noise in the
medians gave 50-120 % endpoint errors for a curve whose in-sample error was 3 %); those
errors are recorded per length and not gated (beyond the swept range placement prices
at the curve's upper bound when told to, see below).

Uncertainty: :func:`bootstrap_ttft` and :func:`bootstrap_decode` resample the raw
measurements, refit, and give percentile intervals per coefficient and per prediction
at the operating points (every swept length; every decode cell and the far corner of
the decode domain). Prefill: a residual bootstrap; every repeat's ratio to the fitted
curve is pooled over the lengths, and each resample draws, at every length, as many
ratios as were measured there, scales the curve by their median and refits: an
interval of the fitted curve (of medians), not of single requests, that one stalled
request among a handful of repeats at one length cannot blow up (a per-length
bootstrap of three or five repeats spans nearly their whole range). In simulation
with 2-10 % noise and 3-5 repeats at four lengths the intervals covered the true
coefficients and predictions 92-95 % of the time.
Decode: the window intervals are drawn within each stream of each cell. The resampling
is seeded, so the same samples give the same intervals, and a preflight can recompute
them. :func:`interval_rejection` applies the prefill bounds to the TTFT intervals' mean
and widest relative half-width over the swept lengths, and refuses intervals made from
fewer than :data:`MIN_INTERVAL_REPEATS` repeats at a length.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs
import numpy as np
from scipy.optimize import nnls

__all__ = [
    "BOOTSTRAP_LEVEL",
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "CACHED_MODEL",
    "DEFAULT_MAX_MEAN_ERROR",
    "DEFAULT_MAX_WORST_ERROR",
    "MIN_CACHED_CELLS",
    "MIN_DECODE_CELLS",
    "MIN_INTERVAL_REPEATS",
    "MIN_PREFILL_LENGTHS",
    "TPOT_MODEL",
    "TTFT_MODEL",
    "Band",
    "CachedFit",
    "DecodeFit",
    "DecodePoint",
    "Intervals",
    "TTFTFit",
    "bootstrap_cached",
    "bootstrap_decode",
    "bootstrap_ttft",
    "cached_fit_problem",
    "cached_prefill_s",
    "cached_rejection",
    "cell_figures",
    "decode_fit_problem",
    "fit_cached",
    "fit_decode",
    "fit_ttft",
    "interval_rejection",
    "mape",
    "median_by_length",
    "nonneg_lstsq",
    "samples_by_cell",
    "tpot_kv_limit",
    "ttft_rejection",
]

TTFT_MODEL: Final = "a + b*L + c*L^2"
TPOT_MODEL: Final = "c0 + c1*active + c2*resident_kv_tokens"
CACHED_MODEL: Final = "a + b*(L-k) + c*(L^2-k^2) + d*k"
#: Cells with a cached prefix a cached-prefix fit needs (every leave-one-cell-out fold
#: keeps two to set the cached-token coefficient and check it).
MIN_CACHED_CELLS: Final = 3
#: The prefill validation bounds (the seed's section 4).
DEFAULT_MAX_MEAN_ERROR: Final = 0.20
DEFAULT_MAX_WORST_ERROR: Final = 0.50
#: Lengths a TTFT fit needs: leave-one-length-out then fits three coefficients to three.
MIN_PREFILL_LENGTHS: Final = 4
MIN_DECODE_CELLS: Final = 4
#: Bootstrap resamples, confidence level and seed (fixed: the same samples give the same
#: intervals, so a preflight can recompute them).
BOOTSTRAP_RESAMPLES: Final = 200
BOOTSTRAP_LEVEL: Final = 0.95
BOOTSTRAP_SEED: Final = 16
#: Fewest repeats at every prefill length for its interval to mean anything (one repeat
#: resamples to itself, two to their mean: a zero or arbitrary width).
MIN_INTERVAL_REPEATS: Final = 3


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> np.ndarray:
    """Least squares with every coefficient >= 0 (NNLS), on relative residuals by default.

    Columns are scaled to unit maximum before solving (``L**2`` is many orders of
    magnitude above the constant column) and the solution is scaled back. Integer
    arrays are solved as floats: every step before ``nnls`` divides, and ``nnls``
    solves in float64.
    """
    a = np.asarray(x)
    b = np.asarray(y)
    if relative:
        if np.any(b <= 0):
            raise ValueError("relative least squares needs positive observations")
        a = a / b[:, None]
        b = np.ones_like(b)
    scale = np.max(np.abs(a), axis=0)
    scale[scale == 0] = 1.0  # pragma: no mutate (equivalent: a zero column's coefficient is 0 whatever its scale)
    solution, _ = nnls(a / scale, b)
    coef: np.ndarray = np.maximum(solution / scale, 0.0)
    return coef


def mape(predicted: Iterable[float], observed: Iterable[float]) -> float:
    """Mean absolute percentage error, as a fraction."""
    errors = [abs(p - o) / o for p, o in zip(predicted, observed, strict=True)]
    return float(statistics.fmean(errors)) if errors else 0.0


def median_by_length(samples: Iterable[tuple[int, float]]) -> dict[int, float]:
    """The median latency at each exact length, lengths ascending."""
    by_length: dict[int, list[float]] = {}
    for length, seconds in samples:
        by_length.setdefault(length, []).append(seconds)
    return {n: float(statistics.median(by_length[n])) for n in sorted(by_length)}


# ------------------------------------------------------------------ TTFT


@attrs.frozen
class TTFTFit:
    """A TTFT curve fitted to per-length medians, with its errors at those points.

    Attributes:
        a, b, c: coefficients of ``a + b*L + c*L**2`` (seconds), all >= 0.
        lengths: the fitted lengths, ascending.
        medians: the median TTFT at each length.
        predicted: the curve at each length.
        errors: ``|predicted - median| / median`` at each length.
        mean_error: mean of ``errors``.
        worst_error: largest of ``errors``.
        loo_predicted: each length predicted by the curve fitted without it.
        loo_errors: relative errors of ``loo_predicted`` (at the shortest and the
            longest length an extrapolation: recorded, not gated).
        loo_mean_error, loo_worst_error: mean and largest of ``loo_errors`` at the
            interior lengths, where the held-out curve interpolates (the gated figures).
    """

    a: float
    b: float
    c: float
    lengths: tuple[int, ...]
    medians: tuple[float, ...]
    predicted: tuple[float, ...]
    errors: tuple[float, ...]
    mean_error: float
    worst_error: float
    loo_predicted: tuple[float, ...] = ()
    loo_errors: tuple[float, ...] = ()
    loo_mean_error: float = 0.0
    loo_worst_error: float = 0.0

    def predict(self, length: float) -> float:
        """The curve at ``length`` tokens, seconds."""
        return self.a + self.b * length + self.c * length * length

    @property
    def worst_length(self) -> int:
        """The length with the largest error."""
        return self.lengths[int(np.argmax(self.errors))]

    @property
    def loo_worst_length(self) -> int:
        """The interior length with the largest leave-one-length-out error."""
        return self.lengths[1 + int(np.argmax(self.loo_errors[1:-1]))]

    def as_dict(self) -> dict[str, object]:
        """The JSON form kept in the sidecar."""
        return {
            "model": TTFT_MODEL,
            "coefficients": {"a": self.a, "b": self.b, "c": self.c},
            "points": [
                {"length": n, "median_s": m, "predicted_s": p, "error": e,
                 "loo_predicted_s": lp, "loo_error": le,
                 "loo_kind": "interpolation" if 0 < i < len(self.lengths) - 1
                 else "extrapolation"}
                for i, (n, m, p, e, lp, le) in enumerate(zip(
                    self.lengths, self.medians, self.predicted, self.errors,
                    self.loo_predicted, self.loo_errors, strict=True,  # pragma: no mutate (equivalent: the six series are built one per length)
                ))
            ],
            "mean_error": self.mean_error,
            "worst_error": self.worst_error,
            "loo_mean_error": self.loo_mean_error,
            "loo_worst_error": self.loo_worst_error,
        }


def _ttft_design(lengths: Sequence[int]) -> np.ndarray:
    n = np.array(lengths, dtype=float)  # squared in float64: an int64 L*L wraps past 3e9 tokens
    return np.column_stack([np.ones_like(n), n, n * n])


def _relative_errors(predicted: Sequence[float], observed: Sequence[float]) -> tuple[float, ...]:
    return tuple(abs(p - y) / y for p, y in zip(predicted, observed, strict=True))  # pragma: no mutate (equivalent: fit_ttft passes a fit and its medians, one per length)


def _fit_holding_out(x: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, tuple[float, ...], tuple[float, ...]]:
    """The non-negative fit of ``ys`` on ``x``, its predictions at every row, and each
    row predicted by the fit without it."""
    coef = nonneg_lstsq(x, ys)
    loo = []
    for i in range(len(ys)):
        keep = np.arange(len(ys)) != i
        loo.append(float(x[i] @ nonneg_lstsq(x[keep], ys[keep])))
    return coef, tuple(float(v) for v in x @ coef), tuple(loo)


def fit_ttft(medians: Mapping[int, float]) -> TTFTFit:
    """Fit ``a + b*L + c*L**2`` (non-negative) to per-length median TTFTs, and each
    length out of sample (the curve fitted to the other lengths).

    Raises:
        ValueError: fewer than :data:`MIN_PREFILL_LENGTHS` lengths, or a non-positive median.
    """
    lengths = tuple(sorted(medians))
    if len(lengths) < MIN_PREFILL_LENGTHS:
        raise ValueError(
            f"a TTFT fit needs at least {MIN_PREFILL_LENGTHS} lengths, got {len(lengths)}"
        )
    ys = np.array([medians[n] for n in lengths], dtype=float)
    x = _ttft_design(lengths)
    coef, predicted, loo = _fit_holding_out(x, ys)
    a, b, c = (float(v) for v in coef)
    observed = ys.tolist()
    errors = _relative_errors(predicted, observed)
    loo_errors = _relative_errors(loo, observed)
    return TTFTFit(
        a=a,
        b=b,
        c=c,
        lengths=lengths,
        medians=tuple(observed),
        predicted=predicted,
        errors=errors,
        mean_error=float(statistics.fmean(errors)),
        worst_error=max(errors),
        loo_predicted=loo,
        loo_errors=loo_errors,
        loo_mean_error=float(statistics.fmean(loo_errors[1:-1])),
        loo_worst_error=max(loo_errors[1:-1]),
    )


def ttft_rejection(
    fit: TTFTFit,
    *,
    max_mean_error: float = DEFAULT_MAX_MEAN_ERROR,
    max_worst_error: float = DEFAULT_MAX_WORST_ERROR,
) -> str | None:
    """Why a TTFT curve must be rejected, or None if it passes.

    Either bound exceeded, in sample or leave-one-length-out at the interior lengths (a
    curve through the medians that cannot predict a length it did not see is no curve
    to price with).
    """
    reasons = []
    if fit.mean_error > max_mean_error:
        reasons.append(f"mean error {fit.mean_error:.1%} is above the {max_mean_error:.0%} bound")
    if fit.worst_error > max_worst_error:
        reasons.append(
            f"worst-point error {fit.worst_error:.1%} (at {fit.worst_length} tokens) is above "
            f"the {max_worst_error:.0%} bound"
        )
    if fit.loo_errors and fit.loo_mean_error > max_mean_error:
        reasons.append(f"leave-one-length-out mean error {fit.loo_mean_error:.1%} (interior "
                       f"lengths) is above the {max_mean_error:.0%} bound")  # fmt: skip
    if fit.loo_errors and fit.loo_worst_error > max_worst_error:
        reasons.append(
            f"leave-one-length-out worst error {fit.loo_worst_error:.1%} (at "
            f"{fit.loo_worst_length} tokens) is above the {max_worst_error:.0%} bound"
        )
    return "; ".join(reasons) if reasons else None


def interval_rejection(
    intervals: Intervals,
    *,
    max_mean_width: float = DEFAULT_MAX_MEAN_ERROR,
    max_worst_width: float = DEFAULT_MAX_WORST_ERROR,
    min_samples: int = MIN_INTERVAL_REPEATS,
) -> str | None:
    """Why a TTFT curve's intervals show it is not known well enough, or None.

    The prefill bounds applied to the relative half-width of the curve's prediction
    interval at the swept lengths (their mean and the widest), and at least
    ``min_samples`` repeats at every length (fewer give no interval worth the name).
    """
    reasons = []
    if intervals.min_samples < min_samples:
        reasons.append(f"{intervals.min_samples} repeat(s) at a length cannot bound its median "
                       f"(at least {min_samples} are needed; raise --repeats)")  # fmt: skip
    too_few = len(reasons)
    if intervals.mean_half_width > max_mean_width:
        reasons.append(f"mean prediction-interval half-width {intervals.mean_half_width:.1%} is "
                       f"above the {max_mean_width:.0%} bound")  # fmt: skip
    if intervals.worst_half_width > max_worst_width:
        reasons.append(f"widest prediction-interval half-width {intervals.worst_half_width:.1%} "
                       f"is above the {max_worst_width:.0%} bound")  # fmt: skip
    if len(reasons) > too_few:  # a width tripped: the samples scatter (too few repeats alone do not)
        reasons[-1] += " (noisy samples: measure again on a quieter host or with more --repeats)"
    return "; ".join(reasons) if reasons else None


# ------------------------------------------------------------------ intervals


@attrs.frozen
class Band:
    """A point estimate and its percentile interval."""

    value: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}

    @property
    def relative_half_width(self) -> float:
        """The larger distance from the value to an end, relative to the value."""
        if self.value <= 0:
            return 0.0 if self.high <= 0 else math.inf
        return max(self.high - self.value, self.value - self.low) / self.value


@attrs.frozen
class Intervals:
    """Bootstrap intervals of one fit.

    Attributes:
        coefficients: per coefficient name.
        predictions: ``(operating point, band)``; the point is ``{"length": L}`` or
            ``{"active": a, "kv_tokens": k}``.
        min_samples: the fewest raw samples behind one operating point's figure
            (repeats at a length; intervals of a decode cell).
        resamples, level, seed: how they were made.
    """

    coefficients: dict[str, Band]
    predictions: tuple[tuple[dict[str, float], Band], ...]
    min_samples: int
    resamples: int = BOOTSTRAP_RESAMPLES
    level: float = BOOTSTRAP_LEVEL
    seed: int = BOOTSTRAP_SEED

    @property
    def upper_factor(self) -> float:
        """The largest ``high / value`` over the operating points (>= 1): a conservative
        price is the point prediction times this."""
        ratios = [b.high / b.value for _, b in self.predictions if b.value > 0]
        return max([1.0, *ratios])

    @property
    def worst_half_width(self) -> float:
        """The largest relative half-width of a prediction interval."""
        return max((b.relative_half_width for _, b in self.predictions), default=0.0)

    @property
    def mean_half_width(self) -> float:
        """The mean relative half-width of the prediction intervals."""
        widths = [b.relative_half_width for _, b in self.predictions]
        return float(statistics.fmean(widths)) if widths else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "method": "percentile bootstrap of the raw samples, refitted",
            "resamples": self.resamples,
            "level": self.level,
            "seed": self.seed,
            "coefficients": {k: b.as_dict() for k, b in self.coefficients.items()},
            "predictions": [p | b.as_dict() for p, b in self.predictions],
            "min_samples": self.min_samples,
            "upper_factor": self.upper_factor,
            "mean_half_width": self.mean_half_width,
            "worst_half_width": self.worst_half_width,
        }


def _band(value: float, draws: np.ndarray, level: float) -> Band:
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    # The point estimate is inside its interval by construction (a percentile interval
    # of a skewed statistic can miss it).
    return Band(float(value), float(min(low, value)), float(max(high, value)))


def _residual_bootstrap(
    x: np.ndarray,
    predicted: Sequence[float],
    counts: Sequence[int],
    ratios: Sequence[float],
    *,
    resamples: int,
    seed: int,
) -> np.ndarray:
    """Refitted coefficients of ``resamples`` residual-bootstrap draws (one row each).

    Every measured repeat's ratio to the fit at its operating point is pooled; each
    resample draws, at every point (row of ``x``), as many ratios as were measured there,
    scales the fit's prediction there by their median and refits.
    """
    pooled = np.array(ratios)
    dof = x.shape[1]
    # Residuals of a fit are smaller than the noise they estimate (the fit took ``dof``
    # degrees of freedom): the usual correction widens them by sqrt(n / (n - dof)).
    if len(pooled) > dof:
        pooled = 1.0 + (pooled - 1.0) * math.sqrt(len(pooled) / (len(pooled) - dof))
    rng = np.random.default_rng(seed)
    coefs = np.empty((resamples, dof))
    for r in range(resamples):
        points = zip(predicted, counts, strict=True)  # pragma: no mutate (equivalent: one count per operating point, as predicted)
        ys = np.array([p * float(np.median(rng.choice(pooled, size=k))) for p, k in points])
        coefs[r] = nonneg_lstsq(x, ys)
    return coefs


def bootstrap_ttft(
    repeats: Sequence[tuple[int, float]],
    fit: TTFTFit,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = BOOTSTRAP_LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> Intervals:
    """Intervals of the TTFT coefficients and of the curve at every swept length.

    A residual bootstrap: every repeat's ratio to the fitted curve at its length is
    pooled over the lengths (widened for the fit's three degrees of freedom); each
    resample draws, at every length, as many ratios as were measured there (with
    replacement), scales the curve at that length by their median and refits.
    """
    counts = [sum(1 for length, _ in repeats if length == n) for n in fit.lengths]
    ratios = [s / fit.predict(length) for length, s in repeats if length in fit.lengths]
    x = _ttft_design(fit.lengths)
    coefs = _residual_bootstrap(x, fit.predicted, counts, ratios, resamples=resamples, seed=seed)
    point = np.array([fit.a, fit.b, fit.c])
    coefficients = {k: _band(point[i], coefs[:, i], level) for i, k in enumerate("abc")}
    predictions = tuple(
        ({"length": float(n)}, _band(fit.predict(n), coefs @ x[i], level))
        for i, n in enumerate(fit.lengths)
    )
    return Intervals(coefficients, predictions, min(counts), resamples, level, seed)


# ------------------------------------------------------------------ cached prefixes


@attrs.frozen
class CachedFit:
    """Prefill with a cached prefix, fitted to per-cell medians, with its validation.

    The model is :data:`CACHED_MODEL`: a prompt of ``L`` tokens of which the first ``k``
    are served from the prefix cache costs ``a + b*(L-k) + c*(L**2 - k**2) + d*k``
    seconds. ``b`` pays each computed token, ``c`` the attention pairs the computed
    tokens add (over the cached prefix and one another), ``d`` whatever a cached token
    still costs (looking it up, reading it); with ``k = 0`` it is the TTFT curve's form.
    Cells are ``(L, k)``; those with ``k = 0`` are the plain prefill sweep's lengths.

    Attributes:
        a, b, c, d: coefficients (seconds), all >= 0.
        cells: the fitted cells ``(L, k)``, sorted.
        medians: the median TTFT of each cell.
        counts: repeats behind each median.
        predicted: the fit at each cell.
        errors: relative errors of ``predicted``.
        mean_error, worst_error: their mean and largest over every cell.
        loo_predicted: each cell predicted by the fit that left it out.
        loo_errors: their relative errors.
        loo_mean_error, loo_worst_error: mean and largest of ``loo_errors`` over the
            cached cells (``k > 0``; the plain lengths are validated by the TTFT curve).
    """

    a: float
    b: float
    c: float
    d: float
    cells: tuple[tuple[int, int], ...]
    medians: tuple[float, ...]
    counts: tuple[int, ...]
    predicted: tuple[float, ...]
    errors: tuple[float, ...]
    mean_error: float
    worst_error: float
    loo_predicted: tuple[float, ...]
    loo_errors: tuple[float, ...]
    loo_mean_error: float
    loo_worst_error: float

    def predict(self, length: float, cached: float) -> float:
        """TTFT in seconds of ``length`` prompt tokens, the first ``cached`` of them cached."""
        return cached_prefill_s(self.a, self.b, self.c, self.d, length, cached)

    def _worst(self, errors: Sequence[float], *, only_cached: bool = False) -> tuple[int, int]:
        pool = [(e, cell) for e, cell in zip(errors, self.cells,
                                             strict=True)  # pragma: no mutate (equivalent: one error per cell)
                if cell[1] > 0 or not only_cached]  # fmt: skip
        return max(pool)[1]

    def as_dict(self) -> dict[str, object]:
        """The JSON form kept in the sidecar."""
        return {
            "model": CACHED_MODEL,
            "coefficients": {"a": self.a, "b": self.b, "c": self.c, "d": self.d},
            "points": [
                {"length": n, "cached": k, "median_s": m, "repeats": r, "predicted_s": p,
                 "error": e, "loo_predicted_s": lp, "loo_error": le}
                for (n, k), m, r, p, e, lp, le in zip(
                    self.cells, self.medians, self.counts, self.predicted, self.errors,
                    self.loo_predicted, self.loo_errors,
                    strict=True,  # pragma: no mutate (equivalent: the seven series are built one per cell)
                )
            ],
            "mean_error": self.mean_error,
            "worst_error": self.worst_error,
            "loo_mean_error": self.loo_mean_error,
            "loo_worst_error": self.loo_worst_error,
            "loo_scope": "cells with a cached prefix (k > 0)",
        }  # fmt: skip


def cached_prefill_s(a: float, b: float, c: float, d: float, length: float, cached: float) -> float:
    """:data:`CACHED_MODEL` at ``(length, cached)``, seconds."""
    return a + b * (length - cached) + c * (length * length - cached * cached) + d * cached


def _cached_design(cells: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.array([[1.0, n - k, n * n - k * k, k] for n, k in cells])  # float64: the 1.0


def samples_by_cell(samples: Iterable[tuple[int, int, float]]) -> dict[tuple[int, int], list[float]]:
    """The samples ``(length, cached, seconds)`` grouped by cell, cells sorted."""
    by_cell: dict[tuple[int, int], list[float]] = {}
    for length, cached, seconds in samples:
        by_cell.setdefault((length, cached), []).append(seconds)
    return {cell: by_cell[cell] for cell in sorted(by_cell)}


def cached_fit_problem(cells: Iterable[tuple[int, int]]) -> str | None:
    """Why these cells cannot support a cached-prefix fit, or None."""
    cells = list(cells)
    plain = {n for n, k in cells if k == 0}
    cached = [(n, k) for n, k in cells if k > 0]
    if len(plain) < MIN_PREFILL_LENGTHS:
        return (f"{len(plain)} lengths without a cached prefix; the fit needs at least "
                f"{MIN_PREFILL_LENGTHS}")  # fmt: skip
    if len(cached) < MIN_CACHED_CELLS:
        return f"{len(cached)} cells with a cached prefix; the fit needs at least {MIN_CACHED_CELLS}"
    return None


def fit_cached(samples: Sequence[tuple[int, int, float]]) -> CachedFit:
    """Fit :data:`CACHED_MODEL` (non-negative, relative residuals) to the median of the
    samples ``(length, cached, seconds)`` at every cell, and each cell out of sample.

    Raises:
        ValueError: the cells cannot support a fit (:func:`cached_fit_problem`), or a
            non-positive median.
    """
    grouped = samples_by_cell(samples)
    problem = cached_fit_problem(grouped)
    if problem is not None:
        raise ValueError(problem)
    cells = tuple(grouped)
    ys = np.array([statistics.median(grouped[cell]) for cell in cells], dtype=float)
    x = _cached_design(cells)
    coef, predicted, loo = _fit_holding_out(x, ys)
    observed = ys.tolist()
    errors = _relative_errors(predicted, observed)
    loo_errors = _relative_errors(loo, observed)
    gated = [e for e, (_, k) in zip(loo_errors, cells,
                                    strict=True)  # pragma: no mutate (equivalent: one error per cell)
             if k > 0]  # fmt: skip
    a, b, c, d = (float(v) for v in coef)
    return CachedFit(
        a=a, b=b, c=c, d=d, cells=cells, medians=tuple(observed),
        counts=tuple(len(grouped[cell]) for cell in cells), predicted=predicted,
        errors=errors, mean_error=float(statistics.fmean(errors)), worst_error=max(errors),
        loo_predicted=loo, loo_errors=loo_errors,
        loo_mean_error=float(statistics.fmean(gated)), loo_worst_error=max(gated),
    )  # fmt: skip


def cached_rejection(
    fit: CachedFit,
    *,
    max_mean_error: float = DEFAULT_MAX_MEAN_ERROR,
    max_worst_error: float = DEFAULT_MAX_WORST_ERROR,
) -> str | None:
    """Why a cached-prefix fit must be rejected (the prefill bounds, in sample and
    leave-one-cell-out over the cached cells), or None."""
    reasons = []
    if fit.mean_error > max_mean_error:
        reasons.append(f"mean error {fit.mean_error:.1%} is above the {max_mean_error:.0%} bound")
    if fit.worst_error > max_worst_error:
        n, k = fit._worst(fit.errors)
        reasons.append(f"worst-cell error {fit.worst_error:.1%} (at {n} tokens, {k} cached) is "
                       f"above the {max_worst_error:.0%} bound")  # fmt: skip
    if fit.loo_mean_error > max_mean_error:
        reasons.append(f"leave-one-cell-out mean error {fit.loo_mean_error:.1%} (cached cells) "
                       f"is above the {max_mean_error:.0%} bound")  # fmt: skip
    if fit.loo_worst_error > max_worst_error:
        n, k = fit._worst(fit.loo_errors, only_cached=True)
        reasons.append(f"leave-one-cell-out worst error {fit.loo_worst_error:.1%} (at {n} "
                       f"tokens, {k} cached) is above the {max_worst_error:.0%} bound")  # fmt: skip
    return "; ".join(reasons) if reasons else None


def bootstrap_cached(
    samples: Sequence[tuple[int, int, float]],
    fit: CachedFit,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = BOOTSTRAP_LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> Intervals:
    """Intervals of the cached-prefix coefficients and of the fit at every cached cell
    (the residual bootstrap of :func:`bootstrap_ttft`, over cells)."""
    ratios = [s / fit.predict(n, k) for n, k, s in samples]
    x = _cached_design(fit.cells)
    coefs = _residual_bootstrap(x, fit.predicted, fit.counts, ratios, resamples=resamples, seed=seed)
    point = np.array([fit.a, fit.b, fit.c, fit.d])
    coefficients = {k: _band(point[i], coefs[:, i], level) for i, k in enumerate("abcd")}
    predictions = tuple(
        ({"length": float(n), "cached": float(k)}, _band(fit.predicted[i], coefs @ x[i], level))
        for i, (n, k) in enumerate(fit.cells) if k > 0
    )  # fmt: skip
    counts = [r for (_, k), r in zip(fit.cells, fit.counts,
                                     strict=True)  # pragma: no mutate (equivalent: one count per cell)
              if k > 0]  # fmt: skip
    return Intervals(coefficients, predictions, min(counts), resamples, level, seed)


# ------------------------------------------------------------------ decode


@attrs.frozen
class DecodePoint:
    """One kept decode cell as the fit sees it (its medians)."""

    active: float
    kv_tokens: float
    tpot_s: float


@attrs.frozen
class DecodeFit:
    """The decode model fitted to cell medians, with its validation.

    Attributes:
        c0, c1, c2: coefficients (seconds, seconds per active request, seconds per
            resident KV token), all >= 0.
        points: the fitted cells.
        predicted: the full fit at each cell.
        fit_mape: mean relative error of the full fit over the cells.
        cv_predicted: each cell predicted by the fit that left it out.
        cv_coefficients: ``(c0, c1, c2)`` of each leave-one-cell-out fit.
        cv_mape: mean relative error of the leave-one-cell-out predictions.
        active_min, active_max, kv_min, kv_max: the observed domain of both axes.
    """

    c0: float
    c1: float
    c2: float
    points: tuple[DecodePoint, ...]
    predicted: tuple[float, ...]
    fit_mape: float
    cv_predicted: tuple[float, ...]
    cv_coefficients: tuple[tuple[float, float, float], ...]
    cv_mape: float
    active_min: float
    active_max: float
    kv_min: float
    kv_max: float

    def predict(self, active: float, kv_tokens: float) -> float:
        """Predicted TPOT, seconds."""
        return self.c0 + self.c1 * active + self.c2 * kv_tokens

    def as_dict(self) -> dict[str, object]:
        """The JSON form kept in the sidecar."""
        return {
            "model": TPOT_MODEL,
            "coefficients": {"c0": self.c0, "c1": self.c1, "c2": self.c2},
            "fit_mape": self.fit_mape,
            "cv_mape": self.cv_mape,
            "points": [
                {
                    "active": p.active,
                    "kv_tokens": p.kv_tokens,
                    "tpot_s": p.tpot_s,
                    "predicted_s": f,
                    "cv_predicted_s": cv,
                    "cv_coefficients": {"c0": k[0], "c1": k[1], "c2": k[2]},
                }
                for p, f, cv, k in zip(
                    self.points,
                    self.predicted,
                    self.cv_predicted,
                    self.cv_coefficients,
                    strict=True,  # pragma: no mutate (equivalent: the four series are built one per cell)
                )
            ],
            "domain": {
                "active": {"min": self.active_min, "max": self.active_max},
                "kv_tokens": {"min": self.kv_min, "max": self.kv_max},
            },
        }


def decode_fit_problem(points: Sequence[DecodePoint]) -> str | None:
    """Why these cells cannot support a decode fit, or None."""
    if len(points) < MIN_DECODE_CELLS:
        return f"{len(points)} usable decode cells; the fit needs at least {MIN_DECODE_CELLS}"
    if len({p.active for p in points}) < 2:
        return "the usable cells measure only one active-request count; the fit needs two"
    if len({p.kv_tokens for p in points}) < 2:
        return "the usable cells measure only one resident-KV size; the fit needs two"
    return None


def _design(points: Sequence[DecodePoint]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[1.0, p.active, p.kv_tokens] for p in points])  # float64: the 1.0
    y = np.array([p.tpot_s for p in points])
    return x, y


def fit_decode(points: Sequence[DecodePoint]) -> DecodeFit:
    """Fit the decode model (non-negative) and validate it leave-one-cell-out.

    Raises:
        ValueError: the cells cannot support a fit (see :func:`decode_fit_problem`).
    """
    problem = decode_fit_problem(points)
    if problem is not None:
        raise ValueError(problem)
    x, y = _design(points)
    coef = nonneg_lstsq(x, y)
    predicted = tuple(float(v) for v in x @ coef)
    cv_predicted: list[float] = []
    cv_coefficients: list[tuple[float, float, float]] = []
    for i in range(len(points)):
        keep = np.arange(len(points)) != i
        fold = nonneg_lstsq(x[keep], y[keep])
        cv_coefficients.append((float(fold[0]), float(fold[1]), float(fold[2])))
        cv_predicted.append(float(x[i] @ fold))
    observed = y.tolist()
    return DecodeFit(
        c0=float(coef[0]),
        c1=float(coef[1]),
        c2=float(coef[2]),
        points=tuple(points),
        predicted=predicted,
        fit_mape=mape(predicted, observed),
        cv_predicted=tuple(cv_predicted),
        cv_coefficients=tuple(cv_coefficients),
        cv_mape=mape(cv_predicted, observed),
        active_min=min(p.active for p in points),
        active_max=max(p.active for p in points),
        kv_min=min(p.kv_tokens for p in points),
        kv_max=max(p.kv_tokens for p in points),
    )


def cell_figures(intervals: Sequence[Mapping[str, float]]) -> tuple[float, float, float]:
    """A decode cell's ``(tpot_s, active, kv_tokens)`` from its window's intervals.

    TPOT is the median over streams of each stream's mean interval inside the window
    (the measurement contract's ``(last - first) / (n - 1)`` restricted to it); the
    load is the mean of the inferred active count and resident KV over the intervals.

    Raises:
        ValueError: no intervals.
    """
    if not intervals:
        raise ValueError("a decode cell needs at least one interval")
    spans: dict[int, list[float]] = {}
    for iv in intervals:
        spans.setdefault(int(iv["stream"]), []).append(float(iv["seconds"]))
    per_stream = [sum(g) / len(g) for _, g in sorted(spans.items())]
    return (
        float(statistics.median(per_stream)),
        float(statistics.fmean(float(iv["active"]) for iv in intervals)),
        float(statistics.fmean(float(iv["kv_tokens"]) for iv in intervals)),
    )


def bootstrap_decode(
    cells: Sequence[Sequence[Mapping[str, float]]],
    fit: DecodeFit,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = BOOTSTRAP_LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> Intervals:
    """Intervals of the decode coefficients and of TPOT at every cell and at the far
    corner of the domain (most active requests with the most resident KV).

    ``cells`` are the fitted cells' window intervals, in the order of ``fit.points``.
    Each resample draws, in every cell, window positions with replacement and takes
    every stream's intervals at those positions (as many as it had), recomputes each
    cell's figures (:func:`cell_figures`) and refits.
    """
    rng = np.random.default_rng(seed)
    rows = [
        [np.array([[iv["seconds"], iv["active"], iv["kv_tokens"]] for iv in cell
                   if iv["stream"] == stream])
         for stream in sorted({iv["stream"] for iv in cell})]
        for cell in cells
    ]  # fmt: skip
    coefs = np.empty((resamples, 3))
    for r in range(resamples):
        xs, ys = [], []
        for streams in rows:
            # One draw of window positions for every stream of the cell: the streams
            # step together (one engine step gives each its next token), so the i-th
            # intervals of two streams are one step's time and share its noise;
            # drawing them independently would understate the variance.
            u = rng.random(max(len(s) for s in streams))
            drawn = [s[(u[: len(s)] * len(s)).astype(int)] for s in streams]
            tpot = float(np.median([d[:, 0].mean() for d in drawn]))
            stacked = np.vstack(drawn)
            xs.append([1.0, stacked[:, 1].mean(), stacked[:, 2].mean()])
            ys.append(tpot)
        coefs[r] = nonneg_lstsq(np.array(xs), np.array(ys))
    point = np.array([fit.c0, fit.c1, fit.c2])
    coefficients = {k: _band(point[i], coefs[:, i], level) for i, k in enumerate(("c0", "c1", "c2"))}
    operating = [(p.active, p.kv_tokens) for p in fit.points] + [(fit.active_max, fit.kv_max)]
    predictions = tuple(
        ({"active": a, "kv_tokens": k}, _band(fit.predict(a, k), coefs @ np.array([1.0, a, k]), level))
        for a, k in operating
    )  # fmt: skip
    return Intervals(coefficients, predictions, min(len(c) for c in cells), resamples, level,
                     seed)  # fmt: skip


def tpot_kv_limit(c0: float, c1: float, c2: float, *, tpot_s: float, active: float) -> float | None:
    """Resident KV tokens at which predicted TPOT reaches ``tpot_s`` with ``active`` requests.

    None when KV does not move TPOT (``c2 == 0``) or the target is already missed
    without any KV.
    """
    if c2 <= 0:
        return None
    room = tpot_s - c0 - c1 * active
    return room / c2 if room > 0 else None
