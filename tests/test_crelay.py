"""The token relay's C loop (``narwhal._crelay``) held to the Python path, byte for byte.

The loop forwards a read only when it is the plain case and hands any other read back
untouched for the stream's own code. So whatever it forwards must be exactly what the
Python path makes of the same read (de-chunked by the engine transport, scanned by the
SSE decoder, shaped by the request's :class:`StreamShaper`, framed for the client),
and it must forward the plain case itself (else it would cost more than it saves). The
inputs: vLLM's recorded token events, alone and in bursts, and hypothesis' mutations and
random bytes around them.
"""

from __future__ import annotations

import errno
import gc
import math
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from narwhal.engines.sse import SSEDecoder
from narwhal.engines.wire import _Body
from narwhal.errors import EngineProtocolError
from narwhal.router.requests import StreamShaper, parse_request

_crelay: Any = pytest.importorskip("narwhal._crelay")

RECORDED = (Path(__file__).parent.parent / "fixtures" / "completions-stream-token-ids.sse").read_bytes()
EVENTS = [e + b"\n\n" for e in RECORDED.split(b"\n\n") if e.startswith(b"data: {")]
TOKENS = [e for e in EVENTS if b'"finish_reason":null' in e]
MAX_EVENT = 1 << 20


class _Conn:
    def __init__(self) -> None:
        self.buf = bytearray()


def _shaper(return_token_ids: bool) -> StreamShaper:
    extra = b', "return_token_ids": true' if return_token_ids else b""
    return StreamShaper(parse_request(b'{"prompt": "x", "stream": true%s}' % extra, "completions"), "rid-7")


def _python(read: bytes, shaper: StreamShaper, chunked: bool) -> tuple[int, bytes] | None:
    """What the Python path forwards of ``read`` at a carried stream's state (nothing
    buffered, past the stream's first event), when it forwards it whole; else None."""
    body = _Body(None, _Conn(), length=None, chunked=True, keep_alive=True)  # type: ignore[arg-type]
    piece = body.feed(read)
    if body.ended or not piece:
        return None
    decoder = SSEDecoder(max_event_bytes=MAX_EVENT)
    decoder.feed(TOKENS[0])  # the first token, read before the stream is carried
    count, run, rest = decoder.feed_tokens(piece)
    if not count or rest:
        return None
    out = shaper(run)
    return count, (b"%x\r\n%b\r\n" % (len(out), out) if chunked else out)


def _c(read: bytes, shaper: StreamShaper, chunked: bool) -> tuple[int, bytes] | None:
    result: tuple[int, bytes] | None = _crelay.shape(read, shaper.id_prefix, shaper.strip_ids, chunked, MAX_EVENT)
    return result


def _chunks(events: list[bytes], sizes: list[int] | None = None) -> bytes:
    """``events`` as one chunk each (or their bytes cut in chunks of ``sizes``)."""
    if sizes is None:
        return b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)
    data, out = b"".join(events), []
    while data:
        size = max(1, sizes[len(out) % len(sizes)])
        out.append(b"%x\r\n%b\r\n" % (len(data[:size]), data[:size]))
        data = data[size:]
    return b"".join(out)


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("chunked", [True, False])
def test_the_plain_case_is_forwarded_as_the_python_path_forwards_it(return_token_ids: bool, chunked: bool) -> None:
    shaper = _shaper(return_token_ids)
    for events in ([TOKENS[1]], TOKENS[1:6], TOKENS):
        for read in (_chunks(events), _chunks(events, [7, 100, 3])):
            expected = _python(read, shaper, chunked)
            assert expected is not None and expected[0] == len(events)
            assert _c(read, shaper, chunked) == expected


@pytest.mark.parametrize(
    "read",
    [
        _chunks([EVENTS[-2]]),  # the finishing event
        _chunks([EVENTS[-1]]),  # usage
        _chunks([b"data: [DONE]\n\n"]),
        _chunks([TOKENS[1], EVENTS[-2]]),  # tokens, then the finishing event
        _chunks([TOKENS[1]]) + b"0\r\n\r\n",  # the body's last chunk
        _chunks([TOKENS[1]])[:-1],  # a chunk cut short
        _chunks([TOKENS[1][:40]]),  # an event cut short
        _chunks([TOKENS[1].replace(b"data: ", b"data:")]),  # another spacing
        _chunks([TOKENS[1].replace(b"\n\n", b"\r\n\r\n")]),
        _chunks([TOKENS[1].replace(b'{"id":"cmpl-', b'{"id": "cmpl-')]),  # not the compact id
        _chunks([TOKENS[1].replace(b'"cmpl-', b'"cm\\"pl-')]),  # an escaped quote in the id
        _chunks([b": keep-alive\n\n"]),
        b"1;ext=1\r\n" + TOKENS[1][:1] + b"\r\n",  # a chunk extension
        b"zz\r\n" + TOKENS[1] + b"\r\n",
    ],
)
def test_anything_else_is_handed_back(read: bytes) -> None:
    for shaper in (_shaper(False), _shaper(True)):
        assert _c(read, shaper, True) is None


@st.composite
def _reads(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(st.sampled_from([*EVENTS, b"data: [DONE]\n\n"]), min_size=1, max_size=6))
    edits = draw(st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=4), st.integers(0, 3)), max_size=3))
    raw = b"".join(events)
    for at, insert, cut in edits:
        at %= len(raw) + 1
        raw = raw[:at] + insert + raw[at + cut :]
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e] or [raw]
    sizes = draw(st.none() | st.lists(st.integers(1, 400), min_size=1, max_size=4))
    read = _chunks(events, sizes)
    if draw(st.booleans()):  # damage the framing too
        at = draw(st.integers(0, len(read)))
        read = read[:at] + draw(st.binary(max_size=3)) + read[at + draw(st.integers(0, 2)) :]
    return read


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(read=_reads() | st.binary(max_size=600), return_token_ids=st.booleans(), chunked=st.booleans())
@example(read=_chunks([TOKENS[2].replace(b'"token_ids":[', b'"token_ids":[ ')]), return_token_ids=False, chunked=True)
@example(read=_chunks([TOKENS[2].replace(b'"token_ids":[1774]', b'"token_ids":[17,74]')]), return_token_ids=False, chunked=True)
@example(read=_chunks([TOKENS[2].replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[1,2]')]), return_token_ids=False, chunked=True)
def test_what_the_c_loop_forwards_is_what_the_python_path_would(read: bytes, return_token_ids: bool, chunked: bool) -> None:
    shaper = _shaper(return_token_ids)
    got = _c(read, shaper, chunked)
    if got is not None:
        assert got == _python(read, shaper, chunked)


def test_a_read_too_long_for_an_event_is_handed_back() -> None:
    shaper = _shaper(False)
    read = _chunks(TOKENS[1:4])
    limit = len(b"".join(TOKENS[1:4]))
    assert _crelay.shape(read, shaper.id_prefix, False, True, limit) is not None
    assert _crelay.shape(read, shaper.id_prefix, False, True, limit - 1) is None


def test_the_shaped_bytes_carry_the_routers_id_and_no_token_ids() -> None:
    shaper = _shaper(False)
    got = _c(_chunks(TOKENS[1:3]), shaper, False)
    assert got is not None
    count, out = got
    assert count == 2
    assert re.findall(rb'"id":"([^"]*)"', out) == [b"cmpl-rid-7", b"cmpl-rid-7"]
    assert b"token_ids" not in out


# ---------------------------------------------------------------- the loop itself


class _Loop:
    """A C relay loop in a thread of its own, carrying jobs between socket pairs."""

    def __init__(self) -> None:
        self.relay = _crelay.Relay()
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=self.relay.run, daemon=True)
        self.thread.start()

    def adopt(self, *, silence_s: float = math.inf) -> tuple[Any, threading.Event, socket.socket, socket.socket]:
        """A job carrying from a fresh engine socket to a fresh client socket: the job, an
        event set when it is handed back, and the engine's and the client's far ends."""
        engine, src = socket.socketpair()
        dst, client = socket.socketpair()
        for sock in (src, dst):
            sock.setblocking(False)
        self.sockets += [engine, src, dst, client]
        back = threading.Event()
        shaper = _shaper(False)
        job = self.relay.adopt(
            src.fileno(), dst.fileno(), shaper.id_prefix, True, True, MAX_EVENT, silence_s, time.monotonic(), back.set
        )
        return job, back, engine, client

    def close(self) -> None:
        self.relay.close()
        self.thread.join(5)
        assert not self.thread.is_alive()
        for sock in self.sockets:
            sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(5)
    data = b""
    while len(data) < n:
        data += sock.recv(65536)
    return data


def test_the_loop_forwards_tokens_and_hands_back_the_rest_untouched() -> None:
    loop = _Loop()
    try:
        job, back, engine, client = loop.adopt()
        shaper = _shaper(False)
        read = _chunks(TOKENS[1:3])
        expected = _c(read, shaper, True)
        assert expected is not None
        engine.sendall(read)
        assert _read(client, len(expected[1])) == expected[1]
        assert not back.wait(0.05)
        rest = _chunks([EVENTS[-2], EVENTS[-1]])
        engine.sendall(rest)
        assert back.wait(5)
        assert (job.reason, job.raw, job.tokens, job.unsent) == (_crelay.RAW, rest, 2, b"")
        assert job.done and 0 < job.last_token <= job.last_activity <= time.monotonic()
    finally:
        loop.close()


def test_the_loop_hands_back_at_the_engines_end_a_silence_or_a_full_client() -> None:
    loop = _Loop()
    try:
        eof, eof_back, engine, _ = loop.adopt()
        engine.close()
        silent, silent_back, _, _ = loop.adopt(silence_s=0.05)
        full, full_back, full_engine, _ = loop.adopt()
        read = _chunks(TOKENS[1:20])
        for _ in range(2000):  # the client reads nothing: its socket fills
            if full_back.is_set():
                break
            full_engine.sendall(read)
            time.sleep(0.001)
        for event in (eof_back, silent_back, full_back):
            assert event.wait(5)
        assert eof.reason == _crelay.EOF and silent.reason == _crelay.SILENT
        assert full.reason == _crelay.UNSENT and full.unsent and full.tokens > 0
    finally:
        loop.close()


def test_a_released_job_comes_back_at_once_whether_or_not_the_loop_had_taken_it() -> None:
    loop = _Loop()
    try:
        for _ in range(50):
            job, back, _, _ = loop.adopt()
            loop.relay.release(job)
            assert back.wait(5)
            assert job.reason == _crelay.RELEASED
            loop.relay.release(job)  # again, once it is back: nothing happens
            del job
            gc.collect()
        carried, carried_back, _, _ = loop.adopt()
        time.sleep(0.05)  # taken by now
        loop.relay.release(carried)
        assert carried_back.wait(5) and carried.reason == _crelay.RELEASED
    finally:
        loop.close()


def test_closing_the_loop_hands_back_what_it_carries_and_takes_no_more() -> None:
    loop = _Loop()
    job, back, _, _ = loop.adopt()
    loop.close()
    assert back.is_set() and job.reason == _crelay.CLOSED
    shaper = _shaper(False)
    with pytest.raises(RuntimeError, match="the relay is closed"):
        loop.relay.adopt(0, 1, shaper.id_prefix, True, True, MAX_EVENT, 1.0, 0.0, back.set)


# ---------------------------------------------------------------- what the task makes of a hand-back


class _Owner:
    name = public_name = "d0"

    def __init__(self) -> None:
        self.bad: list[tuple[str, str]] = []

    def map_error(self, exc: Exception, leg: str | None) -> Exception:
        return RuntimeError(f"mapped: {exc}")

    def report_bad_input(self, source: str, reason: str) -> None:
        self.bad.append((source, reason))


class _Writer:
    chunked = True

    def frame(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data)


def _handed_back(reason: int, offset: float = 0.0, max_event_bytes: int = MAX_EVENT, **fields: Any) -> tuple[Any, Any]:
    """A carried stream the C loop handed back for ``reason`` (its job's ``fields``), settled
    by the relay as the task sees it: (the relay's job, the stream)."""
    from narwhal.engines.stream import DecodeStream
    from narwhal.engines.wire import WireResponse
    from narwhal.router.relay import Carried, TokenRelay

    conn = _Conn()
    body = _Body(None, conn, length=None, chunked=True, keep_alive=True)  # type: ignore[arg-type]
    response = WireResponse(200, "OK", {}, body)
    stream = DecodeStream(
        response, owner=_Owner(), leg="decode", request_id="r", kind="completions",  # type: ignore[arg-type]
        prefill=None, opened_at=0.0, lazy=True, max_event_bytes=max_event_bytes,
    )  # fmt: skip
    relay = TokenRelay(compiled=True)
    relay._offset = offset  # the loop's clock is the event loop's, less this
    job = Carried(stream, 5, 6, _Writer(), _shaper(False), math.inf)  # type: ignore[arg-type]
    job.compiled = SimpleNamespace(  # type: ignore[assignment]
        **{"tokens": 3, "last_token": 2.0, "last_activity": 2.5, "raw": b"", "unsent": b"", "errno": 0, **fields},
        reason=reason,
    )
    relay._settle(job)
    return job, stream


async def test_a_handed_back_read_is_taken_by_the_streams_own_code() -> None:
    # Tokens the C loop forwarded before, at the loop's clock plus the offset.
    now = trio.current_time() + 10.0  # (ahead of the stream's opening)
    job, stream = _handed_back(_crelay.EOF, now)
    assert (job.tokens, job.last_token_at, job.unsent) == (3, now + 2.0, b"")
    assert (stream.tokens, stream.last_token_at, stream.last_activity_at) == (3, now + 2.0, now + 2.5)
    # A token event whose id the C loop does not rewrite: the stream takes it, the task sends it.
    odd = TOKENS[1].replace(b'"cmpl-', b'"cm\\"pl-')
    job, stream = _handed_back(_crelay.RAW, now, raw=_chunks([odd]))
    assert job.tokens == 4 and job.last_token_at == stream.last_activity_at == now + 2.5
    assert job.unsent == _Writer().frame(_shaper(False)(odd)) and b"cmpl-rid-7" in job.unsent
    # Half an event: nothing to send yet; the rest completes it, for the task's next step.
    half = _chunks([TOKENS[1][:50]])
    job, stream = _handed_back(_crelay.RAW, now, raw=half)
    assert (job.tokens, job.unsent, stream.buffered) == (3, b"", False)
    assert stream.take(_chunks([TOKENS[1][50:]]), now + 3.0) == (-1, b"") and stream.buffered
    # The finishing event: queued for the task's next step.
    job, stream = _handed_back(_crelay.RAW, now, raw=_chunks([EVENTS[-2]]))
    assert (job.tokens, job.unsent, stream.buffered) == (3, b"", True)


async def test_the_other_hand_backs_reach_the_task() -> None:
    job, _ = _handed_back(_crelay.UNSENT, unsent=b"3\r\nabc\r\n")
    assert job.unsent == b"3\r\nabc\r\n"
    job, _ = _handed_back(_crelay.SILENT)
    assert job.silent and not job.released
    job, _ = _handed_back(_crelay.RELEASED)
    assert job.released and not job.silent
    # A read that is no event stream (a line past the bound): the task's next step says so.
    job, stream = _handed_back(_crelay.RAW, max_event_bytes=64, raw=_chunks([b"data: " + b"x" * 100]))
    assert (job.tokens, job.unsent) == (3, b"")
    with pytest.raises(EngineProtocolError, match="engine d0 sent an unusable event stream"):
        await stream.__anext__()
    assert [source for source, _ in stream._owner.bad] == ["stream"]
    job, stream = _handed_back(_crelay.ERROR, errno=errno.ECONNRESET)
    with pytest.raises(RuntimeError, match=r"mapped: connection to the engine broke: .*Connection reset by peer"):
        await stream.__anext__()
