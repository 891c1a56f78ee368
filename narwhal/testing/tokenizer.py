"""A deterministic word-level tokenizer for the simulated engine.

Not a real tokenizer, but one with the properties the router depends on: every
whitespace-separated word of a prompt is one token (so a test controls the prompt
length exactly), the same text always gives the same ids, a prompt given as a list of
token ids passes through, chat messages are rendered through one fixed template, and
each generated token is a function of the model and the whole token context before it
(the prompt and the tokens generated so far), as a real model's greedy choice is: every
engine of a model generates the same tokens for the same context, and a prompt that is
another's prompt plus its first k generated tokens continues it token for token
(:func:`greedy_tokens`). About one generated id
in eight detokenizes to the empty string, like vLLM's events that end inside an
incomplete UTF-8 sequence, so consumers must count token ids, not text chunks.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "FIRST_WORD_ID",
    "VOCAB_SIZE",
    "ChatTemplateError",
    "decode",
    "encode",
    "encode_chat",
    "extend_key",
    "generated_token",
    "greedy_tokens",
    "model_seed",
    "prompt_key",
    "render_chat",
    "token_text",
]

#: Ids are in ``[0, VOCAB_SIZE)``; words hash into ``[FIRST_WORD_ID, VOCAB_SIZE)``.
VOCAB_SIZE = 32000
FIRST_WORD_ID = 256

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class ChatTemplateError(ValueError):
    """The ``messages`` of a chat request cannot be rendered."""


def _word_id(word: str) -> int:
    return FIRST_WORD_ID + zlib.crc32(word.encode("utf-8")) % (VOCAB_SIZE - FIRST_WORD_ID)


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per whitespace-separated word."""
    return [_word_id(word) for word in text.split()]


def render_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """Render chat ``messages`` through the simulator's fixed template.

    Raises:
        ChatTemplateError: a message is not ``{"role": str, "content": str | parts}``.
    """
    lines: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        lines.append(f"<|{role}|> {_content_text(message.get('content'), i)}")
    if add_generation_prompt:
        lines.append("<|assistant|>")
    return "\n".join(lines)


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
                    continue
            raise ChatTemplateError(f"messages[{i}].content: only text parts are supported")
        return " ".join(texts)
    raise ChatTemplateError(f"messages[{i}].content must be a string or a list of parts")


def encode_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat ``messages`` rendered through the fixed template."""
    return encode(render_chat(messages, add_generation_prompt=add_generation_prompt))


def prompt_key(ids: Iterable[int]) -> int:
    """A stable 32-bit key of a token sequence (a running checksum over its ids: the
    key of ``a + b`` is ``a``'s key extended by ``b``, see :func:`extend_key`)."""
    crc = 0
    for token in ids:
        crc = extend_key(crc, token)
    return crc


def extend_key(key: int, token: int) -> int:
    """The key of a sequence whose key is ``key``, with ``token`` appended."""
    return zlib.crc32(struct.pack("<I", token & 0xFFFFFFFF), key)


def model_seed(model: str) -> int:
    """The seed of a model's generated tokens (its "weights"): engines of one model agree."""
    return zlib.crc32(model.encode("utf-8"))


def generated_token(seed: int, key: int, index: int) -> int:
    """The token id generated after the context with ``key`` and length ``index``,
    under ``seed`` (a model's: :func:`model_seed`)."""
    raw = struct.pack("<QIQ", seed & 0xFFFFFFFFFFFFFFFF, key & 0xFFFFFFFF, index)
    return FIRST_WORD_ID + zlib.crc32(raw) % (VOCAB_SIZE - FIRST_WORD_ID)


def greedy_tokens(model: str, prompt_ids: Sequence[int], n: int) -> list[int]:
    """The first ``n`` tokens an engine of ``model`` generates after ``prompt_ids``."""
    seed = model_seed(model)
    key = prompt_key(prompt_ids)
    length = len(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        token = generated_token(seed, key, length)
        out.append(token)
        key = extend_key(key, token)
        length += 1
    return out


def token_text(token_id: int) -> str:
    """The text of one token; ids divisible by 8 give ``""`` (a partial character)."""
    if token_id % 8 == 0:
        return ""
    h = zlib.crc32(struct.pack("<I", token_id & 0xFFFFFFFF))
    length = 1 + h % 6
    letters = "".join(_LETTERS[(h >> (3 + 5 * k)) % 26] for k in range(length))
    return (" " if (h >> 1) % 3 == 0 else "") + letters


def decode(ids: Iterable[int]) -> str:
    """The text of a sequence of token ids."""
    return "".join(token_text(t) for t in ids)
