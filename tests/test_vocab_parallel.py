"""Vocab-parallel logits (issue 12): the loss written on the local vocabulary shard with
functional collectives on per-row tensors, Megatron's way.

In-process tests use a one-rank gloo group (the collectives run, the graph is what a
rank of many compiles); tests/test_distributed.py runs the example on 2 ranks."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters

from fx_passes import compat
from fx_passes.testing.codegen import allocations, full_fp32_buffers
from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.helpers import chunked_counters, clean_env, isa_probes_settled, ops, rewrite_graphs
from tests.numerics import FULL_MATRIX, TOLERANCES, assert_no_less_accurate, dtype_matrix, reference, run
from tests.shard_heads import (
    HEADS,
    SMALL_BUDGET,
    H,
    T,
    V,
    all_reduce,
    cross_entropy,
    entropy,
    inputs,
    lm_inputs,
    logprob,
    logprob_inplace,
    logprob_unshifted,
    shifted,
    with_lm_head,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_rank_group")  # (conftest)


def _masked(head, one_pass: bool = False) -> dict:
    """The counters a head with a mask adds (its ignored labels): the one-pass loop skips
    their rows (8 of ``T``, ``tests/test_vocab_parallel_masked.py``); the stages without it
    run every row and say why (NOTE [why every row runs])."""
    if head is not cross_entropy:
        return {}
    if one_pass:
        return {"masked_rows": 1, "rows_seen": T, "rows_skipped": 8}
    return {"masked_rows_not_skipped": 1}


@pytest.mark.sampled
@pytest.mark.parametrize("head,dtype,out_rtol,grad_rtol", dtype_matrix(HEADS, ids=lambda f: f.__name__))
def test_rewritten_and_no_less_accurate_than_stock(head, dtype, out_rtol, grad_rtol):
    data = inputs(dtype)
    if head is not cross_entropy:
        data[1] = data[1].clamp(min=0)
    ref = reference(head, data, (0,))
    torch._dynamo.reset()
    stock = run(torch.compile(head, backend="inductor"), data, (0,))
    torch._dynamo.reset()
    counters.clear()
    ours = run(torch.compile(head, backend="chunked_logits"), data, (0,))
    assert chunked_counters() == {"rewritten": 1, "vocab_parallel": 1, **_masked(head)}
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


@pytest.mark.sampled
@pytest.mark.parametrize("head", HEADS, ids=lambda f: f.__name__)
def test_no_fp32_shard_buffer_forward_or_backward(head):
    """Stock allocates FP32 [T, V] buffers (positive control); the rewrite none, in the
    outer graph or in the stage bodies it compiles."""
    x, tok = inputs(torch.bfloat16)
    tok = tok.clamp(min=0) if head is not cross_entropy else tok

    def codes(backend):
        torch._dynamo.reset()
        xr = x.clone().requires_grad_()
        fn = torch.compile(head, backend=backend)
        _, out = torch._inductor.utils.run_and_get_code(lambda: fn(xr, tok).sum().backward())
        return out
    assert full_fp32_buffers(codes("inductor"), T, V)
    assert full_fp32_buffers(codes("chunked_logits"), T, V) == []


def test_reductions_in_two_stages_that_need_gradients_are_declined():
    """The entropy's p taken from the all-reduced sum: a third stage with a gradient;
    summing two model-precision gradients would round twice, so it stays stock."""
    def head(local):
        z = shifted(local, torch.float32)
        lse = all_reduce(z.exp().sum(-1), "sum").log()
        p = (z - lse.unsqueeze(-1)).exp()
        return lse - all_reduce((p * z).sum(-1), "sum")
    x = inputs(torch.bfloat16)[0].requires_grad_()
    torch._dynamo.reset()
    counters.clear()
    torch.compile(head, backend="chunked_logits")(x).sum().backward()
    assert chunked_counters() == {"declined": 1, "declined:UNKNOWN_OP": 1}


def test_no_gradient_needed_is_rewritten_in_stages():
    """Under no_grad (reference scoring) several stages are fine: no backward."""
    def head(local):
        z = shifted(local, torch.float32)
        lse = funcol.all_reduce(z.exp().sum(-1), "sum", dist.group.WORLD).log()
        p = (z - lse.unsqueeze(-1)).exp()
        return lse - funcol.all_reduce((p * z).sum(-1), "sum", dist.group.WORLD)
    x = inputs(torch.bfloat16)[0]
    want = torch.compile(head, backend="inductor")(x)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        got = torch.compile(head, backend="chunked_logits")(x)
    assert chunked_counters() == {"rewritten": 1, "vocab_parallel": 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_logits_changed_in_place_inside_the_region_is_declined():
    def head(local, tok):
        z = local.float()
        m = funcol.all_reduce(z.detach().amax(-1), "max", dist.group.WORLD)
        local.mul_(2)  # the stage after the max would read the changed logits
        return ((z - m.unsqueeze(-1)).exp().sum(-1)).log()
    x, tok = inputs(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(head, backend="chunked_logits")(x.clone(), tok)
    assert chunked_counters() == {"declined": 1, "declined:MUTATION": 1}


def test_shard_over_rows_is_not_taken():
    """Reductions over the rows (dim 0), all-reduced: not a vocabulary shard; nothing
    rewritten, results as stock."""
    def head(local):
        z = local.float() / 0.7
        return funcol.all_reduce(z.exp().sum(0), "sum", dist.group.WORLD).log()
    x = inputs(torch.bfloat16)[0]
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(head, backend="chunked_logits")(x)
    assert "rewritten" not in chunked_counters() and "vocab_parallel" not in chunked_counters()
    torch.testing.assert_close(got, torch.compile(head, backend="inductor")(x))


@pytest.mark.parametrize("spelling", ["cross_entropy", "log_softmax_gather"])
def test_a_loss_all_reduced_for_logging_stays_single_process(spelling):
    """Was a bug: a loss whose value is all-reduced for logging made its region look
    vocab-parallel (declined, or taken by the shard path without the single-process
    rewrite).  Only per-row results reaching a collective count."""
    def step(logits, tok):
        z = logits.float() / 0.7
        if spelling == "cross_entropy":
            loss = torch.nn.functional.cross_entropy(z, tok)
        else:
            loss = -torch.log_softmax(z, -1).gather(-1, tok.unsqueeze(-1)).mean()
        return loss, funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)
    x, tok = inputs(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(step, backend="chunked_logits")(x.requires_grad_(), tok.clamp(min=0))[0].backward()
    assert chunked_counters() == {"rewritten": 1}


# --- the lm_head matmul inside the loop (fx_passes.kernels.log_softmax.shard) ---------------------

def _reference_and_stock(fn, data) -> tuple:
    """(FP64 reference, stock Inductor's run) of an lm_head case, both gradients."""
    ref = reference(fn, data, (0, 1))
    torch._dynamo.reset()
    return ref, run(torch.compile(fn, backend="inductor"), data, (0, 1))


@pytest.mark.sampled
@pytest.mark.parametrize("head,dtype,out_rtol,grad_rtol", dtype_matrix(HEADS, ids=lambda f: f.__name__))
def test_lm_head_fused_and_no_less_accurate_than_stock(head, dtype, out_rtol, grad_rtol):
    """``h @ w_shard.T`` feeding the region: every stage computes its logits per row chunk;
    loss and the gradients of h and of the weight shard no further from FP64 than stock."""
    fn, data = with_lm_head(head), lm_inputs(dtype, head)
    ref, stock = _reference_and_stock(fn, data)
    torch._dynamo.reset()
    counters.clear()
    ours = run(torch.compile(fn, backend="chunked_logits", options=SMALL_BUDGET), data, (0, 1))
    assert chunked_counters() == {"rewritten": 1, "vocab_parallel": 1, "vocab_parallel_lm_head": 1,
                                  "vocab_parallel_one_pass": 1, **_masked(head, one_pass=True)}
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


@pytest.mark.parametrize("head", [logprob, entropy], ids=lambda f: f.__name__)
def test_lm_head_fused_no_logits_shard_in_generated_code(head):
    """Not even the model-precision logits shard or its gradient: no [T, V / world]
    buffer of any dtype in the step's graphs (stock has them: the positive control)."""
    fn, (h, w, tok) = with_lm_head(head), lm_inputs(torch.bfloat16, head)

    def codes(backend):
        torch._dynamo.reset()
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        step = torch.compile(fn, backend=backend, options=SMALL_BUDGET if backend != "inductor" else None)
        _, out = torch._inductor.utils.run_and_get_code(lambda: step(hr, wr, tok).sum().backward())
        return [a for c in out for a in allocations(c) if a[0] == (str(T), str(V))]
    assert codes("inductor"), "positive control"
    assert codes("chunked_logits") == []


def test_lm_head_frozen_weight_only_hidden_gradient():
    """A frozen lm_head shard: only grad_hidden is computed, the same as with the weight
    trainable."""
    fn, data = with_lm_head(logprob), lm_inputs(torch.bfloat16, logprob)
    step = torch.compile(fn, backend="chunked_logits", options=SMALL_BUDGET)
    _, (gh_all, _) = run(step, data, (0, 1))
    _, (gh,) = run(step, data, (0,))
    assert torch.equal(gh, gh_all)


def logprob_global_shift(local, tok, up=torch.float32):
    """The shift is the largest max over all rows: still a valid shift, but the glue
    between the stages (``.max()`` over rows) is not per row."""
    z = local.to(up) / 0.7
    m = funcol.all_reduce(z.detach().amax(-1), "max", dist.group.WORLD)
    z = z - m.max()
    s = all_reduce(z.exp().sum(-1), "sum")
    return z.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - s.log()


def logprob_fixed_view(local, tok, up=torch.float32):
    """The max's shape spelled with the number of rows: wrong for a chunk of rows."""
    z = local.to(up) / 0.7
    m = funcol.all_reduce(z.detach().amax(-1), "max", dist.group.WORLD)
    z = z - m.view(local.shape[0], 1)
    s = all_reduce(z.exp().sum(-1), "sum")
    return z.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - s.log()


NOT_ONE_PASS = {logprob_global_shift: "is not one value per row",
                logprob_fixed_view: "(view) is not an elementwise op"}


def logits_rows(monkeypatch, step):
    """Rows x columns of the lm_head matmuls ``step`` runs in the forward and in the
    backward (real tensors only: not the fake ones compiling traces)."""
    calls, linear = [], torch.nn.functional.linear

    def counted(a, b, *rest):
        if not isinstance(a, torch._subclasses.FakeTensor):
            calls.append(a.shape[0] * b.shape[0])
        return linear(a, b, *rest)
    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    out = step()
    forward = sum(calls)
    out.sum().backward()
    return forward, sum(calls) - forward


@pytest.mark.sampled(3)
@pytest.mark.parametrize("head", [logprob, entropy, cross_entropy, logprob_inplace, logprob_unshifted,
                                  *NOT_ONE_PASS], ids=lambda f: f.__name__)
def test_lm_head_stages_in_one_pass_compute_the_logits_once(head, monkeypatch, caplog):
    """The forward computes each row chunk's logits once for all stages, the glue (the
    max's all-reduce, in-place or functional) running per chunk; glue that is not per row
    keeps one pass per stage, with the reason in the log.  Results as stock's either way;
    the backward's two sweeps compute the logits twice (``two_sweeps``); the rows the
    cross-entropy ignores are computed neither way."""
    fn, (h, w, tok) = with_lm_head(head), lm_inputs(torch.bfloat16, head)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(fn, backend="chunked_logits", options=SMALL_BUDGET)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    with caplog.at_level("INFO", logger="fx_passes"):
        forward, backward = logits_rows(monkeypatch, lambda: step(hr, wr, tok))
    one_pass = head not in NOT_ONE_PASS
    assert chunked_counters().get("vocab_parallel_one_pass", 0) == one_pass
    ran = T - chunked_counters().get("rows_skipped", 0)  # (the cross-entropy's ignored labels: left out)
    assert ran == (T - 8 if head is cross_entropy else T)
    assert forward == (1 if one_pass else 2) * ran * V
    assert backward == 2 * ran * V
    if not one_pass:
        assert "one lm_head pass per stage: glue between stages:" in caplog.text
        assert NOT_ONE_PASS[head] in caplog.text
    torch._dynamo.reset()
    stock = torch.compile(fn, backend="inductor")
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = stock(hs, ws, tok)
    out.sum().backward()
    for got, want in zip((step(h, w, tok), hr.grad, wr.grad), (out, hs.grad, ws.grad)):
        torch.testing.assert_close(got, want.detach(), rtol=2e-6, atol=2**-8 * want.abs().max().item())


@pytest.mark.parametrize("head,dtype,out_rtol,grad_rtol", [
    pytest.param(logprob, *TOLERANCES[0].values, id="logprob-bf16"),  # one pass
    pytest.param(cross_entropy, *TOLERANCES[1].values, id="cross_entropy-fp16"),  # one pass, rows skipped
    pytest.param(logprob_global_shift, *TOLERANCES[1].values, id="stages-fp16"),  # a loop per stage
])
@pytest.mark.sampled
def test_lm_head_gpu_plan_recomputes_the_logits_once(head, dtype, out_rtol, grad_rtol, monkeypatch):
    """On CUDA / XPU the backward runs the lm_head's "gpu" plan (NOTE [shard lm_head
    loops]), here through the test-only ``out_dtype`` kernels: its vocabulary blocks
    recompute the logits once, not twice as ``two_sweeps`` does (four ``[T, H] x [H, V]``
    GEMMs a step with the forward's, not five), and add ``grad_hidden`` into an FP32 sum
    inside their GEMMs (``compat.addmm_fp32_``, which ``two_sweeps`` never calls); results
    and gradients no further from FP64 than stock's."""
    fn, data = with_lm_head(head), lm_inputs(dtype, head)
    ref, stock = _reference_and_stock(fn, data)
    added, addmm_fp32_ = [], compat.addmm_fp32_

    def counted(acc, a, b):
        added.append(a.dtype)
        return addmm_fp32_(acc, a, b)
    monkeypatch.setattr(compat, "addmm_fp32_", counted)
    rows = {}
    for plan in ("gpu", "two_sweeps"):
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(fn, backend="chunked_logits", options={**SMALL_BUDGET, "lm_head_plan": plan})
        with cpu_out_dtype_kernels():
            if plan == "gpu":
                assert_no_less_accurate(run(step, data, (0, 1)), stock, ref, dtype, out_rtol, grad_rtol)
                assert added and set(added) == {dtype}
            added.clear()
            h, w, tok = (data[0].clone().requires_grad_(), data[1].clone().requires_grad_(), data[2])
            rows[plan] = logits_rows(monkeypatch, lambda: step(h, w, tok))[1]
        assert chunked_counters()["vocab_parallel_lm_head"] == 1, chunked_counters()
        assert bool(added) == (plan == "gpu")
    ran = T - chunked_counters().get("rows_skipped", 0)
    assert rows == {"gpu": ran * V, "two_sweeps": 2 * ran * V}


def _gemms(monkeypatch):
    """(rows x columns of each ``F.linear``, FLOPs / 2 of each ``torch.mm``) a step runs
    (real tensors only: not the fake ones compiling traces)."""
    linears, mms, linear, mm = [], [], torch.nn.functional.linear, torch.mm

    def counted_linear(a, b, *rest):
        if not isinstance(a, torch._subclasses.FakeTensor):
            linears.append(a.shape[0] * b.shape[0])
        return linear(a, b, *rest)

    def counted_mm(a, b, **kw):
        if not isinstance(a, torch._subclasses.FakeTensor):
            mms.append(a.shape[0] * a.shape[1] * b.shape[1])
        return mm(a, b, **kw)
    monkeypatch.setattr(torch.nn.functional, "linear", counted_linear)
    monkeypatch.setattr(torch, "mm", counted_mm)
    return linears, mms


@pytest.mark.parametrize("head,dtype,out_rtol,grad_rtol", [
    pytest.param(logprob, *TOLERANCES[0].values, id="logprob-bf16"),
    pytest.param(entropy, *TOLERANCES[1].values, id="entropy-fp16"),
])
@pytest.mark.sampled
def test_kept_logits_three_gemms_and_no_less_accurate(head, dtype, out_rtol, grad_rtol, monkeypatch):
    """``lm_head_plan="kept_logits"`` (NOTE [kept shard logits]): the one-pass forward keeps
    its model-precision logits shard and the backward writes their gradient in their place:
    three ``[T, H] x [H, V]`` GEMMs a step (the forward's chunks, ``grad_hidden``,
    ``grad_weight``), none recomputing the logits; results and gradients no further from
    FP64 than stock's; a retained graph's second backward gives the first's gradients;
    under ``no_grad`` the plain one-pass call (nothing kept)."""
    fn, data = with_lm_head(head), lm_inputs(dtype, head)
    ref, stock = _reference_and_stock(fn, data)
    torch._dynamo.reset()
    counters.clear()
    kept = {**SMALL_BUDGET, "lm_head_plan": "kept_logits"}
    step = torch.compile(fn, backend="chunked_logits", options=kept)
    h, w, tok = data[0].clone().requires_grad_(), data[1].clone().requires_grad_(), data[2]
    # (retain_graph below: no donated buffers, and no cache that may hold this graph compiled with them)
    no_cache = torch._inductor.config.patch(force_disable_caches=True)
    with functorch_config.patch(donated_buffer=False), no_cache:
        ours = run(step, data, (0, 1))
        assert chunked_counters() == {"rewritten": 1, "vocab_parallel": 1, "vocab_parallel_lm_head": 1,
                                      "vocab_parallel_one_pass": 1, "kept_logits": 1}
        assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)
        linears, mms = _gemms(monkeypatch)
        out = step(h, w, tok)
        forward = len(mms)
        out.sum().backward(retain_graph=True)
    assert linears == [] and sum(mms) == 3 * T * H * V and sum(mms[:forward]) == T * H * V
    first = (h.grad.clone(), w.grad.clone())
    h.grad, w.grad = None, None
    out.sum().backward()  # (the flag cleared by the first: the logits computed again, then the same)
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])
    with torch.no_grad():
        mms.clear()
        torch.testing.assert_close(step(data[0], data[1], tok), ours[0][0], rtol=0, atol=0)
    assert sum(mms) == 0 and linears  # (the plain one-pass loop: F.linear per chunk, nothing kept)


@pytest.mark.slow
@pytest.mark.full  # (make test starts warm in tests/test_recompiles_cache.py)
def test_warm_start_in_a_new_process_serves_the_one_pass_graphs(tmp_path):
    """AOTAutograd's cache holds graphs that call ``shard_lm_head_stages`` by a plan's
    name; the plan lives in the process that ran the pass.  A second process with the same
    cache runs the pass again (it registers the same plan under the same name), hits the
    cache for every graph, and gets the same bits."""
    env = clean_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT),
                    TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                    **isa_probes_settled())

    def child() -> dict:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vocab_parallel_child.py")], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    cold, warm = child(), child()
    for process in (cold, warm):
        assert process["chunked_logits"] == {"rewritten": 2, "vocab_parallel": 2, "vocab_parallel_lm_head": 2,
                                         "vocab_parallel_one_pass": 2}
    saved = cold["aot_autograd"].get("autograd_cache_saved", 0)
    assert saved >= 2 and cold["aot_autograd"].get("autograd_cache_hit", 0) == 0, cold
    assert warm["aot_autograd"].get("autograd_cache_hit", 0) == saved, warm
    assert "autograd_cache_miss" not in warm["aot_autograd"], warm
    assert warm["bits"] == cold["bits"]


@pytest.mark.sampled
@pytest.mark.parametrize("fused", [False, True], ids=["shard", "lm_head"])
def test_dynamic_lengths_rewritten_once_and_same_as_stock(fused):
    """Was a gap: under ``dynamic=True`` Dynamo passes the temperature as a symbolic float
    and the region was declined ("not a tensor").  It is a 0-d FP32 operand now: one
    rewrite for every length, results as stock's."""
    fn = with_lm_head(logprob) if fused else logprob
    ours = torch.compile(fn, backend="chunked_logits", dynamic=True, options=SMALL_BUDGET)
    stock = torch.compile(fn, backend="inductor", dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    for rows in (37, 50, 23):
        g = torch.Generator().manual_seed(rows)
        tok = torch.randint(0, V, (rows,), generator=g)
        if fused:
            h, w = torch.randn(rows, H, generator=g), torch.randn(V, H, generator=g) / 4
            data = [h.bfloat16(), w.bfloat16(), tok]
        else:
            data = [(torch.randn(rows, V, generator=g) * 4).bfloat16(), tok]
        grad_pos = (0, 1) if fused else (0,)
        got, want = run(ours, data, grad_pos), run(stock, data, grad_pos)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2**-8 * b.abs().max().item())
    kinds = chunked_counters()
    assert kinds.get("declined", 0) == 0 and kinds["vocab_parallel"] >= 1, kinds
    assert kinds.get("vocab_parallel_lm_head", 0) == (kinds["vocab_parallel"] if fused else 0), kinds
    assert kinds.get("vocab_parallel_one_pass", 0) == (kinds["vocab_parallel"] if fused else 0), kinds


NOT_FUSED = {"returned": "the logits shard is also read outside the region", "bias": "the lm_head has a bias"}


@pytest.mark.parametrize("case", ["returned", "bias", "off"])
def test_lm_head_not_fused_says_why(case, caplog):
    """The shard read outside the region (here: returned), or a bias, keeps the matmul, and
    so does ``fuse_lm_head=False``; the region is rewritten either way."""
    def fn(h, w, tok):
        local = torch.nn.functional.linear(h, w, w[:, 0]) if case == "bias" else h @ w.t()
        out = logprob(local, tok)
        return (out, local) if case == "returned" else out
    h, w, tok = lm_inputs(torch.bfloat16, logprob)
    torch._dynamo.reset()
    counters.clear()
    options = {"fuse_lm_head": False} if case == "off" else {}
    with caplog.at_level("INFO", logger="fx_passes"):
        torch.compile(fn, backend="chunked_logits", options=options)(h.requires_grad_(), w, tok)
    if case in NOT_FUSED:
        assert chunked_counters() == {"rewritten": 1, "vocab_parallel": 1, "lm_head_not_fused": 1}
        assert NOT_FUSED[case] in caplog.text
    else:
        assert chunked_counters() == {"rewritten": 1, "vocab_parallel": 1}


UNEVEN = ["--vocab", "2400", "--vocab-split", "1000,1400", "--chunk-budget-mib", "0.05"]
# (ranks, data-parallel replicas, more arguments) of each run of the example
# (and the uneven shards with the logits shard kept for the backward: NOTE [kept shard logits])
KEPT = ["--lm-head-plan", "kept_logits", "--head", "logprob", "entropy", "ce"]
EVERY_RANK = {"tp2_fsdp2_dp2": (4, 2, []), "tp2_fsdp2_dp2_loss_unit": (4, 2, ["--fsdp-unit", "loss"]),
              "tp2_uneven_shards": (2, 1, UNEVEN), "tp2_uneven_shards_kept": (2, 1, UNEVEN + KEPT)}
# (4 ranks on a 2-core machine take as long as the rest of the module: make test runs the
# uneven shards, whose tensor parallelism the 4-rank runs repeat, on three heads, and make
# test-full every run and head; kept_logits on uneven shards: test_kept_logits_* on one rank)
EVERY_RANK_IN_CI = set(EVERY_RANK) if FULL_MATRIX else {"tp2_uneven_shards"}
FULL = pytest.mark.full


def every_rank_heads(ranks: int) -> list[str]:
    # (issue 21's spelling, the target logit gathered before the shift, on 2 ranks)
    if ranks == 4:
        return ["logprob", "ce"]
    return ["logprob", "entropy", "ce", "logprob_unshifted"][0 if FULL_MATRIX else 1:]


def torchrun(tmp_path: pathlib.Path) -> dict[str, list[dict]]:
    """Every run of the example in one torchrun start (tests/torchrun_cases.py) on the
    most ranks any asks for, a run on fewer on the first ranks (``--ranks``; the others
    skip it), and what each of its ranks wrote."""
    exe = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    chosen = {name: EVERY_RANK[name] for name in EVERY_RANK_IN_CI}
    world = max(ranks for ranks, _, _ in chosen.values())
    runs = {name: ["--head", *every_rank_heads(ranks), "--dp", str(dp), "--ranks", str(ranks),
                   "--out", str(tmp_path / name), *extra] for name, (ranks, dp, extra) in chosen.items()}
    proc = subprocess.run(
        [exe, "--standalone", "--nproc-per-node", str(world), str(ROOT / "tests" / "torchrun_cases.py"),
         "examples.vocab_parallel_step", json.dumps(runs)],
        capture_output=True, text=True, cwd=ROOT, env=clean_env(OMP_NUM_THREADS="1"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(ranks)]
            for name, (ranks, _, _) in chosen.items()}


@pytest.fixture(scope="module")
def every_rank_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each run's rank files by name: the 4-rank runs and the 2-rank run share one
    torchrun start (each rank imports torch, joins the group and warms Inductor once)."""
    return torchrun(tmp_path_factory.mktemp("every_rank"))


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(name, marks=() if name in EVERY_RANK_IN_CI else FULL)
                                  for name in EVERY_RANK])
def test_every_rank_every_head(every_rank_runs, case):
    """examples/vocab_parallel_step.py: 2 data-parallel replicas of 2 tensor-parallel ranks
    with the lm_head shard under FSDP2 (4 ranks), the shard alone a ``fully_shard`` unit
    (its call a graph break: not fused) or with the loss in the unit (fused); and 2 ranks
    whose shards differ in width, with a budget that gives them different chunk counts (8
    and 11: the one-pass loop's collectives must still pair up, so the ranks agree on the
    largest).  Each head rewritten on every rank, loss and gradients (the weight shard's,
    and h's summed over the shards) no further from the FP64 single-process reference than
    stock Inductor on the same ranks.  (Even shards on 2 ranks are the 4-rank runs' tensor
    parallelism; the 4-rank runs take two heads, the 2-rank run every head.)"""
    ranks, dp, extra = EVERY_RANK[case]
    heads = [h for h in every_rank_heads(ranks) if "--head" not in extra or h in extra]
    files = every_rank_runs[case]
    assert [rank["world"] for rank in files] == [ranks] * ranks
    for rank in files:
        assert set(heads) <= set(rank)
        for head in heads:
            ours, stock = rank[head]["chunked_logits"], rank[head]["inductor"]
            # (with the shard alone under FSDP2 its module call is a graph break: its logits
            # come in whole)
            whole = dp > 1 and "loss" not in extra
            fused = {} if whole else {"vocab_parallel_lm_head": 1, "vocab_parallel_one_pass": 1}
            # (the cross-entropy's ignored labels are a mask: the one-pass loop leaves their
            # rows out where the shards are as wide, and runs every row where they are not;
            # the stages of logits that come in whole run every row, and say so)
            said = {} if head != "ce" else {"masked_rows_not_skipped": 1} if whole else {"masked_rows": 1}
            # (kept logits: the one-pass loops with no mask; a masked one keeps its own loop)
            kept = {"kept_logits": 1} if "kept_logits" in extra and head != "ce" else {}
            got = ours["counters"]
            rows = {k: got.pop(k) for k in ("rows_seen", "rows_skipped") if k in got}
            want = {"rewritten": 1, "vocab_parallel": 1, **fused, **said, **kept}
            assert ours["counters"] == want, ours["events"]
            if head == "ce" and not whole:
                uneven = "--vocab-split" in extra
                assert rows["rows_seen"] > 0 and (rows["rows_skipped"] == 0) == uneven, rows
            assert ours["loss"]["max"] <= stock["loss"]["max"] + 2e-6 * max(stock["loss"]["scale"], 1.0)
            for name, got in ours["grads"].items():
                st = stock["grads"][name]
                assert got["max"] <= st["max"] + 2**-8 * st["scale"], (head, name, got, st)


def test_graph_before_and_after():
    """The FP32 part becomes one call per stage; the collectives and the [T] maths stay
    as written (the index computation moves before the second stage's call)."""
    before, after = rewrite_graphs(logprob, *inputs(torch.bfloat16))
    assert ops(before) == (
        ".to truediv .detach .amax all_reduce wait_tensor .unsqueeze sub .exp .sum .detach all_reduce "
        "wait_tensor .detach sub add ge lt and_ sub where .unsqueeze .gather .squeeze where .detach "
        "all_reduce wait_tensor .detach sub add .log sub")
    assert ops(after) == (
        "shard_reduce getitem all_reduce wait_tensor .unsqueeze ge lt and_ sub where .unsqueeze shard_reduce "
        "getitem getitem .detach all_reduce wait_tensor .detach sub add .squeeze where .detach all_reduce "
        "wait_tensor .detach sub add .log sub")


@pytest.mark.parametrize("head", [logprob, logprob_inplace], ids=lambda f: f.__name__)
def test_lm_head_graph_after_one_pass(head):
    """With the lm_head fused, both stages are one call; the max's all-reduce moves into
    it (functional, or Megatron's in-place spelling, whose ``copy_`` stays for readers
    outside); the sums' all-reduces and the [T] maths stay as written."""
    h, w, tok = lm_inputs(torch.bfloat16, head)
    _, after = rewrite_graphs(with_lm_head(head), h.requires_grad_(), w.requires_grad_(), tok)
    assert ops(after) == {
        logprob: "ge lt and_ sub where .unsqueeze shard_lm_head_stages getitem getitem getitem getitem "
                 ".detach all_reduce wait_tensor .detach sub add .squeeze where .detach all_reduce "
                 "wait_tensor .detach sub add .log sub",
        logprob_inplace: ".unsqueeze shard_lm_head_stages getitem getitem getitem getitem getitem .copy_ "
                         "all_reduce wait_tensor .copy_ .squeeze .log sub",
    }[head]


def test_a_body_that_fails_to_compile_runs_eagerly(caplog):
    """A compile failure inside the step (the stage bodies compile on first use) must not
    end the user's step: the body runs eagerly, the same maths, with a warning."""
    from fx_passes.kernels.ops.body_compiler import compiling_with

    def broken(fn, options):
        def call(*args):
            raise RuntimeError("injected compile failure")
        return call
    data = inputs(torch.bfloat16)
    data[1] = data[1].clamp(min=0)
    torch._dynamo.reset()
    stock = run(torch.compile(logprob, backend="inductor"), data, (0,))
    torch._dynamo.reset()
    counters.clear()
    with compiling_with(broken):
        ours = run(torch.compile(logprob, backend="chunked_logits"), data, (0,))
    assert chunked_counters()["shard_body_eager"] == 3  # two forward stages, one backward
    assert "injected compile failure" in caplog.text
    for got, want in zip(ours[0] + ours[1], stock[0] + stock[1]):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2**-8 * want.abs().max().item())


# --- a mask on the loss the rows of which run anyway: the log says why ----------------------------
# (the one-pass loop skips them: tests/test_vocab_parallel_masked.py)

def _masked_mean(head, where):
    def fn(h, w, tok, mask):
        y = head(h @ w.t(), tok)
        kept = torch.where(mask > 0, y, 0.0) if where else y * mask
        return kept.sum() / mask.sum()
    return fn


def _masked_given(local, tok, mask):
    return (logprob(local, tok) * mask).sum() / mask.sum()


@pytest.mark.parametrize("case", ["given_logits", "in_place_all_reduce"])
def test_a_masked_loss_that_runs_every_row_says_why(case):
    """Where the stages run every row, a loss with a mask says so (counter
    ``masked_rows_not_skipped``, the rewrite's line): the stages of logits the graph is
    given (no lm_head in the loop: skipping rows there is not built), and Megatron's
    in-place ``dist.all_reduce`` (a ``copy_`` among the readers, which the proof does not
    read)."""
    from fx_passes.reporting.session import session
    h, w, tok = lm_inputs(torch.bfloat16, logprob)
    mask = (torch.arange(T) % 4 != 0).float()
    torch._dynamo.reset()
    counters.clear()
    session.reset()
    if case == "given_logits":
        step, args, expect = _masked_given, ((h @ w.t()).requires_grad_(), tok, mask), "run every row"
    else:
        step, args, expect = _masked_mean(logprob_inplace, False), (h.requires_grad_(), w, tok, mask), "copy_"
    torch.compile(step, backend="chunked_logits", options=SMALL_BUDGET)(*args).backward()
    c = chunked_counters()
    assert c.get("masked_rows_not_skipped") == 1 and "rows_skipped" not in c, c
    said = [e.what for e in session.events if "though a mask" in e.what]
    assert len(said) == 1 and expect in said[0], said
