"""A tiny tokenizer and a tiny bf16 Llama, built locally (no downloads), for the TRL examples.

The tokenizer is a word-level one over the words ``t0 .. t{V-4}`` plus pad / eos / unk,
so any text made of those words round-trips, and the model's vocabulary is its size.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<unk>"]

# What every example's Trainer run shares: compiled (the Trainer's default backend,
# "inductor"), on CPU, one log line per step, nothing saved or reported, seeded.
TRAINER_SETTINGS = dict(
    torch_compile=True,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    dataloader_num_workers=0,
    disable_tqdm=True,
    seed=0,
)


def build_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = SPECIALS + [f"t{i}" for i in range(vocab - len(SPECIALS))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_model(tokenizer: PreTrainedTokenizerFast, max_len: int, seed: int = 0) -> LlamaForCausalLM:
    """A 1-layer bf16 Llama over ``tokenizer``'s vocabulary, seeded weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_len, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def random_texts(n: int, words: int, vocab: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``words`` random words of the tokenizer's vocabulary."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(vocab - len(SPECIALS))}" for _ in range(words)) for _ in range(n)]
