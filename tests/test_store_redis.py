"""Limits and fair shares fleet-wide, through a real ``redis-server`` (tenancy.store).

The tests that need a server start one of their own on a free loopback port and skip,
saying why, when ``redis-server`` is not installed (``apt-get install redis-server``).
They run on the real clock: the store keeps time itself (``TIME``).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from narwhal.config import FleetConfig, parse_fleet
from narwhal.errors import RateLimited, Refused
from narwhal.router.admission import Admission, Ticket
from narwhal.router.placement import Placement
from narwhal.router.store import RedisClient, SharedLimits, StoreUnavailable

from .routerkit import fleet_doc, open_stack

REDIS = shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh redis-server on a free loopback port, stopped after the test."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): the shared store's tests need one")
    port = _free_port()
    proc = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        give_up = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > give_up or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def config(url: str, limits: dict[str, Any], **store: Any) -> FleetConfig:
    return parse_fleet(fleet_doc(
        server={"api_keys": [{"key": "sk-a", "name": "a"}]},
        tenancy={"classes": [{"name": "batch", "wait": True, "slo": {"ttft_s": 5.0}}],
                 "tenants": [{"name": "a", "latency_class": "batch", "limits": limits}],
                 "store": {"url": url, "timeout_s": 1.0, "sync_s": 0.05, **store}, "replicas": 2},
    ))  # fmt: skip


def admission(cfg: FleetConfig) -> Admission:
    assert cfg.tenancy is not None and cfg.tenancy.store is not None
    return Admission(cfg, Placement(["p0"], ["d0"]), store=SharedLimits(cfg.tenancy.store))


def ticket(adm: Admission) -> Ticket:
    return adm.ticket(lambda name: None, "a", {})


async def test_two_routers_share_one_in_flight_limit(redis_url: str) -> None:
    cfg = config(redis_url, {"max_in_flight": 1})
    one, two = admission(cfg), admission(cfg)
    first = ticket(one)
    await one.admit(first, 10, 10)
    with pytest.raises(RateLimited, match=r"^tenant a is over its max_in_flight limit$"):
        await two.admit(ticket(two), 10, 10)  # the fleet's one place, not each router's share
    await one.release(first, 10, 10)
    again = ticket(two)
    await two.admit(again, 10, 10)
    await two.release(again, 10, 10)
    for adm in (one, two):
        assert adm.store is not None
        await adm.store.aclose()


async def test_two_routers_share_one_request_rate(redis_url: str) -> None:
    cfg = config(redis_url, {"requests_per_s": 2.0})
    one, two = admission(cfg), admission(cfg)
    await one.admit(ticket(one), 1, 1)
    await two.admit(ticket(two), 1, 1)
    with pytest.raises(RateLimited) as info:
        await one.admit(ticket(one), 1, 1)
    assert 0 < info.value.retry_after_s <= 0.5
    for adm in (one, two):
        assert adm.store is not None
        await adm.store.aclose()


async def test_a_lapsed_lease_gives_its_place_back(redis_url: str) -> None:
    store = SharedLimits(config(redis_url, {}).tenancy.store)  # type: ignore[union-attr]
    limits = config(redis_url, {"max_in_flight": 1}).tenancy.tenants[0].limits  # type: ignore[union-attr]
    # A router that died holding its lease: the lease lapses at its deadline.
    assert await store.admit("a", limits, 1, "dead-router-1", 0.0001) == (0.0, "")
    wait, which = await store.admit("a", limits, 1, "live-1", 60.0)
    assert (wait, which) == (0.0, "")
    assert (await store.admit("a", limits, 1, "live-2", 60.0))[1] == "max_in_flight"
    await store.aclose()


async def test_fair_shares_are_the_fleets(redis_url: str) -> None:
    cfg = config(redis_url, {})
    one, two = admission(cfg), admission(cfg)
    async with trio.open_nursery() as nursery:
        await nursery.start(one.run)
        await nursery.start(two.run)
        one._charge(ticket(one), 3000)
        two._charge(ticket(two), 1000)
        with trio.fail_after(5):
            while one.served["a"] != 4000 or two.served["a"] != 4000:  # noqa: ASYNC110 (the store, not an event, tells)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    for adm in (one, two):
        assert adm.store is not None
        await adm.store.aclose()


async def test_scripts_load_again_after_the_store_forgets_them(redis_url: str) -> None:
    client = RedisClient(redis_url, timeout_s=1.0)
    store = SharedLimits(config(redis_url, {}).tenancy.store, client=client)  # type: ignore[union-attr]
    assert await store.exchange_served({"a": 1.5}) == {"a": 1.5}
    assert await client.call("SCRIPT", "FLUSH") == "OK"  # a restarted store
    assert await store.exchange_served({"a": 1.0}) == {"a": 2.5}
    await store.aclose()


async def test_a_router_with_a_store_answers_429_for_the_fleet(redis_url: str) -> None:
    doc = fleet_doc(
        server={"api_keys": [{"key": "sk-a", "name": "a"}]},
        tenancy={"classes": [{"name": "batch", "wait": True, "slo": {"ttft_s": 5.0}}],
                 "tenants": [{"name": "a", "latency_class": "batch", "limits": {"max_in_flight": 1}}],
                 "store": {"url": redis_url, "timeout_s": 1.0}, "replicas": 4},
    )  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        other = admission(stack.config)  # another replica, holding the tenant's one place
        held = ticket(other)
        await other.admit(held, 1, 1)
        refused = await stack.complete({"prompt": "hi", "max_tokens": 2}, headers={"authorization": "Bearer sk-a"})
        await other.release(held, 1, 1)
        served = await stack.complete({"prompt": "hi", "max_tokens": 2}, headers={"authorization": "Bearer sk-a"})
        assert other.store is not None
        await other.store.aclose()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == "tenant a is over its max_in_flight limit"
    assert served.status_code == 200


# ------------------------------------------------------------------ outages (no server needed)


def _closed_port_url() -> str:
    return f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there


async def test_an_unreachable_store_fails_open_to_the_local_share(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    adm = admission(config(_closed_port_url(), {"requests_per_s": 4.0}))
    await adm.admit(ticket(adm), 1, 1)
    await adm.admit(ticket(adm), 1, 1)
    with pytest.raises(RateLimited, match=r"over its requests_per_s limit \(this router's share: 1/2\)"):
        await adm.admit(ticket(adm), 1, 1)  # 4/s over tenancy.replicas 2
    assert not adm.store_ok
    assert caplog.text.count("limits store unreachable: tenants limited by this process's share") == 1


async def test_an_unreachable_store_fails_closed_when_told_to() -> None:
    adm = admission(config(_closed_port_url(), {"requests_per_s": 4.0}, on_outage="refuse"))
    with pytest.raises(Refused, match=r"^the limits store is unreachable \(tenancy.store.on_outage: refuse\)") as info:
        await adm.admit(ticket(adm), 1, 1)
    assert info.value.http_status == 503 and info.value.retry_after_s == 1.0


async def test_a_silent_store_times_out() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts, never answers
    port = listener.getsockname()[1]
    client = RedisClient(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    start = trio.current_time()
    with pytest.raises(StoreUnavailable, match=r"did not answer within 0.2 s"):
        await client.call("PING")
    assert trio.current_time() - start == pytest.approx(0.2, abs=0.1)
    await client.aclose()
    listener.close()


async def test_a_router_whose_store_is_down_fails_open_and_says_so(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    import httpx

    caplog.set_level(logging.WARNING)
    doc = fleet_doc(
        server={"api_keys": [{"key": "sk-a", "name": "a"}]},
        tenancy={"classes": [{"name": "batch", "wait": True, "slo": {"ttft_s": 5.0}}],
                 "tenants": [{"name": "a", "latency_class": "batch", "limits": {"requests_per_s": 10.0}}],
                 "store": {"url": _closed_port_url()}},
    )  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        for _ in range(2):
            out = await stack.complete({"prompt": "hi", "max_tokens": 2}, headers={"authorization": "Bearer sk-a"})
            assert out.status_code == 200  # admitted by this router's own share of the limit
        stack.net.listen("127.0.0.1", 8001, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            fleet = (await admin.get("/fleet")).json()
    assert fleet["tenancy"]["store"] == "unreachable"
    assert caplog.text.count("limits store unreachable") == 1  # when the outage starts, not per request


# ------------------------------------------------------------------ a store that answers nonsense


async def _answering(replies: list[bytes], task_status: trio.TaskStatus[int]) -> None:
    """A fake store on loopback: each command read is answered with the next of ``replies``."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    task_status.started(listener.getsockname()[1])
    sock, _ = await listener.accept()
    stream = trio.SocketStream(sock)
    with listener:
        async with stream:
            for reply in replies:
                await stream.receive_some(65536)
                await stream.send_all(reply)
            await trio.sleep_forever()


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (b"*1\r\n" * 5000 + b":1\r\n", "too large or nested too deep"),  # past any reply of the router's scripts
        (b"*100000000\r\n" + b":1\r\n" * 100_001, "too large or nested too deep"),  # more values than any holds
        (b"$99999999\r\n", r"^reply from the store too large$"),
        (b":twelve\r\n", "invalid literal"),
        (b"?\r\n", "unexpected reply from the store"),
        (b"+\xff\xfe\r\n", "can't decode"),
    ],
    ids=["nested", "endless-array", "huge-bulk", "not-a-number", "unknown-type", "not-utf8"],
)
async def test_a_store_that_answers_nonsense_costs_the_request_its_store_not_the_process(reply: bytes, why: str) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_answering, [reply])
        client = RedisClient(f"redis://127.0.0.1:{port}/0", timeout_s=5.0)
        with pytest.raises(StoreUnavailable, match=why):
            await client.call("PING")
        await client.aclose()
        nursery.cancel_scope.cancel()


async def test_the_limits_and_shares_take_only_finite_numbers_from_the_store() -> None:
    cfg = config("redis://127.0.0.1:1/0", {"requests_per_s": 1.0})
    limits = cfg.tenancy.tenants[0].limits if cfg.tenancy is not None else None
    assert limits is not None
    replies = [
        b"*3\r\n:0\r\n*0\r\n$14\r\nrequests_per_s\r\n",  # a wait that is no number
        b"*3\r\n:0\r\n$3\r\ninf\r\n$1\r\nx\r\n",  # an infinite wait
        b"*3\r\n:0\r\n$5\r\n1e300\r\n$1\r\nx\r\n",  # an endless one
        b"*6\r\n$1\r\na\r\n$3\r\nnan\r\n$1\r\nb\r\n$2\r\n-1\r\n$1\r\nc\r\n$3\r\n2.5\r\n",  # served totals
    ]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_answering, replies)
        shared = SharedLimits(cfg.tenancy.store if cfg.tenancy is not None and cfg.tenancy.store else None,  # type: ignore[arg-type]
                              client=RedisClient(f"redis://127.0.0.1:{port}/0", timeout_s=5.0))
        waits = [await shared.admit("a", limits, 10, "lease", 30.0) for _ in range(3)]
        served = await shared.exchange_served({"a": 1.0})
        await shared.aclose()
        nursery.cancel_scope.cancel()
    assert [w for w, _ in waits] == [1.0, 1.0, 3600.0]
    assert served == {"c": 2.5}


async def test_the_store_client_reads_each_kind_of_reply_to_its_bounds() -> None:
    from narwhal.router import store as module

    deepest = b"*1\r\n" * module.MAX_DEPTH + b":7\r\n"
    most = b"*%d\r\n" % (module.MAX_ITEMS - 1) + b":1\r\n" * (module.MAX_ITEMS - 1)
    cases: list[tuple[bytes, Any]] = [
        (b"$0\r\n\r\n", ""),
        (b"$-1\r\n", None),
        (b"*0\r\n", []),
        (b"*-1\r\n", None),
        (b"$5\r\nhello\r\n", "hello"),
        (b"*2\r\n+OK\r\n:-3\r\n", ["OK", -3]),
        (deepest, [[[[7]]]]),
        (most, [1] * (module.MAX_ITEMS - 1)),
    ]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_answering, [reply for reply, _ in cases] + [b"-ERR bad \xff\r\n"])
        client = RedisClient(f"redis://127.0.0.1:{port}/0", timeout_s=5.0)
        answers = [await client.call("PING") for _ in cases]
        with pytest.raises(module.RespError) as info:
            await client.call("PING")
        await client.aclose()
        nursery.cancel_scope.cancel()
    assert answers == [want for _, want in cases]
    assert str(info.value) == "ERR bad \ufffd"
    # One value more, or one level deeper, is refused.
    for reply in (b"*1\r\n" + deepest, b"*%d\r\n" % module.MAX_ITEMS + b":1\r\n" * module.MAX_ITEMS):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_answering, [reply])
            client = RedisClient(f"redis://127.0.0.1:{port}/0", timeout_s=5.0)
            with pytest.raises(StoreUnavailable, match=r"^reply from the store too large or nested too deep$"):
                await client.call("PING")
            await client.aclose()
            nursery.cancel_scope.cancel()
