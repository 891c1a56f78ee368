"""How the simulated engine turns generated token ids into output: text with stop
strings, and logprobs.

:class:`OutputText` is vLLM's detokenizer for one request, with the simulator's
context-free token texts: each token appends its text; a stop string found in the new
characters (and the stop string's length before them) finishes the request, the text cut
before it (after it with ``include_stop_str_in_output``); and while a stop string may
still complete, a streamed answer holds back the last ``len(longest stop) - 1``
characters, sending them with the tokens that follow or when the request finishes.

Logprobs are deterministic in the token: the sampled token (the most likely one: the
simulator decodes greedily) comes first, then alternatives less likely each. A
completions chunk carries vLLM's parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs`` as a token-to-logprob map, ``text_offset`` counted over the text sent
before); a chat chunk carries ``content`` entries whose ``top_logprobs`` are the first
``top_logprobs`` entries of the same map, as vLLM builds both from one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from narwhal.testing.tokenizer import FIRST_WORD_ID, VOCAB_SIZE, token_text

__all__ = ["OutputText", "chat_logprobs", "completion_logprobs", "logprob_entries", "token_piece"]


class OutputText:
    """The output text of one request as vLLM's detokenizer produces and streams it.

    Args:
        stop: the request's stop strings.
        include_stop: ``include_stop_str_in_output``.
    """

    def __init__(self, stop: Sequence[str] = (), *, include_stop: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.hold = max(len(s) for s in self.stop) - 1 if self.stop and not include_stop else 0
        self.text = ""
        self.sent = 0
        #: The stop string that finished the request, once one did.
        self.stop_reason: str | None = None

    def add(self, token: int) -> None:
        """Append ``token``'s text and look for a stop string in what it added."""
        piece = token_text(token)
        self.text += piece
        for stop in self.stop:
            at = self.text.find(stop, max(0, len(self.text) - len(piece) - len(stop) + 1))
            if at < 0:
                continue
            self.stop_reason = stop
            self.text = self.text[: at + len(stop) if self.include_stop else at]
            return

    def take(self, finished: bool) -> str:
        """The text not sent yet that may be sent now (all of it once ``finished``)."""
        end = len(self.text) if finished else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out


def token_piece(token: int) -> str:
    """How logprobs name a token: its text, or vLLM's ``bytes:`` form for a token that
    is part of a character."""
    return token_text(token) or f"bytes:\\x{token % 256:02x}"


def logprob_entries(token: int, k: int) -> list[tuple[int, float]]:
    """``max(k, 1)`` (token id, logprob) pairs: the sampled ``token`` first."""
    best = -((token * 2654435761) % 1000) / 1000.0
    entries = [(token, best)]
    span = VOCAB_SIZE - FIRST_WORD_ID
    for j in range(1, max(k, 1)):
        alt = FIRST_WORD_ID + (token * 31 + j * 7919) % span
        if alt == token:
            alt = FIRST_WORD_ID + (alt + 1 - FIRST_WORD_ID) % span
        entries.append((alt, round(best - 0.5 * j, 6)))
    return entries


def _top_map(token: int, k: int) -> dict[str, float]:
    return {token_piece(t): lp for t, lp in logprob_entries(token, k)}


def completion_logprobs(token: int, k: int, offset: int) -> dict[str, Any]:
    """A completions chunk's ``logprobs`` for one token (``k``: the request's ``logprobs``)."""
    return {
        "text_offset": [offset],
        "token_logprobs": [logprob_entries(token, 0)[0][1]],
        "tokens": [token_piece(token)],
        "top_logprobs": [_top_map(token, k)],
    }


def chat_logprobs(token: int, k: int) -> dict[str, Any]:
    """A chat chunk's ``logprobs`` for one token (``k``: the request's ``top_logprobs``)."""
    piece = token_piece(token)
    top = list(_top_map(token, k).items())[:k]
    return {
        "content": [
            {
                "token": piece,
                "logprob": logprob_entries(token, 0)[0][1],
                "bytes": list(piece.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top],
            }
        ]
    }
