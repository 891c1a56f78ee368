"""What an engine's ``/metrics`` may say: each gauge's range, each capacity label's, and how
the cores' figures combine (narwhal.engines.metrics.engine_metrics), rule by rule.

A page is built from the samples a test names; the rest of an idle vLLM page is there
unless the test replaces it. Every refused page is :class:`MalformedMetrics`, whose
message names the gauge or label and the value (an operator reads it in the warning).
"""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.engines.metrics import (
    MAX_CAPACITY,
    MAX_REQUESTS,
    MAX_START_TIME,
    MalformedMetrics,
    engine_metrics,
    parse_prometheus,
)

RUNNING = 'vllm:num_requests_running{engine="0"} 2.0'
WAITING = 'vllm:num_requests_waiting{engine="0"} 1.0'
USAGE = 'vllm:kv_cache_usage_perc{engine="0"} 0.5'
INFO = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",kv_cache_size_tokens="4096"} 1.0'
START = "process_start_time_seconds 1.7e9"


def page(*lines: str, running: str | None = RUNNING, waiting: str | None = WAITING, usage: str | None = USAGE,
         info: str | None = INFO, start: str | None = START) -> Any:  # fmt: skip
    text = "\n".join(line for line in (running, waiting, usage, info, start, *lines) if line is not None)
    return engine_metrics(parse_prometheus(text))


def info(**labels: str) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"vllm:cache_config_info{{{body}}} 1.0"


def test_an_idle_vllm_page() -> None:
    m = page()
    assert (m.running, m.waiting, m.kv_usage) == (2, 1, 0.5)
    assert (m.kv_cache_size_tokens, m.block_size, m.prefix_caching, m.process_start_time) == (4096, 16, True, 1.7e9)


def test_what_is_missing_is_named() -> None:
    with pytest.raises(MalformedMetrics) as err:
        page(running=None, waiting=None, usage=None)
    assert str(err.value) == "metrics lack vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc"
    with pytest.raises(MalformedMetrics, match=r"^metrics lack vllm:num_requests_waiting$"):
        page(waiting=None)


def test_older_builds_name_the_usage_gpu_cache_usage_perc() -> None:
    assert page(usage='vllm:gpu_cache_usage_perc{engine="0"} 0.25').kv_usage == 0.25


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('vllm:num_requests_running{engine="0"} +Inf', "vllm:num_requests_running is inf, not a number in 0..1e+07"),
        ('vllm:num_requests_running{engine="0"} NaN', "vllm:num_requests_running is nan, not a number in 0..1e+07"),
        ('vllm:num_requests_running{engine="0"} -1', "vllm:num_requests_running is -1.0, not a number in 0..1e+07"),
        (f'vllm:num_requests_running{{engine="0"}} {MAX_REQUESTS + 1}', "vllm:num_requests_running is 10000001.0"),
        ('vllm:num_requests_waiting{engine="0"} -0.5', "vllm:num_requests_waiting is -0.5, not a number in 0..1e+07"),
        ('vllm:kv_cache_usage_perc{engine="0"} 1.5', "vllm:kv_cache_usage_perc is 1.5, not a number in 0..1"),
        ('vllm:kv_cache_usage_perc{engine="0"} -0.1', "vllm:kv_cache_usage_perc is -0.1, not a number in 0..1"),
    ],
)
def test_a_gauge_out_of_its_range_is_refused(line: str, message: str) -> None:
    name = line.split("{")[0].removeprefix("vllm:")
    kwargs = {"running": None} if "running" in name else {"waiting": None} if "waiting" in name else {"usage": None}
    with pytest.raises(MalformedMetrics) as err:
        page(line, **kwargs)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)


def test_the_ranges_include_their_ends() -> None:
    m = page(running=f'vllm:num_requests_running{{engine="0"}} {MAX_REQUESTS}', waiting='vllm:num_requests_waiting 0',
             usage='vllm:kv_cache_usage_perc{engine="0"} 1.0', start=f"process_start_time_seconds {MAX_START_TIME}")  # fmt: skip
    assert (m.running, m.waiting, m.kv_usage, m.process_start_time) == (MAX_REQUESTS, 0, 1.0, MAX_START_TIME)
    assert page(start="process_start_time_seconds 0.5").process_start_time == 0.5  # 1970 is a date


@pytest.mark.parametrize("value", ["+Inf", "NaN", "-1", f"{MAX_START_TIME * 2}"])
def test_a_start_time_that_is_no_date_is_refused(value: str) -> None:
    with pytest.raises(MalformedMetrics, match=r"^process_start_time_seconds is .*, not a number in 0\.\.2\.53402e\+11$"):
        page(start=f"process_start_time_seconds {value}")


def test_no_start_time_is_none() -> None:
    assert page(start=None).process_start_time is None


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"kv_cache_size_tokens": "-4096"}, "kv_cache_size_tokens='-4096'"),
        ({"kv_cache_size_tokens": "1.5"}, "kv_cache_size_tokens='1.5'"),
        ({"kv_cache_size_tokens": "inf"}, "kv_cache_size_tokens='inf'"),
        ({"kv_cache_size_tokens": str(MAX_CAPACITY + 1)}, f"kv_cache_size_tokens='{MAX_CAPACITY + 1}'"),
        ({"kv_cache_size_tokens": "1" * 50}, "kv_cache_size_tokens='" + "1" * 40 + "'"),  # cut at 40
        ({"num_gpu_blocks": "-1", "block_size": "16"}, "num_gpu_blocks='-1'"),
        ({"block_size": "-16", "kv_cache_size_tokens": "16"}, "block_size='-16'"),
        ({"block_size": "NaN"}, "block_size='NaN'"),
    ],
)
def test_a_capacity_label_that_is_no_integer_in_range_is_refused(labels: dict[str, str], message: str) -> None:
    with pytest.raises(MalformedMetrics) as err:
        page(info=info(engine="0", **labels))
    assert str(err.value) == f"vllm:cache_config_info has {message}, not an integer in 0..{MAX_CAPACITY}"


def test_capacity_labels_at_the_ends_of_their_range_and_unknown_ones() -> None:
    assert page(info=info(engine="0", kv_cache_size_tokens="0")).kv_cache_size_tokens == 0
    assert page(info=info(engine="0", kv_cache_size_tokens=str(MAX_CAPACITY))).kv_cache_size_tokens == MAX_CAPACITY
    unknown = page(info=info(engine="0", kv_cache_size_tokens="None", block_size="None"))
    assert unknown.kv_cache_size_tokens is None and unknown.block_size is None
    bare = page(info=None)
    assert bare.kv_cache_size_tokens is None and bare.prefix_caching is None and bare.block_size is None


def test_builds_without_kv_cache_size_tokens_multiply_blocks_by_block_size() -> None:
    assert page(info=info(engine="0", num_gpu_blocks="10", block_size="16")).kv_cache_size_tokens == 160
    assert page(info=info(engine="0", num_gpu_blocks="10")).kv_cache_size_tokens is None
    assert page(info=info(engine="0", block_size="16")).kv_cache_size_tokens is None
    huge = page(info=info(engine="0", num_gpu_blocks=str(2**40), block_size=str(2**10)))
    assert huge.kv_cache_size_tokens == MAX_CAPACITY  # at most the range's end


def test_usage_is_weighted_by_each_cores_capacity_when_each_reports_one() -> None:
    two = ('vllm:kv_cache_usage_perc{engine="0"} 0.5', 'vllm:kv_cache_usage_perc{engine="1"} 0.25')
    caps = (info(engine="0", kv_cache_size_tokens="1000"), info(engine="1", kv_cache_size_tokens="3000"))
    m = page(*two, *caps, usage=None, info=None)
    assert m.kv_usage == (0.5 * 1000 + 0.25 * 3000) / 4000 and m.kv_cache_size_tokens == 4000
    # One core without a capacity (or with none): the plain mean.
    assert page(*two, caps[0], usage=None, info=None).kv_usage == 0.375
    zero = info(engine="1", kv_cache_size_tokens="0")
    assert page(*two, caps[0], zero, usage=None, info=None).kv_usage == 0.375
    # Capacities of one core reported twice add up.
    again = info(engine="0", kv_cache_size_tokens="3000")
    assert page(caps[0], again, info=None).kv_cache_size_tokens == 4000


def test_requests_add_up_over_cores_and_round() -> None:
    m = page('vllm:num_requests_running{engine="1"} 2.6', 'vllm:num_requests_waiting{engine="1"} 0.4')
    assert (m.running, m.waiting) == (5, 1)


def test_prefix_caching_is_on_only_when_every_core_has_it() -> None:
    assert page(info(engine="1", enable_prefix_caching="False")).prefix_caching is False
    assert page(info(engine="1", enable_prefix_caching=" true ")).prefix_caching is True
