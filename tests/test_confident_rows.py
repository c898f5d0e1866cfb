"""Confident rows: the gradient at a row's top token, where its probability is near 1
(NOTE [the rounding of lse] in ``fx_passes/kernels/log_softmax/given.py``).

A backward that formed ``log p = z - lse`` from the FP32 ``lse`` alone lost, at a confident
row's top token, ``1 - p`` and ``log p + H`` to the rounding of ``lse`` (half a spacing:
1e-6 at logits of 20): several times stock's error there, though the largest error over
the whole gradient stayed stock's (what the other tests measure).  The forward now saves
what ``lse`` rounded away, and each backward reads it: here held, element by element at
the top tokens, to stock's error (the logits given; the lm_head fused, its loss in the
graph, rows masked out, the logits kept; and the vocab-parallel stages, which replay the
user's maths and read no ``lse``).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests import shard_heads
from tests.helpers import chunked_counters
from tests.numerics import F32

T, V = 128, 4096


def logprob(x, tokens, up=F32):
    return torch.log_softmax(x.to(up), -1).gather(-1, tokens[:, None]).squeeze(-1)


def entropy(x, tokens, up=F32):
    z = x.to(up)
    return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


def _confident_logits():
    """Rows whose top token leads by 5 to 15: 1 - p from about 1e-2 to 1e-6."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, V, generator=g) * 3
    top = x.argmax(-1)
    x[torch.arange(T), top] += torch.linspace(5, 15, T)
    return (x + 20).bfloat16(), top


def _grad(fn, inputs, up=None):
    """The gradient of the first input that is not the tokens (the logits, or the lm_head's
    weight: where the top tokens' logits' gradients land)."""
    *tensors, tokens = inputs
    leaves = [t.detach().double() if up is not None else t.detach() for t in tensors]
    x = leaves[-1].requires_grad_()
    out = fn(*leaves, tokens, up=up) if up is not None else fn(*leaves, tokens)
    out.sum().backward()
    return x.grad.double()


def _lm_head_inputs():
    """Hidden states and an lm_head whose logits are :func:`_confident_logits`' (the
    hidden states one-hot: each row's logits a sum of one weight column)."""
    x, top = _confident_logits()
    hidden = torch.eye(T, dtype=torch.bfloat16)
    return hidden, x.T.contiguous(), top


def logprob_lm_head(hidden, weight, tokens, up=F32):
    return logprob(hidden @ weight.T, tokens, up)


def entropy_lm_head(hidden, weight, tokens, up=F32):
    return entropy(hidden @ weight.T, tokens, up)


def policy_loss_lm_head(hidden, weight, tokens, up=F32):
    return -logprob_lm_head(hidden, weight, tokens, up).mean()


def masked_policy_loss_lm_head(hidden, weight, tokens, up=F32):
    """A masked mean of the log-probs, half the rows masked out (they are not run)."""
    keep = (torch.arange(tokens.shape[0], device=tokens.device) % 2 == 0).to(up)
    return -(logprob_lm_head(hidden, weight, tokens, up) * keep).sum() / keep.sum()


def _shard(head):
    """A vocab-parallel head (``tests/shard_heads.py``, one rank's shard): its backward is
    the user's own maths replayed (NOTE [vocab-parallel stages]), which reads no ``lse``."""
    def fn(*args, up=F32):
        return head(*args, up=up)
    fn.__name__ = f"shard_{head.__name__}"
    return fn


CASES = {  # name -> (function, lm_head in the graph, options)
    "logprob": (logprob, False, {}),
    "entropy": (entropy, False, {}),
    "logprob_lm_head": (logprob_lm_head, True, {}),
    "entropy_lm_head": (entropy_lm_head, True, {}),
    "policy_loss_lm_head": (policy_loss_lm_head, True, {}),
    "masked_policy_loss_lm_head": (masked_policy_loss_lm_head, True, {}),
    "logprob_lm_head_kept": (logprob_lm_head, True, {"lm_head_plan": "kept_logits"}),
    "entropy_lm_head_kept": (entropy_lm_head, True, {"lm_head_plan": "kept_logits"}),
    "shard_logprob": (_shard(shard_heads.logprob), False, {}),
    "shard_entropy": (_shard(shard_heads.entropy), False, {}),
    "shard_logprob_lm_head": (_shard(shard_heads.with_lm_head(shard_heads.logprob)), True, {}),
    "shard_entropy_lm_head": (_shard(shard_heads.with_lm_head(shard_heads.entropy)), True, {}),
}


@pytest.mark.parametrize("name", CASES)
def test_top_token_gradient_no_further_from_fp64_than_stock(name, request):
    if name.startswith("shard"):
        request.getfixturevalue("one_rank_group")  # (conftest)
    fn, head, options = CASES[name]
    inputs = _lm_head_inputs() if head else _confident_logits()
    top = inputs[-1]
    ref = _grad(fn, inputs, up=torch.float64)
    torch._dynamo.reset()
    stock = _grad(torch.compile(fn, backend="inductor"), inputs)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", options={"leave_to_stock": False, **options})
    ours = _grad(compiled, inputs)
    c = chunked_counters()
    assert c.get("rewritten") == 1 and (not name.startswith("masked") or c.get("rows_skipped")), c
    at = (top, torch.arange(T)) if head else (torch.arange(T), top)  # (the weight's [V, T]: transposed)
    r, read = ref[at].abs(), ref[at] != 0  # (a row a mask leaves out: 0, exactly, in all three)
    assert read.sum() >= T // 2 and (ours[at][~read] == 0).all() and (stock[at][~read] == 0).all()
    rel_ours, rel_stock = ((g[at] - ref[at]).abs()[read] / r[read] for g in (ours, stock))
    assert (ours - ref).abs().max() <= (stock - ref).abs().max() * 1.01  # (the whole gradient: stock's)
    assert rel_ours.max() <= 2 * rel_stock.max() + 2**-8, (rel_ours.max().item(), rel_stock.max().item())
