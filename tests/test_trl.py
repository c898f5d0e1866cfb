"""TRL's own log-prob function, compiled: it computes in the logits' dtype (bf16), so only
``upgrade_low_precision`` reaches it.  (TRL's SFT and GRPO trainers do not call it: they
train through TRL's fused lm_head; tests/test_examples.py runs them.)"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

trl_utils = pytest.importorskip("trl.trainer.utils")


def token_logprobs(logits, tokens):
    """TRL's GRPO-style call: log-probs of the sampled tokens at temperature 0.7."""
    return trl_utils.selective_log_softmax(logits, tokens, temperature=0.7)


@pytest.mark.slow
def test_selective_log_softmax_reached_only_by_the_upgrade():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 64, 4096, generator=g) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 4096, (2, 64), generator=g)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tokens[..., None])[..., 0]

    stock = torch.compile(token_logprobs, backend="inductor")(logits, tokens)
    torch._dynamo.reset()
    plain = torch.compile(token_logprobs, backend="chunked_logits")(logits, tokens)
    assert not counters["chunked_logits"]["rewritten"]  # no upcast in TRL's bf16 branch
    assert torch.equal(plain, stock)

    torch._dynamo.reset()
    up = torch.compile(token_logprobs, backend="chunked_logits",
                       options={"upgrade_low_precision": True})(logits, tokens)
    assert counters["chunked_logits"]["rewritten"] == 2  # TRL loops over the batch rows
    assert up.dtype == torch.float32 and stock.dtype == torch.bfloat16
    stock_err = (stock.double() - ref).abs().max().item()
    up_err = (up.double() - ref).abs().max().item()
    assert up_err < 1e-4 < stock_err, (up_err, stock_err)  # FP32 results vs bf16's rounding
