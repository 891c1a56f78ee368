"""The breaker's state machine, least-reserved-load placement and the retry budget, on a
hand-driven clock.

The router tests drive the same rules end to end; these pin down every transition
(what each one sets, what it emits, what it leaves alone), so that a change to any
of them fails a test (see tools/mutation.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from narwhal.errors import NoEngine, Refused
from narwhal.router.breaker import Breaker, BreakerState, Transition
from narwhal.router.placement import Placement
from narwhal.router.retry import RetryBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(
    *,
    eject_after: int = 2,
    quarantine_s: float = 0.0,
    probe_interval_s: float = 5.0,
    roles: dict[str, list[str]] | None = None,
) -> tuple[Breaker, Clock]:
    clock = Clock()
    roles = roles if roles is not None else {"prefill": ["p0", "p1"], "decode": ["d0", "d1"]}
    names = list(dict.fromkeys(n for group in roles.values() for n in group))
    b = Breaker(
        names, eject_after=eject_after, quarantine_s=quarantine_s, probe_interval_s=probe_interval_s,
        roles=roles, clock=clock,
    )  # fmt: skip
    return b, clock


def events(b: Breaker) -> list[tuple[str, str]]:
    return [(t.engine, t.event) for t in b.transitions]


def test_a_fresh_engine_is_in_placement() -> None:
    b, _ = breaker()
    assert b.states["d0"] == BreakerState()
    assert b.available("d0") and b.status("d0") == "ok" and not b.on_trial("d0")
    assert b.due_probes() == [] and b.next_probe_at() == math.inf


def test_failures_build_a_streak_and_a_success_resets_it() -> None:
    b, _ = breaker(eject_after=3)
    b.record_failure("d0", "one")
    b.record_failure("d0", "two")
    st = b.states["d0"]
    assert st.streak == 2 and not st.ejected and st.last_error == "two"
    assert b.available("d0") and b.transitions == []  # no quarantine configured
    b.record_success("d0")
    assert st.streak == 0 and st.last_error == "two"
    b.record_failure("d0", "three")
    assert st.streak == 1 and not st.ejected


def test_ejection_after_the_streak() -> None:
    b, clock = breaker(eject_after=2, probe_interval_s=7.0)
    b.record_failure("d0", "first", origin_producer="p0", leg="decode")
    clock.now = 103.0
    b.record_failure("d0", "second", origin_producer="p1", leg="decode")
    st = b.states["d0"]
    assert st.ejected and not st.trial
    assert (st.ejected_at, st.next_probe_at, st.probes) == (103.0, 110.0, 0)
    assert (st.origin_producer, st.failed_leg, st.last_error) == ("p1", "decode", "second")
    assert not b.available("d0") and b.status("d0") == "ejected"
    assert b.transitions == [Transition("d0", "ejected", 103.0, "second")]
    # Nothing is due before the probe interval; the loop learns when.
    assert b.due_probes() == [] and b.next_probe_at() == 110.0
    clock.now = 110.0
    assert b.due_probes() == ["d0"]
    # Further failures and successes change nothing while ejected: only a probe readmits.
    b.record_failure("d0", "third")
    b.record_success("d0")
    assert st.ejected and st.streak == 2 and st.last_error == "third"
    assert len(b.transitions) == 1


def test_a_same_worker_failure_has_no_origin_producer() -> None:
    b, _ = breaker(eject_after=1, roles={"prefill": ["both", "p1"], "decode": ["both", "d1"]})
    b.record_failure("both", "x", origin_producer="both", leg="decode")
    assert b.states["both"].origin_producer is None and b.states["both"].failed_leg == "decode"


def test_quarantine_after_each_failure() -> None:
    b, clock = breaker(eject_after=5, quarantine_s=10.0)
    b.record_failure("d0", "x")
    st = b.states["d0"]
    assert st.quarantined_until == 110.0
    assert not b.available("d0") and b.status("d0") == "quarantined"
    assert b.transitions == [Transition("d0", "quarantined", 100.0, "x")]
    clock.now = 109.999
    assert not b.available("d0")
    clock.now = 110.0
    assert b.available("d0") and b.status("d0") == "ok"


def test_a_quarantine_never_empties_a_role() -> None:
    b, clock = breaker(eject_after=5, quarantine_s=10.0)
    b.record_failure("d0", "x")
    b.record_failure("d1", "y")
    # Both decode engines quarantined: neither is left out (the role keeps capacity).
    assert b.available("d0") and b.available("d1")
    # Producers are untouched.
    assert b.available("p0") and b.available("p1")
    clock.now = 105.0
    b.record_success("d1")  # streak reset, quarantine runs its course
    assert b.available("d0")


def test_whole_wave_ejects_the_last_engine_of_a_role_too() -> None:
    # Seed 001: an ejected engine leaves placement until a probe succeeds, even the last
    # of its role; the role is empty until the probes bring an engine back.
    b, clock = breaker(eject_after=1)
    b.record_failure("d0", "d0 down", leg="decode")
    clock.now = 101.0
    b.record_failure("d1", "d1 down", leg="decode")
    d0, d1 = b.states["d0"], b.states["d1"]
    assert d0.ejected and not b.available("d0") and b.status("d0") == "ejected"
    assert d1.ejected and not b.available("d1") and b.status("d1") == "ejected"
    assert b.transitions == [Transition("d0", "ejected", 100.0, "d0 down"), Transition("d1", "ejected", 101.0, "d1 down")]
    # The producers are untouched.
    assert b.available("p0") and b.available("p1")
    # A request placed before the ejection that succeeds after it readmits nothing.
    b.record_success("d1")
    assert d1.ejected and d1.streak == 1 and len(b.transitions) == 2
    # Both are probed at their cadence; the first to pass serves the role again.
    clock.now = 106.0
    assert b.due_probes() == ["d0", "d1"]
    b.probe_failed("d0", "still down")
    b.readmit("d1")
    assert b.available("d1") and not b.available("d0")
    # The role's only engine in placement is not limited to trial.
    assert d1.trial and not b.on_trial("d1") and b.status("d1") == "trial"


def test_an_engine_in_two_roles_leaves_both() -> None:
    b, _ = breaker(eject_after=1, roles={"prefill": ["both"], "decode": ["both", "d1"]})
    b.record_failure("both", "x")
    assert b.states["both"].ejected and not b.available("both")  # the only producer, out
    assert b.available("d1")
    clock = Clock()
    alone = Breaker(["e"], eject_after=1, quarantine_s=0.0, probe_interval_s=1.0, clock=clock)
    alone.record_failure("e", "x")
    assert alone.states["e"].ejected and not alone.available("e")


def test_retry_after_is_when_the_next_probe_of_the_role_is_due() -> None:
    b, clock = breaker(eject_after=1, probe_interval_s=5.0)
    # Nothing ejected (a role with no engine at all): the probe cadence.
    assert b.retry_after_s([]) == 5.0 and b.retry_after_s(["d0", "d1"]) == 5.0
    b.record_failure("d0", "x")  # its probe is due at 105
    clock.now = 102.0
    b.record_failure("d1", "y")  # due at 107
    clock.now = 103.5
    assert b.retry_after_s(["d0", "d1"]) == 1.5  # the soonest
    assert b.retry_after_s(["d1"]) == 3.5
    assert b.retry_after_s(["d1", "p0"]) == 3.5  # an engine in placement has no probe
    assert b.retry_after_s(["gone", "d1"]) == 3.5  # nor one that left the fleet
    # d0's probe is due (running): its verdict readmits it or sets the next an interval
    # later, so the cadence.
    clock.now = 105.0
    assert b.retry_after_s(["d0"]) == 5.0 and b.retry_after_s(["d0", "d1"]) == 2.0
    clock.now = 106.0
    b.probe_failed("d0", "still down")  # next at 111
    clock.now = 108.0
    assert b.retry_after_s(["d0", "d1"]) == 3.0 and b.retry_after_s(["d0"]) == 3.0


def test_eject_takes_an_engine_out_at_once() -> None:
    # The start-up probe found it unreachable: out until a readmission probe finds it
    # serving, whatever its streak, even the last of its role.
    b, clock = breaker(probe_interval_s=7.0, roles={"prefill": ["p0"], "decode": ["d0"]})
    b.eject("d0", "no answer to GET /health")
    st = b.states["d0"]
    assert st == BreakerState(ejected=True, ejected_at=100.0, next_probe_at=107.0, last_error="no answer to GET /health")
    assert not b.available("d0") and b.transitions == [Transition("d0", "ejected", 100.0, "no answer to GET /health")]
    clock.now = 101.0
    b.eject("d0", "still no answer")  # already out: the detail is kept, nothing else moves
    assert st.last_error == "still no answer" and st.next_probe_at == 107.0 and len(b.transitions) == 1
    b.eject("gone", "x")  # not (or no longer) in the fleet: ignored
    assert "gone" not in b.states


def test_engines_added_and_removed_at_run_time() -> None:
    b, _ = breaker(eject_after=5, quarantine_s=10.0)
    b.add("d2")  # no role until set_roles names it: a role of its own
    assert b.states["d2"] == BreakerState()
    b.record_failure("d2", "x")
    assert not b.available("d2")  # quarantined, and no role to keep it for
    b.add("d2")  # known already: its state stays
    assert b.states["d2"].streak == 1
    b.remove("d1")
    assert "d1" not in b.states
    b.record_failure("d1", "late report")  # a request that outlived it: ignored
    b.record_success("d1")
    b.readmit("d1")
    b.probe_failed("d1", "x")
    b.probe_inconclusive("d1", "x")
    assert "d1" not in b.states and [t.engine for t in b.transitions] == ["d2"]
    # d0 is the decode role's only engine now: a quarantine keeps it in placement.
    b.record_failure("d0", "y")
    assert b.available("d0") and not b.available("d2")
    b.remove("never-known")  # nothing to forget: no error
    # Added again, d1 starts clean and in no role (its old one is forgotten): a
    # quarantine takes it out, although d0 is quarantined too.
    b.add("d1")
    b.record_failure("d1", "z")
    assert b.states["d1"].streak == 1 and not b.available("d1")


def test_probe_readmission_is_half_open() -> None:
    b, clock = breaker(eject_after=2, quarantine_s=3.0)
    for _ in range(2):
        b.record_failure("d0", "x", origin_producer="p0", leg="decode")
    st = b.states["d0"]
    st.probes = 2
    b.readmit("d0")
    assert not st.ejected and st.trial and st.streak == 0
    assert (st.quarantined_until, st.next_probe_at, st.origin_producer, st.failed_leg) == (
        -math.inf, math.inf, None, None
    )
    assert b.available("d0") and b.on_trial("d0") and b.status("d0") == "trial"
    assert events(b)[-1] == ("d0", "readmitted") and b.transitions[-1].detail is None
    # The first live success closes the trial.
    b.record_success("d0")
    assert not st.trial and not b.on_trial("d0") and b.status("d0") == "ok"
    assert events(b)[-1] == ("d0", "closed")
    # A second success emits nothing more.
    n = len(b.transitions)
    b.record_success("d0")
    assert len(b.transitions) == n
    del clock


def test_a_failure_on_trial_ejects_at_once() -> None:
    b, _ = breaker(eject_after=3)
    for _ in range(3):
        b.record_failure("d0", "x")
    b.readmit("d0")
    b.record_failure("d0", "again", leg="decode")
    st = b.states["d0"]
    assert st.ejected and not st.trial and st.streak == 1 and st.failed_leg == "decode"


def test_the_last_engine_of_a_role_is_never_limited_to_trial() -> None:
    b, _ = breaker(eject_after=1, roles={"prefill": ["p0"], "decode": ["d0", "d1"]})
    b.record_failure("d0", "x")
    b.readmit("d0")
    assert b.on_trial("d0")
    b.record_failure("d1", "y")  # d1 out: d0 is the role's only engine in placement
    assert b.states["d0"].trial and not b.on_trial("d0")


def test_probe_outcomes() -> None:
    b, clock = breaker(eject_after=1, probe_interval_s=5.0)
    b.record_failure("d0", "x")
    st = b.states["d0"]
    clock.now = 105.0
    b.probe_failed("d0", "probe failed: 503")
    assert (st.probes, st.next_probe_at, st.last_error) == (1, 110.0, "probe failed: 503")
    assert st.ejected and b.transitions[-1] == Transition("d0", "probe_failed", 105.0, "probe failed: 503")
    clock.now = 110.0
    b.probe_inconclusive("d0", "producer p0 failed")
    assert (st.probes, st.next_probe_at, st.last_error) == (2, 115.0, "probe failed: 503")
    assert b.transitions[-1] == Transition("d0", "probe_inconclusive", 110.0, "producer p0 failed")


def test_listeners_and_a_bounded_transition_log() -> None:
    b, _ = breaker(eject_after=10_000, quarantine_s=1.0)
    seen: list[Transition] = []
    b.add_listener(seen.append)
    for i in range(1005):
        b.record_failure("d0", f"f{i}")
    assert len(seen) == 1005
    assert len(b.transitions) == 1000 and b.transitions[0].detail == "f5" and b.transitions[-1].detail == "f1004"


async def test_the_probe_loop_wakes_on_an_ejection_and_on_a_poke() -> None:
    b = Breaker(["e"], eject_after=1, quarantine_s=0.0, probe_interval_s=1.0)
    woke = 0

    async def waiter() -> None:
        nonlocal woke
        await b.wait_for_change()
        woke += 1
        await b.wait_for_change()
        woke += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == 0
        b.record_failure("e", "x")
        await trio.testing.wait_all_tasks_blocked()
        assert woke == 1
        b.poke()
        await trio.testing.wait_all_tasks_blocked()
        assert woke == 2


# ---------------------------------------------------------------- placement


def test_placement_takes_the_least_reserved_load() -> None:
    p = Placement(["p0", "p1"], ["d0", "d1"])
    first = p.choose(100, 10)
    assert (first.producer, first.consumer, first.same_worker) == ("p0", "d0", False)
    assert (p.loads["p0"].prefill_requests, p.loads["p0"].prefill_tokens) == (1, 100)
    assert (p.loads["d0"].decode_requests, p.loads["d0"].decode_kv_tokens) == (1, 110)
    assert p.open_reservations == 1 and not p.idle("p0") and not p.idle("d0") and p.idle("p1")
    second = p.choose(50, 5)
    assert (second.producer, second.consumer) == ("p1", "d1")
    first.release_prefill()
    assert (p.loads["p0"].prefill_requests, p.loads["p0"].prefill_tokens) == (0, 0)
    assert p.loads["d0"].decode_requests == 1
    first.release()
    first.release()  # idempotent
    assert (p.loads["d0"].decode_requests, p.loads["d0"].decode_kv_tokens) == (0, 0)
    assert p.open_reservations == 1 and p.idle("p0") and p.idle("d0")
    with second:
        pass
    assert p.open_reservations == 0
    assert all(load.prefill_tokens == 0 and load.decode_kv_tokens == 0 for load in p.loads.values())


def test_placement_weighs_tokens_then_requests() -> None:
    p = Placement(["p0", "p1"], ["d0", "d1"])
    big = p.choose(1000, 10)  # p0, d0
    assert (big.producer, big.consumer) == ("p0", "d0")
    small = p.choose(10, 10)  # p1 has fewer prefill tokens; d1 fewer decodes
    assert (small.producer, small.consumer) == ("p1", "d1")
    nxt = p.choose(10, 10)
    assert nxt.producer == "p1"  # 10 tokens reserved < 1000
    p.loads["d1"].engine_running = 5  # what the engine reports counts too
    assert p.choose(10, 10).consumer == "d0"


def test_placement_skips_unavailable_engines_and_avoids_failed_ones() -> None:
    out = {"p0"}
    p = Placement(["p0", "p1"], ["d0", "d1"], available=lambda n: n not in out)
    assert p.choose(1, 1).producer == "p1"
    r = p.choose(1, 1, avoid=frozenset({"d0"}))
    assert r.consumer == "d1"
    # Avoidance yields when nothing else is left.
    assert p.choose(1, 1, avoid=frozenset({"p1"})).producer == "p1"
    out.update({"p1"})
    with pytest.raises(Refused, match="no engine available for prefill") as info:
        p.choose(1, 1)
    assert info.value.retry_after_s == 1.0
    out.clear()
    out.update({"d0", "d1"})
    with pytest.raises(Refused, match="no engine available for decode"):
        p.choose(1, 1)


def test_placement_same_worker_when_one_engine_has_both_roles() -> None:
    p = Placement(["both"], ["both"])
    r = p.choose(10, 5)
    assert r.same_worker and r.producer == r.consumer == "both"
    assert p.loads["both"].prefill_requests == 1 and p.loads["both"].decode_requests == 1


def test_reservation_callbacks() -> None:
    p = Placement(["p0"], ["d0"])
    r = p.choose(10, 5)
    calls: list[str] = []
    r.on_release_prefill = lambda done: calls.append("prefill")
    r.on_release_decode = lambda: calls.append("decode")
    r.release()
    r.release()
    assert calls == ["prefill", "decode"]


async def test_acquire_honours_cancellation() -> None:
    p = Placement(["p0"], ["d0"])
    with trio.CancelScope() as scope:
        scope.cancel()
        await p.acquire(1, 1)
    assert scope.cancelled_caught and p.open_reservations == 0
    r = await p.acquire(1, 1)
    assert r.producer == "p0" and p.open_reservations == 1


# ---------------------------------------------------------------- the retry budget


def test_retry_budget_allows_the_floor_then_refuses() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.2, window_s=10.0, clock=clock)
    # max(0.2 * 10, 0 * requests) = 2 retries per window.
    assert [budget.try_acquire() for _ in range(3)] == [True, True, False]
    clock.now += 10.0  # still inside the window (its edge counts)
    assert not budget.try_acquire()
    clock.now += 0.001  # the first two retries leave the window
    assert [budget.try_acquire() for _ in range(3)] == [True, True, False]


def test_retry_budget_grows_with_the_request_rate() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.5, min_retries_per_s=0.0, window_s=10.0, clock=clock)
    assert not budget.try_acquire()  # no requests, no floor: no retry
    for _ in range(4):
        budget.note_request()
    assert [budget.try_acquire() for _ in range(3)] == [True, True, False]  # 0.5 * 4
    clock.now += 10.5  # the requests leave the window: back to nothing
    assert not budget.try_acquire()
    budget.note_request()
    budget.note_request()
    assert budget.try_acquire() and not budget.try_acquire()


def test_retry_budget_bounds_its_memory() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=1.0, min_retries_per_s=0.0, window_s=1.0, clock=clock)
    held = []
    for _ in range(5000):
        budget.note_request()
        held.append(len(budget._requests))
        clock.now += 0.01
    # Requests older than the window are dropped once more than 4096 are held.
    assert max(held) == 4096 and held.count(4096) == 1
    clock.now += 0.5
    assert budget.try_acquire()


def test_transition_details_and_exact_states() -> None:
    b, clock = breaker(eject_after=1)
    b.record_failure("d0", "x")
    b.record_failure("d1", "y")  # the last decode engine: out too
    assert b.states["d1"] == BreakerState(
        streak=1, ejected=True, ejected_at=100.0, next_probe_at=105.0, last_error="y"
    )
    b.record_success("d1")  # a live success while ejected changes nothing
    assert b.states["d1"] == BreakerState(
        streak=1, ejected=True, ejected_at=100.0, next_probe_at=105.0, last_error="y"
    )
    b.readmit("d0")  # by a probe: on trial
    assert b.states["d0"] == BreakerState(trial=True, last_error="x", ejected_at=100.0)
    assert b.transitions[-1] == Transition("d0", "readmitted", 100.0, None)
    b.record_success("d0")
    assert b.transitions[-1] == Transition("d0", "closed", 100.0, "a live request succeeded on trial: full weight")
    assert b.states["d0"] == BreakerState(last_error="x", ejected_at=100.0)
    # A failure on trial: the trial flag is cleared, not just falsy.
    b.readmit("d1")
    b.record_failure("d1", "on trial")
    assert b.states["d1"].trial is False and b.states["d1"].ejected is True
    del clock


def test_probes_are_counted() -> None:
    b, _ = breaker(eject_after=1)
    b.record_failure("d0", "x")
    b.probe_failed("d0", "a")
    b.probe_failed("d0", "b")
    b.probe_inconclusive("d0", "c")
    assert b.states["d0"].probes == 3


def test_a_peer_whose_quarantine_ends_now_is_back_in_placement() -> None:
    b, clock = breaker(eject_after=5, quarantine_s=10.0)
    b.record_failure("d1", "y")  # quarantined until 110
    clock.now = 105.0
    b.record_failure("d0", "x")  # quarantined until 115
    clock.now = 109.0
    assert b.available("d0")  # d1 is out too: d0 is the role's last engine
    clock.now = 110.0
    assert b.available("d1") and not b.available("d0")  # d1 is back: d0 sits out its quarantine


def test_placement_refusals_and_reservation_fields() -> None:
    out: set[str] = set()
    p = Placement(["p0"], ["d0"], available=lambda n: n not in out)
    r = p.choose(10, 5)
    assert r.predicted_ttft_s is None and r.predicted_tpot_s is None  # priced placement sets them
    r.release()
    assert (r.prefill_held, r.decode_held, r._open) == (False, False, False)
    assert all(x is False for x in (r.prefill_held, r.decode_held, r._open))
    for gone, role in (("p0", "prefill"), ("d0", "decode")):
        out.clear()
        out.add(gone)
        with pytest.raises(Refused) as info:
            p.choose(1, 1)
        assert str(info.value) == f"no engine available for {role}" and info.value.retry_after_s == 1.0


def test_a_role_with_no_engine_left_is_refused_with_the_time_until_one_may_be_back() -> None:
    out: set[str] = set()
    asked: list[list[str]] = []

    def retry_after_s(names: Sequence[str]) -> float:
        asked.append(list(names))
        return 2.5

    p = Placement(["p0", "a1"], ["d0", "d1", "a1"], available=lambda n: n not in out,
                  models={"p0": ["m"], "d0": ["m"], "d1": ["m"], "a1": ["other"]}, retry_after_s=retry_after_s)  # fmt: skip
    out.update({"d0", "d1"})
    with pytest.raises(NoEngine) as info:
        p.choose(1, 1, model="m")
    # The role's engines serving the model (not another model's), all out.
    assert asked == [["d0", "d1"]]
    err = info.value
    assert str(err) == "no engine of model 'm' available for decode" and err.retry_after_s == 2.5
    assert (err.status, err.error_type, err.terminal_class) == (503, "service_unavailable", "no_engine")
    assert isinstance(err, Refused) and p.open_reservations == 0 and p.loads["p0"].prefill_requests == 0
    out.add("p0")
    with pytest.raises(NoEngine, match=r"^no engine of model 'm' available for prefill$"):
        p.choose(1, 1, model="m")
    assert asked[-1] == ["p0"]
    assert p.choose(1, 1, model="other").consumer == "a1"  # another model's engines serve on


def test_placement_adds_up_a_consumers_kv_and_counts_what_it_reports_waiting() -> None:
    p = Placement(["p0"], ["d0", "d1"])
    a = p.choose(10, 5)
    p.loads["d1"].decode_requests = 1  # d1 as busy as d0 now: ties rotate
    b = p.choose(20, 5, avoid=frozenset({"d1"}))
    assert (a.consumer, b.consumer) == ("d0", "d0")
    assert p.loads["d0"].decode_kv_tokens == 15 + 25 and p.loads["d0"].decode_requests == 2
    # What an engine reports running and waiting both count towards its load.
    q = Placement(["p0"], ["d0", "d1"])
    q.loads["d0"].engine_running, q.loads["d0"].engine_waiting = 1, 2
    q.loads["d1"].engine_running = 2
    assert q.choose(1, 1).consumer == "d1"


async def test_acquire_passes_the_engines_to_avoid() -> None:
    p = Placement(["p0", "p1"], ["d0"])
    r = await p.acquire(1, 1, avoid=frozenset({"p0"}))
    assert r.producer == "p1"
