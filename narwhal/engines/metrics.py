"""A small Prometheus text-format parser and the engine load figures narwhal reads.

vLLM's ``/metrics`` is the Prometheus text exposition format. Narwhal needs a handful
of gauges from it (running and waiting requests, KV-cache usage and capacity, prefix
caching, the API server's start time), so it parses the text itself rather than
depending on a client library. :func:`parse_prometheus` keeps every sample, so callers
that want histograms (time to first token, inter-token latency) can read them too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Final

import attrs

__all__ = [
    "LOAD_SAMPLES",
    "EngineMetrics",
    "Sample",
    "engine_metrics",
    "parse_prometheus",
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


def _int_label(sample: Sample, key: str) -> int | None:
    raw = sample.label(key)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None  # "None" when the engine does not know
    return int(value) if math.isfinite(value) else None


def _capacity(info: Sample) -> int | None:
    size = _int_label(info, "kv_cache_size_tokens")
    if size is not None:
        return size
    # Builds that predate kv_cache_size_tokens: blocks x block size (wrong for hybrid
    # models, which is why the explicit figure is preferred).
    blocks, block_size = _int_label(info, "num_gpu_blocks"), _int_label(info, "block_size")
    if blocks is None or block_size is None:
        return None
    return blocks * block_size


#: The samples :func:`engine_metrics` reads: what a load poll needs parsed.
LOAD_SAMPLES: Final = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "process_start_time_seconds",
})  # fmt: skip


def engine_metrics(samples: Mapping[str, tuple[Sample, ...]]) -> EngineMetrics:
    """Summarize parsed vLLM metrics into :class:`EngineMetrics`.

    Raises:
        ValueError: a required gauge (running, waiting, KV usage) is missing.
    """
    running = sum_samples(samples.get("vllm:num_requests_running", ()))
    waiting = sum_samples(samples.get("vllm:num_requests_waiting", ()))
    usage_samples = samples.get("vllm:kv_cache_usage_perc") or samples.get(
        "vllm:gpu_cache_usage_perc", ()
    )
    missing = [
        name
        for name, value in (
            ("vllm:num_requests_running", running),
            ("vllm:num_requests_waiting", waiting),
            ("vllm:kv_cache_usage_perc", usage_samples or None),
        )
        if value is None
    ]
    if missing or running is None or waiting is None:
        raise ValueError(f"metrics lack {', '.join(missing)}")

    infos = samples.get("vllm:cache_config_info", ())
    capacity_by_engine: dict[str | None, int] = {}
    prefix_flags: list[bool] = []
    for info in infos:
        cap = _capacity(info)
        if cap is not None:
            key = info.label("engine")
            capacity_by_engine[key] = capacity_by_engine.get(key, 0) + cap
        flag = info.label("enable_prefix_caching")
        if flag is not None:
            prefix_flags.append(flag.strip().lower() == "true")
    kv_size = sum(capacity_by_engine.values()) if capacity_by_engine else None

    weights = [capacity_by_engine.get(s.label("engine")) for s in usage_samples]
    if all(w for w in weights):
        total_weight = sum(w for w in weights if w)
        kv_usage = (
            sum(s.value * (w or 0) for s, w in zip(usage_samples, weights, strict=True))
            / total_weight
        )
    else:
        kv_usage = sum(s.value for s in usage_samples) / len(usage_samples)

    start = samples.get("process_start_time_seconds", ())
    return EngineMetrics(
        running=round(running),
        waiting=round(waiting),
        kv_usage=kv_usage,
        kv_cache_size_tokens=kv_size,
        prefix_caching=all(prefix_flags) if prefix_flags else None,
        process_start_time=start[0].value if start else None,
        samples=samples,
    )
