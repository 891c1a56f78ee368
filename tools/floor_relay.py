"""The floor: the least a prefill/decode router written in Python on trio does per request.

``tools/bench_overhead.py`` measures it beside Narwhal and vllm-router, so that the
CPU a Python router cannot avoid is a figure of the same run, not a guess. Per client
request it does only what any disaggregating router must:

- read the request (head up to the blank line, then ``content-length`` bytes);
- parse the JSON body and write the prefill body (``max_tokens: 1``, ``stream: false``,
  the connector's ``kv_transfer_params`` request block), POST it to the producer over
  a pooled keep-alive connection and parse the JSON answer for its descriptor;
- write the decode body (the descriptor in ``kv_transfer_params``), POST it to the
  consumer over a pooled connection and relay its chunked event stream to the client
  byte for byte, until the terminating chunk.

It does nothing else: no token accounting, no placement, no deadlines, no failure
detection or retries, no journal, metrics or logs, no header validation, and it
answers nothing but that one route. It is a measuring stick, not a router.

    python tools/floor_relay.py --port 8100 --prefill http://127.0.0.1:8001 \
        --decode http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import socket
from urllib.parse import urlsplit

import orjson
import trio

from narwhal.engines.connector import prefill_request_params

#: The request block every prefill carries (the same one Narwhal sends).
_PREFILL_PARAMS = prefill_request_params("NixlConnector")
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
_END = b"\r\n0\r\n\r\n"


class Upstream:
    """One engine: a pool of idle keep-alive connections and its request head prefix."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            "content-type: application/json\r\ncontent-length: "
        ).encode()
        self.idle: list[trio.SocketStream] = []

    async def connect(self) -> trio.SocketStream:
        while self.idle:
            stream = self.idle.pop()
            # An idle connection with something to read was closed by the engine (a
            # vLLM engine closes one after 5 s): what any pooling client checks.
            if not stream.socket.is_readable():
                return stream
            await trio.aclose_forcefully(stream)
        stream = await trio.open_tcp_stream(self.host, self.port)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return stream

    async def post(self, body: bytes) -> tuple[trio.SocketStream, bytearray]:
        """Send a POST; the connection and the first bytes of its answer (a full head)."""
        stream = await self.connect()
        await stream.send_all(b"%s%d\r\n\r\n%s" % (self.prefix, len(body), body))
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError("the engine closed the connection")
            buf += data
        return stream, buf


async def read_message(stream: trio.SocketStream, buf: bytearray) -> tuple[bytes, bytes]:
    """Read a head and its ``content-length`` body from ``buf`` and ``stream``."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    head = bytes(buf[:end]).lower()
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name == b"content-length":
            length = int(value)
    del buf[: end + 4]
    while len(buf) < length:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed mid-body")
        buf += data
    body = bytes(buf[:length])
    del buf[:length]
    return head, body


async def relay(client: trio.SocketStream, producer: Upstream, consumer: Upstream) -> None:
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    try:
        while True:
            _, body = await read_message(client, buf)
            request = orjson.loads(body)
            prefill = dict(request)
            prefill.update(
                max_tokens=1,
                stream=False,
                return_token_ids=True,
                ignore_eos=True,
                kv_transfer_params=_PREFILL_PARAMS,
            )
            prefill.pop("stream_options", None)
            stream, answer = await producer.post(orjson.dumps(prefill))
            _, reply = await read_message(stream, answer)
            producer.idle.append(stream)
            request["kv_transfer_params"] = orjson.loads(reply)["kv_transfer_params"]
            request["stream_options"] = {"include_usage": True}
            stream, answer = await consumer.post(orjson.dumps(request))
            del answer[: answer.index(b"\r\n\r\n") + 4]  # the engine's head: ours is fixed
            await client.send_all(_STREAM_HEAD + answer)
            tail = bytes(answer[-7:])
            while not tail.endswith(_END):
                data = await stream.receive_some(65536)
                if not data:
                    raise ConnectionError("the consumer closed mid-stream")
                await client.send_all(data)
                tail = (tail + data)[-7:]
            consumer.idle.append(stream)
    except (ConnectionError, trio.BrokenResourceError, ValueError):
        pass
    finally:
        await trio.aclose_forcefully(client)


async def serve(port: int, prefill: str, decode: str) -> None:
    producer, consumer = Upstream(prefill), Upstream(decode)

    async def handler(client: trio.SocketStream) -> None:
        await relay(client, producer, consumer)

    await trio.serve_tcp(handler, port, host="127.0.0.1")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="the producer engine's URL")
    parser.add_argument("--decode", required=True, help="the consumer engine's URL")
    args = parser.parse_args()
    trio.run(serve, args.port, args.prefill, args.decode)


if __name__ == "__main__":
    main()
