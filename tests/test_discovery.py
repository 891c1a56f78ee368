"""Engines found in DNS: an engine group's addresses come and go, and the fleet follows.

The machine's resolver is never asked: trio's custom hostname resolver hook answers
for the group's name. Simulated engines listen on different loopback addresses
(127.0.0.2, 127.0.0.3, ...), in memory in virtual time under load, and once on real
sockets.
"""

from __future__ import annotations

import collections
import copy
import errno
import functools
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.errors import ConfigError
from narwhal.router.discovery import Discovery, group_engines, resolve_group
from narwhal.router.journal import Journal
from narwhal.router.service import Router, open_router
from narwhal.testing import MemoryNetwork, open_memory_network, open_sim_fleet
from narwhal.testing.ports import free_port

from .loadkit import Outcome, exchange
from .routerkit import ROUTER_HOST, ROUTER_PORT, SIM, engine, fleet_doc, sim_profiles

NAME = "decode.llm.svc.cluster.local"
STEP_S = 0.05
_SIM = {**copy.deepcopy(SIM), "decode": {"c0": STEP_S, "c1": 0.0, "c2": 0.0}, "max_num_seqs": 512}


class Resolver(trio.abc.HostnameResolver):
    """DNS as the test says: ``names[host]`` is its addresses; None fails the lookup; a
    name not there does not exist (NXDOMAIN), one in ``nodata`` exists with no address."""

    def __init__(self, names: dict[str, list[str] | None]) -> None:
        self.names = names
        self.nodata: set[str] = set()
        self.lookups: list[str] = []
        #: Each lookup's port and socket type.
        self.asked: list[tuple[Any, int]] = []
        #: host -> an event its lookups wait for (a slow DNS server).
        self.gates: dict[str, trio.Event] = {}

    async def getaddrinfo(
        self, host: bytes | None, port: bytes | str | int | None, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
    ) -> list[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[str, int]]]:
        await trio.lowlevel.checkpoint()
        name = host.decode() if isinstance(host, bytes) else str(host)
        self.lookups.append(name)
        self.asked.append((port, type))
        if name in self.gates:
            await self.gates[name].wait()
        if name in self.nodata:
            raise socket.gaierror(socket.EAI_NODATA, "No address associated with hostname")
        if name not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        addresses = self.names[name]
        if addresses is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, int(port or 0))) for a in addresses]

    async def getnameinfo(self, sockaddr: tuple[str, int] | tuple[str, int, int, int], flags: int) -> tuple[str, str]:
        raise NotImplementedError


def _sim_at(address: str, port: int) -> dict[str, Any]:
    return {
        "name": f"sim-{address}", "url": f"http://{address}:{port}", "roles": ["decode"],
        "connector": {"type": "NixlConnector", "kv_host": address, "kv_port": 15000}, "sim": _SIM,
    }  # fmt: skip


def group(**over: Any) -> dict[str, Any]:
    return {"name": "decode", "host": NAME, "port": 8000, "roles": ["decode"],
            "connector": {"kv_port": 15000}, "resolve_every_s": 5.0, **over}  # fmt: skip


@attrs.define
class Live:
    net: MemoryNetwork
    router: Router
    resolver: Resolver
    records: list[dict[str, Any]]

    async def request(self, rid: str, max_tokens: int = 20) -> Outcome:
        conn = await self.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = {"prompt": f"request {rid}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        return await exchange(conn, body, request_id=rid)


@asynccontextmanager
async def open_live(addresses: list[str] | None, *, priced: bool = False, **group_over: Any) -> AsyncIterator[Live]:
    """A router whose decode engines are the group's; ``priced``: p0's profile prices placement."""
    resolver = Resolver({NAME: addresses})
    trio.socket.set_custom_hostname_resolver(resolver)
    p0 = engine("p0", 8101, ["prefill"], **_SIM)
    sims = parse_fleet(fleet_doc(p0, *(_sim_at(f"127.0.0.{i}", 8000) for i in (2, 3, 4, 5))))
    config = parse_fleet(fleet_doc(copy.deepcopy(p0), engine_groups=[group(**group_over)]))
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    async with open_memory_network() as net, open_sim_fleet(sims, network=net) as fleet:
        profiles = await sim_profiles(config, net) if priced else None
        async with open_router(config, transport=fleet.transport, journal=journal, profiles=profiles) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            yield Live(net, router, resolver, records)
    assert net.open_connections == 0


def _consumers(records: list[dict[str, Any]], rids: set[str]) -> collections.Counter[str]:
    return collections.Counter(r["consumer"] for r in records if r["request_id"] in rids)


async def test_addresses_that_appear_and_disappear_under_load(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(["127.0.0.2", "127.0.0.3"]) as live:
        state = live.router.state
        assert sorted(state.engines) == ["decode-127.0.0.2", "decode-127.0.0.3", "p0"]
        assert state.ready() and not state.phase
        assert state.engines["decode-127.0.0.2"].url == "http://127.0.0.2:8000"
        outcomes: dict[str, Outcome] = {}
        late: set[str] = set()

        async def one(rid: str) -> None:
            outcomes[rid] = await live.request(rid)

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(one, f"a{i}")
                await trio.sleep(0.05)
            assert state.in_flight_by_engine["decode-127.0.0.2"] > 0
            changed_at = trio.current_time()
            live.resolver.names[NAME] = ["127.0.0.3", "127.0.0.4"]  # a pod replaced
            for i in range(200):
                rid = f"b{i}"
                if trio.current_time() > changed_at + 5.0 + 0.5:  # resolved again, d4 probed
                    late.add(rid)
                nursery.start_soon(one, rid)
                await trio.sleep(0.05)
        assert len(outcomes) == 240 and all(o.ok for o in outcomes.values())
        ids = [r["request_id"] for r in live.records]
        assert len(ids) == len(set(ids)) == 240
        served = _consumers(live.records, late)
        assert served["decode-127.0.0.2"] == 0 and served["decode-127.0.0.4"] > 0 and served["decode-127.0.0.3"] > 0
        assert sorted(state.engines) == ["decode-127.0.0.3", "decode-127.0.0.4", "p0"]
        assert live.net.connections_to("127.0.0.2", 8000) == 0
        [reload] = [c for c in live.router.fleet.changes if c["event"] == "reload" and c["source"] == "dns:decode"]
        assert (reload["added"], reload["removed"]) == (["decode-127.0.0.4"], ["decode-127.0.0.2"])
        # Resolved at start, then every resolve_every_s.
        assert len(live.resolver.lookups) == pytest.approx(1 + trio.current_time() // 5.0, abs=1)


def _logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "narwhal.router.discovery"]


async def test_a_failed_lookup_keeps_the_engines_and_an_empty_name_keeps_the_role(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.discovery")
    async with open_live(["127.0.0.2"]) as live:
        state = live.router.state
        [start] = [c for c in live.router.fleet.changes if c["event"] == "reload"]
        assert (start["event"], start["source"], start["added"]) == ("reload", "dns", ["decode-127.0.0.2"])
        live.resolver.names[NAME] = None  # the DNS server fails
        await trio.sleep(5.5)
        assert sorted(state.engines) == ["decode-127.0.0.2", "p0"] and not state.phase
        fleet = live.router.admin.handler.fleet  # type: ignore[attr-defined]
        assert fleet()["engine_groups"] == {
            "decode": {"host": NAME, "addresses": ["127.0.0.2"], "error": "[Errno -3] Temporary failure in name resolution"}
        }
        warned = [(logging.WARNING, f"engine group decode: cannot resolve {NAME!r}: [Errno -3] "
                   "Temporary failure in name resolution (keeping 1 engines)")]  # fmt: skip
        assert _logged(caplog) == warned
        await trio.sleep(5.0)  # it fails again: said once
        assert _logged(caplog) == warned
        del live.resolver.names[NAME]  # no pod is ready: the name has no address
        await trio.sleep(5.0)
        # Its engine drains, but stays in placement while it is the role's only one.
        assert state.engine_state("decode-127.0.0.2") == "draining" and state.ready()
        assert fleet()["engine_groups"] == {"decode": {"host": NAME, "addresses": [], "error": None}}
        assert (await live.request("r0", 4)).ok
        live.resolver.names[NAME] = ["127.0.0.5", "127.0.0.3"]
        await trio.sleep(5.5)
        assert sorted(state.engines) == ["decode-127.0.0.3", "decode-127.0.0.5", "p0"]
        assert (await live.request("r1", 4)).ok
        await trio.sleep(10.0)  # resolved twice more, to the same addresses: nothing to say
        assert _logged(caplog)[1:] == [
            (logging.INFO, f"engine group decode: {NAME} resolves to nothing"),
            (logging.INFO, f"engine group decode: {NAME} resolves to 127.0.0.3, 127.0.0.5"),
        ]
        assert {r["request_id"]: r["consumer"] for r in live.records}["r0"] == "decode-127.0.0.2"


async def test_a_reload_brings_a_group_and_refuses_one_that_cannot_resolve(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(["127.0.0.2"]) as live:
        state = live.router.state
        assert not state.phase  # the router started once its group's engines were probed
        prefill = engine("p0", 8101, ["prefill"], **_SIM)
        more = group(name="more", host="more.llm.svc")
        live.resolver.names["more.llm.svc"] = None
        doc = fleet_doc(prefill, engine_groups=[group(), more])
        with pytest.raises(ConfigError) as err:
            await live.router.reload(doc, source="test")
        assert err.value.path == "$.engine_groups[1].host"
        assert "cannot resolve 'more.llm.svc'" in err.value.reason
        assert sorted(state.engines) == ["decode-127.0.0.2", "p0"]
        live.resolver.names["more.llm.svc"] = ["127.0.0.3", "127.0.0.4"]
        change = await live.router.reload(doc, source="test")
        assert change.added == ("more-127.0.0.3", "more-127.0.0.4")
        live.resolver.names["more.llm.svc"] = ["127.0.0.4"]  # the group brought is resolved periodically
        await trio.sleep(5.5)
        assert "more-127.0.0.3" not in state.engines
        # The group leaves with the next document: its engines drain, its name is no longer resolved.
        await live.router.reload(fleet_doc(prefill, engine_groups=[group()]), source="test")
        await trio.sleep(1.0)
        assert sorted(state.engines) == ["decode-127.0.0.2", "p0"]
        discovery = live.router.admin.handler.discovery  # type: ignore[attr-defined]
        assert discovery.addresses == {"decode": ("127.0.0.2",)} and discovery.errors == {}
        asked = len(live.resolver.lookups)
        await trio.sleep(20)
        assert "more.llm.svc" not in live.resolver.lookups[asked:]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"host": ""}, "expected a non-empty string @ $.engine_groups[0].host"),
        ({"port": 0}, "expected a port number 1-65535 @ $.engine_groups[0].port"),
        ({"roles": ["decoder"]}, "expected one of 'prefill', 'decode' @ $.engine_groups[0].roles[0]"),
        ({"resolve_every_s": 0}, "expected a number > 0 @ $.engine_groups[0].resolve_every_s"),
        ({"name": "p0"}, "duplicate name 'p0' (an engine has it) @ $.engine_groups[0].name"),
        ({"connector": {"kv_port": "x"}}, "expected an integer @ $.engine_groups[0].connector.kv_port"),
        ({"roles": ["prefill", "decode"], "connector": None},
         "a prefill engine group needs a connector when an engine can decode @ $.engine_groups[0].connector"),
        ({"kv_events": {"port": 5557, "replay_prt": 5558}},
         "unknown key 'replay_prt' (did you mean 'replay_port'?) @ $.engine_groups[0].kv_events"),
    ],
)
def test_engine_group_errors_name_their_path(over: dict[str, Any], message: str) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine_groups=[group(**over)])
    with pytest.raises(ConfigError) as err:
        parse_fleet(doc)
    assert str(err.value) == message


def test_a_fleet_of_groups_alone_is_valid() -> None:
    groups = [group(name="prefill", host="prefill.svc", roles=["prefill"]), group()]
    config = parse_fleet(fleet_doc(engine("p0", 8101, ["prefill"]), engine_groups=groups) | {"engines": []})
    assert config.engines == () and [g.name for g in config.engine_groups] == ["prefill", "decode"]
    with pytest.raises(ConfigError, match="no engine has the prefill role"):
        parse_fleet({"engines": [], "engine_groups": [group()]})


async def test_discovery_over_loopback_addresses() -> None:
    """Real sockets on 127.0.0.2 and 127.0.0.3 (wall clock): both are found, one leaves."""
    port = free_port()
    resolver = Resolver({NAME: ["127.0.0.2", "127.0.0.3"]})
    trio.socket.set_custom_hostname_resolver(resolver)
    p0 = {**engine("p0", free_port(), ["prefill"], **_SIM), "url": f"http://127.0.0.1:{free_port()}"}
    p0["connector"] = {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()}
    sims = parse_fleet(fleet_doc(p0, *(_sim_at(a, port) for a in ("127.0.0.2", "127.0.0.3"))))
    config = parse_fleet(fleet_doc(p0, engine_groups=[group(port=port, resolve_every_s=0.2)]))
    journal = Journal(None)
    records: list[dict[str, Any]] = []
    journal.add_listener(records.append)
    with trio.fail_after(60):
        async with open_sim_fleet(sims, sockets=True), open_router(config, journal=journal) as router:
            state = router.state
            assert sorted(state.engines) == ["decode-127.0.0.2", "decode-127.0.0.3", "p0"] and state.ready()
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(router.serve_tcp, "127.0.0.1", 0)
                for i in range(8):
                    stream = await trio.open_tcp_stream(*bound[0])
                    body = {"prompt": f"r{i}", "max_tokens": 3, "stream": True}
                    assert (await exchange(stream, body, request_id=f"r{i}")).ok
                resolver.names[NAME] = ["127.0.0.3"]
                while "decode-127.0.0.2" in state.engines:  # noqa: ASYNC110
                    await trio.sleep(0.05)
                stream = await trio.open_tcp_stream(*bound[0])
                assert (await exchange(stream, {"prompt": "last", "max_tokens": 3, "stream": True}, request_id="z")).ok
                await router.shutdown(0)
                nursery.cancel_scope.cancel()
    assert {r["consumer"] for r in records if r["request_id"] != "z"} == {"decode-127.0.0.2", "decode-127.0.0.3"}
    assert [r["consumer"] for r in records if r["request_id"] == "z"] == ["decode-127.0.0.3"]


def test_a_group_engine_per_address_ipv6_included() -> None:
    config = parse_fleet(fleet_doc(engine("p0", 8101, ["prefill"]), engine_groups=[
        group(kv_events={"port": 5557, "replay_port": 5558, "topic": "kv"}, model="m", api_key="k")
    ]))  # fmt: skip
    [g] = config.engine_groups
    v4, v6 = group_engines(g, ["10.0.0.7", "fd00::1"])
    assert (v4.name, v4.url, v4.roles, v4.model, v4.api_key) == ("decode-10.0.0.7", "http://10.0.0.7:8000", ("decode",), "m", "k")
    assert v4.connector is not None and (v4.connector.kv_host, v4.connector.kv_port) == ("10.0.0.7", 15000)
    assert v6.name == "decode-fd00--1" and v6.url == "http://[fd00::1]:8000" and v6.host == "fd00::1"
    assert v6.kv_events is not None
    assert (v6.kv_events.endpoint, v6.kv_events.replay_endpoint, v6.kv_events.topic) == (
        "tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558", "kv"
    )


async def test_a_change_resolved_during_a_reload_does_not_undo_the_reload(autojump_clock: trio.abc.Clock) -> None:
    """A group's new addresses arrive while a reload waits for another group's name: the
    fleet then follows both, the reload's document (not the one served when the change
    was resolved)."""
    async with open_live(["127.0.0.2"], resolve_every_s=1.0) as live:
        state = live.router.state
        prefill = engine("p0", 8101, ["prefill"], **_SIM)
        live.resolver.names["more.llm.svc"] = ["127.0.0.4"]
        gate = live.resolver.gates["more.llm.svc"] = trio.Event()
        doc = fleet_doc(prefill, engine={"request_timeout_s": 300.0}, engine_groups=[
            group(resolve_every_s=1.0), group(name="more", host="more.llm.svc")
        ])  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(live.router.reload, doc, source="test"))
            await trio.sleep(0.1)  # the reload waits for more.llm.svc
            live.resolver.names[NAME] = ["127.0.0.2", "127.0.0.3"]
            await trio.sleep(1.5)  # decode's watch has resolved its change meanwhile
            gate.set()
        await trio.sleep(1.0)
        assert state.config.engine.request_timeout_s == 300.0
        assert [g.name for g in state.config.engine_groups] == ["decode", "more"]
        assert sorted(state.engines) == ["decode-127.0.0.2", "decode-127.0.0.3", "more-127.0.0.4", "p0"]


def test_a_group_without_a_connector_or_a_replay_port() -> None:
    config = parse_fleet(fleet_doc(engine("p0", 8101, ["prefill"]), engine_groups=[
        group(connector=None, kv_events={"port": 5557}),
        group(name="lm", host="lm.svc", connector={"type": "LMCacheConnectorV1", "kv_port": 16000}),
    ]))  # fmt: skip
    plain, typed = config.engine_groups
    [e] = group_engines(plain, ["10.0.0.7"])
    assert e.connector is None and e.kv_events is not None
    assert (e.kv_events.endpoint, e.kv_events.replay_endpoint) == ("tcp://10.0.0.7:5557", None)
    [lm] = group_engines(typed, ["10.0.0.8"])
    assert lm.connector is not None and lm.kv_events is None
    assert (lm.connector.type, lm.connector.kv_host, lm.connector.kv_port) == ("LMCacheConnectorV1", "10.0.0.8", 16000)


async def test_a_lookup_asks_for_the_groups_port_and_gives_up_after_the_connect_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    resolver = Resolver({NAME: ["10.0.0.7", "10.0.0.6", "10.0.0.7"]})
    trio.socket.set_custom_hostname_resolver(resolver)
    [g] = parse_fleet(fleet_doc(engine("p0", 8101, ["prefill"]), engine_groups=[group(port=8011)])).engine_groups
    assert await resolve_group(g, 2.5) == ("10.0.0.6", "10.0.0.7")
    assert resolver.asked == [(8011, socket.SOCK_STREAM)]
    resolver.gates[NAME] = trio.Event()  # the server does not answer
    began = trio.current_time()
    with pytest.raises(OSError) as err:
        await resolve_group(g, 2.5)
    assert trio.current_time() - began == pytest.approx(2.5)
    assert (err.value.errno, err.value.strerror) == (errno.ETIMEDOUT, "no answer within 2.5 s (engine.connect_timeout_s)")


def test_engines_already_in_the_fleet_are_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="narwhal.router.discovery")
    named = engine("decode-10.0.0.7", 8102, ["decode"])  # the name of the group's engine at 10.0.0.7
    at = {**engine("d9", 8103, ["decode"]), "url": "http://10.0.0.8:8000"}  # the URL of the one at 10.0.0.8
    config = parse_fleet(fleet_doc(engine("p0", 8101, ["prefill"]), named, at, engine_groups=[
        group(), group(name="decode-fd00", host="v6.svc"), group(name="again", host="again.svc"),
        group(name="unresolved", host="unresolved.svc"),
    ]))  # fmt: skip
    discovery = Discovery(SimpleNamespace(state=None))  # type: ignore[arg-type]
    discovery.follow(config)  # not running yet: nothing is watched
    discovery.addresses.update({
        "decode": ("10.0.0.7", "10.0.0.8", "10.0.0.9", "fd00:1::"),
        "decode-fd00": ("1::",),  # decode-fd00-1-- again, at another URL
        "again": ("10.0.0.9",),  # another name at decode-10.0.0.9's URL
    })  # fmt: skip
    engines = discovery.expand(config)
    assert [(e.name, e.url) for e in engines[3:]] == [
        ("decode-10.0.0.9", "http://10.0.0.9:8000"), ("decode-fd00-1--", "http://[fd00:1::]:8000")
    ]
    assert [e.name for e in engines[:3]] == ["p0", "decode-10.0.0.7", "d9"]
    assert [r.getMessage() for r in caplog.records] == [
        f"engine group {g}: {name} at {url} is already in the fleet: skipped" for g, name, url in (
            ("decode", "decode-10.0.0.7", "http://10.0.0.7:8000"), ("decode", "decode-10.0.0.8", "http://10.0.0.8:8000"),
            ("decode-fd00", "decode-fd00-1--", "http://[1::]:8000"), ("again", "again-10.0.0.9", "http://10.0.0.9:8000"),
        )
    ]  # fmt: skip


async def test_a_reload_resolves_the_groups_it_changes_only(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(["127.0.0.2"]) as live:
        discovery = live.router.admin.handler.discovery  # type: ignore[attr-defined]
        prefill = engine("p0", 8101, ["prefill"], **_SIM)
        live.resolver.names[NAME] = None
        await trio.sleep(5.5)  # its watch failed
        assert discovery.errors == {"decode": "[Errno -3] Temporary failure in name resolution"}
        asked = len(live.resolver.lookups)
        # Followed already: not resolved again, so that the DNS failure refuses nothing.
        change = await live.router.reload(fleet_doc(prefill, engine={"request_timeout_s": 300.0},
                                                    engine_groups=[group()]), source="test")  # fmt: skip
        assert change.settings == ("engine.request_timeout_s",) and len(live.resolver.lookups) == asked
        # Its name changes: the new name is resolved before the document applies.
        live.resolver.names["new.llm.svc"] = ["127.0.0.3"]
        change = await live.router.reload(fleet_doc(prefill, engine_groups=[group(host="new.llm.svc")]), source="test")
        assert live.resolver.lookups[asked:] == ["new.llm.svc"]
        assert (change.added, change.removed) == (("decode-127.0.0.3",), ("decode-127.0.0.2",))
        assert discovery.addresses == {"decode": ("127.0.0.3",)} and discovery.errors == {}


async def test_an_unchanged_group_is_watched_on_through_reloads(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(["127.0.0.2"]) as live:
        state = live.router.state
        discovery = live.router.admin.handler.discovery  # type: ignore[attr-defined]
        prefill = engine("p0", 8101, ["prefill"], **_SIM)
        asked = len(live.resolver.lookups)
        for _ in range(4):  # reloaded every 3 s, resolved every 5 s all the same
            await trio.sleep(3.0)
            await live.router.reload(fleet_doc(prefill, engine_groups=[group()]), source="test")
        assert len(live.resolver.lookups) - asked == 2
        # Its period changes: watched anew, with the addresses it has.
        await live.router.reload(fleet_doc(prefill, engine_groups=[group(resolve_every_s=1.0)]), source="test")
        assert discovery.addresses == {"decode": ("127.0.0.2",)}
        live.resolver.names[NAME] = ["127.0.0.2", "127.0.0.3"]
        await trio.sleep(1.5)
        assert sorted(state.engines) == ["decode-127.0.0.2", "decode-127.0.0.3", "p0"]


async def test_a_group_that_never_resolved_can_leave(autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="narwhal.router.discovery")
    async with open_live(None) as live:  # the DNS server fails from the start
        state = live.router.state
        discovery = live.router.admin.handler.discovery  # type: ignore[attr-defined]
        assert sorted(state.engines) == ["p0"] and discovery.addresses == {}
        assert [(c["event"], c.get("source")) for c in live.router.fleet.changes] == [("rejected", "dns")]
        assert _logged(caplog) == [(logging.ERROR, f"engine groups: cannot resolve {NAME!r}: [Errno -3] Temporary "
                                    "failure in name resolution @ $.engine_groups[0].host")]  # fmt: skip
        await trio.sleep(5.5)  # its watch fails too
        assert discovery.errors == {"decode": "[Errno -3] Temporary failure in name resolution"}
        live.resolver.names["other.llm.svc"] = ["127.0.0.3"]
        prefill = engine("p0", 8101, ["prefill"], **_SIM)
        await live.router.reload(fleet_doc(prefill, engine_groups=[group(name="other", host="other.llm.svc")]),
                                 source="test")  # fmt: skip
        assert discovery.addresses == {"other": ("127.0.0.3",)} and discovery.errors == {}
        assert sorted(state.engines) == ["other-127.0.0.3", "p0"]


@pytest.mark.parametrize("first", [["127.0.0.2"], None])
async def test_a_change_the_fleet_refuses_keeps_the_addresses_applied(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, first: list[str] | None
) -> None:
    """The addresses applied are kept: those resolved at start, or none (the name failed)."""
    async with open_live(first) as live:
        kept = tuple(first or ())
        caplog.set_level(logging.ERROR, logger="narwhal.router.discovery")
        caplog.clear()
        state = live.router.state
        discovery = live.router.admin.handler.discovery  # type: ignore[attr-defined]
        fleet = live.router.fleet
        prepare = fleet.before_apply

        async def refuse(config: Any) -> None:
            raise ConfigError("refused here", path="$.engine_groups")

        fleet.before_apply = refuse
        live.resolver.names[NAME] = ["127.0.0.3"]
        await trio.sleep(5.5)
        assert discovery.addresses == {"decode": kept}
        assert sorted(state.engines) == sorted(["p0", *(f"decode-{a}" for a in kept)])
        assert _logged(caplog) == [
            (logging.ERROR, "engine group decode: the change was refused: refused here @ $.engine_groups")
        ]
        fleet.before_apply = prepare
        await trio.sleep(5.0)  # tried again at the next resolution
        assert discovery.addresses == {"decode": ("127.0.0.3",)} and "decode-127.0.0.3" in state.engines
        assert "decode-127.0.0.2" not in state.engines or state.engine_state("decode-127.0.0.2") == "draining"


async def test_a_priced_router_follows_its_groups(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(["127.0.0.2"], priced=True) as live:
        state = live.router.state
        assert state.profiles is not None and sorted(state.engines) == ["decode-127.0.0.2", "p0"]
        live.resolver.names[NAME] = ["127.0.0.3"]
        await trio.sleep(5.5)
        assert sorted(state.engines) == ["decode-127.0.0.3", "p0"]
        assert state.profiles is not None


async def test_the_router_does_not_wait_for_a_group_engine_whose_first_probe_failed(autojump_clock: trio.abc.Clock) -> None:
    began = trio.current_time()
    async with open_live(["127.0.0.9"]) as live:  # nothing listens there
        assert trio.current_time() - began < 1.0  # not the connect timeout and more
        assert live.router.state.phase == {"decode-127.0.0.9": "starting"}
        assert "decode-127.0.0.9" in live.router.state.phase_errors


async def test_a_group_whose_name_does_not_exist_is_refused_and_one_with_no_address_is_not(
    autojump_clock: trio.abc.Clock,
) -> None:
    """As the operations guide says: a reload that brings a group whose host cannot be
    resolved is refused, NXDOMAIN (most often a typo) included; a name that exists with
    no address (no pod ready) is a group with no engines yet."""
    async with open_live(["127.0.0.2"]) as live:
        state = live.router.state
        prefill = engine("p0", 8101, ["prefill"], **_SIM)
        typo = group(name="more", host="mroe.llm.svc")
        with pytest.raises(ConfigError) as err:
            await live.router.reload(fleet_doc(prefill, engine_groups=[group(), typo]), source="test")
        assert err.value.path == "$.engine_groups[1].host"
        assert err.value.reason == (
            "cannot resolve 'mroe.llm.svc': [Errno -2] the name does not exist (NXDOMAIN: Name or service not known)"
        )
        assert [c["path"] for c in live.router.fleet.changes if c["event"] == "rejected"] == ["$.engine_groups[1].host"]
        discovery = live.router.admin.handler.discovery  # type: ignore[attr-defined]
        assert "more" not in discovery.addresses and sorted(state.engines) == ["decode-127.0.0.2", "p0"]
        live.resolver.nodata.add("more.llm.svc")
        change = await live.router.reload(fleet_doc(prefill, engine_groups=[group(), group(name="more",
                                          host="more.llm.svc")]), source="test")  # fmt: skip
        assert change.empty and discovery.addresses["more"] == ()
        live.resolver.nodata.discard("more.llm.svc")
        live.resolver.names["more.llm.svc"] = ["127.0.0.3"]
        await trio.sleep(5.5)
        assert "more-127.0.0.3" in state.engines


async def test_a_group_whose_name_does_not_exist_at_start_is_refused_and_watched(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="narwhal.router.discovery")
    async with open_live(["127.0.0.2"], host="decod.llm.svc.cluster.local") as live:  # a typo
        state = live.router.state
        assert sorted(state.engines) == ["p0"] and not state.ready()
        [rejected] = [c for c in live.router.fleet.changes if c["event"] == "rejected"]
        assert (rejected["source"], rejected["path"]) == ("dns", "$.engine_groups[0].host")
        assert _logged(caplog) == [(logging.ERROR, "engine groups: cannot resolve 'decod.llm.svc.cluster.local': "
                                    "[Errno -2] the name does not exist (NXDOMAIN: Name or service not known) "
                                    "@ $.engine_groups[0].host")]  # fmt: skip
