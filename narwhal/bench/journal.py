"""Joining a result set with the router journal, by request id.

The bench sends every request with its own ``x-request-id``, and the router journals
each request under the id its client gave. The join breaks each client TTFT into the
router's parts:

- ``router_ttft_s``: router arrival to prefill completion (token counting, placement,
  prefill queueing and prefill);
- ``transfer_queue_s`` = ``first_byte_s - ttft_s``: KV transfer and decode queueing
  up to the first visible token;
- ``outside_router_s`` = client TTFT ``- first_byte_s``: what the router does not see
  (the network both ways, the router's own send, the client's receive).

Where the router priced placement, the summary also gives, per producer, the error
of its TTFT predictions against the journaled TTFT (``|predicted - observed| /
observed``) and the prefix-cache hits it predicted beside those the producer reported;
per consumer, the prompt tokens it was predicted to hold (and so not to pull) beside
the ``cached_tokens`` its decode usage reported (vLLM counts pulled tokens there too).

Journal lines of other clients are ignored; a journal line that is not JSON (a
router killed mid-write) is counted and skipped; an id journaled twice is ambiguous
and left out of the join.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from narwhal.bench.records import RequestResult
from narwhal.bench.report import distribution, format_seconds

__all__ = ["JOIN_SCHEMA", "JoinResult", "join_journal", "join_row", "read_journal", "render_join"]

JOIN_SCHEMA: Final = "narwhal.bench.join/1"


@attrs.define
class JoinResult:
    """The joined rows and what could not be joined.

    Attributes:
        rows: one object per result whose request id the journal has once.
        unmatched: request ids of results the journal does not have.
        ambiguous: request ids the journal has more than once.
        malformed_lines: journal lines that are not JSON objects.
    """

    rows: list[dict[str, Any]]
    unmatched: list[str]
    ambiguous: list[str]
    malformed_lines: int

    def summary(self) -> dict[str, Any]:
        """Counts, disagreements and the distribution of each TTFT part over successes."""
        both_ok = [r for r in self.rows if r["client_class"] == "ok" and r["router_class"] == "ok"]

        def dist(key: str) -> dict[str, Any]:
            return distribution([r[key] for r in both_ok if r[key] is not None])

        return {
            "schema": JOIN_SCHEMA,
            "matched": len(self.rows),
            "unmatched": len(self.unmatched),
            "ambiguous": len(self.ambiguous),
            "malformed_lines": self.malformed_lines,
            "class_disagreements": sum(not r["classes_agree"] for r in self.rows),
            "output_len_disagreements": sum(not r["output_len_agrees"] for r in self.rows),
            "parts_over_successes": {
                "client_ttft_s": dist("client_ttft_s"),
                "router_ttft_s": dist("router_ttft_s"),
                "transfer_queue_s": dist("transfer_queue_s"),
                "outside_router_s": dist("outside_router_s"),
            },
            "prediction_by_producer": prediction_by_producer(both_ok),
            "prediction_by_consumer": prediction_by_consumer(both_ok),
        }


def prediction_by_producer(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per producer: TTFT prediction error and predicted vs reported cached tokens."""
    errors: dict[str, list[float]] = {}
    cached: dict[str, list[int]] = {}
    for r in rows:
        producer, predicted, observed = r.get("producer"), r.get("predicted_ttft_s"), r.get("router_ttft_s")
        if not isinstance(producer, str):
            continue
        if predicted is not None and observed:
            errors.setdefault(producer, []).append(abs(predicted - observed) / observed)
        if r.get("predicted_cached_tokens") is not None:
            sums = cached.setdefault(producer, [0, 0, 0])
            sums[0] += int(r["predicted_cached_tokens"])
            reported = r.get("cached_tokens")
            sums[1] += int(reported or 0)
            # an engine that does not report its hits cannot contradict the prediction
            sums[2] += reported is not None and int(r["predicted_cached_tokens"]) != int(reported)
    out: dict[str, dict[str, Any]] = {}
    for producer in sorted(set(errors) | set(cached)):
        sums = cached.get(producer, [0, 0, 0])
        out[producer] = {
            "ttft_error": distribution(errors.get(producer, [])),
            "cached_tokens_predicted": sums[0],
            "cached_tokens_reported": sums[1],
            "cached_mispredictions": sums[2],
        }
    return out


def prediction_by_consumer(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per consumer: the prompt tokens it was predicted to hold (not to pull), over the
    prompt tokens of those attempts, and the ``cached_tokens`` its usage reported."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        consumer, held = r.get("consumer"), r.get("consumer_predicted_cached_tokens")
        if not isinstance(consumer, str) or held is None:
            continue
        c = out.setdefault(consumer, {"n": 0, "prompt_tokens": 0, "cached_tokens_predicted": 0,
                                      "cached_tokens_reported": 0, "reported": 0})  # fmt: skip
        c["n"] += 1
        c["prompt_tokens"] += int(r.get("prompt_tokens") or 0)
        c["cached_tokens_predicted"] += int(held)
        reported = r.get("consumer_cached_tokens")
        if reported is not None:
            c["reported"] += 1
            c["cached_tokens_reported"] += int(reported)
    return dict(sorted(out.items()))


def read_journal(path: str | os.PathLike[str], ids: Iterable[str]) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """The journal lines whose ``request_id`` is in ``ids``, and the malformed line count.

    Raises:
        OSError: the journal cannot be read.
    """
    wanted = set(ids)
    found: dict[str, list[dict[str, Any]]] = {}
    malformed = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                malformed += 1
                continue
            if not isinstance(obj, dict):
                malformed += 1
                continue
            rid = obj.get("request_id")
            if isinstance(rid, str) and rid in wanted:
                found.setdefault(rid, []).append(obj)
    return found, malformed


def _sub(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) - float(b)
    return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


#: The router's classes of a 503 refusal (the client's ``refused``): no capacity, or no
#: engine of a role in placement.
_REFUSED = ("refused", "no_engine")


def _classes_agree(client: str, router: str) -> bool:
    if client == "ok" or router == "ok":
        return client == router
    if client == "refused" or router in _REFUSED:
        return client == "refused" and router in _REFUSED
    return True  # both failed; the names differ by design (client vs router view)


def join_row(rec: RequestResult, entry: Mapping[str, Any]) -> dict[str, Any]:
    """One joined row: the client's figures beside the router's."""
    router_ttft = _number(entry.get("ttft_s"))
    first_byte = _number(entry.get("first_byte_s"))
    router_class = str(entry.get("terminal_class"))
    router_out = entry.get("output_len")
    attempts = entry.get("attempts")
    last = attempts[-1] if isinstance(attempts, list) and attempts and isinstance(attempts[-1], dict) else {}
    return {
        "request_id": rec.request_id,
        "client_class": rec.terminal_class,
        "router_class": router_class,
        "classes_agree": _classes_agree(rec.terminal_class, router_class),
        "client_status": rec.status,
        "router_status": entry.get("status"),
        "client_ttft_s": rec.ttft_s,
        "router_ttft_s": router_ttft,
        "router_first_byte_s": first_byte,
        "transfer_queue_s": _sub(first_byte, router_ttft),
        "outside_router_s": _sub(rec.ttft_s, first_byte),
        "client_tpot_s": rec.tpot_s,
        "router_tpot_s": _number(entry.get("tpot_s")),
        "client_output_len": rec.output_len,
        "router_output_len": router_out,
        "output_len_agrees": router_out == rec.output_len,
        "attempts": len(entry.get("attempts") or ()),
        "producer": entry.get("producer"),
        "consumer": entry.get("consumer"),
        "router_error": entry.get("error"),
        # The attempt that ran last is the one the outcome and the TTFT belong to.
        "predicted_ttft_s": _number(last.get("predicted_ttft_s")),
        "predicted_cached_tokens": last.get("predicted_cached_tokens"),
        "cached_tokens": last.get("cached_tokens"),
        "prompt_tokens": entry.get("prompt_tokens"),
        "consumer_predicted_cached_tokens": last.get("consumer_predicted_cached_tokens"),
        "consumer_cached_tokens": last.get("consumer_cached_tokens"),
    }


def join_journal(records: Sequence[RequestResult], journal: str | os.PathLike[str]) -> JoinResult:
    """Join ``records`` with the router journal at ``journal`` by request id."""
    found, malformed = read_journal(journal, (r.request_id for r in records))
    rows: list[dict[str, Any]] = []
    unmatched: list[str] = []
    ambiguous: list[str] = []
    for rec in records:
        entries = found.get(rec.request_id)
        if not entries:
            unmatched.append(rec.request_id)
        elif len(entries) > 1:
            ambiguous.append(rec.request_id)
        else:
            rows.append(join_row(rec, entries[0]))
    return JoinResult(rows, unmatched, ambiguous, malformed)


def render_join(summary: Mapping[str, Any]) -> str:
    """The join summary as a table."""
    lines = [
        f"joined {summary['matched']} requests with the router journal; {summary['unmatched']} not in the "
        f"journal, {summary['ambiguous']} ambiguous, {summary['malformed_lines']} malformed journal lines",
        f"  disagreements: {summary['class_disagreements']} terminal outcomes, "
        f"{summary['output_len_disagreements']} output lengths",
        "",
        f"  {'TTFT part (successes)':<28}{'n':>7}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99", "max")),
    ]
    labels = {
        "client_ttft_s": "client TTFT",
        "router_ttft_s": "router ttft_s (prefill)",
        "transfer_queue_s": "KV transfer + decode queue",
        "outside_router_s": "outside the router",
    }
    for key, label in labels.items():
        dist = summary["parts_over_successes"][key]
        cells = [format_seconds(dist.get(k)) for k in ("mean", "p50", "p90", "p99", "max")]
        lines.append(f"  {label:<28}{dist['n']:>7}" + "".join(f"{c:>12}" for c in cells))
    by_producer = summary.get("prediction_by_producer") or {}
    if by_producer:
        lines += ["", f"  {'prediction (successes)':<28}{'n':>7}{'TTFT err p50':>14}{'p90':>8}"
                      f"{'cached predicted':>18}{'reported':>10}{'mispredicted':>14}"]  # fmt: skip
        for producer, p in by_producer.items():
            err = p["ttft_error"]
            p50 = f"{err['p50'] * 100:.1f}%" if err.get("p50") is not None else "-"
            p90 = f"{err['p90'] * 100:.1f}%" if err.get("p90") is not None else "-"
            lines.append(f"  {producer:<28}{err['n']:>7}{p50:>14}{p90:>8}{p['cached_tokens_predicted']:>18}"
                         f"{p['cached_tokens_reported']:>10}{p['cached_mispredictions']:>14}")  # fmt: skip
    by_consumer = summary.get("prediction_by_consumer") or {}
    if by_consumer:
        lines += ["", f"  {'consumer (successes)':<28}{'n':>7}{'prompt':>10}{'held (not pulled)':>19}"
                      f"{'share':>8}{'reported':>10}"]  # fmt: skip
        for consumer, c in by_consumer.items():
            share = f"{c['cached_tokens_predicted'] / c['prompt_tokens'] * 100:.1f}%" if c["prompt_tokens"] else "-"
            reported = str(c["cached_tokens_reported"]) if c["reported"] else "-"
            lines.append(f"  {consumer:<28}{c['n']:>7}{c['prompt_tokens']:>10}{c['cached_tokens_predicted']:>19}"
                         f"{share:>8}{reported:>10}")  # fmt: skip
    return "\n".join(lines)
