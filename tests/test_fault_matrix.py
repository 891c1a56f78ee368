"""The fault matrix: every scripted fault, by the leg it hits, by the client's mode.

Each case runs one request against a fresh router in front of ``p0`` (prefill) and
``d0`` (decode), in memory and in virtual time, and asserts what docs/failures.md
promises: the client's status (or, once a stream is committed, its terminal event),
the journal's terminal class, the breaker's state (``eject_after: 1``, so a counted
fault ejects its engine at once and an uncounted one leaves every streak at 0; each
role has one engine, so an ejection empties the role until a probe readmits it), and
the invariants: exactly one journal record carrying the request's id, no engine
generation left running, no reservation or in-flight count left, no connection or
task left once the stack closes, no internals (host names, exception text) in the
client's error.

The readmission probe is the fifth leg: an ejected engine meets a fault during its
probe, stays out, and comes back at the next probe once the fault is spent. Probes
have no client, so that leg has no client mode.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from narwhal.config import EngineTimeouts, FaultSpec, HandoffConfig
from narwhal.engines.stream import SILENCE_SLACK
from narwhal.router.breaker import Breaker

from .routerkit import Stack, engine, fleet_doc, open_stack

PROMPT = "one two three four"
BODY = {"prompt": PROMPT, "max_tokens": 6}
PREFILL_S = 0.010 + 1e-4 * 4  # routerkit's latency model for a 4-token prompt
STEP_S = 0.005
# The shipped defaults: the matrix runs what users run.
FIRST_TOKEN_S = EngineTimeouts().first_token_timeout_s
SILENCE_S = EngineTimeouts().decode_read_timeout_s
HANDOFF_S = HandoffConfig().max_age_s
# Internals a client's error body must never show: engine and KV host names
# (p0.test, p0.kv.test), library exception text, tracebacks.
_INTERNALS = (".test", "Errno", "Traceback", "httpx", "httpcore", "Exception")


def doc_for(**sections: Any) -> dict[str, Any]:
    recovery = {"eject_after": 1, "probe_interval_s": 1000.0, **sections.pop("recovery", {})}
    return fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), recovery=recovery, **sections
    )


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


@attrs.frozen
class Reply:
    status: int
    error: dict[str, Any] | None  # the error object (of the body or the terminal event)
    tokens: int  # token events received before the end (streaming)
    done: bool  # the stream ended with data: [DONE]
    request_id: str | None


async def send(stack: Stack, mode: str, rid: str, body: dict[str, Any] = BODY) -> Reply:
    """One request in ``mode`` ("stream" or "plain") with ``x-request-id: rid``."""
    headers = {"x-request-id": rid}
    if mode == "plain":
        resp = await stack.client.post("/v1/completions", json=body, headers=headers)
        doc = resp.json()
        return Reply(resp.status_code, doc.get("error"), 0, False, resp.headers.get("x-request-id"))
    events: list[Any] = []
    async with stack.client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as resp:
        raw = await resp.aread()
    if resp.status_code != 200:
        return Reply(resp.status_code, json.loads(raw)["error"], 0, False, resp.headers.get("x-request-id"))
    for event in raw.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: "), raw
            payload = event[len(b"data: ") :].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    done = events[-1:] == ["[DONE]"]
    error = events[-1].get("error") if events and isinstance(events[-1], dict) else None
    tokens = sum(1 for e in events if isinstance(e, dict) and e.get("choices"))
    return Reply(200, error, tokens, done, resp.headers.get("x-request-id"))


async def settled(stack: Stack) -> None:
    """Every engine generation and router count back to rest (after a request)."""
    await trio.testing.wait_all_tasks_blocked()
    for name, sim in stack.fleet.engines.items():
        assert sim.stats.active == 0, f"{name} still runs a generation"
    assert stack.router.server.in_flight == 0
    stack.assert_clean()


def assert_public(error: dict[str, Any]) -> None:
    assert isinstance(error.get("message"), str) and error["message"]
    for word in _INTERNALS:
        assert word not in error["message"], error


# ---------------------------------------------------------------- the client legs


@attrs.frozen
class Case:
    """One fault on one leg.

    Attributes:
        id: test id.
        engine: the engine the fault is injected into.
        fault: the fault.
        status: client status before commit (both modes), or the plain status when
            ``event`` is set.
        event: ``type`` of the streaming client's terminal event (committed 200), or
            None; its ``code`` is OpenAI's (a string or null), never a status.
        klass: the journal's terminal class.
        culprit: the engine the breaker must count the fault against (None: no one).
        elapsed: the exact virtual time the request takes, when it is a timeout.
        late: how much later than ``elapsed`` it may end (a deadline kept with a slack).
        message: a fragment the client's error message holds.
        sections: fleet document overrides.
        restart_producer_at: restart p0 this long after the request starts.
        also: more faults, as (engine, fault) pairs.
    """

    id: str
    engine: str
    fault: FaultSpec
    status: int
    klass: str
    culprit: str | None
    event: str | None = None
    elapsed: float | None = None
    late: float = 0.0
    message: str | None = None
    sections: dict[str, Any] = attrs.field(factory=dict)
    restart_producer_at: float | None = None
    also: tuple[tuple[str, FaultSpec], ...] = ()


def _prefill(kind: str, status: int, klass: str, culprit: str | None = "p0", **kw: Any) -> Case:
    fault = kw.pop("fault", None) or FaultSpec(kind=kind, on="prefill")  # type: ignore[arg-type]
    return Case(f"prefill-{kw.pop('id', kind)}", "p0", fault, status, klass, culprit, **kw)


def _decode(kind: str, status: int, klass: str, culprit: str | None = "d0", **kw: Any) -> Case:
    fault = kw.pop("fault", None) or FaultSpec(kind=kind, on="decode")  # type: ignore[arg-type]
    return Case(f"{kw.pop('leg', 'decode-before-token')}-{kw.pop('id', kind)}", "d0", fault, status, klass, culprit, **kw)


_AFTER = {"after_tokens": 2, "on": "decode"}

CASES = [
    # Prefill leg: the producer fails; a prefill error is always an ordinary HTTP error.
    _prefill("refuse_connection", 502, "prefill_failed", fault=FaultSpec(kind="refuse_connection")),
    _prefill("delay_headers", 504, "prefill_failed",
             fault=FaultSpec(kind="delay_headers", on="prefill", delay_s=HANDOFF_S + 10),
             elapsed=HANDOFF_S, message="handoff.max_age_s"),
    _prefill("http_error", 502, "prefill_failed", id="http_error-500"),
    _prefill("http_error", 502, "prefill_failed", id="http_error-503",
             fault=FaultSpec(kind="http_error", on="prefill", status=503)),
    # The engine's own timeout is timeout-shaped: 504.
    _prefill("http_error", 504, "prefill_failed", id="http_error-408",
             fault=FaultSpec(kind="http_error", on="prefill", status=408)),
    # A 400 rejects the request's content: the client's fault, never the engine's.
    _prefill("http_error", 400, "invalid_request", None, id="http_error-400",
             fault=FaultSpec(kind="http_error", on="prefill", status=400, message="bad sampling")),
    _prefill("close_before_done", 502, "prefill_failed"),
    _prefill("done_before_token", 502, "invalid_descriptor", message="unexpected finish_reason"),
    _prefill("silence_after", 504, "prefill_failed", elapsed=HANDOFF_S),
    _prefill("error_in_stream", 502, "prefill_failed"),
    *[
        _prefill("malformed_descriptor", 502, "invalid_descriptor", id=f"malformed_descriptor-{variant}",
                 fault=FaultSpec(kind="malformed_descriptor", variant=variant), message=reason)
        for variant, reason in [
            ("missing_engine_id", "invalid KV handoff descriptor: missing engine identity"),
            ("missing_request_id", "invalid KV handoff descriptor: missing engine identity"),
            ("bad_block_ids", "invalid KV handoff descriptor: malformed block ids"),
            ("wrong_endpoint", "invalid KV handoff descriptor: endpoint mismatch"),
        ]
    ],
    _prefill("restart", 502, "prefill_failed"),
    # Transfer: the consumer pulls the producer's KV before its first token.
    _decode("slow_transfer", 504, "first_token_timeout", leg="transfer",
            fault=FaultSpec(kind="slow_transfer", on="decode", delay_s=FIRST_TOKEN_S + 10),
            elapsed=PREFILL_S + FIRST_TOKEN_S),
    # A slow producer leaves the consumer less of the handoff's age than the first-token
    # timeout: the handoff expires while the consumer holds it, which is the consumer's
    # first-token failure (the breaker counts it against the consumer).
    _decode("slow_transfer", 504, "handoff_expired", leg="transfer", id="slow_transfer-handoff_expired",
            fault=FaultSpec(kind="slow_transfer", on="decode", delay_s=HANDOFF_S),
            also=(("p0", FaultSpec(kind="delay_headers", on="prefill", delay_s=HANDOFF_S - FIRST_TOKEN_S / 2)),),
            elapsed=HANDOFF_S, message="handoff.max_age_s"),
    # The producer restarts after the prefill: its KV is gone and the consumer's pull
    # fails (a 500 after vLLM's 5 s); the breaker blames the consumer that answered it.
    _decode("restart", 502, "decode_failed", leg="transfer", id="producer_restart",
            fault=FaultSpec(kind="delay_headers", on="decode", delay_s=1.0), restart_producer_at=0.5,
            sections={"engine": {"first_token_timeout_s": 10.0}}, elapsed=PREFILL_S + 1.0 + 5.0),
    # Decode before the first token: still an ordinary HTTP error in both modes.
    _decode("refuse_connection", 502, "decode_failed", fault=FaultSpec(kind="refuse_connection")),
    _decode("delay_headers", 504, "first_token_timeout",
            fault=FaultSpec(kind="delay_headers", on="decode", delay_s=FIRST_TOKEN_S + 10),
            elapsed=PREFILL_S + FIRST_TOKEN_S, message="first_token_timeout_s"),
    _decode("http_error", 502, "decode_failed", id="http_error-500"),
    _decode("http_error", 504, "decode_failed", id="http_error-504",
            fault=FaultSpec(kind="http_error", on="decode", status=504)),
    _decode("http_error", 400, "invalid_request", None, id="http_error-400",
            fault=FaultSpec(kind="http_error", on="decode", status=400, message="bad sampling")),
    _decode("close_before_done", 502, "decode_failed"),
    _decode("done_before_token", 502, "decode_failed", message="stream ended with [DONE] before any token arrived"),
    _decode("silence_after", 504, "first_token_timeout", elapsed=PREFILL_S + FIRST_TOKEN_S),
    _decode("error_in_stream", 503, "decode_failed",
            fault=FaultSpec(kind="error_in_stream", on="decode", status=503, message="overloaded"), message="overloaded"),
    _decode("restart", 502, "decode_failed"),
    # Decode after the first token: a committed stream ends with a terminal event.
    _decode("close_before_done", 502, "decode_failed", leg="decode-after-token", event="engine_error",
            fault=FaultSpec(kind="close_before_done", **_AFTER)),  # type: ignore[arg-type]
    _decode("silence_after", 504, "silence_timeout", leg="decode-after-token", event="timeout_error",
            fault=FaultSpec(kind="silence_after", **_AFTER),  # type: ignore[arg-type]
            elapsed=PREFILL_S + 2 * STEP_S + SILENCE_S, late=SILENCE_S * SILENCE_SLACK, message="engine went silent between tokens"),
    _decode("error_in_stream", 503, "decode_failed", leg="decode-after-token", event="engine_error",
            fault=FaultSpec(kind="error_in_stream", status=503, **_AFTER)),  # type: ignore[arg-type]
    _decode("restart", 502, "decode_failed", leg="decode-after-token", event="engine_error",
            fault=FaultSpec(kind="restart", **_AFTER)),  # type: ignore[arg-type]
]


def test_the_matrix_covers_every_fault() -> None:
    from narwhal.config import FAULT_KINDS

    kinds = {c.fault.kind for c in CASES}
    assert kinds == set(FAULT_KINDS)
    legs = {c.id.rsplit("-", 1)[0].split("-")[0] for c in CASES}
    assert {"prefill", "transfer", "decode"} <= legs


@pytest.mark.parametrize("mode", ["stream", "plain"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_fault(autojump_clock: trio.abc.Clock, case: Case, mode: str) -> None:
    tasks_before = count_tasks()
    rid = f"matrix-{case.id}-{mode}"
    async with open_stack(doc_for(**case.sections)) as stack:
        breaker = stack.router.state.breaker
        stack.engine(case.engine).inject(case.fault)
        for name, fault in case.also:
            stack.engine(name).inject(fault)
        async with trio.open_nursery() as nursery:
            if case.restart_producer_at is not None:

                async def restart_producer() -> None:
                    await trio.sleep(case.restart_producer_at)  # type: ignore[arg-type]
                    stack.engine("p0").trigger_restart()

                nursery.start_soon(restart_producer)
            t0 = trio.current_time()
            reply = await send(stack, mode, rid)
            elapsed = trio.current_time() - t0

        # What the client saw.
        assert reply.request_id == rid
        if mode == "stream" and case.event is not None:
            assert reply.status == 200
            assert reply.tokens == 2 and not reply.done
            assert reply.error is not None and reply.error["type"] == case.event
            assert reply.error["code"] is None
        else:
            assert reply.status == case.status
            assert reply.error is not None
        assert_public(reply.error)
        if case.message is not None:
            assert case.message in reply.error["message"]
        if case.elapsed is not None:
            assert case.elapsed - 1e-6 <= elapsed <= case.elapsed + case.late + 1e-6, elapsed

        # The journal: one record, this request's, with the terminal class.
        [record] = stack.records
        assert record["request_id"] == rid
        assert record["terminal_class"] == case.klass
        assert record["status"] == (200 if mode == "stream" and case.event is not None else case.status)
        assert record["error"]
        assert PROMPT not in json.dumps(record)

        # The breaker (eject_after 1): the culprit is ejected, nobody else is touched.
        for name, st in breaker.states.items():
            if name == case.culprit:
                assert st.ejected and st.streak == 1 and not breaker.available(name), (name, st)
            else:
                assert not st.ejected and st.streak == 0, (name, st)
        assert [t.event for t in breaker.transitions] == (["ejected"] if case.culprit else [])
        if case.klass == "invalid_descriptor":
            # Rejected between the legs: the consumer never saw the handoff.
            assert [b for b in stack.engine("d0").requests_seen if "prompt" in b] == []

        await settled(stack)
    # open_stack checked that every connection is closed; no task outlived it either.
    assert count_tasks() == tasks_before


# ---------------------------------------------------------------- the readmission probe


@attrs.frozen
class ProbeCase:
    id: str
    target: str  # the ejected engine
    fault: FaultSpec  # meets the probe
    at: str  # the engine the fault is injected into
    outcome: str = "probe_failed"


def _probe(target: str, kind: str, **kw: Any) -> ProbeCase:
    on = "prefill" if target == "p0" else "decode"
    fault = kw.pop("fault", None) or FaultSpec(kind=kind, on=on, times=1)  # type: ignore[arg-type]
    return ProbeCase(f"{target}-{kw.pop('id', kind)}", target, fault, kw.pop("at", target), **kw)


PROBE_CASES = [
    *[
        _probe(target, "refuse_connection", fault=FaultSpec(kind="refuse_connection", times=1))
        for target in ("p0", "d0")
    ],
    *[
        _probe(target, "delay_headers", fault=FaultSpec(kind="delay_headers", on=on, delay_s=FIRST_TOKEN_S + 10, times=1))
        for target, on in (("p0", "prefill"), ("d0", "decode"))
    ],
    *[
        _probe(target, kind)
        for target in ("p0", "d0")
        for kind in ("http_error", "close_before_done", "done_before_token", "silence_after",
                     "error_in_stream")
    ],
    # A restart the engine is back from at once is no fault to the probe (the new
    # generation serves it); one with downtime is.
    *[
        _probe(target, "restart", fault=FaultSpec(kind="restart", on=on, delay_s=1.0, times=1))
        for target, on in (("p0", "prefill"), ("d0", "decode"))
    ],
    _probe("p0", "malformed_descriptor",
           fault=FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint", times=1)),
    _probe("d0", "slow_transfer",
           fault=FaultSpec(kind="slow_transfer", on="decode", delay_s=FIRST_TOKEN_S + 10, times=1)),
    # The probe replays the failing path: a decode streamed past its first token, so a
    # consumer that goes silent mid-stream (or closes the stream) is not readmitted.
    _probe("d0", "silence_after-2", fault=FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1)),
    _probe("d0", "close_before_done-2",
           fault=FaultSpec(kind="close_before_done", on="decode", after_tokens=2, times=1)),
    # The consumer's probe needs a fresh handoff from the original producer; when that
    # producer fails, the probe cannot judge the consumer.
    _probe("d0", "origin_producer_fails", at="p0",
           fault=FaultSpec(kind="http_error", on="prefill", times=1), outcome="probe_inconclusive"),
]


async def transition(breaker: Breaker, n: int) -> None:
    """Wait (virtual time) until the breaker has made ``n`` transitions."""
    reached = trio.Event()

    def check(_: object = None) -> None:
        if len(breaker.transitions) >= n:
            reached.set()

    breaker.add_listener(check)
    check()
    with trio.fail_after(60):
        await reached.wait()


@pytest.mark.parametrize("case", PROBE_CASES, ids=[c.id for c in PROBE_CASES])
async def test_fault_during_readmission_probe(autojump_clock: trio.abc.Clock, case: ProbeCase) -> None:
    interval = 5.0
    async with open_stack(doc_for(recovery={"probe_interval_s": interval})) as stack:
        breaker = stack.router.state.breaker
        st = breaker.states[case.target]
        # Eject the target with one failed request.
        on = "prefill" if case.target == "p0" else "decode"
        stack.engine(case.target).inject(FaultSpec(kind="http_error", on=on, times=1))
        assert (await stack.complete(BODY)).status_code == 502
        assert st.ejected
        stack.engine(case.at).inject(case.fault)

        ejected_at = trio.current_time()

        # It is its role's only engine: the role is empty (the router not ready, a
        # request refused at once) until a probe readmits it.
        assert [t.event for t in breaker.transitions] == ["ejected"]
        assert not stack.router.state.ready()
        assert (await stack.complete(BODY)).status_code == 503

        # The first probe meets the fault (each probe leg is bounded by the first-token
        # timeout, a decode's silence by the read timeout): the engine stays ejected
        # and is probed again a full interval later.
        await transition(breaker, 2)
        failed_at = trio.current_time()
        assert failed_at - ejected_at <= interval + 2 * FIRST_TOKEN_S + SILENCE_S * (1 + SILENCE_SLACK) + 0.1
        assert [t.event for t in breaker.transitions] == ["ejected", case.outcome]
        assert st.ejected and st.probes == 1
        # The fault is spent: the next probe readmits it and requests flow again.
        await transition(breaker, 3)
        assert trio.current_time() - failed_at >= interval
        assert [t.event for t in breaker.transitions] == ["ejected", case.outcome, "readmitted"]
        assert not st.ejected and stack.router.state.ready()
        assert (await stack.complete(BODY)).status_code == 200
        # Probes are not client requests: three requests, three records.
        assert [r["terminal_class"] for r in stack.records] == [f"{on}_failed", "no_engine", "ok"]
        await settled(stack)


# ---------------------------------------------------------------- a token at its deadline


@pytest.mark.parametrize("mode", ["stream", "plain"])
async def test_first_token_arriving_as_its_deadline_passes(
    autojump_clock: trio.abc.Clock, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the wall clock a token can be read in the same scheduler tick in which the
    # first-token deadline expires: the router then holds a token while its decode
    # scope is already cancelled. Reproduced here by reading the first token under a
    # shield past the deadline. Before: the router began the 200, was cancelled
    # inside that write, and answered nothing at all (journal: 504 silence_timeout).
    from narwhal.engines.stream import DecodeStream

    original = DecodeStream.__anext__

    async def late_first_token(self: DecodeStream) -> Any:
        chunk = await original(self)
        if chunk.kind == "token" and self.tokens == chunk.count:
            with trio.CancelScope(shield=True):
                await trio.sleep(FIRST_TOKEN_S)
        return chunk

    monkeypatch.setattr(DecodeStream, "__anext__", late_first_token)
    async with open_stack(doc_for(recovery={"eject_after": 100})) as stack:
        reply = await send(stack, mode, "late")
        assert reply.status == 504
        assert reply.error is not None and "first_token_timeout_s" in reply.error["message"]
        [record] = stack.records
        assert (record["terminal_class"], record["status"]) == ("first_token_timeout", 504)
        await settled(stack)
