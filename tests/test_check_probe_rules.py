"""The KV transfer probe, one pair at a time, against simulated engines: which stage a
fault fails, every word of the result, and the pairs that are not probed."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.check.checks import open_clients
from narwhal.check.probes import pair_name, probe_pair, probe_transfers, role_pairs
from narwhal.check.results import CheckResult
from narwhal.config import FaultSpec, FleetConfig, parse_fleet
from narwhal.engines.client import EngineClient, EngineIdentity
from narwhal.testing import SimFleet, open_sim_fleet
from tests.checkkit import LIMIT_S, engine, fleet_doc, identities

TIMEOUT_S = 2.5
LIMIT = "each leg within 2.5 s"


def fleet(*engines: dict[str, Any]) -> FleetConfig:
    doc = fleet_doc(*engines)
    doc["engine"]["first_token_timeout_s"] = TIMEOUT_S
    return parse_fleet(doc)


@asynccontextmanager
async def running(config: FleetConfig) -> AsyncIterator[tuple[SimFleet, dict[str, EngineClient]]]:
    async with open_sim_fleet(config) as sim, AsyncExitStack() as stack:
        yield sim, open_clients(stack, config, sim.transport)


async def probe(config: FleetConfig, faults: Mapping[str, FaultSpec] = {}, **kw: Any) -> CheckResult:
    async with running(config) as (sim, clients):
        for name, spec in faults.items():
            sim.engines[name].inject(spec)
        p, c = config.engines[0], config.engines[1]
        await trio.sleep(10)  # the times measured are the probe's own, not the clock's
        with trio.fail_after(LIMIT_S):
            return await probe_pair(kw.pop("producer", p), kw.pop("consumer", c), clients,
                                    timeout_s=TIMEOUT_S, **kw)  # fmt: skip


def two() -> FleetConfig:
    return fleet(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]))


def test_role_pairs_keep_one_model_and_let_an_unknown_model_pair_with_any() -> None:
    config = fleet(
        engine("p0", 8101, ["prefill"]), engine("x", 8102), engine("d0", 8103, ["decode"]),
        engine("d1", 8104, ["decode"]),
    )  # fmt: skip
    everything = [("p0", "x"), ("p0", "d0"), ("p0", "d1"), ("x", "d0"), ("x", "d1")]
    assert [(p.name, c.name) for p, c in role_pairs(config)] == everything
    models = {"p0": "a", "x": None, "d0": "a", "d1": "b"}
    assert [(p.name, c.name) for p, c in role_pairs(config, models)] == [
        ("p0", "x"), ("p0", "d0"), ("x", "d0"), ("x", "d1"),
    ]  # fmt: skip
    assert [(p.name, c.name) for p, c in role_pairs(config, {"d1": "b"})] == everything
    assert pair_name("p0", "d0") == "p0->d0"


async def test_a_probe_that_passes_times_each_leg(autojump_clock: trio.abc.Clock) -> None:
    r = await probe(two())
    assert (r.name, r.engine, r.ok, r.limit) == ("kv_transfer", "p0->d0", True, LIMIT)
    d = r.detail
    assert set(d) == {"producer", "consumer", "prefill_s", "endpoint", "first_token_s", "stage", "total_s"}
    assert (d["producer"], d["consumer"], d["stage"]) == ("p0", "d0", "done")
    assert d["endpoint"] == "p0.kv.test:23101"
    assert 0 < d["prefill_s"] < TIMEOUT_S and 0 < d["first_token_s"] < TIMEOUT_S
    assert r.measured == d["total_s"] == pytest.approx(d["prefill_s"] + d["first_token_s"])
    assert r.message == (
        f"KV transfer p0->d0: prefill {d['prefill_s'] * 1e3:.1f} ms, "
        f"first token {d['first_token_s'] * 1e3:.1f} ms"
    )


async def test_a_probe_within_its_bound_reports_each_leg_in_milliseconds(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Legs of over a second: the displayed figures are their times in ms to a tenth.
    faults = {
        "p0": FaultSpec(kind="delay_headers", on="prefill", delay_s=1.25),
        "d0": FaultSpec(kind="delay_headers", on="decode", delay_s=2.0),
    }
    r = await probe(two(), faults)
    assert r.ok, r.message
    match = re.fullmatch(r"KV transfer p0->d0: prefill (\S+) ms, first token (\S+) ms", r.message)
    assert match is not None, r.message
    prefill_ms, first_token_ms = (float(g) for g in match.groups())
    assert prefill_ms == pytest.approx(r.detail["prefill_s"] * 1000, abs=0.05) and prefill_ms >= 1250
    assert first_token_ms == pytest.approx(r.detail["first_token_s"] * 1000, abs=0.05)
    assert first_token_ms >= 2000


def failed(r: CheckResult, stage: str, error: str) -> None:
    assert (r.name, r.engine, r.ok, r.limit) == ("kv_transfer", "p0->d0", False, LIMIT)
    assert r.measured == f"{stage} failed"
    assert r.detail["stage"] == stage and r.detail["error"] == error
    assert (r.detail["producer"], r.detail["consumer"]) == ("p0", "d0")
    assert r.message == f"KV transfer p0->d0 failed at {stage}: {error}"


async def test_a_pair_without_a_connector_fails_before_any_request(autojump_clock: trio.abc.Clock) -> None:
    config = two()
    p, c = config.engines
    r = await probe(config, producer=attrs.evolve(p, connector=None))
    failed(r, "prefill", "producer p0 has no KV connector configured")
    assert r.detail["total_s"] == 0
    r = await probe(config, consumer=attrs.evolve(c, connector=None))
    failed(r, "decode", "consumer d0 has no KV connector configured; "
                        "it would ignore the handoff and recompute the prompt")  # fmt: skip


async def test_a_slow_prefill_fails_at_the_leg_bound(autojump_clock: trio.abc.Clock) -> None:
    slow = FaultSpec(kind="delay_headers", on="prefill", delay_s=60.0)
    r = await probe(two(), {"p0": slow})
    failed(r, "prefill", "the prefill took over 2.5 s (engine.first_token_timeout_s)")
    assert r.detail["total_s"] == pytest.approx(TIMEOUT_S)
    assert "prefill_s" not in r.detail


async def test_a_prefill_error_fails_the_prefill(autojump_clock: trio.abc.Clock) -> None:
    r = await probe(two(), {"p0": FaultSpec(kind="http_error", on="prefill", status=503, message="busy")})
    assert r.detail["stage"] == "prefill" and "503" in r.detail["error"]
    failed(r, "prefill", r.detail["error"])


@pytest.mark.parametrize("variant", ["wrong_endpoint", "missing_engine_id"])
async def test_a_bad_descriptor_fails_the_descriptor(autojump_clock: trio.abc.Clock, variant: str) -> None:
    fault = FaultSpec(kind="malformed_descriptor", on="prefill", variant=variant)  # type: ignore[arg-type]
    r = await probe(two(), {"p0": fault})
    failed(r, "descriptor", r.detail["error"])
    assert r.detail["error"].startswith("invalid KV handoff descriptor: "), r.detail["error"]
    assert "endpoint" not in r.detail


async def test_a_silent_decode_fails_at_the_leg_bound(autojump_clock: trio.abc.Clock) -> None:
    r = await probe(two(), {"d0": FaultSpec(kind="delay_headers", on="decode", delay_s=60.0)})
    failed(r, "decode", "no first token within 2.5 s (engine.first_token_timeout_s)")
    assert r.detail["endpoint"] == "p0.kv.test:23101" and r.detail["prefill_s"] > 0
    assert r.detail["total_s"] == pytest.approx(r.detail["prefill_s"] + TIMEOUT_S)


async def test_a_decode_that_ends_without_a_token_fails(autojump_clock: trio.abc.Clock) -> None:
    r = await probe(two(), {"d0": FaultSpec(kind="done_before_token", on="decode")})
    assert "before any token arrived" in r.detail["error"]
    failed(r, "decode", r.detail["error"])


class _Ended:
    """A consumer whose decode stream ends cleanly with only non-token chunks (the
    engine client raises for an empty stream; the probe does not rely on it)."""

    @asynccontextmanager
    async def decode(self, *args: Any, **kwargs: Any) -> AsyncIterator[AsyncIterator[Any]]:
        async def chunks() -> AsyncIterator[Any]:
            yield attrs.make_class("Meta", {"kind": attrs.field(default="meta")})()

        yield chunks()


async def test_a_decode_stream_that_ends_without_a_token_fails(autojump_clock: trio.abc.Clock) -> None:
    config = two()
    async with running(config) as (_, clients):
        with trio.fail_after(LIMIT_S):
            p, c = config.engines
            r = await probe_pair(p, c, {**clients, "d0": _Ended()}, timeout_s=TIMEOUT_S)  # type: ignore[dict-item]
    failed(r, "decode", "the decode stream ended without a token")


async def test_a_decode_error_fails_the_decode(autojump_clock: trio.abc.Clock) -> None:
    r = await probe(two(), {"d0": FaultSpec(kind="http_error", on="decode", status=500, message="no")})
    assert "500" in r.detail["error"]
    failed(r, "decode", r.detail["error"])


async def test_pairs_with_an_unreachable_engine_are_not_probed(autojump_clock: trio.abc.Clock) -> None:
    config = fleet(
        engine("p0", 8101, ["prefill"]), engine("p1", 8102, ["prefill"], no_sim=True),
        engine("d0", 8103, ["decode"]), engine("d1", 8104, ["decode"], no_sim=True),
    )  # fmt: skip
    async with running(config) as (sim, clients):
        live: dict[str, EngineIdentity | None] = {**await identities(config, sim.transport), "p1": None}
        with trio.fail_after(LIMIT_S):
            results = await probe_transfers(config, clients, live)
    assert [(r.engine, r.ok) for r in results] == [
        ("p0->d0", True), ("p0->d1", False), ("p1->d0", False), ("p1->d1", False),
    ]  # fmt: skip
    skipped = results[1:]
    assert [r.message for r in skipped] == [
        "KV transfer p0->d1 not probed: engine d1 unreachable",
        "KV transfer p1->d0 not probed: engine p1 unreachable",
        "KV transfer p1->d1 not probed: engine p1 and d1 unreachable",
    ]
    assert skipped[0].detail == {"producer": "p0", "consumer": "d1", "stage": "skipped"}
    assert all(r.name == "kv_transfer" and r.measured == "not probed" and r.limit == LIMIT for r in skipped)


async def test_the_probe_names_the_model_the_producer_serves(autojump_clock: trio.abc.Clock) -> None:
    """With no model declared, the probe asks for the producer's reported model (the
    simulated engine answers a request for another model with 404), and pairs only
    engines that serve the same model."""
    config = fleet(
        engine("p0", 8101, ["prefill"], model="m1"), engine("d0", 8102, ["decode"], model="m2"),
        engine("d1", 8103, ["decode"], model="m1"),
    )  # fmt: skip
    async with open_sim_fleet(config) as sim, AsyncExitStack() as stack:
        recording = _Recording(sim.transport)
        clients = open_clients(stack, config, recording)
        live: dict[str, EngineIdentity | None] = dict(await identities(config, sim.transport))
        with trio.fail_after(LIMIT_S):
            (result,) = await probe_transfers(config, clients, live)
            p, c, _ = config.engines
            wrong = await probe_pair(p, c, clients, timeout_s=TIMEOUT_S, model="m2")
    assert result.engine == "p0->d1" and result.ok, result.line()
    assert [body["model"] for _, body in recording.bodies[:2]] == ["m1", "m1"]
    assert not wrong.ok and wrong.detail["stage"] == "prefill"


class _Recording(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.request_ids: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies.append((request.url.host, json.loads(await request.aread())))
            self.request_ids.append(request.headers.get("x-request-id"))
        return await self.inner.handle_async_request(request)


async def test_the_probe_asks_for_two_greedy_tokens_of_a_prompt_that_names_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An operator reading the engines' logs sees what the probe was; two tokens, so
    that the decode leg has a token to generate after the prefill's."""
    config = fleet(engine("p0", 8101, ["prefill"], model="m1"), engine("d0", 8102, ["decode"], model="m1"))
    async with open_sim_fleet(config) as sim, AsyncExitStack() as stack:
        recording = _Recording(sim.transport)
        clients = open_clients(stack, config, recording)
        with trio.fail_after(LIMIT_S):
            p, c = config.engines
            r = await probe_pair(p, c, clients, timeout_s=TIMEOUT_S, model="m1")
            again = await probe_pair(p, c, clients, timeout_s=TIMEOUT_S)
    assert r.ok and again.ok
    (p_host, prefill), (d_host, decode), (_, prefill2), _ = recording.bodies
    assert (p_host, d_host) == ("p0.test", "d0.test")
    for body in (prefill, decode):
        assert body["prompt"].startswith("narwhal preflight transfer probe ")
        assert len(body["prompt"]) == len("narwhal preflight transfer probe ") + 12
        assert body["temperature"] == 0 and body["model"] == "m1"
    assert decode["max_tokens"] == 2
    assert prefill["prompt"] == decode["prompt"] and prefill2["prompt"] != prefill["prompt"]
    # The decode takes the producer's KV: it carries the handoff, naming the producer's
    # KV endpoint.
    params = decode["kv_transfer_params"]
    assert params["remote_host"] == "p0.kv.test" and params["remote_port"] == 23101, params
    # Each leg is named as the probe's in the engines' logs, with ids of its own.
    ids = recording.request_ids
    assert all(re.fullmatch(r"check-[0-9a-f]{12}-[pd]", str(i)) for i in ids), ids
    assert [str(i)[-1] for i in ids] == ["p", "d", "p", "d"] and len(set(ids)) == 4
    # No model named anywhere: the request names none.
    assert "model" not in prefill2


async def test_the_probe_checks_the_kv_endpoint_itself(autojump_clock: trio.abc.Clock) -> None:
    """A producer's client that does not know the connector accepts any endpoint; the
    probe still holds the descriptor to the endpoint the fleet document configures."""
    config = two()
    fault = FaultSpec(kind="malformed_descriptor", on="prefill", variant="wrong_endpoint")
    async with running(config) as (sim, clients):
        sim.engines["p0"].inject(fault)
        bare = copy.copy(clients["p0"])
        bare.connector = None
        p, c = config.engines
        with trio.fail_after(LIMIT_S):
            r = await probe_pair(p, c, {**clients, "p0": bare}, timeout_s=TIMEOUT_S)
    failed(r, "descriptor", r.detail["error"])
    assert "p0" in r.detail["error"] and "p0.kv.test:23101" in r.detail["error"], r.detail["error"]
