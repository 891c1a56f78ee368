"""No engine input kills the router: what an engine sends that the router cannot use is
that engine's fault, through the whole router.

Each engine-facing surface gets values a faulty or hostile engine could send (``+Inf``
requests running, NaN, capacities that sum to zero, a start time that is no date; KV
events whose token ids are not integers, or a msgpack map keyed by an array; a
``/tokenize`` count that contradicts its ids): the router starts and keeps serving, the
fault is counted per engine and source (``narwhal_engine_bad_input_total``) and
logged sparingly, and the engine's view is dropped (its load report, its prefix view)
or, on the request path, its breaker counts the failure.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import pytest
import trio
import zmq

from narwhal.engines.badinput import BadInput
from narwhal.engines.kvevents import BlockStored, EventBatch, encode_batch, seq_bytes
from narwhal.testing.ports import free_port

from .routerkit import engine, fleet_doc, open_stack
from .test_kvevents import GUARD_S, until
from .test_prefix_placement import CACHING

Edit = Callable[[str], str]


def answering(edits: dict[tuple[str, str], Callable[[Any], Any]]) -> Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap`` for :func:`open_stack`: the answers of ``(engine, path)`` go through
    ``edits[(engine, path)]`` (the body text of ``/metrics``, the JSON of the others)
    before the router reads them; the table can change while the router runs."""

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await self.inner.handle_async_request(request)
            edit = edits.get((request.url.host.removesuffix(".test"), request.url.path))
            if edit is None or response.status_code != 200:
                return response
            body = await response.aread()
            await response.aclose()
            if request.url.path == "/metrics":
                return httpx.Response(200, text=edit(body.decode()))
            return httpx.Response(200, json=edit(json.loads(body)))

    return Wrapped


def gauge(name: str, value: str) -> Edit:
    """Every sample of ``name`` reads ``value``."""
    return lambda text: re.sub(rf"^({re.escape(name)}(?:{{[^}}]*}})?) \S+$", rf"\1 {value}", text, flags=re.M)


def second_core(text: str) -> str:
    """A second engine core whose cache_config_info reports minus the first one's capacity."""
    found = re.search(r'kv_cache_size_tokens="(\d+)"', text)
    assert found is not None
    return text.rstrip("\n") + (
        '\nvllm:kv_cache_usage_perc{engine="1",model_name="sim-llama"} 0.5\n'
        f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="1",'
        f'kv_cache_size_tokens="-{found.group(1)}"}} 1.0\n'
    )


UNUSABLE_METRICS = {
    # Before: OverflowError out of the prefix watch's first refresh: `narwhal serve` died at start.
    "inf running": gauge("vllm:num_requests_running", "+Inf"),
    # Before: ZeroDivisionError (a capacity-weighted mean over weights summing to 0).
    "capacities summing to zero": second_core,
    # Before: OverflowError from the profile binding's message (a start "date" of +Inf).
    "inf start time": gauge("process_start_time_seconds", "+Inf"),
    # Before: taken as they came (a NaN load, a NaN usage).
    "nan running": gauge("vllm:num_requests_running", "NaN"),
    "nan usage": gauge("vllm:kv_cache_usage_perc", "NaN"),
    "negative waiting": gauge("vllm:num_requests_waiting", "-3"),
    "usage above one": gauge("vllm:kv_cache_usage_perc", "7.5"),
}


def caching_doc(**sections: Any) -> dict[str, Any]:
    return fleet_doc(engine("p0", 8101, ["prefill"], **CACHING), engine("d0", 8102, ["decode"], **CACHING),
                     **sections)  # fmt: skip


def exposition(stack: Any) -> str:
    text: str = stack.router.metrics.exposition().decode()
    return text


@pytest.mark.parametrize("edit", list(UNUSABLE_METRICS.values()), ids=list(UNUSABLE_METRICS))
async def test_unusable_metrics_at_start_are_the_engines_fault(autojump_clock: trio.abc.Clock, edit: Edit) -> None:
    """p0's /metrics is unusable from the first answer on: the router starts (the load
    poll, the prefix watch and the profile binding all read it), serves, prices p0 by
    load only, counts the fault and warns of it once."""
    doc = caching_doc(server={"engine_load_poll_s": 1.0})
    edits = {("p0", "/metrics"): edit}
    async with open_stack(doc, priced=True, wrap=answering(edits)) as stack:
        state = stack.router.state
        await trio.sleep(25.0)  # 25 load polls, 2 prefix refreshes (at 0 and 10 s)
        resp = await stack.complete({"prompt": "a b c d", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert state.bad_input.counts[("p0", "metrics")] >= 25
        assert ("d0", "metrics") not in state.bad_input.counts
        assert state.placement.loads["p0"].engine_running == 0  # no report taken from it
        assert not state.prefix.enabled("p0") and state.prefix.enabled("d0")
        assert 'narwhal_engine_bad_input_total{engine="p0",source="metrics"}' in exposition(stack)
        if edit is UNUSABLE_METRICS["inf start time"]:
            assert state.placement.unbound["p0"].startswith("identity unavailable")  # type: ignore[attr-defined]


async def test_an_engine_whose_metrics_turn_unusable_loses_its_views_until_they_are_sound(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    doc = caching_doc(server={"engine_load_poll_s": 1.0})
    edits: dict[tuple[str, str], Callable[[Any], Any]] = {}
    with caplog.at_level(logging.WARNING, logger="narwhal.engines"):
        async with open_stack(doc, wrap=answering(edits)) as stack:
            state = stack.router.state
            edits[("p0", "/metrics")] = gauge("vllm:num_requests_running", "7")
            await trio.sleep(11.0)
            assert state.placement.loads["p0"].engine_running == 7 and state.prefix.enabled("p0")
            edits[("p0", "/metrics")] = gauge("vllm:num_requests_running", "+Inf")
            # Twenty polls, one refresh (an engine sent no request is read 20 s after the
            # read before): dropped at the first of each.
            await trio.sleep(20.0)
            assert state.placement.loads["p0"].engine_running == 0 and not state.prefix.enabled("p0")
            assert state.bad_input.counts[("p0", "metrics")] >= 21
            resp = await stack.complete({"prompt": "a b c d", "max_tokens": 3})
            assert resp.status_code == 200
            edits[("p0", "/metrics")] = gauge("vllm:num_requests_running", "2")
            await trio.sleep(11.0)
            assert state.placement.loads["p0"].engine_running == 2 and state.prefix.enabled("p0")
    # Logged once per minute, not once per poll.
    warnings = [r.getMessage() for r in caplog.records if r.name == "narwhal.engines"]
    assert len(warnings) == 1 and warnings[0].startswith("engine p0: unusable metrics: vllm:num_requests_running")


# ------------------------------------------------------------------ /tokenize and /v1/models


def tokenize_doc(*producers: str) -> dict[str, Any]:
    return fleet_doc(*(engine(p, 8101 + i, ["prefill"]) for i, p in enumerate(producers)),
                     engine("d0", 8109, ["decode"]), controller={"prompt_tokens": "tokenize"})  # fmt: skip


UNTRUSTED_COUNTS: dict[str, Callable[[Any], Any]] = {
    # Before: the count was trusted: every request was a context-length 400, never counted
    # against the engine.
    "count contradicting its ids": lambda obj: {**obj, "count": 10**6},
    "count alone, beyond the prompt": lambda obj: {**obj, "count": 10**6, "tokens": None},
    "max_model_len of zero": lambda obj: {**obj, "max_model_len": 0},
    "ids that are not token ids": lambda obj: {**obj, "tokens": ["x"] * obj["count"]},
}


@pytest.mark.parametrize("edit", list(UNTRUSTED_COUNTS.values()), ids=list(UNTRUSTED_COUNTS))
async def test_a_tokenize_answer_that_cannot_be_trusted_is_the_producers_fault(
    autojump_clock: trio.abc.Clock, edit: Callable[[Any], Any]
) -> None:
    edits = {("p0", "/tokenize"): edit}
    async with open_stack(tokenize_doc("p0"), wrap=answering(edits)) as stack:
        resp = await stack.complete({"prompt": "a b c d", "max_tokens": 3})
        assert resp.status_code == 502, resp.text
        assert resp.json()["error"]["type"] == "engine_error"
        [record] = stack.records
        assert record["terminal_class"] == "prefill_failed" and "unusable answer" in record["error"]
        state = stack.router.state
        assert state.breaker.states["p0"].streak == 1
        assert state.bad_input.counts[("p0", "tokenize")] == 1
    # With another producer, the request is counted there.
    async with open_stack(tokenize_doc("p0", "p1"), wrap=answering(edits)) as stack:
        state = stack.router.state
        state.placement.loads["p1"].prefill_tokens = 1  # p0 is asked first
        resp = await stack.complete({"prompt": "a b c d", "max_tokens": 3})
        state.placement.loads["p1"].prefill_tokens = 0
        assert resp.status_code == 200, resp.text
        # Counted against p0 (whose prefill, placed afterwards, then succeeded).
        assert (state.breaker.states["p0"].last_error or "").startswith("tokenize: engine p0 sent an unusable answer")
        assert state.bad_input.counts[("p0", "tokenize")] == 1 and ("p1", "tokenize") not in state.bad_input.counts


async def test_a_models_listing_with_an_unusable_limit_is_taken_without_it(autojump_clock: trio.abc.Clock) -> None:
    """Before: a max_model_len of 0 in one engine's /v1/models was the model's limit: every
    request a context-length 400."""

    def zero(obj: Any) -> Any:
        return {**obj, "data": [{**m, "max_model_len": 0} for m in obj["data"]]}

    async with open_stack(fleet_doc(), wrap=answering({("d0", "/v1/models"): zero})) as stack:
        state = stack.router.state
        assert state.models == {"sim-llama": 4096}  # p0's
        resp = await stack.complete({"prompt": "a b c d", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert state.bad_input.counts[("d0", "models")] >= 1


# ------------------------------------------------------------------ KV events


def _stored(tokens: list[Any], *, block_size: Any = 2, hashes: list[Any] | None = None) -> bytes:
    event = {"type": "BlockStored", "block_hashes": hashes if hashes is not None else [7], "parent_block_hash": None,
             "token_ids": tokens, "block_size": block_size}  # fmt: skip
    return msgpack.packb([1.0, [event], 0])  # type: ignore[no-any-return]


HOSTILE_BATCHES = [
    _stored(["x", "y"]),  # before: ValueError
    _stored([None, None]),  # before: TypeError
    _stored([math.inf, 1]),  # before: OverflowError
    b"\x92\xcb\x3f\xf0" + b"\x00" * 6 + b"\x91\x81\x91\x01\x01",  # [1.0, [{[1]: 1}]]: before, TypeError
    _stored([1, 2], block_size=0),  # before: a view whose lookups divide by its block size
    _stored([-5, 1]),
    _stored([1, 2], hashes=[[1]]),
]


async def test_a_hostile_publisher_in_bind_mode_cannot_kill_the_router() -> None:
    """In bind mode anyone who reaches the port can publish: every hostile batch is
    malformed (the view dropped, the fault counted), and the router serves on."""
    address = f"tcp://127.0.0.1:{free_port()}"
    doc = fleet_doc({**engine("p0", 8101, ["prefill"], **CACHING), "kv_events": {"bind": address}},
                    engine("d0", 8102, ["decode"]))  # fmt: skip
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        with trio.fail_after(GUARD_S):
            async with open_stack(doc) as stack:
                state = stack.router.state
                sub = state.kv_subscribers["p0"]
                pub.connect(address)
                seq = 0
                while sub.live == 0:  # the connection is made on ZeroMQ's time
                    pub.send_multipart([b"", seq_bytes(seq), HOSTILE_BATCHES[0]])
                    seq += 1
                    await trio.sleep(0.01)
                for payload in HOSTILE_BATCHES:
                    pub.send_multipart([b"", seq_bytes(seq), payload])
                    seq += 1
                good = BlockStored(block_hashes=(9,), parent_block_hash=None, token_ids=tuple(range(16)), block_size=16)
                pub.send_multipart([b"", seq_bytes(seq), encode_batch(EventBatch(1.0, (good,), 0))])
                await until(lambda: sub.delivered)
                # Every message received but the last (some sent before the connection was made are lost).
                assert sub.malformed == sub.live - 1 >= len(HOSTILE_BATCHES)
                assert state.bad_input.counts[("p0", "kv_events")] == sub.malformed
                assert len(state.prefix.views["p0"]) == 1  # the good batch, after the resets
                resp = await stack.complete({"prompt": "a b c d", "max_tokens": 3})
                assert resp.status_code == 200
                assert 'narwhal_engine_bad_input_total{engine="p0",source="kv_events"}' in exposition(stack)
    finally:
        pub.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------ the log


def test_bad_input_is_counted_every_time_and_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    bad = BadInput(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="narwhal.engines"):
        for t in (0.0, 1.0, 59.0, 60.0, 61.0, 130.0):
            now[0] = t
            bad.report("p0", "metrics", f"bad at {t:g}")
        bad.report("p0", "kv_events", "other source")
        bad.report("d0", "metrics", "other engine")
    assert bad.counts == {("p0", "metrics"): 6, ("p0", "kv_events"): 1, ("d0", "metrics"): 1}
    assert bad.total() == 8 and bad.total("p0") == 7 and bad.total(source="metrics") == 7
    assert [r.getMessage() for r in caplog.records] == [
        "engine p0: unusable metrics: bad at 0",
        "engine p0: unusable metrics: bad at 60 (2 more since the last warning)",
        "engine p0: unusable metrics: bad at 130 (1 more since the last warning)",
        "engine p0: unusable kv_events: other source",
        "engine d0: unusable metrics: other engine",
    ]


def test_a_sparse_log_remembers_a_bounded_number_of_keys(caplog: pytest.LogCaptureFixture) -> None:
    from narwhal.logs import MAX_KEYS, SparseLog

    log = SparseLog(logging.getLogger("narwhal.test.sparse"), 60.0, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="narwhal.test.sparse"):
        assert log.warning("first", "k %s", "first") and not log.warning("first", "k %s", "again")
        for i in range(3 * MAX_KEYS):  # keys a peer makes up
            log.warning(i, "k %s", i)
        assert len(log._quiet_until) <= MAX_KEYS and len(log._unlogged) <= MAX_KEYS
        # The oldest key was forgotten: it logs again at once, without its count.
        assert log.warning("first", "k %s", "back")
    assert caplog.records[-1].getMessage() == "k back"


def test_without_orjson_json_nested_too_deeply_is_a_value_error() -> None:
    """The stdlib fallback raises RecursionError for deep nesting: every reader of engine
    JSON catches ValueError, as orjson raises it."""
    from narwhal.engines.sse import _stdlib_loads

    with pytest.raises(ValueError, match="JSON nested too deeply"):
        _stdlib_loads(b"[" * 100_000)
    assert _stdlib_loads(b'{"a": [1]}') == {"a": [1]}
