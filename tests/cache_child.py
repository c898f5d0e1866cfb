"""Child process of tests/test_recompiles_cache.py: compile, report the cache counters.

    python tests/cache_child.py '{"train": {...options}, "score": {...}, "pre_grad": {...}}'

Modes (each optional, each with its options): ``train``, a training step with
``backend="chunked_logits"`` (forward and backward graphs); ``score``, a scoring
function with that backend (one graph); ``pre_grad``, the scoring function with stock
Inductor plus ``ChunkedLogitsPass`` as ``pre_grad_custom_pass``; ``installed``, the same
under ``fx_passes.install(**options)`` (early pre-grad timing: the rewritten graph is the
key).  They compile in the FX graph cache that TORCHINDUCTOR_CACHE_DIR names; the child
prints one JSON line with, per mode, Inductor's cache counters, our counters and a
checksum of the results, plus which ``fx_passes`` it imported and the pre-grad pass's uuid.
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


def main() -> None:
    options = json.loads(sys.argv[1])
    result = {"fx_passes": fx_passes.__file__, "uuid": None}
    x, tok, adv = inputs()
    if "train" in options:
        counters.clear()
        x1 = x.clone().requires_grad_()
        loss = torch.compile(train_step, backend="chunked_logits", options=options["train"])(x1, tok, adv)
        loss.backward()
        result["train"] = {**report(), "checksum": [loss.item(), x1.grad.float().abs().sum().item()]}
    if "score" in options:
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            lp, ent = torch.compile(score, backend="chunked_logits", options=options["score"])(x, tok)
        result["score"] = {**report(), "checksum": [lp.sum().item(), ent.sum().item()]}
    if "pre_grad" in options:
        torch._dynamo.reset()
        counters.clear()
        cl_pass = fx_passes.ChunkedLogitsPass(fx_passes.Config.from_options(options["pre_grad"]))
        result["uuid"] = cl_pass.uuid()
        with torch._inductor.config.patch(pre_grad_custom_pass=cl_pass), torch.no_grad():
            lp, ent = torch.compile(score, backend="inductor")(x, tok)
        result["pre_grad"] = {**report(), "checksum": [lp.sum().item(), ent.sum().item()]}
    if "installed" in options:
        torch._dynamo.reset()
        counters.clear()
        with fx_passes.install(**options["installed"]), torch.no_grad():
            lp, ent = torch.compile(score, backend="inductor")(x, tok)
        result["installed"] = {**report(), "checksum": [lp.sum().item(), ent.sum().item()]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
