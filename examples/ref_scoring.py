"""Reference-model scoring under torch.no_grad(), compiled with torch.compile.

The miles / RLHF case: a frozen reference model scores the sampled tokens (for the
KL penalty), in inference mode, with the stock ``inductor`` backend.  Nothing here
knows about chunked-logits::

    CHUNKED_LOGITS=1 python examples/ref_scoring.py      # the environment switch
    chunked-logits run -- examples/ref_scoring.py        # the launcher
    python examples/ref_scoring.py                       # stock Inductor

The reference model is a tiny bf16 Llama built from a config (no download).  The
script compares the compiled scores with eager ones (no compile, no pass) and
prints one JSON line with the largest difference and
``torch._dynamo.utils.counters["chunked_logits"]``.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM


def ref_logprobs(ref_model, input_ids, temperature: float):
    """log p_ref(token) of every sampled token, [B, T-1], in FP32."""
    logits = ref_model(input_ids=input_ids).logits[:, :-1, :].float()
    logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"],
                        help="the model's attention (transformers' attn_implementation)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False, attn_implementation=args.attention)
    ref = LlamaForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq_len),
                              generator=torch.Generator().manual_seed(1))

    scorer = torch.compile(ref_logprobs)
    with torch.no_grad():
        scores = scorer(ref, input_ids, args.temperature)
        scores = scorer(ref, input_ids, args.temperature)  # second call: the compiled code
        eager = ref_logprobs(ref, input_ids, args.temperature)
        # FP64 log-softmax of the (eager) bf16 logits: the best any FP32 path can do
        logits = ref(input_ids=input_ids).logits[:, :-1, :].double() / args.temperature
        exact = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    print(json.dumps({
        "shape": list(scores.shape),
        "dtype": str(scores.dtype),
        "sequence_logprob": scores.sum(-1).tolist()[:2],
        "max_diff_vs_eager": (scores - eager).abs().max().item(),
        "max_err_vs_fp64": (scores.double() - exact).abs().max().item(),
        "eager_max_err_vs_fp64": (eager.double() - exact).abs().max().item(),
        "counters": dict(counters["chunked_logits"]),
    }))


if __name__ == "__main__":
    main()
