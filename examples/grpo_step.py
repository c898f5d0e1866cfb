"""A GRPO/PPO-style policy step, compiled with torch.compile.

Written the way RL trainers write it, with nothing that knows about chunked-logits:
model forward, ``logits / temperature``, token log-probs and entropy from the FP32
log-softmax, a clipped policy loss, backward, optimizer step.  Run it::

    python examples/grpo_step.py --backend chunked_logits     # the backend by name
    chunked-logits run -- examples/grpo_step.py              # stock "inductor", launcher
    python examples/grpo_step.py                              # stock Inductor

The policy is a tiny bf16 Llama built from a config (no download).  Each step is
measured from the same weights in every run, whatever the backend: the compiled
step, the same step run eagerly (no compile, no pass) and an FP64 copy of the model
all compute the loss and the gradients at the current weights, and the weights then
follow the FP64 gradient.  (A trajectory driven by the compiled step would drift: a
token whose probability ratio crosses the PPO clip boundary from rounding alone
changes the gradient by far more than any rounding, so two trajectories measure the
clip, not the compiler.)  It prints one JSON line: per-step losses and gradient
errors against FP64, and ``torch._dynamo.utils.counters["chunked_logits"]``
(empty without the pass).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM


def token_logprobs_and_entropy(model, input_ids, temperature: float, dtype=torch.float32):
    """Per-token log-probs of the sampled tokens and the policy entropy, [B, T-1] each."""
    logits = model(input_ids=input_ids).logits[:, :-1, :]  # bf16 [B, T-1, V]
    logits = logits / temperature  # in model precision, as many RL trainers do
    logp_all = torch.log_softmax(logits.to(dtype), dim=-1)  # FP32 [B, T-1, V]
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def grpo_loss(model, input_ids, mask, old_logp, advantages, temperature: float,
              clip: float = 0.2, entropy_coef: float = 1e-3, dtype=torch.float32):
    logp, entropy = token_logprobs_and_entropy(model, input_ids, temperature, dtype)
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


def loss_and_grads(loss_fn, model, batch, temperature: float, **kwargs):
    """The loss and every parameter's gradient (FP64 copies) at the model's current weights."""
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn(model, *batch, temperature, **kwargs)
    loss.backward()
    return loss.item(), [p.grad.detach().double().clone() for p in model.parameters()]


def max_error(grads, reference) -> float:
    return max((g - r).abs().max().item() for g, r in zip(grads, reference))


def train(compiled_loss, args) -> list[dict]:
    """``args.steps`` steps; at each, the compiled, eager and FP64 losses and gradients
    from the same weights, then an SGD step along the FP64 gradient."""
    model = build_policy(args.vocab, args.seq_len)
    model64 = copy.deepcopy(model).double()
    input_ids, mask, advantages = make_batch(args.vocab, 2, 4, args.seq_len)
    with torch.no_grad():  # the rollout policy's log-probs (eager, the same for every run)
        old_logp, _ = token_logprobs_and_entropy(model, input_ids, args.temperature)
    batch = (input_ids, mask, old_logp, advantages)
    steps = []
    for _ in range(args.steps):
        with torch.no_grad():  # the FP64 copy holds exactly the bf16 weights
            for p64, p in zip(model64.parameters(), model.parameters()):
                p64.copy_(p)
        loss, grads = loss_and_grads(compiled_loss, model, batch, args.temperature)
        loss_eager, grads_eager = loss_and_grads(grpo_loss, model, batch, args.temperature)
        loss_64, grads_64 = loss_and_grads(grpo_loss, model64, batch, args.temperature, dtype=torch.float64)
        steps.append({
            "loss": loss, "loss_eager": loss_eager, "loss_fp64": loss_64,
            "grad_err": max_error(grads, grads_64), "grad_err_eager": max_error(grads_eager, grads_64),
            "grad_scale": max(g.abs().max().item() for g in grads_64),
        })
        with torch.no_grad():
            for p, g64 in zip(model.parameters(), grads_64):
                p -= args.lr * g64.to(p.dtype)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    steps = train(torch.compile(grpo_loss, backend=args.backend), args)
    result = {"backend": args.backend, "steps": steps, "counters": dict(counters["chunked_logits"])}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
