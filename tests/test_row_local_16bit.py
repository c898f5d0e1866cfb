"""16-bit roundings next to a row-local region (issue 55, NOTE [16-bit roundings in a
row-local body] in ``fx_passes/match/short_floats.py``): stock Inductor fuses a cast to bf16 /
fp16 into the kernel that reads it and keeps FP32 there, so a per-row value rounded to 16
bits, or a weight the graph computes in 16 bits (``adv.bfloat16()``), is never rounded
in stock's loss.  A chunk body would read the stored 16-bit weight, or store each row's
16-bit value: such an op stays in the graph, after the region's FP32 per-row result (or,
reading an FP32 ``[rows, V]`` tensor, the region is declined with the reason in the log).

Each program runs in FP64 (the reference), through stock Inductor, and through the
backend (the rewritten graph and the chunk bodies compiled by Inductor) with 3 and 8 row
chunks forced: the loss and the gradients of ``hidden`` and ``weight`` no further from
FP64 than stock's.  A bf16 graph input read as it is and a converted bool mask are exact,
and stay in the body (the loss's row part then has its gradients in the forward).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.op_rule_programs import BF16, F16, F32, ROW_LOCAL_BUDGETS, inputs
from tests.property_programs import Result, as_reference, assert_no_worse, fresh

NAMES = ("h", "w", "tok", "adv", "shift", "adv16", "teacher", "temp")


def _just_above_bf16(values: torch.Tensor) -> torch.Tensor:
    """``values`` rounded to bf16, plus 3.45 fp16 units (0.43 of a bf16 unit): a rounding to
    either 16-bit dtype moves each one down, so that it shows in a sum instead of averaging out."""
    base = values.to(BF16).double()
    return base + 3.45 * 2.0 ** (base.abs().log2().floor() - 10) * base.sign()


def _values() -> dict:
    """The op-rule suite's logits; positive advantages just above bf16 values; ``shift``
    puts each row's log-prob (``lp + shift``, ``lp`` as stock computes it from the bf16
    logits) just above a bf16 value; ``adv16``: a bf16 graph input; ``temp``: a per-row
    temperature (entropy and log-probs then go through a row-local region)."""
    v = inputs()
    temp = 1 + 0.25 * v["sign"]
    g = torch.Generator().manual_seed(55)
    adv = _just_above_bf16(torch.rand(v["adv"].shape, generator=g, dtype=torch.float64) + 0.5).float()
    lp = _logprob((v["h"] @ v["w"].T).double(), v["tok"], None, temp.double())
    shift = (_just_above_bf16(lp) - lp).float()
    return {"h": v["h"], "w": v["w"], "tok": v["tok"], "adv": adv, "shift": shift, "adv16": v["adv"].to(BF16),
            "teacher": v["teacher"], "temp": temp}


def _kl(z, tok, teacher, temp):
    return F.kl_div(z.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="none").sum(-1)


def _entropy(z, tok, teacher, temp):
    z = z / temp[:, None]
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


def _logprob(z, tok, teacher, temp):
    return (z / temp[:, None]).log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)


def _program(body, tail):
    """``tail(per_row, x, low)`` on a per-row ``body`` of the FP32 logits; ``x``: the
    other inputs (FP64 in the reference, but for the bf16 ones); ``low(dtype)``: the
    dtype asked for, FP64 in the reference."""
    def fn(h, w, tok, adv, shift, adv16, teacher, temp, up=F32):
        def low(dtype):
            return dtype if up == F32 else up
        per_row = body((h @ w.T).to(up), tok, teacher.to(up), temp.to(up))
        x = {"adv": adv.to(up), "shift": shift.to(up), "adv16": adv16, "tok": tok}
        return tail(per_row, x, low)
    return fn


# name: (body, tail, whether the body must leave the tail's 16-bit op in the graph)
PROGRAMS = {
    # a weight the graph computes in 16 bits (issue 55's spelling)
    "kl_adv_bf16_sum": (_kl, lambda r, x, low: (r * x["adv"].to(low(BF16))).sum(), True),
    "entropy_adv_bf16_mean": (_entropy, lambda r, x, low: (r * x["adv"].to(low(BF16))).mean(), True),
    "logprob_adv_bf16_sum": (_logprob, lambda r, x, low: -(r * x["adv"].to(low(BF16))).sum(), True),
    "logprob_adv_half_mean": (_logprob, lambda r, x, low: -(r * x["adv"].to(low(F16))).mean(), True),
    # a per-row value rounded to 16 bits inside the body, then summed
    "logprob_bf16_sum": (_logprob, lambda r, x, low: (r + x["shift"]).to(low(BF16)).sum(dtype=low(F32)),
                         True),
    "logprob_half_sum": (_logprob, lambda r, x, low: (r + x["shift"]).to(low(F16)).sum(dtype=low(F32)),
                         True),
    # exact: a bf16 graph input as the weights, a bool mask converted to bf16
    "kl_adv16_input": (_kl, lambda r, x, low: (r * x["adv16"]).sum(), False),
    "entropy_mask_bf16": (_entropy, lambda r, x, low: (r * (x["tok"] > 100).to(low(BF16))).sum(), False),
}
GRAD = ("h", "w")


def _result(fn, values: dict, up: torch.dtype) -> Result:
    args = fresh({k: v.requires_grad_(k in GRAD) for k, v in values.items()})
    loss = fn(*(args[k] for k in NAMES), up=up)
    loss.backward()
    return Result((loss.detach(),), {k: args[k].grad for k in GRAD}, (loss.requires_grad,))


def _compiled(fn, backend: str, **options) -> Result:
    torch._dynamo.reset()
    counters.clear()
    return _result(torch.compile(fn, backend=backend, options=options or None), _values(), F32)


@pytest.mark.sampled(4)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_16_bit_rounding_next_to_a_row_local_body_against_stock_inductor(name):
    body, tail, left_out = PROGRAMS[name]
    fn = _program(body, tail)
    ref = _result(fn, as_reference(_values()), torch.float64)
    stock = _compiled(fn, "inductor")
    v = _values()
    scale = (v["h"].float() @ v["w"].float().T).abs().max().item()  # (tests/test_op_rules._logits_ulps)
    for chunks in (3, 8):
        got = _compiled(fn, "chunked_logits", chunk_budget_mib=ROW_LOCAL_BUDGETS[chunks] / 2**20)
        c = dict(counters["chunked_logits"])
        assert c.get("row_local") == 1 and not c.get("pass_failed"), (name, c)
        assert_no_worse(got, stock, ref, f"{name}, {chunks} chunks {c}", scale, v["h"].shape[0])
        # (the loss's row part derived in the forward only when nothing rounds there)
        assert c.get("gradients_in_forward", 0) == int(not left_out), (name, c)


def _kl_of_bf16_teacher(z, tok, teacher, temp):
    """The teacher's log-probs rounded to bf16 in the graph, read with the FP32 [rows, V]
    student's: no per-row result to leave the cast after."""
    return F.kl_div(z.log_softmax(-1), teacher.log_softmax(-1).bfloat16(), log_target=True,
                    reduction="none").sum(-1)


def test_a_16_bit_operand_of_a_vocabulary_wide_op_declines_the_region(caplog):
    fn = _program(_kl_of_bf16_teacher, lambda r, x, low: (r * x["adv"]).sum())
    with caplog.at_level(logging.DEBUG, logger="fx_passes"):
        _compiled(fn, "chunked_logits", chunk_budget_mib=ROW_LOCAL_BUDGETS[8] / 2**20)
    c = dict(counters["chunked_logits"])
    assert not c.get("row_local") and c.get("declined:ESCAPES") == 1, c
    assert "torch.bfloat16 the graph computes" in caplog.text
    assert "NOTE [16-bit roundings in a row-local body]" in caplog.text
