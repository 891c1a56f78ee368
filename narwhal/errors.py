"""Narwhal's exception hierarchy and its HTTP mapping.

Every error a client can see is a :class:`NarwhalError`; its ``status`` is the HTTP
status the router answers with, its ``error_type`` the OpenAI ``error.type`` and its
``terminal_class`` the journal's closed set of terminal outcomes. Library errors
(httpx, h11, json) are translated at the boundary (``raise EngineTimeout(...) from
exc``), most specific first::

    NarwhalError (500 internal_error)
    ├── ConfigError                         fleet document / profile file problems (not HTTP)
    ├── ClientError (400 invalid_request_error, refused)
    │   ├── BadRequest (400)
    │   │   └── ContextLengthExceeded (400)  prompt + max_tokens > max_model_len
    │   ├── Unauthorized (401)
    │   ├── Forbidden (403)                  no tenant, a class the tenant may not ask for, an admin operation turned off
    │   ├── NotFound (404)                   unknown route or model
    │   ├── MethodNotAllowed (405)
    │   ├── PayloadTooLarge (413)
    │   └── Unsupported (400)                a valid but unsupported option (n > 1, ...)
    ├── RateLimited (429, rate_limited)      a tenant's limit; carries Retry-After
    ├── Refused (503, refused)               no capacity; carries Retry-After
    │   └── NoEngine (503, no_engine)         no engine of a role in placement (every one ejected)
    ├── DeadlineExceeded (504, deadline_exceeded)
    └── EngineError (502, ...)               anything an engine did wrong
        ├── RouterOverloaded (503, router_overloaded)    not the engine: the router ran out of
        │                                                 its own descriptors, buffers or ports
        │                                                 opening a connection to it; Retry-After
        ├── EngineUnavailable (502, engine_unavailable)   connect refused / reset
        ├── EngineHTTPError (502, engine_http_error)      non-2xx answer; keeps upstream status
        │                                                 (a 400/422 is the client's fault: that status;
        │                                                 the engine's own 408/504 is a timeout: 504)
        ├── EngineProtocolError (502, engine_protocol_error)
        │   ├── StreamClosed (502, stream_closed)         closed before ``data: [DONE]``
        │   └── EmptyStream (502, empty_stream)           ``[DONE]`` before any token
        ├── EngineStreamError (own status, engine_stream_error)  error object in a 200 stream
        ├── InvalidDescriptor (502, invalid_descriptor)   handoff descriptor rejected
        └── EngineTimeout (504, engine_timeout)           every timeout-shaped engine fault
            ├── FirstTokenTimeout (504, first_token_timeout)
            ├── SilenceTimeout (504, silence_timeout)     "engine went silent between tokens"
            └── HandoffExpired (504, handoff_expired)     handoff.max_age_s passed

``leg`` on an :class:`EngineError` says which leg failed (``"prefill"``, ``"decode"``,
``"probe"``), ``engine`` which engine. The router maps a prefill-leg failure to the
``prefill_failed`` terminal class and a decode-leg failure to ``decode_failed`` unless
the error names a more specific class (timeouts, handoff expiry, descriptor).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = [
    "RESOURCE_ERRNOS",
    "TIMEOUT_STATUSES",
    "BadRequest",
    "ClientError",
    "ConfigError",
    "ContextLengthExceeded",
    "DeadlineExceeded",
    "EmptyStream",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineStreamError",
    "EngineTimeout",
    "EngineUnavailable",
    "FirstTokenTimeout",
    "Forbidden",
    "HandoffExpired",
    "InvalidDescriptor",
    "MethodNotAllowed",
    "NarwhalError",
    "NoEngine",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "Refused",
    "RouterOverloaded",
    "SilenceTimeout",
    "StreamClosed",
    "Unauthorized",
    "Unsupported",
    "resource_exhaustion",
]


class NarwhalError(Exception):
    """Base class; ``public_message`` (``str(err)`` unless an engine error carries
    internals in its detail) is the message a client may see."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    terminal_class: ClassVar[str] = "internal_error"
    #: Whether a fresh attempt may help (only consulted before visible output).
    transient: bool = False

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    @property
    def http_status(self) -> int:
        return self.status

    @property
    def public_message(self) -> str:
        """The message of the client's error body (``message`` unless it holds internals)."""
        return self.message

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error shape ``{"error": {"message", "type", "code"}}``; ``code`` is
        OpenAI's: a string naming the error (``context_length_exceeded``) or None, never
        the HTTP status (that is the response's status line)."""
        return {"error": {"message": self.public_message, "type": self.error_type, "code": self.code}}


class ConfigError(NarwhalError):
    """A fleet document, profile pair or workload file is invalid.

    ``path`` is the JSON path of the offending value (``$.engine.first_token_timeout_s``).
    """

    terminal_class = "config_error"

    def __init__(self, message: str, *, path: str = "$", source: str | None = None) -> None:
        where = f" @ {path}"
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}{message}{where}")
        self.path = path
        self.reason = message
        self.source = source


# --------------------------------------------------------------------- client side


class ClientError(NarwhalError):
    status = 400
    error_type = "invalid_request_error"
    terminal_class = "refused"


class BadRequest(ClientError):
    status = 400


class ContextLengthExceeded(BadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="context_length_exceeded")


class Unauthorized(ClientError):
    status = 401
    error_type = "authentication_error"


class Forbidden(ClientError):
    status = 403
    error_type = "permission_error"


class NotFound(ClientError):
    status = 404
    error_type = "not_found_error"


class MethodNotAllowed(ClientError):
    status = 405


class PayloadTooLarge(ClientError):
    status = 413


class Unsupported(BadRequest):
    pass


class RateLimited(NarwhalError):
    """A tenant's limit is reached (429 with ``Retry-After``: when the limit allows
    another request)."""

    status = 429
    error_type = "rate_limit_error"
    terminal_class = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s


class Refused(NarwhalError):
    """No engine can take the request now (503 with ``Retry-After``)."""

    status = 503
    error_type = "service_unavailable"
    terminal_class = "refused"

    def __init__(self, message: str, *, retry_after_s: float = 1.0,
                 placement: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.retry_after_s = retry_after_s
        #: Why placement found no pair in time (its explanation, or a function that
        #: writes it), when it priced one.
        self.placement = placement


class NoEngine(Refused):
    """No engine of a role (prefill, decode) serving the request's model is in
    placement: every one is ejected until a readmission probe succeeds (503 with
    ``Retry-After``: when the next probe is due)."""

    terminal_class = "no_engine"


class DeadlineExceeded(NarwhalError):
    """The request's own deadline (``engine.request_timeout_s``) passed."""

    status = 504
    error_type = "timeout_error"
    terminal_class = "deadline_exceeded"


# --------------------------------------------------------------------- engine side


class EngineError(NarwhalError):
    """An engine failed. ``engine`` names it, ``leg`` says which leg, ``deadline`` the
    router's setting whose deadline fired, when one did (``"handoff.max_age_s"``, ...).

    ``message`` is the full detail for the journal and logs; ``public`` (when given) is
    what the client's error body says instead, without library exception text or the
    engine's own error text (addresses, tracebacks).
    """

    status = 502
    error_type = "engine_error"
    terminal_class = "engine_error"
    transient = True
    #: The engine rejected the request's content (see :class:`EngineHTTPError`): the
    #: client's fault.
    client_fault: bool = False
    #: Not the router's own fault (:class:`RouterOverloaded`: it could not reach the
    #: engine for want of its own resources).
    router_fault: bool = False

    def __init__(
        self,
        message: str,
        *,
        engine: str | None = None,
        leg: str | None = None,
        code: str | None = None,
        public: str | None = None,
        deadline: str | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.engine = engine
        self.leg = leg
        self.deadline = deadline
        self._public = public

    @property
    def public_message(self) -> str:
        return self._public if self._public is not None else self.message

    @property
    def engine_fault(self) -> bool:
        """Whether the engine's breaker counts this failure (neither the client's request
        nor the router's own resources are to blame)."""
        return not (self.client_fault or self.router_fault)


class EngineUnavailable(EngineError):
    terminal_class = "engine_unavailable"


#: What an ``errno`` says the router itself ran out of (on ``socket()``, ``connect()``
#: or ``accept()``): the router's fault, never the peer's.
RESOURCE_ERRNOS: dict[int, str] = {
    errno.EMFILE: "file descriptors",
    errno.ENFILE: "file descriptors (system-wide)",
    errno.ENOBUFS: "socket buffers",
    errno.ENOMEM: "memory",
    errno.EADDRNOTAVAIL: "local ports",
}


def resource_exhaustion(exc: BaseException) -> OSError | None:
    """The :class:`OSError` under ``exc`` (itself, its causes and contexts, the members
    of exception groups: ``trio.open_tcp_stream`` raises one error caused by a group of
    its attempts' errors) whose ``errno`` is one of :data:`RESOURCE_ERRNOS`, or None."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        err = stack.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in RESOURCE_ERRNOS:
            return err
        if isinstance(err, BaseExceptionGroup):
            stack.extend(err.exceptions)
        for linked in (err.__cause__, err.__context__):
            if linked is not None:
                stack.append(linked)
    return None


class RouterOverloaded(EngineError):
    """The router ran out of its own resources (descriptors, socket buffers, memory,
    local ports) opening a connection to an engine: a 503 with ``Retry-After``, never
    the engine's fault (``router_fault``: no breaker counts it), never retried on
    another engine (which would need the same resources)."""

    status = 503
    error_type = "service_unavailable"
    terminal_class = "router_overloaded"
    transient = False
    router_fault = True
    retry_after_s = 1.0

    @classmethod
    def opening(cls, target: str, cause: OSError) -> RouterOverloaded:
        """The error for ``cause`` (its ``errno`` one of :data:`RESOURCE_ERRNOS`) while
        connecting to ``target``; the client's message names what ran out, not the address."""
        code = cause.errno
        assert code is not None  # (resource_exhaustion found it by its errno)
        what = RESOURCE_ERRNOS[code]
        return cls(
            f"router out of {what} ({errno.errorcode[code]}) connecting to {target}: {os.strerror(code)}",
            public=f"router overloaded: out of {what} ({errno.errorcode[code]}); retry later",
        )


#: Upstream statuses that say the engine itself timed out: answered as 504.
TIMEOUT_STATUSES: frozenset[int] = frozenset({408, 504})


class EngineHTTPError(EngineError):
    """The engine answered with a non-2xx status; ``upstream_status`` keeps it.

    A 400 or 422 means the engine rejected the request's content (an out-of-vocabulary
    token id, an empty prompt, a sampling setting out of range): ``client_fault`` is
    true, the client gets that status with the engine's ``detail`` as an
    ``invalid_request_error``, and the engine's breaker does not count it, so that no
    client can eject engines by sending bad requests.
    """

    terminal_class = "engine_http_error"

    def __init__(
        self,
        message: str,
        *,
        upstream_status: int,
        engine: str | None = None,
        leg: str | None = None,
        detail: str | None = None,
        public: str | None = None,
    ) -> None:
        super().__init__(message, engine=engine, leg=leg, public=public)
        self.upstream_status = upstream_status
        self.detail = detail
        # A 4xx from an engine is about the request, not the engine: retrying won't help.
        self.transient = upstream_status >= 500 or upstream_status in (408, 429)
        self.client_fault = upstream_status in (400, 422)
        #: The engine's own timeout (408 Request Timeout, 504 Gateway Timeout).
        self.timed_out = upstream_status in TIMEOUT_STATUSES

    @property
    def http_status(self) -> int:
        if self.client_fault:
            return self.upstream_status
        return EngineTimeout.status if self.timed_out else self.status

    @property
    def public_message(self) -> str:
        if self.client_fault and self.detail:
            return self.detail
        return super().public_message

    def to_body(self) -> dict[str, Any]:
        body = super().to_body()
        if self.timed_out and not self.client_fault:
            body["error"]["type"] = EngineTimeout.error_type
        if self.client_fault:
            body["error"]["type"] = ClientError.error_type
            if self.detail and "maximum context length" in self.detail:
                # vLLM's wording for a prompt (plus output) over max_model_len.
                body["error"]["code"] = "context_length_exceeded"
        return body


class EngineProtocolError(EngineError):
    terminal_class = "engine_protocol_error"


class StreamClosed(EngineProtocolError):
    terminal_class = "stream_closed"


class EmptyStream(EngineProtocolError):
    terminal_class = "empty_stream"

    def __init__(self, *, engine: str | None = None, leg: str | None = "decode") -> None:
        super().__init__("stream ended with [DONE] before any token arrived", engine=engine, leg=leg)


class EngineStreamError(EngineError):
    """An error object inside an upstream HTTP 200 stream; keeps the object's status."""

    terminal_class = "engine_stream_error"

    def __init__(
        self,
        message: str,
        *,
        upstream_status: int,
        error: dict[str, Any] | None = None,
        engine: str | None = None,
        leg: str | None = None,
        public: str | None = None,
    ) -> None:
        super().__init__(message, engine=engine, leg=leg, public=public)
        self.upstream_status = upstream_status
        self.error = error or {}

    @property
    def http_status(self) -> int:
        return self.upstream_status


class InvalidDescriptor(EngineError):
    """The producer's handoff descriptor failed validation (``reason`` says why)."""

    terminal_class = "invalid_descriptor"

    def __init__(self, reason: str, *, engine: str | None = None, leg: str | None = "prefill") -> None:
        # The client learns which check failed ("endpoint mismatch"), not the hosts,
        # ports or ids the descriptor named.
        super().__init__(
            f"invalid KV handoff descriptor: {reason}",
            engine=engine,
            leg=leg,
            public=f"invalid KV handoff descriptor: {reason.partition(':')[0]}",
        )
        self.reason = reason


class EngineTimeout(EngineError):
    """A timeout-shaped engine fault (``deadline``: the router's setting that fired, if one did)."""

    status = 504
    error_type = "timeout_error"
    terminal_class = "engine_timeout"


class FirstTokenTimeout(EngineTimeout):
    terminal_class = "first_token_timeout"


class SilenceTimeout(EngineTimeout):
    terminal_class = "silence_timeout"


class HandoffExpired(EngineTimeout):
    terminal_class = "handoff_expired"

