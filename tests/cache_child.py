"""Child process of tests/test_recompiles_cache.py: compile, report the cache counters.

    python tests/cache_child.py '{"train": {...options}, "score": {...}, "pre_grad": {...}}'
    python tests/cache_child.py '{"score": {}, "score@off": {"rewrite": false}}'

Modes (each optional, each with its options): ``train``, a training step with
``backend="chunked_logits"`` (forward and backward graphs); ``score``, a scoring
function with that backend (one graph); ``pre_grad``, the scoring function with stock
Inductor plus ``ChunkedLogitsPass`` as ``pre_grad_custom_pass``; ``installed``, the same
under ``fx_passes.install(**options)`` (early pre-grad timing: the rewritten graph is the
key).  They compile in the FX graph cache that TORCHINDUCTOR_CACHE_DIR names; the child
prints one JSON line with, per mode, Inductor's cache counters, our counters and a
checksum of the results (a ``pre_grad`` mode: its pass's uuid), plus which ``fx_passes`` it
imported and the first pre-grad pass's uuid.
"""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

import fx_passes


def train_step(logits, tokens, advantages):
    logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -(logprob * advantages).mean()


def score(logits, tokens):
    z = logits.float()
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(torch.softmax(z, dim=-1) * logp).sum(-1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), entropy


def inputs():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 24, generator=g) * 3).bfloat16()
    return x, torch.randint(0, 24, (8,), generator=g), torch.randn(8, generator=g)


def report() -> dict:
    out = {"inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
           "aot_autograd": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
           "chunked_logits": dict(counters["chunked_logits"])}
    counters.clear()
    return out


def train(options: dict, x, tok, adv) -> dict:
    x1 = x.clone().requires_grad_()
    loss = torch.compile(train_step, backend="chunked_logits", options=options)(x1, tok, adv)
    loss.backward()
    return {**report(), "checksum": [loss.item(), x1.grad.float().abs().sum().item()]}


def scored(compiled, x, tok) -> dict:
    with torch.no_grad():
        lp, ent = compiled(x, tok)
    return {**report(), "checksum": [lp.sum().item(), ent.sum().item()]}


def pre_grad(options: dict, x, tok) -> dict:
    cl_pass = fx_passes.ChunkedLogitsPass(fx_passes.Config.from_options(options))
    with torch._inductor.config.patch(pre_grad_custom_pass=cl_pass):
        return {**scored(torch.compile(score, backend="inductor"), x, tok), "uuid": cl_pass.uuid()}


def installed(options: dict, x, tok) -> dict:
    with fx_passes.install(**options):
        return scored(torch.compile(score, backend="inductor"), x, tok)


def main() -> None:
    """Each mode in the order given; ``mode@label`` runs a mode again (other options) in the
    same process, after the ones before it."""
    options = json.loads(sys.argv[1])
    result = {"fx_passes": fx_passes.__file__, "uuid": None}
    x, tok, adv = inputs()
    for key, opts in options.items():
        mode = key.split("@")[0]
        torch._dynamo.reset()
        counters.clear()
        if mode == "train":
            result[key] = train(opts, x, tok, adv)
        elif mode == "score":
            result[key] = scored(torch.compile(score, backend="chunked_logits", options=opts), x, tok)
        elif mode == "pre_grad":
            result[key] = pre_grad(opts, x, tok)
            result["uuid"] = result["uuid"] or result[key]["uuid"]
        elif mode == "installed":
            result[key] = installed(opts, x, tok)
        else:
            raise SystemExit(f"unknown mode {key!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
