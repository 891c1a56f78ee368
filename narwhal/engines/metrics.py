"""A small Prometheus text-format parser and the engine load figures narwhal reads.

vLLM's ``/metrics`` is the Prometheus text exposition format. Narwhal needs a handful
of gauges from it (running and waiting requests, KV-cache usage and capacity, prefix
caching, the API server's start time), so it parses the text itself rather than
depending on a client library. :func:`parse_prometheus` keeps every sample, so callers
that want histograms (time to first token, inter-token latency) can read them too.

The text comes from an engine and is not trusted: :func:`engine_metrics` refuses
(:class:`MalformedMetrics`) a gauge that is not a finite number in its range (``+Inf``
requests running, a NaN usage, a negative capacity, a start time that is no date),
so that what it returns is safe to do arithmetic on.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Final

import attrs

__all__ = [
    "LOAD_SAMPLES",
    "EngineMetrics",
    "MalformedMetrics",
    "Sample",
    "engine_metrics",
    "parse_prometheus",
    "start_time",
    "sum_samples",
]

_NAME_RE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE: Final = re.compile(
    r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,?)'
)
_ESCAPES: Final = {"\\": "\\", '"': '"', "n": "\n"}


@attrs.frozen(slots=True)
class Sample:
    """One sample line: ``name{labels} value [timestamp]``.

    ``labels`` is a tuple of ``(name, value)`` pairs in the order the text gave them.
    """

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int | None = None

    def label(self, key: str, default: str | None = None) -> str | None:
        """The value of label ``key``, or ``default``."""
        for name, value in self.labels:
            if name == key:
                return value
        return default

    def matches(self, wanted: Mapping[str, str]) -> bool:
        """Whether every label in ``wanted`` has the given value."""
        return all(self.label(k) == v for k, v in wanted.items())


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    out: list[str] = []
    i = 0
    while i < len(value):
        ch = value[i]
        if ch == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _parse_line(line: str) -> Sample:
    m = _NAME_RE.match(line)
    if m is None:
        raise ValueError("no metric name")
    name = m.group(0)
    pos = m.end()
    labels: list[tuple[str, str]] = []
    if pos < len(line) and line[pos] == "{":
        pos += 1
        while True:
            while pos < len(line) and line[pos] in " \t":
                pos += 1
            if pos < len(line) and line[pos] == "}":
                pos += 1
                break
            lm = _LABEL_RE.match(line, pos)
            if lm is None:
                raise ValueError("malformed label set")
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
            if not lm.group(3):
                while pos < len(line) and line[pos] in " \t":
                    pos += 1
                if pos >= len(line) or line[pos] != "}":
                    raise ValueError("unterminated label set")
                pos += 1
                break
    rest = line[pos:].split()
    if not rest or len(rest) > 2 or (pos < len(line) and line[pos] not in " \t"):
        raise ValueError("expected a value after the metric name")
    value = float(rest[0])  # accepts +Inf, -Inf and NaN
    timestamp = int(rest[1]) if len(rest) == 2 else None
    return Sample(name, tuple(labels), value, timestamp)


def parse_prometheus(
    text: str, *, strict: bool = False, names: Collection[str] | None = None
) -> dict[str, tuple[Sample, ...]]:
    """Parse Prometheus text exposition into samples grouped by sample name.

    Args:
        text: the ``/metrics`` body.
        strict: raise on a malformed line instead of skipping it.
        names: parse only the samples of these names (the other lines are skipped
            unparsed: a vLLM exposition is mostly histogram buckets).

    Returns:
        ``{sample name: samples in text order}`` (histogram series appear under
        their ``_bucket``/``_sum``/``_count`` names).

    Raises:
        ValueError: ``strict`` and a line is malformed (the message names the line).
    """
    grouped: dict[str, list[Sample]] = {}
    prefixes = tuple(names) if names is not None else ()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        if names is not None and not (line.startswith(prefixes) and _sample_name(line) in names):
            continue
        try:
            sample = _parse_line(line)
        except ValueError as exc:
            if strict:
                raise ValueError(f"line {lineno}: {exc}: {line[:120]!r}") from None
            continue
        grouped.setdefault(sample.name, []).append(sample)
    return {name: tuple(samples) for name, samples in grouped.items()}


def _sample_name(line: str) -> str:
    end = len(line)
    for sep in ("{", " ", "\t"):
        i = line.find(sep, 0, end)
        if i >= 0:
            end = i
    return line[:end]


def sum_samples(samples: Iterable[Sample], **labels: str) -> float | None:
    """The sum of the samples whose labels match ``labels``; ``None`` when none do."""
    total = 0.0
    found = False
    for sample in samples:
        if labels and not sample.matches(labels):
            continue
        total += sample.value
        found = True
    return total if found else None


@attrs.frozen(eq=False)
class EngineMetrics:
    """An engine's load as its ``/metrics`` reported it.

    Attributes:
        running: requests in execution batches, summed over the engine's cores
            (the ``engine`` label: one per data-parallel rank).
        waiting: requests queued, summed likewise.
        kv_usage: KV-cache usage in 0..1, averaged over the cores weighted by their
            capacity (a sum would exceed 1 with several cores).
        kv_cache_size_tokens: KV capacity in tokens (``cache_config_info``'s
            ``kv_cache_size_tokens``, summed over cores); ``None`` when not reported.
        prefix_caching: whether every core has prefix caching enabled; ``None`` when
            not reported.
        process_start_time: the API server's ``process_start_time_seconds``.
        samples: every parsed sample, by sample name.
    """

    running: int
    waiting: int
    kv_usage: float
    kv_cache_size_tokens: int | None
    prefix_caching: bool | None
    process_start_time: float | None
    samples: Mapping[str, tuple[Sample, ...]]

    def get(self, name: str) -> tuple[Sample, ...]:
        """The samples named ``name`` (empty when absent)."""
        return self.samples.get(name, ())

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of the samples named ``name`` matching ``labels``."""
        return sum_samples(self.get(name), **labels)

    @property
    def block_size(self) -> int | None:
        """The KV block size ``cache_config_info`` reports (the first core's), if any."""
        for info in self.get("vllm:cache_config_info"):
            size = _int_label(info, "block_size")
            if size is not None and size > 0:
                return size
        return None


class MalformedMetrics(ValueError):
    """A gauge narwhal reads is missing, or not a number it can use; ``str()`` says which."""


#: The most requests a gauge may report (per core): more is no engine's load.
MAX_REQUESTS: Final = 10**7
#: The most KV-cache tokens (or blocks) a capacity label may report.
MAX_CAPACITY: Final = 2**48
#: The latest start time a date can show (9999-12-31, as Python's datetime).
MAX_START_TIME: Final = 253402300799.0


def _int_label(sample: Sample, key: str) -> int | None:
    """An integer label >= 0; None when absent or not a number (``"None"``: unknown)."""
    raw = sample.label(key)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None  # "None" when the engine does not know
    if not (math.isfinite(value) and value == int(value) and 0 <= value <= MAX_CAPACITY):
        raise MalformedMetrics(f"{sample.name} has {key}={raw[:40]!r}, not an integer in 0..{MAX_CAPACITY}")
    return int(value)


def _capacity(info: Sample) -> int | None:
    size = _int_label(info, "kv_cache_size_tokens")
    if size is not None:
        return size
    # Builds that predate kv_cache_size_tokens: blocks x block size (wrong for hybrid
    # models, which is why the explicit figure is preferred).
    blocks, block_size = _int_label(info, "num_gpu_blocks"), _int_label(info, "block_size")
    if blocks is None or block_size is None:
        return None
    return min(blocks * block_size, MAX_CAPACITY)


def _value(sample: Sample, low: float, high: float) -> float:
    """The sample's value, a finite number in ``low..high`` (else :class:`MalformedMetrics`)."""
    value = sample.value
    if not low <= value <= high:  # False for NaN too
        raise MalformedMetrics(f"{sample.name} is {value!r}, not a number in {low:g}..{high:g}")
    return value


_RUNNING: Final = "vllm:num_requests_running"
_WAITING: Final = "vllm:num_requests_waiting"
_USAGE: Final = "vllm:kv_cache_usage_perc"
_USAGE_BEFORE: Final = "vllm:gpu_cache_usage_perc"  # its name in older vLLM builds
_CACHE_INFO: Final = "vllm:cache_config_info"
_START: Final = "process_start_time_seconds"


def start_time(samples: Mapping[str, tuple[Sample, ...]]) -> float | None:
    """``process_start_time_seconds`` (None when not reported).

    Raises:
        MalformedMetrics: it is not a date (not finite, negative, past year 9999).
    """
    start = samples.get(_START)
    return _value(start[0], 0.0, MAX_START_TIME) if start else None


#: The samples :func:`engine_metrics` reads: what a load poll needs parsed.
LOAD_SAMPLES: Final = frozenset({_RUNNING, _WAITING, _USAGE, _USAGE_BEFORE, _CACHE_INFO, _START})


def engine_metrics(samples: Mapping[str, tuple[Sample, ...]]) -> EngineMetrics:
    """Summarize parsed vLLM metrics into :class:`EngineMetrics`.

    Raises:
        MalformedMetrics: a required gauge (running, waiting, KV usage) is missing, or a
            gauge or label read is not a finite number in its range.
    """
    usage_name = _USAGE if samples.get(_USAGE) else _USAGE_BEFORE
    missing = [name for name, read in ((_RUNNING, _RUNNING), (_WAITING, _WAITING), (_USAGE, usage_name))
               if not samples.get(read)]  # fmt: skip
    if missing:
        raise MalformedMetrics(f"metrics lack {', '.join(missing)}")
    running = sum(_value(s, 0.0, MAX_REQUESTS) for s in samples[_RUNNING])
    waiting = sum(_value(s, 0.0, MAX_REQUESTS) for s in samples[_WAITING])
    usage_samples = samples[usage_name]
    usages = [_value(s, 0.0, 1.0) for s in usage_samples]

    capacity_by_engine: dict[str | None, int] = {}
    prefix_flags: list[bool] = []
    for info in samples.get(_CACHE_INFO, ()):
        _int_label(info, "block_size")  # checked here: EngineMetrics.block_size reads it
        cap = _capacity(info)
        if cap is not None:
            key = info.label("engine")
            capacity_by_engine[key] = capacity_by_engine.get(key, 0) + cap
        flag = info.label("enable_prefix_caching")
        if flag is not None:
            prefix_flags.append(flag.strip().lower() == "true")

    # Each core's usage weighted by its capacity, when every core reports one (> 0: so
    # their sum is too); else their plain mean.
    weights = [capacity_by_engine.get(s.label("engine")) or 0 for s in usage_samples]
    if all(weights):
        kv_usage = sum(map(operator.mul, usages, weights)) / sum(weights)
    else:
        kv_usage = sum(usages) / len(usages)

    return EngineMetrics(
        running=round(running),
        waiting=round(waiting),
        kv_usage=kv_usage,
        kv_cache_size_tokens=sum(capacity_by_engine.values()) if capacity_by_engine else None,
        prefix_caching=all(prefix_flags) if prefix_flags else None,
        process_start_time=start_time(samples),
        samples=samples,
    )
