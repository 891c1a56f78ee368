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


def test_prompt_size_of_every_shape_of_chat_content() -> None:
    # A non-message first does not end the count; a message without content costs its
    # overhead; parts that are not objects or carry no text count nothing.
    chat = {"messages": [
        "not a message",
        {"role": "user"},
        {"role": "user", "content": ["a string part", {"type": "text", "text": "ab"}, {"type": "text", "text": "cde"}]},
    ]}  # fmt: skip
    assert prompt_size(chat, "chat") == 12 + 12 + 2 + 3
    assert prompt_size({}, "chat") == 0
    assert prompt_size({"messages": None}, "chat") == 0
    # A chat body's prompt field is no chat content; a completion's messages are no prompt.
    assert prompt_size({"prompt": "hello"}, "chat") == 0
    assert prompt_size({"messages": [{"role": "user", "content": "hello"}]}, "completions") == 0


def test_prompt_size_of_text_a_json_body_can_carry_but_utf8_cannot() -> None:
    # A lone surrogate ("\ud800" escaped in JSON) is counted as one replaced byte,
    # wherever the text sits.
    assert prompt_size({"prompt": "a\ud800"}, "completions") == 2
    assert prompt_size({"messages": [{"role": "user", "content": "a\ud800"}]}, "chat") == 12 + 2
    parts = [{"type": "text", "text": "\ud800b"}]
    assert prompt_size({"messages": [{"role": "user", "content": parts}]}, "chat") == 12 + 2


def test_each_observation_moves_the_ratio_by_its_weight_after_the_first_ones() -> None:
    lengths = PromptLengths(weight=0.25)
    lengths.observe("chat", 100, 20)  # 0.2: the first counts fully
    lengths.observe("chat", 100, 40)  # 0.4: the mean of two (1/2 > 0.25)
    assert lengths.ratio["chat"] == pytest.approx(0.3)
    assert lengths.observations == {"completions": 0, "chat": 2}
    lengths.observe("chat", 100, 60)  # 1/3 > 0.25 still
    assert lengths.ratio["chat"] == pytest.approx(0.4)
    lengths.observe("chat", 100, 80)  # now the weight: 0.4 + 0.25 * (0.8 - 0.4)
    assert lengths.ratio["chat"] == pytest.approx(0.5)
    assert lengths.observations["chat"] == 4
    assert lengths.estimate("chat", 3) == 2 and lengths.estimate("chat", 5) == 2  # rounded, to even
    assert lengths.ratio["completions"] == 0.3


def test_a_tiny_observed_ratio_is_clamped_from_below() -> None:
    lengths = PromptLengths()
    lengths.observe("completions", 10_000, 1)
    assert lengths.ratio["completions"] == pytest.approx(0.01)  # not 1e-4
    assert lengths.estimate("completions", 1) == 1


def test_the_settings_bounds_are_inclusive_and_their_errors_say_them() -> None:
    assert PromptLengths(initial_ratio=0.01).ratio["chat"] == 0.01
    assert PromptLengths(initial_ratio=4.0).ratio["completions"] == 4.0
    assert PromptLengths(weight=1).weight == 1
    with pytest.raises(ValueError) as low:
        PromptLengths(initial_ratio=0.009)
    assert str(low.value) == "initial_ratio must be in [0.01, 4.0]"
    with pytest.raises(ValueError) as high:
        PromptLengths(initial_ratio=4.01)
    assert str(high.value) == "initial_ratio must be in [0.01, 4.0]"
    with pytest.raises(ValueError) as heavy:
        PromptLengths(weight=1.01)
    assert str(heavy.value) == "weight must be in (0, 1]"
    with pytest.raises(ValueError) as none:
        PromptLengths(weight=-0.5)
    assert str(none.value) == "weight must be in (0, 1]"
