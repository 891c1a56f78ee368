"""A lean HTTP/1.1 client for many concurrent router requests (load, shutdown, hostile input).

httpx costs more CPU per request than the router under test, and a pool shared by
hundreds of tasks adds its own waits; these helpers speak h11 over one trio stream
per request instead (an in-memory connection from :class:`MemoryNetwork` or a TCP
socket), and report what the client saw as an :class:`Outcome`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import h11
import trio

__all__ = ["Outcome", "exchange", "read_response", "request_bytes"]


@attrs.define
class Outcome:
    """What one client saw.

    Attributes:
        request_id: the ``x-request-id`` sent.
        status: the HTTP status (0 when the connection ended before a response).
        headers: response headers (lower-case names).
        tokens: token events of a stream (events with choices).
        done: the stream ended with ``data: [DONE]``.
        error: the error object: the body's, or the stream's terminal event's.
        complete: the response ended properly (its last chunk or all its bytes arrived).
        body: the body of a non-streaming response.
    """

    request_id: str
    status: int = 0
    headers: dict[str, str] = attrs.Factory(dict)
    tokens: int = 0
    done: bool = False
    error: dict[str, Any] | None = None
    complete: bool = False
    body: bytes = b""

    @property
    def ok(self) -> bool:
        """A complete success: 200 and (for a stream) ``[DONE]`` with no error."""
        return self.status == 200 and self.complete and self.error is None and (self.done or bool(self.body))


def request_bytes(
    body: dict[str, Any] | bytes,
    *,
    path: str = "/v1/completions",
    request_id: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    """One POST request, serialized."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    all_headers = [("host", "router"), ("content-type", "application/json"), *headers]
    if request_id is not None:
        all_headers.append(("x-request-id", request_id))
    all_headers.append(("content-length", str(len(raw))))
    conn = h11.Connection(h11.CLIENT)
    return conn.send(h11.Request(method="POST", target=path, headers=all_headers)) + conn.send(
        h11.Data(data=raw)
    ) + conn.send(h11.EndOfMessage())


async def read_response(
    stream: trio.abc.ReceiveStream,
    outcome: Outcome,
    conn: h11.Connection | None = None,
    *,
    on_first_token: Callable[[], None] | None = None,
) -> Outcome:
    """Read one response from ``stream`` into ``outcome`` (SSE events parsed as they come);
    ``on_first_token`` is called when the stream's first token event arrives."""
    conn = conn or _client_conn()
    buf = b""
    streaming = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return outcome
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            conn.receive_data(bytes(data))
            if not data and conn.their_state is not h11.DONE:
                try:
                    conn.next_event()
                except h11.RemoteProtocolError:
                    pass
                return outcome  # ended before the response did
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            outcome.status = event.status_code
            outcome.headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            streaming = outcome.headers.get("content-type", "").startswith("text/event-stream")
        elif isinstance(event, h11.Data):
            if not streaming:
                outcome.body += bytes(event.data)
                continue
            buf += bytes(event.data)
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                payload = raw.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    outcome.done = True
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    outcome.error = obj["error"]
                elif obj.get("choices"):
                    outcome.tokens += 1
                    if outcome.tokens == 1 and on_first_token is not None:
                        on_first_token()
        elif isinstance(event, h11.EndOfMessage):
            outcome.complete = True
            if not streaming and outcome.body and outcome.status != 200:
                try:
                    outcome.error = json.loads(outcome.body).get("error")
                except ValueError:
                    pass
            return outcome
        else:  # ConnectionClosed
            return outcome


def _client_conn() -> h11.Connection:
    conn = h11.Connection(h11.CLIENT)
    # Only the response is parsed: pretend the request went through this connection.
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    return conn


async def exchange(
    stream: trio.abc.Stream,
    body: dict[str, Any] | bytes,
    *,
    request_id: str,
    path: str = "/v1/completions",
    headers: Sequence[tuple[str, str]] = (),
    close: bool = True,
    on_first_token: Callable[[], None] | None = None,
) -> Outcome:
    """Send one request on ``stream``, read its response, close the stream."""
    outcome = Outcome(request_id)
    try:
        try:
            await stream.send_all(request_bytes(body, path=path, request_id=request_id, headers=headers))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return outcome
        return await read_response(stream, outcome, on_first_token=on_first_token)
    finally:
        if close and outcome.complete:
            await stream.aclose()
        elif close:
            await trio.aclose_forcefully(stream)
