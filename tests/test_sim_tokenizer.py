"""The simulator's deterministic word-level tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.testing.tokenizer import (
    FIRST_WORD_ID,
    VOCAB_SIZE,
    ChatTemplateError,
    decode,
    encode,
    encode_chat,
    extend_key,
    generated_token,
    greedy_tokens,
    prompt_key,
    render_chat,
    token_text,
)


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=["Z", "C"]), min_size=1), max_size=50))
def test_one_token_per_word_in_range(words: list[str]) -> None:
    ids = encode(" ".join(words))
    assert len(ids) == len(words)
    assert all(FIRST_WORD_ID <= t < VOCAB_SIZE for t in ids)
    assert ids == encode("\n".join(words))  # whitespace-insensitive, stable


def test_chat_template() -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]  # fmt: skip
    assert render_chat(messages) == "<|system|> be brief\n<|user|> hi there\n<|assistant|>"
    assert encode_chat(messages) == encode(render_chat(messages))
    with pytest.raises(ChatTemplateError):
        render_chat([{"content": "no role"}])
    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "user", "content": [{"type": "image_url"}]}])


def test_generated_tokens_are_deterministic() -> None:
    key = prompt_key(encode("a b c"))
    assert key == prompt_key(encode("a b c")) != prompt_key(encode("a b d"))
    first = [generated_token(0, key, i) for i in range(100)]
    assert first == [generated_token(0, key, i) for i in range(100)]
    assert first != [generated_token(1, key, i) for i in range(100)]
    assert all(FIRST_WORD_ID <= t < VOCAB_SIZE for t in first)


def test_greedy_tokens_follow_the_token_context() -> None:
    prompt = encode("a b c d")
    tokens = greedy_tokens("m", prompt, 12)
    # A continuation whose prompt is the prompt plus the first k tokens goes on alike.
    for k in (1, 5, 11):
        assert greedy_tokens("m", [*prompt, *tokens[:k]], 12 - k) == tokens[k:]
    assert greedy_tokens("other", prompt, 12) != tokens  # another model, other tokens
    assert prompt_key([*prompt, tokens[0]]) == extend_key(prompt_key(prompt), tokens[0])


def test_about_one_in_eight_ids_has_no_text() -> None:
    ids = [generated_token(0, 123, i) for i in range(4000)]
    empty = sum(token_text(t) == "" for t in ids)
    assert 0.09 < empty / len(ids) < 0.16
    assert decode(ids[:5]) == "".join(token_text(t) for t in ids[:5])
