"""Incremental server-sent-events decoding and OpenAI stream chunk classification.

:class:`SSEDecoder` turns bytes, split anywhere, into :class:`SSEEvent` objects
(the WHATWG event-stream rules: CRLF, LF or CR line ends, ``:`` comments, multi-line
``data`` joined by ``\\n``, ``event``/``id``/``retry`` fields, a leading BOM).
:func:`parse_chunk` classifies one event of a ``/v1/completions`` or
``/v1/chat/completions`` stream as a token, metadata, ``[DONE]`` or in-stream error.

Output is counted by token id, never by text: with ``"return_token_ids": true`` an
engine attaches the ids each event adds, and an event whose text is empty (an
incomplete UTF-8 sequence) or that only carries reasoning still adds tokens.

This module is on the per-token path of every stream, so it avoids per-line regular
expressions and decodes JSON with ``orjson`` when it is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, NamedTuple

import attrs

__all__ = [
    "Chunk",
    "ChunkKind",
    "MalformedEvent",
    "SSEDecoder",
    "SSEError",
    "SSEEvent",
    "json_dumps",
    "json_loads",
    "parse_chunk",
    "parse_data",
    "scan_token_event",
]

# --------------------------------------------------------------------------- JSON


def _stdlib_dumps(obj: Any) -> bytes:
    import json

    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _stdlib_loads(data: bytes | str) -> Any:
    import json

    try:
        return json.loads(data)
    except RecursionError:  # nesting deeper than the interpreter's stack: a ValueError as orjson's
        raise ValueError("JSON nested too deeply") from None


json_loads: Callable[[bytes | str], Any]
"""Parse JSON from bytes or str (``orjson`` when importable, else :mod:`json`)."""

_orjson_dumps: Callable[[Any], bytes] | None

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is optional
    json_loads = _stdlib_loads
    _orjson_dumps = None
else:
    json_loads = orjson.loads
    _orjson_dumps = orjson.dumps


def json_dumps(obj: Any) -> bytes:
    """Serialize ``obj`` to compact UTF-8 JSON bytes."""
    if _orjson_dumps is not None:
        try:
            return _orjson_dumps(obj)
        except TypeError:
            # orjson refuses integers beyond 64 bits and non-str keys; the stdlib doesn't.
            pass
    return _stdlib_dumps(obj)


# --------------------------------------------------------------------------- events

_BOM: Final = b"\xef\xbb\xbf"
_DEFAULT_MAX_EVENT_BYTES: Final = 64 * 1024 * 1024


class SSEError(ValueError):
    """The byte stream is not a usable event stream (an event over the size limit)."""


class MalformedEvent(ValueError):
    """An event's data is not the JSON object (or ``[DONE]``) an OpenAI stream sends, or
    its fields are not of the types the stream's readers rely on."""


class SSEEvent(NamedTuple):
    """One dispatched event (a named tuple: cheap to make on the per-token path).

    Attributes:
        data: the ``data`` lines joined by ``\\n``, as undecoded UTF-8 bytes.
        event: the ``event`` field given in this event, if any.
        id: the ``id`` field given in this event, if any (the decoder keeps the
            stream's last event id in :attr:`SSEDecoder.last_event_id`).
    """

    data: bytes
    event: str | None = None
    id: str | None = None

    @property
    def text(self) -> str:
        """``data`` decoded as UTF-8 (invalid sequences replaced)."""
        return self.data.decode("utf-8", "replace")

    def encode(self) -> bytes:
        """The event in canonical wire form (LF line ends, one blank line after)."""
        data = self.data
        if b"\n" in data:
            body = b"".join(b"data: " + line + b"\n" for line in data.split(b"\n"))
        else:
            body = b"data: " + data + b"\n"
        if self.event is None and self.id is None:
            return body + b"\n"
        head = b""
        if self.event is not None:
            head += b"event: " + self.event.encode("utf-8") + b"\n"
        if self.id is not None:
            head += b"id: " + self.id.encode("utf-8") + b"\n"
        return head + body + b"\n"


class SSEDecoder:
    """Incremental event-stream decoder; feed it bytes split anywhere.

    Args:
        max_event_bytes: refuse (:class:`SSEError`) an unterminated line or event
            growing beyond this many bytes instead of buffering without bound.
    """

    __slots__ = (
        "_bom_pending",
        "_data",
        "_event",
        "_id",
        "_max",
        "_pending",
        "_pending_size",
        "_size",
        "_skip_lf",
        "last_event_id",
        "retry",
    )

    def __init__(self, *, max_event_bytes: int = _DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._pending: list[bytes] = []  # pieces of an incomplete line (no CR or LF)
        self._pending_size = 0
        self._skip_lf = False  # the last byte seen was a CR: drop one LF that follows
        self._bom_pending = True  # still at the start of the stream
        self._data: list[bytes] = []
        self._event: str | None = None
        self._id: str | None = None
        self._size = 0
        #: The last ``id`` the stream set (persists across events, as the spec says).
        self.last_event_id: str | None = None
        #: The last valid ``retry`` (milliseconds) the stream set.
        self.retry: int | None = None

    @property
    def max_event_bytes(self) -> int:
        """The longest line or event the decoder takes."""
        return self._max

    def _simple_parts(self, chunk: bytes) -> list[bytes] | None:
        """The events of ``chunk`` when it is whole ``data: ...\\n\\n`` events with one
        data line each and the decoder holds nothing (what engines send); else None."""
        if self._bom_pending and not self._pending and chunk[:1] != b"\xef":
            self._bom_pending = False  # the stream does not open with a byte-order mark
        if (
            chunk[-2:] == b"\n\n"
            and not self._pending
            and not self._data
            and self._event is None
            and self._id is None
            and not self._skip_lf
            and not self._bom_pending
            and len(chunk) <= self._max
            and b"\r" not in chunk
        ):
            parts = chunk[:-2].split(b"\n\n")
            for part in parts:
                if part[:6] != b"data: " or b"\n" in part:
                    return None
            return parts
        return None

    def feed_tokens(self, chunk: bytes) -> tuple[int, bytes, list[SSEEvent]]:
        """Consume ``chunk`` if it opens with token events of the usual shape
        (:func:`scan_token_event`) and is whole one-line ``data:`` events: return the
        token count of that opening run, its bytes, and the events after it (a burst's
        finishing event, usage, ``[DONE]``: :func:`parse_chunk` them). Else consume
        nothing and return ``(0, b"", [])`` (then :meth:`feed` it)."""
        if not chunk:
            return 0, b"", []
        parts = self._simple_parts(chunk)
        if parts is None:
            return 0, b"", []
        total = 0
        end = 0
        for i, part in enumerate(parts):
            count = scan_token_event(part[6:])
            if not count:
                if not total:
                    return 0, b"", []
                return total, chunk[:end], [SSEEvent(p[6:]) for p in parts[i:]]
            total += count
            end += len(part) + 2
        return total, chunk, []

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume ``chunk`` and return the events it completed, in order."""
        if not chunk:
            return []
        parts = self._simple_parts(chunk)
        if parts is not None:
            return [SSEEvent(part[6:]) for part in parts]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
                if not chunk:
                    return []
        if self._bom_pending:
            head = b"".join(self._pending) + chunk
            self._pending = []
            self._pending_size = 0
            if len(head) < 3 and _BOM.startswith(head):
                self._pending.append(head)
                self._pending_size = len(head)
                return []
            self._bom_pending = False
            chunk = head[3:] if head.startswith(_BOM) else head
            if not chunk:
                return []
        if b"\n" not in chunk and b"\r" not in chunk:
            # No line end: keep the piece (joined once, when its line ends).
            self._pending.append(chunk)
            self._pending_size += len(chunk)
            if self._pending_size > self._max:
                raise SSEError(f"event stream line longer than {self._max} bytes")
            return []
        if self._pending:
            self._pending.append(chunk)
            buf = b"".join(self._pending)
        else:
            buf = chunk
        if b"\r" in buf:
            if buf[-1] == 0x0D:
                # A CR ends a line now; if an LF opens the next chunk it belongs to it.
                self._skip_lf = True
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        rest = lines.pop()
        self._pending = [rest] if rest else []
        self._pending_size = len(rest)
        if self._pending_size > self._max:
            raise SSEError(f"event stream line longer than {self._max} bytes")
        events: list[SSEEvent] = []
        for line in lines:
            self._line(line, events)
        return events

    def flush(self) -> list[SSEEvent]:
        """End of input: process a final unterminated line and event (lenient).

        The event-stream spec drops an event that the stream did not terminate with
        a blank line; an engine that closes right after ``data: [DONE]\\n`` has
        still said everything, so the pending event is dispatched.
        """
        events: list[SSEEvent] = []
        pending = b"".join(self._pending)
        self._pending = []
        self._pending_size = 0
        if pending:
            if self._bom_pending and pending.startswith(_BOM):
                pending = pending[3:]
            self._line(pending, events)
        self._bom_pending = False
        self._skip_lf = False
        self._dispatch(events)
        return events

    def _line(self, line: bytes, events: list[SSEEvent]) -> None:
        if not line:
            self._dispatch(events)
            return
        if line.startswith(b"data:"):
            value = line[6:] if line.startswith(b"data: ") else line[5:]
            self._data.append(value)
            self._size += len(value) + 1
            if self._size > self._max:
                raise SSEError(f"event stream event larger than {self._max} bytes")
            return
        if line[0] == 0x3A:  # ":" starts a comment (keep-alive)
            return
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name = line[:colon]
            value = line[colon + 1 :]
            if value.startswith(b" "):
                value = value[1:]
        if name == b"data":  # "data" without a colon: an empty data line
            self._data.append(value)
            self._size += len(value) + 1
            if self._size > self._max:
                raise SSEError(f"event stream event larger than {self._max} bytes")
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        elif name == b"id":
            if b"\x00" not in value:
                self._id = value.decode("utf-8", "replace")
                self.last_event_id = self._id
        elif name == b"retry":
            if value.isdigit():
                self.retry = int(value)
        # Other field names are ignored, as the spec says.

    def _dispatch(self, events: list[SSEEvent]) -> None:
        data = self._data
        if data:
            payload = data[0] if len(data) == 1 else b"\n".join(data)
            events.append(SSEEvent(payload, self._event, self._id))
            self._data = []
        # An event with no data is not dispatched; its fields are reset all the same.
        self._event = None
        self._id = None
        self._size = 0


# --------------------------------------------------------------------------- chunks

ChunkKind = Literal["token", "done", "error", "meta"]

_DONE_RAW: Final = b"data: [DONE]\n\n"
_NO_IDS: Final[tuple[int, ...]] = ()


@attrs.define(slots=True, weakref_slot=False)
class Chunk:
    """One classified stream event (not frozen: a plain ``__init__`` is cheaper per token).

    Attributes:
        kind: ``"token"`` (the event adds generated output), ``"meta"`` (role-only
            deltas, usage, finish markers without tokens), ``"done"``
            (``data: [DONE]``) or ``"error"`` (an error object in the stream).
        raw: the event re-encoded for verbatim forwarding (``data: ...\\n\\n``).
        data: the parsed JSON object (``None`` for ``[DONE]``).
        token_ids: the generated token ids the event adds, over all choices.
        count: output tokens the event adds: ``len(token_ids)``, or, when an engine
            sends output without ids, one per choice carrying output.
        text: generated text (completions ``text`` or chat ``delta.content``).
        finish_reason: the first non-null ``finish_reason`` among the choices.
        usage: the ``usage`` object when the event carries one.
        error: the error object of an ``"error"`` chunk.
        status: the HTTP status an ``"error"`` chunk maps to (its integer ``code``
            when that is a 4xx/5xx status, else 500).
    """

    kind: ChunkKind
    raw: bytes
    data: dict[str, Any] | None = None
    token_ids: tuple[int, ...] = _NO_IDS
    count: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    status: int | None = None


_DONE_CHUNK: Final = Chunk("done", _DONE_RAW)
# Delta fields that carry generated output (vLLM names reasoning "reasoning", older
# builds and other engines "reasoning_content").
_OUTPUT_DELTA_KEYS: Final = ("content", "reasoning", "reasoning_content", "tool_calls", "refusal")


def _error_status(error: Mapping[str, Any]) -> int:
    code = error.get("code")
    if type(code) is int and 400 <= code <= 599:
        return code
    return 500


def _error_chunk(raw: bytes, obj: dict[str, Any], error: dict[str, Any]) -> Chunk:
    return Chunk("error", raw, obj, error=error, status=_error_status(error))


def parse_chunk(event: SSEEvent, *, lazy: bool = False) -> Chunk:
    """Classify one event of an OpenAI-compatible completions or chat stream.

    ``lazy`` as for :func:`parse_data`.

    Raises:
        MalformedEvent: the data is neither ``[DONE]`` nor a JSON object.
    """
    data = event.data
    if event.event is None and event.id is None and b"\n" not in data:
        return parse_data(data, lazy=lazy)
    return parse_data(data, event.encode(), lazy=lazy)


_IDS_KEY: Final = b'"token_ids":['
_ID_CHARS: Final = b"0123456789, "


def scan_token_event(data: bytes) -> int:
    """Count the token ids of an event of the usual shape without parsing it; 0 otherwise.

    The usual shape is what vLLM streams for one choice with ``return_token_ids``: a
    JSON object with exactly one ``"token_ids":[...]`` array of integers, a null
    ``finish_reason``, no ``error`` key and no usage. A JSON string cannot contain
    the key's bytes unescaped, so text that mentions ``"token_ids":[`` is not mistaken
    for it; braces and brackets must balance. This is not a JSON validation: a
    malformed event of that shape is relayed as it is (the client's parser sees it).
    Anything else (0) needs :func:`parse_data`.
    """
    if data[:1] != b"{" or data[-1:] != b"}":
        return 0
    start = data.find(_IDS_KEY)
    if start < 0:
        return 0
    start += len(_IDS_KEY)
    end = data.find(b"]", start)
    if end < 0 or data.find(_IDS_KEY, end) >= 0:
        return 0
    ids = data[start:end]
    if not ids.strip() or ids.translate(None, _ID_CHARS):
        return 0
    if (
        b'"finish_reason":null' not in data
        or b'"error"' in data
        or (b'"usage"' in data and b'"usage":null' not in data)
        # A cut or corrupted event rarely balances (and text with brackets only costs
        # a full parse).
        or data.count(b"{") != data.count(b"}")
        or data.count(b"[") != data.count(b"]")
    ):
        return 0
    return ids.count(b",") + 1


def parse_data(data: bytes, raw: bytes | None = None, *, lazy: bool = False) -> Chunk:
    """Classify the data of one event (see :func:`parse_chunk`).

    Args:
        data: the event's data.
        raw: the event as forwarded; by default ``data: <data>\\n\\n``, which is
            the event exactly when it had one data line and no other field.
        lazy: a token event of the usual shape (:func:`scan_token_event`) is counted
            without being parsed: its chunk has ``count`` and ``raw`` but no ``data``,
            ``token_ids`` or ``text`` (for a forwarder that needs only those).

    Raises:
        MalformedEvent: the data is neither ``[DONE]`` nor a JSON object.
    """
    if lazy:
        count = scan_token_event(data)
        if count:
            return Chunk("token", b"data: " + data + b"\n\n" if raw is None else raw, None, _NO_IDS, count)
    if data[:1] != b"{" and data.strip() == b"[DONE]":
        return _DONE_CHUNK
    try:
        obj = json_loads(data)
    except ValueError as exc:  # orjson.JSONDecodeError and json's are ValueErrors
        raise MalformedEvent(f"stream event is not JSON: {exc}") from None
    if type(obj) is not dict:
        raise MalformedEvent("stream event is not a JSON object")
    if raw is None:
        raw = b"data: " + data + b"\n\n"

    if "error" in obj or obj.get("object") == "error":
        err = obj.get("error")
        if err is None:
            # vLLM's older ErrorResponse shape: the error fields at the top level.
            return _error_chunk(raw, obj, {k: v for k, v in obj.items() if k != "object"})
        if isinstance(err, dict):
            return _error_chunk(raw, obj, err)
        return _error_chunk(raw, obj, {"message": str(err)})

    choices = obj.get("choices")
    _check_fields(obj, choices)
    if type(choices) is list and len(choices) == 1:
        # The usual event: one choice that carries its token ids.
        choice = choices[0]
        if type(choice) is dict:
            ids = choice.get("token_ids")
            delta = choice.get("delta")
            if delta is None:
                text = choice.get("text")
            elif type(delta) is dict:
                if ids is None:
                    ids = delta.get("token_ids")
                text = delta.get("content")
            else:
                ids = None
            if type(ids) is list and ids:
                reason = choice.get("finish_reason")
                usage = obj.get("usage")
                return Chunk(
                    "token",
                    raw,
                    obj,
                    tuple(ids),
                    len(ids),
                    text if type(text) is str else "",
                    reason if type(reason) is str else None,
                    usage if type(usage) is dict else None,
                )
    return _classify(raw, obj, choices)


def _is_ids(ids: object) -> bool:
    if type(ids) is not list:
        return False
    for t in ids:  # (a loop: a generator costs more than the usual one id)
        if type(t) is not int or t < 0:
            return False
    return True


def _check_fields(obj: dict[str, Any], choices: object) -> None:
    """Refuse (:class:`MalformedEvent`) an event whose fields that readers of the stream
    use have the wrong type: ``choices`` a list of objects, each one's ``token_ids`` a
    list of token ids, its ``text``, ``finish_reason`` and ``delta`` contents strings,
    ``usage`` an object (null stands for absent throughout)."""
    if choices is not None and type(choices) is not list:
        raise MalformedEvent("the event's choices are not a list")
    usage = obj.get("usage")
    if usage is not None and type(usage) is not dict:
        raise MalformedEvent("the event's usage is not an object")
    for choice in choices or ():
        if type(choice) is not dict:
            raise MalformedEvent("a choice is not an object")
        ids = choice.get("token_ids")
        if ids is not None and not _is_ids(ids):
            raise MalformedEvent("a choice's token_ids are not token ids")
        text, reason = choice.get("text"), choice.get("finish_reason")
        if (text is not None and type(text) is not str) or (reason is not None and type(reason) is not str):
            raise MalformedEvent("a choice's text or finish_reason is not a string")
        delta = choice.get("delta")
        if delta is None:
            continue
        if type(delta) is not dict:
            raise MalformedEvent("a choice's delta is not an object")
        ids = delta.get("token_ids")
        if ids is not None and not _is_ids(ids):
            raise MalformedEvent("a delta's token_ids are not token ids")
        for key in ("content", "reasoning", "reasoning_content"):
            value = delta.get(key)
            if value is not None and type(value) is not str:
                raise MalformedEvent(f"a delta's {key} is not a string")


def _classify(raw: bytes, obj: dict[str, Any], choices: object) -> Chunk:
    """Any number of choices, with or without token ids."""
    ids: list[int] = []
    count_without_ids = 0
    texts: list[str] = []
    finish: str | None = None
    if type(choices) is list:
        for choice in choices:
            if type(choice) is not dict:
                continue
            choice_ids = choice.get("token_ids")
            delta = choice.get("delta")
            if type(delta) is not dict:
                delta = None
            if choice_ids is None and delta is not None:
                choice_ids = delta.get("token_ids")
            if delta is None:
                text = choice.get("text")
            else:
                text = delta.get("content")
            if type(text) is str and text:
                texts.append(text)
            if type(choice_ids) is list and choice_ids:
                ids.extend(choice_ids)
            elif _carries_output(choice, delta):
                count_without_ids += 1
            reason = choice.get("finish_reason")
            if finish is None and type(reason) is str:
                finish = reason
    usage = obj.get("usage")
    if type(usage) is not dict:
        usage = None
    count = len(ids) + count_without_ids
    return Chunk(
        "token" if count else "meta",
        raw,
        obj,
        tuple(ids) if ids else _NO_IDS,
        count,
        texts[0] if len(texts) == 1 else "".join(texts),
        finish,
        usage,
    )


def _carries_output(choice: dict[str, Any], delta: dict[str, Any] | None) -> bool:
    """Whether a choice without token ids still carries generated output."""
    if delta is None:
        return bool(choice.get("text"))
    return any(delta.get(key) for key in _OUTPUT_DELTA_KEYS)
