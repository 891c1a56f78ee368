"""narwhal.bench.workload: length specs, seeded arrival processes, traces, prompts."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from narwhal.bench.workload import (
    LengthDist,
    Workload,
    arrival_offsets,
    build_schedule,
    load_trace,
    prompt_ids,
    prompt_text,
)
from narwhal.errors import ConfigError
from narwhal.testing.tokenizer import encode


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("128", "fixed:128"),
        ("fixed:7", "fixed:7"),
        ("uniform:100:500", "uniform:100:500"),
        ("normal:200:20", "normal:200:20"),
        ("lognormal:300:150", "lognormal:300:150"),
        ("Uniform:1:1", "uniform:1:1"),
    ],
)
def test_length_specs_parse(spec: str, canonical: str) -> None:
    assert LengthDist.parse(spec).spec == canonical


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("zipf:3", "expected N"),
        ("uniform:5", "takes 2"),
        ("uniform:9:3", "LO must not exceed HI"),
        ("fixed:0", "integers >= 1"),
        ("fixed:2.5", "integers >= 1"),
        ("normal:abc:3", "not numeric"),
        ("normal:0:3", "MEAN must be >= 1"),
        ("lognormal:10:nan", "finite"),
    ],
)
def test_length_spec_errors_say_why(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LengthDist.parse(spec)


def test_length_samples_respect_their_distribution() -> None:
    rng = random.Random(3)
    uniform = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(2000)]
    assert min(uniform) == 10 and max(uniform) == 20
    normal = [LengthDist.parse("normal:200:20").sample(rng) for _ in range(4000)]
    assert statistics.fmean(normal) == pytest.approx(200, rel=0.02)
    assert statistics.pstdev(normal) == pytest.approx(20, rel=0.1)
    logn = [LengthDist.parse("lognormal:300:150").sample(rng) for _ in range(8000)]
    assert statistics.fmean(logn) == pytest.approx(300, rel=0.05)
    assert statistics.pstdev(logn) == pytest.approx(150, rel=0.1)
    assert min(LengthDist.parse("normal:2:50").sample(rng) for _ in range(200)) == 1


def test_arrivals_are_reproducible_and_start_at_zero() -> None:
    a = arrival_offsets(5, "poisson", count=50, seed=11)
    assert a == arrival_offsets(5, "poisson", count=50, seed=11)
    assert a != arrival_offsets(5, "poisson", count=50, seed=12)
    assert a[0] == 0.0 and a == sorted(a)


def test_constant_and_infinite_rates() -> None:
    assert arrival_offsets(4, "constant", count=4) == [0.0, 0.25, 0.5, 0.75]
    assert arrival_offsets(math.inf, "poisson", count=3) == [0.0, 0.0, 0.0]


def test_poisson_rate_and_gamma_burstiness() -> None:
    n = 20000
    poisson = arrival_offsets(10, "poisson", count=n, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)
    bursty = arrival_offsets(10, "gamma", burstiness=0.25, count=n, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    # Gamma with shape k has coefficient of variation 1/sqrt(k): 2 for k = 0.25.
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.1)


def test_duration_bounds_the_schedule() -> None:
    offsets = arrival_offsets(10, "constant", duration_s=1.0)
    assert len(offsets) == 10 and offsets[-1] < 1.0
    assert len(arrival_offsets(10, "constant", duration_s=1.0, count=3)) == 3


def test_workload_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="duration or a request count"):
        Workload(rate=5)
    with pytest.raises(ValueError, match="request count"):
        Workload(rate=math.inf, duration_s=10)


def test_schedule_streams_are_independent() -> None:
    base = Workload(rate=5, num_requests=40, input_len=LengthDist.parse("uniform:10:90"), seed=4)
    other = Workload(rate=5, num_requests=40, input_len=LengthDist.parse("uniform:10:90"),
                     output_len=LengthDist.parse("uniform:1:64"), seed=4)
    a, b = build_schedule(base), build_schedule(other)
    assert [r.offset_s for r in a] == [r.offset_s for r in b]
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
    assert [r.index for r in a] == list(range(40))


def test_prompts_have_the_exact_length_on_the_simulator() -> None:
    for n in (1, 7, 512):
        text = prompt_text(n, seed=0, index=3)
        assert len(encode(text)) == n
        assert text == prompt_text(n, seed=0, index=3)
    assert prompt_text(50, seed=0, index=1) != prompt_text(50, seed=0, index=2)
    ids = prompt_ids(64, seed=0, index=0)
    assert len(ids) == 64 and all(1000 <= t < 30000 for t in ids)


def _trace(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_trace_loads_sorted_by_offset(tmp_path: Path) -> None:
    path = _trace(
        tmp_path,
        {"offset_s": 1.5, "prompt_len": 10, "output_len": 4},
        "",
        {"offset_s": 0.5, "prompt": "hello there", "output_len": 2},
        {"offset_s": 1.5, "prompt_len": 3, "output_len": 1},
    )
    schedule = load_trace(path)
    assert [(r.index, r.offset_s, r.prompt_len, r.prompt, r.output_len) for r in schedule] == [
        (0, 0.5, None, "hello there", 2),
        (1, 1.5, 10, None, 4),
        (2, 1.5, 3, None, 1),
    ]


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("{not json", r"trace.jsonl:2: not JSON"),
        ('{"offset_s": 1, "prompt_len": 3}', r"trace.jsonl:2: 'output_len' is required @ \$.output_len"),
        ('{"offset_s": -1, "prompt_len": 3, "output_len": 1}', r":2: 'offset_s' must be a number >= 0"),
        ('{"offset_s": 1, "prompt_len": 0, "output_len": 1}', r":2: 'prompt_len' must be an integer >= 1"),
        ('{"offset_s": 1, "prompt": "a", "prompt_len": 1, "output_len": 1}', r":2: give exactly one"),
        ('{"offset_s": 1, "prompt_len": 2, "output_len": 1, "extra": 1}', r":2: unknown field 'extra'"),
        ("[1, 2]", r":2: a trace line must be a JSON object"),
    ],
)
def test_trace_errors_name_the_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = _trace(tmp_path, {"offset_s": 0, "prompt_len": 1, "output_len": 1}, line)
    with pytest.raises(ConfigError, match=fragment):
        load_trace(path)


def test_trace_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")
