"""The server's request parser (narwhal.http.parser), against h11 as a reference.

Valid requests, however their bytes are split, parse to what h11 parses them to
(method, target, version, lower-cased fields, body); invalid ones are refused with
the status the connection answers.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.http.parser import ProtocolError, RequestHead, RequestParser

MAX_HEAD = 4096

_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_tokens = st.text(_TOKEN_CHARS, min_size=1, max_size=12)
# Field values: visible characters and obs-text, single inner spaces and tabs.
_values = st.binary(max_size=30).map(
    lambda b: bytes(c for c in b if c >= 0x21 and c != 0x7F) or b"v"
).flatmap(lambda v: st.sampled_from([v, v + b" " + v, b"\t" + v + b" "]))


def parse_all(data: bytes, splits: list[int]) -> list[tuple[RequestHead, bytes]]:
    """Every request in ``data`` fed in pieces of the given sizes, then EOF."""
    parser = RequestParser(MAX_HEAD)
    pieces, pos = [], 0
    for size in splits:
        pieces.append(data[pos : pos + size])
        pos += size
    pieces.append(data[pos:])
    out: list[tuple[RequestHead, bytes]] = []
    head: RequestHead | None = None
    body = b""
    for piece in pieces:
        parser.feed(piece)
        while True:
            if head is None:
                head = parser.head()
                if head is None:
                    break
                body = b""
            if not parser.done:
                body += parser.body()
            if not parser.done:
                break
            out.append((head, body))
            head = None
            parser.next_request()
    parser.feed(b"")
    assert parser.head() is None and parser.trailing == b""
    return out


def h11_parse(data: bytes) -> list[tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]], bytes]]:
    out = []
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    while True:
        event = conn.next_event()
        assert isinstance(event, h11.Request)
        body = b""
        while True:
            part = conn.next_event()
            if isinstance(part, h11.EndOfMessage):
                break
            assert isinstance(part, h11.Data)
            body += bytes(part.data)
        out.append(
            (event.method, event.target, event.http_version, list(event.headers), body)
        )
        rest, _ = conn.trailing_data
        if not rest:
            return out
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(rest)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"X-CUSTOM"]))
    target = draw(st.sampled_from([b"/", b"/v1/completions", b"/a?b=c&d=%20", b"*", b"http://h/x"]))
    fields = [(b"Host", b"router")]
    fields += [(draw(_tokens).encode(), draw(_values)) for _ in range(draw(st.integers(0, 4)))]
    fields = [(n, v) for n, v in fields if n.lower() not in (
        b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"
    )] + [(b"Host", b"router")]
    body = draw(st.binary(max_size=200))
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(1, 50), max_size=6))
        chunks, pos = [], 0
        for size in sizes:
            if pos < len(body):
                chunks.append(body[pos : pos + size])
                pos += size
        if pos < len(body):
            chunks.append(body[pos:])
        framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        fields.append((b"Transfer-Encoding", b"chunked"))
    else:
        framed = body
        fields.append((b"Content-Length", b"%d" % len(body)))
    head = method + b" " + target + b" HTTP/1.1\r\n"
    head += b"".join(n + b":" + v + b"\r\n" for n, v in fields)
    return head + b"\r\n" + framed


@settings(max_examples=200, deadline=None)
@given(
    batch=st.lists(requests(), min_size=1, max_size=3),
    splits=st.lists(st.integers(min_value=1, max_value=40), max_size=8),
)
def test_valid_requests_parse_as_h11_parses_them(batch: list[bytes], splits: list[int]) -> None:
    data = b"".join(batch)
    ours = [
        (h.method, h.target, b"1.1" if h.http11 else b"1.0", h.headers, body)
        for h, body in parse_all(data, splits)
    ]
    assert ours == h11_parse(data)


def test_head_fields_set_framing_and_persistence() -> None:
    parser = RequestParser(MAX_HEAD)
    parser.feed(
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\nConnection: keep-alive, Close\r\n"
        b"Expect: 100-Continue\r\n\r\nabcGET"
    )
    head = parser.head()
    assert head is not None
    assert (head.content_length, head.chunked, head.close, head.expect_continue) == (3, False, True, True)
    assert parser.body() == b"abc" and parser.done
    assert parser.trailing == b"GET"
    http10 = RequestParser(MAX_HEAD)
    http10.feed(b"GET / HTTP/1.0\r\nExpect: 100-continue\r\n\r\n")
    head = http10.head()
    assert head is not None and head.close and not head.http11 and not head.expect_continue
    assert http10.done  # no body


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * MAX_HEAD, 431),  # incomplete, already too big
        (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"GET / HTTP/3.0\r\nHost: x\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1234567890123456789\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5,\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\n:empty-name\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: \x7f\r\n\r\n", 400),
        (b"G\xc3\xa9T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1 \r\nHost: x\r\n\r\n", 400),
        (b"GET / http/1.1\r\nHost: x\r\n\r\n", 400),
    ],
)
def test_invalid_heads_are_refused_with_their_status(data: bytes, status: int) -> None:
    parser = RequestParser(MAX_HEAD)
    parser.feed(data)
    with pytest.raises(ProtocolError) as caught:
        parser.head()
    assert caught.value.status == status
    assert caught.value.message  # names the problem


@pytest.mark.parametrize(
    "body",
    [
        b"x\r\n",  # not hex
        b"-1\r\n",
        b"1 2\r\n",
        b"10000000000000000\r\n",  # more than 15 hex digits
        b"1\r\nabc",  # data longer than its size
        b"1" * 5000,  # a chunk-size line that never ends
    ],
)
def test_invalid_chunked_framing_is_refused(body: bytes) -> None:
    parser = RequestParser(MAX_HEAD)
    parser.feed(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert parser.head() is not None
    with pytest.raises(ProtocolError) as caught:
        parser.body()
    assert caught.value.status == 400


def test_eof_in_the_middle_of_a_head_is_an_error_and_between_requests_is_not() -> None:
    parser = RequestParser(MAX_HEAD)
    parser.feed(b"GET / HTTP/1.1\r\nHo")
    assert parser.head() is None
    parser.feed(b"")
    with pytest.raises(ProtocolError):
        parser.head()
    idle = RequestParser(MAX_HEAD)
    idle.feed(b"")
    assert idle.head() is None and idle.closed
