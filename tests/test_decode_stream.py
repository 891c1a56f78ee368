"""DecodeStream and its helpers on a hand-fed reply: the stream termination rules, what
each error names (engine, leg, public message), what the stream records, lazy counting,
and closing (drain or not). tests/test_engine_client.py drives the same code through an
EngineClient; these pin every field and branch down (see tools/mutation.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.engines.sse import SSEDecoder, json_dumps
from narwhal.engines.stream import (
    DecodeStream,
    HttpxReply,
    check_kind,
    error_message,
    error_object,
    status_of,
    stream_error,
    truncate,
)
from narwhal.errors import (
    EmptyStream,
    EngineError,
    EngineProtocolError,
    EngineStreamError,
    StreamClosed,
)

DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + json_dumps(obj) + b"\n\n"


def token(ids: list[int], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    obj: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": finish, "token_ids": ids}],
    }
    if usage is not None:
        obj["usage"] = usage
    return event(obj)


class Reply:
    """An EngineReply fed from a list of body pieces (then an end, an error or a hang)."""

    def __init__(
        self,
        parts: list[bytes],
        *,
        then: BaseException | None = None,
        hang: bool = False,
        gap_s: float = 0.0,
        complete: bool = False,
    ) -> None:
        self.status = 200
        self.reason = "OK"
        self.headers: Mapping[str, str] = {"content-type": "text/event-stream"}
        self.parts = parts
        self.then = then
        self.hang = hang
        self.gap_s = gap_s
        self.complete = complete
        self.sent = 0
        self.closed = False
        self.body: AsyncIterator[bytes] = self._body()

    async def _body(self) -> AsyncIterator[bytes]:
        # (Like test_engine_client's ScriptedStream, but an EngineReply's own body: the
        # stream under test closes it.)
        for part in self.parts:
            if self.gap_s:
                await trio.sleep(self.gap_s)
            self.sent += 1
            yield part
        if self.then is not None:
            raise self.then
        if self.hang:
            await trio.sleep_forever()

    async def read(self) -> bytes:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.closed = True
        await self.body.aclose()  # type: ignore[attr-defined]

    def body_complete(self) -> bool:
        return self.complete


class Owner:
    name = "d0"
    public_name = "d0"

    def __init__(self) -> None:
        self.mapped: list[tuple[httpx.HTTPError, str | None]] = []
        self.bad: list[tuple[str, str]] = []

    def map_error(self, exc: httpx.HTTPError, leg: str | None) -> EngineError:
        self.mapped.append((exc, leg))
        return StreamClosed(f"mapped: {exc}", engine=self.name, leg=leg)

    def report_bad_input(self, source: str, reason: str) -> None:
        self.bad.append((source, reason))


def open_stream(reply: Reply, *, leg: str | None = "decode", **kwargs: Any) -> DecodeStream:
    return DecodeStream(
        reply,
        owner=Owner(),
        leg=leg,
        request_id="narwhal-1",
        kind="completions",
        prefill=None,
        opened_at=trio.current_time(),
        **kwargs,
    )


async def fails(stream: DecodeStream) -> BaseException:
    """Iterate until the stream raises; then it is finished (the next step ends it)."""
    with pytest.raises(Exception) as info:
        async for _ in stream:
            pass
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    return info.value


# ------------------------------------------------------------------- helpers


def test_truncate() -> None:
    assert truncate("a  b\n c") == "a b c"
    assert truncate("abcde", 5) == "abcde"
    assert truncate("abcdef", 5) == "abcd…"
    assert len(truncate("x" * 600)) == 500 and truncate("x" * 600).endswith("x…")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "engine overloaded", "code": 503}}', "engine overloaded"),
        (b'{"error": "engine overloaded"}', "engine overloaded"),
        (b'{"error": {"message": 7}, "message": "top level"}', "top level"),
        (b'{"message": "top level"}', "top level"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b'{"detail": [{"loc": ["body"], "msg": "bad"}]}', "[{'loc': ['body'], 'msg': 'bad'}]"),
        (b'{"detail": null}', '{"detail": null}'),
        (b'{"other": 1}', '{"other": 1}'),
        (b"Bad Gateway\n", "Bad Gateway"),
        (b"bad \xff byte", "bad \ufffd byte"),
        (b"", "HTTP 502"),
        (b'{"error": {"message": ""}}', "HTTP 502"),
    ],
)
def test_error_message_shapes(body: bytes, message: str) -> None:
    assert error_message(body, "HTTP 502") == message


def test_error_object() -> None:
    assert error_object({"error": {"message": "m", "code": 400}}) == {"message": "m", "code": 400}
    assert error_object({"error": "m"}) == {"message": "m"}
    assert error_object({"object": "error", "message": "m", "code": 400}) == {
        "message": "m",
        "code": 400,
    }
    assert error_object({"object": "text_completion"}) is None
    assert error_object(["error"]) is None


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (400, 400),
        (399, 500),
        (599, 599),
        (600, 500),
        (503, 503),
        ("503", 500),
        (None, 500),
        (True, 500),
    ],
)
def test_status_of(code: Any, status: int) -> None:
    assert status_of({"code": code}) == status


def test_stream_error() -> None:
    err = stream_error(
        {"message": "kv  transfer\nfailed", "code": 503}, 503, engine="d0", leg="decode"
    )
    assert isinstance(err, EngineStreamError)
    assert str(err) == "engine d0 reported an error: kv transfer failed"
    assert err.upstream_status == 503 and err.error == {
        "message": "kv  transfer\nfailed",
        "code": 503,
    }
    assert (err.engine, err.leg) == ("d0", "decode")
    for error in ({}, {"message": ""}, {"message": 7}):
        assert str(stream_error(error, 500, engine="d0", leg=None)) == (
            "engine d0 reported an error: error object in the stream"
        )


def test_check_kind() -> None:
    assert check_kind("completions") == "completions"
    assert check_kind("chat") == "chat"
    with pytest.raises(ValueError, match=r"kind must be 'completions' or 'chat', not 'embeddings'"):
        check_kind("embeddings")


# ------------------------------------------------------------------- the stream


async def test_a_stream_records_what_arrived(autojump_clock: trio.abc.Clock) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    parts = [
        token([1]),
        event({"choices": [], "usage": None}),
        token([2, 3], finish="length"),
        event({"choices": [], "usage": usage}),
        DONE,
    ]
    reply = Reply(parts, gap_s=1.0)
    start = trio.current_time()
    stream = open_stream(reply)
    assert (stream.engine, stream.leg, stream.request_id, stream.kind) == (
        "d0",
        "decode",
        "narwhal-1",
        "completions",
    )
    assert stream.prefill is None and stream.status == 200 and stream.headers is reply.headers
    assert (
        stream.opened_at == start
        and stream.headers_at == start
        and stream.last_activity_at == start
    )
    assert stream.first_token_at is None and stream.last_token_at is None
    assert stream.finish_reason is None and stream.usage is None
    assert stream.tokens == 0 and stream.done is False and stream.closed is False
    chunks = [c async for c in stream]
    assert [c.kind for c in chunks] == ["token", "meta", "token", "meta"]
    assert chunks[0].token_ids == (1,) and chunks[2].token_ids == (2, 3)  # parsed: not lazy
    assert stream.tokens == 3 and stream.done is True
    assert stream.first_token_at == start + 1.0 and stream.last_token_at == start + 3.0
    assert stream.last_activity_at == start + 5.0
    assert stream.finish_reason == "length" and stream.usage == usage
    with pytest.raises(StopAsyncIteration):  # finished at [DONE]: nothing more is read
        await stream.__anext__()
    assert reply.sent == 5
    await stream.aclose()
    assert stream.closed is True and reply.closed


async def test_usage_and_finish_reason_on_a_token_event() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    stream = open_stream(Reply([token([1], usage=usage), token([2], finish="stop"), DONE]))
    chunks = [c async for c in stream]
    assert len(chunks) == 2
    assert stream.usage == usage and stream.finish_reason == "stop"


async def test_a_finish_reason_on_an_event_without_tokens() -> None:
    finish = event(
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "token_ids": []}]}
    )
    stream = open_stream(Reply([token([1]), finish, DONE]))
    chunks = [c async for c in stream]
    assert [c.kind for c in chunks] == ["token", "meta"]
    assert stream.finish_reason == "stop" and stream.tokens == 1


async def test_a_meta_event_keeps_the_earlier_finish_reason() -> None:
    stream = open_stream(
        Reply([token([1], finish="stop"), event({"choices": [], "usage": None}), DONE])
    )
    [_ async for _ in stream]
    assert stream.finish_reason == "stop" and stream.usage is None


async def test_lazy_stream_counts_a_burst_of_token_events_as_one_chunk() -> None:
    burst = token([1]) + token([2, 3])
    mixed = token([4]) + b": keep-alive\n\n"
    last = token([5], finish="length")
    stream = open_stream(Reply([burst, mixed, last, DONE]), lazy=True)
    chunks = [c async for c in stream]
    # The burst: one chunk, relayed as it came.
    assert (chunks[0].kind, chunks[0].raw, chunks[0].data, chunks[0].token_ids, chunks[0].count) == (
        "token", burst, None, (), 3
    )  # fmt: skip
    # A token event of the usual shape beside a comment: counted, not parsed.
    assert (chunks[1].kind, chunks[1].data, chunks[1].token_ids, chunks[1].count) == (
        "token",
        None,
        (),
        1,
    )
    # Any other event is parsed.
    assert chunks[2].token_ids == (5,) and chunks[2].finish_reason == "length"
    assert len(chunks) == 3 and stream.tokens == 5 and stream.finish_reason == "length"


async def test_lazy_stream_splits_a_burst_that_ends_the_stream() -> None:
    # Tokens, the finishing event and [DONE] in one read: the tokens are one chunk,
    # relayed as they came; the finishing event is parsed.
    run = token([1]) + token([2, 3])
    last = token([4], finish="length")
    stream = open_stream(Reply([run + last + DONE]), lazy=True)
    chunks = [c async for c in stream]
    assert (chunks[0].kind, chunks[0].raw, chunks[0].data, chunks[0].count) == ("token", run, None, 3)
    assert chunks[1].token_ids == (4,) and chunks[1].finish_reason == "length"
    assert len(chunks) == 2 and stream.tokens == 4 and stream.done and stream.finish_reason == "length"


async def test_done_before_any_token_is_an_empty_stream() -> None:
    stream = open_stream(Reply([event({"choices": []}), DONE]), leg="probe")
    err = await fails(stream)
    assert isinstance(err, EmptyStream)
    assert (err.engine, err.leg) == ("d0", "probe") and stream.done


async def test_an_error_object_in_the_stream() -> None:
    error = {"message": "kv transfer failed", "code": 503}
    stream = open_stream(Reply([token([1]), event({"error": error}), DONE]), leg="probe")
    err = await fails(stream)
    assert isinstance(err, EngineStreamError)
    assert err.upstream_status == 503 and err.error == error
    assert (err.engine, err.leg) == ("d0", "probe")
    assert str(err) == "engine d0 reported an error: kv transfer failed"
    assert not stream.done and stream.tokens == 1


async def test_a_malformed_event() -> None:
    stream = open_stream(Reply([token([1]), b"data: {oops\n\n", DONE]), leg="probe")
    err = await fails(stream)
    assert type(err) is EngineProtocolError
    assert str(err).startswith("engine d0 sent a malformed stream event: stream event is not JSON")
    assert err.public_message == "engine d0 sent a malformed stream event"
    assert (err.engine, err.leg) == ("d0", "probe")


async def test_an_unusable_event_stream() -> None:
    stream = open_stream(Reply([token([1]), b"data: " + b"x" * 100, DONE]), leg="probe")
    # A small bound on the stream's own decoder.
    stream._decoder = SSEDecoder(max_event_bytes=64)
    err = await fails(stream)
    assert type(err) is EngineProtocolError
    assert (
        str(err)
        == "engine d0 sent an unusable event stream: event stream event larger than 64 bytes"
    )
    assert err.public_message == "engine d0 sent an unusable event stream"
    assert (err.engine, err.leg) == ("d0", "probe")


async def test_the_body_ends_before_done() -> None:
    # The last event is complete but unterminated: it still counts, then the end is an error.
    stream = open_stream(Reply([token([1]) + token([2])[:-2]]), leg="probe")
    chunks = []
    with pytest.raises(StreamClosed) as info:
        async for chunk in stream:
            chunks.append(chunk)
    assert [c.token_ids for c in chunks] == [(1,), (2,)]
    assert str(info.value) == "engine d0 closed the stream before data: [DONE] (after 2 tokens)"
    assert (info.value.engine, info.value.leg) == ("d0", "probe")
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_the_body_ends_in_the_middle_of_an_event() -> None:
    stream = open_stream(Reply([token([1]), token([2])[:20]]))
    err = await fails(stream)
    assert type(err) is StreamClosed
    assert str(err) == "engine d0 closed the stream before data: [DONE] (after 1 tokens)"


async def test_a_transport_error_is_mapped_by_the_owner() -> None:
    broken = httpx.ReadError("connection reset by peer")
    reply = Reply([token([1])], then=broken)
    stream = open_stream(reply, leg="probe")
    err = await fails(stream)
    assert str(err) == "mapped: connection reset by peer" and err.__cause__ is broken
    owner = stream._owner
    assert isinstance(owner, Owner) and owner.mapped == [(broken, "probe")]


async def test_a_cancelled_read_cannot_resume(autojump_clock: trio.abc.Clock) -> None:
    stream = open_stream(Reply([token([1]), token([2])], gap_s=5.0), leg="probe")
    with trio.move_on_after(1.0) as scope:
        await stream.__anext__()
    assert scope.cancelled_caught
    with pytest.raises(StreamClosed) as info:
        await stream.__anext__()
    assert str(info.value) == "the read from engine d0 was cancelled; the stream cannot resume"
    assert (info.value.engine, info.value.leg) == ("d0", "probe")
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


# ------------------------------------------------------------------- closing


async def test_closing_mid_stream_ends_the_iteration() -> None:
    reply = Reply([token([1]) + token([2])], hang=True)
    stream = open_stream(reply)
    await stream.__anext__()  # the second event is buffered
    assert stream.buffered
    await stream.aclose()
    assert stream.closed and reply.closed
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await stream.aclose()  # closing twice is harmless


TRAILER = [b"x" * 32768, b"x" * 32768, b"x", b"x", b"x"]


@pytest.mark.parametrize(
    ("drain", "until_done", "complete", "read_after_done"),
    [
        (True, True, False, 3),  # up to 64 KiB and then one more piece
        (False, True, False, 0),  # no drain asked
        (None, True, False, 0),  # nor by default
        (True, False, False, 0),  # no [DONE] yet: the body is not the stream's end
        (True, True, True, 0),  # the body is complete already
    ],
)
async def test_drain_after_done(
    autojump_clock: trio.abc.Clock,
    drain: bool | None,
    until_done: bool,
    complete: bool,
    read_after_done: int,
) -> None:
    parts = [token([1]), DONE] if until_done else [token([1]), token([2])]
    reply = Reply([*parts, *TRAILER], hang=True, complete=complete)
    stream = open_stream(reply)
    if until_done:
        [_ async for _ in stream]
    else:
        await stream.__anext__()
    sent = reply.sent
    start = trio.current_time()
    await (stream.aclose() if drain is None else stream.aclose(drain=drain))
    assert reply.sent - sent == read_after_done and reply.closed
    assert trio.current_time() == start  # no wait: the limit, not the 0.1 s bound, ended it


async def test_drain_is_bounded_in_time(autojump_clock: trio.abc.Clock) -> None:
    reply = Reply([token([1]), DONE, b": a", b": b"], hang=True)
    stream = open_stream(reply)
    [_ async for _ in stream]
    start = trio.current_time()
    await stream.aclose(drain=True)
    assert reply.sent == 4 and trio.current_time() == start + 0.1


async def test_drain_stops_at_the_end_of_the_body(autojump_clock: trio.abc.Clock) -> None:
    reply = Reply([token([1]), DONE, b": trailing\n\n"])
    stream = open_stream(reply)
    [_ async for _ in stream]
    start = trio.current_time()
    await stream.aclose(drain=True)
    assert reply.sent == 3 and trio.current_time() == start


# ------------------------------------------------------------------- httpx replies


class Body(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            await trio.lowlevel.checkpoint()  # as a socket read takes one
            yield part

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()  # closing a socket takes a checkpoint
        self.closed = True


async def test_httpx_reply() -> None:
    body = Body([b"ab", b"cd"])
    reply = HttpxReply(httpx.Response(201, headers={"X-Thing": "1"}, stream=body))
    assert (reply.status, reply.reason, reply.headers["x-thing"]) == (201, "Created", "1")
    assert not reply.body_complete()
    assert await reply.read() == b"abcd"
    assert body.closed


async def test_httpx_reply_closes_under_cancellation() -> None:
    body = Body([b"ab", b"cd"])
    reply = HttpxReply(httpx.Response(200, stream=body))
    with trio.CancelScope() as scope:
        scope.cancel()
        await reply.aclose()
    assert body.closed
