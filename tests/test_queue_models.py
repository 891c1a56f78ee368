"""A producer computing its queued prompts one at a time or together (chunked prefill):
the two queue models, how the router learns which one an engine follows, and how
admission protects the requests that share a step."""

from __future__ import annotations

import logging
import math

import attrs
import pytest
import trio

from narwhal.errors import Refused
from narwhal.profile.store import PrefillOutside
from narwhal.router.admin import AdminApp
from narwhal.router.batching import DIFFER, MIN_EVIDENCE, WINDOW, QueueModels
from narwhal.router.placement import Reservation
from narwhal.router.prefillqueue import ARRIVALS, PrefillQueues
from narwhal.router.pricing import ERROR_MIN, PricedPlacement

from .routerkit import engine, fleet_doc, open_stack
from .test_pricing_rules import PREFILL, Clock, priced, profile, ttft

FIXED = PREFILL["a"]


def share(length: float) -> float:
    """A prompt's prefill beyond the fixed cost a step pays once."""
    return ttft(length) - FIXED


def learn(models: QueueModels, producer: str, *, batched: bool, times: int = MIN_EVIDENCE) -> None:
    """``times`` observations that the batched (or the serial) prediction got right."""
    for _ in range(times):
        models.observe(producer, 0.2 if batched else 0.4, serial_s=0.4, batched_s=0.2)


# ----------------------------------------------------------------- learning


def test_a_producer_is_priced_serially_until_its_prefills_say_they_share_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.placement")
    models = QueueModels()
    for _ in range(5 * MIN_EVIDENCE):  # predictions that agree tell nothing apart
        models.observe("p0", 0.2, serial_s=0.3, batched_s=0.3 * (1 - DIFFER) + 1e-9)
    learn(models, "p0", batched=True, times=MIN_EVIDENCE - 1)
    assert models.batched == set() and caplog.records == []
    learn(models, "p0", batched=True, times=1)
    assert models.batched == {"p0"}
    assert [r.getMessage() for r in caplog.records] == [
        "producer p0 computes its queued prompts together (chunked prefill): its queue is priced as one step"
    ]
    learn(models, "p0", batched=True, times=3)  # no news: said once
    assert len(caplog.records) == 1
    # The engine changes (a restart with another scheduler): the latest window decides.
    # 13 placements said batched (the serial prediction off by 100 %), now the serial
    # one is right (the batched off by 50 %): 26 of them balance it.
    learn(models, "p0", batched=False, times=25)
    assert models.batched == {"p0"}
    learn(models, "p0", batched=False, times=1)
    assert models.batched == set()
    assert caplog.records[-1].getMessage() == (
        "producer p0 computes its queued prompts one at a time: its queue is priced prompt by prompt"
    )


def test_the_evidence_is_the_latest_window_and_weighs_errors_by_size() -> None:
    models = QueueModels()
    assert WINDOW == 100
    learn(models, "p0", batched=True, times=WINDOW)  # -1 each
    # +0.5 each: with 66 of them the window holds 34 of the -1s (-1 in all), with 67 only
    # 33 (+0.5); without a window it would take 200.
    learn(models, "p0", batched=False, times=66)
    assert models.batched == {"p0"}
    learn(models, "p0", batched=False, times=1)
    assert models.batched == set()
    # Fewer but larger errors of the serial model outweigh many small ones of the batched.
    for _ in range(WINDOW // 2):
        models.observe("p0", 0.1, serial_s=1.0, batched_s=0.12)  # serial 9x off, batched 20 %
    assert models.batched == {"p0"}
    models.forget("p0")
    assert models.batched == set()
    learn(models, "p0", batched=True, times=MIN_EVIDENCE - 1)
    assert models.batched == set()  # the evidence went with it
    models.forget("never-seen")  # nothing to forget: no error


def test_predictions_that_differ_by_exactly_the_threshold_tell_the_models_apart() -> None:
    models = QueueModels()
    for _ in range(MIN_EVIDENCE):
        models.observe("p0", 9.0, serial_s=10.0, batched_s=9.0)  # 1.0 apart: DIFFER of 10.0
    assert DIFFER * 10.0 == 1.0 and models.batched == {"p0"}


def test_an_observation_of_no_time_tells_nothing() -> None:
    models = QueueModels()
    for _ in range(MIN_EVIDENCE):
        models.observe("p0", 0.0, serial_s=0.4, batched_s=0.0)
    assert models.batched == set()


# ----------------------------------------------------------------- the queue, both ways


def test_the_batched_queue_is_the_step_in_progress_then_the_waiting_prompts_beyond_their_fixed_cost() -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0)
    assert pl.queues.queues_s("p0") == (0.0, 0.0)
    first = pl.choose(1000, 10)  # starts at 100.0: the step in progress
    clock.now = 100.02
    pl.choose(500, 10)
    clock.now = 100.03
    pl.choose(200, 10)  # both wait for the next step
    clock.now = 100.05
    serial, batched = pl.queues.queues_s("p0")
    assert serial == pytest.approx(ttft(1000) + ttft(500) + ttft(200) - 0.05)
    # ... and the prompts expected to join before the step in progress ends (0.06 s from
    # now): the placements' parts beyond the fixed cost came at this rate.
    joining = (share(1000) + share(500) + share(200)) / 0.05
    assert batched == pytest.approx(ttft(1000) - 0.05 + share(500) + share(200) + 0.06 * joining)
    assert pl.quote_producer("p0", 300).predicted_s == pytest.approx(serial + ttft(300))  # not learned yet
    learn(pl.queue_models, "p0", batched=True)
    assert pl.quote_producer("p0", 300).predicted_s == pytest.approx(batched + ttft(300))
    # The step ends at 100.11: the two waiting ones are the new step, started then.
    clock.now = 100.11
    first.release_prefill(done=True)
    clock.now = 100.12
    joining = (share(1000) + share(500) + share(200)) / 0.12
    step = FIXED + share(500) + share(200) - 0.01
    assert pl.queues.queues_s("p0")[1] == pytest.approx(step + step * joining)
    # A step overdue is predicted to end now, not in the past (and no prompt joins it).
    clock.now = 101.0
    assert pl.queues.queues_s("p0")[1] == 0.0
    # Prompts others queued there count in both models, each at the mean prefill this
    # router placed there: whole serially, its part beyond the fixed cost in steps.
    pl.engine_reported("p0", 2, 0, 0)
    mean = ttft(1000)
    for work in (ttft(500), ttft(200)):
        mean += 0.05 * (work - mean)
    assert pl.queues.queues_s("p0") == pytest.approx((ttft(200) + 2 * mean, 2 * (mean - FIXED)))


def test_a_prompts_time_outside_the_engines_steps_is_not_part_of_the_step_it_shares() -> None:
    """Each prompt pays its own HTTP, parsing and tokenization beside the step (the
    profile measured 20 us a token of it): a step's waiting prompts add only what they
    add to the step; the prompt's own prediction still pays its own in full."""
    outside = PrefillOutside(base_s=0.001, per_token_s=2e-5, samples=30)
    profiles = {n: attrs.evolve(profile(n), prefill_outside=outside) for n in ("p0", "d0")}
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0, profiles=profiles)
    learn(pl.queue_models, "p0", batched=True)

    def part(length: float) -> float:
        return share(length) - 2e-5 * length

    pl.choose(1000, 10)  # the step in progress, from 100.0
    clock.now = 100.02
    pl.choose(500, 10)
    clock.now = 100.03
    pl.choose(200, 10)
    clock.now = 100.05
    # The step in progress: its fixed cost and the first prompt's part, less 0.05 s done;
    # the waiting prompts' parts; those expected to join at the placements' rate of parts.
    remaining = FIXED + part(1000) - 0.05
    joining = (part(1000) + part(500) + part(200)) / 0.05
    expected = remaining + part(500) + part(200) + remaining * joining
    assert pl.queues.queues_s("p0")[1] == pytest.approx(expected)
    assert pl.quote_producer("p0", 300).predicted_s == pytest.approx(expected + ttft(300))
    # Prompts others queued there: each the mean part of this router's placements.
    pl.engine_reported("p0", 2 + 3, 0, 3)
    mean = part(1000)
    for length in (500, 200):
        mean += 0.05 * (part(length) - mean)
    assert pl.others_prefill_s("p0", batched=True) == pytest.approx(2 * mean)
    # A prompt whose outside time exceeds what it adds beyond the fixed cost adds nothing.
    assert pl._part_s("p0", FIXED + 0.001, 1000) == 0.0


def test_an_unpriced_producers_prefills_teach_the_queue_models_nothing() -> None:
    """A producer without a bound profile has no predictions to score: what its
    prefills took says nothing of how it queues."""
    work = ttft(500)
    for priced_ in (False, True):
        clock = Clock()
        queues = PrefillQueues(["p0"], clock=clock, fixed_s=lambda name: FIXED,
                               part_s=lambda name, work, tokens: work - FIXED, others_s=lambda name, batched: 0.0)
        keys = [queues.add("p0", work, math.inf, priced=priced_, prompt_tokens=500) for _ in range(3)]
        predicted = [(q.serial_s, q.batched_s) for q in queues.reserved["p0"].values()]
        if priced_:  # one after the other, or the two behind the first sharing the next step
            assert predicted == [pytest.approx(p) for p in [(work, work), (2 * work, 2 * work), (3 * work, 3 * work - FIXED)]]
        else:
            assert predicted == [(work, work)] * 3
        clock.now += 0.5
        for key in keys:
            queues.release("p0", key, done=True)
        if not priced_:
            assert queues.models._evidence == {}
        assert queues.work_s == {"p0": pytest.approx(0.0, abs=1e-12)}


def test_a_release_after_its_producer_left_releases_nothing() -> None:
    clock = Clock()
    queues = PrefillQueues(["p0"], clock=clock, fixed_s=lambda name: FIXED,
                           part_s=lambda name, work, tokens: work - FIXED, others_s=lambda name, batched: 0.0)
    old = queues.add("p0", 0.3, math.inf, priced=True, prompt_tokens=300)
    queues.remove_engine("p0")
    queues.release("p0", old, done=True)  # gone: nothing to release, no error
    assert queues.work_s == {} and queues.reserved == {}
    # Back in the fleet with a prefill of its own: the old reservation's release does
    # not take from the new queue, nor release twice.
    queues.add_engine("p0")
    new = queues.add("p0", 0.2, math.inf, priced=True, prompt_tokens=200)
    queues.release("p0", old, done=True)
    assert queues.work_s == {"p0": 0.2} and list(queues.reserved["p0"]) == [new]
    queues.release("p0", new, done=False)
    queues.release("p0", new, done=False)
    assert queues.work_s == {"p0": 0.0} and queues.reserved == {"p0": {}}
    assert queues.models._evidence == {}  # given up, never scored


def test_the_prompts_expected_to_join_come_at_the_rate_of_the_latest_placements() -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0)
    for _ in range(2 * ARRIVALS):  # one every 5 ms, then a pause
        pl.choose(100, 10).release_prefill(done=True)
        clock.now += 0.005
    clock.now += 0.005 * ARRIVALS  # the latest ARRIVALS came in half of the time since
    pl.choose(1000, 10)  # a step of 0.11 s begins
    clock.now += 0.01
    # The latest ARRIVALS: the last ARRIVALS - 1 of the 100-token ones and this one.
    oldest = 100.0 + 0.005 * (ARRIVALS + 1)
    rate = ((ARRIVALS - 1) * share(100) + share(1000)) / (clock.now - oldest)
    assert pl.queues.queues_s("p0")[1] == pytest.approx((ttft(1000) - 0.01) * (1 + rate))


def test_no_prompt_is_expected_to_join_without_placements_to_reckon_from() -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0)
    pl.choose(1000, 10)
    pl.choose(100, 10)  # placed in the same instant: no time to reckon a rate over
    assert pl.queues.queues_s("p0")[1] == pytest.approx(ttft(1000) + share(100))
    # A producer placed on while it was not priced (no profile bound) has no placements
    # to reckon from once it is.
    bare = priced(clock=clock, ttft_s=10.0)
    p0 = bare.profiles.pop("p0")
    bare.choose(1000, 10)  # the fallback: nothing priced, nothing reckoned
    bare.profiles["p0"] = p0
    assert bare.queues.queues_s("p0")[1] == pytest.approx(FIXED)  # a step of its fixed cost alone


def test_a_finished_prefill_scores_both_predictions_made_when_it_was_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0)
    monkeypatch.setattr(pl.queues, "_join_rate_s", lambda name: 0.0)  # no prompt expected to join: the steps alone

    def place() -> list:
        reservations = [pl.choose(1000, 10)]
        clock.now += 0.01
        return reservations + [pl.choose(100, 10) for _ in range(3)]

    reservations = place()
    last = pl.queues.reserved["p0"][max(pl.queues.reserved["p0"])]
    assert last.serial_s == pytest.approx(ttft(1000) - 0.01 + 3 * ttft(100))
    assert last.batched_s == pytest.approx(ttft(1000) - 0.01 + 2 * share(100) + ttft(100))
    # A batching engine: the first alone, then the other three in one step. Only the
    # last of the three tells the models apart (they differ by 12.5 % for it, 7 % for
    # the one before it).
    for n in range(MIN_EVIDENCE):
        assert pl.queue_models.batched == set()
        clock.now += ttft(1000) - 0.01
        reservations[0].release_prefill(done=True)
        clock.now += FIXED + 3 * share(100)
        for r in reservations[1:]:
            r.release_prefill(done=True)
        assert pl.queues.work_s["p0"] == pytest.approx(0.0, abs=1e-9)
        assert len(pl.queue_models._evidence["p0"]) == n + 1
        reservations = place()
    assert pl.queue_models.batched == {"p0"}


def test_a_prefill_that_failed_scores_nothing() -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0)
    for _ in range(2 * MIN_EVIDENCE):
        reservations = [pl.choose(1000, 10) for _ in range(3)]
        clock.now += 0.01
        for r in reservations:
            r.release()  # given up (an error, a client gone): not a prefill's end
    assert pl.queue_models._evidence == {}


def test_a_producer_leaving_takes_its_queue_model_with_it() -> None:
    pl = priced(["p0", "p1"], ["d0"])
    learn(pl.queue_models, "p1", batched=True)
    pl.set_roles(["p0"], ["d0"])
    pl.remove_engine("p1")
    assert pl.queue_models.batched == set()


# ----------------------------------------------------------------- admission


def test_a_prompt_that_would_make_the_prompts_sharing_its_step_late_goes_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    profiles = {n: profile(n) for n in ("p0", "p1", "d0")}
    pl = priced(["p0", "p1"], ["d0"], profiles=profiles, clock=clock, ttft_s=0.5)
    monkeypatch.setattr(pl.queues, "_join_rate_s", lambda name: 0.0)  # no prompt expected to join: the steps alone
    learn(pl.queue_models, "p0", batched=True)
    learn(pl.queue_models, "p1", batched=True)
    pl.choose(2000, 10, avoid=frozenset({"p1"}))  # p0's step in progress: 0.21 s
    clock.now = 100.1
    # Waits for the next step on p0 with 0.28 s of its 0.5 s left when placed (it spent
    # 0.22 s in the router): it must end by 100.38.
    waiting = pl.choose(100, 10, elapsed_s=0.22, avoid=frozenset({"p1"}))
    assert waiting.producer == "p0"
    assert pl.queues.reserved["p0"][max(pl.queues.reserved["p0"])].latest_done == pytest.approx(100.38)
    # A prompt whose share of that step would end it at 100.11 + 0.28 > 100.38: p0
    # cannot take it, p1 (idle, 0.28 s) can.
    clock.now = 100.11
    q = pl.quote_producer("p0", 2600)
    assert q.predicted_s == pytest.approx(0.1 + share(100) + ttft(2600)) and q.predicted_s < 0.5
    assert q.delays == 1
    assert pl.quote_producer("p1", 2600).delays == 0
    assert pl.choose(2600, 10).producer == "p1"
    # A prompt small enough to share the step in time is taken.
    assert pl.choose(500, 10, avoid=frozenset({"p1"})).producer == "p0"


async def test_a_prompt_that_would_make_the_prompts_sharing_its_step_late_waits_for_that_step(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    """Under ``admission: refuse`` such a prompt is not refused while it can meet its
    own target a step later: it waits for the next reservation to end (the step the
    others wait for under way) and is priced again, its wait counted; it is refused,
    saying why, once its own target has passed."""

    async def busy() -> tuple[PricedPlacement, Reservation, float]:
        pl = priced(clock=trio.current_time, ttft_s=0.5)
        monkeypatch.setattr(pl.queues, "_join_rate_s", lambda name: 0.0)  # no prompt expected to join
        learn(pl.queue_models, "p0", batched=True)
        t0 = trio.current_time()
        head = pl.choose(2000, 10)  # p0's step in progress: 0.21 s
        await trio.sleep(0.1)
        pl.choose(100, 10, elapsed_s=0.22)  # waits for the next step: must end by t0 + 0.38
        await trio.sleep(0.01)
        return pl, head, t0

    pl, head, t0 = await busy()
    placed: list[Reservation] = []

    async def newcomer() -> None:
        placed.append(await pl.acquire(2600, 10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(newcomer)
        await trio.sleep(0.05)
        assert placed == [] and pl.counters["deferred"] == 1 and pl.counters["refused"] == 1
        await trio.sleep_until(t0 + 0.21)
        head.release_prefill(done=True)  # the next step begins: the other prompt in it
    (reservation,) = placed
    assert reservation.producer == "p0" and trio.current_time() == pytest.approx(t0 + 0.21)
    # Priced again from there: that step (its fixed cost and the other's part), then its
    # own prefill, after the 0.1 s it waited.
    assert reservation.predicted_ttft_s == pytest.approx(0.1 + FIXED + share(100) + ttft(2600))
    assert pl.counters["deferred"] == 1 and pl.counters["priced"] == 3
    # Nothing ends before its own target has passed (0.45 s of it left): refused then,
    # saying why.
    pl, head, t0 = await busy()
    with pytest.raises(Refused) as refused:
        await pl.acquire(2600, 10, elapsed_s=0.05)
    assert trio.current_time() == pytest.approx(t0 + 0.11 + 0.45)
    assert "it would make 1 request(s) queued there miss the TTFT target (they share its next step)" in str(refused.value)
    assert pl.counters["deferred"] == 1
    # Without a target nothing is late, for it or for the others: placed at once.
    pl.slo = attrs.evolve(pl.slo, ttft_s=None)
    assert (await pl.acquire(2600, 10)).producer == "p0"


def test_the_prompts_a_newcomer_would_delay_are_those_waiting_for_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=10.0)
    monkeypatch.setattr(pl.queues, "_join_rate_s", lambda name: 0.0)  # no prompt expected to join: the steps alone
    learn(pl.queue_models, "p0", batched=True)
    head = pl.choose(2000, 10)  # begins a step at 100.0
    pl.choose(100, 10)  # placed as it began: waits for the next step
    clock.now = 100.01
    pl.choose(100, 10)  # waits too
    head_q, first, second = pl.queues.reserved["p0"].values()
    head_q.latest_done = 0.0  # the step in progress: no newcomer delays it
    second.latest_done = math.inf
    clock.now = 100.05
    own = pl.prefill_s("p0", 300)
    done = clock.now + (pl.queues.queues_s("p0")[1] + own)  # they would all end then
    first.latest_done = done
    assert pl.quote_producer("p0", 300).delays == 0  # just in time
    first.latest_done = math.nextafter(done, -math.inf)
    assert pl.quote_producer("p0", 300).delays == 1
    # The correction scales the step's time as it scales the prediction.
    first.latest_done = clock.now + (pl.queues.queues_s("p0")[1] + own) * 1.5
    pl.ttft_correction["p0"] = 2.0
    assert pl.quote_producer("p0", 300).delays == 1
    pl.ttft_correction["p0"] = 0.5
    assert pl.quote_producer("p0", 300).delays == 0
    pl.ttft_correction["p0"] = 1.0
    # Prompts other routers queued there run before the step ends too.
    first.latest_done = clock.now + (pl.queues.queues_s("p0")[1] + own)
    assert pl.quote_producer("p0", 300).delays == 0
    pl.mean_prompt_tokens = 100.0
    pl.engine_reported("p0", 4, 0, 3)  # one request of another router's
    assert pl.others_prefill_s("p0") > 0 and pl.quote_producer("p0", 300).delays == 1
    # ... each at its part beyond the step's fixed cost: it shares the step.
    assert 0 < pl.others_prefill_s("p0", batched=True) < pl.others_prefill_s("p0")
    first.latest_done = clock.now + (pl.queues.queues_s("p0")[1] + own)
    assert pl.quote_producer("p0", 300).delays == 0
    first.latest_done = math.nextafter(first.latest_done, -math.inf)
    assert pl.quote_producer("p0", 300).delays == 1
    pl.engine_reported("p0", 3, 0, 3)
    # The head's step ends at 100.2: the two waiting ones are the step in progress now.
    clock.now = 100.2
    head.release_prefill(done=True)
    clock.now = 100.21
    first.latest_done = second.latest_done = 0.0
    assert pl.quote_producer("p0", 300).delays == 0


def test_the_prompts_a_newcomer_would_delay_are_held_to_the_point_prediction_under_either_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``admission_bound: lower`` lets a newcomer in when the low end of its own TTFT
    meets the target; the prompts already waiting for its step are still protected by
    the point prediction of the step's end. Held to the low end instead, on the default
    prefix fleet at 32 req/s, 21 admitted requests missed the TTFT target against 3."""
    for bound in ("lower", "point"):
        clock = Clock()
        pl = priced(clock=clock, ttft_s=10.0, admission_bound=bound)
        monkeypatch.setattr(pl.queues, "_join_rate_s", lambda name: 0.0)
        learn(pl.queue_models, "p0", batched=True)
        for _ in range(ERROR_MIN):  # observed TTFTs a fifth under their predictions
            pl.observe_ttft("p0", 0.8, 1.0)
        assert pl.low_factor("p0") == pytest.approx(0.8)
        pl.choose(2000, 10)  # begins a step at 100.0
        pl.choose(100, 10)  # waits for the next step
        _, waiting = pl.queues.reserved["p0"].values()
        clock.now = 100.05
        ends = pl.queues.queues_s("p0")[1] + pl.prefill_s("p0", 300)  # the next step's end, from now
        waiting.latest_done = clock.now + 0.9 * ends  # between the low end and the prediction
        assert pl.quote_producer("p0", 300).delays == 1
        waiting.latest_done = clock.now + ends
        assert pl.quote_producer("p0", 300).delays == 0


def test_a_serially_priced_producer_never_counts_delays() -> None:
    clock = Clock()
    pl = priced(clock=clock, ttft_s=0.5)
    pl.choose(2000, 10)
    clock.now = 100.1
    pl.choose(100, 10, elapsed_s=0.22)
    clock.now = 100.11
    assert pl.quote_producer("p0", 100).delays == 0  # a later prompt runs after it


# ----------------------------------------------------------------- end to end


def _fleet(batched_tokens: int | None) -> dict:
    extra = {} if batched_tokens is None else {"max_num_batched_tokens": batched_tokens}
    return fleet_doc(
        engine("p0", 8101, ["prefill"], prefill={"a": 0.02, "b": 1e-4, "c": 0.0}, **extra),
        engine("d0", 8102, ["decode"]),
        controller={"slo": {"ttft_s": 2.0, "tpot_s": 0.5}, "admission": "refuse"},
    )


@pytest.mark.parametrize("batched_tokens", [None, 8192])
async def test_the_router_learns_whether_a_simulated_producer_shares_its_steps(
    autojump_clock: trio.abc.Clock, batched_tokens: int | None
) -> None:
    async with open_stack(_fleet(batched_tokens), priced=True) as stack:
        placement = stack.router.state.placement

        async def one(i: int, delay: float) -> None:
            await trio.sleep(delay)
            assert (await stack.complete({"prompt": " ".join(f"w{i}x{j}" for j in range(200)), "max_tokens": 2}))

        for burst in range(3 * MIN_EVIDENCE):
            async with trio.open_nursery() as nursery:
                for i, delay in enumerate((0.0, 0.005, 0.006, 0.007)):  # three behind the first
                    nursery.start_soon(one, 4 * burst + i, delay)
            await trio.sleep(0.5)
        assert placement.queue_models.batched == ({"p0"} if batched_tokens else set())
        fleet = {e["name"]: e for e in AdminApp(stack.router.state, stack.router.metrics, stack.router.events).fleet()["engines"]}
        assert fleet["p0"]["prefill_queue"] == ("batched" if batched_tokens else "serial")
        assert "prefill_queue" not in fleet["d0"]  # a consumer
        # Predictions within 15 % at the median (a serial
        # producer's exactly; a batching one's miss which prompts of a burst share a step).
        errors = sorted(abs(r["attempts"][0]["predicted_ttft_s"] / r["ttft_s"] - 1) for r in stack.records[-40:])
        assert errors[len(errors) // 2] <= (0.15 if batched_tokens else 1e-9)


# ----------------------------------------------------------------- the profile's verdict


def test_a_profile_says_how_its_producer_queues_until_its_requests_say_otherwise() -> None:
    models = QueueModels()
    models.prior("p0", "batched")
    models.prior("p1", "serial")
    models.prior("p2", None)
    assert models.batched == {"p0"}
    learn(models, "p0", batched=False, times=MIN_EVIDENCE - 1)
    assert models.batched == {"p0"}  # too little evidence to overrule the profile
    learn(models, "p0", batched=False, times=1)
    assert models.batched == set()
    # A new profile (a new generation, a new measurement) starts again from its verdict,
    # the requests' evidence dropped: one more serial-looking placement does not flip it.
    models.prior("p0", "batched")
    learn(models, "p0", batched=False, times=1)
    assert models.batched == {"p0"}
    learn(models, "p1", batched=True)
    assert models.batched == {"p0", "p1"}
    models.prior("p1", None)
    assert models.batched == {"p0"}


def test_placement_takes_the_verdict_of_the_profiles_it_is_given_and_binds() -> None:
    batched = attrs.evolve(profile("p0"), prefill_queue="batched")
    pl = priced(["p0", "p1"], ["d0"], profiles={"p0": batched, "p1": profile("p1"), "d0": profile("d0")})
    assert pl.queue_models.batched == {"p0"}
    # Binding the profile already bound keeps what the requests taught since.
    learn(pl.queue_models, "p1", batched=True)
    pl.bind("p1", pl.profiles["p1"])
    assert pl.queue_models.batched == {"p0", "p1"}
    # Another profile says anew.
    pl.bind("p0", attrs.evolve(batched, prefill_queue="serial"))
    pl.bind("p1", attrs.evolve(profile("p1"), prefill_queue="serial"))
    assert pl.queue_models.batched == set()
    pl.unbound["p1"] = "identity unavailable: test"
    pl.bind("p1", attrs.evolve(profile("p1"), prefill_queue="batched"))
    assert pl.queue_models.batched == {"p1"} and "p1" not in pl.unbound
    assert pl.profiles["p1"].prefill_queue == "batched"


@pytest.mark.parametrize("said", [None, "batched"])
async def test_a_profile_that_says_batched_prices_the_first_bursts_as_steps(
    autojump_clock: trio.abc.Clock, said: str | None
) -> None:
    async with open_stack(_fleet(8192), priced=True) as stack:
        state = stack.router.state
        assert state.profiles is not None
        engines = state.profiles.engines | {"p0": attrs.evolve(state.profiles.engines["p0"], prefill_queue=said)}
        state.profiles = attrs.evolve(state.profiles, engines=engines)
        assert await state.bind_profiles() == {}
        fleet = {e["name"]: e for e in AdminApp(state, stack.router.metrics, stack.router.events).fleet()["engines"]}
        assert fleet["p0"]["prefill_queue"] == ("batched" if said else "serial")

        async def one(i: int, delay: float) -> None:
            await trio.sleep(delay)
            assert (await stack.complete({"prompt": " ".join(f"w{i}x{j}" for j in range(200)), "max_tokens": 2}))

        for burst in range(3):  # fewer placements than the learning needs
            async with trio.open_nursery() as nursery:
                for i, delay in enumerate((0.0, 0.005, 0.006, 0.007)):
                    nursery.start_soon(one, 4 * burst + i, delay)
            await trio.sleep(0.5)
        errors = sorted(abs(r["attempts"][0]["predicted_ttft_s"] / r["ttft_s"] - 1) for r in stack.records)
        median = errors[len(errors) // 2]
        # Priced as steps from the first request, within 15 %; priced serially (no
        # verdict yet, too few placements to learn one), the queued prompts' shared
        # steps are over-predicted by more.
        assert (median <= 0.15) if said else (median > 0.3), median
