"""Start-up probes of every engine, and readmission probes for ejected engines.

At start every engine's ``GET /health`` is asked once, concurrently, each within
``engine.connect_timeout_s``; an engine that does not answer 200 is named (by URL) in
the log and ejected, so that placement skips it and ``/health`` tells the truth, until
a readmission probe finds it serving.

An ejected engine returns to placement only when an inference probe succeeds:

- with ``engine_contract`` configured, the engine's lifecycle is validated first: its
  identity (version, model, max_model_len) and configured connector must match the
  contract; without it, ``GET /health`` must answer 200;
- then an inference probe runs, each leg bounded by ``engine.first_token_timeout_s``:
  a consumer ejected after a crossed decode (the failing request's KV came from another
  engine) is probed with a *fresh* handoff from that original producer; otherwise the
  engine prefills a one-token request (with a KV descriptor when it has a connector)
  or, when it only decodes, streams a short same-worker request;
- a probe that cannot decide (the original producer itself failed) is *inconclusive*:
  the engine stays out and is probed again at the normal cadence.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import trio

from narwhal.engines.connector import validate_descriptor
from narwhal.errors import NarwhalError
from narwhal.router.state import RouterState

__all__ = ["probe_at_start", "probe_engine", "run_probes"]

log = logging.getLogger("narwhal.router.probe")


class _Inconclusive(Exception):
    pass


def _probe_body(state: RouterState, name: str, max_tokens: int) -> dict[str, Any]:
    engine = state.engines[name]
    model = engine.model or (engine.sim.model if engine.sim is not None else None) or state.default_model
    body: dict[str, Any] = {
        "prompt": f"narwhal readmission probe {secrets.token_hex(8)}",
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if model:
        body["model"] = model
    return body


async def _check_lifecycle(state: RouterState, name: str) -> None:
    client = state.clients[name]
    contract = state.config.engine_contract
    timeout = state.config.engine.first_token_timeout_s
    with trio.fail_after(timeout):
        if contract is None:
            if not await client.health():
                raise NarwhalError("health check failed")
            return
        ident = await client.identity()
    mismatches = []
    if contract.version is not None and ident.version != contract.version:
        mismatches.append(f"version {ident.version!r} != {contract.version!r}")
    if contract.model is not None and ident.model != contract.model:
        mismatches.append(f"model {ident.model!r} != {contract.model!r}")
    if contract.max_model_len is not None and ident.max_model_len != contract.max_model_len:
        mismatches.append(f"max_model_len {ident.max_model_len} != {contract.max_model_len}")
    connector = state.engines[name].connector
    if contract.connector is not None and (connector is None or connector.type != contract.connector):
        mismatches.append(f"connector {connector.type if connector else None!r} != {contract.connector!r}")
    if mismatches:
        raise NarwhalError("engine contract mismatch: " + "; ".join(mismatches))


async def _decode_one(state: RouterState, name: str, handoff: Any, body: dict[str, Any]) -> None:
    timeout = state.config.engine.first_token_timeout_s
    client = state.clients[name]
    with trio.fail_after(timeout):
        async with client.decode(handoff, body, kind="completions", request_id=f"probe-{secrets.token_hex(6)}-d") as stream:
            async for chunk in stream:
                if chunk.kind == "token":
                    return
    raise NarwhalError("probe stream produced no token")


async def probe_engine(state: RouterState, name: str) -> bool | None:
    """Probe one engine: True (healthy), False (still failing), None (inconclusive)."""
    timeout = state.config.engine.first_token_timeout_s
    origin = state.breaker.states[name].origin_producer
    engine = state.engines[name]
    try:
        await _check_lifecycle(state, name)
        if origin is not None:
            # Crossed decode: a fresh handoff from the original producer.
            body = _probe_body(state, origin, 2)
            try:
                with trio.fail_after(timeout):
                    prefill = await state.clients[origin].prefill(
                        body, kind="completions", request_id=f"probe-{secrets.token_hex(6)}-p", transfer=True
                    )
                connector = state.engines[origin].connector
                validate_descriptor(
                    prefill.descriptor,
                    connector=connector.type if connector else None,
                    expected_endpoint=(connector.kv_host, connector.kv_port) if connector else None,
                    engine=origin,
                )
            except (NarwhalError, trio.TooSlowError) as exc:
                raise _Inconclusive(f"original producer {origin} failed the probe handoff: {exc}") from exc
            await _decode_one(state, name, prefill, body)
        elif engine.can_prefill:
            body = _probe_body(state, name, 1)
            connector = engine.connector
            with trio.fail_after(timeout):
                prefill = await state.clients[name].prefill(
                    body,
                    kind="completions",
                    request_id=f"probe-{secrets.token_hex(6)}-p",
                    transfer=connector is not None,
                )
            if connector is not None:
                validate_descriptor(
                    prefill.descriptor,
                    connector=connector.type,
                    expected_endpoint=(connector.kv_host, connector.kv_port),
                    engine=name,
                )
        else:
            await _decode_one(state, name, None, _probe_body(state, name, 2))
    except _Inconclusive as exc:
        state.breaker.probe_inconclusive(name, str(exc))
        return None
    except (NarwhalError, trio.TooSlowError) as exc:
        detail = str(exc) or "probe timed out (engine.first_token_timeout_s)"
        state.breaker.probe_failed(name, detail)
        return False
    state.breaker.readmit(name)
    # A readmitted engine may be a new generation: it is priced only if its profile binds.
    await state.bind_profiles([name])
    return True


async def run_probes(state: RouterState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Probe ejected engines at ``recovery.probe_interval_s``, until cancelled."""
    breaker = state.breaker
    probing: set[str] = set()

    async def one(name: str) -> None:
        try:
            result = await probe_engine(state, name)
            log.info("readmission probe of %s: %s", name, {True: "ok", False: "failed", None: "inconclusive"}[result])
        finally:
            probing.discard(name)
            breaker.poke()

    task_status.started()
    async with trio.open_nursery() as nursery:
        while True:
            for name in breaker.due_probes():
                if name not in probing:
                    probing.add(name)
                    nursery.start_soon(one, name)
            deadline = min(
                (st.next_probe_at for n, st in breaker.states.items() if st.ejected and n not in probing),
                default=state.clock() + 3600,
            )
            with trio.move_on_at(deadline):
                await breaker.wait_for_change()


async def probe_at_start(state: RouterState) -> dict[str, str]:
    """Ask every engine's ``/health`` once; eject and return those that do not answer 200
    (name: why)."""
    down: dict[str, str] = {}
    timeout = state.config.engine.connect_timeout_s

    async def one(name: str) -> None:
        why: str | None = f"no answer to GET /health within {timeout:g} s (engine.connect_timeout_s)"
        with trio.move_on_after(timeout):
            why = await state.clients[name].unhealthy()
        if why is not None:
            down[name] = why

    async with trio.open_nursery() as nursery:
        for name in state.engines:
            nursery.start_soon(one, name)
    interval = state.config.recovery.probe_interval_s
    for name in state.engines:  # in the document's order
        if name in down:
            log.warning(
                "engine %s at %s is unreachable (%s): out of placement until a readmission probe "
                "finds it serving (every %g s)", name, state.engines[name].url, down[name], interval,
            )  # fmt: skip
            state.breaker.eject(name, down[name])
    return {name: down[name] for name in state.engines if name in down}
