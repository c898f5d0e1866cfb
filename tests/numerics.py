"""Numerics support: run a case, its FP64 reference, and the rule that the rewritten
path is no less accurate than stock torch.compile (test_numerics, test_lm_head)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

F32 = torch.float32

# Per dtype: relative tolerance on FP32 outputs, and on gradients, which are stored in
# the model dtype (one rounding of the two paths may land on neighbouring values).
TOLERANCES = [
    pytest.param(torch.bfloat16, 2e-6, 2**-8, id="bf16"),
    pytest.param(torch.float16, 2e-6, 2**-11, id="fp16"),
]


# ``make test-full`` sets this: every matrix of cases x dtypes x plans in full (see :func:`dtype_matrix`).
FULL_MATRIX = os.environ.get("CHUNKED_LOGITS_FULL_MATRIX") == "1"


def dtype_matrix(names, plans=None, ids=str) -> list:
    """``(name, dtype, out_rtol, grad_rtol, plan)`` parameters of a test over cases, dtypes
    and plans: every case with every plan, the dtype alternating along both (so each plan,
    and each case run with more than one plan, still runs in bf16 and in fp16): half the
    full product, which ``CHUNKED_LOGITS_FULL_MATRIX=1`` (``make test-full``) runs.
    Without ``plans``, ``(name, dtype, out_rtol, grad_rtol)``: the cases alternate dtypes.
    Ids as stacked parametrizes spell them: ``case-dtype-plan``."""
    out = []
    for i, name in enumerate(names):
        for j, plan in enumerate(plans or [None]):
            for k, tol in enumerate(TOLERANCES):
                if FULL_MATRIX or k == (i + j) % len(TOLERANCES):
                    tail, suffix = ((plan,), f"-{plan}") if plans else ((), "")
                    out.append(pytest.param(name, *tol.values, *tail, id=f"{ids(name)}-{tol.id}{suffix}"))
    return out


def run(fn, inputs, grad_pos):
    inputs = [t.detach().clone().requires_grad_(i in grad_pos) for i, t in enumerate(inputs)]
    with torch.set_grad_enabled(bool(grad_pos)):
        out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = ()
    if grad_pos:
        # A non-scalar output gets a fixed, non-uniform upstream gradient.
        w = torch.linspace(-1, 1, outs[0].numel()).reshape(outs[0].shape).to(outs[0].dtype)
        grads = torch.autograd.grad((outs[0] * w).sum(), [inputs[i] for i in grad_pos])
    return [o.detach() for o in outs], list(grads)


def max_err(got, ref):
    """Max abs error; NaN where the reference has NaN must also be NaN (same maths)."""
    got, ref = got.double(), ref.double()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN pattern differs from FP64"
    finite = torch.isfinite(ref)
    assert torch.equal(got[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)])
    return (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0


def mean_err(got, ref):
    finite = torch.isfinite(ref)
    return (got.double()[finite] - ref[finite].double()).abs().mean().item() if finite.any() else 0.0


def reference(fn, inputs, grad_pos):
    f64 = functools.partial(fn, up=torch.float64)
    outs, _ = run(f64, inputs, ())
    # Gradients of the FP64 maths w.r.t. the (exact) model-precision inputs.
    inputs64 = [t.double() if t.is_floating_point() else t for t in inputs]
    _, grads = run(f64, inputs64, grad_pos)
    return outs, grads


def assert_stock_logits(got: torch.Tensor, stock: torch.Tensor) -> None:
    """Returned model-precision logits are stock Inductor's: bit for bit where a GEMM of a
    chunk's rows sums each dot product as the GEMM of all rows does (the AVX2 and AVX-512 BF16
    CPUs this project has run on), else at most one spacing of the model dtype from stock's
    at any element (each is the rounding of the same FP32 dot product, summed in another order:
    seen on an AVX-512 CPU without bf16 units, at 2 of 300k elements)."""
    assert got.dtype == stock.dtype and got.shape == stock.shape
    if torch.equal(got, stock):
        return
    want = stock.double()
    _, exponent = torch.frexp(want)
    spacing = torch.ldexp(torch.full_like(want, torch.finfo(stock.dtype).eps / 2), exponent)  # (want = m 2^e)
    off = (got.double() - want).abs()
    assert (off <= spacing).all(), f"returned logits {off.max().item()} from stock's (more than a spacing)"


def ours_stock_reference(fn, inputs, grad_pos, **options):
    """(ours, stock, FP64 reference) of ``fn`` on ``inputs``: chunked_logits with
    ``options`` (the rewrite's counters cleared before it, so they are its alone), stock
    Inductor, and ``fn``'s FP64 maths (:func:`reference`)."""
    from torch._dynamo.utils import counters

    ref = reference(fn, inputs, grad_pos)
    torch._dynamo.reset()
    stock = run(torch.compile(fn, backend="inductor"), inputs, grad_pos)
    torch._dynamo.reset()
    counters.clear()
    ours = run(torch.compile(fn, backend="chunked_logits", options=options), inputs, grad_pos)
    return ours, stock, ref


def assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol, mean_ratio=1.1):
    """Each (outputs, gradients) of ours is no further from FP64 than stock's, plus the
    per-dtype tolerance; gradients land in the model dtype; each gradient's mean error at
    most ``mean_ratio`` times stock's."""
    for got, st, r in zip(ours[0], stock[0], ref[0]):
        assert got.dtype == st.dtype and got.shape == st.shape
        # Outputs are O(1) log-probs or reductions of them: a loss that averages to 0.1
        # still carries the rounding of its O(10) terms, so the scale is at least 1.
        scale = max(r.double().abs().nan_to_num(0, 0, 0).max().item(), 1.0)
        # (a model-precision output, returned logits: its own rounding of the same FP32 value,
        # to the other side where a GEMM of fewer rows summed in another order)
        rtol = out_rtol if got.dtype in (torch.float32, torch.float64) else torch.finfo(got.dtype).eps
        assert max_err(got, r) <= max_err(st, r) + rtol * scale
    for got, st, r in zip(ours[1], stock[1], ref[1]):
        assert got.dtype == dtype and got.shape == st.shape
        scale = r.abs().max().item() or 1.0
        assert max_err(got, r) <= max_err(st, r) + grad_rtol * scale
        # The max is dominated by the final rounding to the model dtype, which both
        # paths share; a small systematic error shows in the mean instead.
        assert mean_err(got, r) <= mean_ratio * mean_err(st, r) + 1e-9
