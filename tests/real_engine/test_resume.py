"""A stream that survives its consumer (``recovery.resume_streams``) on the real pair.

The consumer is killed (SIGKILL, ``pair.py kill consumer``) in the middle of a greedy
stream; the router resumes it on the producer, which may decode in this test's fleet
(a same-worker decode of the prompt and the tokens already sent). The client's stream
must complete, with the tokens and the text of an uninterrupted greedy run of the same
request on the producer alone. Each test restarts the consumer when it is done (the
fault tests that follow need it).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .kit import (
    HTTP_TIMEOUT,
    MODEL,
    RealPair,
    RouterProcess,
    Streamed,
    new_request_id,
    stream,
    unique_prompt,
)

pytestmark = pytest.mark.real_engine

MAX_TOKENS = 300
KILL_AFTER = 10


def resuming_fleet(fleet: dict[str, Any]) -> dict[str, Any]:
    """The pair's fleet with resumes on and a producer that may decode too; the
    consumer listed first, so that a fresh router's first stream decodes on it (ties go
    to the first engine of a role)."""
    doc = copy.deepcopy(fleet)
    engines = {e["name"]: e for e in doc["engines"]}
    engines["producer"]["roles"] = ["prefill", "decode"]
    doc["engines"] = [engines["consumer"], engines["producer"]]
    doc.setdefault("recovery", {})["resume_streams"] = True
    return doc


@pytest.fixture
def resuming_router(managed_pair: RealPair, tmp_path: Path) -> Iterator[RouterProcess]:
    proc = RouterProcess(resuming_fleet(managed_pair.fleet), tmp_path / "router")
    proc.start()
    try:
        yield proc
    finally:
        status = proc.stop()
        # The fault tests that follow need the consumer.
        if "consumer" in managed_pair.dirty:
            managed_pair.restart("consumer")
    assert status == 0, proc.log()[-3000:]


def uninterrupted(pair: RealPair, path: str, body: dict[str, Any]) -> tuple[list[int], str]:
    """The token ids and text of the same request, streamed by the producer alone."""
    with httpx.Client(base_url=pair.urls["producer"], timeout=HTTP_TIMEOUT) as client:
        out = stream(client, path, body)
    assert out.status == 200 and out.done, out.events[-3:]
    return out.token_ids, text_of(out)


def text_of(out: Streamed) -> str:
    parts = []
    for event in out.data:
        for choice in event.get("choices") or ():
            parts.append((choice.get("delta") or {}).get("content") or "" if "delta" in choice else choice["text"])
    return "".join(parts)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_survives_its_consumer(
    managed_pair: RealPair, resuming_router: RouterProcess, route: str
) -> None:
    pair = managed_pair
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":
        body["messages"] = [{"role": "user", "content": unique_prompt(20)}]
    else:
        body["prompt"] = unique_prompt(20)
    whole_ids, whole_text = uninterrupted(pair, path, body)
    assert len(whole_ids) == MAX_TOKENS

    rid = new_request_id(f"resume-{route}")
    killed_after: list[int] = []
    killed_at: list[float] = []

    def kill_after_some_tokens(out: Streamed) -> None:
        if not killed_after and len(out.token_ids) >= KILL_AFTER:
            killed_after.append(len(out.token_ids))
            killed_at.append(time.monotonic())
            pair.kill_now("consumer")

    with httpx.Client(base_url=resuming_router.url, timeout=HTTP_TIMEOUT) as client:
        out = stream(client, path, body, request_id=rid, on_event=kill_after_some_tokens)
    assert killed_after, "the stream ended before the consumer could be killed"
    assert not pair.healthy("consumer")

    # One uninterrupted stream: every token once, the uninterrupted run's.
    assert out.status == 200
    assert out.done, out.events[-3:]
    assert not any("error" in e for e in out.data), out.events[-3:]
    assert len(out.token_ids) == MAX_TOKENS
    first_difference = next((i for i, (a, b) in enumerate(zip(out.token_ids, whole_ids, strict=True)) if a != b), None)
    assert first_difference is None, (
        f"token {first_difference} differs from the uninterrupted run (killed after {killed_after[0]})"
    )
    assert text_of(out) == whole_text
    assert out.usage is not None and out.usage["completion_tokens"] == MAX_TOKENS
    assert len({e["id"] for e in out.data}) == 1
    kind = "chat.completion.chunk" if route == "chat" else "text_completion"
    assert {e["object"] for e in out.data} == {kind}

    # The journal: the broken attempt on the consumer, the resume on the producer.
    record = resuming_router.record(rid)
    assert record["terminal_class"] == "ok" and record["status"] == 200, record
    assert record["output_len"] == MAX_TOKENS
    broken, resumed = record["attempts"]
    assert (broken["consumer"], broken["outcome"]) == ("consumer", "decode_failed"), broken
    assert broken["output_tokens"] >= killed_after[0]
    assert resumed["resume"] == "stream_closed", resumed
    assert (resumed["producer"], resumed["consumer"], resumed["same_worker"]) == ("producer", "producer", True)
    assert resumed["outcome"] == "ok"
    assert broken["output_tokens"] + resumed["output_tokens"] == MAX_TOKENS
    assert out.usage["prompt_tokens"] == record["prompt_tokens"]
    # The delay at the break, from the router's view: the break seen to the first token
    # after it, against the continuation's own first-token time (placement to token).
    gap = resumed["first_token_s"] - resumed["resumed_at_s"]
    own = resumed["first_token_s"] - resumed["started_s"]
    print(
        f"resume ({route}): killed after {killed_after[0]} tokens; break seen -> first token after it "
        f"{gap * 1000:.1f} ms; the continuation's own first-token time {own * 1000:.1f} ms; "
        f"the original first byte {record['first_byte_s'] * 1000:.1f} ms"
    )
    assert gap <= own + 0.05  # the router adds nothing of note before the continuation starts
