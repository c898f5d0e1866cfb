"""SFT with TRL's SFTTrainer, unmodified, compiled with the stock inductor backend.

Nothing here knows about chunked-logits; turn the pass on from outside::

    chunked-logits run -- examples/trl_sft.py                       # the launcher
    CHUNKED_LOGITS=1 python examples/trl_sft.py                     # the environment switch
    chunked-logits run --upgrade-low-precision -- examples/trl_sft.py
    python examples/trl_sft.py                                      # stock Inductor

The model is a tiny bf16 Llama and a word-level tokenizer built locally (no download),
the dataset a few random texts in memory.  ``torch_compile=True`` compiles the model's
forward.  TRL (1.16) trains SFT through its own fused lm_head (``add_fused_lm_head``: the
log-probs per tile of the vocabulary, upcast to FP32 per tile), so the forward holds no
``[T, V]`` logits for the pass to rewrite; docs/enabling.md ("TRL") says what fires.  The
script prints the training losses and the pass's counters as JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from datasets import Dataset
from tiny_hf import TRAINER_SETTINGS, build_model, build_tokenizer, random_texts
from torch._dynamo.utils import counters
from trl import SFTConfig, SFTTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--words", type=int, default=24, help="words per text (tokens, plus eos)")
    parser.add_argument("--vocab", type=int, default=2048)
    args = parser.parse_args()

    tokenizer = build_tokenizer(args.vocab)
    model = build_model(tokenizer, max_len=args.words + 8)
    texts = random_texts(args.steps * args.batch, args.words, args.vocab)
    data = Dataset.from_list([{"text": t} for t in texts])
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            max_length=args.words + 8,
            **TRAINER_SETTINGS,
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"losses": [h["loss"] for h in logs], "entropy": [h["entropy"] for h in logs],
                      "grad_norm": [h["grad_norm"] for h in logs],
                      "counters": dict(counters["chunked_logits"]), "pid": os.getpid()}))


if __name__ == "__main__":
    main()
