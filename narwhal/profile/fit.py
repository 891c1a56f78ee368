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
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs
import numpy as np
from scipy.optimize import nnls

__all__ = [
    "DEFAULT_MAX_MEAN_ERROR",
    "DEFAULT_MAX_WORST_ERROR",
    "MIN_DECODE_CELLS",
    "MIN_PREFILL_LENGTHS",
    "TPOT_MODEL",
    "TTFT_MODEL",
    "DecodeFit",
    "DecodePoint",
    "TTFTFit",
    "decode_fit_problem",
    "fit_decode",
    "fit_ttft",
    "mape",
    "median_by_length",
    "nonneg_lstsq",
    "tpot_kv_limit",
    "ttft_rejection",
]

TTFT_MODEL: Final = "a + b*L + c*L^2"
TPOT_MODEL: Final = "c0 + c1*active + c2*resident_kv_tokens"
#: The prefill validation bounds (the seed's section 4).
DEFAULT_MAX_MEAN_ERROR: Final = 0.20
DEFAULT_MAX_WORST_ERROR: Final = 0.50
MIN_PREFILL_LENGTHS: Final = 3
MIN_DECODE_CELLS: Final = 4


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> np.ndarray:
    """Least squares with every coefficient >= 0 (NNLS), on relative residuals by default.

    Columns are scaled to unit maximum before solving (``L**2`` is many orders of
    magnitude above the constant column) and the solution is scaled back.
    """
    a = np.asarray(x, dtype=float)
    b = np.asarray(y, dtype=float)
    if relative:
        if np.any(b <= 0):
            raise ValueError("relative least squares needs positive observations")
        a = a / b[:, None]
        b = np.ones_like(b)
    scale = np.max(np.abs(a), axis=0)
    scale[scale == 0] = 1.0
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

    def predict(self, length: float) -> float:
        """The curve at ``length`` tokens, seconds."""
        return self.a + self.b * length + self.c * length * length

    @property
    def worst_length(self) -> int:
        """The length with the largest error."""
        return self.lengths[int(np.argmax(self.errors))]

    def as_dict(self) -> dict[str, object]:
        """The JSON form kept in the sidecar."""
        return {
            "model": TTFT_MODEL,
            "coefficients": {"a": self.a, "b": self.b, "c": self.c},
            "points": [
                {"length": n, "median_s": m, "predicted_s": p, "error": e}
                for n, m, p, e in zip(
                    self.lengths, self.medians, self.predicted, self.errors, strict=True
                )
            ],
            "mean_error": self.mean_error,
            "worst_error": self.worst_error,
        }


def fit_ttft(medians: Mapping[int, float]) -> TTFTFit:
    """Fit ``a + b*L + c*L**2`` (non-negative) to per-length median TTFTs.

    Raises:
        ValueError: fewer than three lengths, or a non-positive median.
    """
    lengths = tuple(sorted(medians))
    if len(lengths) < MIN_PREFILL_LENGTHS:
        raise ValueError(
            f"a TTFT fit needs at least {MIN_PREFILL_LENGTHS} lengths, got {len(lengths)}"
        )
    ys = np.array([medians[n] for n in lengths], dtype=float)
    ls = np.array(lengths, dtype=float)
    x = np.column_stack([np.ones_like(ls), ls, ls * ls])
    a, b, c = (float(v) for v in nonneg_lstsq(x, ys))
    predicted = tuple(float(a + b * n + c * n * n) for n in ls)
    errors = tuple(abs(p - y) / y for p, y in zip(predicted, ys.tolist(), strict=True))
    return TTFTFit(
        a=a,
        b=b,
        c=c,
        lengths=lengths,
        medians=tuple(float(y) for y in ys),
        predicted=predicted,
        errors=errors,
        mean_error=float(statistics.fmean(errors)),
        worst_error=max(errors),
    )


def ttft_rejection(
    fit: TTFTFit,
    *,
    max_mean_error: float = DEFAULT_MAX_MEAN_ERROR,
    max_worst_error: float = DEFAULT_MAX_WORST_ERROR,
) -> str | None:
    """Why a TTFT curve must be rejected (either bound exceeded), or None if it passes."""
    reasons = []
    if fit.mean_error > max_mean_error:
        reasons.append(f"mean error {fit.mean_error:.1%} is above the {max_mean_error:.0%} bound")
    if fit.worst_error > max_worst_error:
        reasons.append(
            f"worst-point error {fit.worst_error:.1%} (at {fit.worst_length} tokens) is above "
            f"the {max_worst_error:.0%} bound"
        )
    return "; ".join(reasons) if reasons else None


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
                    strict=True,
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
    x = np.array([[1.0, p.active, p.kv_tokens] for p in points], dtype=float)
    y = np.array([p.tpot_s for p in points], dtype=float)
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


def tpot_kv_limit(c0: float, c1: float, c2: float, *, tpot_s: float, active: float) -> float | None:
    """Resident KV tokens at which predicted TPOT reaches ``tpot_s`` with ``active`` requests.

    None when KV does not move TPOT (``c2 == 0``) or the target is already missed
    without any KV.
    """
    if c2 <= 0:
        return None
    room = tpot_s - c0 - c1 * active
    return room / c2 if room > 0 else None
