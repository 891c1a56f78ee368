"""The in-process KV fabric: how a simulated consumer reaches a simulated producer.

A producer registers itself under its connector's KV endpoint (``kv_host``,
``kv_port``), the ``remote_host``/``remote_port`` its descriptors name. A consumer
looks the endpoint up, claims the named handoff, waits out the transfer time and then
finishes it, which frees the producer's blocks. Loopback aliases (``localhost``,
``127.0.0.1``, ``::1``) name the same endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

__all__ = ["Handoff", "KVFabric", "KVProducer", "TransferError", "endpoint_key"]

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def endpoint_key(host: str, port: int) -> tuple[str, int]:
    """The canonical form of a KV endpoint (loopback aliases folded)."""
    h = host.strip("[]").lower()
    return ("127.0.0.1" if h in _LOOPBACK else h), port


class TransferError(Exception):
    """A KV transfer cannot complete; ``str()`` says why."""


@attrs.define(eq=False)
class Handoff:
    """KV blocks a producer holds for one finished prefill until a consumer reads them.

    Attributes:
        request_id: The descriptor's ``remote_request_id``.
        engine_id: The producer generation's ``remote_engine_id``.
        block_ids: The blocks held (the descriptor's ``remote_block_ids[0]``).
        num_tokens: Prompt tokens whose KV the blocks hold.
        expires_at: Producer clock time at which the blocks are freed unread.
        claimed: A consumer is reading them now.
    """

    request_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float
    claimed: bool = False


class KVProducer(Protocol):
    """What a consumer needs of a producer."""

    def claim_handoff(
        self, engine_id: str, request_id: str, block_ids: Sequence[object]
    ) -> Handoff:
        """Reserve a held handoff for reading; raises :class:`TransferError`."""
        ...

    def unclaim_handoff(self, handoff: Handoff) -> None:
        """Give a claimed handoff back unread (the reader went away)."""
        ...

    def finish_handoff(self, handoff: Handoff) -> None:
        """The read completed: free the blocks; raises :class:`TransferError`."""
        ...


class KVFabric:
    """Registry of simulated producers by KV endpoint, shared by a fleet."""

    def __init__(self) -> None:
        self._producers: dict[tuple[str, int], KVProducer] = {}

    def register(self, host: str, port: int, producer: KVProducer) -> None:
        """Serve ``producer``'s handoffs at ``host:port`` (replacing any other)."""
        self._producers[endpoint_key(host, port)] = producer

    def unregister(self, host: str, port: int, producer: KVProducer) -> None:
        """Stop serving ``producer`` at ``host:port`` (no-op if another took it)."""
        key = endpoint_key(host, port)
        if self._producers.get(key) is producer:
            del self._producers[key]

    def lookup(self, host: str, port: int) -> KVProducer | None:
        """The producer at ``host:port``, or None when nothing listens there."""
        return self._producers.get(endpoint_key(host, port))

    def __len__(self) -> int:
        return len(self._producers)
