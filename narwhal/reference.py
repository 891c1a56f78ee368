"""The fleet-document reference, generated from the config classes so it cannot drift.

``python -m narwhal.reference > docs/fleet-reference.md`` writes it; a test checks that
the committed file is what this module generates and that every field appears. Its last
section lists every limit on what reaches the router (:data:`LIMITS`).
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, get_args, get_origin

import attrs

from narwhal.config import FleetConfig
from narwhal.engines.badinput import LOG_INTERVAL_S
from narwhal.engines.client import ERROR_BODY_LIMIT, TEMPLATE_TOKENS
from narwhal.engines.metrics import MAX_CAPACITY, MAX_REQUESTS
from narwhal.router.admin import REFUSAL_LOG_INTERVAL_S
from narwhal.router.lifecycle import SESSION_HINT_MAX
from narwhal.router.store import MAX_DEPTH as STORE_MAX_DEPTH
from narwhal.router.store import MAX_ITEMS as STORE_MAX_ITEMS
from narwhal.router.store import MAX_REPLY as STORE_MAX_REPLY

__all__ = ["LIMITS", "document_fields", "fleet_reference_markdown"]

#: Every limit on what clients, engines and the limits store can make the router hold or wait for, in the
#: order the reference lists them: a fleet-document path (its default and meaning come
#: from the document's classes), or a fixed limit as ``(name, value, meaning)``.
LIMITS: tuple[str | tuple[str, str, str], ...] = (
    # What clients send.
    "$.server.max_body_bytes",
    "$.server.max_header_bytes",
    "$.server.header_timeout_s",
    "$.server.body_timeout_s",
    "$.server.keepalive_timeout_s",
    "$.server.max_concurrent_requests",
    "$.server.max_connections",
    "$.server.send_timeout_s",
    ("session name", f"{SESSION_HINT_MAX} characters", "Of a request's ``x-session-id`` header (or its ``user`` field) "
     "the cache plan keeps this much as the session's name."),
    ("refused-admin warnings", f"1 per route and cause per {REFUSAL_LOG_INTERVAL_S:g} s",
     "Refusals past the first are summed into the next warning; a path that is no admin route counts as one."),
    # What the limits store (tenancy.store) sends.
    ("limits store reply", f"{STORE_MAX_REPLY // 1024} KiB, {STORE_MAX_ITEMS:,} values, {STORE_MAX_DEPTH} deep",
     "A larger, longer or deeper reply, or one that is not RESP, counts as the store unreachable for that request "
     "(``tenancy.store.on_outage``); a wait or a served total that is no finite number is not taken."),
    # What engines send.
    "$.engine_limits.max_response_bytes",
    "$.engine_limits.max_metrics_bytes",
    "$.engine_limits.max_stream_event_bytes",
    "$.engine_limits.max_listed_models",
    "$.engine_limits.kv_max_message_bytes",
    "$.engine_limits.kv_max_queued_messages",
    "$.engine_limits.kv_replay_timeout_s",
    "$.engine_limits.kv_replay_max_batches",
    "$.engine_limits.kv_replay_max_bytes",
    ("engine error body", f"{ERROR_BODY_LIMIT // 1024} KiB", "An engine's answer other than 200 is read up to this much (its message is "
     "kept); the rest is not read and the connection is closed."),
    ("engine response head", "64 KiB", "An engine's status line and headers; a longer head is the engine's "
     "protocol error."),
    ("`/tokenize` count", f"1 a prompt byte + {TEMPLATE_TOKENS}", "The most tokens a text prompt (or chat messages of text) can "
     "tokenize to, chat template included; a larger count, one that differs from the number of token ids "
     "returned, or ids that are not integers >= 0 are the engine's protocol error (counted by its breaker; the "
     "next producer is asked), never a context-length 400 to the client."),
    ("engine `/metrics` gauges",
     f"requests 0..{MAX_REQUESTS:.0e}, KV usage 0..1, capacities 0..2^{MAX_CAPACITY.bit_length() - 1}, start time a date",
     "A gauge outside its range (``+Inf`` requests running, NaN usage, a negative capacity) makes the whole "
     "answer unusable: the engine's load report and prefix view are dropped until a sound one comes."),
    ("KV-event batch", "token ids integers >= 0, block size >= 1, finite ts",
     "A batch that is not well typed (or not msgpack, or a map keyed by an array) is malformed: the engine's "
     "cache view is dropped and rebuilt from the events that follow."),
    ("bad-input warnings", f"1 per engine and source per {LOG_INTERVAL_S:g} s", "Faults past the first are counted "
     "(``narwhal_engine_bad_input_total``) and summed into the next warning."),
)


def _attributes_doc(cls: type) -> dict[str, str]:
    """``name -> description`` from the class docstring's ``Attributes:`` section."""
    doc = cls.__doc__ or ""
    out: dict[str, str] = {}
    in_section = False
    current: str | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            in_section = True
            continue
        if not in_section:
            continue
        m = re.match(r"^(\w+): (.*)$", stripped)
        if m:
            current = m.group(1)
            out[current] = m.group(2)
        elif stripped and current is not None:
            out[current] += " " + stripped
    return out


def _summary(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0]


def _unwrap(tp: Any) -> tuple[Any, bool, bool]:
    """(inner type, optional, is a list)."""
    optional = False
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        optional = len(args) < len(get_args(tp))
        tp = args[0] if len(args) == 1 else tp
        origin = get_origin(tp)
    if origin is tuple:
        return get_args(tp)[0], optional, True
    return tp, optional, False


def _type_name(tp: Any) -> str:
    inner, optional, is_list = _unwrap(tp)
    if get_origin(inner) is Literal:
        name = " \\| ".join(json.dumps(a) for a in get_args(inner))
    elif attrs.has(inner):
        name = "object"
    else:
        name = {str: "string", int: "integer", float: "number", bool: "boolean"}.get(inner, str(inner))
    if is_list:
        name = f"list of {name}"
    return f"{name} or null" if optional else name


def _default(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    factory = getattr(default, "factory", None)
    if factory is not None:
        value = factory()
        if attrs.has(type(value)):
            return "(section defaults)"
        default = value
    if isinstance(default, tuple):
        default = list(default)
    return f"`{json.dumps(default)}`"


def document_fields(cls: type = FleetConfig, prefix: str = "$") -> Iterator[tuple[str, type, attrs.Attribute[Any]]]:
    """Every (JSON path, owning class, field) of the fleet document, depth first."""
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        path = f"{prefix}.{field.name}"
        yield path, cls, field
        inner, _, is_list = _unwrap(hints[field.name])
        if attrs.has(inner):
            yield from document_fields(inner, f"{path}[]" if is_list else path)


def fleet_reference_markdown() -> str:
    lines = [
        "# Fleet document reference",
        "",
        "<!-- Generated by `python -m narwhal.reference`; do not edit by hand. -->",
        "",
        "The fleet document is JSON. Every section except `engines` is optional; unknown keys",
        "are errors, and every error names the JSON path of the offending value",
        "(`expected a number > 0 @ $.engine.first_token_timeout_s`).",
        "",
    ]
    sections: dict[str, tuple[type, list[tuple[str, attrs.Attribute[Any]]]]] = {}
    for path, owner, field in document_fields():
        parent = path.rsplit(".", 1)[0]
        sections.setdefault(parent, (owner, []))[1].append((path, field))
    for parent, (owner, fields) in sections.items():
        docs = _attributes_doc(owner)
        hints = typing.get_type_hints(owner)
        lines += [f"## `{parent}` — {owner.__name__}", "", _summary(owner), ""]
        lines += ["| path | type | default | meaning |", "| --- | --- | --- | --- |"]
        for path, field in fields:
            meaning = docs.get(field.name, "").replace("|", "\\|")
            lines.append(f"| `{path}` | {_type_name(hints[field.name])} | {_default(field)} | {meaning} |")
        lines.append("")
    lines += _limits_markdown()
    return "\n".join(lines)


def _limits_markdown() -> list[str]:
    fields = {path: (owner, field) for path, owner, field in document_fields()}
    lines = [
        "## Limits",
        "",
        "Every bound on what a client, an engine or the limits store can make the router hold or wait for. Past a client",
        "limit the request is refused (4xx); past an engine limit the answer is that engine's fault (an",
        "engine protocol error, counted in `narwhal_engine_bad_input_total{engine,source}`), never the",
        "router's.",
        "",
        "| limit | default | setting | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for entry in LIMITS:
        if isinstance(entry, str):
            owner, field = fields[entry]
            meaning = _attributes_doc(owner).get(field.name, "").replace("|", "\\|")
            lines.append(f"| {field.name} | {_default(field)} | `{entry}` | {meaning} |")
        else:
            name, value, meaning = entry
            lines.append(f"| {name} | {value} | fixed | {meaning} |")
    lines.append("")
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(fleet_reference_markdown())
