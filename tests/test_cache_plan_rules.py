"""The cache plan's rules, one at a time: groups, owners, the producer rule, the price
of a block, the calibration of predicted hits, a consumer's transfer."""

from __future__ import annotations

import math
from typing import Any

import pytest

from narwhal.engines.metrics import engine_metrics, parse_prometheus
from narwhal.router.cachecal import CacheCalibration
from narwhal.router.cacheplan import OWNER_WITHIN, CachePlan, che_time, saved
from narwhal.router.choice import choose_producer
from narwhal.router.handoff import HandoffModel
from narwhal.router.prefix import PrefixIndex
from narwhal.router.prefixwatch import capacity_blocks
from narwhal.router.quotes import Quote, best_consumer

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefill_s(producer: str, tokens: int, cached: int) -> float:
    scale = 2.0 if producer == "slow" else 1.0
    return scale * (0.01 + 1e-3 * (tokens - cached))


def fleet(capacity: int = 1000) -> tuple[PrefixIndex, CachePlan, Clock]:
    index = PrefixIndex()
    for name in ("fast", "slow"):
        index.enable(name, block_size=BS, capacity_tokens=capacity * BS, events=False)
    clock = Clock()
    return index, CachePlan(index, prefill_s, clock), clock


def words(tag: str, n: int) -> list[int]:
    return [hash((tag, i)) % 50000 + 1000 for i in range(n)]


def test_the_turns_of_a_session_are_one_group_and_a_prefix_s_requests_another() -> None:
    index, plan, _ = fleet()
    system = words("system", 32)

    def classify(ids: list[int], placed_on: str = "fast", hint: str | None = None) -> Any:
        ticket = plan.classify(index.lookup(ids), hint, BS, ids)
        index.placed(placed_on, ids)
        return ticket

    a1 = [*system, *words("a1", 10)]
    first = classify(a1)  # nothing shares it yet: no group
    assert first.group is None
    a2 = [*a1, *words("a-answer", 5), *words("a2", 9)]
    second = classify(a2)  # it repeats the first turn whole: a session starts
    assert second.group is not None and second.group.kind == "session"
    a3 = [*a2, *words("a-answer2", 6), *words("a3", 7)]
    assert classify(a3).group is second.group  # and goes on
    # Another conversation on the same system prompt shares only the system prompt: its
    # first turn belongs to the system prompt's group, its second turn to its own session.
    b1 = [*system, *words("b1", 12)]
    b_first = classify(b1)
    assert b_first.group is not None and b_first.group.kind == "prefix"
    b2 = [*b1, *words("b2", 8)]
    b_second = classify(b2)
    assert b_second.group is not None and b_second.group.kind == "session" and b_second.group is not second.group
    # Requests of one shared prefix, each with a tail of its own, are one prefix group.
    prefix = words("document", 64)
    classify([*prefix, *words("q0", 11)])
    groups = {classify([*prefix, *words(f"q{i}", 11)]).group for i in range(1, 6)}
    assert len(groups) == 1 and next(iter(groups)).kind == "prefix"
    # A named session is its own group from its first request.
    named = classify(words("named", 20), hint="user-7")
    assert named.group is not None and named.group.key == ("h", "user-7") and named.new_session
    assert classify(words("named-2", 20), hint="user-7").group is named.group


def test_a_prefix_that_starts_sessions_places_each_request_as_a_new_session() -> None:
    index, plan, clock = fleet()
    system = words("system", 32)
    for s in range(3):  # three conversations on one system prompt, two turns each
        t1 = [*system, *words(f"s{s}", 10)]
        plan.classify(index.lookup(t1), None, BS, t1)
        index.placed("fast", t1)
        t2 = [*t1, *words(f"s{s}-2", 10)]
        plan.classify(index.lookup(t2), None, BS, t2)
        index.placed("fast", t2)
    t1 = [*system, *words("s9", 10)]
    ticket = plan.classify(index.lookup(t1), None, BS, t1)
    assert ticket.group is not None and ticket.group.sessions >= 2 and ticket.new_session
    # Its owner is chosen for the session it starts: by the producers' planned loads.
    # Both idle: the fast one (a turn's work is half there).
    assert plan.owners(ticket, ["fast", "slow"], lambda n: 128, len(t1), 0.5) == ["fast"]
    assert ticket.group.owners == []  # (the prefix itself keeps none: each session its own)
    # The fast one owns more already: the slow one (both can take the turn in time).
    plan.owned_load["fast"] = 0.9
    assert plan.owners(ticket, ["fast", "slow"], lambda n: 128, len(t1), 0.5) == ["slow"]
    clock.now += 1.0


def quote(engine: str, predicted: float, cached: int = 0, queue: float = 0.0, delays: int = 0) -> Quote:
    return Quote(engine, predicted, 1.0 - predicted / 0.5, cached_tokens=cached, queue_s=queue, delays=delays)


def test_a_young_group_goes_to_its_owner_while_it_meets_the_target_within_the_share() -> None:
    index, plan, _ = fleet()
    ids = [*words("p", 40), *words("t", 9)]
    index.placed("fast", ids)
    ticket = plan.classify(index.lookup(ids), None, BS, ids)
    assert ticket.group is not None
    ticket.group.owners = ["slow"]  # the plan gave it to the slow producer
    quotes = [quote("fast", 0.05, cached=160), quote("slow", 0.30, cached=0)]
    choice = choose_producer(quotes, target_s=0.5, handoff_s=0.02, bound=lambda q: q.predicted_s, plan=plan,
                             ticket=ticket, cached=lambda n: 160 if n == "fast" else 0, prompt_tokens=len(ids))  # fmt: skip
    assert (choice.quote.engine, choice.rule) == ("slow", "move")  # a miss, in time: it moves now
    assert choice.runner_up is not None and choice.runner_up.engine == "fast"
    assert choice.others == {"fast": "not an owner of " + ticket.group.label()}
    # Over the share of the target with the handoff: the price decides (the hit).
    late = [quote("fast", 0.05, cached=160), quote("slow", OWNER_WITHIN * 0.5 - 0.01, cached=0)]
    choice = choose_producer(late, target_s=0.5, handoff_s=0.02, bound=lambda q: q.predicted_s, plan=plan,
                             ticket=ticket, cached=lambda n: 160 if n == "fast" else 0, prompt_tokens=len(ids))  # fmt: skip
    assert (choice.quote.engine, choice.rule) == ("fast", "spill")
    assert choice.others["slow"].startswith("price ")
    # Nobody in time: the most headroom, to be refused.
    over = [quote("fast", 0.7, cached=160), quote("slow", 0.9), quote("third", 0.4, delays=2)]
    choice = choose_producer(over, target_s=0.5, handoff_s=0.0, bound=lambda q: q.predicted_s, plan=plan,
                             ticket=ticket, cached=lambda n: 0, prompt_tokens=len(ids))  # fmt: skip
    assert (choice.quote.engine, choice.rule) == ("fast", "over_target")
    assert choice.others == {"slow": "TTFT 900.0 ms over the target",
                             "third": "would make 2 request(s) queued there miss the TTFT target"}  # fmt: skip


def test_an_established_group_moves_home_only_at_low_load() -> None:
    index, plan, clock = fleet()
    ids = [*words("p", 40), *words("t", 9)]
    index.placed("fast", ids)
    ticket = plan.classify(index.lookup(ids), None, BS, ids)
    group = ticket.group
    assert group is not None
    group.owners, group.turns = ["slow"], 10
    args: dict[str, Any] = {"target_s": 0.5, "handoff_s": 0.0, "bound": lambda q: q.predicted_s, "plan": plan,
                            "ticket": ticket, "cached": lambda n: 0, "prompt_tokens": len(ids)}  # fmt: skip
    idle = [quote("fast", 0.05, cached=160), quote("slow", 0.2, queue=0.01)]
    assert choose_producer(idle, **args).rule == "move"
    queued = [quote("fast", 0.05, cached=160), quote("slow", 0.24, queue=0.06)]  # over a tenth of the target
    assert choose_producer(queued, **args).rule == "spill"
    plan.placed(ticket, "slow", len(ids), work_s=0.6 * 30)  # busy lately, over half its time
    clock.now += 1.0
    assert choose_producer(idle, **args).rule == "spill"


def test_without_a_plan_the_most_headroom_wins_as_before() -> None:
    quotes = [quote("a", 0.2), quote("b", 0.1), quote("c", 0.05, delays=1)]
    choice = choose_producer(quotes, target_s=0.5, handoff_s=0.0, bound=lambda q: q.predicted_s)
    assert (choice.quote.engine, choice.rule, choice.runner_up.engine if choice.runner_up else None) == (
        "b", "headroom", "a")
    assert choice.others == {"a": "less headroom", "c": "would make 1 request(s) queued there miss the TTFT target"}


def test_che_time_and_the_price_of_a_block() -> None:
    # Everything fits, nothing used once: blocks stay for ever; no price.
    assert che_time([(10, 1.0, 0.1)], 0.0, 100) == math.inf
    # Blocks used once only: the cache turns over in capacity / rate seconds.
    assert che_time([], 5.0, 100) == pytest.approx(20.0, rel=1e-6)
    # A group of 50 blocks requested once a second beside 5 blocks a second used once.
    t = che_time([(50, 1.0, 0.1)], 5.0, 100)
    assert 50 * (1 - math.exp(-t)) + 5 * t == pytest.approx(100, rel=1e-6)
    assert saved([(50, 1.0, 0.1)], t) == pytest.approx(0.1 * (1 - math.exp(-t)))
    index, plan, clock = fleet(capacity=60)
    # One prefix of 40 blocks, requested twice a second, with a 20-block tail each time:
    # the producer's cache (60 blocks) turns over faster than the prefix comes back.
    prefix = words("p", 160)
    for i in range(60):
        ids = [*prefix, *words(f"t{i}", 80)]
        ticket = plan.classify(index.lookup(ids), None, BS, ids)
        index.placed("fast", ids)
        plan.placed(ticket, "fast", len(ids))
        clock.now += 0.5
    plan.replan(["fast", "slow"], 0.5)
    assert plan.block_price["fast"] > 0 and plan.block_price["slow"] == 0.0  # nothing placed there
    assert 0 < plan.cache_time["fast"] < 5
    # A request that would compute the prefix again on the slow producer costs nothing
    # later there (its cache has room); on the fast one, what it holds costs nothing.
    ticket = plan.classify(index.lookup([*prefix, 1]), None, BS, [*prefix, 1])
    assert plan.future_s(ticket, "fast", 0) == pytest.approx(plan.block_price["fast"] * len(ticket.chain))
    assert plan.future_s(ticket, "fast", len(ticket.chain) * BS) == 0.0


def test_predicted_hits_that_do_not_materialize_are_priced_at_the_observed_share() -> None:
    events: list[dict[str, Any]] = []
    cal = CacheCalibration(publish=events.append)

    def record(producer: str, predicted: int, reported: int | None) -> dict[str, Any]:
        return {"prompt_tokens": 1200, "attempts": [
            {"producer": producer, "predicted_cached_tokens": predicted, "cached_tokens": reported}]}  # fmt: skip

    for _ in range(19):
        cal.on_record(record("p0", 1024, 0))
    assert cal.factor("p0") == 1.0 and cal.ratio("p0") is None  # too few to say
    cal.on_record(record("p0", 1024, 512))
    assert cal.ratio("p0") == pytest.approx(512 / (20 * 1024))
    assert cal.factor("p0") == cal.ratio("p0") and "p0" in cal.overpredicting
    assert events and events[-1]["event"] == "overpredicting" and events[-1]["engine"] == "p0"
    for _ in range(200):  # the hits materialize again: the window forgets the old misses
        cal.on_record(record("p0", 1024, 1024))
    assert "p0" not in cal.overpredicting and events[-1]["event"] == "calibrated"
    assert cal.status("p0") == {"materialized": 1.0, "state": "ok"}
    # A hit larger than predicted is not the index's error; a miss predicted is no sample.
    cal.on_record(record("p1", 0, 512))
    assert cal.ratio("p1") is None


def test_the_counters_calibrate_an_engine_that_reports_no_hit_per_request() -> None:
    cal = CacheCalibration()

    def placed(predicted: int, n: int) -> None:
        for _ in range(n):
            cal.on_record({"prompt_tokens": 1000, "attempts": [
                {"producer": "p0", "predicted_cached_tokens": predicted, "cached_tokens": None}]})  # fmt: skip

    cal.observe_counters("p0", 0.0, 0.0)  # a first read
    placed(800, 40)
    cal.observe_counters("p0", 16000.0, 40000.0)  # 16,000 of the 32,000 predicted
    assert cal.ratio("p0") == pytest.approx(0.5) and "p0" in cal.overpredicting
    placed(800, 40)
    cal.observe_counters("p0", 50000.0, 100000.0)  # others' traffic: 60,000 queried, 40,000 ours
    assert cal.ratio("p0") == pytest.approx(0.5)  # not taken
    assert cal.status("nobody") == {"materialized": None, "state": "unknown"}


def test_an_engine_s_capacity_is_its_pool_less_the_null_block() -> None:
    def metrics(info: str) -> Any:
        text = ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
                f"vllm:cache_config_info{{{info}}} 1.0\n")  # fmt: skip
        return engine_metrics(parse_prometheus(text))

    assert capacity_blocks(metrics('block_size="16",num_gpu_blocks="1025",kv_cache_size_tokens="16400"'), 16) == 1024
    assert capacity_blocks(metrics('block_size="16",kv_cache_size_tokens="16384"'), 16) == 1024
    assert capacity_blocks(metrics('block_size="16",num_gpu_blocks="None",kv_cache_size_tokens="160"'), 16) == 10


def test_a_consumer_holding_the_history_wins_when_it_shortens_the_transfer() -> None:
    model = HandoffModel()
    for i in range(40):  # 10 ms plus 20 us a pulled token
        pulled = 100 + 100 * (i % 10)
        model.observe("d0", 0.010 + 2e-5 * pulled, pulled)
    assert model.per_token["d0"] == pytest.approx(2e-5, rel=1e-3)
    model.per_token["d1"] = 2e-5
    holder = Quote("d0", 0.020, 1 - 0.020 / 0.05, cached_tokens=3000)
    other = Quote("d1", 0.0195, 1 - 0.0195 / 0.05, cached_tokens=0)  # 2.5% faster: no tie
    assert best_consumer([holder, other]).engine == "d1"  # without the measure: the headroom
    # 3,000 tokens not pulled save 60 ms, 12% of the TTFT target, against 1% of TPOT headroom.
    assert best_consumer([holder, other], model.per_token, 0.5).engine == "d0"
    far = Quote("d1", 0.010, 1 - 0.010 / 0.05, cached_tokens=0)  # 40 points of headroom more
    assert best_consumer([holder, far], model.per_token, 0.5).engine == "d1"
    model.forget("d0")
    assert "d0" not in model.per_token


def test_the_handoff_slope_waits_for_enough_requests_and_spread_and_follows_the_recent_ones() -> None:
    model = HandoffModel()
    for i in range(19):
        pulled = 100 + 100 * (i % 10)
        model.observe("d0", 0.010 + 2e-5 * pulled, pulled)
    assert "d0" not in model.per_token  # 19 requests: not yet
    model.observe("d0", 0.010 + 2e-5 * 500, 500)
    assert model.per_token["d0"] == pytest.approx(2e-5, rel=1e-3)
    # Too little spread in what was pulled (a two-point spread of 120 tokens: 60 from
    # the mean) says nothing about the slope, however many requests.
    for i in range(100):
        pulled = 1000 + 120 * (i % 2)
        model.observe("d1", 0.010 + 2e-5 * pulled, pulled)
    assert "d1" not in model.per_token
    for i in range(40):  # 130 tokens apart: 65 from the mean, over MIN_SPREAD
        pulled = 1000 + 130 * (i % 2)
        model.observe("d2", 0.010 + 3e-5 * pulled, pulled)
    assert model.per_token["d2"] == pytest.approx(3e-5, rel=1e-3)
    # The link got slower: 300 requests later the fit is the new slope (decayed sums).
    for i in range(300):
        pulled = 100 + 100 * (i % 10)
        model.observe("d0", 0.010 + 6e-5 * pulled, pulled)
    assert model.per_token["d0"] == pytest.approx(6e-5, rel=0.01)
    # A handoff that shrinks with the tokens pulled is noise, not a negative price.
    for i in range(40):
        pulled = 100 + 100 * (i % 10)
        model.observe("d3", 0.050 - 2e-5 * pulled, pulled)
    assert model.per_token["d3"] == 0.0
