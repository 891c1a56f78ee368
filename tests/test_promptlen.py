"""PromptLengths: prompt sizes and the learned tokens-per-byte ratio."""

from __future__ import annotations

import pytest

from narwhal.router.promptlen import PromptLengths, prompt_size


def test_prompt_size_counts_utf8_bytes_and_chat_contents() -> None:
    assert prompt_size({"prompt": "héllo"}, "completions") == 6
    assert prompt_size({"prompt": [1, 2, 3]}, "completions") == 0
    chat = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
        "not a message",
    ]}  # fmt: skip
    assert prompt_size(chat, "chat") == 12 + 8 + 12 + 2


def test_ratio_starts_conservative_then_follows_the_engines() -> None:
    lengths = PromptLengths()
    assert lengths.estimate("completions", 1000) == 300
    assert lengths.estimate("completions", 0) == 1
    lengths.observe("completions", 1000, 200)
    assert lengths.ratio["completions"] == pytest.approx(0.2)  # the first observation counts fully
    for _ in range(200):
        lengths.observe("completions", 1000, 250)
    assert lengths.estimate("completions", 4000) == pytest.approx(1000, abs=5)
    assert lengths.ratio["chat"] == pytest.approx(0.3)  # routes learn separately


def test_unusable_observations_are_ignored_and_extremes_clamped() -> None:
    lengths = PromptLengths()
    lengths.observe("chat", 0, 10)
    lengths.observe("chat", 10, 0)
    assert lengths.observations["chat"] == 0
    lengths.observe("chat", 1, 1000)
    assert lengths.ratio["chat"] == 4.0
    with pytest.raises(ValueError, match="initial_ratio"):
        PromptLengths(initial_ratio=10)
    with pytest.raises(ValueError, match="weight"):
        PromptLengths(weight=0)
