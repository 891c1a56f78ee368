"""The split simulation behind ``suggest-slo``, step by step on hand-computed cases.

Coefficients are powers of two where the order of events matters, so that the times
compare exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from narwhal.check.simulate import simulate_split, ttft_of
from narwhal.profile.store import EngineProfile
from tests.checkkit import identity_of, sim_profile


def prof(
    name: str,
    *,
    prefill: Mapping[str, float] | None = None,
    decode: Mapping[str, float] | None = None,
) -> EngineProfile:
    return sim_profile(
        name,
        identity_of(name, 8100),
        prefill=prefill or {"a": 1.0, "b": 0.0, "c": 0.0},
        decode=decode or {"c0": 0.25, "c1": 0.0, "c2": 0.0},
    )


def test_ttft_of_is_the_quadratic_at_every_length() -> None:
    p = prof("p", prefill={"a": 0.5, "b": 0.25, "c": 0.125})
    got = ttft_of(p, np.array([0, 2, 4]))
    assert got.tolist() == [0.5, 0.5 + 0.5 + 0.5, 0.5 + 1.0 + 2.0]


def test_ttft_of_prices_huge_integer_lengths_without_overflow() -> None:
    """The square of 3.04e9 tokens is past int64: the curve is priced in floats."""
    p = prof("p", prefill={"a": 0.0, "b": 0.0, "c": 1.0})
    assert ttft_of(p, np.array([3_037_000_500])).tolist() == [3_037_000_500.0**2]


def test_requests_whose_prefills_end_together_join_in_arrival_order() -> None:
    """Twenty producers: every prefill takes 1 s from its arrival, so the odd requests
    end at 1 and the even ones at 2. The first of each group decodes alone for a step
    (0.1875 s); the rest join at the next step (ten sequences: 0.75 s). That first is
    the earliest of its group by index: request 0 for the even ones, whose TPOT is the
    ten-sequence step; every other even request's is the nine-sequence step after it."""
    producers = [prof(f"p{i}") for i in range(20)]
    d = prof("d", decode={"c0": 0.125, "c1": 0.0625, "c2": 0.0})
    run = simulate_split(producers, [d], [1.0, 0.0] * 10, [4] * 20, [2, 1] * 10, warmup_fraction=0.0)
    assert run.ttft_s.tolist() == [1.0] * 20
    assert run.tpot_s.tolist() == [0.75] + [0.6875] * 9


def test_prefill_goes_to_the_producer_that_finishes_first_and_queues_fcfs() -> None:
    fast = prof("fast", prefill={"a": 1.0, "b": 0.0, "c": 0.0})
    slow = prof("slow", prefill={"a": 1.5, "b": 0.0, "c": 0.0})
    run = simulate_split(
        [fast, slow], [prof("d")], [0.0, 0.0, 0.0, 4.0], [8, 8, 8, 8], [1, 1, 1, 1],
        warmup_fraction=0.0,
    )  # fmt: skip
    # r0 -> fast (ends 1); r1: fast would end 2, slow 1.5 -> slow; r2: fast 2, slow 3 -> fast;
    # r3 arrives after both are free: fast, 1 s.
    assert run.ttft_s.tolist() == [1.0, 1.5, 2.0, 1.0]
    assert run.requests == 4 and run.warmup == 0
    # One output token each: no TPOT.
    assert run.tpot_s.tolist() == []


def test_a_tie_between_producers_goes_to_the_first() -> None:
    a = prof("a", prefill={"a": 1.0, "b": 0.0, "c": 0.0})
    b = prof("b", prefill={"a": 1.0, "b": 0.0, "c": 0.0})
    run = simulate_split([a, b], [prof("d")], [0.0, 0.0, 0.0], [8, 8, 8], [1, 1, 1],
                         warmup_fraction=0.0)  # fmt: skip
    assert run.ttft_s.tolist() == [1.0, 1.0, 2.0]


def test_one_sequence_decodes_one_token_per_step_with_its_resident_kv() -> None:
    d = prof("d", decode={"c0": 0.25, "c1": 0.125, "c2": 0.0625})
    run = simulate_split([prof("p")], [d], [0.0], [2], [3], warmup_fraction=0.0)
    # Steps: kv 2 -> 0.25+0.125+0.125 = 0.5 (first token at 1.5); kv 3 -> 0.5625; kv 4 -> 0.625.
    assert run.ttft_s.tolist() == [1.0]
    assert run.tpot_s.tolist() == [(0.5625 + 0.625) / 2]
    assert run.peak_kv == {"d": 4} and run.peak_active == {"d": 1}


def test_a_request_that_arrives_mid_step_joins_at_the_next_step() -> None:
    d = prof("d", decode={"c0": 0.25, "c1": 0.125, "c2": 0.0})
    p = prof("p", prefill={"a": 1.0, "b": 0.0, "c": 0.0})
    run = simulate_split([p, prof("p2", prefill={"a": 1.25, "b": 0.0, "c": 0.0})], [d],
                         [0.0, 0.0], [4, 4], [2, 2], warmup_fraction=0.0)  # fmt: skip
    # r0 decodes [1, 1.375]; r1 (prefill ends 1.25) waits, then both [1.375, 1.875]
    # (r0 done), then r1 alone [1.875, 2.25].
    assert run.ttft_s.tolist() == [1.0, 1.25]
    assert run.tpot_s.tolist() == [0.5, 0.375]
    assert run.peak_active == {"d": 2}
    # Resident KV: 4 (r0) -> 5 + 4 (r1 pending) = 9 at the two-sequence step.
    assert run.peak_kv == {"d": 9}


def test_a_step_that_ends_as_a_request_arrives_runs_first() -> None:
    d = prof("d", decode={"c0": 0.25, "c1": 0.0, "c2": 0.0})
    p = prof("p", prefill={"a": 1.0, "b": 0.0, "c": 0.0})
    late = prof("late", prefill={"a": 1.25, "b": 0.0, "c": 0.0})
    # r0's first step ends at 1.25, exactly when r1's prefill ends: the step is processed
    # first (r0 continues alone, KV 5), r1 joins at the step after: that step holds r0's
    # prompt and two tokens plus r1's prompt (arrival first would have priced 4 + 1 + 4).
    run = simulate_split([p, late], [d], [0.0, 0.0], [4, 4], [3, 2], warmup_fraction=0.0)
    assert run.tpot_s.tolist() == [0.25, 0.25]
    assert run.peak_active == {"d": 2}
    assert run.peak_kv == {"d": 4 + 2 + 4}


def test_a_finished_sequence_releases_its_kv() -> None:
    d = prof("d", decode={"c0": 0.25, "c1": 0.0, "c2": 0.0625})
    # r0 (prompt 4, 2 tokens) finishes; r1 (prompt 4) arrives later and decodes alone:
    # its steps price kv 4 then 5, not 4 + r0's leftovers.
    run = simulate_split([prof("p")], [d], [0.0, 10.0], [4, 4], [2, 2], warmup_fraction=0.0)
    assert run.tpot_s.tolist() == [0.25 + 0.0625 * 5, 0.25 + 0.0625 * 5]
    assert run.peak_kv == {"d": 5}


def test_a_request_joins_the_consumer_its_step_slows_least() -> None:
    cheap = prof("cheap", decode={"c0": 0.25, "c1": 1.0, "c2": 0.0})
    dear = prof("dear", decode={"c0": 0.5, "c1": 0.0, "c2": 0.0})
    # Joining cheap costs c0 + c1*1 = 1.25, dear 0.5: dear, both times (r1 comes after r0).
    run = simulate_split([prof("p")], [cheap, dear], [0.0, 10.0], [4, 4], [2, 2],
                         warmup_fraction=0.0)  # fmt: skip
    assert run.peak_active == {"cheap": 0, "dear": 1}
    cheap = prof("cheap", decode={"c0": 0.25, "c1": 0.125, "c2": 0.0})
    run = simulate_split([prof("p")], [cheap, dear], [0.0], [4], [2], warmup_fraction=0.0)
    assert run.peak_active == {"cheap": 1, "dear": 0}
    assert run.tpot_s.tolist() == [0.375]


def test_joining_counts_the_prompt_and_the_sequences_already_there() -> None:
    a = prof("a", decode={"c0": 0.25, "c1": 0.0, "c2": 0.0625})
    b = prof("b", decode={"c0": 0.5, "c1": 0.0, "c2": 0.0})
    # r0 (prompt 2): a costs 0.375, b 0.5 -> a. r1 (prompt 2) at the same time: a would
    # cost 0.25 + 0.0625*(2+2) = 0.5, b 0.5: a tie goes to a. r2: a 0.75 -> b.
    run = simulate_split([prof("p"), prof("p1"), prof("p2")], [a, b], [0.0, 0.0, 0.0],
                         [2, 2, 2], [2, 2, 2], warmup_fraction=0.0)  # fmt: skip
    assert run.peak_active == {"a": 2, "b": 1}
    c1 = prof("a", decode={"c0": 0.25, "c1": 0.0625, "c2": 0.0})
    # With the batch priced instead: r0 -> a (0.3125 < 0.5); r1: a 0.375 -> a; r2: a 0.4375
    # -> a; a fourth: 0.5 tie -> a.
    run = simulate_split([prof(f"p{i}") for i in range(4)], [c1, b], [0.0] * 4, [2] * 4,
                         [2] * 4, warmup_fraction=0.0)  # fmt: skip
    assert run.peak_active == {"a": 4, "b": 0}
    # Steeper: 0.375, then 0.5 (a tie: a), then 0.625 -> b.
    steep = prof("a", decode={"c0": 0.25, "c1": 0.125, "c2": 0.0})
    run = simulate_split([prof(f"p{i}") for i in range(3)], [steep, b], [0.0] * 3, [2] * 3,
                         [2] * 3, warmup_fraction=0.0)  # fmt: skip
    assert run.peak_active == {"a": 2, "b": 1}


@pytest.mark.parametrize(
    ("n", "fraction", "warmup"), [(10, 0.1, 1), (10, 0.25, 2), (1, 1.0, 0), (3, 1.0, 2)]
)
def test_the_warm_up_is_left_out_but_never_every_request(n: int, fraction: float, warmup: int) -> None:
    run = simulate_split([prof("p")], [prof("d")], [10.0 * i for i in range(n)], [4] * n,
                         [2] * n, warmup_fraction=fraction)  # fmt: skip
    assert run.warmup == warmup and run.requests == n
    assert len(run.ttft_s) == n - warmup and len(run.tpot_s) == n - warmup


def test_the_default_warm_up_is_a_tenth() -> None:
    run = simulate_split([prof("p")], [prof("d")], [10.0 * i for i in range(20)], [4] * 20, [2] * 20)
    assert run.warmup == 2 and len(run.ttft_s) == 18


def test_tpot_leaves_out_single_token_requests_only() -> None:
    run = simulate_split([prof("p")], [prof("d")], [0.0, 10.0, 20.0], [4, 4, 4], [1, 2, 3],
                         warmup_fraction=0.0)  # fmt: skip
    assert run.ttft_s.tolist() == [1.0, 1.0, 1.0]
    assert run.tpot_s.tolist() == [0.25, 0.25]
