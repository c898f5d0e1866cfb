"""The op-rule table, tried op by op (issue 32): each op the loss tail or the vocabulary-block
split accepts, with each keyword value that changes its meaning, in a loss tail (the
lm_head loss path) and in a row-local body (the row-local loss, and the vocabulary-block
sweeps of its backward), with 1, 3 and 8 row chunks (and 1, 4, 8 vocabulary blocks) forced.

Each program runs eagerly in FP64 (the reference) and FP32 (stock), and through the pass
(Dynamo capture, the passes, the rewritten graph and its chunk bodies run eagerly:
tests/property_programs.CaptureAndTransform); a tail that rounds to 16 bits runs through
stock Inductor and the backend instead (eager rounds where Inductor's fused kernels do
not).  The loss and the gradients of ``hidden`` and ``weight`` must be no further from
FP64 than stock's, whatever the chunk count, and the chunk counts must agree with each
other within stock's error.  A program the table
declines keeps the recompute path: the same check holds, and the counters say which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode

from fx_passes import Config
from fx_passes.fx.op_rules import TAIL as TAIL_RULES
from fx_passes.kernels.ops.args import Cotangents, Head, HeadOptions, LogitsInput, Region, RowValues
from tests.op_rule_programs import (
    BODIES,
    LM_HEAD_BUDGETS,
    LOW_TAILS,
    ROW_LOCAL_BUDGETS,
    TAILS,
    V,
    body_program,
    inputs,
    tail_program,
)
from tests.property_programs import (
    CaptureAndTransform,
    Result,
    as_reference,
    assert_no_worse,
    eager_lm_head_chunks,
    term_scales,
)
from tests.property_programs import fresh as _fresh

GRAD = ("h", "w")
NAMES = ("h", "w", "tok", "adv", "sign", "teacher", "class_w", "old")


def _run(fn, values: dict, up: torch.dtype) -> Result:
    args = _fresh({k: v.requires_grad_(k in GRAD) if k in GRAD else v for k, v in values.items()})
    loss = fn(*(args[k] for k in NAMES), up=up)
    loss.backward()
    return Result((loss.detach(),), {k: args[k].grad for k in GRAD}, (loss.requires_grad,))


_baseline: dict = {}


class _LogitsGrad(TorchFunctionMode):
    """Keeps the gradient of the lm_head's logits (``h @ w.T``, ``[T, V]``) of the FP64
    reference: the terms its ``w`` and ``h`` gradients sum (``property_programs.term_scales``;
    a tail that sums ``lp * sign`` makes those gradients cancel to 0 exactly, where each
    side's error is the rounding of its terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.grads: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("matmul", "__matmul__") and isinstance(out, torch.Tensor) \
                and out.requires_grad and out.shape[-1] == V:
            out.register_hook(self.grads.append)
        return out


def _reference_and_stock(fn, inductor: bool = False) -> tuple[Result, Result]:
    """(FP64, stock): stock eager, or with ``inductor`` stock Inductor (a tail that rounds to
    16 bits: Inductor's fused kernel skips those roundings, eager does not)."""
    if fn.__name__ not in _baseline:
        values = inputs()
        ref_inputs = as_reference({k: v.requires_grad_(k in GRAD) if k in GRAD else v
                                   for k, v in values.items()})
        torch._dynamo.reset()
        stock = _run(torch.compile(fn, backend="inductor") if inductor else fn, values, torch.float32)
        with _LogitsGrad() as kept:
            ref = _run(fn, ref_inputs, torch.float64)
        if len(kept.grads) == 1:
            scales = term_scales(kept.grads[0], {"hidden": ref_inputs["h"], "lm_w": ref_inputs["w"]})
            ref = dataclasses.replace(ref, term_scales={"w": scales["lm_w"], "h": scales["hidden"]})
        _baseline[fn.__name__] = (ref, stock)
    return _baseline[fn.__name__]


def _ours(fn, budget: int, inductor: bool = False, **options) -> tuple[Result, dict]:
    """The pass's result: with ``inductor`` as the backend runs it (the rewritten graph and
    the chunk bodies compiled by Inductor), else the rewritten graph and the bodies eagerly."""
    torch._dynamo.reset()
    counters.clear()
    options = {"chunk_budget_mib": budget / 2**20, "lm_head_plan": "two_sweeps", **options}
    backend = "chunked_logits" if inductor else CaptureAndTransform(Config(**options))
    with contextlib.nullcontext() if inductor else eager_lm_head_chunks():
        got = _run(torch.compile(fn, backend=backend, options=options if inductor else None), inputs(),
                   torch.float32)
    return got, dict(counters["chunked_logits"])


def _logits_ulps(inductor: bool) -> tuple[float, int]:
    """(``scale``, ``rows``) of ``assert_no_worse`` against stock Inductor: an FP32 result
    may differ by a few units in the last place of the largest logit per row summed (its
    log-softmax computes in another order than the pass's); none against stock eager."""
    if not inductor:
        return 0.0, 1
    values = inputs()
    return (values["h"].float() @ values["w"].float().T).abs().max().item(), values["h"].shape[0]


def _check_chunk_counts(fn, budgets: dict, inductor: bool = False, **options) -> list[dict]:
    ref, stock = _reference_and_stock(fn, inductor)
    results, seen = {}, []
    for k, budget in budgets.items():
        got, c = _ours(fn, budget, inductor, **options)
        assert not c.get("pass_failed"), c
        assert_no_worse(got, stock, ref, f"{fn.__name__}, {k} chunk(s) {c}", *_logits_ulps(inductor))
        results[k] = got
        seen.append(c)
    # the chunk counts agree with each other within stock's error against FP64 (both
    # sides' errors bounded above: twice stock's, and the dtype's tolerance)
    first = results[min(results)]
    for k, got in results.items():
        pairs = [("loss", got.outputs[0], first.outputs[0], ref.outputs[0], stock.outputs[0])]
        pairs += [(f"grad of {g}", got.grads[g], first.grads[g], ref.grads[g], stock.grads[g]) for g in GRAD]
        for name, a, b, r, s in pairs:
            stock_err = (s.double() - r.double()).abs().max().item()
            tol = 2 * stock_err + 2.0**-7 * r.double().abs().max().item()
            assert (a.double() - b.double()).abs().max().item() <= tol, \
                f"{fn.__name__}: {name} with {k} chunks differs from 1 chunk by more than stock's error"
    return seen


# tails the table must take (gradients in the forward) and the ones it must decline
TAIL_TAKEN = {"div": True, "div_floor": False, "div_trunc": False, "mul_neg": True,
              "add_alpha": True, "sub_alpha": True, "mean": True, "sum_dtype": True, "sum_low": False,
              "mean_low": False, "row_div_floor": True, "row_clamp": True, "rsub_pos": True,
              "rsub_alpha": True, "mean_dtype": True, "conversions": True, "half": True, "bfloat16": True}
# each op of the loss tail's table (fx/op_rules.TAIL) and the programs that put it in a tail
# (with each value of a keyword argument that changes its meaning)
TAIL_OPS = {"add": ["add_alpha"], "sub": ["sub_alpha"], "rsub": ["rsub_pos", "rsub_alpha"],
            "neg": ["mul_neg"], "positive": ["rsub_pos"], "mul": ["mul_neg"],
            "div": ["div", "div_floor", "div_trunc"],
            "sum": ["div", "sum_dtype", "sum_low"], "mean": ["mean", "mean_dtype", "mean_low"],
            "to": ["sum_dtype", "sum_low"], "float": ["conversions"], "double": ["conversions"],
            "half": ["half"], "bfloat16": ["bfloat16"], "type_as": ["conversions"]}


def test_every_op_of_the_tail_table_has_its_programs():
    assert set(TAIL_OPS) == set(TAIL_RULES) and all(p in TAILS for ps in TAIL_OPS.values() for p in ps)


@pytest.mark.parametrize("name", list(TAILS))
def test_a_loss_tail_op_as_eager_with_1_3_8_chunks(name):
    seen = _check_chunk_counts(tail_program(name), LM_HEAD_BUDGETS)
    for c in seen:
        assert c.get("lm_head_fused") == 1, c
        assert c.get("gradients_in_forward", 0) == int(TAIL_TAKEN[name]), (name, c)


# tails that round per-row values to 16 bits (tests/op_rule_programs.LOW_TAILS), against
# stock Inductor: declined, the tail left to Inductor (issue 55: the chunk loop rounded
# each row's value where stock's fused kernel does not); one rounding of the whole sum
# and an exact conversion of a mask are taken
LOW_TAKEN = {"lp_bfloat16": False, "kl_bf16_sum": False, "kl_bf16_mean": False, "kl_fp16_to": False,
             "weight_bf16_mean": False, "sum_dtype_bf16": True, "mask_bf16": True}


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name", list(LOW_TAILS))
def test_a_16_bit_rounding_in_a_loss_tail_against_stock_inductor(name):
    chunks = (4, 8) if LOW_TAKEN[name] else (8,)  # (declined: the tail runs in the graph, no chunks)
    seen = _check_chunk_counts(tail_program(name), {k: LM_HEAD_BUDGETS[k] for k in chunks}, inductor=True)
    for c in seen:
        assert c.get("lm_head_fused") == 1, c
        assert c.get("gradients_in_forward", 0) == int(LOW_TAKEN[name]), (name, c)


@pytest.mark.parametrize("name,said", [("kl_bf16_sum", "rounds each row's value to torch.bfloat16"),
                                       ("weight_bf16_mean", "torch.bfloat16 the graph computes")])
def test_a_16_bit_rounding_is_named_in_the_log(name, said, caplog):
    with caplog.at_level(logging.DEBUG, logger="fx_passes"):
        _, c = _ours(tail_program(name), LM_HEAD_BUDGETS[8])
    assert c.get("lm_head_fused") == 1 and not c.get("gradients_in_forward"), c
    assert said in caplog.text and "NOTE [16-bit roundings in a tail]" in caplog.text


# bodies whose gradient splits into per-row values and a per-column function (the
# vocabulary-block sweeps); the others read the row's length V in a vocabulary block
# (``op_rules.reads_row_length``): the split declines and the call keeps whole rows
SPLITS = {"ce_smoothing": True, "ce_probs": True, "ce_probs_smoothing": False, "ce_weight_smoothing": False,
          "z_mean": False, "z_mean_keepdim": False, "z_var": True, "z_var_biased": True, "kl": True}


@pytest.mark.parametrize("in_forward", [True, False], ids=["row_local_loss", "block_sweeps"])
@pytest.mark.parametrize("name", list(BODIES))
def test_a_row_local_body_op_as_eager_with_1_3_8_chunks(name, in_forward):
    seen = _check_chunk_counts(body_program(name), ROW_LOCAL_BUDGETS, gradients_in_forward=in_forward)
    for c in seen:
        if c.get("lm_head_fused"):  # (a plain cross-entropy: the hand-derived lm_head path)
            continue
        assert c.get("row_local") == 1, c
        split = c.get("row_local_lm_head", 0) == 1 and not c.get("row_local_lm_head_in_call")
        assert split == SPLITS[name], (name, c)
        assert c.get("gradients_in_forward", 0) == int(in_forward and split), (name, c)


def _empty_batch():
    bf16 = torch.bfloat16
    return torch.zeros(0, 16, dtype=bf16), torch.randn(2048, 16).to(bf16), torch.randn(2048).to(bf16)


@pytest.mark.parametrize("plan", ["two_sweeps", "blocks", "fp32_tiles", "gpu"])
def test_an_empty_batch_does_no_per_block_work(plan, monkeypatch):
    """0 rows: no vocabulary block is computed (``two_sweeps`` looped over 2048 one-column
    blocks at this vocabulary), and the gradients are zeros (``blocks`` / ``fp32_tiles``
    left ``grad_weight`` unwritten when ``grad_hidden`` was wanted too)."""
    from fx_passes.kernels.log_softmax import lm_head_sweeps
    from fx_passes.testing.gemms import cpu_out_dtype_kernels

    tiles = []
    real = lm_head_sweeps._Backward.grad_of_tile
    monkeypatch.setattr(lm_head_sweeps._Backward, "grad_of_tile",
                        lambda self, *a: tiles.append(a[4:6]) or real(self, *a))
    h, w, b = _empty_batch()
    rows, tok = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    with cpu_out_dtype_kernels(), eager_lm_head_chunks():
        gh, gw, gb = lm_head_sweeps.lm_head_grads(Head(h, w, b, tok), RowValues(rows, rows),
                                                  Cotangents(rows, rows, rows),
                                                  HeadOptions(False, False, 1 << 20, plan=plan))
    assert tiles == [] and gh.shape == (0, 16)
    assert torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


def test_an_empty_batch_does_no_per_block_work_in_the_row_local_sweep(monkeypatch):
    from fx_passes.kernels.row_local import sweeps as row_local_sweeps

    blocks = []
    monkeypatch.setattr(row_local_sweeps, "head_logits",
                        lambda *a: blocks.append(a) or pytest.fail("a block"))
    h, w, b = _empty_batch()
    region, lm = Region("key", [], [], 1 << 20), LogitsInput(0, h, w, b, "matmul")
    gw, gb = row_local_sweeps.block_sweep(None, region, lm, [], [], [False, True, True])
    assert blocks == [] and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_a_kwarg_the_table_does_not_take_is_named_in_the_log(mode, caplog):
    """``torch.div(loss, c, rounding_mode=...)`` declines the tail, the op and the value named."""
    with caplog.at_level(logging.DEBUG, logger="fx_passes"):
        _, c = _ours(tail_program(f"div_{mode}"), LM_HEAD_BUDGETS[8])
    assert c.get("lm_head_fused") == 1 and not c.get("gradients_in_forward"), c
    assert f"div(rounding_mode='{mode}') changes what the op means" in caplog.text
