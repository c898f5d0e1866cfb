"""A row-local region whose logits are ``hidden @ weight.T`` in the graph (issue 21, WD):
the call runs the matmul and its backward writes the logits' gradient over them
(``fx_passes/kernels/row_local/head.py``), so the backward holds one ``[T, V]``
model-precision buffer where the plain call held two.  This is the path of a body whose
gradient does not split into per-row values (a sort, a scan) and of
``row_local_sweeps=False``, which the tests here set (tests/test_row_local_sweeps.py: the
chunked lm_head of the bodies that split).

Each loss is rewritten (counter ``row_local_lm_head_in_call``) and no further from FP64
than stock Inductor on its output and the gradients of ``hidden`` and ``weight``; the
backward allocates no ``[T, V]`` model-precision tensor (the plain call's allocates one);
a retained graph's second backward equals its first; a matmul the call may not run stays
in the graph, with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx import symbolic_trace
from torch.utils._python_dispatch import TorchDispatchMode

from fx_passes.kernels.ops import user_bodies
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.kernels.row_local.engine import _row_local_backward
from fx_passes.kernels.row_local.head import _row_local_head, _row_local_head_backward
from fx_passes.reporting.session import session
from tests import row_local_cases as rl
from tests.helpers import assert_retained_backward_repeats, chunked_counters
from tests.numerics import F32, dtype_matrix

T, V, H = rl.T, rl.V, 32
WHOLE = {"row_local_sweeps": False}  # (the logits kept whole, for every body)
EAGER = lambda fn, options: fn  # noqa: E731  (bodies run eagerly, so a dispatch mode sees their ops)


def _lm_head(dtype=torch.bfloat16, seed=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / 4).to(dtype)
    return hidden, weight, rl.kept_tokens(hidden @ weight.T)


def topk_policy(hidden, weight, tokens, adv, up=F32):
    return -(rl.topk_topp_logprob(hidden @ weight.T, tokens, up) * adv).mean()


def distillation(hidden, weight, teacher, up=F32):
    """WD's loss: forward KL to the given teacher logits, the student's lm_head in the graph."""
    s = torch.log_softmax((hidden @ weight.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def smoothed_ce(hidden, weight, labels, up=F32):
    return F.cross_entropy((hidden @ weight.T).to(up), labels, label_smoothing=0.1)


def kl_div_linear(hidden, weight, bias, teacher, up=F32):
    """``F.linear`` with a bias on ``[B, S, H]`` states; both logits flattened after the
    upcast, as Hugging Face code does (one region reads both)."""
    s = F.linear(hidden, weight, bias).to(up).view(-1, V).log_softmax(-1)
    t = teacher.to(up).view(-1, V).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def _case(name: str, dtype=torch.bfloat16):
    hidden, weight, tokens = _lm_head(dtype)
    g = torch.Generator().manual_seed(5)
    teacher = rl.distinct_logits(T, V, dtype, seed=2)
    if name == "topk_policy":
        return topk_policy, (hidden, weight, tokens, torch.randn(T, generator=g)), (0, 1)
    if name == "distillation":
        return distillation, (hidden, weight, teacher), (0, 1)
    if name == "smoothed_ce":
        return smoothed_ce, (hidden, weight, tokens), (0, 1)
    if name == "frozen_weight":
        return smoothed_ce, (hidden, weight, tokens), (0,)
    bias = (torch.randn(V, generator=g) / 4).to(dtype)
    return kl_div_linear, (hidden.view(4, T // 4, H), weight, bias, teacher.view(4, T // 4, V)), (0, 1, 2)


CASES = ["topk_policy", "distillation", "smoothed_ce", "frozen_weight", "kl_div_linear"]


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name", CASES)
def test_the_call_runs_the_matmul_as_accurate_as_stock(name):
    fn, inputs, grad_pos = _case(name)
    c = rl.check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8, **WHOLE)
    assert c.get("row_local_lm_head_in_call") == 1 and not c.get("lm_head_not_fused"), c


@pytest.mark.parametrize("name", ["distillation", "kl_div_linear"])
def test_bit_for_bit_the_plain_calls_results(name):
    """The call's matmul and gradients are the ops the graph and autograd run, and its
    chunk gradients are the plain call's (stored over the logits instead of into a new
    buffer): the same bits as with the matmul left in the graph (``fuse_lm_head=False``)."""
    fn, inputs, grad_pos = _case(name)
    got = []
    for options in ({"fuse_lm_head": False}, WHOLE):
        torch._dynamo.reset()
        args = [x.clone().requires_grad_(i in grad_pos) for i, x in enumerate(inputs)]
        out = torch.compile(fn, backend="chunked_logits", dynamic=True, options=options)(*args)
        out.backward()
        got.append([out.detach(), *(args[i].grad for i in grad_pos)])
    assert chunked_counters().get("row_local_lm_head_in_call") == 1
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol", dtype_matrix(["distillation", "kl_div_linear"]))
def test_dynamic_shapes_and_dtypes(name, dtype, out_rtol, grad_rtol):
    fn, inputs, grad_pos = _case(name, dtype)
    c = rl.check(fn, inputs, grad_pos, dtype, out_rtol, grad_rtol, dynamic=True, **WHOLE)
    assert c.get("row_local_lm_head_in_call") == 1, c


def test_scoring_runs_the_matmul_before_a_plain_call():
    """Without a gradient there is no backward to write over the logits (with
    ``row_local_sweeps`` on, the call runs the matmul chunk by chunk instead:
    tests/test_row_local_sweeps.py)."""
    hidden, weight, tokens = _lm_head()
    c = rl.check(lambda h, w, t, up=F32: rl.topk_logprob(h @ w.T, t, up), (hidden, weight, tokens), (),
                 torch.bfloat16, 2e-6, 2**-8, **WHOLE)
    assert not c.get("row_local_lm_head_in_call"), c


def read_outside(hidden, weight, labels, up=F32):
    logits = hidden @ weight.T
    return F.cross_entropy(logits.to(up), labels, label_smoothing=0.1) + logits.mean().to(up)


@pytest.mark.parametrize("fn,options,why", [
    (read_outside, {}, "the logits are also used outside the region"),
    (smoothed_ce, {"fuse_lm_head": False}, "fuse_lm_head is off"),
])
def test_a_matmul_the_call_may_not_run_stays_with_the_reason(fn, options, why):
    hidden, weight, tokens = _lm_head()
    n_events = len(session.events)
    c = rl.check(fn, (hidden, weight, tokens), (0, 1), torch.bfloat16, 2e-6, 2**-8, **options)
    assert c.get("lm_head_not_fused") == 1 and not c.get("row_local_lm_head_in_call"), c
    said = [e.what for e in session.events[n_events:] if e.kind == "rewritten"]
    assert any(f"lm_head not fused: {why}" in s for s in said), said


class _Big(TorchDispatchMode):
    """Model-precision tensors of at least ``T x V`` elements that ops allocate (no views)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and not func.is_view
                    and t.numel() >= T * V):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _kl_rows(x, teacher):
    s = torch.log_softmax(x.float(), -1)
    t = torch.log_softmax(teacher.float(), -1)
    return ((t.exp() * (t - s)).sum(-1),)


def test_the_backward_writes_the_gradient_over_the_logits():
    """Deterministic memory: the call's backward (its ops run eagerly under a dispatch
    mode) allocates no ``[T, V]`` bf16 tensor and leaves the logits' gradient where the
    logits were, bit for bit the plain call's gradient, which allocates it anew; the
    lm_head's gradients are ``g @ W`` and ``g.T @ h`` of that gradient."""
    hidden, weight, _ = _lm_head()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    key = user_bodies.register(symbolic_trace(_kl_rows))
    budget = 8 * V * 32  # 8 rows a chunk
    grads = [torch.randn(T)]
    with compiling_with(EAGER):
        kl, x, flag = _row_local_head._init_fn(key, [teacher], [], budget, 0, hidden, weight, None,
                                              "matmul", False)
        logits = hidden @ weight.T
        assert torch.equal(x, logits) and flag.item() == 1
        plain, fresh = _Big(), _Big()
        with plain:
            (want,) = _row_local_backward._init_fn(key, [0], [0], [logits, teacher], [], [], grads, budget)
        with fresh:
            gh, gw = _row_local_head_backward._init_fn(key, [], [0], [teacher], [], [], grads, budget, 0,
                                                       hidden, weight, None, "matmul", False, x, flag,
                                                       [True, True, False])
    assert [s for _, s in plain.shapes] == [(T, V)] and fresh.shapes == [], (plain.shapes, fresh.shapes)
    assert torch.equal(x, want) and flag.item() == 0
    assert torch.equal(gh, want @ weight) and torch.equal(gw, want.t() @ hidden)


@pytest.mark.parametrize("donated", [True, False])
def test_a_retained_graphs_second_backward_equals_the_first(donated):
    """The first backward wrote over the logits; the second recomputes them first."""
    hidden, weight, tokens = _lm_head()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch._dynamo.reset()
    with functorch_config.patch(donated_buffer=donated):
        loss = torch.compile(smoothed_ce, backend="chunked_logits", options=WHOLE)(h, w, tokens)
        assert chunked_counters().get("row_local_lm_head_in_call") == 1
        assert_retained_backward_repeats(loss, h, w)


def test_the_call_runs_stocks_three_gemms():
    """GEMM audit, recorded by the profiler (``aten::mm`` / ``aten::addmm`` and their
    shapes; the audit's dispatch mode cannot run the bodies' ``torch.func.vjp``): the
    call's forward matmul and the backward's ``g @ W`` and ``g.T @ h`` are stock's three
    ``[T, H] x [H, V]`` GEMMs, with the lm_head plans forced or not (they are the fused
    loop's, not this call's)."""
    from torch.profiler import profile

    from tests.numerics import run

    fn, inputs, grad_pos = _case("distillation")
    for options in (WHOLE, {"lm_head_plan": "gpu", **WHOLE}, {"lm_head_plan": "fp32_tiles", **WHOLE}):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="chunked_logits", options=options)
        run(compiled, inputs, grad_pos)  # compiled before the recorded step
        with profile(record_shapes=True) as prof:
            run(compiled, inputs, grad_pos)
        assert chunked_counters().get("row_local_lm_head_in_call") == 1
        shapes = [e.input_shapes[-2:] for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
        flops = sum(2 * a[0] * a[1] * b[1] for a, b in shapes)
        assert len(shapes) == 3 and flops == 3 * 2 * T * H * V, shapes
