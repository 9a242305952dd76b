"""A tiny Llama and its tokenizer, made locally with a fixed seed, for a real ``vllm serve`` on CPU.

Why: the end-to-end tests, ``demo --engine`` and the bench serve a real model through vLLM's OpenAI server,
and nothing may be downloaded. A model of a few MB made here is enough: what is under test is the KV cache's
path (saved to Mooncake, loaded back on a store hit), and a greedy completion that depends on the whole prompt
shows that the loaded KV is the right one. So the weights are redrawn with a fixed seed at a scale where the
output follows the prompt (the default initialisation's small weights give every prompt the same tokens),
and the tokenizer is a byte-level BPE trained on fixed text. Same seed, same files.

vLLM's CPU attention needs a head size of 32, 64, 80, 96, 112, 128...; this model has 32 (128 / 4 heads).

Runs in the engine's venv (torch, transformers, tokenizers)::

    python -m mooncake_lookout.connector.rigs.tiny_model OUT_DIR

It writes ``config.json``, the weights and the tokenizer files into ``OUT_DIR`` and prints ``OUT_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

SEED = 20261206
VOCAB = 2048
HIDDEN = 128
HEADS = 4  # head_dim 32: one of the sizes vLLM's CPU attention takes
LAYERS = 2
MAX_POSITIONS = 1024
WEIGHT_STD = 0.5  # large enough that the greedy output follows the prompt

WORDS = ("mooncake", "store", "prefix", "cache", "lookup", "block", "token", "engine", "scheduler", "worker",
         "master", "segment", "transfer", "request", "prompt", "completion", "deadline", "timeout", "hit", "miss",
         "recompute", "latency", "metrics", "trace", "span", "budget", "the", "a", "of", "to", "in", "and", "is",
         "on", "for", "with", "as", "by", "at", "from", "that", "this", "it", "be", "are", "was", "were", "or",
         "an", "not", "but")


def corpus(lines: int = 2000) -> list[str]:
    """Fixed training text for the tokenizer: sentences of the words above and digits, from a seeded draw."""
    import random

    draw = random.Random(SEED)
    out = []
    for i in range(lines):
        words = [draw.choice(WORDS) for _ in range(draw.randint(4, 16))]
        out.append(f"{i} " + " ".join(words) + f" {draw.randint(0, 99999)}.")
    return out


def make_tokenizer(out: Path) -> int:
    """Train a byte-level BPE on :func:`corpus` and save it as a ``PreTrainedTokenizerFast``; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def make_model(out: Path) -> None:
    """A 2-layer Llama with weights drawn from a fixed seed, saved with ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    draw = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=draw) * WEIGHT_STD)
    model.save_pretrained(str(out))


def make(out: Path) -> Path:
    """The model and tokenizer in ``out`` (made if absent; idempotent)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        size = make_tokenizer(out)
        if size > VOCAB:
            raise AssertionError(f"the tokenizer has {size} tokens, more than the model's {VOCAB}")
    if not (out / "config.json").exists():
        make_model(out)
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))


__all__ = ["SEED", "VOCAB", "corpus", "make", "make_model", "make_tokenizer"]
