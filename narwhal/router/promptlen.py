"""Prompt length before placement, without a tokenizer round trip.

Placement needs a prompt's length in tokens before any engine has seen it. Asking a
producer's ``/tokenize`` is exact but costs a full engine exchange per request;
:class:`PromptLengths` instead scales the prompt's UTF-8 size by a tokens-per-byte
ratio per route, learned from the exact counts the producers report with every
prefill (``usage.prompt_tokens``). The ratio starts at a conservative 0.3 tokens per
byte (English prose runs near 0.25, code and non-Latin scripts higher) and follows an
exponentially weighted average of what the engines report, so an estimate converges
to the fleet's own tokenizer on the fleet's own traffic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from narwhal.engines.connector import RequestKind

__all__ = ["PromptLengths", "prompt_size"]

#: Template overhead per chat message, in bytes of content (role markers and separators).
_PER_MESSAGE_BYTES: Final = 12
_MIN_RATIO: Final = 0.01
_MAX_RATIO: Final = 4.0


def prompt_size(body: Mapping[str, Any], kind: RequestKind) -> int:
    """The UTF-8 size of a text prompt, or of a chat's message contents plus overhead."""
    if kind == "completions":
        prompt = body.get("prompt")
        return len(prompt.encode("utf-8", "replace")) if isinstance(prompt, str) else 0
    size = 0
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        size += _PER_MESSAGE_BYTES
        content = message.get("content")
        if isinstance(content, str):
            size += len(content.encode("utf-8", "replace"))
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    size += len(text.encode("utf-8", "replace"))
    return size


class PromptLengths:
    """A learned tokens-per-byte ratio per route.

    Args:
        initial_ratio: tokens per byte before any observation.
        weight: weight of each new observation in the running average.
    """

    def __init__(self, *, initial_ratio: float = 0.3, weight: float = 0.05) -> None:
        if not _MIN_RATIO <= initial_ratio <= _MAX_RATIO:
            raise ValueError(f"initial_ratio must be in [{_MIN_RATIO}, {_MAX_RATIO}]")
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        self.weight = weight
        self.ratio: dict[str, float] = {"completions": initial_ratio, "chat": initial_ratio}
        self.observations: dict[str, int] = {"completions": 0, "chat": 0}

    def estimate(self, kind: RequestKind, size: int) -> int:
        """Estimated tokens of a prompt of ``size`` bytes (at least 1)."""
        return max(1, round(size * self.ratio[kind]))

    def observe(self, kind: RequestKind, size: int, tokens: int) -> None:
        """Learn from an engine's exact count of a prompt of ``size`` bytes."""
        if size <= 0 or tokens <= 0:
            return
        sample = min(max(tokens / size, _MIN_RATIO), _MAX_RATIO)
        n = self.observations[kind]
        # The first observations count fully (a plain mean), later ones with the weight.
        w = max(self.weight, 1.0 / (n + 1))
        self.ratio[kind] += w * (sample - self.ratio[kind])
        self.observations[kind] = n + 1
