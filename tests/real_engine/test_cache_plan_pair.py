"""The cache plan through ``narwhal serve`` on the real pair: a session's turns land where
its history is cached, and the engine's own count says so; a reset is followed.

The pair runs with prefix caching, cached-token counts in usage and KV-cache events on
(``tools/vllm-cpu/pair.py``'s default; the module skips for a pair started with
``--no-kv-events``). As in ``test_prefix_pair.py`` (whose rig this module shares) both
engines may prefill (the producer prefill-only, the consumer prefill and decode), priced
by a profile measured on the pair until a hit decides placement, and the router keeps
an exact view of both caches from their events.

1. A conversation that names itself (``x-session-id``) sends turns that each repeat the
   one before with its answer and add to it: from the second turn on every turn is
   placed on the engine that holds the history (the journal's ``placement`` names the
   session and its owner, rule ``owner``), the predicted hit is the engine's own
   ``cached_tokens``, and it covers the turn before whole.
2. A conversation that does not name itself is found from its turns (``session:`` in
   the journal's ``placement`` from its second turn on), and its turns stay together
   the same way.
3. The holder's cache is reset: the router's view of it empties, the next turn is
   predicted a miss there and the engine reports one (or it is placed on the other
   engine, which holds none of it either); the turn after it hits again.

``/fleet`` shows each engine's prefix view (``events``) and that its predicted hits
materialized.

Run (the lead runs the real-engine suite; it starts the pair itself):

    PYTHONPATH=$PWD python3 -m pytest -m real_engine tests/real_engine/test_cache_plan_pair.py -v -s
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .kit import HTTP_TIMEOUT, MODEL, RealPair, new_request_id
from .test_prefix_pair import ENGINES, FOLLOW_S, Rig, open_rig

pytestmark = pytest.mark.real_engine

#: The TTFT target the plan places against (it plans only with one: its owners are the
#: producers that compute a group's request within 80% of it). Generous for one CPU
#: core an engine, so that either engine is an owner whatever the load of the machine.
TTFT_TARGET_S = 5.0


@pytest.fixture(scope="module")
def rig(pair: RealPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """``test_prefix_pair``'s rig, with a TTFT target (the plan's default otherwise)."""
    yield from open_rig(pair, tmp_path_factory, {"slo": {"ttft_s": TTFT_TARGET_S}})


#: Tokens of the system prompt and of each user turn (about); turns of a conversation.
SYSTEM_TOKENS = 512
TURN_TOKENS = 120
TURNS = 5
OUTPUT_TOKENS = 24


def _turn(rig: Rig, prompt: str, tag: str, session: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One turn through the router: its answer and its journal record."""
    rid = new_request_id(tag)
    headers = {"x-request-id": rid}
    if session is not None:
        headers["x-session-id"] = session
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    r = rig.client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    record = rig.router.record(rid)
    assert record["terminal_class"] == "ok", record
    return dict(r.json()), record


def _conversation(rig: Rig, tag: str, session: str | None) -> list[dict[str, Any]]:
    """A conversation of :data:`TURNS` turns; returns each turn's last attempt, checked."""
    bs = rig.block_size
    system = f"{secrets.token_hex(4)} " + rig.text_of(f"{tag}s", SYSTEM_TOKENS)
    history = system
    attempts = []
    previous: list[int] = []
    for turn in range(TURNS):
        history = f"{history} " + rig.text_of(f"{tag}u{turn}x", TURN_TOKENS)
        ids = rig.tokens(history)
        answer, record = _turn(rig, history, f"{tag}-{turn}", session)
        attempt = record["attempts"][-1]
        placement = attempt["placement"]
        assert placement is not None and placement["producer"]["engine"] == attempt["producer"], record
        # The engine's own count is what the router predicted, on every turn.
        assert attempt["cached_tokens"] == attempt["predicted_cached_tokens"], record
        if turn:
            # The turn before is cached whole where this one went (both engines cache
            # what they compute; the consumer what it pulls too).
            assert attempt["cached_tokens"] >= (len(previous) - 1) // bs * bs - bs, (turn, record)
            assert placement["group"].startswith("session:"), record
            assert attempt["producer"] in (placement["owners"] or [attempt["producer"]]), record
        attempts.append(attempt)
        previous = ids
        # The next turn repeats the answer (its text, as a client would send it back).
        history = f"{history} {answer['choices'][0]['text']}"
    return attempts


def test_a_named_conversation_stays_where_its_history_is(rig: Rig) -> None:
    for name in ENGINES:
        rig.reset(name)
    session = f"chat-{secrets.token_hex(3)}"
    attempts = _conversation(rig, "n", session)
    groups = {a["placement"]["group"] for a in attempts}
    assert groups == {f"session:{session}"}, attempts
    homes = {a["producer"] for a in attempts[1:]}
    assert len(homes) == 1, [(a["producer"], a["placement"]["rule"]) for a in attempts]
    print("named:", [(a["producer"], a["placement"]["rule"], a["cached_tokens"]) for a in attempts])


def test_an_unnamed_conversation_is_found_from_its_turns(rig: Rig) -> None:
    attempts = _conversation(rig, "u", None)
    later = [a["placement"]["group"] for a in attempts[1:]]
    assert len(set(later)) == 1 and later[0].startswith("session:"), later  # (a number: found, not named)
    print("unnamed:", [(a["producer"], a["placement"]["rule"], a["cached_tokens"]) for a in attempts])


def test_a_reset_of_the_holder_is_followed(rig: Rig) -> None:
    bs = rig.block_size
    session = f"reset-{secrets.token_hex(3)}"
    system = f"{secrets.token_hex(4)} " + rig.text_of("rs", SYSTEM_TOKENS)
    history = f"{system} " + rig.text_of("ru0x", TURN_TOKENS)
    answer, _ = _turn(rig, history, "reset-0", session)
    history = f"{history} {answer['choices'][0]['text']} " + rig.text_of("ru1x", TURN_TOKENS)
    answer, record = _turn(rig, history, "reset-1", session)
    holder = record["attempts"][-1]["producer"]
    assert record["attempts"][-1]["cached_tokens"] > 0
    rig.reset(holder)  # its view empties (the AllBlocksCleared event arrived)
    other = next(n for n in ENGINES if n != holder)
    rig.reset(other)  # and the other holds none of it (the consumer caches what it pulls)
    history = f"{history} {answer['choices'][0]['text']} " + rig.text_of("ru2x", TURN_TOKENS)
    answer, record = _turn(rig, history, "reset-2", session)
    attempt = record["attempts"][-1]
    assert attempt["predicted_cached_tokens"] == attempt["cached_tokens"] == 0, record
    history = f"{history} {answer['choices'][0]['text']} " + rig.text_of("ru3x", TURN_TOKENS)
    _, record = _turn(rig, history, "reset-3", session)
    attempt = record["attempts"][-1]
    assert attempt["cached_tokens"] == attempt["predicted_cached_tokens"] >= 4 * bs, record
    fleet = httpx.get(f"{rig.router.admin_url}/fleet", timeout=HTTP_TIMEOUT).json()["engines"]
    views = {e["name"]: e.get("prefix_cache") or {} for e in fleet}
    assert {n: views[n].get("view") for n in ENGINES} == dict.fromkeys(ENGINES, "events"), views
    assert all(views[n].get("state") != "overpredicting" for n in ENGINES), views
    print(f"reset: {holder} reset before turn 2; turn 3 placed on {attempt['producer']} with "
          f"{attempt['cached_tokens']} cached; views {views}; follow window {FOLLOW_S:g} s")
