"""The error hierarchy's contract, one class at a time: the HTTP status, the OpenAI error
body, the journal's terminal class, and what each constructor keeps (engine, leg,
deadline, the public message). The router and client tests reach these through whole
requests; these pin every field down (see tools/mutation.py)."""

from __future__ import annotations

import errno
import os

import pytest

from narwhal.errors import (
    BadRequest,
    ClientError,
    ConfigError,
    ContextLengthExceeded,
    DeadlineExceeded,
    EmptyStream,
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineStreamError,
    EngineTimeout,
    EngineUnavailable,
    FirstTokenTimeout,
    HandoffExpired,
    InvalidDescriptor,
    MethodNotAllowed,
    NarwhalError,
    NoEngine,
    NotFound,
    PayloadTooLarge,
    Refused,
    RouterOverloaded,
    SilenceTimeout,
    StreamClosed,
    Unauthorized,
    Unsupported,
    resource_exhaustion,
)


def test_base_error_body_is_openai_shaped() -> None:
    err = NarwhalError("it broke")
    assert str(err) == "it broke" and err.message == "it broke" and err.code is None
    assert err.http_status == 500 and not err.transient
    assert err.to_body() == {
        "error": {"message": "it broke", "type": "internal_error", "code": None}
    }
    coded = NarwhalError("it broke", code="some_code")
    assert coded.code == "some_code"
    assert coded.to_body()["error"]["code"] == "some_code"


def test_config_error_names_the_json_path_and_source() -> None:
    err = ConfigError(
        "must be positive", path="$.engine.first_token_timeout_s", source="fleet.json"
    )
    assert str(err) == "fleet.json: must be positive @ $.engine.first_token_timeout_s"
    assert err.path == "$.engine.first_token_timeout_s"
    assert err.reason == "must be positive" and err.source == "fleet.json"
    assert err.terminal_class == "config_error"
    bare = ConfigError("not an object")
    assert str(bare) == "not an object @ $"
    assert bare.path == "$" and bare.source is None and bare.reason == "not an object"


@pytest.mark.parametrize(
    ("cls", "status", "error_type"),
    [
        (ClientError, 400, "invalid_request_error"),
        (BadRequest, 400, "invalid_request_error"),
        (Unsupported, 400, "invalid_request_error"),
        (Unauthorized, 401, "authentication_error"),
        (NotFound, 404, "not_found_error"),
        (MethodNotAllowed, 405, "invalid_request_error"),
        (PayloadTooLarge, 413, "invalid_request_error"),
    ],
)
def test_client_errors(cls: type[ClientError], status: int, error_type: str) -> None:
    err = cls("bad")
    assert err.http_status == status and err.terminal_class == "refused" and not err.transient
    assert err.to_body() == {"error": {"message": "bad", "type": error_type, "code": None}}


def test_context_length_exceeded_has_openais_code() -> None:
    err = ContextLengthExceeded("prompt too long")
    assert err.http_status == 400 and err.message == "prompt too long"
    assert err.to_body() == {
        "error": {
            "message": "prompt too long",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }


def test_refused_carries_retry_after() -> None:
    err = Refused("no decode engine")
    assert err.retry_after_s == 1.0 and err.message == "no decode engine"
    assert err.http_status == 503 and err.terminal_class == "refused"
    assert err.to_body()["error"] == {
        "message": "no decode engine",
        "type": "service_unavailable",
        "code": None,
    }
    assert Refused("busy", retry_after_s=7.5).retry_after_s == 7.5
    none = NoEngine("no engine available for decode", retry_after_s=3.0)
    assert isinstance(none, Refused) and none.retry_after_s == 3.0
    assert (none.http_status, none.terminal_class, none.error_type) == (503, "no_engine", "service_unavailable")


def test_deadline_exceeded() -> None:
    err = DeadlineExceeded("request deadline passed")
    assert err.http_status == 504 and err.terminal_class == "deadline_exceeded"
    assert err.to_body()["error"]["type"] == "timeout_error"


def test_engine_error_keeps_engine_leg_deadline_and_public_message() -> None:
    err = EngineError(
        "connect to 10.0.0.7:8100 failed: [Errno 111]",
        engine="d0",
        leg="decode",
        code="engine_down",
        public="engine d0 is unavailable",
        deadline="engine.connect_timeout_s",
    )
    assert (err.engine, err.leg, err.deadline, err.code) == (
        "d0",
        "decode",
        "engine.connect_timeout_s",
        "engine_down",
    )
    assert err.transient and not err.client_fault
    assert err.message == "connect to 10.0.0.7:8100 failed: [Errno 111]"
    assert err.public_message == "engine d0 is unavailable"
    assert err.to_body() == {
        "error": {
            "message": "engine d0 is unavailable",
            "type": "engine_error",
            "code": "engine_down",
        }
    }
    plain = EngineError("engine d0 failed")
    assert plain.public_message == "engine d0 failed"
    assert (plain.engine, plain.leg, plain.deadline, plain.code) == (None, None, None, None)


@pytest.mark.parametrize(
    ("cls", "status", "terminal_class"),
    [
        (EngineUnavailable, 502, "engine_unavailable"),
        (EngineProtocolError, 502, "engine_protocol_error"),
        (StreamClosed, 502, "stream_closed"),
        (EngineTimeout, 504, "engine_timeout"),
        (FirstTokenTimeout, 504, "first_token_timeout"),
        (SilenceTimeout, 504, "silence_timeout"),
        (HandoffExpired, 504, "handoff_expired"),
    ],
)
def test_engine_error_classes(cls: type[EngineError], status: int, terminal_class: str) -> None:
    err = cls("x", engine="p0", leg="prefill", deadline="handoff.max_age_s")
    assert err.http_status == status and err.terminal_class == terminal_class and err.transient
    assert (err.engine, err.leg, err.deadline) == ("p0", "prefill", "handoff.max_age_s")


@pytest.mark.parametrize(
    ("upstream", "transient", "client_fault", "timed_out", "http_status", "error_type"),
    [
        (400, False, True, False, 400, "invalid_request_error"),
        (401, False, False, False, 502, "engine_error"),
        (404, False, False, False, 502, "engine_error"),
        (408, True, False, True, 504, "timeout_error"),
        (409, False, False, False, 502, "engine_error"),
        (422, False, True, False, 422, "invalid_request_error"),
        (423, False, False, False, 502, "engine_error"),
        (429, True, False, False, 502, "engine_error"),
        (430, False, False, False, 502, "engine_error"),
        (499, False, False, False, 502, "engine_error"),
        (500, True, False, False, 502, "engine_error"),
        (501, True, False, False, 502, "engine_error"),
        (503, True, False, False, 502, "engine_error"),
        (504, True, False, True, 504, "timeout_error"),
    ],
)
def test_engine_http_error_by_upstream_status(
    upstream: int,
    transient: bool,
    client_fault: bool,
    timed_out: bool,
    http_status: int,
    error_type: str,
) -> None:
    err = EngineHTTPError(
        f"engine d0 answered HTTP {upstream}: detail", upstream_status=upstream, engine="d0", leg="decode",
        detail="the engine's words", public=f"engine d0 answered HTTP {upstream}",
    )  # fmt: skip
    assert err.upstream_status == upstream and (err.engine, err.leg) == ("d0", "decode")
    assert (err.transient, err.client_fault, err.timed_out) == (transient, client_fault, timed_out)
    assert err.http_status == http_status
    assert err.detail == "the engine's words"
    body = err.to_body()["error"]
    assert body["type"] == error_type and body["code"] is None
    # A client fault shows the engine's own words (they are about the request); any
    # other fault shows the public message, never the engine's internals.
    assert body["message"] == (
        "the engine's words" if client_fault else f"engine d0 answered HTTP {upstream}"
    )


def test_engine_http_error_messages_without_detail_or_public() -> None:
    err = EngineHTTPError("engine d0 answered HTTP 400", upstream_status=400)
    assert err.detail is None and err.public_message == "engine d0 answered HTTP 400"
    assert err.to_body()["error"] == {
        "message": "engine d0 answered HTTP 400", "type": "invalid_request_error", "code": None
    }  # fmt: skip
    assert EngineHTTPError("m", upstream_status=500, public="p").public_message == "p"


def test_engine_http_error_recognises_vllms_context_length_wording() -> None:
    detail = (
        "This model's maximum context length is 2048 tokens. However, you requested 4096 tokens."
    )
    err = EngineHTTPError("HTTP 400", upstream_status=400, detail=detail)
    assert err.to_body() == {
        "error": {
            "message": detail,
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
    other = EngineHTTPError("HTTP 400", upstream_status=400, detail="temperature must be >= 0")
    assert other.to_body()["error"]["code"] is None
    # Only a client fault is the client's prompt: a 500 with the same words is the engine's.
    server = EngineHTTPError("HTTP 500", upstream_status=500, detail=detail)
    assert server.to_body()["error"]["code"] is None


def test_empty_stream() -> None:
    err = EmptyStream(engine="d1")
    assert str(err) == "stream ended with [DONE] before any token arrived"
    assert err.engine == "d1" and err.leg == "decode" and err.terminal_class == "empty_stream"
    assert err.http_status == 502 and isinstance(err, EngineProtocolError)
    assert EmptyStream(engine="p0", leg="probe").leg == "probe"
    assert EmptyStream().engine is None


def test_engine_stream_error_keeps_the_objects_status() -> None:
    obj = {"message": "kv transfer failed", "code": 503}
    err = EngineStreamError(
        "engine d0 reported an error: kv transfer failed", upstream_status=503, error=obj,
        engine="d0", leg="decode", public="engine d0 reported an error",
    )  # fmt: skip
    assert err.http_status == 503 and err.upstream_status == 503 and err.error == obj
    assert (err.engine, err.leg) == ("d0", "decode")
    assert err.public_message == "engine d0 reported an error"
    assert err.terminal_class == "engine_stream_error"
    assert EngineStreamError("m", upstream_status=400).error == {}


def test_invalid_descriptor_hides_the_details_from_the_client() -> None:
    err = InvalidDescriptor(
        "endpoint mismatch: remote_host 10.0.0.9:15600 is not p0's kv endpoint", engine="p0"
    )
    assert err.reason == "endpoint mismatch: remote_host 10.0.0.9:15600 is not p0's kv endpoint"
    assert err.message == f"invalid KV handoff descriptor: {err.reason}"
    assert err.public_message == "invalid KV handoff descriptor: endpoint mismatch"
    assert err.to_body()["error"]["message"] == "invalid KV handoff descriptor: endpoint mismatch"
    assert (
        err.engine == "p0" and err.leg == "prefill" and err.terminal_class == "invalid_descriptor"
    )
    assert InvalidDescriptor("missing", leg="decode").leg == "decode"
    assert InvalidDescriptor("missing").engine is None


def test_the_routers_own_resource_error_is_found_under_chains_groups_and_cycles() -> None:
    emfile = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    refused = OSError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
    assert resource_exhaustion(emfile) is emfile
    assert resource_exhaustion(refused) is None and resource_exhaustion(RuntimeError("x")) is None
    # trio.open_tcp_stream: one error, caused by the group of its attempts' errors.
    message = "all attempts to connect to h:1 failed"
    top = OSError(message)
    top.__cause__ = ExceptionGroup(message, [refused, emfile])
    assert resource_exhaustion(top) is emfile
    # Under what httpx or a caller wrapped it in, as a cause or a context.
    wrapped = RuntimeError("connect failed")
    wrapped.__context__ = top
    assert resource_exhaustion(wrapped) is emfile
    # A cycle in a chain ends the walk there, not the search.
    b, c = RuntimeError("b"), RuntimeError("c")
    b.__cause__, c.__cause__ = c, b
    top = OSError("x")
    top.__cause__, top.__context__ = emfile, b
    assert resource_exhaustion(top) is emfile
    assert resource_exhaustion(b) is None


def test_router_overloaded_is_the_routers_fault_not_the_engines() -> None:
    cause = OSError(errno.ENFILE, "whatever the library said")
    err = RouterOverloaded.opening("10.0.0.5:8000", cause)
    assert isinstance(err, EngineError) and err.router_fault and not err.client_fault
    assert not err.engine_fault and not err.transient
    assert (err.http_status, err.terminal_class, err.retry_after_s) == (503, "router_overloaded", 1.0)
    assert err.message == (
        "router out of file descriptors (system-wide) (ENFILE) connecting to 10.0.0.5:8000: "
        + os.strerror(errno.ENFILE)
    )
    assert err.to_body() == {"error": {
        "message": "router overloaded: out of file descriptors (system-wide) (ENFILE); retry later",
        "type": "service_unavailable", "code": None,
    }}  # fmt: skip
