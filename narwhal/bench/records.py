"""The per-request record of a bench run, and the results file (JSON lines).

One :class:`RequestResult` is kept for every *scheduled* request, started or not, in
schedule order. Times are seconds on the run's monotonic clock, relative to the start
of the run (``scheduled_s``, ``actual_s``) or to the request's own start (``ttft_s``,
``latency_s``); wall-clock Unix times appear only in the summary, as labels.

The stream-accounting rule (:data:`ACCOUNTING`) travels with every result set: output
is counted by token id, TTFT and TPOT follow the deployment-client column of the
measurement contract, and refused and failed scored requests stay in the denominator.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import attrs

__all__ = [
    "ACCOUNTING",
    "RESULTS_FILE",
    "SCORED_CLASSES",
    "SUMMARY_FILE",
    "TERMINAL_CLASSES",
    "RequestResult",
    "is_scored_class",
    "read_results",
    "write_results",
]

RESULTS_FILE: Final = "results.jsonl"
SUMMARY_FILE: Final = "summary.json"

#: The client's terminal classes; ``http_<status>`` stands for every non-200 status
#: other than 503 (``http_429``, ``http_500``, ...).
TERMINAL_CLASSES: Final[tuple[str, ...]] = (
    "ok",
    "refused",
    "http_<status>",
    "stream_error",
    "stream_closed",
    "connect_error",
    "timeout",
    "client_cancelled",
)

#: The classes a scored request may end in; all of them are in the SLO denominator.
#: ``client_cancelled`` (the bench itself stopped the request: interrupted run) is not
#: the server's outcome and is left out, as are warmup requests.
SCORED_CLASSES: Final[tuple[str, ...]] = tuple(c for c in TERMINAL_CLASSES if c != "client_cancelled")

#: The stream-accounting rule every result set records (compared by ``bench compare``).
ACCOUNTING: Final[dict[str, str]] = {
    "rule": "narwhal-token-ids/1",
    "output_len": (
        "identified output tokens: the token ids each SSE event carries (return_token_ids); "
        "events with empty text or only reasoning count their ids; an event with output but "
        "no ids counts one per choice and is flagged in events_without_ids"
    ),
    "ttft": "HTTP request start to the first identified output token",
    "tpot": "first to last identified output token over output_len - 1; only with >= 2 tokens",
    "success": "HTTP 200, at least one identified token, data: [DONE], no error event",
    "denominator": (
        "every scored request: refused and failed included; warmup requests and "
        "client_cancelled (the bench stopped them) excluded"
    ),
    "percentiles": "linear interpolation; with_failures counts each scored failure as a miss",
}


def is_scored_class(terminal_class: str) -> bool:
    """Whether a request that ended in ``terminal_class`` can be scored."""
    return terminal_class != "client_cancelled"


@attrs.define
class RequestResult:
    """What the bench retained about one scheduled request.

    Attributes:
        index: position in the schedule, from 0.
        request_id: the id sent as ``x-request-id`` (the router journal's key).
        route: ``completions`` or ``chat``.
        warmup: a warmup request (never scored).
        scheduled_s: scheduled start, seconds after the run started.
        actual_s: actual start (request sent), seconds after the run started; None if
            the request never started.
        lag_s: ``actual_s - scheduled_s``: how late the client was (cap or saturation).
        cap_wait_s: the part of the lag spent waiting for the concurrency cap.
        status: HTTP status of the response (None when none arrived).
        terminal_class: one of :data:`TERMINAL_CLASSES` (``http_<status>`` expanded).
        error: ``{"message", "type", "code"}`` of a failed request, else None.
        prompt_len: the prompt length asked for, in tokens (None for a trace's text).
        prompt_tokens: prompt tokens the server reported in ``usage``.
        requested_output_len: the output length asked for (``max_tokens``).
        output_len: identified output tokens received.
        completion_tokens: completion tokens the server reported in ``usage``.
        empty_text_tokens: identified tokens whose event carried no text (empty text,
            or reasoning only): counted in ``output_len`` all the same.
        events_without_ids: events with output but no token ids (counted one per choice).
        ttft_s: request start to the first identified token.
        tpot_s: first to last identified token over ``output_len - 1`` (>= 2 tokens).
        latency_s: request start to the terminal outcome.
        finish_reason: the finish reason the server reported.
        done: whether ``data: [DONE]`` arrived.
        stream: the stream of a mix the request belongs to (None: no mix).
        tenant: its stream's tenant (a label of the mix).
        latency_class: its stream's class (a label of the mix).
    """

    index: int
    request_id: str
    route: str
    warmup: bool = False
    scheduled_s: float = 0.0
    actual_s: float | None = None
    lag_s: float | None = None
    cap_wait_s: float | None = None
    status: int | None = None
    terminal_class: str = "client_cancelled"
    error: dict[str, Any] | None = None
    prompt_len: int | None = None
    prompt_tokens: int | None = None
    requested_output_len: int = 0
    output_len: int = 0
    completion_tokens: int | None = None
    empty_text_tokens: int = 0
    events_without_ids: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    finish_reason: str | None = None
    done: bool = False
    stream: str | None = None
    tenant: str | None = None
    latency_class: str | None = None

    @property
    def scored(self) -> bool:
        """Whether this request is in the SLO denominator."""
        return not self.warmup and is_scored_class(self.terminal_class)

    @property
    def ok(self) -> bool:
        """Whether the request succeeded."""
        return self.terminal_class == "ok"

    def to_json(self) -> dict[str, Any]:
        """The record as one JSON object (``scored`` included)."""
        out = attrs.asdict(self)
        out["scored"] = self.scored
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RequestResult:
        """Rebuild a record from :meth:`to_json` output (unknown keys ignored)."""
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in names})


def write_results(path: str | os.PathLike[str], records: Iterable[RequestResult]) -> None:
    """Write one JSON line per record."""
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                yield number, line


def read_results(path: str | os.PathLike[str]) -> list[RequestResult]:
    """Read a results file (or the one inside a run directory).

    Raises:
        ValueError: a line is not a result record (the message names the line).
        OSError: the file cannot be read.
    """
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_FILE
    records: list[RequestResult] = []
    for number, line in _lines(p):
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise TypeError("not a JSON object")
            records.append(RequestResult.from_json(obj))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{p}:{number}: not a bench result record ({exc})") from None
    return records
