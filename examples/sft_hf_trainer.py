"""SFT with the Hugging Face Trainer, compiled with the stock inductor backend.

Plain Trainer code: nothing here knows about chunked-logits.  The Trainer (through
accelerate) only accepts backend names from a fixed list, so the pass is turned on
from outside::

    chunked-logits run -- examples/sft_hf_trainer.py          # the launcher
    CHUNKED_LOGITS=1 python examples/sft_hf_trainer.py        # the environment switch
    python examples/sft_hf_trainer.py                         # stock Inductor

The model is a tiny bf16 Llama built from a config (no download).  Its forward
computes the loss with transformers' ForCausalLMLoss: ``logits.float()`` then
``cross_entropy``, the FP32 [B*T, V] copy the pass removes.  The script prints the
training losses as JSON on its last line (``--out`` also writes them to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from tiny_hf import TRAINER_SETTINGS
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences: labels are the inputs (causal LM)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--out", default=None, help="write the losses as JSON here")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # a bf16 model: bf16 logits

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            **TRAINER_SETTINGS,
        )
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=RandomTokens(args.steps * args.batch, args.seq_len, args.vocab))
        trainer.train()
    losses = [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(losses, f)
    print(json.dumps({"losses": losses, "backend": training_args.torch_compile_backend,
                      "pid": os.getpid()}))


if __name__ == "__main__":
    main()
