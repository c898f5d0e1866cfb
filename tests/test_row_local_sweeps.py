"""A row-local region whose lm_head runs chunk by chunk inside its call (issue 21, WD's
memory limit): the forward computes each row chunk's logits, the backward runs row chunks
over the whole vocabulary (``grad_hidden``) and vocabulary blocks over all rows
(``grad_weight``) on the body's gradient split into per-row values and a pointwise
function (``fx_passes/kernels/row_local/split.py``, ``row_local_sweeps.py``).

Each loss whose gradient splits is rewritten so (counter ``row_local_lm_head``) and is no
further from FP64 than stock Inductor, static and dynamic, bf16 and fp16; neither the
forward nor the backward allocates a ``[T, V]`` tensor of any float dtype; the split
itself rebuilds the whole-row gradient block by block; a body that needs whole rows keeps
its logits (``row_local_lm_head_in_call``) with the reason in the log; the GEMMs are the
five the docs count.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx import symbolic_trace

from fx_passes.kernels.ops import user_bodies
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.kernels.row_local import split as row_split
from fx_passes.kernels.row_local.head import _row_local_head, _row_local_head_backward
from fx_passes.kernels.row_local.sweeps import _row_local_sweeps, row_local_sweeps_backward
from fx_passes.reporting.session import session
from tests import row_local_cases as rl
from tests.helpers import RowGathers, assert_retained_backward_repeats, chunked_counters
from tests.numerics import F32, dtype_matrix
from tests.sweep_cases import EAGER, SPLIT, H, T, V, topp_policy
from tests.sweep_cases import Wide as _Wide
from tests.sweep_cases import case as _case
from tests.sweep_cases import head as _head
from tests.sweep_cases import kl_rows as _kl_rows
from tests.sweep_cases import topk_rows as _topk_rows
from tests.sweep_cases import topp_rows as _topp_rows

# (with the loss in the graph each takes its gradients in the forward, tests/test_row_local_loss.py;
# here both sweeps run in the backward, as for per-row results that leave the graph)
BACKWARD_SWEEPS = {"gradients_in_forward": False}


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name", list(SPLIT))
def test_each_loss_runs_the_lm_head_in_chunks_as_accurate_as_stock(name):
    fn, inputs, grad_pos = _case(name)
    c = rl.check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8, **BACKWARD_SWEEPS)
    assert c.get("row_local_lm_head") == 1 and not c.get("row_local_lm_head_in_call"), c


def test_a_frozen_weight_takes_only_the_row_sweep():
    fn, inputs, _ = _case("forward_kl")
    c = rl.check(fn, inputs, (0,), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head") == 1, c


# (losses without a float global: one Dynamo pass, one rewrite)
@pytest.mark.sampled(3)
@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol",
                         dtype_matrix(["reverse_kl", "kl_div_linear", "smoothed_ce"]))
def test_dynamic_shapes_and_dtypes(name, dtype, out_rtol, grad_rtol):
    fn, inputs, grad_pos = _case(name, dtype)
    c = rl.check(fn, inputs, grad_pos, dtype, out_rtol, grad_rtol, dynamic=True, **BACKWARD_SWEEPS)
    assert c.get("row_local_lm_head") == 1, c


def test_a_body_that_needs_whole_rows_keeps_its_logits_with_the_reason():
    hidden, weight = _head()
    tokens = rl.kept_tokens(hidden @ weight.T)
    n_events = len(session.events)
    c = rl.check(topp_policy, (hidden, weight, tokens, torch.randn(T)), (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head_in_call") == 1 and not c.get("row_local_lm_head"), c
    said = [e.what for e in session.events[n_events:] if e.kind == "rewritten"]
    assert any("logits kept whole: the body's gradient needs whole rows: aten.scatter.src of more than one "
               "column a row is not pointwise" in s for s in said), said


def test_the_option_off_keeps_the_logits():
    fn, inputs, grad_pos = _case("forward_kl")
    n_events = len(session.events)
    c = rl.check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8, row_local_sweeps=False)
    assert c.get("row_local_lm_head_in_call") == 1 and not c.get("row_local_lm_head"), c
    said = [e.what for e in session.events[n_events:] if e.kind == "rewritten"]
    assert any("logits kept whole: row_local_sweeps=False" in s for s in said), said


def test_the_split_rebuilds_the_whole_row_gradient_block_by_block():
    """Eagerly: the block graph on each vocabulary block, from the stats graph's per-row
    values, gives the stats graph's own gradient of those columns, and that is the body's
    vector-Jacobian product, up to one bf16 rounding (ATen computes a slice's last
    columns with a scalar ``exp``, the row's with a vectorised one, and the body's
    ``log_softmax`` backward with its own kernel)."""
    key = user_bodies.register(symbolic_trace(_kl_rows))
    x = rl.distinct_logits(T, V, torch.bfloat16, seed=1)
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    split = row_split.split_of(key, [0], [0], 0, [x, teacher], [])
    assert isinstance(split, row_split.Split) and split.values >= 2, split
    g = torch.randn(T)
    got = split.stats(x, teacher, g)
    want = user_bodies.vjp_function(_kl_rows, 2, (0,), (0,))(x, teacher, g)[0]
    torch.testing.assert_close(got[0], want, rtol=2**-7, atol=1e-7)  # (ATen's fused log_softmax backward)
    args = [x, teacher, g]
    for v0, v1 in [(0, 100), (100, 101), (101, V)]:
        picked = [args[i][..., v0:v1] if sliced else args[i] for i, sliced in split.inputs]
        torch.testing.assert_close(split.block(*picked, *got[1:]), want[:, v0:v1], rtol=2**-7, atol=1e-7)


def _soft_target_ce_rows(x, teacher):
    return (torch.nn.functional.cross_entropy(x.float(), teacher.float().softmax(-1), reduction="none"),)


def _ce_reading_sizes_as_numbers(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """ATen's ``cross_entropy_loss`` as torch 2.11 and 2.12 trace it: the input's sizes
    read as numbers (``int``: the trace makes the vocabulary a constant)."""
    rows, vocab = int(x.shape[0]), int(x.shape[1])
    return -(torch.log_softmax(x, 1) * target.expand(rows, vocab)).sum(1)


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")  # (the kernel replaced)
@pytest.mark.parametrize("sizes_as_numbers", [False, True], ids=["aten", "aten_reading_sizes_as_numbers"])
def test_a_soft_target_cross_entropy_splits_however_aten_reads_its_sizes(sizes_as_numbers):
    """A cross-entropy on a teacher's probabilities splits (NOTE [a soft-target
    cross-entropy traced with symbolic sizes]), also where ATen's composite reads the
    input's sizes as numbers (torch 2.11 and 2.12; here its kernel replaced by one that
    does, which keeps the logits whole without the NOTE's formula), and the split rebuilds
    the body's gradient block by block."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        if sizes_as_numbers:
            lib.impl("cross_entropy_loss", _ce_reading_sizes_as_numbers, "CompositeImplicitAutograd")
        key = user_bodies.register(symbolic_trace(_soft_target_ce_rows))
        x = rl.distinct_logits(T, V, torch.bfloat16, seed=1)
        teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
        # (``__wrapped__``: traced here, not the other case's split from the cache)
        split = row_split._traced_split.__wrapped__(key, (0,), (0,), 0, row_split._spec([x, teacher], 1), (),
                                                    False)
    finally:
        lib._destroy()
    assert isinstance(split, row_split.Split), split
    g = torch.randn(T, generator=torch.Generator().manual_seed(3))
    got = split.stats(x, teacher, g)
    want = user_bodies.vjp_function(_soft_target_ce_rows, 2, (0,), (0,))(x, teacher, g)[0]
    torch.testing.assert_close(got[0], want, rtol=2**-7, atol=1e-7)
    args = [x, teacher, g]
    for v0, v1 in [(0, 100), (100, 101), (101, V)]:
        picked = [args[i][..., v0:v1] if sliced else args[i] for i, sliced in split.inputs]
        torch.testing.assert_close(split.block(*picked, *got[1:]), want[:, v0:v1], rtol=2**-7, atol=1e-7)


def test_the_soft_target_formula_is_atens():
    """:func:`split.soft_target_cross_entropy` against ``F.cross_entropy`` in FP64, with and
    without label smoothing; any other call (class weights, a reduction, class indices) is
    left to ``F.cross_entropy`` (None)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 50, generator=g, dtype=torch.float64) * 3
    t = torch.randn(7, 50, generator=g, dtype=torch.float64).softmax(-1)
    F = torch.nn.functional
    for smoothing in (0.0, 0.1):
        want = F.cross_entropy(x, t, reduction="none", label_smoothing=smoothing)
        got = row_split.soft_target_cross_entropy(x, t, reduction="none", label_smoothing=smoothing)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    assert row_split.soft_target_cross_entropy(x, t) is None  # (the mean)
    assert row_split.soft_target_cross_entropy(x, t, weight=torch.ones(50), reduction="none") is None
    assert row_split.soft_target_cross_entropy(x, t.argmax(-1), reduction="none") is None


def _picked_rows(x, tok):
    """A token's log-prob beside a term of the whole row: a result that reads a gathered
    logit, which the gradient does not need (its gather stays in the results' part)."""
    lp = torch.log_softmax(x.float(), -1)
    return (lp.gather(-1, tok[:, None]).squeeze(-1) + 0.01 * (lp.exp() * lp).sum(-1),)


def _indexed_rows(x, tok):
    lp = torch.log_softmax(x.float(), -1)
    return (lp[torch.arange(lp.shape[0]), tok] + 0.01 * (lp.exp() * lp).sum(-1),)


def test_a_gathered_logit_is_read_before_the_gradient_overwrites_it():
    """NOTE [a body that writes over its logits]: the loss's row sweep (``stats_into``, the
    gradient written over the logits) reads a gathered logit as a sum with one term, so no
    gather of a logits row runs (every op seen, run eagerly); compiled by Inductor, its
    results are the out-of-place graph's, bitwise (torch 2.11's Inductor loaded the gather
    after the gradient's stores: token log-probs
    off by up to 7 nats here).  Another indirect
    read of the logits (an index) keeps the gradient beside them."""
    from fx_passes.kernels.ops import body_compiler
    from fx_passes.kernels.row_local.sweeps import compiled, stats_into

    r, vocab = 64, 1000
    x = rl.distinct_logits(r, vocab, torch.bfloat16, seed=1)
    tok = torch.randint(0, vocab, (r,), generator=torch.Generator().manual_seed(2))
    g = torch.randn(r, generator=torch.Generator().manual_seed(3))
    key = user_bodies.register(symbolic_trace(_picked_rows))
    split = row_split.split_of(key, [0], [0], 0, [x, tok], [], with_outputs=True)
    assert isinstance(split, row_split.Split), split
    gathered = []
    with compiling_with(EAGER), RowGathers(vocab, gathered):
        eager = stats_into(split, ("test_picked", key), 0)(x.clone(), tok, g)
    assert gathered == []
    inductor = lambda fn, options: body_compiler._inductor(fn, options)  # noqa: E731  (its own compiles)
    with compiling_with(inductor):
        want = compiled(split.stats, ("test_picked", key))(x.clone(), tok, g)
        got = stats_into(split, ("test_picked", key), 0)(x.clone(), tok, g)
    for a, b, c in zip(got, want, eager):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=2**-7, atol=1e-5)

    # (an index does not split, its gradient being an index_put: its graph traced here)
    from torch.fx.experimental.proxy_tensor import make_fx
    indexed = make_fx(user_bodies.vjp_function(_indexed_rows, 2, (0,), (0,), with_outputs=True))(x, tok, g)
    with compiling_with(EAGER):
        logits = x.clone()
        into = stats_into(types.SimpleNamespace(stats=indexed), ("test_indexed", id(indexed)), 0)
        got = into(logits, tok, g)
    assert torch.equal(logits, x) and got[0].data_ptr() != logits.data_ptr()
    torch.testing.assert_close(got, tuple(indexed(x, tok, g)), rtol=0, atol=0)


def test_the_stats_graph_writes_the_gradient_over_the_logits():
    """``sweeps.stats_into``, compiled by Inductor as the row sweeps compile it (WD's loop,
    plan ``"gpu"``, and the sweeps' row sweep): the logits' gradient lands in the logits'
    own buffer, bitwise the out-of-place graph's, with its other results the same.  The
    generated wrapper makes no model-precision ``[r, V]`` buffer (the gradient is not made
    beside the logits and copied over them): its one kernel takes the logits as its input
    and its output.  Its one ``[r, V]`` allocation is the FP32 temporary the kernel keeps
    between its passes over a row, which ``tiling.SWEEP_BYTES_PER_ELEMENT`` budgets."""
    import re

    from torch._inductor.utils import run_and_get_code

    from fx_passes.kernels.ops import body_compiler
    from fx_passes.kernels.row_local.sweeps import compiled, stats_into
    from fx_passes.testing.codegen import allocations
    key = user_bodies.register(symbolic_trace(_kl_rows))
    r = 96
    x = rl.distinct_logits(r, V, torch.bfloat16, seed=1)
    teacher = rl.distinct_logits(r, V, torch.bfloat16, seed=2)
    g = torch.randn(r, generator=torch.Generator().manual_seed(3))
    split = row_split.split_of(key, [0], [0], 0, [x, teacher], [])
    assert isinstance(split, row_split.Split), split
    inductor = lambda fn, options: body_compiler._inductor(fn, options)  # noqa: E731  (its own compiles)
    with compiling_with(inductor):
        want = compiled(split.stats, ("test_stats", key, id(split)))(x.clone(), teacher, g)
        into = stats_into(split, ("test_stats", key, id(split)), 0)
        storage = x.untyped_storage().data_ptr()
        got, codes = run_and_get_code(into, x, teacher, g)
    assert x.untyped_storage().data_ptr() == storage and got[0].untyped_storage().data_ptr() == storage
    assert torch.equal(x, want[0]) and len(got) == len(want)
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)
    [code] = codes
    # ((rows, vocabulary) allocations; the split is traced with symbolic sizes)
    wide = [(dims, dtype) for dims, dtype in allocations(code) if len(dims) == 2 and "1" not in dims]
    assert [dtype for _, dtype in wide] == ["torch.float32"], wide
    body = code[code.index("def call(self, args)"):]
    calls = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)(?:\.run)?\((.*)\)$", body, re.M)
    in_place = [(name, a) for name, args in calls for a in {p.strip() for p in args.split(",")}
                if a.startswith("arg") and [p.strip() for p in args.split(",")].count(a) == 2]
    assert len(calls) == 1 and len(in_place) == 1, calls


def test_the_traced_graphs_make_their_tensors_on_the_inputs_device():
    """The split is traced on the inputs' device (a GPU's at run time; meta here, the
    one other device a CPU has): the zeros of a gather's backward and every constant
    tensor of both graphs are made there, not on the host."""
    key = user_bodies.register(symbolic_trace(_topk_rows))
    x = torch.empty(T, V, dtype=torch.bfloat16, device="meta")
    tokens = torch.empty(T, dtype=torch.int64, device="meta")
    split = row_split.split_of(key, [0], [0], 0, [x, tokens], [])
    assert isinstance(split, row_split.Split), split
    made = [n.kwargs["device"] for gm in (split.stats, split.block) for n in gm.graph.nodes
            if n.op == "call_function" and "device" in n.kwargs]
    assert made and all(str(d) == "meta" for d in made), made


def test_a_sort_and_a_scatter_do_not_split_and_say_so():
    key = user_bodies.register(symbolic_trace(_topp_rows))
    x = rl.distinct_logits(T, V, torch.bfloat16, seed=1)
    why = row_split.split_of(key, [0], [0], 0, [x, rl.kept_tokens(x)], [])
    assert isinstance(why, str) and "is not pointwise" in why, why


def test_neither_the_logits_nor_their_gradient_exist_whole():
    """Deterministic memory: the call's forward and backward (their ops run eagerly under
    a dispatch mode) allocate no float tensor of ``T x V`` elements, where the call that
    keeps the logits allocates them; every GEMM's inputs are bf16; the gradients agree
    with that call's (accuracy against FP64: the tests above)."""
    hidden, weight = _head()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    key = user_bodies.register(symbolic_trace(_kl_rows))
    budget = 8 * V * 16  # 16 rows a chunk, 16 * V / T columns a block
    grads = [torch.randn(T)]
    with compiling_with(EAGER):
        with _Wide() as chunked:
            (kl,) = _row_local_sweeps._init_fn(key, [teacher], [], budget, 0, hidden, weight, None, "matmul")
            gh, gw = row_local_sweeps_backward._init_fn(key, [], [0], [teacher], [], grads, budget, 0,
                                                         hidden,
                                                         weight, None, "matmul", [True, True, False])
        with _Wide() as whole:
            kl_w, x, flag = _row_local_head._init_fn(key, [teacher], [], budget, 0, hidden, weight, None,
                                                     "matmul", False)
            gh_w, gw_w = _row_local_head_backward._init_fn(key, [], [0], [teacher], [], [], grads, budget, 0,
                                                           hidden, weight, None, "matmul", False, x, flag,
                                                           [True, True, False])
    assert chunked.shapes == [] and whole.shapes, (chunked.shapes, whole.shapes)
    assert chunked.gemm_inputs == {torch.bfloat16}, chunked.gemm_inputs
    torch.testing.assert_close(kl, kl_w, rtol=1e-4, atol=1e-6)
    for got, want in ((gh, gh_w), (gw, gw_w)):  # (each element a sum of bf16 gradients whose
        # roundings may differ by one between the two forms: a few bf16 units of the largest)
        assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max()


def test_a_body_that_does_not_split_at_run_time_recomputes_the_logits(caplog):
    """The rewrite calls ``row_local_sweeps`` only for a body that splits; called for one
    that does not, its backward computes the logits whole and takes the call's backward
    that keeps them: the same gradients, said in the log."""
    hidden, weight = _head()
    tokens = rl.kept_tokens(hidden @ weight.T)
    key = user_bodies.register(symbolic_trace(_topp_rows))
    budget = 8 * V * 16
    grads = [torch.randn(T)]
    got = row_local_sweeps_backward._init_fn(key, [], [0], [tokens], [], grads, budget, 0, hidden, weight,
                                              None, "matmul", [True, True, False])
    _, x, flag = _row_local_head._init_fn(key, [tokens], [], budget, 0, hidden, weight, None, "matmul", False)
    want = _row_local_head_backward._init_fn(key, [], [0], [tokens], [], [], grads, budget, 0, hidden, weight,
                                             None, "matmul", False, x, flag, [True, True, False])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "did not split at run time" in caplog.text


def test_a_retained_graphs_second_backward_equals_the_first():
    fn, inputs, _ = _case("forward_kl")
    h, w, teacher = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_(), inputs[2]
    torch._dynamo.reset()
    # A fresh compile: a backward served warm from AOTAutograd's cache (these graphs are
    # cacheable) is loaded with donated buffers, which torch refuses under retain_graph.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        loss = torch.compile(fn, backend="chunked_logits")(h, w, teacher)
        assert chunked_counters().get("row_local_lm_head") == 1
        assert_retained_backward_repeats(loss, h, w)


def test_the_backward_finds_the_split_the_rewrite_traced():
    """The rewrite traces the split for the floating-point results, the backward looks it
    up with their indices: the same split, traced once (no trace during the backward)."""
    fn, inputs, grad_pos = _case("forward_kl")
    torch._dynamo.reset()
    row_split._traced_split.cache_clear()
    h, w, teacher = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_(), inputs[2]
    loss = torch.compile(fn, backend="chunked_logits", options=BACKWARD_SWEEPS)(h, w, teacher)
    assert chunked_counters().get("row_local_lm_head") == 1
    traced = row_split._traced_split.cache_info()
    loss.backward()
    after = row_split._traced_split.cache_info()
    assert traced.misses >= 1 and after.misses == traced.misses and after.hits > traced.hits, (traced, after)


@pytest.mark.parametrize("name", ["forward_kl", "kl_div_linear"])
def test_five_gemms_with_model_precision_inputs(name):
    """GEMM audit, recorded by the profiler: the forward's row chunks (one GEMM's worth),
    the row sweep's recompute and ``g @ W``, the vocabulary sweep's recompute and
    ``g.T @ h``: five ``[T, H] x [H, V]`` GEMMs (their input dtypes:
    test_neither_the_logits_nor_their_gradient_exist_whole)."""
    from torch.profiler import profile

    from tests.numerics import run

    fn, inputs, grad_pos = _case(name)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", options=BACKWARD_SWEEPS)
    run(compiled, inputs, grad_pos)
    with profile(record_shapes=True) as prof:
        run(compiled, inputs, grad_pos)
    assert chunked_counters().get("row_local_lm_head") == 1
    gemms = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
    shapes = [e.input_shapes[1:3] if e.name == "aten::addmm" else e.input_shapes[:2] for e in gemms]
    flops = sum(2 * a[0] * a[1] * b[1] for a, b in shapes)
    assert len(shapes) == 5 and flops == 5 * 2 * T * H * V, shapes


def test_one_dynamic_graph_serves_every_row_count():
    """The split does not depend on the rows' count (traced with symbolic sizes, cached
    by the inputs' other sizes): a ``dynamic=True`` graph compiled at one T runs another
    without recompiling, each as accurate as stock."""
    from tests.numerics import assert_no_less_accurate, reference, run

    fn, (hidden, weight, teacher), grad_pos = _case("reverse_kl")
    cases = [(hidden[:rows], weight, teacher[:rows]) for rows in (T, T // 2 + 3)]
    torch._dynamo.reset()
    stock = [run(torch.compile(fn, backend="inductor", dynamic=True), c, grad_pos) for c in cases]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=True)
    for inputs, theirs in zip(cases, stock):
        ours = run(compiled, inputs, grad_pos)
        assert_no_less_accurate(ours, theirs, reference(fn, inputs, grad_pos), torch.bfloat16, 2e-6, 2**-8)
    assert chunked_counters().get("row_local_lm_head") == 1  # (one compile for both)


def test_scoring_runs_the_lm_head_in_chunks_for_any_body():
    """Without a gradient there is no backward to split: a top-p log-prob of
    ``hidden @ weight.T`` (a sort) runs its matmul chunk by chunk too, and no buffer of
    ``T x V`` elements is in the generated code (with ``row_local_sweeps=False`` the
    matmul's bf16 logits are)."""
    from tests.codegen import allocations, compiled_codes

    hidden, weight = _head()
    tokens = rl.kept_tokens(hidden @ weight.T)

    def score(h, w, t, up=F32):
        return rl.topk_topp_logprob(h @ w.T, t, up)
    c = rl.check(score, (hidden, weight, tokens), (), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head") == 1, c
    wide = {}
    for options in ({}, {"row_local_sweeps": False}):
        torch._dynamo.reset()
        _, codes = compiled_codes(torch.compile(score, backend="chunked_logits", options=options),
                                  hidden, weight, tokens)
        sized = [a for code in codes for a in allocations(code) if all(d.isdigit() for d in a[0])]
        wide[bool(options)] = [a for a in sized if torch.Size(map(int, a[0])).numel() >= T * V]
    assert wide[False] == [] and wide[True], wide


def test_scoring_under_no_grad_inside_a_training_step():
    """Reference top-p log-probs under ``no_grad`` through the trained weight (which
    requires grad) next to a distillation loss on it: the no-grad region runs its matmul
    chunk by chunk without a gradient (its results detached, as eager's), the loss's
    region takes its own chunked call, and both match stock."""
    hidden, weight = _head()
    tokens = rl.kept_tokens(hidden @ weight.T)
    ref_hidden, _ = _head(seed=9)
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)

    def step(h, w, rh, teacher, t, up=F32):
        with torch.no_grad():
            ref = rl.topk_topp_logprob(rh @ w.T, t, up)
        return rl.reverse_kl(h @ w.T, teacher, up) + (ref * 0.1).mean(), ref
    c = rl.check(step, (hidden, weight, ref_hidden, teacher, tokens), (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head") == 2, c
    out = torch.compile(step, backend="chunked_logits")(hidden, weight.clone().requires_grad_(), ref_hidden,
                                                        teacher, tokens)
    assert out[0].requires_grad and not out[1].requires_grad
