"""Start-up probes of every engine, and readmission probes for ejected engines.

At start every engine's ``GET /health`` is asked once, concurrently, each within
``engine.connect_timeout_s``; an engine that does not answer 200 is named (by URL) in
the log and ejected, so that placement skips it and ``/health`` tells the truth, until
a readmission probe finds it serving.

An ejected engine returns to placement only when an inference probe succeeds:

- with ``engine_contract`` configured, the engine's lifecycle is validated first: its
  identity (version, model, max_model_len) and configured connector must match the
  contract; without it, ``GET /health`` must answer 200;
- an engine whose model is not known yet (it declares none and was unreachable at
  start) is asked for its ``/v1/models`` before the inference probe, and again after a
  readmission (a new generation may serve another model);
- then an inference probe replays the path that failed, each leg bounded by
  ``engine.first_token_timeout_s`` (and, after the first token, the silence between
  chunks by ``engine.decode_read_timeout_s``):

  - an engine ejected for a decode-leg failure (or one that only decodes) streams a
    decode of :data:`PROBE_TOKENS` tokens to its ``data: [DONE]``: after a crossed
    decode through a *fresh* handoff from the original producer; a decode-only engine
    otherwise through a fresh handoff from a producer of its model in placement; an
    engine that also prefills, same-worker;
  - an engine ejected for a prefill-leg failure prefills a one-token request (with a
    KV descriptor, validated, when it has a connector);

- a probe that cannot decide (the producer of its handoff failed, or no producer is in
  placement) is *inconclusive*: the engine stays out and is probed again at the normal
  cadence.

A successful probe readmits the engine half-open (see :mod:`narwhal.router.breaker`).
With tracing on, each inference probe is a trace of its own (``narwhal.probe``) whose
legs send its context to the engines.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import trio

from narwhal.engines.client import TraceHeaders
from narwhal.errors import NarwhalError, RouterOverloaded
from narwhal.router.state import RouterState

__all__ = ["PROBE_TOKENS", "probe_at_start", "probe_engine", "readiness_problem", "run_probes"]

#: Tokens a decode probe streams: enough to cross the first-token and between-chunk
#: bounds that eject consumers.
PROBE_TOKENS = 4

log = logging.getLogger("narwhal.router.probe")


class _Inconclusive(Exception):
    pass


def _probe_body(state: RouterState, name: str, *, decode: bool) -> dict[str, Any]:
    """A probe request of its own prompt: :data:`PROBE_TOKENS` tokens for a decode probe,
    one for a prefill probe."""
    model = state.engines[name].model or _learned_model(state, name) or state.default_model
    body: dict[str, Any] = {
        "prompt": f"narwhal readmission probe {secrets.token_hex(8)}",
        "max_tokens": PROBE_TOKENS if decode else 1,
        "temperature": 0,
    }
    if decode:
        # Every token must come: an early end-of-sequence is no verdict on the stream.
        body["ignore_eos"] = True
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


async def readiness_problem(state: RouterState, name: str) -> str | None:
    """The readiness probe of an engine added at run time: ``GET /health`` answers 200
    (with ``engine_contract``: the engine's identity matches it). Returns why it is not
    ready, or None."""
    client = state.clients.get(name)
    if client is None:
        return "left the fleet"
    if state.config.engine_contract is None:
        timeout = state.config.engine.connect_timeout_s
        why: str | None = f"no answer to GET /health within {timeout:g} s (engine.connect_timeout_s)"
        with trio.move_on_after(timeout):
            try:
                why = await client.unhealthy()
            except RouterOverloaded as exc:
                why = str(exc)  # not ready yet, as far as the router can tell: asked again
        return why
    try:
        await _check_lifecycle(state, name)
    except trio.TooSlowError:
        return f"no answer within {state.config.engine.first_token_timeout_s:g} s (engine.first_token_timeout_s)"
    except NarwhalError as exc:
        return str(exc)
    return None


async def _decode_stream(
    state: RouterState, name: str, handoff: Any, body: dict[str, Any] | None = None, trace: TraceHeaders = ()
) -> None:
    """Stream a decode to its ``[DONE]`` under the request path's own bounds (through
    ``handoff``, whose request is the body; or same-worker, of ``body``)."""
    cfg = state.config.engine
    client = state.clients[name]
    silence = cfg.decode_read_timeout_s if cfg.decode_read_timeout_s > 0 else cfg.first_token_timeout_s
    with trio.CancelScope(deadline=trio.current_time() + cfg.first_token_timeout_s) as scope:
        async with client.decode(handoff, body, request_id=f"probe-{secrets.token_hex(6)}-d", trace=trace) as stream:
            async for chunk in stream:
                if chunk.kind == "token" and stream.tokens == chunk.count:
                    stream.watch_silence(scope, silence)
                    scope.deadline = trio.current_time() + silence
            if stream.tokens < PROBE_TOKENS:
                raise NarwhalError(f"probe stream ended after {stream.tokens} of {PROBE_TOKENS} tokens")
    if scope.cancelled_caught:
        raise trio.TooSlowError(
            "probe decode timed out (engine.first_token_timeout_s, then engine.decode_read_timeout_s)"
        )


async def _fresh_handoff(state: RouterState, producer: str, body: dict[str, Any], trace: TraceHeaders = ()) -> Any:
    """A handoff from ``producer`` (its client validates the descriptor against the
    producer's connector and KV endpoint); its failure makes the probe inconclusive."""
    try:
        with trio.fail_after(state.config.engine.first_token_timeout_s):
            prefill = await state.clients[producer].prefill(
                body, request_id=f"probe-{secrets.token_hex(6)}-p", trace=trace
            )
    except (NarwhalError, trio.TooSlowError) as exc:
        raise _Inconclusive(f"producer {producer} failed the probe handoff: {exc}") from exc
    return prefill


def _learned_model(state: RouterState, name: str) -> str | None:
    served = state.placement.models.get(name)
    return min(served) if served else None


def _probe_producer(state: RouterState, name: str) -> str | None:
    """A producer in placement (not ``name``) of the engine's model for a decode-only
    engine's probe handoff."""
    placement = state.placement
    loads = placement.loads
    model = state.engines[name].model or _learned_model(state, name)
    candidates = [
        n for n in placement.prefill_engines
        if n != name and state.breaker.available(n) and placement.serves(n, model)
    ]  # fmt: skip
    return min(candidates, key=lambda n: loads[n].prefill_tokens, default=None)


async def probe_engine(state: RouterState, name: str) -> bool | None:
    """Probe one engine: True (healthy), False (still failing), None (inconclusive)."""
    timeout = state.config.engine.first_token_timeout_s
    st = state.breaker.states[name]
    origin = st.origin_producer
    engine = state.engines[name]
    decode_path = engine.can_decode and (st.failed_leg == "decode" or not engine.can_prefill)
    tracing = state.tracing
    span = None
    if tracing is not None:
        path = "decode" if decode_path else "prefill"
        span = tracing.probe(name, f"{path} (after a {st.failed_leg or 'start-up'} failure)")
    trace = () if span is None else span.headers
    try:
        await _check_lifecycle(state, name)
        if name not in state.placement.models:
            # Its model is not known yet (it declares none and was down at start): ask
            # now, so that a decode probe's handoff comes from a producer of that model.
            await state.refresh_models([name])
        if decode_path and origin is not None:
            # Crossed decode: a fresh handoff from the original producer.
            handoff = await _fresh_handoff(state, origin, _probe_body(state, origin, decode=True), trace)
            await _decode_stream(state, name, handoff, trace=trace)
        elif decode_path and not engine.can_prefill:
            # A decode-only engine decodes through a handoff, as live traffic does.
            producer = _probe_producer(state, name)
            if producer is None:
                raise _Inconclusive("no producer in placement for the probe handoff")
            handoff = await _fresh_handoff(state, producer, _probe_body(state, producer, decode=True), trace)
            await _decode_stream(state, name, handoff, trace=trace)
        elif decode_path:
            await _decode_stream(state, name, None, _probe_body(state, name, decode=True), trace)
        else:
            # With a connector, a handoff: the client validates its descriptor.
            with trio.fail_after(timeout):
                await state.clients[name].prefill(
                    # (The prefill leg itself asks for one token and ignores EOS.)
                    _probe_body(state, name, decode=False),  # pragma: no mutate (equivalent: see above)
                    request_id=f"probe-{secrets.token_hex(6)}-p",
                    transfer=engine.connector is not None,
                    trace=trace,
                )
    except _Inconclusive as exc:
        if span is not None:
            span.finish("inconclusive", str(exc))
        state.breaker.probe_inconclusive(name, str(exc))
        return None
    except RouterOverloaded as exc:
        # The router's own descriptors or memory ran out: nothing about the engine.
        if span is not None:
            span.finish("inconclusive", str(exc))
        state.breaker.probe_inconclusive(name, str(exc))
        return None
    except (NarwhalError, trio.TooSlowError) as exc:
        detail = str(exc) or "probe timed out (engine.first_token_timeout_s)"
        if span is not None:
            span.finish("failed", detail, exc)
        state.breaker.probe_failed(name, detail)
        return False
    except BaseException as exc:  # cancelled (the router stops), or a bug: the span ends all the same
        if span is not None:
            span.finish("aborted", type(exc).__name__)
        raise
    if span is not None:
        span.finish("ok", None)
    state.breaker.readmit(name)
    # A readmitted engine may be a new generation: its models are asked again (an engine
    # unreachable at start is learned now), and it is priced only if its profile binds.
    await state.refresh_models([name])
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
                default=state.clock() + 3600,  # pragma: no mutate (equivalent: any idle wake-up)
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
            try:
                why = await state.clients[name].unhealthy()
            except RouterOverloaded as exc:
                why = str(exc)  # unknown at start: probed again like an engine that is down
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
