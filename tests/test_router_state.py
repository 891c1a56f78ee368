"""The router's shared state on its own: profile binding, prompt counting, model and
readiness bookkeeping and a changing fleet's membership, over simulated engines in
memory (virtual time)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.engines.client import start_date
from narwhal.errors import EngineError, NoEngine
from narwhal.profile.store import Profiles
from narwhal.router.journal import Journal
from narwhal.router.pricing import PricedPlacement
from narwhal.router.state import RouterState
from narwhal.testing import SimFleet, open_memory_network, open_sim_fleet

from .routerkit import engine, fleet_doc, sim_profiles


@asynccontextmanager
async def open_state(
    doc: dict[str, Any] | None = None,
    *,
    priced: bool = False,
    wrap: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None,
) -> AsyncIterator[tuple[RouterState, SimFleet, Profiles | None]]:
    """A router's state (no server, no background tasks) in front of simulated engines;
    ``wrap`` wraps its transport to the engines."""
    config = parse_fleet(doc if doc is not None else fleet_doc())
    async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet:
        profiles = await sim_profiles(config, net) if priced else None
        transport = fleet.transport if wrap is None else wrap(fleet.transport)
        state = RouterState(config, transport=transport, journal=Journal(None), profiles=profiles)
        try:
            yield state, fleet, profiles
        finally:
            await state.aclose()


# ----------------------------------------------------------------- binding profiles


async def test_a_profile_of_another_generation_is_not_bound_and_the_change_is_named(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_state(priced=True) as (state, _fleet, profiles):
        assert profiles is not None
        live = profiles.engines["p0"].identity
        older = attrs.evolve(live, url="http://old.test:1", model="other", version="0.31.0", max_model_len=2048)
        engines = dict(profiles.engines)
        engines["p0"] = attrs.evolve(engines["p0"], identity=older)
        state.profiles = attrs.evolve(profiles, engines=engines)
        unbound = await state.bind_profiles()
        placement = state.placement
        assert isinstance(placement, PricedPlacement)
        assert set(placement.profiles) == {"d0"}
        assert unbound == {"p0": (
            "profile bound to another engine generation (url 'http://old.test:1' -> 'http://p0.test:8101'; "
            "model 'other' -> 'sim-llama'; version '0.31.0' -> '0.32.0'; max_model_len 2048 -> 4096): "
            "re-profile or refit"
        )}  # fmt: skip


# ----------------------------------------------------------------- counting prompts


#: The engines asked to count a prompt, in order (kept by :func:`failing_tokenize`).
asked: list[str] = []


def failing_tokenize(statuses: dict[str, int]) -> Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap``: the engines named answer ``POST /tokenize`` with the status given;
    every engine asked is appended to :data:`asked`."""
    asked.clear()

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            name = request.url.host.removesuffix(".test")
            if request.url.path == "/tokenize":
                asked.append(name)
                if name in statuses:
                    return httpx.Response(statuses[name], json={"error": {"message": f"{name} says no"}})
            return await self.inner.handle_async_request(request)

    return Wrapped


def two_producers(**sections: Any) -> dict[str, Any]:
    return fleet_doc(engine("p0", 8101, ["prefill"]), engine("p1", 8102, ["prefill"]), engine("d0", 8103, ["decode"]),
                     controller={"prompt_tokens": "tokenize"}, **sections)  # fmt: skip


async def test_a_transient_tokenize_failure_asks_the_next_producer_and_counts_against_the_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_state(two_producers(), wrap=failing_tokenize({"p0": 503})) as (state, _fleet, _):
        count = await state.count_prompt({"prompt": "a b c"}, "completions")
        assert count.exact and count.count == 3 and count.ids is not None and len(count.ids) == 3
        assert asked == ["p0", "p1"]
        assert state.breaker.states["p0"].streak == 1 and state.breaker.states["p1"].streak == 0
        assert state.breaker.states["p0"].last_error is not None
        assert state.breaker.states["p0"].last_error.startswith("tokenize: ")
        assert state.in_flight_by_engine == {"p0": 0, "p1": 0, "d0": 0}


async def test_the_least_loaded_producer_counts_and_the_last_ones_failure_is_raised(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_state(two_producers(), wrap=failing_tokenize({"p0": 503, "p1": 500})) as (state, _fleet, _):
        state.placement.loads["p0"].prefill_tokens = 100
        with pytest.raises(EngineError) as exc:
            await state.tokenize({"prompt": "a b c"}, "completions")
        assert asked == ["p1", "p0"]
        assert exc.value.engine == "p0" and exc.value.leg == "prefill"
        assert state.breaker.states["p0"].streak == 1 and state.breaker.states["p1"].streak == 1
        assert state.in_flight_by_engine == {"p0": 0, "p1": 0, "d0": 0}


async def test_a_prompt_a_producer_rejects_is_not_its_fault_nor_asked_again(autojump_clock: trio.abc.Clock) -> None:
    async with open_state(two_producers(), wrap=failing_tokenize({"p0": 400})) as (state, _fleet, _):
        with pytest.raises(EngineError) as exc:
            await state.tokenize({"prompt": "a b c"}, "completions")
        assert asked == ["p0"] and exc.value.client_fault
        assert exc.value.engine == "p0" and exc.value.leg == "prefill"
        assert state.breaker.states["p0"].streak == 0 and state.breaker.states["p0"].last_error is None


async def test_no_producer_to_count_with_is_a_refusal(autojump_clock: trio.abc.Clock) -> None:
    async with open_state(two_producers()) as (state, _fleet, _):
        state.breaker.eject("p0", "down")
        state.breaker.eject("p1", "down")
        with pytest.raises(NoEngine) as exc:
            await state.count_prompt({"prompt": "a b c"}, "completions")
        # Their probes are due in recovery.probe_interval_s (the shipped 5 s).
        assert exc.value.message == "no engine available for prefill" and exc.value.retry_after_s == 5.0


async def test_chat_messages_are_counted_with_the_chat_template(autojump_clock: trio.abc.Clock) -> None:
    async with open_state(two_producers(), wrap=failing_tokenize({})) as (state, _fleet, _):
        messages = [{"role": "user", "content": "a b c"}]
        chat = await state.count_prompt({"messages": messages}, "chat")
        plain = await state.count_prompt({"prompt": "a b c"}, "completions")
        assert chat.exact and chat.count > plain.count == 3
        assert asked == ["p0", "p0"]


async def test_token_id_prompts_are_counted_here_and_text_is_estimated_without_tokenize(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_state(wrap=failing_tokenize({})) as (state, _fleet, _):
        assert not state.exact_prompt_counts  # least-loaded placement: estimates
        ids = await state.count_prompt({"prompt": [5, 6, 7]}, "completions")
        assert ids == attrs.evolve(ids, count=3, max_model_len=None, exact=True, size=0, ids=(5, 6, 7))
        mixed = await state.count_prompt({"prompt": [5, "x", 7]}, "completions")
        assert (mixed.count, mixed.exact, mixed.ids) == (3, True, None)
        text = "a b c d"
        estimate = await state.count_prompt({"prompt": text}, "completions")
        assert not estimate.exact and estimate.size == len(text) and estimate.ids is None
        assert estimate.count == state.prompt_lengths.estimate("completions", len(text))
        # A chat request's token ids are no prompt: estimated from its messages.
        chat = await state.count_prompt({"prompt": [1, 2], "messages": [{"role": "user", "content": text}]}, "chat")
        assert not chat.exact
        assert asked == []


# ----------------------------------------------------------------- a changing fleet


async def test_an_engine_is_busy_while_a_reservation_or_a_leg_uses_it(autojump_clock: trio.abc.Clock) -> None:
    async with open_state() as (state, _fleet, _):
        assert not state.busy("p0")
        reservation = state.placement.choose(10, 2)
        assert state.busy("p0") and state.busy("d0")
        reservation.release()
        assert not state.busy("p0")
        state.in_flight_by_engine["p0"] += 1  # a leg (a token count, a probe) with no reservation
        assert state.busy("p0") and not state.busy("d0")


async def test_an_added_engine_starts_out_of_placement_and_a_forgotten_one_leaves_every_table(
    autojump_clock: trio.abc.Clock,
) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    config = parse_fleet(doc)
    d1 = config.engines[2]
    async with open_state(fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]))) as (state, _f, _):
        with pytest.raises(ValueError, match="engine d0 is already in the fleet"):
            state.add_engine(config.engines[1])
        state.add_engine(d1)
        assert state.engine_state("d1") == "starting" and state.in_flight_by_engine["d1"] == 0
        assert "d1" in state.clients and "d1" in state.breaker.states and "d1" in state.placement.loads
        assert [e.name for e in state.members()] == ["p0", "d0"]
        state.phase.pop("d1")
        state.refresh_roles()
        assert state.placement.decode_engines == ["d0", "d1"] and state.engine_state("d1") == "ok"
        # Draining d0 leaves d1 decoding: d0 is no member; draining d1 too keeps d0 (the role's last).
        state.phase["d0"] = "draining"
        assert [e.name for e in state.members()] == ["p0", "d1"]
        state.refresh_roles()
        assert state.placement.decode_engines == ["d1"]
        state.phase["d1"] = "draining"
        assert [e.name for e in state.members()] == ["p0", "d0", "d1"]
        state.phase["d1"] = "starting"  # a starting engine serves no role yet: the draining one stays
        assert [e.name for e in state.members()] == ["p0", "d0"]
        state.phase.pop("d1")
        state.refresh_roles()
        state.placement.set_roles(["p0"], ["d1"])
        state._reported.update({"d0": {"sim-llama": 4096}, "d1": {"other": 2048}})
        state._recompute_models()
        assert state.models == {"sim-llama": 4096, "other": 2048}
        await state.forget_engine("d0")
        assert "d0" not in state.engines and "d0" not in state.clients and "d0" not in state.phase
        assert "d0" not in state.breaker.states and "d0" not in state.placement.loads
        assert "d0" not in state.in_flight_by_engine and "d0" not in state._reported
        assert state.models == {"other": 2048}
        await state.forget_engine("d0")  # once only


async def test_an_engine_on_trial_takes_one_request_at_a_time(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    async with open_state(doc) as (state, _fleet, _):
        state.breaker.eject("d0", "down")
        assert not state.placeable("d0") and state.engine_state("d0") == "ejected"
        state.breaker.readmit("d0")
        assert state.placeable("d0") and state.engine_state("d0") == "trial"
        reservation = state.placement.choose(10, 2, avoid=frozenset({"d1"}))
        assert reservation.consumer == "d0" and not state.placeable("d0")
        assert state.placeable("d1")
        reservation.release()
        assert state.placeable("d0")


# ----------------------------------------------------------------- models


def listing(answers: dict[str, Any]) -> Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap``: the engines named answer ``GET /v1/models`` with the ``data`` given
    (``"hang"``: never; ``"slow"``: their own answer, after 2 s; ``("late", data)``:
    ``data``, after 2 s)."""

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            name = request.url.host.removesuffix(".test")
            if request.url.path == "/v1/models" and name in answers:
                answer = answers[name]
                if answer == "hang":
                    await trio.sleep_forever()
                if answer == "slow":
                    await trio.sleep(2.0)
                    return await self.inner.handle_async_request(request)
                if isinstance(answer, tuple):  # ("late", data): data, after 2 s
                    await trio.sleep(2.0)
                    answer = answer[1]
                return httpx.Response(200, json={"object": "list", "data": answer})
            return await self.inner.handle_async_request(request)

    return Wrapped


async def test_models_are_learned_with_the_smallest_limit_and_odd_entries_ignored(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    doc["engines"][2]["model"] = doc["engines"][2]["sim"]["model"] = "declared"
    answers = {
        "p0": [{"id": "a", "max_model_len": 4096}, {"id": "b", "max_model_len": 1000}, "junk", {"id": 7}],
        "d0": [{"id": "a", "max_model_len": 2048}, {"id": "b", "max_model_len": 1.5e3}, {"max_model_len": 10}],
        "d1": [{"id": "a", "max_model_len": 8192}],  # lists a, declared to serve "declared"
    }
    async with open_state(doc, wrap=listing(answers)) as (state, _fleet, _):
        assert state.models == {"declared": None}
        await state.refresh_models()
        assert state._reported == {
            "p0": {"a": 4096, "b": 1000}, "d0": {"a": 2048, "b": None}, "d1": {"a": 8192},
        }  # fmt: skip
        assert state.models == {"declared": None, "a": 2048, "b": 1000}
        assert state.placement.models == {
            "p0": frozenset({"a", "b"}), "d0": frozenset({"a", "b"}), "d1": frozenset({"declared", "a"}),
        }  # fmt: skip
        # Only the engines asked are asked again (and only they are warned of).
        answers["p0"] = [{"id": "a", "max_model_len": 512}]
        answers["d0"] = [{"id": "a", "max_model_len": 256}]
        await state.refresh_models(["p0"])
        assert state._reported["p0"] == {"a": 512} and state._reported["d0"] == {"a": 2048, "b": None}
        assert state.models == {"declared": None, "a": 512, "b": None}
    warnings = [r.getMessage() for r in caplog.records if r.name == "narwhal.router"]
    assert warnings == ["engine d1 is declared to serve model 'declared' but lists 'a'"]


async def test_an_engine_that_does_not_answer_keeps_what_is_known(autojump_clock: trio.abc.Clock) -> None:
    answers: dict[str, Any] = {"p0": [{"id": "a", "max_model_len": 4096}], "d0": [{"id": "a", "max_model_len": 2048}]}
    async with open_state(wrap=listing(answers)) as (state, _fleet, _):
        await state.refresh_models()
        assert state.models == {"a": 2048}
        answers["d0"] = "hang"
        answers["p0"] = [{"id": "a", "max_model_len": 1024}]
        with trio.fail_after(state.config.engine.connect_timeout_s + 1):
            await state.refresh_models(["d0", "p0", "gone"])
        assert trio.current_time() >= state.config.engine.connect_timeout_s
        assert state.models == {"a": 1024}
        assert state._reported["d0"] == {"a": 2048}
        answers["p0"] = None  # no data list: an engine error, kept as before
        await state.refresh_models(["p0"])
        assert state._reported["p0"] == {"a": 1024}


async def test_a_request_names_a_served_model_or_none_when_the_fleet_serves_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    from narwhal.errors import BadRequest, NotFound

    async with open_state() as (state, _fleet, _):
        assert state.models == {} and state.default_model is None
        assert state.model_of(None) is None and state.model_of("anything") == "anything"
        state.models = {"a": 4096}
        assert state.default_model == "a" and state.model_of(None) == "a" and state.model_of("a") == "a"
        with pytest.raises(NotFound) as missing:
            state.model_of("b")
        assert missing.value.message == "model 'b' does not exist (served: 'a')" and missing.value.code == "model_not_found"
        state.models = {"a": 4096, "b": None}
        assert state.default_model is None and state.model_of("b") == "b"
        with pytest.raises(BadRequest) as several:
            state.model_of(None)
        assert several.value.message == "'model' is required: this router serves several models ('a', 'b')"
        assert several.value.code == "model_required"


async def test_each_model_is_ready_while_it_has_a_producer_and_a_consumer(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                    engine("p1", 8103, ["prefill"]), engine("d1", 8104, ["decode"]))  # fmt: skip
    for e, model in zip(doc["engines"], "aabb", strict=True):
        e["model"] = e["sim"]["model"] = model
    async with open_state(doc) as (state, _fleet, _):
        assert state.model_readiness() == {"a": None, "b": None} and state.ready()
        state.breaker.eject("d1", "down")
        assert state.model_readiness() == {"a": None, "b": "no engine can decode now"}
        assert state.unready_reason() is None and state.ready()
        state.breaker.eject("p0", "down")
        state.breaker.eject("d0", "down")
        assert state.unready_reason() == (
            "model 'a': no engine can prefill or decode now; model 'b': no engine can decode now"
        )
        assert not state.ready()
        body = state.health(detail=False)
        assert body["status"] == "unavailable" and body["models"] == {
            "a": "no engine can prefill or decode now", "b": "no engine can decode now",
        }  # fmt: skip
    async with open_state() as (state, _fleet, _):
        assert state.models == {} and state.model_readiness() == {None: None}
        state.breaker.eject("p0", "down")
        assert state.unready_reason() == "no engine can prefill now"
        assert "models" not in state.health(detail=False)


async def test_an_engine_without_a_profile_or_an_identity_is_placed_by_load_and_says_why(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("p1", 8102, ["prefill"]), engine("d0", 8103, ["decode"]))
    hang = {"p1": "hang"}
    async with open_state(doc, priced=True, wrap=listing(hang)) as (state, _fleet, profiles):
        assert profiles is not None
        placement = state.placement
        assert isinstance(placement, PricedPlacement)
        health = state.health(detail=True)["engines"]
        assert health["p0"]["pricing"] == "load (its profile is not bound yet)"
        engines = dict(profiles.engines)
        del engines["d0"]
        state.profiles = attrs.evolve(profiles, engines=engines)
        placement.profiles["d0"] = profiles.engines["d0"]  # bound before: unbound now
        unbound = await state.bind_profiles()
        timeout = state.config.engine.first_token_timeout_s
        assert trio.current_time() == pytest.approx(timeout)
        assert set(placement.profiles) == {"p0"}
        assert unbound == {
            "d0": "no accepted profile",
            "p1": f"identity unavailable: {unbound['p1'].removeprefix('identity unavailable: ')}",
        }
        health = state.health(detail=True)["engines"]
        assert health["p0"]["pricing"] == "profile" and health["d0"]["pricing"] == "load (no accepted profile)"
        warnings = sorted(r.getMessage() for r in caplog.records if r.name == "narwhal.router")
        assert warnings[0] == "engine d0 is placed by load only: no accepted profile"
        assert warnings[1].startswith("engine p1 is placed by load only: identity unavailable")
        # Bound again once it answers: only the engines named are looked at.
        del hang["p1"]
        assert await state.bind_profiles(["p1"]) == {}  # what it says is of the engines asked
        assert set(placement.profiles) == {"p0", "p1"} and placement.unbound == {"d0": "no accepted profile"}
    async with open_state() as (state, _fleet, _):
        assert await state.bind_profiles() == {}
        assert "pricing" not in state.health(detail=True)["engines"]["p0"]


async def test_an_engine_forgotten_while_its_identity_is_asked_is_not_bound(autojump_clock: trio.abc.Clock) -> None:
    async with open_state(priced=True, wrap=listing({"d0": "slow"})) as (state, _fleet, _):
        placement = state.placement
        assert isinstance(placement, PricedPlacement)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(state.bind_profiles)
            await trio.sleep(1.0)
            state.clients.pop("d0")
        assert set(placement.profiles) == {"p0"} and "d0" not in placement.unbound
        assert await state.bind_profiles(["d0"]) == {}  # not in the fleet: nothing asked


async def test_each_model_of_several_learns_its_own_prompt_lengths(autojump_clock: trio.abc.Clock) -> None:
    async with open_state() as (state, _fleet, _):
        shared = state.prompt_lengths
        state.models = {"a": None}
        assert state.prompt_lengths_for("a") is shared and state.prompt_lengths_for(None) is shared
        state.models = {"a": None, "b": None}
        a = state.prompt_lengths_for("a")
        assert a is not shared and state.prompt_lengths_for("a") is a
        assert state.prompt_lengths_for("b") not in (a, shared)
        assert state.prompt_lengths_for(None) is shared
        a.observe("completions", 100, 50)
        estimate = await state.count_prompt({"model": "a", "prompt": "x" * 100}, "completions")
        assert estimate.count == a.estimate("completions", 100) != shared.estimate("completions", 100)


# ----------------------------------------------------------------- built from the document


async def test_the_state_is_built_from_every_setting_of_the_document(autojump_clock: trio.abc.Clock) -> None:
    from narwhal.router.placement import Placement

    p0 = engine("p0", 8101, ["prefill"])
    p0.update(model="sim-llama", api_key="k0")
    doc = fleet_doc(
        p0, engine("d0", 8102, ["decode"]), engine("b0", 8103, ["prefill", "decode"]),
        recovery={"eject_after": 4, "failure_quarantine_s": 2.5, "probe_interval_s": 7.0,
                  "retry_budget": {"ratio": 0.3, "min_retries_per_s": 2.0, "window_s": 12.0}},
        journal={"path": "elsewhere/j.jsonl", "queue_size": 17, "fsync": False},
        engine={"connect_timeout_s": 3.0},
        server={"engine_urls_in_errors": True},
        controller={"slo": {"ttft_s": 0.7, "tpot_s": 0.04}, "admission": "wait", "pricing": "upper",
                    "admission_bound": "point"},
    )  # fmt: skip
    config = parse_fleet(doc)
    state = RouterState(config)  # its own journal, least-loaded placement
    breaker = state.breaker
    assert (breaker.eject_after, breaker.quarantine_s, breaker.probe_interval_s) == (4, 2.5, 7.0)
    assert breaker._peers["d0"] and breaker._peers["p0"]  # each role's engines know each other
    budget = state.retry_budget
    assert (budget.ratio, budget.min_retries_per_s, budget.window_s) == (0.3, 2.0, 12.0)
    journal = state.journal
    assert journal.path is not None and journal.path.as_posix() == "elsewhere/j.jsonl" and journal.fsync is False
    assert journal._send.statistics().max_buffer_size == 17
    assert type(state.placement) is Placement
    assert state.placement.prefill_engines == ["p0", "b0"] and state.placement.decode_engines == ["d0", "b0"]
    assert state.placement.models == {"p0": frozenset({"sim-llama"})}
    assert state.models == {"sim-llama": None}
    assert not state.exact_prompt_counts
    assert state.in_flight == 0 and state.in_flight_by_engine == {"p0": 0, "d0": 0, "b0": 0}
    client = state.clients["p0"]
    assert (client.url, client.name, client.model, client._api_key, client.connect_timeout_s) == (
        "http://p0.test:8101", "p0", "sim-llama", "k0", 3.0)
    assert client.connector == config.engines[0].connector
    assert client.public_name == "p0 at http://p0.test:8101"
    assert state.clients["d0"].model is None and state.clients["d0"]._api_key is None
    assert state.phase == {} and state.phase_errors == {} and state.kv_subscribers == {}
    assert state.clock is trio.current_time and breaker._clock is trio.current_time
    assert budget._clock is trio.current_time
    await state.aclose()

    priced = RouterState(config, journal=Journal(None), profiles=Profiles(
        schema_version=1, created_at="now", software={}, samples=None, engines={}))  # type: ignore[arg-type]
    placement = priced.placement
    assert isinstance(placement, PricedPlacement)
    assert placement.slo == config.controller.slo and placement.admission == "wait" and placement.pricing == "upper"
    assert placement.admission_bound == "point"
    assert placement.profiles == {} and placement.clock is trio.current_time
    assert placement.prefill_engines == ["p0", "b0"] and placement.decode_engines == ["d0", "b0"]
    assert placement.models == {"p0": frozenset({"sim-llama"})}
    assert priced.exact_prompt_counts  # priced placement counts exactly by default
    breaker.eject("p0", "down")
    assert not state.placeable("p0")
    priced.breaker.eject("p0", "down")
    assert not placement.available("p0") and placement.available("b0")
    for mode, expected in (("tokenize", True), ("estimate", False), ("auto", False)):
        other = attrs.evolve(config, controller=attrs.evolve(config.controller, prompt_tokens=mode))
        assert RouterState(other, journal=Journal(None)).exact_prompt_counts is expected
    for mode, expected in (("tokenize", True), ("estimate", False), ("auto", True)):
        other = attrs.evolve(config, controller=attrs.evolve(config.controller, prompt_tokens=mode))
        assert RouterState(other, journal=Journal(None), profiles=priced.profiles).exact_prompt_counts is expected


async def test_health_shows_how_each_engines_kv_events_arrive(autojump_clock: trio.abc.Clock) -> None:
    from narwhal.engines.kvevents import KVEventSubscriber

    async with open_state() as (state, _fleet, _):
        assert state.kv_events_status("p0") is None
        assert "kv_events" not in state.health(detail=True)["engines"]["p0"]
        sub = KVEventSubscriber("tcp://p0.test:5557", on_batch=lambda seq, batch: None, on_reset=lambda why: None)
        sub.delivered, sub.probe_gaps = 12, 3
        state.kv_subscribers["p0"] = sub
        live = {"state": "live", "detail": None, "delivered": 12, "probe_gaps": 3}
        assert state.kv_events_status("p0") == live
        assert state.health(detail=True)["engines"]["p0"]["kv_events"] == live
        sub.stale = "no live batch in 2 probes"
        assert state.kv_events_status("p0") == {
            "state": "stale", "detail": "no live batch in 2 probes", "delivered": 12, "probe_gaps": 3,
        }  # fmt: skip
        assert state.health(detail=False)["engines"] == {"p0": "ok", "d0": "ok"}


async def test_an_engine_forgotten_while_it_lists_its_models_leaves_no_limit_behind(
    autojump_clock: trio.abc.Clock,
) -> None:
    # d1 answers /v1/models late, with a small context; it leaves the fleet meanwhile.
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    answers: dict[str, Any] = {"p0": [{"id": "a", "max_model_len": 4096}], "d0": [{"id": "a", "max_model_len": 4096}],
                               "d1": ("late", [{"id": "a", "max_model_len": 1024}])}  # fmt: skip
    async with open_state(doc, wrap=listing(answers)) as (state, _fleet, _):
        state.placement.set_roles(["p0"], ["d0"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(state.refresh_models)
            await trio.sleep(1.0)
            await state.forget_engine("d1")
        assert state.models == {"a": 4096}  # d1's 1,024 tokens bound the model no longer
        assert "d1" not in state._reported


async def test_the_breaker_keeps_the_permitted_roles_whatever_placement_is_assigned(
    autojump_clock: trio.abc.Clock,
) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    async with open_state(doc) as (state, _fleet, _):
        assert state.breaker._peers == {"p0": [["p0"]], "d0": [["d0", "d1"]], "d1": [["d0", "d1"]]}
        state.assign_roles = lambda members: (["p0"], ["d1"])  # reactive control's choice
        state.phase["d1"] = "starting"
        state.refresh_roles()
        assert state.placement.decode_engines == ["d1"]
        assert state.breaker._peers == {"p0": [["p0"]], "d0": [["d0"]], "d1": []}


# ----------------------------------------------------------------- the request's model, counted


def aliases_and_tokenize(bodies: list[tuple[str, dict[str, Any]]]) -> Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap``: every engine lists the models ``a`` and ``b``, but p0 ``a`` only; ``POST /tokenize``
    answers three tokens and a 777-token limit, its body kept in ``bodies``."""

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            name = request.url.host.removesuffix(".test")
            if request.url.path == "/v1/models":
                data = [{"id": m, "max_model_len": 4096} for m in ("a", "b") if m == "a" or name != "p0"]
                return httpx.Response(200, json={"object": "list", "data": data})
            if request.url.path == "/tokenize":
                await request.aread()
                bodies.append((name, json.loads(request.content)))
                return httpx.Response(200, json={"count": 3, "tokens": [7, 8, 9], "max_model_len": 777})
            return await self.inner.handle_async_request(request)

    return Wrapped


async def test_the_prompt_is_counted_for_the_model_the_request_names(autojump_clock: trio.abc.Clock) -> None:
    bodies: list[tuple[str, dict[str, Any]]] = []
    async with open_state(two_producers(), wrap=aliases_and_tokenize(bodies)) as (state, _fleet, _):
        await state.refresh_models()
        assert set(state.models) == {"a", "b"}  # several: a request names its model
        state.placement.loads["p1"].prefill_tokens = 100  # p0 is the least loaded, and serves a only
        state.in_flight_by_engine["p1"] = 1  # a leg of another request
        count = await state.count_prompt({"prompt": "x y z", "model": "b"}, "completions")
        assert count == attrs.evolve(count, count=3, max_model_len=777, exact=True, ids=(7, 8, 9))
        messages = [{"role": "user", "content": "x"}]
        await state.count_prompt({"messages": messages, "model": "b"}, "chat")
        assert bodies == [("p1", {"prompt": "x y z", "model": "b"}), ("p1", {"messages": messages, "model": "b"})]
        assert state.in_flight_by_engine["p1"] == 1  # the other request's leg still counts
        state.breaker.eject("p1", "down")
        with pytest.raises(NoEngine) as exc:
            await state.count_prompt({"prompt": "x", "model": "b"}, "completions")
        assert exc.value.message == "no engine of model 'b' available for prefill" and exc.value.retry_after_s == 5.0


async def test_an_estimated_count_says_it_is_not_exact(autojump_clock: trio.abc.Clock) -> None:
    async with open_state() as (state, _fleet, _):
        estimate = await state.count_prompt({"prompt": "a b c d"}, "completions")
        assert estimate.exact is False and estimate.max_model_len is None


# ----------------------------------------------------------------- profiles bound again


async def test_a_bound_profile_is_dropped_when_its_engine_changes_or_stops_answering(
    autojump_clock: trio.abc.Clock,
) -> None:
    hang: dict[str, Any] = {}
    async with open_state(priced=True, wrap=listing(hang)) as (state, _fleet, profiles):
        assert profiles is not None
        placement = state.placement
        assert isinstance(placement, PricedPlacement)
        assert await state.bind_profiles() == {}
        assert placement.profiles == {"p0": profiles.engines["p0"], "d0": profiles.engines["d0"]}
        # Another generation of p0 (restarted): only the engines named are looked at.
        live = profiles.engines["p0"].identity
        restarted = attrs.evolve(live, process_start_time=86400.0)
        engines = dict(profiles.engines)
        engines["p0"] = attrs.evolve(engines["p0"], identity=restarted)
        state.profiles = attrs.evolve(profiles, engines=engines)
        assert await state.bind_profiles(["d0"]) == {}
        assert set(placement.profiles) == {"p0", "d0"}
        unbound = await state.bind_profiles(["p0"])
        assert set(placement.profiles) == {"d0"}
        assert unbound == {"p0": (
            "profile bound to another engine generation (started 1970-01-02 00:00:00 UTC, running since "
            f"{start_date(live.process_start_time)}): re-profile or refit"
        )}  # fmt: skip
        # d0 stops answering: its profile is dropped too.
        hang["d0"] = "hang"
        await state.bind_profiles(["d0"])
        assert set(placement.profiles) == set() and placement.unbound["d0"].startswith("identity unavailable")


async def test_an_engine_never_profiled_is_placed_by_load(autojump_clock: trio.abc.Clock) -> None:
    async with open_state(priced=True) as (state, _fleet, profiles):
        assert profiles is not None
        state.profiles = attrs.evolve(profiles, engines={"d0": profiles.engines["d0"]})
        assert await state.bind_profiles() == {"p0": "no accepted profile"}
        assert isinstance(state.placement, PricedPlacement) and set(state.placement.profiles) == {"d0"}


async def test_profiles_bind_only_under_priced_placement(autojump_clock: trio.abc.Clock) -> None:
    async with open_state(priced=True) as (state, _fleet, profiles):
        state.profiles = None  # a priced router that has none (yet): nothing to bind
        assert await state.bind_profiles() == {}
        assert isinstance(state.placement, PricedPlacement) and not state.placement.profiles
    async with open_state() as (state, _fleet, _):
        state.profiles = profiles  # least-loaded placement prices nothing, profiles or not
        assert await state.bind_profiles() == {}


async def test_a_forgotten_engine_leaves_the_prefix_index(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    async with open_state(doc) as (state, _fleet, _):
        for name in ("p0", "d0"):
            state.prefix.enable(name, block_size=4, capacity_tokens=64, events=False)
        state.phase["d0"] = "draining"
        state.refresh_roles()
        await state.forget_engine("d0")
        assert not state.prefix.enabled("d0") and state.prefix.view("d0") is None
        assert state.prefix.enabled("p0") and state.prefix.view("p0") is not None
