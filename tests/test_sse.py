"""SSE decoding and stream chunk classification (narwhal.engines.sse)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engines.sse import (
    Chunk,
    MalformedEvent,
    SSEDecoder,
    SSEError,
    SSEEvent,
    json_dumps,
    json_loads,
    parse_chunk,
    parse_data,
    scan_token_event,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RECORDING = (FIXTURES / "completions-stream-token-ids.sse").read_bytes()
# The recording: 20 single-id token events, a usage event, then [DONE].
RECORDED_EVENTS = 22
RECORDED_TOKENS = 20


def decode_all(pieces: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for piece in pieces:
        events.extend(decoder.feed(piece))
    events.extend(decoder.flush())
    return events


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted(set(cuts))
    pieces = []
    start = 0
    for point in points:
        pieces.append(data[start:point])
        start = point
    pieces.append(data[start:])
    return pieces


REFERENCE = decode_all([RECORDING])


# --------------------------------------------------------------------------- recording


def test_recording_events_and_token_count() -> None:
    assert len(REFERENCE) == RECORDED_EVENTS
    chunks = [parse_chunk(e) for e in REFERENCE]
    kinds = [c.kind for c in chunks]
    assert kinds == ["token"] * RECORDED_TOKENS + ["meta", "done"]
    assert sum(c.count for c in chunks) == RECORDED_TOKENS
    ids = [i for c in chunks for i in c.token_ids]
    assert len(ids) == RECORDED_TOKENS
    assert ids[:2] == [1290, 520]
    # Events whose text is empty (an incomplete UTF-8 sequence) still carry a token.
    empty_text = [c for c in chunks if c.kind == "token" and c.text == ""]
    assert empty_text and all(c.count == 1 for c in empty_text)
    # The last token event says why generation stopped; the usage event is metadata.
    assert chunks[RECORDED_TOKENS - 1].finish_reason in ("length", "stop")
    usage = chunks[RECORDED_TOKENS]
    assert usage.data is not None and usage.data["choices"] == []
    assert usage.usage is not None and usage.usage["completion_tokens"] == RECORDED_TOKENS


def test_recording_raw_reproduces_the_stream() -> None:
    chunks = [parse_chunk(e) for e in REFERENCE]
    assert b"".join(c.raw for c in chunks) == RECORDING


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(RECORDING)), max_size=40))
def test_recording_split_anywhere(cuts: list[int]) -> None:
    assert decode_all(split_at(RECORDING, cuts)) == REFERENCE


@settings(max_examples=300, deadline=None)
@given(
    ending=st.sampled_from([b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=len(RECORDING) * 2), max_size=40),
)
def test_recording_other_line_ends_split_anywhere(ending: bytes, cuts: list[int]) -> None:
    data = RECORDING.replace(b"\n", ending)
    assert decode_all(split_at(data, cuts)) == REFERENCE


def test_recording_byte_by_byte_with_crlf() -> None:
    data = RECORDING.replace(b"\n", b"\r\n")
    assert decode_all([data[i : i + 1] for i in range(len(data))]) == REFERENCE


# --------------------------------------------------------------------------- decoder


def test_crlf_split_across_feeds_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\r") == [SSEEvent(b"a")]
    assert decoder.feed(b"\ndata: b\r\n\r\n") == [SSEEvent(b"b")]


def test_lone_cr_then_cr_is_two_line_ends() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\r") == [SSEEvent(b"a")]


def test_comments_multiline_data_and_fields() -> None:
    stream = (
        b": keep-alive\n"
        b"event: update\n"
        b"id: 7\n"
        b"data: first\n"
        b"data:second\n"
        b"data\n"
        b": another comment\n"
        b"retry: 1500\n"
        b"unknown: ignored\n"
        b"\n"
        b"data: next\n\n"
    )
    decoder = SSEDecoder()
    events = decoder.feed(stream)
    assert events == [
        SSEEvent(b"first\nsecond\n", event="update", id="7"),
        SSEEvent(b"next"),
    ]
    assert events[0].text == "first\nsecond\n"
    assert decoder.retry == 1500
    assert decoder.last_event_id == "7"


def test_event_without_data_is_not_dispatched() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"event: ping\n\n: comment only\n\n\n\n") == []
    # The event type does not leak into the next event.
    assert decoder.feed(b"data: x\n\n") == [SSEEvent(b"x")]


def test_empty_data_line_dispatches_empty_event() -> None:
    assert SSEDecoder().feed(b"data:\n\n") == [SSEEvent(b"")]


def test_only_one_space_after_colon_is_stripped() -> None:
    assert SSEDecoder().feed(b"data:  two\n\n") == [SSEEvent(b" two")]


def test_id_with_nul_is_ignored() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"id: a\x00b\ndata: x\n\n") == [SSEEvent(b"x")]
    assert decoder.last_event_id is None


def test_bom_at_start_is_dropped_even_when_split() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"\xef") == []
    assert decoder.feed(b"\xbb") == []
    assert decoder.feed(b"\xbfdata: x\n\n") == [SSEEvent(b"x")]
    # Only at the very start.
    assert decoder.feed(b"\xef\xbb\xbfdata: y\n\n") == []


def test_flush_dispatches_an_unterminated_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.flush() == [SSEEvent(b"[DONE]")]
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]\n") == []
    assert decoder.flush() == [SSEEvent(b"[DONE]")]
    assert decoder.flush() == []


def test_oversized_line_is_refused() -> None:
    decoder = SSEDecoder(max_event_bytes=16)
    with pytest.raises(SSEError):
        decoder.feed(b"data: " + b"x" * 32)
    decoder = SSEDecoder(max_event_bytes=16)
    with pytest.raises(SSEError):
        decoder.feed(b"data: 0123456789\ndata: 0123456789\n")


def test_encode_round_trips() -> None:
    event = SSEEvent(b"a\nb", event="message", id="3")
    assert event.encode() == b"event: message\nid: 3\ndata: a\ndata: b\n\n"
    assert SSEDecoder().feed(event.encode()) == [event]


# --------------------------------------------------------------------------- chunks


def chunk_of(obj: object) -> Chunk:
    return parse_chunk(SSEEvent(json_dumps(obj)))


def test_done() -> None:
    chunk = parse_chunk(SSEEvent(b"[DONE]"))
    assert chunk.kind == "done"
    assert chunk.raw == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("obj", "status"),
    [
        (
            {
                "error": {
                    "message": "too long",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
            400,
        ),
        ({"error": {"message": "boom", "type": "InternalServerError", "code": 503}}, 503),
        ({"error": {"message": "odd", "code": "context_length_exceeded"}}, 500),
        ({"error": {"message": "ok?", "code": 200}}, 500),
        ({"error": {"message": "bool", "code": True}}, 500),
        ({"error": {"message": "none"}}, 500),
        ({"object": "error", "message": "old shape", "type": "BadRequestError", "code": 422}, 422),
        ({"error": "plain string"}, 500),
    ],
)
def test_error_objects(obj: dict[str, object], status: int) -> None:
    chunk = chunk_of(obj)
    assert chunk.kind == "error"
    assert chunk.status == status
    assert chunk.error is not None
    assert "message" in chunk.error
    assert chunk.raw == b"data: " + json_dumps(obj) + b"\n\n"


def test_chat_stream_counts_ids_not_text() -> None:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    role = chunk_of(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    )
    assert role.kind == "meta" and role.count == 0
    reasoning = chunk_of(
        {**base, "choices": [{"index": 0, "delta": {"reasoning": "hmm"}, "token_ids": [11, 12]}]}
    )
    assert reasoning.kind == "token" and reasoning.token_ids == (11, 12) and reasoning.text == ""
    empty = chunk_of(
        {**base, "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [13]}]}
    )
    assert empty.kind == "token" and empty.count == 1
    content = chunk_of(
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"content": "hi"}, "token_ids": [14], "finish_reason": "stop"}
            ],
        }
    )
    assert content.text == "hi" and content.finish_reason == "stop"
    usage = chunk_of({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert usage.kind == "meta" and usage.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    final = chunk_of({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert final.kind == "meta" and final.finish_reason == "length"


def test_chat_reasoning_only_delta_counts_even_without_ids() -> None:
    chunk = chunk_of({"choices": [{"index": 0, "delta": {"reasoning_content": "step one"}}]})
    assert chunk.kind == "token" and chunk.count == 1 and chunk.token_ids == ()


def test_ids_inside_delta_are_accepted() -> None:
    chunk = chunk_of({"choices": [{"index": 0, "delta": {"content": "", "token_ids": [5, 6]}}]})
    assert chunk.token_ids == (5, 6)


def test_completions_empty_text_with_id_counts() -> None:
    chunk = chunk_of({"choices": [{"index": 0, "text": "", "token_ids": [225]}]})
    assert chunk.kind == "token" and chunk.count == 1


def test_ids_over_several_choices() -> None:
    chunk = chunk_of(
        {
            "choices": [
                {"index": 0, "text": "a", "token_ids": [1]},
                {"index": 1, "text": "b", "token_ids": [2]},
            ]
        }
    )
    assert chunk.token_ids == (1, 2) and chunk.text == "ab"


def test_finish_without_token_is_meta() -> None:
    chunk = chunk_of(
        {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "stop"}]}
    )
    assert chunk.kind == "meta" and chunk.finish_reason == "stop"


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'"text"', b""])
def test_malformed_events(data: bytes) -> None:
    with pytest.raises(MalformedEvent):
        parse_chunk(SSEEvent(data))


def test_json_helpers_round_trip() -> None:
    obj = {"a": [1, 2.5, None, True], "b": {"c": "é"}}
    assert json_loads(json_dumps(obj)) == obj
    # Integers beyond 64 bits still serialize (the stdlib fallback).
    assert json.loads(json_dumps({"big": 2**70 + 1})) == {"big": 2**70 + 1}


# --------------------------------------------------------------------------- lazy counting


def test_lazy_parse_counts_the_recording_like_a_full_parse() -> None:
    full = [parse_chunk(e) for e in REFERENCE]
    lazy = [parse_chunk(e, lazy=True) for e in REFERENCE]
    assert [c.kind for c in lazy] == [c.kind for c in full]
    assert [c.count for c in lazy] == [c.count for c in full]
    assert b"".join(c.raw for c in lazy) == RECORDING
    # Token events of the usual shape are counted without a parse; the last one (its
    # finish_reason is set) and the usage event are parsed in full.
    assert sum(c.data is None for c in lazy if c.kind == "token") == RECORDED_TOKENS - 1
    assert lazy[RECORDED_TOKENS - 1].finish_reason in ("length", "stop")
    assert lazy[RECORDED_TOKENS].usage is not None


@pytest.mark.parametrize(
    ("data", "count"),
    [
        (b'{"choices":[{"index":0,"text":"a","finish_reason":null,"token_ids":[5]}]}', 1),
        (b'{"choices":[{"index":0,"text":"ab","finish_reason":null,"token_ids":[5, 6,7]}],"usage":null}', 3),
        (b'{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null,"token_ids":[9]}]}', 1),
        # Text that mentions the key is escaped inside its string: not the key.
        (b'{"choices":[{"index":0,"text":"\\"token_ids\\":[1,2]","finish_reason":null,"token_ids":[4]}]}', 1),
        (b'{"choices":[{"text":"a","finish_reason":"length","token_ids":[5]}]}', 0),  # a finish
        (b'{"choices":[{"text":"a","finish_reason":null,"token_ids":[]}]}', 0),  # no ids
        (b'{"choices":[{"text":"a","finish_reason":null,"token_ids":[1]},'
         b'{"text":"b","finish_reason":null,"token_ids":[2]}]}', 0),  # two choices
        (b'{"choices":[{"finish_reason":null,"token_ids":[1]}],"usage":{"prompt_tokens":3}}', 0),
        (b'{"error":{"message":"x"},"choices":[{"finish_reason":null,"token_ids":[1]}]}', 0),
        (b'{"choices":[{"finish_reason":null,"token_ids":[1,"x"]}]}', 0),  # not integers
        (b'{"choices":[{"finish_reason":null,"token_ids":[1]}', 0),  # truncated
        (b"[DONE]", 0),
    ],
)
def test_scan_token_event(data: bytes, count: int) -> None:
    assert scan_token_event(data) == count
    if count:
        full = parse_data(data)
        assert full.count == count
        lazy = parse_data(data, lazy=True)
        assert (lazy.kind, lazy.count, lazy.raw, lazy.data) == ("token", count, full.raw, None)


def test_feed_tokens_takes_only_bursts_of_usual_token_events() -> None:
    events = [e + b"\n\n" for e in RECORDING.split(b"\n\n") if e]
    assert len(events) == RECORDED_EVENTS
    decoder = SSEDecoder()
    burst = b"".join(events[:5])
    assert decoder.feed_tokens(burst) == (5, burst, [])
    # Not opening with a usual token event: nothing consumed, feed() takes it.
    tail = b"".join(events[RECORDED_TOKENS - 1 :])  # the finishing event, usage, [DONE]
    assert decoder.feed_tokens(tail) == (0, b"", [])
    assert [e.data for e in decoder.feed(tail)] == [e.data for e in REFERENCE[RECORDED_TOKENS - 1 :]]
    # A burst cut inside an event is left to feed() as well.
    assert decoder.feed_tokens(burst[:-10]) == (0, b"", [])
    assert decoder.feed(burst[:-10]) == REFERENCE[:4]
    assert decoder.feed_tokens(burst[-10:]) == (0, b"", [])  # the decoder holds a partial line
    assert decoder.feed(burst[-10:]) == [REFERENCE[4]]


def test_feed_tokens_splits_a_burst_after_its_opening_token_events() -> None:
    # The last tokens, the finishing event, usage and [DONE] in one read (what a
    # zero-latency or batching engine sends): the tokens are one run, the rest events.
    events = [e + b"\n\n" for e in RECORDING.split(b"\n\n") if e]
    run = b"".join(events[RECORDED_TOKENS - 4 : RECORDED_TOKENS - 1])
    burst = run + b"".join(events[RECORDED_TOKENS - 1 :])
    decoder = SSEDecoder()
    count, got_run, rest = decoder.feed_tokens(burst)
    assert (count, got_run) == (3, run)
    assert rest == REFERENCE[RECORDED_TOKENS - 1 :]
    # Nothing is held back: the next read starts clean.
    assert decoder.feed(events[0]) == [REFERENCE[0]]
