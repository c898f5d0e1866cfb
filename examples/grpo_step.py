"""A GRPO/PPO-style policy step, compiled with torch.compile.

Written the way RL trainers write it, with nothing that knows about chunked-logits:
model forward, ``logits / temperature``, token log-probs and entropy from the FP32
log-softmax, a clipped policy loss, backward, optimizer step.  Run it::

    python examples/grpo_step.py --backend chunked_logits     # the backend by name
    chunked-logits run -- examples/grpo_step.py              # stock "inductor", launcher
    python examples/grpo_step.py                              # stock Inductor

The policy is a tiny bf16 Llama built from a config (no download).  The script
checks the compiled step against the same step run eagerly (no compile, no pass),
and prints one JSON line: losses, the largest differences, and
``torch._dynamo.utils.counters["chunked_logits"]`` (empty without the pass).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM


def token_logprobs_and_entropy(model, input_ids, temperature: float):
    """Per-token log-probs of the sampled tokens and the policy entropy, [B, T-1] each."""
    logits = model(input_ids=input_ids).logits[:, :-1, :]  # bf16 [B, T-1, V]
    logits = logits / temperature  # in model precision, as many RL trainers do
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # FP32 [B, T-1, V]
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def grpo_loss(model, input_ids, mask, old_logp, advantages, temperature: float,
              clip: float = 0.2, entropy_coef: float = 1e-3):
    logp, entropy = token_logprobs_and_entropy(model, input_ids, temperature)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    per_token = pg - entropy_coef * entropy
    loss = (per_token * mask).sum() / mask.sum()
    return loss, entropy.detach()


def make_batch(vocab: int, groups: int, group_size: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (groups * group_size, seq_len), generator=g)
    mask = torch.ones(groups * group_size, seq_len - 1)
    mask[:, : seq_len // 4] = 0  # prompt tokens carry no loss
    rewards = torch.rand(groups, group_size, generator=g)
    advantages = ((rewards - rewards.mean(1, keepdim=True))
                  / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    return input_ids, mask, advantages


def build_policy(vocab: int, seq_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def train(loss_fn, steps: int, args) -> tuple[list[float], list[torch.Tensor]]:
    model = build_policy(args.vocab, args.seq_len)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    input_ids, mask, advantages = make_batch(args.vocab, 2, 4, args.seq_len)
    with torch.no_grad():  # the rollout policy's log-probs (eager, the same for every run)
        old_logp, _ = token_logprobs_and_entropy(model, input_ids, args.temperature)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss, _ = loss_fn(model, input_ids, mask, old_logp, advantages, args.temperature)
        loss.backward()
        grads.append(model.lm_head.weight.grad.detach().float().clone())
        losses.append(loss.item())
        opt.step()
    return losses, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    compiled = torch.compile(grpo_loss, backend=args.backend)
    losses, grads = train(compiled, args.steps, args)
    ref_losses, ref_grads = train(grpo_loss, args.steps, args)  # eager: no compile, no pass
    result = {
        "backend": args.backend,
        "losses": losses,
        "eager_losses": ref_losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "max_grad_diff": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)),
        "grad_scale": max(g.abs().max().item() for g in ref_grads),
        "counters": dict(counters["chunked_logits"]),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
