"""The profile pair on disk: ``profiles.json`` and its ``profiles.samples.json`` sidecar.

``profiles.json`` holds what placement and the preflight need, one
:class:`EngineProfile` per engine whose fits were accepted, each bound to the engine
generation (:class:`~narwhal.engines.client.EngineIdentity`) it was measured on, and
names its sidecar with the sidecar's SHA-256 so that a pair cannot be mixed up. The
sidecar holds everything measured (see :func:`samples_document`). Both carry
``schema_version``; :func:`load_profiles` validates a profiles file and names the JSON
path of the first bad value.

Files are written whole to a temporary name and renamed, so a reader never sees half
a file; the sidecar is rewritten after every engine so completed engines' data
survives a later failure.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import attrs

from narwhal.config import converter, parse_as, read_document
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.fit import CACHED_MODEL, TPOT_MODEL, TTFT_MODEL, cached_prefill_s

_T = TypeVar("_T")

__all__ = [
    "PROFILES_KIND",
    "SAMPLES_KIND",
    "SCHEMA_VERSION",
    "CachedPrefill",
    "CoefficientBand",
    "DecodeAxis",
    "DecodeDomain",
    "DecodeModel",
    "EngineProfile",
    "KVCapacity",
    "PrefillOutside",
    "Profiles",
    "QueueKind",
    "SamplesRef",
    "TTFTCurve",
    "Uncertainty",
    "file_sha256",
    "load_profiles",
    "pair_paths",
    "read_json",
    "write_json",
]

#: How a producer queues prompts (:mod:`narwhal.profile.burst`): one whole prompt a
#: step, or the waiting ones together in its next step.
QueueKind = Literal["batched", "serial"]

SCHEMA_VERSION: Final = 1
PROFILES_KIND: Final = "narwhal.profiles"
SAMPLES_KIND: Final = "narwhal.profile-samples"


def _nonneg(_inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:  # also rejects NaN
        raise ConfigError("expected a number >= 0", path=f"$.{attribute.name}")


def _equals(expected: str) -> Any:
    return lambda _inst, attribute, value: _require(expected, attribute, value)  # pragma: no mutate (unreachable: runs at class definition, before a mutant is active; the check is tested)


def _require(expected: str, attribute: attrs.Attribute[Any], value: str) -> None:
    # Apart from _equals, whose body runs once, when the classes are defined.
    if value != expected:
        raise ConfigError(f"expected {expected!r}", path=f"$.{attribute.name}")


@attrs.frozen(kw_only=True)
class CoefficientBand:
    """A coefficient's value and its bootstrap interval."""

    value: float
    low: float
    high: float


@attrs.frozen(kw_only=True)
class Uncertainty:
    """A fit's bootstrap intervals, as placement and the preflight use them.

    Attributes:
        level: the intervals' confidence level.
        resamples: bootstrap resamples.
        coefficients: each coefficient's interval.
        upper_factor: the largest ``upper bound / prediction`` over the operating points
            (>= 1); conservative pricing multiplies predictions by it.
        worst_half_width: the largest relative half-width of a prediction interval at
            the operating points.
        mean_half_width: their mean (None in profiles written before it was recorded).
        min_samples: the fewest raw samples behind one operating point (repeats at a
            prefill length; intervals of a decode cell).
    """

    level: float
    resamples: int
    coefficients: dict[str, CoefficientBand]
    upper_factor: float = attrs.field(validator=_nonneg)
    worst_half_width: float = attrs.field(validator=_nonneg)
    mean_half_width: float | None = attrs.field(default=None,
                                                validator=attrs.validators.optional(_nonneg))
    min_samples: int | None = None


@attrs.frozen(kw_only=True)
class TTFTCurve:
    """TTFT in seconds for a prompt of L tokens: ``a + b*L + c*L**2``.

    Attributes:
        model: the curve's formula.
        a, b, c: non-negative coefficients.
        min_length, max_length: the measured lengths' range (the priced domain).
        mean_error, worst_error: relative errors of the curve at the per-length medians.
        loo_mean_error, loo_worst_error: leave-one-length-out relative errors (None in
            profiles written before they were measured; the preflight refuses those).
        uncertainty: bootstrap intervals (None likewise).
    """

    model: str = attrs.field(default=TTFT_MODEL, validator=_equals(TTFT_MODEL))
    a: float = attrs.field(validator=_nonneg)
    b: float = attrs.field(validator=_nonneg)
    c: float = attrs.field(validator=_nonneg)
    min_length: int
    max_length: int
    mean_error: float = attrs.field(validator=_nonneg)
    worst_error: float = attrs.field(validator=_nonneg)
    loo_mean_error: float | None = None
    loo_worst_error: float | None = None
    uncertainty: Uncertainty | None = None

    def predict(self, length: float) -> float:
        """TTFT in seconds for ``length`` prompt tokens."""
        return self.a + self.b * length + self.c * length * length

    def predict_upper(self, length: float) -> float:
        """The conservative TTFT: the prediction times the upper-bound factor."""
        factor = self.uncertainty.upper_factor if self.uncertainty is not None else 1.0
        return self.predict(length) * factor


@attrs.frozen(kw_only=True)
class CachedPrefill:
    """TTFT in seconds for a prompt of L tokens whose first k are in the engine's prefix
    cache: ``a + b*(L-k) + c*(L**2 - k**2) + d*k`` (measured by the cached-prefix sweep).

    Attributes:
        model: the formula.
        a, b, c, d: non-negative coefficients.
        cells: cells fitted (plain lengths included).
        min_length, max_length: the measured prompt lengths' range.
        max_cached: the longest cached prefix measured.
        block_size: the engine's KV block size during the sweep.
        mean_error, worst_error: relative errors of the fit at the cells' medians.
        loo_mean_error, loo_worst_error: leave-one-cell-out relative errors over the
            cells with a cached prefix.
        uncertainty: bootstrap intervals (coefficients, and the fit at the cached cells).
    """

    model: str = attrs.field(default=CACHED_MODEL, validator=_equals(CACHED_MODEL))
    a: float = attrs.field(validator=_nonneg)
    b: float = attrs.field(validator=_nonneg)
    c: float = attrs.field(validator=_nonneg)
    d: float = attrs.field(validator=_nonneg)
    cells: int
    min_length: int
    max_length: int
    max_cached: int
    block_size: int
    mean_error: float = attrs.field(validator=_nonneg)
    worst_error: float = attrs.field(validator=_nonneg)
    loo_mean_error: float = attrs.field(validator=_nonneg)
    loo_worst_error: float = attrs.field(validator=_nonneg)
    uncertainty: Uncertainty

    def predict(self, length: float, cached: float) -> float:
        """TTFT in seconds of ``length`` prompt tokens, the first ``cached`` cached."""
        return cached_prefill_s(self.a, self.b, self.c, self.d, length, cached)

    def predict_upper(self, length: float, cached: float) -> float:
        """The conservative price: the prediction times the upper-bound factor."""
        return self.predict(length, cached) * self.uncertainty.upper_factor


@attrs.frozen(kw_only=True)
class PrefillOutside:
    """What a prefill spends outside the engine's steps, ``base_s + per_token_s * L``
    for a prompt of L tokens: its TTFT at the client less the engine's own waiting and
    prefill seconds, fitted over the sweeps' prefills
    (:mod:`narwhal.profile.enginetime`).

    Attributes:
        base_s, per_token_s: non-negative coefficients.
        samples: prefills fitted.
    """

    base_s: float = attrs.field(validator=_nonneg)
    per_token_s: float = attrs.field(validator=_nonneg)
    samples: int

    def predict(self, length: float) -> float:
        """Seconds a ``length``-token prefill spends outside the engine's steps."""
        return self.base_s + self.per_token_s * length


@attrs.frozen(kw_only=True)
class DecodeAxis:
    """Observed range of one decode axis."""

    min: float
    max: float

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max


@attrs.frozen(kw_only=True)
class DecodeDomain:
    """The measured decode domain: the fit is trustworthy inside it only."""

    active: DecodeAxis
    kv_tokens: DecodeAxis

    def contains(self, active: float, kv_tokens: float) -> bool:
        return self.active.contains(active) and self.kv_tokens.contains(kv_tokens)


@attrs.frozen(kw_only=True)
class DecodeModel:
    """TPOT in seconds: ``c0 + c1*active + c2*resident_kv_tokens``.

    Attributes:
        model: the model's formula.
        c0, c1, c2: non-negative coefficients.
        fit_mape: mean relative error of the fit over the measured cells.
        cv_mape: leave-one-cell-out mean relative error.
        cells: cells fitted.
        domain: observed minimum and maximum of both axes.
        uncertainty: bootstrap intervals (None in profiles written before them).
    """

    model: str = attrs.field(default=TPOT_MODEL, validator=_equals(TPOT_MODEL))
    c0: float = attrs.field(validator=_nonneg)
    c1: float = attrs.field(validator=_nonneg)
    c2: float = attrs.field(validator=_nonneg)
    fit_mape: float = attrs.field(validator=_nonneg)
    cv_mape: float = attrs.field(validator=_nonneg)
    cells: int
    domain: DecodeDomain
    uncertainty: Uncertainty | None = None

    def predict(self, active: float, kv_tokens: float) -> float:
        """TPOT in seconds with ``active`` requests holding ``kv_tokens`` KV tokens."""
        return self.c0 + self.c1 * active + self.c2 * kv_tokens

    @property
    def upper_factor(self) -> float:
        """The conservative factor on predictions (1 without intervals)."""
        return self.uncertainty.upper_factor if self.uncertainty is not None else 1.0


@attrs.frozen(kw_only=True)
class KVCapacity:
    """How many KV tokens the engine can hold, and where that figure comes from.

    Attributes:
        source: ``physical`` (the engine's ``kv_cache_size_tokens``: a hard limit),
            ``tpot`` (the resident KV at which the decode fit reaches the TPOT target:
            a limit of the SLO), or ``measured`` (neither was available: the largest
            resident KV the sweep measured, which is the edge of the measured domain
            and no capacity at all; placement prices beyond it conservatively instead
            of excluding the engine).
        tokens: the limit.
        basis: how it was obtained, in words.
        tpot_s: the TPOT target it was derived for (``tpot`` with an SLO).
        active: the active-request count it was derived at (``tpot`` with an SLO).
    """

    source: Literal["physical", "tpot", "measured"]

    @property
    def is_limit(self) -> bool:
        """Whether ``tokens`` bounds what the engine may hold (not just what was measured)."""
        return self.source != "measured"
    tokens: int
    basis: str
    tpot_s: float | None = None
    active: float | None = None


@attrs.frozen(kw_only=True)
class EngineProfile:
    """One engine's accepted profile, bound to the generation it was measured on.

    A prefill-only engine (roles ``["prefill"]``) has no decode sweep: ``decode`` and
    ``kv_capacity`` are None. A decode-only engine still has a TTFT curve: its prefill
    sweep measures the prompt processing every decode request starts with when the
    router decodes on the producer or recomputes a prompt (no transfer).

    ``cached_prefill`` is the cached-prefix model of an engine with prefix caching whose
    cached-prefix sweep was accepted (None otherwise: placement then prices a hit from
    the TTFT curve alone).

    ``prefill_queue`` says how the engine queues prompts, as the burst probe measured it
    (:mod:`narwhal.profile.burst`): ``batched`` (the waiting prompts share its next step)
    or ``serial`` (one whole prompt a step); None where the probe did not run (placement
    then learns it from its own requests).

    ``prefill_outside`` is what a prefill spends outside the engine's steps, where the
    engine reports its own time per request (None otherwise: placement then prices a
    prompt's whole prefill as part of the step it shares).
    """

    name: str
    identity: EngineIdentity
    ttft: TTFTCurve
    decode: DecodeModel | None = None
    kv_capacity: KVCapacity | None = None
    roles: tuple[str, ...] = ("prefill", "decode")
    cached_prefill: CachedPrefill | None = None
    prefill_queue: QueueKind | None = None
    prefill_outside: PrefillOutside | None = None

    def predict_ttft(self, length: float) -> float:
        """Predicted TTFT in seconds for a ``length``-token prompt."""
        return self.ttft.predict(length)

    @property
    def decode_model(self) -> DecodeModel:
        """The decode model of an engine that decodes.

        Raises:
            ValueError: a prefill-only profile.
        """
        return _decoding(self.decode, self.name, "decode model")

    @property
    def kv_limit(self) -> KVCapacity:
        """The KV capacity of an engine that decodes.

        Raises:
            ValueError: a prefill-only profile.
        """
        return _decoding(self.kv_capacity, self.name, "KV capacity")

    def predict_tpot(self, active: float, kv_tokens: float) -> float:
        """Predicted TPOT in seconds with ``active`` requests and ``kv_tokens`` resident.

        Raises:
            ValueError: a prefill-only profile (no decode model).
        """
        return self.decode_model.predict(active, kv_tokens)


@attrs.frozen(kw_only=True)
class SamplesRef:
    """The sidecar a profiles file belongs to: file name beside it and SHA-256."""

    path: str
    sha256: str


@attrs.frozen(kw_only=True)
class Profiles:
    """A ``profiles.json`` document.

    Attributes:
        schema_version: :data:`SCHEMA_VERSION`.
        kind: :data:`PROFILES_KIND`.
        created_at: when it was written (UTC, ISO 8601).
        software: the profiler's software identity.
        samples: the sidecar it belongs to.
        engines: accepted profiles by engine name.
        excluded: engines profiled without an accepted profile, with the reason.
        refit_of: the sidecar a refit was made from, if this is a refit.
    """

    schema_version: int = attrs.field(validator=lambda _i, _a, v: _version_ok(v))
    kind: str = attrs.field(default=PROFILES_KIND, validator=_equals(PROFILES_KIND))
    created_at: str
    software: dict[str, str]
    samples: SamplesRef
    engines: dict[str, EngineProfile]
    excluded: dict[str, str] = attrs.field(factory=dict)
    refit_of: str | None = None

    def __getitem__(self, name: str) -> EngineProfile:
        return self.engines[name]

    def __contains__(self, name: object) -> bool:
        return name in self.engines

    def to_json(self) -> dict[str, Any]:
        """The document as JSON-able data."""
        out: dict[str, Any] = converter.unstructure(self)
        return out


def _version_ok(value: Any) -> None:
    if value != SCHEMA_VERSION:
        raise ConfigError(
            f"schema_version {value!r} is not {SCHEMA_VERSION}; profile again with this narwhal",
            path="$.schema_version",
        )


def pair_paths(out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(profiles, samples)`` paths of the pair written at ``out`` (``x.json`` → ``x.samples.json``)."""
    path = Path(out)
    stem = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
    return path, path.with_name(f"{stem}.samples.json")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # pragma: no mutate (equivalent: the block size changes memory use, not the digest)
            digest.update(block)
    return digest.hexdigest()


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON atomically (temporary file, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"  # pragma: no mutate (equivalent: allow_nan=None is falsy as False; the rest is tested)
    with open(tmp, "w", encoding="utf-8") as f:  # pragma: no mutate (equivalent in a UTF-8 locale, the only one a test here runs in; "w" and the path are tested)
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a JSON file (a regular file of at most :data:`~narwhal.config.MAX_DOCUMENT_BYTES`).

    Raises:
        ConfigError: unreadable, not a regular file, too large, or not JSON (the
            message names ``what``).
    """
    source = os.fspath(path)
    data = read_document(source, what)  # a regular file of a bounded size, or refused unread
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc}", source=source) from None


def load_profiles(path: str | os.PathLike[str], *, verify_samples: bool = True) -> Profiles:
    """Read and validate a ``profiles.json``.

    Args:
        path: the profiles file.
        verify_samples: also require its sidecar beside it, with the recorded SHA-256.

    Raises:
        ConfigError: unreadable, an unknown kind or schema, an invalid value (the
            message names its JSON path), or a missing or mismatched sidecar.
    """
    source = os.fspath(path)
    obj = read_json(source, "profiles file")
    if not isinstance(obj, dict):
        raise ConfigError("expected an object", source=source)
    if obj.get("kind") != PROFILES_KIND:
        raise ConfigError(f"not a narwhal profiles file (kind {obj.get('kind')!r})",
                          path="$.kind", source=source)  # fmt: skip
    profiles = parse_as(Profiles, obj, source=source)
    if not profiles.engines:
        why = "; ".join(f"{name}: {reason}" for name, reason in profiles.excluded.items()) or "none listed"
        raise ConfigError(f"the pair holds no engine profile (excluded: {why}): nothing to price placement "
                          "by; profile the engines again", path="$.engines", source=source)  # fmt: skip
    for name, profile in profiles.engines.items():
        if profile.name != name:
            raise ConfigError(f"profile of engine {profile.name!r} filed under {name!r}",
                              path=f"$.engines.{name}.name", source=source)  # fmt: skip
    if verify_samples:
        sidecar = Path(source).with_name(profiles.samples.path)
        if not sidecar.is_file():
            raise ConfigError(f"its samples sidecar {profiles.samples.path} is missing",
                              path="$.samples.path", source=source)  # fmt: skip
        if file_sha256(sidecar) != profiles.samples.sha256:
            raise ConfigError(
                f"its samples sidecar {profiles.samples.path} is not the one it was written "
                "with (SHA-256 differs)",
                path="$.samples.sha256",
                source=source,
            )
    return profiles


def _decoding(value: _T | None, engine: str, what: str) -> _T:
    """A decode-side figure of a profile, or ValueError for a prefill-only one."""
    if value is None:
        raise ValueError(f"engine {engine} was profiled for prefill only (no {what})")
    return value
