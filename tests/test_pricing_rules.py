"""Profile pricing's rules, one at a time, on :class:`PricedPlacement` itself: each
producer and consumer price, the choice, admission and the queue it keeps (no engines;
a hand-driven clock, or trio's virtual one where admission waits)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio

from narwhal.config import SLOConfig
from narwhal.errors import Refused
from narwhal.profile.store import CachedPrefill, EngineProfile, KVCapacity, Uncertainty
from narwhal.router.pricing import ERROR_MIN, ERROR_WINDOW, LOW_FLOOR, PricedPlacement, Quote

from .checkkit import identity_of, sim_profile

#: TTFT 0.01 + 1e-4 * L: 0.11 s for 1,000 tokens.
PREFILL = {"a": 0.010, "b": 1e-4, "c": 0.0}
SLOW_PREFILL = {"a": 0.030, "b": 3e-4, "c": 0.0}
#: TPOT 0.004 + 2e-4 * active + 1e-8 * KV tokens.
DECODE = {"c0": 0.004, "c1": 2e-4, "c2": 1e-8}


class Clock:
    """A clock the test sets."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ttft(length: float, p: dict[str, float] = PREFILL) -> float:
    return p["a"] + p["b"] * length + p["c"] * length * length


def tpot(active: float, kv: float, d: dict[str, float] = DECODE) -> float:
    return d["c0"] + d["c1"] * active + d["c2"] * kv


def uncertainty(factor: float) -> Uncertainty:
    return Uncertainty(level=0.9, resamples=100, coefficients={}, upper_factor=factor, worst_half_width=0.1)


def profile(
    name: str,
    *,
    prefill: dict[str, float] = PREFILL,
    decode: dict[str, float] = DECODE,
    active: tuple[float, float] = (1.0, 64.0),
    kv_tokens: tuple[float, float] = (100.0, 200_000.0),
    capacity: int = 262_144,
    source: str = "physical",
    upper: float | None = None,
    prefill_only: bool = False,
    cached: CachedPrefill | None = None,
) -> EngineProfile:
    p = sim_profile(name, identity_of(name, 8100), prefill=prefill, decode=decode, active=active,
                    kv_tokens=kv_tokens, kv_capacity=capacity)  # fmt: skip
    assert p.decode is not None and p.kv_capacity is not None
    if upper is not None:
        p = attrs.evolve(p, ttft=attrs.evolve(p.ttft, uncertainty=uncertainty(upper)),
                         decode=attrs.evolve(p.decode, uncertainty=uncertainty(upper)))  # fmt: skip
    if source != "physical":
        p = attrs.evolve(p, kv_capacity=KVCapacity(source=source, tokens=capacity, basis="test"))  # type: ignore[arg-type]
    if prefill_only:
        p = attrs.evolve(p, decode=None, kv_capacity=None, roles=("prefill",))
    return attrs.evolve(p, cached_prefill=cached)


def cached_model(a: float = 0.005, b: float = 1e-4, c: float = 0.0, d: float = 2e-5, upper: float = 1.5) -> CachedPrefill:
    return CachedPrefill(a=a, b=b, c=c, d=d, cells=6, min_length=16, max_length=4096, max_cached=2048,
                         block_size=16, mean_error=0.01, worst_error=0.02, loo_mean_error=0.02,
                         loo_worst_error=0.03, uncertainty=uncertainty(upper))  # fmt: skip


def priced(
    producers: Sequence[str] = ("p0",),
    consumers: Sequence[str] = ("d0",),
    *,
    profiles: dict[str, EngineProfile] | None = None,
    ttft_s: float | None = 1.0,
    tpot_s: float | None = 0.05,
    admission: str = "refuse",
    clock: Any = None,
    **kwargs: Any,
) -> PricedPlacement:
    if profiles is None:
        profiles = {n: profile(n) for n in dict.fromkeys([*producers, *consumers])}
    return PricedPlacement(list(producers), list(consumers), profiles=profiles,
                           slo=SLOConfig(ttft_s=ttft_s, tpot_s=tpot_s), admission=admission,
                           clock=clock or Clock(), **kwargs)  # fmt: skip


# ----------------------------------------------------------------- producer prices


def test_a_producer_quote_is_the_time_spent_plus_its_queue_and_own_prefill_times_its_correction() -> None:
    pl = priced()
    q = pl.quote_producer("p0", 1000)
    assert q == Quote("p0", pytest.approx(ttft(1000)), pytest.approx(1 - ttft(1000) / 1.0), own_s=pytest.approx(ttft(1000)),
                      low_s=pytest.approx(ttft(1000)))  # a profile without intervals, no requests seen: no lower end
    pl.queues.work_s["p0"] = 0.2  # a queue nothing has started on (no prefill placed)
    pl.ttft_correction["p0"] = 1.5
    q = pl.quote_producer("p0", 1000, elapsed_s=0.05, cached_tokens=0)
    assert q.predicted_s == pytest.approx(0.05 + (0.2 + ttft(1000)) * 1.5)
    assert q.headroom == pytest.approx(1 - q.predicted_s)
    assert q.own_s == pytest.approx(ttft(1000))  # the own prefill, uncorrected
    assert q.cached_tokens == 0 and not q.out_of_domain


def test_without_a_ttft_target_the_headroom_ranks_the_fastest_producer_first() -> None:
    profiles = {"p-slow": profile("p-slow", prefill=SLOW_PREFILL), "p-fast": profile("p-fast"), "d0": profile("d0")}
    pl = priced(["p-slow", "p-fast"], ["d0"], profiles=profiles, ttft_s=None)
    assert pl.quote_producer("p-fast", 1000).headroom == pytest.approx(-ttft(1000))
    quotes = pl.price(1000, 10, frozenset())
    assert quotes is not None and quotes[0].engine == "p-fast"
    reservation = pl.choose(1000, 10)
    assert (reservation.producer, reservation.consumer) == ("p-fast", "d0")


def test_a_cached_prefix_is_priced_from_the_ttft_curve_without_a_cached_prefill_model() -> None:
    curve = {"a": 0.010, "b": 1e-4, "c": 1e-8}
    pl = priced(profiles={"p0": profile("p0", prefill=curve), "d0": profile("d0")})
    full = ttft(1000, curve)
    assert pl.prefill_s("p0", 1000) == pytest.approx(full)
    assert pl.prefill_s("p0", 1000, 0) == pytest.approx(full)
    # The uncached part: ttft(L) - ttft(k) + ttft(0).
    assert pl.prefill_s("p0", 1000, 600) == pytest.approx(full - ttft(600, curve) + curve["a"])
    # A hit longer than the prompt is the whole prompt: only the fixed cost is left.
    assert pl.prefill_s("p0", 1000, 1500) == pytest.approx(curve["a"])
    assert pl.quote_producer("p0", 1000, cached_tokens=600).own_s == pl.prefill_s("p0", 1000, 600)


def test_the_cached_prefill_model_prices_a_hit_point_or_upper_and_never_above_a_miss() -> None:
    model = cached_model()  # a = 0.005: its price of no hit is below the TTFT curve's
    point = priced(profiles={"p0": profile("p0", cached=model), "d0": profile("d0")})
    full = ttft(1000)
    # No hit: the TTFT curve, not the cached model.
    assert point.prefill_s("p0", 1000, 0) == pytest.approx(full)
    assert point.prefill_s("p0", 1000, -5) == pytest.approx(full)
    assert point.prefill_s("p0", 1000, 600) == pytest.approx(model.predict(1000, 600))
    # A hit longer than the prompt: k is the prompt.
    assert point.prefill_s("p0", 1000, 1500) == pytest.approx(model.predict(1000, 1000))
    upper = priced(profiles={"p0": profile("p0", cached=model, upper=1.2), "d0": profile("d0")}, pricing="upper")
    assert upper.prefill_s("p0", 1000, 600) == pytest.approx(model.predict(1000, 600) * 1.5)
    assert upper.prefill_s("p0", 1000) == pytest.approx(full * 1.2)
    # A model that prices the hit above the miss is held to the miss.
    costly = priced(profiles={"p0": profile("p0", cached=cached_model(a=0.5)), "d0": profile("d0")})
    assert costly.prefill_s("p0", 1000, 600) == pytest.approx(full)


def test_upper_pricing_takes_the_bounds_of_the_ttft_curve_for_queues_and_reservations() -> None:
    profiles = {"p0": profile("p0", upper=1.25), "d0": profile("d0", upper=1.25)}
    pl = priced(profiles=profiles, pricing="upper")
    assert pl.quote_producer("p0", 1000).predicted_s == pytest.approx(ttft(1000) * 1.25)
    # The others' prefills are priced likewise.
    pl.mean_prompt_tokens = 500.0
    pl.engine_reported("p0", 2, 0, 0)
    assert pl.others_prefill_s("p0") == pytest.approx(2 * ttft(500) * 1.25)


def test_the_queue_ahead_is_what_is_left_of_the_oldest_prefill_and_the_rest() -> None:
    clock = Clock()
    pl = priced(clock=clock)
    assert pl.queues.head_done_s("p0") == 0.0  # nothing queued
    first = pl.choose(1000, 10)  # 0.11 s placed at 100.0
    clock.now = 100.04
    second = pl.choose(1000, 10)  # behind it
    assert pl.queues.work_s["p0"] == pytest.approx(2 * ttft(1000))
    assert pl.queues.head_done_s("p0") == pytest.approx(0.04)
    assert pl.quote_producer("p0", 1000).predicted_s == pytest.approx(3 * ttft(1000) - 0.04)
    clock.now = 105.0  # never counted done while it is reserved
    assert pl.queues.head_done_s("p0") == pytest.approx(ttft(1000))
    # The first ends at 100.15: the second started then, not when it was placed.
    clock.now = 100.15
    first.release()
    assert pl.queues.work_s["p0"] == pytest.approx(ttft(1000))
    assert pl.queues.head_done_s("p0") == 0.0
    clock.now = 100.2
    assert pl.queues.head_done_s("p0") == pytest.approx(0.05)
    second.release()
    assert pl.queues.work_s["p0"] == pytest.approx(0.0, abs=1e-12)
    assert pl.queues.head_done_s("p0") == 0.0


def test_a_prefill_placed_after_the_last_one_ended_started_when_placed() -> None:
    clock = Clock()
    pl = priced(clock=clock)
    pl.choose(1000, 10).release()  # ended at 100.0
    clock.now = 101.0
    pl.choose(1000, 10)
    clock.now = 101.03
    assert pl.queues.head_done_s("p0") == pytest.approx(0.03)


def test_others_prefills_are_priced_at_the_mean_prompt_of_this_router() -> None:
    pl = priced()
    assert pl.others_prefill_s("p0") == 0.0
    pl.mean_prompt_tokens = 500.4  # priced at a whole prompt: 500 tokens
    pl.engine_reported("p0", 3, 1, 1)  # three others' requests on a prefill-only engine
    assert pl.others_prefill_s("p0") == pytest.approx(3 * ttft(500))
    assert pl.quote_producer("p0", 1000).predicted_s == pytest.approx(3 * ttft(500) + ttft(1000))


def test_others_prefills_are_priced_at_the_mean_prefill_this_router_placed_there() -> None:
    # The others' traffic is the same mix as this router's: where its prompts hit a
    # cached prefix, so do theirs.
    pl = priced(["p0", "p1"], ["d0"])
    pl.mean_prompt_tokens = 1000.0
    hit = pl.prefill_s("p0", 1000, 800)
    assert hit < ttft(1000) / 3
    for _ in range(3):
        pl.choose(1000, 10, cached=lambda name: 800 if name == "p0" else 0).release()
    assert pl.queues.mean_work_s("p0") == pytest.approx(hit) and pl.queues.mean_work_s("p1") is None
    pl.engine_reported("p0", 2, 0, 0)
    pl.engine_reported("p1", 2, 0, 0)
    assert pl.others_prefill_s("p0") == pytest.approx(2 * hit)
    assert pl.others_prefill_s("p1") == pytest.approx(2 * ttft(1000))  # none placed there yet
    # In steps, each other's prompt adds its part beyond the step's fixed cost.
    assert pl.others_prefill_s("p0", batched=True) == pytest.approx(2 * (hit - ttft(0)))


# ----------------------------------------------------------------- consumer prices


def test_a_consumer_quote_adds_this_request_to_the_active_streams_and_resident_kv() -> None:
    pl = priced()
    load = pl.loads["d0"]
    load.decode_requests, load.decode_kv_tokens = 3, 5000
    q = pl.quote_consumer("d0", 1000, 200, cached_tokens=64)
    assert q is not None
    expected = tpot(4, 5000 + 1000 + 200)
    assert q == Quote("d0", pytest.approx(expected), pytest.approx(1 - expected / 0.05), out_of_domain=False,
                      cached_tokens=64)  # fmt: skip
    pl.tpot_correction["d0"] = 2.0
    q = pl.quote_consumer("d0", 1000, 200)
    assert q is not None and q.predicted_s == pytest.approx(2 * expected) and q.cached_tokens is None


def test_others_streams_count_with_the_mean_kv_of_this_router() -> None:
    pl = priced()
    pl.mean_kv_tokens = 1000.4
    pl.engine_reported("d0", 2, 0, 0)  # a decode-only engine: both of them decode
    q = pl.quote_consumer("d0", 100, 10)
    assert q is not None and q.predicted_s == pytest.approx(tpot(3, 2001 + 110))


def test_a_kv_limit_excludes_a_consumer_a_measured_capacity_only_ends_the_domain() -> None:
    limit = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=10_000, kv_tokens=(100.0, 10_000.0))})
    assert limit.quote_consumer("d0", 9000, 1000) is not None  # exactly at the limit
    assert limit.quote_consumer("d0", 9000, 1001) is None
    for source in ("physical", "tpot"):
        p = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=10_000, source=source)})
        assert p.quote_consumer("d0", 9000, 1001) is None
        # No consumer with room is not "no consumer priced": the pair cannot be placed.
        quotes = p.price(9000, 1001, frozenset())
        assert quotes is not None and quotes[1].engine == "d0" and quotes[1].kv_over == 1
    measured = priced(profiles={"p0": profile("p0"),
                                "d0": profile("d0", capacity=10_000, source="measured", kv_tokens=(100.0, 10_000.0))})
    q = measured.quote_consumer("d0", 9000, 1001)
    assert q is not None and q.out_of_domain


async def test_without_kv_room_on_any_consumer_admission_refuses_or_waits_and_never_falls_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    profiles = {"p0": profile("p0"), "d0": profile("d0", capacity=10_000), "d1": profile("d1", capacity=12_000)}
    pl = priced(["p0"], ["d0", "d1"], profiles=profiles, clock=trio.current_time)
    held = [pl.choose(1000, 8000), pl.choose(1000, 9000)]  # 9,000 of d0's 10,000, 10,000 of d1's 12,000
    assert sorted((r.consumer, r.kv_tokens) for r in held) == [("d0", 9000), ("d1", 10000)]
    with pytest.raises(Refused) as refused:
        await pl.acquire(1000, 2000)  # 3,000 tokens: 2,000 past d0's capacity, 1,000 past d1's
    assert str(refused.value).endswith(
        "no KV room on d1 (this request would pass its capacity by 1000 tokens)")  # fmt: skip
    assert pl.counters["fallback"] == 0 and pl.counters["refused"] == 1
    waiting = priced(["p0"], ["d0", "d1"], profiles=profiles, clock=trio.current_time, admission="wait")
    held = [waiting.choose(1000, 8000), waiting.choose(1000, 9000)]
    async with trio.open_nursery() as nursery:

        async def release_later() -> None:
            await trio.sleep(0.5)
            held[1].release()  # d1 has room again

        nursery.start_soon(release_later)
        t0 = trio.current_time()
        r = await waiting.acquire(1000, 2000, deadline=t0 + 10.0)
        assert r.consumer == "d1" and trio.current_time() - t0 == pytest.approx(0.5)
    assert waiting.counters["fallback"] == 0 and waiting.counters["waited"] == 1


def test_a_prefill_only_profile_is_never_priced_as_a_consumer() -> None:
    profiles = {"p0": profile("p0", prefill_only=True), "d0": profile("d0")}
    pl = priced(["p0"], ["p0", "d0"], profiles=profiles)
    assert pl.quote_consumer("p0", 100, 10) is None
    quotes = pl.price(100, 10, frozenset())
    assert quotes is not None and quotes[1].engine == "d0"
    only = priced(["p0"], ["p0"], profiles={"p0": profile("p0", prefill_only=True)})
    assert only.price(100, 10, frozenset()) is None


def test_beyond_the_decode_domain_the_price_is_the_edge_scaled_by_the_overshoot() -> None:
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", active=(1.0, 8.0), kv_tokens=(1000.0, 4000.0))})
    inside = pl.quote_consumer("d0", 1000, 10)
    assert inside is not None and not inside.out_of_domain
    assert inside.predicted_s == pytest.approx(tpot(1, 1010))
    load = pl.loads["d0"]
    # Below the domain: the price at its edge, not the fit's cheaper one at the point.
    below = pl.quote_consumer("d0", 100, 10)
    assert below is not None and below.out_of_domain
    assert below.predicted_s == pytest.approx(tpot(1, 1000))
    # Twice the streams and twice the KV measured: the edge's price times four.
    load.decode_requests, load.decode_kv_tokens = 15, 6000
    beyond = pl.quote_consumer("d0", 1500, 500)
    assert beyond is not None and beyond.out_of_domain
    assert beyond.predicted_s == pytest.approx(tpot(8, 4000) * 2 * 2)
    # Beyond on one axis only.
    load.decode_requests, load.decode_kv_tokens = 3, 6000
    one = pl.quote_consumer("d0", 1500, 500)
    assert one is not None and one.out_of_domain
    assert one.predicted_s == pytest.approx(tpot(4, 4000) * 2)
    load.decode_requests, load.decode_kv_tokens = 11, 0
    other = pl.quote_consumer("d0", 1500, 500)
    assert other is not None and other.out_of_domain
    assert other.predicted_s == pytest.approx(tpot(8, 2000) * 1.5)


def test_beyond_the_domain_never_below_the_fits_own_extrapolation() -> None:
    # A steep KV slope: the edge scaled by the overshoot is still above the fit's price
    # at the point (each term of the edge's price grows at least as fast).
    steep = {"c0": 0.001, "c1": 0.0, "c2": 1e-5}
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", decode=steep, active=(1.0, 8.0),
                                                               kv_tokens=(0.0, 100.0))})  # fmt: skip
    q = pl.quote_consumer("d0", 10_000, 0)
    assert q is not None and q.out_of_domain
    assert q.predicted_s == pytest.approx(tpot(1, 100, steep) * 100)
    assert q.predicted_s > tpot(1, 10_000, steep)


def test_upper_pricing_multiplies_the_consumers_price_by_its_upper_factor() -> None:
    profiles = {"p0": profile("p0"), "d0": profile("d0", upper=1.3)}
    point = priced(profiles=profiles).quote_consumer("d0", 1000, 10)
    upper = priced(profiles=profiles, pricing="upper").quote_consumer("d0", 1000, 10)
    assert point is not None and upper is not None
    assert upper.predicted_s == pytest.approx(point.predicted_s * 1.3)


# ----------------------------------------------------------------- choosing


def test_candidates_are_available_profiled_engines_of_the_model_avoiding_earlier_failures() -> None:
    down: set[str] = set()
    profiles = {n: profile(n, prefill=SLOW_PREFILL if n == "p1" else PREFILL) for n in ("p0", "p1", "p2", "d0", "d1")}
    del profiles["p2"]  # not bound: not priced
    pl = priced(["p0", "p1", "p2"], ["d0", "d1"], profiles=profiles, available=lambda n: n not in down,
                models={"p0": ["m"], "p1": ["m"], "p2": ["m"], "d0": ["m"], "d1": ["m", "n"]})
    quotes = pl.price(100, 10, frozenset())
    assert quotes is not None and quotes[0].engine == "p0"
    quotes = pl.price(100, 10, frozenset({"p0"}))  # avoided while another is left
    assert quotes is not None and quotes[0].engine == "p1"
    quotes = pl.price(100, 10, frozenset({"p0", "p1"}))  # every priced one avoided: still chosen
    assert quotes is not None and quotes[0].engine == "p0"
    down.add("p0")
    quotes = pl.price(100, 10, frozenset())
    assert quotes is not None and quotes[0].engine == "p1"
    quotes = pl.price(100, 10, frozenset(), model="n")  # only d1 decodes n; no producer serves it
    assert quotes is None
    quotes = pl.price(100, 10, frozenset(), model="m")
    assert quotes is not None and quotes[1].engine in ("d0", "d1")
    down.update({"d0", "d1"})
    assert pl.price(100, 10, frozenset()) is None


def test_the_prefix_index_prices_each_engines_own_hit() -> None:
    profiles = {"p0": profile("p0"), "p1": profile("p1"), "d0": profile("d0"), "d1": profile("d1")}
    pl = priced(["p0", "p1"], ["d0", "d1"], profiles=profiles)
    held = {"p0": 0, "p1": 800, "d0": 0, "d1": 512}
    quotes = pl.price(1000, 10, frozenset(), cached=held.__getitem__)
    assert quotes is not None
    p, c = quotes
    assert (p.engine, p.cached_tokens, c.engine, c.cached_tokens) == ("p1", 800, "d1", 512)
    assert p.own_s == pytest.approx(ttft(1000) - ttft(800) + ttft(0))
    reservation = pl.choose(1000, 10, cached=held.__getitem__)
    assert reservation.producer == "p1"
    # The reserved work is the hit-aware price.
    assert pl.queues.work_s["p1"] == pytest.approx(p.own_s)


def test_a_placed_pair_carries_its_predictions_and_reserves_prompt_and_output() -> None:
    pl = priced()
    r = pl.choose(1000, 200)
    assert (r.producer, r.consumer, r.prompt_tokens, r.kv_tokens) == ("p0", "d0", 1000, 1200)
    assert r.predicted_ttft_s == pytest.approx(ttft(1000))
    assert r.predicted_tpot_s == pytest.approx(tpot(1, 1200))
    assert pl.counters == {"priced": 1, "fallback": 0, "out_of_domain": 0, "refused": 0, "waited": 0, "deferred": 0,
                           "replicated": 0, "warmed": 0}  # fmt: skip
    pl.choose(10, 2)
    assert pl.counters["priced"] == 2


def test_a_pair_out_of_the_decode_domain_is_counted_when_chosen() -> None:
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", kv_tokens=(100.0, 1000.0))})
    pl.choose(1000, 200)
    assert pl.counters["out_of_domain"] == 1 and pl.counters["priced"] == 1
    pl.choose(1000, 200)
    assert pl.counters["out_of_domain"] == 2


def test_a_predicted_ttft_miss_is_refused_at_or_under_the_target_it_is_placed() -> None:
    # 0.11 s of prefill against a 0.11 s target: placed; one token more: refused.
    at = priced(ttft_s=ttft(1000) + 1e-12)
    at.choose(1000, 10)
    over = priced(ttft_s=ttft(1000) - 1e-9)
    with pytest.raises(Exception, match="no placement meets the SLO"):
        over.choose(1000, 10)
    assert over.counters["refused"] == 1 and over.counters["priced"] == 0
    assert over.queues.work_s["p0"] == 0.0 and over.loads["p0"].prefill_requests == 0  # nothing reserved


def test_a_predicted_tpot_miss_is_refused_the_target_itself_is_met() -> None:
    expected = tpot(1, 1010)
    priced(tpot_s=expected).choose(1000, 10)  # headroom 0: placed
    pl = priced(tpot_s=expected * 0.999)
    with pytest.raises(Exception, match="no placement meets the SLO"):
        pl.choose(1000, 10)
    # Without a TPOT target the (negative) headroom only ranks.
    priced(tpot_s=None).choose(1000, 10)
    priced(ttft_s=None, tpot_s=None).choose(1000, 10)


def test_without_a_priced_pair_placement_falls_back_to_least_load_and_reserves_the_curve() -> None:
    clock = Clock()
    profiles = {"p0": profile("p0")}  # no consumer bound
    pl = priced(["p0", "p1"], ["d0"], profiles=profiles, clock=clock)
    r = pl.choose(1000, 10)
    assert pl.counters["fallback"] == 1 and pl.counters["priced"] == 0
    assert r.predicted_ttft_s is None and r.predicted_tpot_s is None
    work = dict(pl.queues.work_s)
    # Least reserved load: the next goes to the other producer.
    r2 = pl.choose(1000, 10)
    assert {r.producer, r2.producer} == {"p0", "p1"}
    # A profiled producer's share is its curve's price; an unprofiled one's is nothing.
    assert work[r.producer] == pytest.approx(ttft(1000) if r.producer == "p0" else 0.0)
    assert pl.queues.work_s == pytest.approx({"p0": ttft(1000), "p1": 0.0, "d0": 0.0})
    r.release()
    r2.release()
    assert pl.queues.work_s == pytest.approx({"p0": 0.0, "p1": 0.0, "d0": 0.0})
    assert pl.counters["fallback"] == 2


def test_a_model_without_a_priced_pair_falls_back_within_its_own_engines() -> None:
    models = {"p0": ["m"], "d0": ["m"], "p1": ["n"], "d1": ["n"]}
    pl = priced(["p0", "p1"], ["d0", "d1"], profiles={"p0": profile("p0"), "d0": profile("d0")}, models=models)
    for _ in range(2):  # least-loaded placement rotates among equals: twice, to see any other engine
        r = pl.choose(100, 10, model="n")
        assert (r.producer, r.consumer, r.predicted_ttft_s) == ("p1", "d1", None)
        r.release()
    assert pl.counters == {"priced": 0, "fallback": 2, "out_of_domain": 0, "refused": 0, "waited": 0, "deferred": 0,
                           "replicated": 0, "warmed": 0}  # fmt: skip
    assert pl.choose(100, 10, model="m").predicted_ttft_s is not None


# ----------------------------------------------------------------- admission


async def test_refuse_answers_at_once_naming_the_prices(autojump_clock: trio.abc.Clock) -> None:
    pl = priced(ttft_s=0.1, clock=trio.current_time)
    with pytest.raises(Refused) as exc:
        await pl.acquire(1000, 10)
    assert trio.current_time() == 0.0
    assert exc.value.retry_after_s == 1.0
    assert exc.value.message == (
        f"no placement meets the SLO: predicted TTFT 110.0 ms on p0, TPOT {tpot(1, 1010) * 1000:.1f} ms on d0"
    )
    assert pl.counters["waited"] == 0 and pl.counters["refused"] == 1


async def test_admission_refuses_only_what_the_low_end_of_the_prediction_misses(autojump_clock: trio.abc.Clock) -> None:
    # Predicted 110 ms against a 105 ms target, on a profile without intervals and no
    # request seen: the low end is the prediction, refused.
    pl = priced(ttft_s=0.105, clock=trio.current_time)
    assert pl.admission_bound == "lower"
    with pytest.raises(Refused):
        await pl.acquire(1000, 10)
    # The producer's last requests took 90-100% of their predictions (fed from the
    # journal): at the 10th percentile, 0.905 of 110 ms is 99.55 ms, within the target.
    for i in range(ERROR_MIN - 1):
        pl.on_record({"ttft_s": 0.9 + 0.1 * i / ERROR_MIN, "consumer": "d0",
                      "attempts": [{"outcome": "ok", "producer": "p0", "predicted_ttft_s": 1.0}]})  # fmt: skip
    assert pl.low_factor("p0") == 1.0  # one short of ERROR_MIN: not yet
    pl.observe_ttft("p0", 0.095 * 2, 0.2)
    assert pl.low_factor("p0") == pytest.approx(0.905)
    r = await pl.acquire(1000, 10)
    assert r.predicted_ttft_s == pytest.approx(ttft(1000))  # placement keeps the point prediction
    r.release()
    # The former rule, on the point prediction, refuses it.
    pl.admission_bound = "point"
    with pytest.raises(Refused) as exc:
        await pl.acquire(1000, 10)
    assert "low end" not in exc.value.message
    # Over the target even at the low end: refused, the refusal naming the low end.
    pl.admission_bound = "lower"
    pl.slo = SLOConfig(ttft_s=0.095, tpot_s=0.05)
    with pytest.raises(Refused) as exc:
        await pl.acquire(1000, 10)
    assert exc.value.message.endswith("; TTFT 99.5 ms at the low end of its prediction error")
    assert pl.counters["refused"] == 3 and pl.counters["priced"] == 1


def test_the_low_end_comes_from_the_profiles_interval_until_requests_are_seen_and_has_a_floor() -> None:
    # Bootstrap intervals of +-10%: the low end is 0.9 of the point prediction, and of
    # an upper-bound prediction (x1.2) 0.9 / 1.2.
    pl = priced(profiles={"p0": profile("p0", upper=1.2), "d0": profile("d0")})
    assert pl.low_factor("p0") == pytest.approx(0.9)
    q = pl.quote_producer("p0", 1000, elapsed_s=0.01)
    assert q.low_s == pytest.approx(0.01 + 0.9 * ttft(1000))  # the time already spent is no estimate
    pl.pricing = "upper"
    assert pl.low_factor("p0") == pytest.approx(0.9 / 1.2)
    # Requests 10x faster than predicted: a profile that no longer describes the engine;
    # the low end stops at half the prediction.
    for _ in range(ERROR_MIN):
        pl.observe_ttft("p0", 0.01, 0.1)
    assert pl.low_factor("p0") == LOW_FLOOR == 0.5
    # Slower than predicted: the low end is never above the prediction.
    for _ in range(ERROR_WINDOW):
        pl.observe_ttft("p0", 0.2, 0.1)
    assert len(pl.ttft_ratios["p0"]) == ERROR_WINDOW and pl.low_factor("p0") == 1.0
    # What no producer of this placement, a zero prediction or a failed request is not counted.
    pl.observe_ttft("p9", 0.1, 0.1)
    pl.observe_ttft("p0", 0.1, 0.0)
    pl.on_record({"ttft_s": 0.05, "attempts": [{"outcome": "engine_error", "producer": "p0", "predicted_ttft_s": 0.1}]})
    assert "p9" not in pl.ttft_ratios and len(pl.ttft_ratios["p0"]) == ERROR_WINDOW and pl.low_factor("p0") == 1.0
    pl.set_roles([], ["d0"])
    pl.remove_engine("p0")
    assert "p0" not in pl.ttft_ratios
    # Back in the fleet, it starts again from its profile's interval (x1.2 upper, as above).
    pl.profiles["p0"] = profile("p0", upper=1.2)
    pl.add_engine("p0")
    assert pl.low_factor("p0") == pytest.approx(0.9 / 1.2)


async def test_the_refusal_names_the_hit_and_the_handoff(autojump_clock: trio.abc.Clock) -> None:
    pl = priced(ttft_s=0.1, clock=trio.current_time)
    pl.observe_handoff("d0", 0.02)
    with pytest.raises(Refused) as exc:
        await pl.acquire(1000, 10, cached=lambda n: 200)
    own = ttft(1000) - ttft(200) + ttft(0)
    assert exc.value.message == (
        f"no placement meets the SLO: predicted TTFT {(own + 0.02) * 1000:.1f} ms on p0 (200 prompt tokens cached "
        f"there), TPOT {tpot(1, 1010) * 1000:.1f} ms on d0 (TTFT with 20.0 ms of handoff to it)"
    )


async def test_the_refusal_states_a_slow_consumers_prices_the_handoff_and_the_low_end(
    autojump_clock: trio.abc.Clock,
) -> None:
    slow = {"c0": 0.2, "c1": 2e-4, "c2": 1e-8}
    pl = priced(profiles={"p0": profile("p0", upper=1.2), "d0": profile("d0", decode=slow)}, clock=trio.current_time)
    pl.observe_handoff("d0", 0.2)
    with pytest.raises(Refused) as exc:
        await pl.acquire(1000, 10)
    low = ttft(1000) * 0.9  # the profile's interval: +-10% of the point prediction
    assert exc.value.message == (
        f"no placement meets the SLO: predicted TTFT {(ttft(1000) + 0.2) * 1000:.1f} ms on p0, "
        f"TPOT {tpot(1, 1010, slow) * 1000:.1f} ms on d0 (TTFT with 200.0 ms of handoff to it); "
        f"TTFT {(low + 0.2) * 1000:.1f} ms at the low end of its prediction error"
    )
    assert f"TPOT {tpot(1, 1010, slow) * 1000:.1f} ms" == "TPOT 200.2 ms"


async def test_wait_places_when_capacity_is_released_and_counts_the_wait(autojump_clock: trio.abc.Clock) -> None:
    # One stream fits the TPOT target, two do not.
    pl = priced(tpot_s=tpot(1, 1010) * 1.001, admission="wait", clock=trio.current_time)
    await trio.sleep(1.0)
    first = await pl.acquire(1000, 10)
    placed: list[float] = []

    async def second() -> None:
        r = await pl.acquire(1000, 10, deadline=5.0)
        placed.append(trio.current_time())
        # The wait counts; the first's prefill (still reserved) is predicted done.
        assert r.predicted_ttft_s == pytest.approx(0.3 + ttft(1000))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.sleep(0.3)
        assert not placed and pl.counters["waited"] == 1
        first.release_decode()
    assert placed == [pytest.approx(1.3)]
    assert pl.counters["waited"] == 1


async def test_wait_refuses_at_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    pl = priced(tpot_s=0.001, admission="wait", clock=trio.current_time)
    with pytest.raises(Refused, match="no placement meets the SLO"):
        await pl.acquire(1000, 10, deadline=0.4)
    assert trio.current_time() == pytest.approx(0.4)
    assert pl.counters["waited"] == 1 and pl.counters["refused"] == 2


async def test_the_time_waited_counts_against_the_ttft_target(autojump_clock: trio.abc.Clock) -> None:
    # The TTFT target leaves 0.09 s beyond the prefill; a wait of 0.1 s spends it.
    pl = priced(ttft_s=ttft(1000) + 0.09, tpot_s=tpot(1, 1010) * 1.001, admission="wait", clock=trio.current_time)
    await trio.sleep(1.0)
    first = await pl.acquire(1000, 10)
    first.release_prefill()  # its prefill is done; its stream holds the consumer

    async def release_later() -> None:
        await trio.sleep(0.1)
        first.release_decode()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_later)
        with pytest.raises(Refused):
            await pl.acquire(1000, 10, deadline=5.0, elapsed_s=0.0)
        assert trio.current_time() == pytest.approx(5.0)
    # Placed when it had spent less.
    pl.choose(1000, 10, elapsed_s=0.09)


async def test_a_drop_in_others_load_wakes_waiting_requests(autojump_clock: trio.abc.Clock) -> None:
    pl = priced(tpot_s=tpot(1, 1010) * 1.001, admission="wait", clock=trio.current_time)
    pl.engine_reported("d0", 1, 0, 0)  # another router's stream on d0
    placed: list[float] = []

    async def one() -> None:
        await pl.acquire(1000, 10, deadline=5.0)
        placed.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        await trio.sleep(0.2)
        refused = pl.counters["refused"]
        pl.engine_reported("d0", 1, 0, 0)  # unchanged: not priced again
        await trio.sleep(0.1)
        assert not placed and pl.counters["refused"] == refused
        pl.engine_reported("d0", 2, 0, 0)  # more: neither
        await trio.sleep(0.1)
        assert not placed and pl.counters["refused"] == refused
        pl.engine_reported("d0", 1, 0, 0)  # less, still no room: priced again, waits on
        await trio.sleep(0.1)
        assert not placed and pl.counters["refused"] == refused + 1
        pl.engine_reported("d0", 0, 0, 0)
    assert placed == [pytest.approx(0.5)]
    pl.engine_reported("gone", 0, 0, 0)  # an engine placement does not know: ignored
    assert "gone" not in pl.loads


async def test_each_waiting_request_counts_once_however_often_it_wakes(autojump_clock: trio.abc.Clock) -> None:
    pl = priced(tpot_s=tpot(1, 1010) * 1.001, admission="wait", clock=trio.current_time)
    pl.engine_reported("d0", 1, 0, 0)  # another router's stream on d0: no room

    async def one() -> None:
        with pytest.raises(Refused):
            await pl.acquire(1000, 10, deadline=1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        await trio.sleep(0.2)
        for load in (0.5, 0.25):  # less each time, still no room: both priced again, both wait on
            pl.engine_reported("d0", load, 0, 0)
            await trio.sleep(0.1)
        assert pl.counters["refused"] == 6
    assert pl.counters["waited"] == 2 and pl.counters["refused"] == 8


async def test_acquire_places_the_requests_model_away_from_avoided_engines() -> None:
    models = {"p0": ["m"], "d0": ["m"], "p1": ["n"], "d1": ["n"]}
    pl = priced(["p0", "p1"], ["d0", "d1"], models=models)
    r = await pl.acquire(100, 10, model="n")
    assert (r.producer, r.consumer) == ("p1", "d1")
    r.release()
    pl = priced(["p0", "p1"], ["d0", "d1"])
    r = await pl.acquire(100, 10, avoid=frozenset({"p0", "d0"}))
    assert (r.producer, r.consumer) == ("p1", "d1")


async def test_acquire_copies_a_busy_prefix_by_the_prompts_token_ids() -> None:
    pl = three_producers()
    started: list[tuple[str, int]] = []

    def replicate(producer: str, ids: Sequence[int], model: str | None, work: float) -> bool:
        started.append((producer, len(ids)))
        return True

    pl.replicate = replicate
    pl.queues.work_s["p0"] = 0.6
    held = {"p0": 800, "p1": 100, "p2": 0, "d0": 0}
    await pl.acquire(1000, 10, cached=held.__getitem__, prompt_ids=list(range(1000)))
    assert started == [("p1", 800)]


async def test_role_changes_wake_waiting_requests(autojump_clock: trio.abc.Clock) -> None:
    profiles = {"p0": profile("p0"), "d0": profile("d0"), "d1": profile("d1")}
    pl = priced(["p0"], ["d0"], profiles=profiles, tpot_s=tpot(1, 1010) * 1.001, admission="wait",
                clock=trio.current_time)  # fmt: skip
    await pl.acquire(1000, 10)
    placed: list[str] = []

    async def one() -> None:
        placed.append((await pl.acquire(1000, 10, deadline=5.0)).consumer)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        await trio.sleep(0.2)
        pl.set_roles(["p0"], ["d0", "d1"])
    assert placed == ["d1"] and trio.current_time() == pytest.approx(0.2)


# ----------------------------------------------------------------- handoff


def test_the_handoff_is_a_moving_mean_per_consumer_from_the_journal() -> None:
    pl = priced()
    pl.on_record({"consumer": "d0", "ttft_s": 0.1, "first_byte_s": 0.3})
    assert pl.handoff_s == {"d0": pytest.approx(0.2)}
    pl.on_record({"consumer": "d0", "ttft_s": 0.1, "first_byte_s": 0.1})  # an equal first byte counts
    assert pl.handoff_s["d0"] == pytest.approx(0.2 + 0.1 * (0.0 - 0.2))
    for bad in ({"consumer": None, "ttft_s": 0.1, "first_byte_s": 0.3},
                {"consumer": "d0", "ttft_s": None, "first_byte_s": 0.3},
                {"consumer": "d0", "ttft_s": 0.1, "first_byte_s": None},
                {"consumer": "d0", "ttft_s": 0.3, "first_byte_s": 0.1}):  # fmt: skip
        pl.on_record(bad)
    assert pl.handoff_s == {"d0": pytest.approx(0.18)}


def test_admission_adds_the_chosen_consumers_handoff_to_the_ttft() -> None:
    pl = priced(ttft_s=ttft(1000) + 0.05)
    pl.observe_handoff("d0", 0.05)
    pl.choose(1000, 10).release()  # exactly at the target
    pl.observe_handoff("d0", 0.05 + 0.01 / 0.1 + 1e-6)  # its mean moves over the target
    with pytest.raises(Exception, match="no placement meets the SLO") as exc:
        pl.choose(1000, 10)
    assert exc.value.handoff_s == pytest.approx(pl.handoff_s["d0"])  # type: ignore[attr-defined]


# ----------------------------------------------------------------- a changing fleet


def test_an_added_engine_is_priced_uncorrected_with_an_empty_queue_and_a_removed_one_forgotten() -> None:
    clock = Clock()
    pl = priced(clock=clock)
    pl.ttft_correction["p0"] = 2.0
    pl.add_engine("p0")  # known: kept as is
    assert pl.ttft_correction["p0"] == 2.0
    pl.add_engine("p1")
    assert (pl.ttft_correction["p1"], pl.tpot_correction["p1"], pl.queues.work_s["p1"]) == (1.0, 1.0, 0.0)
    pl.profiles["p1"] = profile("p1")
    pl.set_roles(["p0", "p1"], ["d0"])
    r = pl.choose(1000, 10, avoid=frozenset({"p0"}))
    assert r.producer == "p1" and pl.queues.head_done_s("p1") == 0.0
    clock.now += 0.05
    assert pl.queues.head_done_s("p1") == pytest.approx(0.05)
    r.release()
    pl.unbound["p1"] = "gone"
    pl.set_roles(["p0"], ["d0"])
    pl.remove_engine("p1")
    for table in (pl.ttft_correction, pl.tpot_correction, pl.queues.work_s, pl.profiles, pl.unbound, pl.loads):
        assert "p1" not in table
    assert pl.queues.head_done_s("p1") == 0.0
    r.release()  # released again after it left: nothing to release
    assert "p1" not in pl.queues.work_s
    # An engine that never had a profile, a prefill or a reason to be unbound leaves too.
    pl.add_engine("p2")
    pl.remove_engine("p2")
    assert "p2" not in pl.loads and "p2" not in pl.queues.work_s


# ----------------------------------------------------------------- copying a busy prefix


def three_producers(**kwargs: Any) -> PricedPlacement:
    profiles = {n: profile(n) for n in ("p0", "p1", "p2", "d0")}
    return priced(["p0", "p1", "p2"], ["d0"], profiles=profiles, **kwargs)


def test_a_prefix_is_copied_when_its_holders_are_busy_to_the_producer_that_would_serve_soonest() -> None:
    pl = three_producers()
    held = {"p0": 800, "p1": 100, "p2": 0}
    own = ttft(1000) - ttft(800) + ttft(0)  # 0.03 s with the prefix
    assert pl.replication(1000, held.__getitem__) is None  # the holder is idle
    pl.queues.work_s["p0"] = 0.6  # busy: 0.63 s of the 1 s target
    assert pl.replication(1000, held.__getitem__) == ("p1", 800, 100)
    pl.queues.work_s["p1"] = 0.3  # now p2 would serve sooner
    assert pl.replication(1000, held.__getitem__) == ("p2", 800, 0)
    pl.queues.work_s["p2"] = 0.3  # equal: the first in order
    assert pl.replication(1000, held.__getitem__) == ("p1", 800, 100)
    pl.replicating.add("p1")  # copying something already: not another
    assert pl.replication(1000, held.__getitem__) == ("p2", 800, 0)
    # A second holder that is idle serves the prefix: no copy.
    assert pl.replication(1000, {"p0": 800, "p1": 800, "p2": 0}.__getitem__) is None
    # Without a TTFT target nothing is due.
    pl.slo = SLOConfig(tpot_s=0.05)
    assert pl.replication(1000, held.__getitem__) is None
    assert own == pytest.approx(0.03)


def test_a_copy_is_due_at_half_the_target_for_a_prefix_of_half_the_prompt() -> None:
    pl = three_producers()
    pl.queues.work_s["p0"] = 0.6
    held = {"p0": 500, "p1": 0, "p2": 0}
    assert pl.replication(1000, held.__getitem__) == ("p1", 500, 0)
    held["p0"] = 499  # less than half the prompt: not worth a copy
    assert pl.replication(1000, held.__getitem__) is None
    assert pl.replication(1000, dict.fromkeys(held, 0).__getitem__) is None  # nothing cached anywhere
    # The holder's prediction exactly at half the target: due.
    held["p0"] = 800
    busy = pl.quote_producer("p0", 1000, 0.0, 800).predicted_s
    pl.slo = SLOConfig(ttft_s=2 * busy, tpot_s=0.05)
    assert pl.replication(1000, held.__getitem__) == ("p1", 800, 0)
    # A producer that would serve it only at half the target is no help.
    after = pl.quote_producer("p1", 1000, 0.0, 800).predicted_s
    pl.slo = SLOConfig(ttft_s=2 * after, tpot_s=0.05)
    pl.queues.work_s["p0"] = 5.0
    assert pl.replication(1000, held.__getitem__) is None


def test_a_copy_stays_within_the_models_producers() -> None:
    profiles = {n: profile(n) for n in ("p0", "p1", "d0")}
    pl = priced(["p0", "p1"], ["d0"], profiles=profiles, models={"p0": ["m"], "p1": ["n"], "d0": ["m", "n"]})
    pl.queues.work_s["p0"] = 0.6
    held = {"p0": 800, "p1": 0}
    assert pl.replication(1000, held.__getitem__, "m") is None
    assert pl.replication(1000, held.__getitem__) == ("p1", 800, 0)


def test_choosing_starts_the_copy_reserves_its_work_and_releases_it_when_copied() -> None:
    clock = Clock()
    pl = three_producers(clock=clock)
    started: list[tuple[str, tuple[int, ...], str | None, float]] = []
    answer = [True]

    def replicate(producer: str, ids: Sequence[int], model: str | None, work: float) -> bool:
        started.append((producer, tuple(ids), model, work))
        return answer[0]

    held = {"p0": 800, "p1": 100, "p2": 0, "d0": 0}
    ids = list(range(1000))
    pl.queues.work_s["p0"] = 0.6
    pl.choose(1000, 10, cached=held.__getitem__).release()  # no prompt ids: nothing to copy
    pl.choose(1000, 10, prompt_ids=ids).release()  # no prefix index: nothing known to copy
    assert started == [] and pl.counters["replicated"] == 0
    pl.replicate = replicate
    r = pl.choose(1000, 10, cached=held.__getitem__, prompt_ids=ids, model="m")
    copy_s = ttft(800) - ttft(100) + ttft(0)  # the prefix, 100 of its tokens held there
    assert started == [("p1", tuple(range(800)), "m", pytest.approx(copy_s))]
    assert pl.replicating == {"p1"} and pl.counters["replicated"] == 1
    assert r.producer == "p1"  # the copy is not in this request's price: p1 is idle
    assert pl.queues.work_s["p1"] == pytest.approx(copy_s + r.predicted_ttft_s)  # type: ignore[operator]
    clock.now += 0.01
    assert pl.queues.head_done_s("p1") == pytest.approx(0.01)  # the copy runs first
    r.release()
    # p2 is copied to as well: a second copy counts.
    pl.queues.work_s["p1"] += 1.0
    pl.choose(1000, 10, cached=held.__getitem__, prompt_ids=ids)
    assert [s[0] for s in started] == ["p1", "p2"] and pl.counters["replicated"] == 2
    pl.copied("p1", copy_s)
    assert pl.replicating == {"p2"}
    assert pl.queues.work_s["p1"] == pytest.approx(1.0)
    assert pl.queues.head_done_s("p1") == 0.0
    pl.copied("p1", copy_s)  # once only
    pl.copied("p0", 0.5)  # nothing was copied there
    assert pl.queues.work_s["p1"] == pytest.approx(1.0) and pl.queues.work_s["p0"] == pytest.approx(0.6)
    # A copy that does not start reserves nothing.
    answer[0] = False
    pl.replicating.clear()
    pl.queues.work_s["p1"] = 0.0
    pl.choose(1000, 10, cached=held.__getitem__, prompt_ids=ids).release()
    assert started[-1][0] == "p1" and "p1" not in pl.replicating and pl.counters["replicated"] == 2
    assert pl.queues.work_s["p1"] == pytest.approx(0.0, abs=1e-12)


def test_consumers_tie_within_one_percent_on_the_same_side_of_the_target() -> None:
    from narwhal.router.pricing import CONSUMER_TIE, best_consumer

    def q(engine: str, tpot: float, cached: int | None = None) -> Quote:
        return Quote(engine, tpot, 1.0 - tpot / 0.05, cached_tokens=cached)

    # Exactly one percent slower still ties; one cached token breaks the tie.
    assert best_consumer([q("d0", 0.0100), q("d1", 0.0100 * (1.0 + CONSUMER_TIE), 1024)]).engine == "d1"
    assert best_consumer([q("d0", 0.0100), q("d1", 0.01005, 1)]).engine == "d1"
    assert best_consumer([q("d0", 0.0100, 0), q("d1", 0.01005)]).engine == "d0"
    # Exactly at the target is meeting it: the same side as a consumer under it.
    assert best_consumer([q("d0", 0.0499), q("d1", 0.05, 1024)]).engine == "d1"
    assert best_consumer([q("d0", 0.0499, 1024)]).engine == "d0"
