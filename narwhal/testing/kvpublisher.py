"""A simulated engine's KV-event publisher, as vLLM's ``ZmqEventPublisher`` does it.

One PUB socket sends each step's events as ``(topic, seq, payload)``: ``seq`` an
8-byte big-endian counter from 0, the payload an msgpack ``EventBatch``
(:func:`narwhal.engines.kvevents.encode_batch`). The last ``buffer_steps`` batches are
kept for the ROUTER replay endpoint, which answers ``[b"", start_seq]`` with every
buffered batch from ``start_seq`` on, then the end marker. A restart of the engine is
a new publisher: numbering starts at 0 again and the buffer is empty.

Like vLLM's, the PUB socket binds or connects: it binds ``kv_events.endpoint`` (vLLM
configured with ``tcp://*:P``), connects to ``kv_events.bind`` where the router binds
(vLLM configured with the router's address), and connects to ``kv_events.endpoint``
with ``connect=True`` (vLLM configured with a non-wildcard address while the router
connects there too: nothing is delivered live, the replay endpoint still answers).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable

import zmq

from narwhal.config import KVEventsConfig
from narwhal.engines.kvevents import END_SEQ, EventBatch, KVEvent, encode_batch, seq_bytes
from narwhal.engines.zmqtrio import close_socket, recv_multipart, send_multipart

__all__ = ["SimKVPublisher"]

log = logging.getLogger(__name__)


class SimKVPublisher:
    """Publishes one simulated engine's KV events on ``config``'s endpoints.

    Args:
        config: The engine's ``kv_events`` block (bound as given).
        wall_time: The engine's wall clock, for each batch's ``ts``.
        buffer_steps: Batches kept for replay (vLLM's default).
        context: The ZeroMQ context (the process-wide one by default).
        connect: Connect the PUB socket to ``endpoint`` rather than bind it (see above).
    """

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        wall_time: Callable[[], float],
        buffer_steps: int = 10_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        connect: bool = False,
    ) -> None:
        self.config = config
        self.connect = connect
        self._wall_time = wall_time
        self._topic = config.topic.encode("utf-8")
        self._ctx = context if context is not None else zmq.Context.instance()
        self._seq = itertools.count()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.published = 0
        #: When set, batches are numbered and buffered but not sent (a lost message).
        self.drop_next = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None

    def bind(self) -> None:
        """Open the PUB socket (bound or connected, see the module docstring) and bind the
        replay ROUTER socket."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        if self.config.bind is not None:
            host, _, port = self.config.bind.removeprefix("tcp://").rpartition(":")
            loopback = "[::1]" if host.startswith("[") else "127.0.0.1"
            pub.connect(f"tcp://{loopback if host in ('*', '0.0.0.0', '[::]') else host}:{port}")
        elif self.connect:
            pub.connect(self.config.address)
        else:
            pub.bind(self.config.address)
        if self.config.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.config.replay_endpoint)
            self._router = router

    def publish(self, events: list[KVEvent]) -> None:
        """Send one step's events as the next batch."""
        seq = next(self._seq)
        payload = encode_batch(EventBatch(self._wall_time(), tuple(events), 0))
        self.buffer.append((seq, payload))
        self.published += 1
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        if self._pub is not None:
            send_multipart(self._pub, [self._topic, seq_bytes(seq), payload])

    def restart(self) -> None:
        """A new engine process: numbering from 0, nothing buffered."""
        self._seq = itertools.count()
        self.buffer.clear()

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (returns at once without a ROUTER)."""
        router = self._router
        if router is None:
            return
        while True:
            frames = await recv_multipart(router)
            if len(frames) != 3:
                log.warning("Invalid replay request: %r", frames)
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    send_multipart(router, [client, b"", self._topic, seq_bytes(seq), payload])
            send_multipart(router, [client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        """Close both sockets."""
        for sock in (self._pub, self._router):
            if sock is not None:
                close_socket(sock)
        self._pub = self._router = None
