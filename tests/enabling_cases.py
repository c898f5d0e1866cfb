"""The row-local families under each way of turning the pass on (test_enabling_matrix.py).

Each case compiles one row-local loss (a per-row temperature, a top-k mask, a KL, label
smoothing) with the stock ``inductor`` backend or the ``chunked_logits`` one, scoring
(no grad) or training (grad), and returns the ``chunked_logits`` counters of that compile
and the largest difference from the eager FP32 maths.  ``python -m tests.enabling_cases``
runs every case with ``backend="inductor"`` and prints one JSON line: what the launcher and
the environment switch runs in a fresh process (one process for all cases).

Issue 33, item 1: under ``install()`` the chunk bodies were compiled by the stock backend
with the installed pass in it, which rewrote its own bodies (no grad: a RecursionError and
``row_local_body_eager``; label smoothing: a spurious ``declined:NOT_ROW_LOCAL``).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

T, V = 6, 96
# The KL and label smoothing families are regions stock Inductor runs with no FP32 [T, V]
# tensor either, which the pass leaves to it by default (match/worth.py): the cases force
# the engine, which is what they test under each way of turning the pass on.
ENGINE = {"leave_to_stock": False}


def per_row_temperature(logits, tokens, temperature):
    z = logits.float() / temperature[:, None]
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def top_k(logits, tokens):
    z = logits.float()
    kth = z.topk(5, dim=-1).values[..., -1, None]
    z = z.masked_fill(z < kth, float("-inf"))
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def kl(student, teacher):
    s = torch.log_softmax(student.float(), -1)
    t = torch.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def label_smoothing(logits, labels):
    return F.cross_entropy(logits.float(), labels, label_smoothing=0.1)


FAMILIES = {"per_row_temperature": per_row_temperature, "top_k": top_k, "kl": kl,
            "label_smoothing": label_smoothing}


def _inputs(family: str) -> list:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, V, generator=g).bfloat16()
    tokens = torch.randint(0, V, (T,), generator=g)
    if family == "per_row_temperature":
        return [logits, tokens, torch.rand(T, generator=g) + 0.5]
    if family == "kl":
        return [logits, torch.randn(T, V, generator=g).bfloat16()]
    return [logits, tokens]


def _run(fn, inputs: list, grad: bool) -> tuple[torch.Tensor, list]:
    x = inputs[0].detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = fn(x, *inputs[1:])
    if not grad:
        return out.detach(), []
    out.float().sum().backward()
    return out.detach(), [x.grad.float()]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference; equal values (the -inf a top-k mask leaves) differ by 0."""
    a, b = a.double(), b.double()
    return torch.where(a == b, 0.0, (a - b).abs()).max().item()


def run_case(family: str, grad: bool, backend: str) -> dict:
    """One family compiled with ``backend``: its counters and largest error against eager."""
    torch._dynamo.reset()
    counters.clear()
    fn, inputs = FAMILIES[family], _inputs(family)
    options = {"options": ENGINE} if backend == "chunked_logits" else {}
    got, got_grads = _run(torch.compile(fn, backend=backend, **options), inputs, grad)
    seen = {k: int(v) for k, v in counters["chunked_logits"].items()}
    want, want_grads = _run(fn, inputs, grad)
    err = max(_diff(a, b) for a, b in zip([got, *got_grads], [want, *want_grads]))
    return {"family": family, "grad": grad, "counters": seen, "max_err": err}


def main() -> None:
    results = [run_case(family, grad, "inductor") for family in FAMILIES for grad in (False, True)]
    sys.stdout.flush()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
