"""A tiny Llama and its tokenizer, made locally with a fixed seed: ``python -m ...rigs.demo_model OUT``.

Why: a real engine needs a model and a tokenizer, and the tests and the demo download nothing. Two layers,
hidden 128, 4 heads of 32 (the CPU attention's head sizes), vocabulary 2048; weights redrawn with a fixed seed
so greedy output depends on the prompt; a byte-level BPE trained on a fixed text. Runs in the engine venv
(torch, transformers, tokenizers); about 2 MB, a few seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 2048
SEED = 0


def make(out: Path) -> Path:
    """Write the model and tokenizer to ``out``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"word{i} token{i % 37} alpha{i % 11}" for i in range(3000)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    return out


if __name__ == "__main__":
    make(Path(sys.argv[1]))

__all__ = ["SEED", "VOCAB", "make"]
