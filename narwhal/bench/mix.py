"""Mixed workloads: several streams of requests, each its tenant, class, arrivals,
lengths and SLO (``narwhal bench --mix FILE``).

A mix file is JSON::

    {"duration_s": 60,
     "streams": [
       {"name": "chat", "tenant": "web", "latency_class": "interactive", "api_key_env": "WEB_KEY",
        "rate": 6, "input_len": "uniform:200:400", "output_len": "32",
        "slo_ttft_s": 0.5, "slo_tpot_s": 0.05},
       {"name": "nightly", "tenant": "etl", "latency_class": "batch", "api_key_env": "ETL_KEY",
        "rate": 6, "input_len": "uniform:500:1000", "output_len": "64", "slo_ttft_s": 10,
        "headers": {"x-narwhal-class": "batch"}}]}

Each stream is an open-loop workload of its own (``rate``, ``arrival``, ``burstiness``,
``num_requests`` or ``duration_s`` (the file's by default), ``input_len``,
``output_len``), seeded apart from the others; the schedule is every stream's requests
in order of their start. A stream's requests carry its ``headers`` and its key as
``Authorization: Bearer`` (``api_key_env`` names the environment variable that holds
it; ``api_key`` gives it inline). ``tenant`` and ``latency_class`` are labels of the
report (the router decides both from the key and the headers). Each request is scored
against its stream's targets (``slo_ttft_s``, ``slo_tpot_s``); the report gives the
attainment of every stream, tenant and class. Keys are never written: not in the
results, not in the summary.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from narwhal.bench.workload import ARRIVALS, LengthDist, ScheduledRequest, Workload, build_schedule
from narwhal.errors import ConfigError

__all__ = ["Stream", "load_mix", "mix_schedule"]

_KEYS: Final = frozenset({
    "name", "tenant", "latency_class", "api_key", "api_key_env", "headers", "rate", "arrival", "burstiness",
    "num_requests", "duration_s", "input_len", "output_len", "slo_ttft_s", "slo_tpot_s",
})  # fmt: skip


@attrs.frozen
class Stream:
    """One stream of a mix.

    Attributes:
        name: unique stream name (a report label).
        tenant: the tenant it stands for (a report label).
        latency_class: the class it stands for (a report label).
        workload: its arrivals and lengths.
        slo_ttft_s: its TTFT target (None: none).
        slo_tpot_s: its TPOT target (None: none).
        headers: the headers its requests carry, its key's ``Authorization`` included
            (never written anywhere).
    """

    name: str
    tenant: str | None
    latency_class: str | None
    workload: Workload
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    headers: tuple[tuple[str, str], ...] = attrs.field(default=(), repr=False)

    def to_json(self) -> dict[str, Any]:
        """The stream as the summary records it: no key, no header value."""
        return {
            "name": self.name, "tenant": self.tenant, "latency_class": self.latency_class,
            "workload": self.workload.to_json(), "slo_ttft_s": self.slo_ttft_s, "slo_tpot_s": self.slo_tpot_s,
            "headers": sorted({name for name, _ in self.headers}),
        }  # fmt: skip


def _number(obj: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
        positive and value <= 0
    ):
        raise ConfigError("expected a number > 0", path=f"{where}.{key}")
    return float(value)


def _text(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError("expected a non-empty string", path=f"{where}.{key}")
    return value


def _stream(obj: Any, i: int, default_duration: float | None, seed: int, env: Mapping[str, str]) -> Stream:
    where = f"$.streams[{i}]"
    if not isinstance(obj, dict):
        raise ConfigError("expected an object", path=where)
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}", path=f"{where}.{unknown[0]}")
    name = _text(obj, "name", where) or f"stream{i}"
    rate = _number(obj, "rate", where)
    if rate is None:
        raise ConfigError("expected the stream's rate (requests/s)", path=f"{where}.rate")
    arrival = obj.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        raise ConfigError("expected one of " + ", ".join(repr(a) for a in ARRIVALS), path=f"{where}.arrival")
    count = obj.get("num_requests")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ConfigError("expected an integer >= 1", path=f"{where}.num_requests")
    duration = _number(obj, "duration_s", where)
    lengths = {}
    for field in ("input_len", "output_len"):
        spec = obj.get(field, "128")
        try:
            lengths[field] = LengthDist.parse(str(spec))
        except ValueError as exc:
            raise ConfigError(str(exc), path=f"{where}.{field}") from None
    try:
        workload = Workload(
            rate=rate, arrival=arrival, burstiness=_number(obj, "burstiness", where) or 1.0, num_requests=count,
            duration_s=duration if duration is not None else default_duration if count is None else None,
            input_len=lengths["input_len"], output_len=lengths["output_len"], seed=seed + 7919 * (i + 1),
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc), path=where) from None
    headers: list[tuple[str, str]] = []
    extra = obj.get("headers") or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise ConfigError("expected an object of header names and string values", path=f"{where}.headers")
    headers += [(k.lower(), v) for k, v in extra.items()]
    key = _text(obj, "api_key", where)
    key_env = _text(obj, "api_key_env", where)
    if key is not None and key_env is not None:
        raise ConfigError("give api_key or api_key_env, not both", path=f"{where}.api_key_env")
    if key_env is not None:
        key = env.get(key_env) or None
        if key is None:
            raise ConfigError(f"the environment variable {key_env} (the stream's key) is not set",
                              path=f"{where}.api_key_env")  # fmt: skip
    if key is not None:
        headers.append(("authorization", f"Bearer {key}"))
    return Stream(name, _text(obj, "tenant", where), _text(obj, "latency_class", where), workload,
                  _number(obj, "slo_ttft_s", where), _number(obj, "slo_tpot_s", where), tuple(headers))  # fmt: skip


def load_mix(path: str | os.PathLike[str], *, seed: int = 0, duration_s: float | None = None,
             env: Mapping[str, str] = os.environ) -> list[Stream]:  # fmt: skip
    """The streams of the mix file at ``path``; ``duration_s`` (``--duration``) overrides
    the file's.

    Raises:
        ConfigError: the file cannot be read, or is not a valid mix (the JSON path says where).
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read the mix: {exc.strerror}", source=source) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"the mix is not JSON: {exc}", source=source) from None
    try:
        if not isinstance(doc, dict) or not isinstance(doc.get("streams"), list) or not doc["streams"]:
            raise ConfigError("expected an object with a non-empty list of streams", path="$.streams")
        unknown = sorted(set(doc) - {"streams", "duration_s"})
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r}", path=f"$.{unknown[0]}")
        default = duration_s if duration_s is not None else _number(doc, "duration_s", "$")
        streams = [_stream(obj, i, default, seed, env) for i, obj in enumerate(doc["streams"])]
    except ConfigError as err:
        raise ConfigError(err.reason, path=err.path, source=source) from None
    names = [s.name for s in streams]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"duplicate stream name {duplicate!r}", source=source)
    return streams


def mix_schedule(streams: Sequence[Stream]) -> list[ScheduledRequest]:
    """Every stream's requests, in order of start (ties in stream order), each naming its stream."""
    entries = [
        (req.offset_s, s, req) for s, stream in enumerate(streams) for req in build_schedule(stream.workload)
    ]
    entries.sort(key=lambda e: (e[0], e[1]))
    return [attrs.evolve(req, index=i, stream=s) for i, (_, s, req) in enumerate(entries)]
