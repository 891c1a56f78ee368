"""One client request from arrival to its terminal outcome.

A :class:`RequestLifecycle` runs inside the HTTP handler's task; the server cancels
that task when the client disconnects, so everything the request started (the
prefill leg, the decode stream, reservations) is cancelled with it. Deadlines are
cancel scopes:

- the request deadline (``engine.request_timeout_s`` from arrival) wraps everything;
- the handoff deadline (``handoff.max_age_s`` from the start of the producer HTTP leg)
  bounds the prefill leg and, for a remote decode, the decode leg until its first
  token (a same-worker decode has no handoff to age);
- the first-token deadline (``engine.first_token_timeout_s``) starts before the decode
  stream is opened, so connect and response headers consume it;
- after the first token, ``engine.decode_read_timeout_s`` bounds the silence between
  transport chunks (any bytes reset it: metadata, SSE comments, part of an event; zero
  leaves only the request deadline).

A deadline that fires is blamed on the engine whose leg held the time: a handoff that
expires after the producer answered, before the consumer's first token, counts against
the consumer (as a first-token failure), and the attempt's journal entry names the
deadline (``deadline``) and that engine (``held_by``).

One scope carries the decode leg's deadlines and is moved as the stream advances, in
steps of a slack (the silence bound may end a stream up to 1/64 of the bound late,
never early), so most tokens cost no deadline assignment at all. The HTTP 200 of a
streaming answer is committed at the first generated token: every failure before it is
an ordinary HTTP error; after it, the stream ends with a terminal ``data: {"error": ...}``
event.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import trio

from narwhal.engines.client import EngineClient
from narwhal.engines.connector import PrefillResult, RequestKind
from narwhal.errors import (
    ClientError,
    DeadlineExceeded,
    EngineError,
    EngineTimeout,
    FirstTokenTimeout,
    HandoffExpired,
    InvalidDescriptor,
    NarwhalError,
    RateLimited,
    Refused,
    RouterOverloaded,
    SilenceTimeout,
)
from narwhal.http.server import JSON_HEADERS, Request, ResponseWriter
from narwhal.router.admission import Ticket
from narwhal.router.cacheplan import PlanTicket
from narwhal.router.cacheviews import Hold
from narwhal.router.journal import AttemptRecord, RequestRecord
from narwhal.router.placement import Reservation
from narwhal.router.requests import (
    ParsedRequest,
    ResponseAccumulator,
    StreamShaper,
    context_length_exceeded,
    engine_context_length,
    error_event,
    parse_request,
)
from narwhal.router.resume import StreamLedger, open_ledger, resume_after
from narwhal.router.state import PromptCount, RouterState
from narwhal.tracing import RequestTrace

__all__ = ["RequestLifecycle", "terminal_class_for"]

log = logging.getLogger("narwhal.router")

_SSE_HEADERS = (
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
)
_DONE = b"data: [DONE]\n\n"
#: Header names, lower-case (names are case-insensitive on the wire).
_REQUEST_ID = "x-request-id"
_RETRY_AFTER = "retry-after"
#: The header naming a request's session (a hint for the cache plan), and the most of
#: it (or of the request's ``user`` field) kept.
_SESSION_ID = "x-session-id"
SESSION_HINT_MAX = 200
#: The most time a failure answer may take to write (a client that stopped reading).
_ANSWER_WRITE_S = 5.0


def terminal_class_for(err: NarwhalError) -> str:
    """The journal's terminal class for an error."""
    if isinstance(err, EngineError):
        if isinstance(err, RouterOverloaded):
            return "router_overloaded"  # the router's own fault, whichever leg met it
        if err.client_fault:
            return "invalid_request"
        if isinstance(err, InvalidDescriptor):
            return "invalid_descriptor"
        if isinstance(err, (FirstTokenTimeout, SilenceTimeout, HandoffExpired)):
            return err.terminal_class
        return "prefill_failed" if err.leg == "prefill" else "decode_failed"
    if isinstance(err, DeadlineExceeded):
        return "deadline_exceeded"
    if isinstance(err, (Refused, RateLimited)):
        return err.terminal_class  # refused, no_engine, or rate_limited
    if isinstance(err, ClientError):
        return "invalid_request"
    return "internal_error"


#: Request ids: a random prefix per process and a counter (unique without a system
#: call per request; workers draw different prefixes).
_ID_PREFIX = secrets.token_hex(6)
_ids = itertools.count(1)


def _calibrated(predicted: Callable[[str], int], factor: Callable[[str], float]) -> Callable[[str], int]:
    """Predicted hits priced at the share of them that materializes on each engine."""

    def cached(name: str) -> int:
        return int(predicted(name) * factor(name))

    return cached


def _new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ids):012x}"


class RequestLifecycle:
    """Runs one ``/v1/completions`` or ``/v1/chat/completions`` request."""

    def __init__(
        self, state: RouterState, request: Request, response: ResponseWriter, kind: RequestKind,
        key_name: str | None = None,
    ) -> None:
        """``key_name``: the name of the API key the request presented (its tenant's)."""
        self.state = state
        self.request = request
        self.response = response
        self.kind = kind
        #: The fleet document as it was at arrival: a reload's new deadlines apply to
        #: requests that arrive after it.
        self.config = state.config
        self.arrival = state.clock()
        rid = request.header(_REQUEST_ID)
        # Echoed in headers to the client and the engines: printable ASCII only.
        ok = rid is not None and 0 < len(rid) <= 200 and rid.isascii() and rid.isprintable()
        self.request_id = rid if rid is not None and ok else _new_request_id()
        self.record = RequestRecord(
            request_id=self.request_id, arrival=time.time(), route=kind
        )
        #: The request's spans (None: tracing is off).
        self.trace: RequestTrace | None = None
        tracing = state.tracing
        if tracing is not None:
            self.trace = tracing.request(request, kind, request.path, self.request_id)
            self.record.trace_id = self.trace.trace_id
        # (Both set by _serve before any read.)
        self.parsed: ParsedRequest | None = None  # pragma: no mutate (equivalent: set before read)
        self.prompt: PromptCount | None = None  # pragma: no mutate (equivalent: set before read)
        self.key_name = key_name
        #: Its tenant and class (set by _serve; None until then).
        self.ticket: Ticket | None = None
        self.committed = False  # pragma: no mutate (equivalent: None is falsy alike; True is killed)
        self.visible = False  # pragma: no mutate (equivalent: None is falsy alike; True is killed)
        #: Streamed events received but not yet written (sent before a terminal event).
        self._unsent: list[bytes] = []
        self.tokens = 0
        # (Both set by _serve, from the prompt's count, before any read.)
        self.prompt_tokens = 0  # pragma: no mutate (equivalent: set before read)
        self.max_tokens = 0  # pragma: no mutate (equivalent: set before read)
        #: The engine whose leg is running (the one a deadline that fires now blames).
        self._holder: str | None = None  # pragma: no mutate (equivalent: _attempt sets it before any read)
        #: What the stream delivered, when a failure after output may be resumed
        #: (``recovery.resume_streams``); its ``current`` continuation is the attempt's request.
        self.ledger: StreamLedger | None = None
        #: The attempt's blocks in the approximate views of its engines, by role, until
        #: it ends there (the producer's until the consumer has its KV).
        self._holds: dict[str, Hold] = {}
        #: The attempt's ticket of the cache plan (None: no plan).
        self._ticket: PlanTicket | None = None

    # ------------------------------------------------------------------ entry point

    async def run(self) -> None:
        state = self.state
        record = self.record
        state.in_flight += 1
        try:
            with trio.CancelScope(deadline=self.arrival + self.config.engine.request_timeout_s) as deadline:
                await self._serve()
            if deadline.cancelled_caught:
                raise DeadlineExceeded("request deadline exceeded (engine.request_timeout_s)")
            record.terminal_class = "ok"
            record.status = 200
        except NarwhalError as err:
            record.terminal_class = terminal_class_for(err)
            record.error = err.message
            if isinstance(err, DeadlineExceeded) and record.attempts:
                last = record.attempts[-1]
                if last.outcome == "pending":
                    last.deadline = "engine.request_timeout_s"
                    last.held_by = self._holder
            await self._fail(err)
        except trio.Cancelled:
            if self.request.disconnected.is_set():
                record.terminal_class = "client_cancelled"
                record.status = 200 if self.committed else 499
                # (Gone, or stopped reading for server.send_timeout_s: the server says which.)
                record.error = self.request.disconnect_reason or "client disconnected"
            else:
                # The shutdown grace period is over: the client still gets its answer
                # (503 before the first token, a terminal event after it).
                record.terminal_class = "shutdown"
                record.error = "router shutting down"
                record.status = 503  # (_fail makes it 200 when it ends a committed stream)
                # Not a response whose head is being written (it cannot become a 503); a
                # finished one takes no terminal event (its end() writes nothing more).
                if self.committed or not self.response.started:
                    await self._fail(Refused("router shutting down"))
            raise
        except Exception as exc:
            log.exception("request %s failed with an internal error", self.request_id)
            record.terminal_class = "internal_error"
            record.error = f"{type(exc).__name__}"
            await self._fail(NarwhalError("internal error"))
        finally:
            # An attempt the request ended in (refused in placement, cut by a deadline,
            # a disconnect or shutdown, an error of the router's own) ends as it did.
            if record.attempts and record.attempts[-1].outcome == "pending":
                record.attempts[-1].outcome = record.terminal_class
            state.in_flight -= 1
            record.latency_s = state.clock() - self.arrival
            record.output_len = self.tokens
            ticket = self.ticket
            if ticket is not None and ticket.tenant is not None:
                record.queued_s = ticket.queued_s
                record.queue_reason = ticket.queue_reason
                await state.admission.release(ticket, self.tokens, self.max_tokens)
            if self.trace is not None:
                self.trace.finish(record)
            state.journal.record(record)
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "request %s %s status=%s class=%s tokens=%d",
                    self.request_id, self.kind, record.status, record.terminal_class, self.tokens,
                    extra={
                        "request_id": self.request_id,
                        "route": self.kind,
                        "status": record.status,
                        "terminal_class": record.terminal_class,
                        "output_len": self.tokens,
                        "producer": record.producer,
                        "consumer": record.consumer,
                        "latency_s": record.latency_s,
                    },
                )

    async def _fail(self, err: NarwhalError) -> None:
        """Tell the client: an HTTP error before commit, a terminal event after."""
        resp = self.response
        if not self.committed:
            self.record.status = err.http_status
            headers = [*JSON_HEADERS, (_REQUEST_ID, self.request_id)]
            retry_after = getattr(err, "retry_after_s", None)
            if retry_after is not None:
                headers.append((_RETRY_AFTER, str(max(1, math.ceil(retry_after)))))
            with trio.move_on_after(_ANSWER_WRITE_S, shield=True):
                await resp.respond(err.http_status, headers, json.dumps(err.to_body()).encode())
        else:
            self.record.status = 200
            data = b"".join((*self._unsent, error_event(err)))
            self._unsent.clear()
            with trio.move_on_after(_ANSWER_WRITE_S, shield=True):
                await resp.end(data)

    # ------------------------------------------------------------------ the request

    async def _serve(self) -> None:
        state = self.state
        if state.in_flight > self.config.server.max_concurrent_requests:
            raise Refused("too many concurrent requests (server.max_concurrent_requests)")
        parsed = self.parsed = parse_request(self.request.body, self.kind)
        record = self.record
        admission = state.admission
        ticket = self.ticket = admission.ticket(self.request.header, self.key_name, parsed.body)
        if ticket.tenant is not None:
            record.tenant = ticket.tenant.name
            record.latency_class = ticket.latency_class.name
            if self.trace is not None:
                self.trace.admitted(ticket.tenant.name, ticket.latency_class.name)
        record.stream = parsed.stream
        model = record.model = state.model_of(parsed.model)
        tok = self.prompt = await state.count_prompt(parsed.body, self.kind)
        self.prompt_tokens = tok.count
        record.prompt_tokens = tok.count if tok.exact else None  # the producer's count, later
        max_model_len = _max_model_len(state, model, tok.max_model_len)
        self.max_tokens = parsed.output_limit(tok.count, max_model_len)
        record.requested_output_len = self.max_tokens
        # An estimate is not grounds for refusing: the engines check the exact length.
        if tok.exact and max_model_len is not None and tok.count + self.max_tokens > max_model_len:
            raise context_length_exceeded(max_model_len, tok.count, self.max_tokens)
        if ticket.tenant is not None:
            await admission.admit(ticket, tok.count, self.max_tokens)
        state.retry_budget.note_request()
        if self.config.recovery.resume_streams:
            self.ledger = open_ledger(parsed, self.request_id)
        max_attempts = self.config.recovery.max_attempts
        tried: set[str] = set()
        n = 0
        while True:
            n += 1
            attempt = AttemptRecord(n=n)
            record.attempts.append(attempt)
            if self.trace is not None:
                self.trace.attempt(attempt)
            cont = self.ledger.current if self.ledger is not None else None
            if cont is None:
                record.ttft_s = None  # this attempt's, once its prefill completes
            else:  # a resume: the request's first token (and TTFT) came before it
                attempt.resume = cont.cause
                attempt.resumed_at_s = cont.at
            try:
                await self._attempt(attempt, frozenset(tried))
                attempt.outcome = "ok"
                return
            except EngineError as err:
                attempt.outcome = terminal_class_for(err)
                attempt.error = err.message
                if err.deadline is not None:
                    attempt.deadline = err.deadline
                    attempt.held_by = err.engine
                if err.engine:
                    tried.add(err.engine)
                if self.visible and await resume_after(self, err, attempt):
                    continue  # the same stream, continued by a new attempt
                if not self._may_retry(err, n, max_attempts):
                    # An engine's 400 for an over-long prompt reads as the router's own.
                    over = engine_context_length(err, parsed, record.prompt_tokens)
                    if over is not None:
                        raise over from err  # (the engine's error: the traceback shows both)
                    raise

    def _may_retry(self, err: EngineError, n: int, max_attempts: int) -> bool:
        if self.visible or self.committed or not err.transient or n >= max_attempts:
            return False
        # The request deadline must still leave a fresh attempt the time it may take to
        # reach a first token (engine.first_token_timeout_s), not merely some time.
        cfg = self.config.engine
        remaining = self.arrival + cfg.request_timeout_s - self.state.clock()
        if remaining < cfg.first_token_timeout_s:
            return False
        return self.state.retry_budget.try_acquire()

    async def _attempt(self, attempt: AttemptRecord, avoid: frozenset[str]) -> None:
        state = self.state
        self._holder = None  # placement's wait is no engine's time
        admitted = self.ticket
        assert admitted is not None  # (set by _serve before the first attempt)
        slo_ttft = admitted.latency_class.ttft_s  # its class's (controller.slo's without tenancy)
        deadline = self.arrival + self.config.engine.request_timeout_s
        placed_at = state.clock()
        attempt.started_s = placed_at - self.arrival
        cont = self.ledger.current if self.ledger is not None else None
        prompt, prompt_tokens, max_tokens, elapsed = self.prompt, self.prompt_tokens, self.max_tokens, placed_at - self.arrival
        if cont is not None:
            # A resume waits for a placement no longer than a first token may take.
            prompt, prompt_tokens, max_tokens, elapsed = cont.prompt, cont.prompt.count, cont.max_tokens, 0.0
            deadline = min(deadline, placed_at + self.config.engine.first_token_timeout_s)
        elif slo_ttft is not None:
            deadline = min(deadline, self.arrival + slo_ttft)
        assert prompt is not None  # counted before the first attempt
        ids = prompt.ids
        prefix = state.prefix
        # The prompt's block chain is looked up once; each candidate engine's hit is then
        # a walk over its ids.
        lookup = prefix.lookup(ids) if ids is not None and prefix.active else None
        predicted = lookup.cached_tokens if lookup is not None else None
        # Hits are priced at the share of the predicted ones that materialize there.
        calibration = state.cache_cal
        cached: Callable[[str], int] | None = predicted
        if predicted is not None and calibration.factors:
            cached = _calibrated(predicted, calibration.factor)

        plan = state.cache_plan
        ticket = None
        if plan is not None and self.config.controller.cache_plan == "auto":
            hint = self._session_hint()
            if lookup is not None or hint is not None:
                ticket = plan.classify(lookup, hint, plan.block_size(), ids)
        self._ticket = ticket
        trace = self.trace
        if trace is not None:
            trace.placing(state.placement, self.record.model, avoid)
        try:
            # Placement against the request's class's targets (its TTFT bounds the wait).
            reservation = await state.admission.acquire(
                admitted, prompt_tokens, max_tokens, arrival=self.arrival, deadline=deadline, avoid=avoid,
                elapsed_s=elapsed, cached=cached, model=self.record.model, prompt_ids=ids,
                held=lookup.held_chain if lookup is not None else None, plan=ticket,
            )  # fmt: skip
        except Refused as err:
            attempt.placement = err.placement
            raise
        finally:
            attempt.placement_wait_s = state.clock() - placed_at
        attempt.predicted_ttft_s = reservation.predicted_ttft_s
        attempt.predicted_tpot_s = reservation.predicted_tpot_s
        attempt.placement = reservation.explain
        # The hits the index predicted, read again (nothing changed since); only for an
        # engine whose cache the index sees (None: not predicted, not a miss).
        if predicted is not None and prefix.enabled(reservation.producer):
            attempt.predicted_cached_tokens = predicted(reservation.producer)
        if predicted is not None and not reservation.same_worker and prefix.enabled(reservation.consumer):
            # What the consumer holds it need not pull from the producer.
            attempt.consumer_predicted_cached_tokens = predicted(reservation.consumer)
        if ticket is not None and plan is not None:
            plan.placed(ticket, reservation.producer, prompt_tokens, reservation.predicted_work_s or 0.0)
        if lookup is not None and prefix.exact(reservation.producer):
            prefix.touch(reservation.producer, lookup.held_chain(reservation.producer)[0])
        with reservation:
            attempt.producer = reservation.producer
            attempt.consumer = reservation.consumer
            attempt.same_worker = reservation.same_worker
            self.record.producer = reservation.producer
            self.record.consumer = reservation.consumer
            if trace is not None:
                trace.placed(attempt)
            suffix = f"{next(_ids):x}"  # unique even when clients reuse an x-request-id
            attempt.prefill_request_id = f"{self.request_id}-{attempt.n}-{suffix}-p"
            attempt.decode_request_id = f"{self.request_id}-{attempt.n}-{suffix}-d"
            try:
                await self._legs(attempt, reservation)
            except EngineError as err:
                # The engine the error names, else the engine of the leg that failed (the
                # router's own deadlines name only the leg).
                culprit = err.engine or (reservation.producer if err.leg == "prefill" else reservation.consumer)
                err.engine = culprit
                if trace is not None:
                    trace.failed(err, self.tokens)
                if err.engine_fault:
                    state.breaker.record_failure(
                        culprit, err.message, origin_producer=reservation.producer, leg=err.leg
                    )
                raise
            finally:
                self._release_holds()
        state.breaker.record_success(reservation.producer)
        state.breaker.record_success(reservation.consumer)

    def _session_hint(self) -> str | None:
        """The session the client names, if any: its ``x-session-id`` header, else the
        request's ``user`` field (at most :data:`SESSION_HINT_MAX` characters of either)."""
        hint = self.request.header(_SESSION_ID)
        if not hint:
            parsed = self.parsed
            user = parsed.body.get("user") if parsed is not None else None
            hint = user if isinstance(user, str) else None
        return hint[:SESSION_HINT_MAX] if hint else None

    def _hold(self, role: str, engine: str, ids: tuple[int, ...], extra_tokens: int) -> None:
        """The attempt's request holds its blocks on ``engine`` (approximate views)."""
        ticket = self._ticket
        chain, bs = (ticket.chain, ticket.block_size) if ticket is not None else ((), 0)
        hold = self.state.prefix.hold(engine, ids, extra_tokens, chain, bs)
        if hold is not None:
            self._holds[role] = hold

    def _release_holds(self, role: str | None = None) -> None:
        """The attempt's request ended on its engines (``role``: on that one only)."""
        for key in [role] if role is not None else list(self._holds):
            hold = self._holds.pop(key, None)
            if hold is not None:
                hold.release()

    async def _legs(self, attempt: AttemptRecord, reservation: Reservation) -> None:
        state = self.state
        cfg = self.config
        parsed = self.parsed
        assert parsed is not None
        producer = state.clients[reservation.producer]
        consumer = state.clients[reservation.consumer]
        same_worker = reservation.same_worker

        # Prefill leg: the handoff's age starts with the producer HTTP leg.
        handoff_start = state.clock()
        handoff_deadline = handoff_start + cfg.handoff.max_age_s
        self._holder = reservation.producer
        cont = self.ledger.current if self.ledger is not None else None
        prompt = self.prompt if cont is None else cont.prompt
        assert prompt is not None  # counted before the first attempt
        ids = prompt.ids
        body, kind = (parsed.body, self.kind) if cont is None else (cont.body, "completions")
        output_limit = self.max_tokens if cont is None else cont.max_tokens
        if ids is not None:
            # The producer caches the prompt's blocks when it schedules it, before computing
            # them (vLLM's allocate_slots): a prompt queued behind this one hits them. It
            # holds them until the consumer has pulled them (or, on one worker, until the
            # decode ends).
            self._hold("producer", reservation.producer, ids, output_limit if same_worker else 1)
        trace = self.trace
        headers = () if trace is None else trace.prefill(reservation.producer, attempt.prefill_request_id)
        with trio.CancelScope(deadline=handoff_deadline) as scope:
            state.in_flight_by_engine[reservation.producer] += 1
            try:
                prefill = await producer.prefill(
                    body,
                    kind=kind,
                    request_id=attempt.prefill_request_id,
                    transfer=not same_worker,
                    trace=headers,
                )
            finally:
                state.in_flight_by_engine[reservation.producer] -= 1
        if scope.cancelled_caught:
            raise EngineTimeout(
                f"prefill did not complete within handoff.max_age_s ({cfg.handoff.max_age_s:g} s)",
                leg="prefill",
                deadline="handoff.max_age_s",
            )
        prefill_done = state.clock()
        reservation.release_prefill(done=True)
        if trace is not None:
            trace.prefilled(prefill, cfg.handoff.max_age_s)
        attempt.cached_tokens = prefill.cached_tokens
        if ids is not None and not same_worker:  # a consumer caches what it pulls, and holds it while it decodes
            self._hold("consumer", reservation.consumer, ids, output_limit)
        counted = prefill.prompt_tokens if cont is None else None  # (a resume's prompt is not the client's)
        if counted is not None and counted > 0:
            if not prompt.exact:
                state.prompt_lengths_for(self.record.model).observe(self.kind, prompt.size, counted)
            self.prompt_tokens = counted
            self.record.prompt_tokens = counted
            if not prompt.exact:
                # The estimate let the request through; the exact count may not fit the
                # output it asks for: refuse before the decode leg rather than after.
                limit = _max_model_len(state, self.record.model)
                parsed = self.parsed
                assert parsed is not None
                if parsed.max_tokens is None:  # the engines' default follows the exact count
                    self.max_tokens = parsed.output_limit(counted, limit)
                    self.record.requested_output_len = self.max_tokens
                elif limit is not None and counted + self.max_tokens > limit:
                    raise context_length_exceeded(limit, counted, self.max_tokens)
        attempt.ttft_s = prefill_done - self.arrival
        if cont is None:
            self.record.ttft_s = attempt.ttft_s
        # The producer's client validated the descriptor against the producer's
        # configured connector and KV endpoint; the consumer's re-checks it on use.
        # A same-worker decode has no handoff: no handoff age bounds it.
        handoff = None if same_worker else prefill
        if same_worker:
            handoff_deadline = math.inf

        # Decode leg, under one scope whose deadline follows the stream.
        self._holder = reservation.consumer
        if not same_worker:
            # The producer lets the request's blocks go once the consumer pulled them: a
            # KV pull takes milliseconds, and a block freed a little early in the view errs
            # towards a miss the engine would have served, not a hit it no longer holds.
            self._release_holds("producer")
        await self._decode(consumer, handoff, attempt, reservation, handoff_deadline, prefill_done, body, kind)

    async def _decode(
        self,
        consumer: EngineClient,
        handoff: PrefillResult | None,
        attempt: AttemptRecord,
        reservation: Reservation,
        handoff_deadline: float,
        prefill_done: float,
        body: dict[str, Any],
        kind: RequestKind,
    ) -> None:
        state = self.state
        cfg = self.config.engine
        parsed = self.parsed
        assert parsed is not None
        clock = state.clock
        silence = cfg.decode_read_timeout_s if cfg.decode_read_timeout_s > 0 else math.inf
        first_token_deadline = clock() + cfg.first_token_timeout_s
        scope = trio.CancelScope(deadline=min(handoff_deadline, first_token_deadline))
        # A resumable request's events are parsed, noted and (a resume's) rewritten.
        ledger = self.ledger
        resumed = ledger is not None and ledger.current is not None
        if parsed.stream:
            acc = None
        elif ledger is None:
            acc = ResponseAccumulator(parsed, self.request_id, self.record.model or "")
        else:  # one answer across the attempts that continue the stream
            if ledger.acc is None or not resumed:
                ledger.acc = ResponseAccumulator(parsed, self.request_id, self.record.model or "")
            acc = ledger.acc
        if ledger is not None and not resumed:
            ledger.prefill_done = prefill_done
        shape = StreamShaper(parsed, self.request_id)
        forward_meta = parsed.include_usage
        respond = self.response
        # Tokens delivered to the client, those of the attempts this one resumes included.
        base = tokens = self.tokens
        # Events not yet written to the client: before the first token (e.g. chat's role
        # delta), then a burst in progress.
        out = self._unsent
        # (Both set before they are read: when tokens arrive.)
        last_token_at = prefill_done  # pragma: no mutate (equivalent: set before read)
        burst_tokens = False  # pragma: no mutate (equivalent: set before read)
        name = reservation.consumer
        # The silence deadline runs: set at the end of the first token's burst, then kept
        # ahead of every read by the stream; a write that waits for the client lifts it.
        armed = False  # pragma: no mutate (equivalent: None is falsy alike; True is killed)
        ended = False  # pragma: no mutate (equivalent: None is falsy alike; True is killed): the end ([DONE]) was read

        def disarm() -> None:
            # A write that must wait for the client: backpressure is not engine silence.
            nonlocal armed
            armed = False  # pragma: no mutate (equivalent: None is falsy alike; True is killed)
            scope.deadline = math.inf

        # Streamed tokens are carried off the event loop where they can be.
        relay = state.relay if acc is None and ledger is None else None
        trace = self.trace
        headers = () if trace is None else trace.decode(name, attempt.decode_request_id)
        state.in_flight_by_engine[name] += 1
        try:
            with scope:
                async with consumer.decode(
                    handoff,
                    body,
                    kind=kind,
                    request_id=attempt.decode_request_id,
                    # A relayed stream needs token counts, not token objects.
                    lazy=acc is None and ledger is None,
                    trace=headers,
                ) as stream:
                    async for chunk in stream:
                        if ledger is not None:
                            chunk = ledger.relay(chunk)
                        if chunk.kind == "token":
                            if tokens == base and scope.cancel_called:
                                # Read in the scheduler tick in which its deadline expired:
                                # too late, and nothing is sent yet, so a timeout as usual
                                # (committing now would be cut by the pending cancellation).
                                break  # pragma: no mutate (equivalent: a return here is cut by the close's checkpoint too)
                            n = chunk.count
                            tokens += n
                            self.tokens = tokens
                            burst_tokens = True
                            if acc is not None:
                                acc.add(chunk.data)
                            else:
                                out.append(shape(chunk.raw))
                            if tokens == base + n and n:
                                attempt.first_token_s = clock() - self.arrival
                                if trace is not None:
                                    trace.first_token()
                                if silence != math.inf:
                                    stream.watch_silence(scope, silence)
                                if not resumed:
                                    self.visible = True
                                    self.record.first_byte_s = attempt.first_token_s
                                if parsed.stream and not resumed:
                                    scope.deadline = math.inf
                                    data = b"".join(out)
                                    out.clear()
                                    await respond.start(200, (*_SSE_HEADERS, (_REQUEST_ID, self.request_id)), data)
                                    self.committed = True
                        elif acc is not None:
                            acc.add(chunk.data)
                        elif forward_meta or not _is_usage(chunk.data):
                            out.append(shape(chunk.raw))
                        if resumed and ledger is not None and ledger.stopped is not None:
                            # A stop string across the break ends the stream here.
                            self._stopped(ledger, acc, out, shape)
                            break
                        if stream.buffered:
                            continue  # more of this burst already arrived
                        # The end of a burst: one write for everything that arrived together;
                        # the silence deadline runs from the read (the stream moved it), or
                        # from now after the first token or a write that waited.
                        if out and self.committed:
                            data = b"".join(out)
                            out.clear()
                            await respond.send(data, on_wait=disarm)
                        if tokens > base and (burst_tokens or not armed):
                            now = clock()
                            if burst_tokens:
                                last_token_at = now
                                burst_tokens = False  # pragma: no mutate (equivalent: None reads false too; True is killed)
                            if not armed:
                                scope.deadline = now + silence
                                armed = True  # pragma: no mutate (equivalent: re-armed at each burst, the deadline is the one the read set; only slower)
                        if relay is not None and self.committed and tokens > base:
                            # The plain middle of the stream, off the event loop: the relay
                            # gives it back for anything else (relay.py).
                            carried = relay.prepare(stream, respond, shape, silence)
                            if carried is None:
                                relay = None  # this stream's ends cannot be carried
                                continue
                            scope.deadline = math.inf  # the relay keeps the silence bound
                            try:
                                await relay.carry(carried)
                            finally:  # (a cancelled task counts what was carried, too)
                                if carried.tokens:
                                    tokens += carried.tokens
                                    self.tokens = tokens
                                    last_token_at = carried.last_token_at
                            if carried.failure is not None:
                                raise carried.failure
                            # From the stream's last bytes (past already when it went silent).
                            scope.deadline = stream.last_activity_at + silence
                            armed = True  # pragma: no mutate (equivalent: the deadline is set here either way)
                            if carried.unsent:
                                await respond.send_framed(carried.unsent, on_wait=disarm)
                    if burst_tokens:  # [DONE] came in the burst of the last tokens
                        last_token_at = clock()
                    attempt.consumer_cached_tokens = stream.cached_tokens
                    ended = stream.done or (ledger is not None and ledger.stopped is not None)
        finally:
            state.in_flight_by_engine[name] -= 1
            reservation.release_decode()
            attempt.output_tokens = tokens - base
        # The scope's deadline fired before the engine's end was read (whether its Cancelled
        # was caught here, or a token read in the same tick broke the loop). A stream that
        # reached its end is whole: a deadline that expired as the end was read cancels only
        # the close of its connection (which is closed all the same).
        if scope.cancel_called and not ended:
            if tokens > base:
                raise SilenceTimeout(
                    f"engine went silent between tokens (no chunk for {cfg.decode_read_timeout_s:g} s "
                    f"after {tokens} tokens)",
                    leg="decode",
                    deadline="engine.decode_read_timeout_s",
                )
            # (At equal deadlines both fired; either name is right.)
            if handoff_deadline < first_token_deadline:  # pragma: no mutate (equivalent at equality)
                # The producer answered; the consumer held the rest of the handoff's age
                # without a token: its first-token failure.
                raise HandoffExpired(
                    f"KV handoff older than handoff.max_age_s ({self.config.handoff.max_age_s:g} s) "
                    f"before the first token: consumer {name} produced none in the "
                    f"{handoff_deadline - prefill_done:.3g} s left after the producer answered",
                    leg="decode",
                    deadline="handoff.max_age_s",
                )
            raise FirstTokenTimeout(
                f"no token within engine.first_token_timeout_s ({cfg.first_token_timeout_s:g} s)",
                leg="decode",
                deadline="engine.first_token_timeout_s",
            )
        # A normal end: the stream saw [DONE] after at least one token (the client enforces it).
        if trace is not None:
            trace.decoded(tokens, attempt.consumer_cached_tokens)
        if tokens >= 2:
            # (A resumed stream's counts from its first prefill, over all its tokens.)
            start = ledger.prefill_done if resumed and ledger is not None and ledger.prefill_done is not None else prefill_done
            self.record.tpot_s = (last_token_at - start) / (tokens - 1)
        if acc is None:
            data = b"".join((*out, _DONE))
            out.clear()
            await respond.end(data)
        else:
            answer = json.dumps(acc.body(self.prompt_tokens)).encode()
            await respond.respond(200, (*JSON_HEADERS, (_REQUEST_ID, self.request_id)), answer)

    def _stopped(
        self, ledger: StreamLedger, acc: ResponseAccumulator | None, out: list[bytes], shape: StreamShaper
    ) -> None:
        """End a resumed stream at a stop string the router found across the break: the
        usage event a stream asked for (the engine's end never comes)."""
        if acc is not None:
            acc.usage = ledger.usage()
        elif self.parsed is not None and self.parsed.include_usage:
            out.append(shape(ledger.usage_event()))


def _max_model_len(state: RouterState, model: str | None, told: int | None = None) -> int | None:
    """The length limit a request for ``model`` must fit: the smallest the engines of
    ``model`` report and ``told`` (a /tokenize answer's), since the request may land on
    any engine of its model (None: none known)."""
    listed = None if model is None else state.models.get(model)  # pragma: no mutate (equivalent: no model is named None, so models.get(None) is None too; the test is for the type)
    return min((n for n in (listed, told) if n is not None), default=None)


def _is_usage(data: dict[str, Any] | None) -> bool:
    return bool(data) and data is not None and "usage" in data and not data.get("choices")
