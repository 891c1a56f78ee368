"""Property tests of every engine-facing parser: any input parses, or raises that engine's error.

One fuzz target per parser of engine data: ``/metrics`` (and the identity that reads
it), ``/tokenize``, ``/v1/models``, a prefill's completion (and its handoff
descriptor), the decode stream (and the router's non-streaming answer built from it),
and KV-event batches (and the prefix index they feed). The invariant is h11's: whatever
arrives either parses into values the router can compute with, or raises the engine's
error (an :class:`~narwhal.errors.EngineError`, a ``MalformedBatch``), never anything
else, and never hangs (every body is finite and small; the stream's event limit is
small). Each target runs a fixed number of examples, derandomized, so that the set is
deterministic and takes seconds.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import attrs
import httpx
import hypothesis.strategies as st
import msgpack
import trio
from hypothesis import HealthCheck, example, given, settings

from narwhal.config import EngineLimits
from narwhal.engines.client import EngineClient
from narwhal.engines.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
    MalformedBatch,
    decode_batch,
    encode_batch,
)
from narwhal.engines.metrics import LOAD_SAMPLES, MAX_CAPACITY, MAX_REQUESTS
from narwhal.errors import EngineError
from narwhal.router.prefix import PrefixIndex
from narwhal.router.requests import ResponseAccumulator, parse_request

from .test_engine_client import URL, Connector


def fuzz(n: int) -> Any:
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


# ------------------------------------------------------------------ values an engine could send

_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**400 // 10**390, 1e308]),
)  # fmt: skip
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, st.text(max_size=8))
_JSON = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)


def _json_text(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()  # NaN and Infinity as Python writes them


def client_answering(routes: dict[str, httpx.Response | Any], **limits: Any) -> EngineClient:
    """An engine client whose engine answers ``routes[path]`` (a response, or a JSON value)."""

    async def handle(request: httpx.Request) -> httpx.Response:
        answer = routes.get(request.url.path)
        if answer is None:
            return httpx.Response(404)
        if isinstance(answer, httpx.Response):
            return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)
        return httpx.Response(200, content=_json_text(answer), headers={"content-type": "application/json"})

    return EngineClient(URL, name="e0", model="m", connector=Connector(), transport=httpx.MockTransport(handle),
                        limits=EngineLimits(**{"max_response_bytes": 64 * 1024, "max_metrics_bytes": 64 * 1024,
                                               "max_stream_event_bytes": 4096, **limits}))  # fmt: skip


# ------------------------------------------------------------------ /metrics

_PROM_NUMBERS = st.one_of(
    _NUMBERS.map(repr), st.sampled_from(["+Inf", "-Inf", "NaN", "nan", "inf", "1e400", "-0", "1_0", "0x10", "", "None"]),
    st.text(max_size=6),
)  # fmt: skip
_LABEL_NAMES = st.sampled_from(["engine", "block_size", "kv_cache_size_tokens", "num_gpu_blocks",
                                "enable_prefix_caching", "model_name", "x"])  # fmt: skip
_LABELS = st.dictionaries(_LABEL_NAMES, st.one_of(_PROM_NUMBERS, st.sampled_from(["True", "False", "0", "1"])),
                          max_size=5)  # fmt: skip


@st.composite
def _prom_line(draw: st.DrawFn) -> str:
    name = draw(st.one_of(st.sampled_from(sorted(LOAD_SAMPLES)), st.text(alphabet="abc_:{} \"=", max_size=12)))
    labels = draw(_LABELS)
    body = ",".join(f'{k}="{v.replace(chr(92), "").replace(chr(34), "")}"' for k, v in labels.items())
    line = f"{name}{{{body}}} {draw(_PROM_NUMBERS)}" if labels else f"{name} {draw(_PROM_NUMBERS)}"
    return draw(st.one_of(st.just(line), st.just(line + " " + draw(_PROM_NUMBERS)), st.text(max_size=30)))


@st.composite
def _prom_page(draw: st.DrawFn) -> str:
    """The gauges narwhal reads, all present, one or two cores each, any values."""
    cores = draw(st.sampled_from([['engine="0"'], ['engine="0"', 'engine="1"'], [""]]))
    lines = [f"{name}{{{core}}} {draw(_PROM_NUMBERS)}" for name in
             ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc") for core in cores]
    for core in cores:
        labels = draw(_LABELS)
        body = ",".join([core, *(f'{k}="{v.replace(chr(92), "").replace(chr(34), "")}"' for k, v in labels.items()
                                 if k != "engine")]).strip(",")  # fmt: skip
        lines.append(f"vllm:cache_config_info{{{body}}} 1.0")
    lines.append(f"process_start_time_seconds {draw(_PROM_NUMBERS)}")
    lines += draw(st.lists(_prom_line(), max_size=3))
    return "\n".join(draw(st.permutations(lines)))


_PROM_TEXT = st.one_of(
    _prom_page(),
    _prom_page(),
    st.lists(_prom_line(), max_size=12).map("\n".join),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
)

#: What vLLM sends (one core, idle), for the named adversarial examples.
SANE = (
    'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
    'vllm:kv_cache_usage_perc{engine="0"} 0.0\nprocess_start_time_seconds 1.7e9\n'
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",kv_cache_size_tokens="4096"} 1.0\n'
)
ADVERSARIAL_METRICS = [
    SANE.replace("vllm:num_requests_running{engine=\"0\"} 0.0", "vllm:num_requests_running{engine=\"0\"} +Inf"),
    SANE.replace("vllm:num_requests_waiting{engine=\"0\"} 0.0", "vllm:num_requests_waiting{engine=\"0\"} NaN"),
    SANE.replace("vllm:kv_cache_usage_perc{engine=\"0\"} 0.0", "vllm:kv_cache_usage_perc{engine=\"0\"} NaN"),
    SANE.replace("1.7e9", "+Inf"),
    SANE.replace('block_size="16"', 'block_size="-16"'),
    SANE + 'vllm:kv_cache_usage_perc{engine="1"} 0.5\nvllm:cache_config_info{engine="1",kv_cache_size_tokens="-4096"} 1.0\n',
]


def _check_metrics(m: Any) -> None:
    assert type(m.running) is int and 0 <= m.running <= 100 * MAX_REQUESTS
    assert type(m.waiting) is int and 0 <= m.waiting <= 100 * MAX_REQUESTS
    assert 0.0 <= m.kv_usage <= 1.0
    assert m.kv_cache_size_tokens is None or (type(m.kv_cache_size_tokens) is int and m.kv_cache_size_tokens >= 0)
    assert m.block_size is None or (type(m.block_size) is int and 1 <= m.block_size <= MAX_CAPACITY)
    start = m.process_start_time
    assert start is None or (math.isfinite(start) and start >= 0)


def _examples(name: str, values: list[Any]) -> Any:
    def decorate(test: Any) -> Any:
        for value in reversed(values):
            test = example(**{name: value})(test)
        return test

    return decorate


@fuzz(200)
@given(text=_PROM_TEXT)
@_examples("text", ADVERSARIAL_METRICS)
async def test_any_metrics_answer_parses_or_is_the_engines_fault(text: str) -> None:
    async with client_answering({"/metrics": httpx.Response(200, text=text)}) as client:
        for read in (client.metrics, client.load):
            try:
                _check_metrics(await read())
            except EngineError as exc:
                assert exc.engine == "e0"
    # Whatever it holds, a router's prefix index can take what was read.
    index = PrefixIndex()
    try:
        async with client_answering({"/metrics": httpx.Response(200, text=text)}) as client:
            m = await client.load()
    except EngineError:
        return
    if m.block_size is not None:
        index.enable("e0", block_size=m.block_size, capacity_tokens=m.kv_cache_size_tokens or 0, events=False)
        index.cached_tokens("e0", list(range(64)))


@fuzz(100)
@given(version=_JSON, models=_JSON, text=_PROM_TEXT)
@example(version={"version": "1"}, models={"data": [{"id": "m", "max_model_len": 0}]}, text=SANE)
@example(version={"version": "1"}, models={"data": [{"id": "m"}]}, text=SANE.replace("1.7e9", "+Inf"))
@example(version={"version": "1"}, models={"data": [{"id": "m"}]}, text=SANE.replace("1.7e9", "1e300"))
async def test_any_identity_answers_give_an_identity_or_the_engines_fault(version: Any, models: Any, text: str) -> None:
    routes = {"/version": version, "/v1/models": models, "/metrics": httpx.Response(200, text=text)}
    async with client_answering(routes) as client:
        try:
            ident = await client.identity()
        except EngineError:
            return
    assert ident.version is None or isinstance(ident.version, str)
    assert ident.max_model_len is None or (type(ident.max_model_len) is int and ident.max_model_len >= 1)
    start = ident.process_start_time
    assert start is None or (math.isfinite(start) and start >= 0)
    hash(ident)  # an identity is compared and kept in sets


# ------------------------------------------------------------------ /tokenize and /v1/models

_TOKENIZE = st.one_of(
    _JSON,
    st.fixed_dictionaries({}, optional={
        "count": st.one_of(_NUMBERS, _JSON), "max_model_len": st.one_of(_NUMBERS, _JSON),
        "tokens": st.one_of(st.lists(st.integers(-2, 2**40), max_size=20), st.lists(_SCALARS, max_size=5), _JSON),
    }),
)  # fmt: skip


@fuzz(200)
@given(answer=_TOKENIZE, prompt=st.text(max_size=20))
@example(answer={"count": 10**6, "tokens": [1, 2], "max_model_len": 4096}, prompt="a b")
@example(answer={"count": 10**6, "max_model_len": 4096}, prompt="a b")
@example(answer={"count": 2, "tokens": ["x", None], "max_model_len": 4096}, prompt="a b")
@example(answer={"count": 2, "tokens": [1, 2], "max_model_len": 0}, prompt="a b")
@example(answer={"count": -1, "tokens": None}, prompt="a b")
async def test_any_tokenize_answer_is_a_count_to_trust_or_the_engines_fault(answer: Any, prompt: str) -> None:
    async with client_answering({"/tokenize": answer}) as client:
        try:
            tok = await client.tokenize(prompt)
        except EngineError:
            return
    assert type(tok.count) is int and 0 <= tok.count <= len(prompt.encode("utf-8", "replace")) + 4096
    assert all(type(t) is int and t >= 0 for t in tok.ids)
    assert not tok.ids or len(tok.ids) == tok.count
    assert tok.max_model_len is None or (type(tok.max_model_len) is int and tok.max_model_len >= 1)


_MODELS = st.one_of(
    _JSON,
    st.fixed_dictionaries({"data": st.one_of(_JSON, st.lists(st.one_of(_JSON, st.fixed_dictionaries(
        {"id": st.one_of(st.text(max_size=5), _JSON)}, optional={"max_model_len": st.one_of(_NUMBERS, _JSON)},
    )), max_size=6))}),
)  # fmt: skip


@fuzz(200)
@given(answer=_MODELS)
@example(answer={"data": [{"id": "m", "max_model_len": 0}]})
@example(answer={"data": [{"id": "m", "max_model_len": 1.5e3}]})
@example(answer={"data": [{"id": f"m{i}"} for i in range(5)]})
async def test_any_models_answer_lists_usable_entries_or_is_the_engines_fault(answer: Any) -> None:
    async with client_answering({"/v1/models": answer}, max_listed_models=4) as client:
        try:
            entries = await client.models()
        except EngineError:
            return
    assert len(entries) <= 4
    for entry in entries:
        assert isinstance(entry["id"], str)
        mml = entry.get("max_model_len")
        assert mml is None or (type(mml) is int and mml >= 1)


# ------------------------------------------------------------------ a prefill's completion

_DESCRIPTOR = st.fixed_dictionaries({}, optional={
    k: st.one_of(_JSON, st.just(v)) for k, v in {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]], "remote_engine_id": "x",
        "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 15600,
    }.items()
})  # fmt: skip
_COMPLETION = st.one_of(
    _JSON,
    st.fixed_dictionaries({"choices": st.one_of(_JSON, st.lists(st.one_of(_JSON, st.fixed_dictionaries(
        {}, optional={"finish_reason": st.one_of(st.just("length"), _JSON), "token_ids": _JSON,
                      "prompt_token_ids": _JSON},
    )), max_size=2))}, optional={"kv_transfer_params": st.one_of(_JSON, _DESCRIPTOR), "usage": _JSON}),
)  # fmt: skip


@fuzz(200)
@given(answer=_COMPLETION, transfer=st.booleans())
@example(answer={"choices": [{"finish_reason": "length"}], "usage": {"prompt_tokens": -5}}, transfer=False)
@example(answer={"choices": [{"finish_reason": "length"}],
                 "usage": {"prompt_tokens_details": {"cached_tokens": -1}}}, transfer=False)  # fmt: skip
@example(answer={"choices": "x"}, transfer=True)
async def test_any_prefill_answer_gives_a_handoff_or_the_engines_fault(answer: Any, transfer: bool) -> None:
    async with client_answering({"/v1/completions": answer}) as client:
        try:
            result = await client.prefill({"prompt": "a b", "max_tokens": 3}, transfer=transfer)
        except EngineError:
            return
    assert result.prompt_tokens is None or (type(result.prompt_tokens) is int and result.prompt_tokens >= 0)
    assert result.cached_tokens is None or (type(result.cached_tokens) is int and result.cached_tokens >= 0)
    json.dumps(dict(result.descriptor) if transfer else {}, default=list)


# ------------------------------------------------------------------ the decode stream

_EVENT_OBJECTS = st.one_of(
    _JSON,
    st.fixed_dictionaries({}, optional={
        "choices": st.one_of(_JSON, st.lists(st.one_of(_JSON, st.fixed_dictionaries({}, optional={
            "text": _JSON, "token_ids": st.one_of(st.lists(st.integers(-1, 99), max_size=3), _JSON),
            "finish_reason": _JSON, "delta": st.one_of(_JSON, st.fixed_dictionaries({}, optional={
                "content": _JSON, "reasoning_content": _JSON, "token_ids": _JSON})),
            "logprobs": _JSON, "prompt_token_ids": _JSON,
        })), max_size=2)),
        "usage": _JSON, "error": _JSON, "object": st.one_of(st.just("error"), _JSON),
    }),
)  # fmt: skip
_EVENTS = st.lists(
    st.one_of(
        _EVENT_OBJECTS.map(lambda o: b"data: " + _json_text(o) + b"\n\n"),
        st.sampled_from([b"data: [DONE]\n\n", b": keep-alive\n\n", b"event: x\nid: 1\ndata: {}\n\n", b"\r\n"]),
        st.binary(max_size=40),
        st.just(b"data: " + b"[" * 5000 + b"\n\n"),  # over the event limit
    ),
    max_size=8,
)


@fuzz(200)
@given(events=_EVENTS, cuts=st.lists(st.integers(0, 400), max_size=6), lazy=st.booleans(),
       kind=st.sampled_from(["completions", "chat"]))  # fmt: skip
@example(events=[b'data: {"choices": ["x"]}\n\n', b"data: [DONE]\n\n"], cuts=[], lazy=False, kind="completions")
@example(events=[b'data: {"choices": [{"token_ids": 5, "text": 7}]}\n\n'], cuts=[], lazy=False, kind="completions")
@example(events=[b'data: {"choices": [{"delta": [1], "token_ids": [1]}]}\n\n'], cuts=[], lazy=False, kind="chat")
@example(events=[b'data: {"choices": [{"delta": {"content": 5}, "token_ids": [1]}]}\n\n'], cuts=[], lazy=False,
         kind="chat")  # fmt: skip
@example(events=[b"data: " + b"[" * 100_000 + b"\n\n"], cuts=[], lazy=False, kind="completions")
async def test_any_decode_stream_gives_tokens_or_the_engines_fault(
    events: list[bytes], cuts: list[int], lazy: bool, kind: str
) -> None:
    raw = b"".join(events)
    points = sorted({min(c, len(raw)) for c in cuts})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True) if raw[a:b]]

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for piece in pieces:
                yield piece

    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Body())
    body = {"prompt": "a b", "max_tokens": 4} if kind == "completions" else {
        "messages": [{"role": "user", "content": "a b"}], "max_tokens": 4}  # fmt: skip
    parsed = parse_request(json.dumps(body).encode(), "completions" if kind == "completions" else "chat")
    acc = ResponseAccumulator(parsed, "req-1", "m")
    with trio.fail_after(10):
        async with client_answering({}) as client:
            client._open = _answering_with(response)  # type: ignore[method-assign]
            try:
                async with client.decode(None, body, kind=kind, lazy=lazy) as stream:  # type: ignore[arg-type]
                    async for chunk in stream:
                        assert chunk.count >= 0
                        acc.add(chunk.data)
            except EngineError as exc:
                assert exc.engine == "e0"
    # The router's non-streaming answer is built from what the stream gave: it serializes.
    json.dumps(acc.body(3))


def _answering_with(response: httpx.Response) -> Any:
    from narwhal.engines.stream import HttpxReply

    async def open_(*_: Any, **__: Any) -> HttpxReply:
        return HttpxReply(response)

    return open_


# ------------------------------------------------------------------ KV events


@attrs.frozen
class _Map:
    """A msgpack map whose keys may be anything (arrays, maps): what a hostile publisher can send."""

    items: tuple[tuple[Any, Any], ...]


def _pack(obj: Any) -> bytes:
    if isinstance(obj, _Map):
        return b"\xdf" + struct.pack(">I", len(obj.items)) + b"".join(_pack(k) + _pack(v) for k, v in obj.items)
    if isinstance(obj, list):
        return b"\xdd" + struct.pack(">I", len(obj)) + b"".join(_pack(v) for v in obj)
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


_MSG_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=6), st.binary(max_size=8),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU"]),
)  # fmt: skip
_MSG = st.recursive(
    _MSG_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.lists(st.tuples(inner, inner), max_size=2).map(
        lambda kv: _Map(tuple(kv))
    ),
    max_leaves=8,
)


@st.composite
def _event(draw: st.DrawFn) -> Any:
    """An event close to vLLM's shape, with any field any value."""
    fields = {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "New"]),
              "block_hashes": st.one_of(st.lists(st.integers(0, 2**64 - 1) | st.binary(max_size=4), max_size=4), _MSG),
              "parent_block_hash": st.one_of(st.none(), st.integers(0, 9), _MSG),
              "token_ids": st.one_of(st.lists(st.integers(0, 50), max_size=8), _MSG),
              "block_size": st.one_of(st.sampled_from([1, 2, 4, 0, -1]), _MSG),
              "lora_id": _MSG, "medium": _MSG, "lora_name": _MSG, "extra_keys": _MSG}  # fmt: skip
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
    items = {k: draw(fields[k]) for k in chosen}
    if draw(st.booleans()):  # the array-like form
        return [items.get("type", "BlockStored"), *(items.get(k) for k in sorted(fields) if k != "type")]
    return _Map(tuple(items.items()))


_PAYLOADS = st.one_of(
    st.binary(max_size=64),
    _MSG.map(_pack),
    st.tuples(st.one_of(st.floats(), _MSG), st.lists(_event(), max_size=4), _MSG).map(
        lambda t: _pack([t[0], t[1], t[2]])
    ),
    st.builds(lambda n: encode_batch(EventBatch(1.0, (BlockStored(
        block_hashes=tuple(range(n)), parent_block_hash=None, token_ids=tuple(range(2 * n)), block_size=2),
        BlockRemoved(block_hashes=(0,)), AllBlocksCleared()))), st.integers(0, 4)),
)  # fmt: skip


ADVERSARIAL_BATCHES = [
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": tokens, "block_size": 1}]])
    for tokens in (["x"], [None], [math.inf], [-1], [True])
] + [_pack([1.0, [_Map((([1], 1),))]]), _pack(_Map(((_Map(()), 1),))),
     msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]),
     msgpack.packb([math.nan, []]), msgpack.packb([1.0, [["BlockStored", [[1]], None, [1], 1]]])]  # fmt: skip


@fuzz(200)
@given(payloads=st.lists(_PAYLOADS, min_size=1, max_size=6))
@_examples("payloads", [[payload] for payload in ADVERSARIAL_BATCHES])
def test_any_kv_event_payload_is_a_batch_or_malformed_and_the_index_takes_it(payloads: list[bytes]) -> None:
    index = PrefixIndex()
    index.follow("e0")
    for payload in payloads:
        try:
            batch = decode_batch(payload)
        except MalformedBatch:
            continue
        assert math.isfinite(batch.ts)
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size >= 1 and all(type(t) is int and t >= 0 for t in event.token_ids)
                hash(event)
            if isinstance(event, BlockStored | BlockRemoved):
                assert all(isinstance(h, bytes) or type(h) is int for h in event.block_hashes)
        index.apply("e0", batch)
    index.enable("e0", block_size=2, capacity_tokens=64, events=True)
    index.cached_tokens("e0", list(range(8)))


@fuzz(100)
@given(payloads=st.lists(st.tuples(st.integers(0, 8), _PAYLOADS), min_size=1, max_size=6))
async def test_a_subscriber_takes_any_payload_without_raising(payloads: list[tuple[int, bytes]]) -> None:
    index = PrefixIndex()
    index.follow("e0")
    sub = KVEventSubscriber("tcp://127.0.0.1:1", name="e0", on_batch=lambda _s, b: index.apply("e0", b),
                            on_reset=lambda _why: index.reset("e0", events_only=True))  # fmt: skip
    for seq, payload in payloads:
        await sub._receive(seq, payload)
    assert sub.bad_input.total() == sub.malformed
