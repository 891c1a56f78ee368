"""Prometheus metrics of a simulated engine, with vLLM's names, labels and buckets.

Only the series a router or profiler reads are produced, each spelled exactly as in a
real vLLM's ``/metrics`` (text format 0.0.4 as ``prometheus_client`` writes it: label
names sorted, counters announced with their ``_total`` name, Go-style floats).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

__all__ = ["EngineMetrics", "Histogram", "MetricsSnapshot", "format_value", "render_metrics"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def format_value(value: float) -> str:
    """A float as ``prometheus_client`` writes it (``1.0``, ``1.79620882233e+09``)."""
    d = float(value)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


class Histogram:
    """A cumulative histogram with fixed upper bounds (``+Inf`` implied)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append((format_value(bound), running))
        return out


@attrs.define
class EngineMetrics:
    """Counters and histograms of one engine generation (reset by a restart)."""

    prompt_tokens_by_source: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(PROMPT_SOURCES, 0)
    )
    generation_tokens: int = 0
    request_success: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    nixl_failed_transfers: int = 0
    nixl_expired: int = 0
    ttft: Histogram = attrs.field(factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = attrs.field(factory=lambda: Histogram(ITL_BUCKETS))
    tpot: Histogram = attrs.field(factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = attrs.field(factory=lambda: Histogram(REQUEST_BUCKETS))
    queue_time: Histogram = attrs.field(factory=lambda: Histogram(REQUEST_BUCKETS))
    #: From a request's scheduling to its first token (vLLM's PREFILL phase), and to its
    #: end (RUNNING).
    prefill_time: Histogram = attrs.field(factory=lambda: Histogram(REQUEST_BUCKETS))
    inference_time: Histogram = attrs.field(factory=lambda: Histogram(REQUEST_BUCKETS))
    xfer_time: Histogram = attrs.field(factory=lambda: Histogram(XFER_BUCKETS))


@attrs.frozen
class MetricsSnapshot:
    """The gauges and identity labels rendered next to :class:`EngineMetrics`."""

    model_name: str
    process_start_time: float
    running: int
    waiting: int
    kv_usage: float
    block_size: int
    num_gpu_blocks: int
    kv_cache_size_tokens: int
    max_model_len: int
    prefix_caching: bool
    has_connector: bool


def _labels(pairs: Mapping[str, str]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Writer:
    def __init__(self, base: Mapping[str, str]) -> None:
        self.base = dict(base)
        self.lines: list[str] = []

    def head(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, extra: Mapping[str, str] | None = None,
               *, base: bool = True) -> None:  # fmt: skip
        labels = {**(self.base if base else {}), **(extra or {})}
        self.lines.append(f"{name}{_labels(labels)} {format_value(value)}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.head(name, "gauge", help_text)
        self.sample(name, value)

    def counter(self, name: str, help_text: str, values: Iterable[tuple[dict[str, str], float]]) -> None:
        self.head(f"{name}_total", "counter", help_text)
        for extra, value in values:
            self.sample(f"{name}_total", value, extra)

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        self.head(name, "histogram", help_text)
        for le, n in hist.cumulative():
            self.sample(f"{name}_bucket", n, {"le": le})
        self.sample(f"{name}_count", hist.count)
        self.sample(f"{name}_sum", hist.sum)


def render_metrics(snap: MetricsSnapshot, m: EngineMetrics) -> str:
    """The ``/metrics`` text of one engine."""
    w = _Writer({"engine": "0", "model_name": snap.model_name})
    w.head("process_start_time_seconds", "gauge",
           "Start time of the process since unix epoch in seconds.")  # fmt: skip
    w.sample("process_start_time_seconds", snap.process_start_time, base=False)
    if snap.has_connector:
        w.histogram("vllm:nixl_xfer_time_seconds",
                    "Histogram of transfer duration for NIXL KV Cache transfers.", m.xfer_time)  # fmt: skip
        w.counter("vllm:nixl_num_failed_transfers",
                  "Number of failed NIXL KV Cache transfers, including handshake and notification "
                  "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
                  [({}, m.nixl_failed_transfers)])  # fmt: skip
        w.counter("vllm:nixl_num_kv_expired_reqs",
                  "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
                  [({}, m.nixl_expired)])  # fmt: skip
    w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
            snap.running)  # fmt: skip
    w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.waiting)
    w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_usage)
    w.counter("vllm:prefix_cache_queries",
              "Prefix cache queries, in terms of number of queried tokens.",
              [({}, m.prefix_cache_queries)])  # fmt: skip
    w.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
              [({}, m.prefix_cache_hits)])  # fmt: skip
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
              [({}, sum(m.prompt_tokens_by_source.values()))])  # fmt: skip
    w.counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
              [({"source": s}, m.prompt_tokens_by_source[s]) for s in PROMPT_SOURCES])  # fmt: skip
    w.counter("vllm:generation_tokens", "Number of generation tokens processed.",
              [({}, m.generation_tokens)])  # fmt: skip
    w.counter("vllm:request_success", "Count of successfully processed requests.",
              [({"finished_reason": r}, m.request_success[r]) for r in FINISH_REASONS])  # fmt: skip
    w.histogram("vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.", m.ttft)  # fmt: skip
    w.histogram("vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.", m.itl)  # fmt: skip
    w.histogram("vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.", m.tpot)  # fmt: skip
    w.histogram("vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.", m.e2e)  # fmt: skip
    w.histogram("vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.", m.queue_time)  # fmt: skip
    w.histogram("vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.", m.inference_time)  # fmt: skip
    w.histogram("vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.", m.prefill_time)  # fmt: skip
    w.head("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    info = {
        "block_size": str(snap.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(snap.prefix_caching),
        "engine": "0",
        "gpu_memory_utilization": "0.92",
        "kv_cache_max_concurrency": repr(snap.kv_cache_size_tokens / snap.max_model_len),
        "kv_cache_size_tokens": str(snap.kv_cache_size_tokens),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(snap.num_gpu_blocks),
        "user_specified_block_size": "True",
    }
    w.sample("vllm:cache_config_info", 1.0, info, base=False)
    return "\n".join(w.lines) + "\n"
