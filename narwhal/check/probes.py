"""KV transfer probes: one real handoff for every role-permitted (producer, consumer) pair.

A pair is role-permitted when the producer has the ``prefill`` role, the consumer the
``decode`` role, they are different engines, and they serve the same model. Each probe runs, in order:

1. ``prefill``: a one-token, non-streaming prefill on the producer asking for a KV
   handoff (:meth:`~narwhal.engines.client.EngineClient.prefill`);
2. ``descriptor``: the producer's descriptor validated against the producer's KV
   endpoint as the fleet document configures it (``connector.kv_host``/``kv_port``);
3. ``decode``: a streaming decode on the consumer with that descriptor, until its first
   generated token.

Each leg is bounded by ``engine.first_token_timeout_s``. Pairs are probed one after
another, so each time is that of an otherwise idle pair, and a broken pair fails
only its own result.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import trio

from narwhal.check.pools import engine_models
from narwhal.check.results import CheckResult
from narwhal.config import EngineConfig, FleetConfig
from narwhal.engines.client import EngineClient, EngineIdentity
from narwhal.engines.connector import PrefillResult, validate_descriptor
from narwhal.errors import EngineError, InvalidDescriptor

__all__ = ["pair_name", "probe_pair", "probe_transfers", "role_pairs"]

NAME = "kv_transfer"


def role_pairs(
    config: FleetConfig, models: Mapping[str, str | None] | None = None
) -> list[tuple[EngineConfig, EngineConfig]]:
    """Every (producer, consumer) pair the roles permit, producer != consumer, in fleet order.

    With ``models`` (each engine's model, None where unknown), only pairs of one model:
    a request is never placed across models, so no KV crosses them.
    """
    known = models or {}

    def same(a: str, b: str) -> bool:
        ma, mb = known.get(a), known.get(b)
        return ma is None or mb is None or ma == mb

    return [
        (p, c)
        for p in config.engines
        if p.can_prefill
        for c in config.engines
        if c.can_decode and c.name != p.name and same(p.name, c.name)
    ]


def pair_name(producer: str, consumer: str) -> str:
    """How a pair is named in results: ``producer->consumer``."""
    return f"{producer}->{consumer}"


class _Failed(Exception):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)  # pragma: no mutate (equivalent: the probe reads .message)
        self.stage = stage
        self.message = message


def _body(model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": f"narwhal preflight transfer probe {secrets.token_hex(6)}",
        "max_tokens": 2,
        "temperature": 0,
    }
    if model is not None:
        body["model"] = model
    return body


async def _prefill(
    client: EngineClient, body: Mapping[str, Any], timeout_s: float
) -> PrefillResult:
    with trio.move_on_after(timeout_s) as scope:
        try:
            return await client.prefill(body, request_id=f"check-{secrets.token_hex(6)}-p")
        except InvalidDescriptor as exc:
            raise _Failed("descriptor", str(exc)) from exc
        except EngineError as exc:
            raise _Failed("prefill", str(exc)) from exc
    assert scope.cancelled_caught
    raise _Failed(
        "prefill", f"the prefill took over {timeout_s:g} s (engine.first_token_timeout_s)"
    )


async def _first_token(client: EngineClient, handoff: PrefillResult, timeout_s: float) -> None:
    """The decode of the handoff's own request (the prefill's body), to its first token."""
    with trio.move_on_after(timeout_s) as scope:
        try:
            rid = f"check-{secrets.token_hex(6)}-d"
            async with client.decode(handoff, request_id=rid) as stream:
                async for chunk in stream:
                    if chunk.kind == "token":
                        return
        except EngineError as exc:
            raise _Failed("decode", str(exc)) from exc
        raise _Failed("decode", "the decode stream ended without a token")
    assert scope.cancelled_caught
    raise _Failed("decode", f"no first token within {timeout_s:g} s (engine.first_token_timeout_s)")


async def probe_pair(
    producer: EngineConfig,
    consumer: EngineConfig,
    clients: Mapping[str, EngineClient],
    *,
    timeout_s: float,
    model: str | None = None,
) -> CheckResult:
    """Probe one pair; the result says which stage failed and how long each took.

    Args:
        producer: The producer's configuration (its connector names the KV endpoint).
        consumer: The consumer's configuration.
        clients: Engine clients by name.
        timeout_s: Bound on each leg.
        model: The model to name in the request when the fleet document names none.
    """
    name = pair_name(producer.name, consumer.name)
    limit = f"each leg within {timeout_s:g} s"
    detail: dict[str, Any] = {"producer": producer.name, "consumer": consumer.name}
    start = trio.current_time()
    try:
        if producer.connector is None:
            raise _Failed("prefill", f"producer {producer.name} has no KV connector configured")
        if consumer.connector is None:
            raise _Failed(
                "decode",
                f"consumer {consumer.name} has no KV connector configured; "
                "it would ignore the handoff and recompute the prompt",
            )
        body = _body(producer.model or model)
        handoff = await _prefill(clients[producer.name], body, timeout_s)
        detail["prefill_s"] = trio.current_time() - start
        try:
            # Against the endpoint the fleet document configures (the connector's), even
            # where the producer's client was made without it.
            validate_descriptor(
                handoff.parameters(),
                connector=producer.connector,
                engine=producer.name,  # pragma: no mutate (equivalent: the result keeps the message, which does not name it)
            )
        except InvalidDescriptor as exc:
            raise _Failed("descriptor", str(exc)) from exc
        detail["endpoint"] = f"{producer.connector.kv_host}:{producer.connector.kv_port}"
        decode_start = trio.current_time()
        await _first_token(clients[consumer.name], handoff, timeout_s)
        detail["first_token_s"] = trio.current_time() - decode_start
    except _Failed as exc:
        detail |= {"stage": exc.stage, "error": exc.message, "total_s": trio.current_time() - start}
        return CheckResult(
            name=NAME,
            engine=name,
            ok=False,
            measured=f"{exc.stage} failed",
            limit=limit,
            detail=detail,
            message=f"KV transfer {name} failed at {exc.stage}: {exc.message}",
        )
    total = trio.current_time() - start
    detail |= {"stage": "done", "total_s": total}
    return CheckResult(
        name=NAME,
        engine=name,
        ok=True,
        measured=total,
        limit=limit,
        detail=detail,
        message=f"KV transfer {name}: prefill {detail['prefill_s'] * 1e3:.1f} ms, "
        f"first token {detail['first_token_s'] * 1e3:.1f} ms",
    )


async def probe_transfers(
    config: FleetConfig,
    clients: Mapping[str, EngineClient],
    identities: Mapping[str, EngineIdentity | None],
) -> list[CheckResult]:
    """Probe every role-permitted pair of one model; pairs with an unreachable engine are
    not probed."""
    timeout_s = config.engine.first_token_timeout_s
    results: list[CheckResult] = []
    for producer, consumer in role_pairs(config, engine_models(config, identities)):
        down = [e.name for e in (producer, consumer) if identities.get(e.name) is None]
        if down:
            name = pair_name(producer.name, consumer.name)
            results.append(
                CheckResult(
                    name=NAME,
                    engine=name,
                    ok=False,
                    measured="not probed",
                    limit=f"each leg within {timeout_s:g} s",
                    detail={
                        "producer": producer.name,
                        "consumer": consumer.name,
                        "stage": "skipped",
                    },
                    message=f"KV transfer {name} not probed: engine {' and '.join(down)} unreachable",
                )
            )
            continue
        live = identities[producer.name]
        assert live is not None  # an unreachable producer was skipped above
        results.append(
            await probe_pair(producer, consumer, clients, timeout_s=timeout_s, model=live.model)
        )
    return results
