"""A strict HTTP/1.1 request parser for :class:`~narwhal.http.connection.Connection`.

The server side of the router's hot path: one request head and body per client
request. A general-purpose protocol library (h11) builds an event object per step and
runs a regular expression per header line and a state machine per event; this parser
does what a server needs and nothing else, with one regular expression over the whole
head:

- a request line ``METHOD SP TARGET SP HTTP/1.x`` (method a token, target visible
  ASCII); another ``HTTP/d.d`` version is answered 505, anything else 400;
- header fields ``name ":" OWS value OWS`` with a token name and a value free of
  control characters other than HTAB; no obsolete line folding, lines end in CRLF;
  names are lower-cased, values stripped of surrounding blanks;
- HTTP/1.1 requires exactly one ``Host`` (HTTP/1.0 at most one);
- the body framed by ``Content-Length`` (digits; repeated values must agree) or
  ``Transfer-Encoding: chunked`` (any other coding: 501; both framings at once: 400,
  the ambiguity request smuggling relies on), chunk extensions and trailers read and
  dropped;
- a head (or a trailer section) larger than ``max_head`` bytes: 431.

Errors are :class:`ProtocolError` with the status to answer and a message naming the
problem. Bytes after the current request (a pipelined next request) stay buffered
for the next cycle (:meth:`RequestParser.next_request`).
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["ProtocolError", "RequestHead", "RequestParser"]

_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_REQUEST_LINE: Final = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
# Every header line of a head at once: a token, a colon, a value without control
# characters other than HTAB (linear: the value's class excludes CR and LF).
_FIELDS: Final = re.compile(rb"(?:" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
_FIELD: Final = re.compile(rb"([^:]*):([^\r]*)\r\n")
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")
_CHUNK_SIZE: Final = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
#: The longest chunk-size line (size and extensions) accepted.
_MAX_CHUNK_LINE: Final = 4096
_BLANK: Final = b" \t"

# Parser states.
_HEAD: Final = 0
_LENGTH: Final = 1  # a Content-Length body: ``remaining`` bytes to go
_CHUNK_LINE: Final = 2  # the next chunk-size line
_CHUNK_DATA: Final = 3  # ``remaining`` bytes of the current chunk
_CHUNK_END: Final = 4  # the CRLF after a chunk's data
_TRAILERS: Final = 5  # the trailer section after the last chunk
_DONE: Final = 6  # the request is complete: the buffer holds what follows it


class ProtocolError(Exception):
    """The request cannot be served: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RequestHead:
    """A parsed request head: method, target, version, lower-cased header fields."""

    __slots__ = (
        "chunked",
        "close",
        "content_length",
        "expect_continue",
        "headers",
        "http11",
        "method",
        "size",
        "target",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        http11: bool,
        headers: list[tuple[bytes, bytes]],
        size: int,
    ) -> None:
        self.method = method
        self.target = target
        self.http11 = http11
        self.headers = headers
        self.size = size  # bytes of the head, final CRLF included
        self.content_length = 0  # -1 when chunked
        self.chunked = False
        self.close = not http11  # "Connection: close", or HTTP/1.0
        self.expect_continue = False  # an HTTP/1.1 "Expect: 100-continue"


def _framing(head: RequestHead) -> None:
    """Check the head's fields and set its framing and persistence from them.

    Raises:
        ProtocolError: a field is missing, repeated or invalid.
    """
    hosts = 0
    length: bytes | None = None
    coding: bytes | None = None
    for name, value in head.headers:
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            for part in value.split(b","):
                part = part.strip(_BLANK)
                if _DIGITS.fullmatch(part) is None:
                    raise ProtocolError(400, f"invalid Content-Length {value!r}")
                if length is not None and int(part) != int(length):
                    raise ProtocolError(400, "conflicting Content-Length values")
                length = part
        elif name == b"transfer-encoding":
            if coding is not None:
                raise ProtocolError(501, "more than one Transfer-Encoding field")
            coding = value.lower()
        elif name == b"connection":
            if b"close" in value.lower():
                head.close = True
        elif name == b"expect":
            head.expect_continue = head.http11 and value.lower() == b"100-continue"
    if hosts > 1:
        raise ProtocolError(400, "more than one Host field")
    if hosts == 0 and head.http11:
        raise ProtocolError(400, "missing Host field (required in HTTP/1.1)")
    if coding is not None:
        if coding != b"chunked":
            raise ProtocolError(501, f"unsupported Transfer-Encoding {coding!r} (only chunked)")
        if length is not None:
            raise ProtocolError(400, "both Content-Length and Transfer-Encoding")
        head.chunked = True
        head.content_length = -1
    elif length is not None:
        head.content_length = int(length)


def parse_head(data: bytes, max_head: int) -> RequestHead:
    """Parse one complete head (its final empty line included).

    Raises:
        ProtocolError: the head is malformed (400), too large (431), of another
            HTTP version (505) or asks for an unsupported coding (501).
    """
    if len(data) > max_head:
        raise ProtocolError(431, f"request head over {max_head} bytes")
    line_end = data.find(b"\r\n")
    match = _REQUEST_LINE.fullmatch(data, 0, line_end)
    if match is None:
        version = re.search(rb" HTTP/([0-9])\.([0-9])$", data[:line_end])
        if version is not None and version.group(1, 2) not in ((b"1", b"0"), (b"1", b"1")):
            raise ProtocolError(505, "HTTP version not supported")
        raise ProtocolError(400, "malformed request line")
    major, minor = match.group(3, 4)
    if major != b"1" or minor not in (b"0", b"1"):
        raise ProtocolError(505, f"HTTP version {(major + b'.' + minor).decode()} not supported")
    fields_end = len(data) - 2  # before the head's final CRLF
    if _FIELDS.fullmatch(data, line_end + 2, fields_end) is None:
        raise ProtocolError(400, "malformed header field")
    headers = [
        (name.lower(), value.strip(_BLANK))
        for name, value in _FIELD.findall(data, line_end + 2, fields_end)
    ]
    head = RequestHead(match.group(1), match.group(2), minor == b"1", headers, len(data))
    _framing(head)
    return head


class RequestParser:
    """Requests from one connection's bytes, one at a time (see the module docstring).

    Feed what the connection reads with :meth:`feed` (``b""``: the peer closed);
    :meth:`head` returns the next head once it is complete, then :meth:`body` the body
    bytes as they arrive until :attr:`done`; :meth:`next_request` starts the next cycle.
    """

    __slots__ = ("buf", "closed", "done", "max_head", "remaining", "state", "trailer_bytes")

    def __init__(self, max_head: int) -> None:
        self.max_head = max_head
        self.buf = bytearray()
        self.closed = False  # the peer closed its side: no more bytes will come
        self.state = _HEAD
        self.done = False  # the current request is complete (head and body)
        self.remaining = 0
        self.trailer_bytes = 0

    def feed(self, data: bytes | bytearray) -> None:
        if data:
            self.buf += data
        else:
            self.closed = True

    @property
    def trailing(self) -> bytes:
        """The bytes buffered beyond what has been parsed."""
        return bytes(self.buf)

    def next_request(self) -> None:
        """Start the next request (after the current one is done)."""
        self.state = _HEAD
        self.done = False

    def head(self) -> RequestHead | None:
        """The next request's head, or None until all of it has arrived.

        Raises:
            ProtocolError: the head is malformed, or the peer closed in the middle of it.
        """
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > self.max_head:
                raise ProtocolError(431, f"request head over {self.max_head} bytes")
            if self.closed and buf:
                raise ProtocolError(400, "connection closed in the middle of a request head")
            return None
        end += 4
        head = parse_head(bytes(buf[:end]), self.max_head)
        del buf[:end]
        if head.chunked:
            self.state = _CHUNK_LINE
        elif head.content_length > 0:
            self.state = _LENGTH
            self.remaining = head.content_length
        else:
            self.state = _DONE
            self.done = True
        return head

    def body(self) -> bytes:
        """The body bytes buffered now (b"" when none); :attr:`done` once the body is whole.

        Raises:
            ProtocolError: the chunked framing is malformed.
        """
        buf = self.buf
        if self.state == _LENGTH:
            take = min(self.remaining, len(buf))
            if take == 0:
                return b""
            data = bytes(buf[:take])
            del buf[:take]
            self.remaining -= take
            if self.remaining == 0:
                self.state = _DONE
                self.done = True
            return data
        parts: list[bytes] = []
        while self._chunk_step(parts):
            pass
        return b"".join(parts)

    def _chunk_step(self, parts: list[bytes]) -> bool:
        """Parse what the buffer holds of a chunked body; False when it needs more."""
        buf = self.buf
        state = self.state
        if state == _CHUNK_LINE:
            end = buf.find(b"\r\n", 0, _MAX_CHUNK_LINE)
            if end < 0:
                if len(buf) >= _MAX_CHUNK_LINE:
                    raise ProtocolError(400, "chunk-size line too long")
                return False
            match = _CHUNK_SIZE.fullmatch(buf, 0, end)
            if match is None:
                raise ProtocolError(400, f"malformed chunk-size line {bytes(buf[:end])[:40]!r}")
            size = int(match.group(1), 16)
            del buf[: end + 2]
            if size == 0:
                self.state = _TRAILERS
                self.trailer_bytes = 0
            else:
                self.state = _CHUNK_DATA
                self.remaining = size
            return True
        if state == _CHUNK_DATA:
            take = min(self.remaining, len(buf))
            if take == 0:
                return False
            parts.append(bytes(buf[:take]))
            del buf[:take]
            self.remaining -= take
            if self.remaining == 0:
                self.state = _CHUNK_END
            return True
        if state == _CHUNK_END:
            if len(buf) < 2:
                return False
            if buf[:2] != b"\r\n":
                raise ProtocolError(400, "chunk data not followed by CRLF")
            del buf[:2]
            self.state = _CHUNK_LINE
            return True
        if state == _TRAILERS:
            end = buf.find(b"\r\n")
            if end < 0:
                if self.trailer_bytes + len(buf) > self.max_head:
                    raise ProtocolError(431, f"trailer section over {self.max_head} bytes")
                return False
            line = bytes(buf[: end + 2])
            del buf[: end + 2]
            self.trailer_bytes += len(line)
            if self.trailer_bytes > self.max_head:
                raise ProtocolError(431, f"trailer section over {self.max_head} bytes")
            if end == 0:
                self.state = _DONE
                self.done = True
                return False
            if _FIELDS.fullmatch(line) is None:
                raise ProtocolError(400, "malformed trailer field")
            return True
        return False
