"""What a preflight check finds: one :class:`CheckResult` per check, one :class:`CheckReport` per run.

Every result names its check, the engine it concerns (``None`` for the fleet as a
whole; ``"p0->d0"`` for a KV transfer pair), what was measured and the configured
limit, so that a failure reads as one line::

    FAIL decode.fit_mape e1: decode fit MAPE 8.10% exceeds profiles.max_decode_fit_mape (measured 0.081; limit 0.05)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from narwhal.engines.client import EngineIdentity

__all__ = ["FLEET", "CheckReport", "CheckResult", "ProfilePair", "format_value", "jsonable"]

#: How a result that concerns no single engine names itself in a line.
FLEET = "fleet"


def jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, attrs classes as dicts and non-finite floats as strings."""
    if attrs.has(type(value)):
        return jsonable(attrs.asdict(value, recurse=False))  # pragma: no mutate (equivalent: attrs' recursion gives the same dicts and lists)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def format_value(value: Any) -> str:
    """A measured value or limit as a line shows it (floats to 4 significant digits)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        # Timestamps (process start times) keep their digits; ratios and seconds need four.
        return f"{value:.2f}" if abs(value) >= 1e5 else f"{value:.4g}"
    if isinstance(value, int | str):
        return str(value)
    return json.dumps(jsonable(value), sort_keys=True)


@attrs.frozen(kw_only=True)
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: The check, dotted (``reachable``, ``contract.version``, ``gate_f.generation``,
            ``decode.fit_mape``, ``kv_transfer``, ...).
        engine: The engine it concerns; ``None`` for the fleet; ``"p->c"`` for a pair.
        ok: Whether it passed.
        measured: What was measured (a number, a string, or ``None`` when nothing could be).
        limit: The configured limit or expected value it was held against.
        message: One sentence that says what was found.
        detail: More structured detail (timings, the identity, the JSON path of an error).
    """

    name: str
    engine: str | None
    ok: bool
    measured: Any = None
    limit: Any = None
    message: str = ""
    detail: Mapping[str, Any] = attrs.field(factory=dict)

    def line(self) -> str:
        """The result as one line: ``ok|FAIL <check> <engine>: <message> (measured ..; limit ..)``."""
        status = "ok  " if self.ok else "FAIL"
        text = f"{status} {self.name} {self.engine or FLEET}: {self.message}"
        return f"{text} (measured {format_value(self.measured)}; limit {format_value(self.limit)})"

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-able data."""
        out: dict[str, Any] = jsonable(self)
        return out


@attrs.frozen(kw_only=True)
class ProfilePair:
    """A ``profiles.json`` and its samples sidecar, as found on disk.

    Attributes:
        profiles: The profiles file.
        samples: Its samples sidecar.
        profiles_sha256: SHA-256 of the profiles file when the check read it.
        samples_sha256: SHA-256 of the sidecar when the check read it.
    """

    profiles: str
    samples: str
    profiles_sha256: str | None = None
    samples_sha256: str | None = None


@attrs.frozen(kw_only=True)
class CheckReport:
    """One preflight run.

    Attributes:
        results: Every check's result, in the order they ran.
        source: The fleet document's file, when it came from one.
        document: The fleet document as parsed JSON (``None`` when it did not load).
        identities: Each engine's generation at the start (``None``: unreachable).
        identities_after: Each engine's generation after the transfer probes.
        profiles: The profile pair in use (``None`` when Gate F found none).
        refit_original: The pair a refit was made from, when the profiles name one.
        started_at: Wall-clock start, UTC ISO 8601.
        duration_s: How long the check took (the run's clock: virtual in tests).
    """

    results: tuple[CheckResult, ...]
    source: str | None = None
    document: Mapping[str, Any] | None = None
    identities: Mapping[str, EngineIdentity | None] = attrs.field(factory=dict)
    identities_after: Mapping[str, EngineIdentity | None] = attrs.field(factory=dict)
    profiles: ProfilePair | None = None
    refit_original: ProfilePair | None = None
    started_at: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether every check passed (and there was at least one)."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        """The failed checks, in order."""
        return [r for r in self.results if not r.ok]

    def named(self, name: str) -> list[CheckResult]:
        """The results of check ``name``."""
        return [r for r in self.results if r.name == name]

    def lines(self) -> list[str]:
        """Every result as one line, in order."""
        return [r.line() for r in self.results]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data (what ``--json`` prints and a record keeps)."""
        return {
            "kind": "narwhal.check",
            "ok": self.ok,
            "fleet": self.source,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "engines": {n: _identity(i) for n, i in self.identities.items()},
            "engines_after": {n: _identity(i) for n, i in self.identities_after.items()},
            "profiles": jsonable(self.profiles),  # None stays None
            "refit_original": jsonable(self.refit_original),
            "failures": len(self.failures),
            "results": [r.to_json() for r in self.results],
        }


def _identity(identity: EngineIdentity | None) -> dict[str, Any] | None:
    return None if identity is None else dict(jsonable(identity))
