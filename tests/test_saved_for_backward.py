"""A row-local region's backward reads what its forward saved (issue 21: WP's and WD's
step time): the masks of its sorts, bit-packed (no sort / top-k / cumsum run again in the
backward; the same results and gradients as recomputing them), and its softmaxes'
row statistics (no max / sum over the rows again); as accurate as stock against FP64."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.kernels.ops.registry import REPLAYING_BODIES
from fx_passes.kernels.row_local.bitmask import pack_bits, unpack_bits
from fx_passes.kernels.row_local.engine import row_local
from fx_passes.kernels.row_local.normalizers import (
    log_softmax_given,
    log_softmax_stats,
    softmax_given,
    softmax_stats,
)
from tests import row_local_cases as rl
from tests.helpers import chunked_counters, rewrite_graphs
from tests.numerics import run

T, V, _check, _inputs = rl.T, rl.V, rl.check, rl.inputs

EAGER = lambda fn, options: fn  # noqa: E731
SAVING = ["topk", "topk_topp", "topp_policy"]


@pytest.mark.sampled
@pytest.mark.parametrize("shape", [(5, 13), (4, 3, 17), (6, 64), (0, 9), (3, 1)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_pack_round_trip(shape, compiled):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.4
    pack = torch.compile(pack_bits, dynamic=True) if compiled else pack_bits
    packed = pack(mask)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (shape[0], -(-mask.shape[1:].numel() // 8))
    assert torch.equal(unpack_bits(packed, mask), mask)
    assert packed.sum() > 0 or not mask.any()  # (the bits are there, not all zero)


def test_bit_order():
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[0, [0, 3, 9]] = True
    assert pack_bits(mask).tolist() == [[0b1001, 0b10]]


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name", SAVING)
def test_saved_masks_match_recompute_and_stock(name):
    """Saving is taken (counter), the results and every gradient are bit for bit those
    of recomputing the masks, and both are as accurate as stock against FP64."""
    fn, inputs, grad_pos = _inputs(name, torch.bfloat16)
    c = _check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_saved_masks") == 1, c
    masks_only = torch.compile(fn, backend="chunked_logits", options={"save_normalizers": False})
    saved = run(masks_only, inputs, grad_pos)
    torch._dynamo.reset()
    counters.clear()
    recompute = torch.compile(fn, backend="chunked_logits", options={"save_masks": False,
                                                                      "save_normalizers": False})
    recomputed = run(recompute, inputs, grad_pos)
    assert "row_local_saved_masks" not in chunked_counters()
    for a, b in zip(saved[0] + saved[1], recomputed[0] + recomputed[1]):
        assert torch.equal(a, b)


# (make test-full; make test: the static masks above, dynamic shapes in the other row-local modules)
@pytest.mark.full
def test_dynamic_shapes():
    fn, inputs, grad_pos = _inputs("topk_topp", torch.bfloat16)
    c = _check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8, dynamic=True)
    assert c.get("row_local_saved_masks", 0) >= 1, c


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def _ops_of_bodies(fn, *args, **options) -> dict[str, _Ops]:
    """The ops the forward and the backward chunk bodies ran in one step of ``fn``
    (bodies run eagerly, each under a dispatch mode that sees its ops)."""
    seen = {"forward": _Ops(), "backward": _Ops()}

    def watched(body, _options):
        ops = seen["backward" if body.__name__.startswith("body_backward") else "forward"]

        def call(*a):
            with ops:
                return body(*a)
        return call
    torch._dynamo.reset()
    with compiling_with(watched):
        # (the engine's bodies, also on a region stock would be left: tests/test_worth.py)
        torch.compile(fn, backend="chunked_logits", options={"leave_to_stock": False, **options})(
            *args).sum().backward()
    return seen


@pytest.mark.parametrize("save", [True, False])
def test_backward_does_not_sort_again(save):
    """With the masks saved the backward bodies run none of the ops that made them (the
    bodies run eagerly, each under a dispatch mode that sees its ops); recomputing runs
    them all again."""
    fn, inputs, _ = _inputs("topk_topp", torch.bfloat16)
    x = inputs[0].detach().clone().requires_grad_()
    seen = _ops_of_bodies(fn, x, *inputs[1:], save_masks=save)
    assert x.grad is not None
    assert {"sort", "topk", "cumsum"} <= seen["forward"].names
    backward = seen["backward"].names
    assert "_log_softmax_backward_data" in backward or "exp" in backward, backward  # (it ran)
    deciding = {"sort", "topk", "cumsum"}
    assert (backward & deciding == set()) if save else deciding <= backward


def _saved(fn, *args, **options) -> int:
    """How many tensors the region's forward saves (masks only, unless ``options``)."""
    _, after = rewrite_graphs(fn, *args, **{"save_normalizers": False, **options})
    calls = [n for n in after.graph.nodes if n.target is row_local]
    assert len(calls) == 1
    saving = calls[0].kwargs.get("saving")
    return REPLAYING_BODIES[saving][1] if saving else 0  # (masks + 2 per saved softmax)


def _topk_then_topp_reading_between(logits, tokens):
    z = logits.float() / rl.TEMPERATURE
    z1 = z.masked_fill(z < z.topk(50, dim=-1).values[..., -1, None], rl.NEG_INF)
    sorted_p, order = z1.softmax(-1).sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) > 0.9
    z2 = z1.masked_fill(drop.scatter(-1, order, drop), rl.NEG_INF)
    logp = torch.log_softmax(z2, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return logp - 0.1 * z1.logsumexp(-1)  # the top-k-only values are read as well


def _pointwise_mask(logits, tokens):
    z = logits.float()
    return torch.log_softmax(z.masked_fill(z < -1.0, rl.NEG_INF), -1).gather(-1, tokens[:, None]).squeeze(-1)


def test_what_is_saved():
    """Top-k then top-p: one mask (their union: the chain fills twice); read in between,
    two; a mask of pointwise ops and reductions alone: none (recomputing it is cheaper);
    no gradient: none."""
    x = rl.distinct_logits(T, V, torch.bfloat16)
    tokens = rl.kept_tokens(x)
    grad = x.detach().clone().requires_grad_()
    assert _saved(rl.topk_topp_logprob, grad, tokens) == 1
    assert _saved(rl.topk_logprob, grad, tokens) == 1
    assert _saved(_topk_then_topp_reading_between, grad, tokens) == 2
    assert _saved(_pointwise_mask, grad, tokens) == 0
    assert _saved(rl.minp_logprob, grad, tokens) == 0  # (a softmax and a max: cheaper to run again)
    assert _saved(rl.topk_topp_logprob, x, tokens) == 0
    # with the normalisers: top-k + top-p's final log_softmax (its softmax before the sort
    # feeds only the mask: not saved), two numbers a row
    assert _saved(rl.topk_topp_logprob, grad, tokens, save_normalizers=True) == 1 + 2


def test_unmerged_chain_matches_recompute():
    """Two masks saved apart (the top-k-only values are read too): the same results and
    gradients as recomputing them."""
    x = rl.distinct_logits(T, V, torch.bfloat16)
    inputs, fn = (x, rl.kept_tokens(x)), _topk_then_topp_reading_between
    torch._dynamo.reset()
    off = {"save_normalizers": False}
    saved = run(torch.compile(fn, backend="chunked_logits", options=off), inputs, (0,))
    torch._dynamo.reset()
    recompute = torch.compile(fn, backend="chunked_logits", options={**off, "save_masks": False})
    recomputed = run(recompute, inputs, (0,))
    for a, b in zip(saved[0] + saved[1], recomputed[0] + recomputed[1]):
        assert torch.equal(a, b)


def test_saved_bytes_are_a_sixteenth_of_the_bf16_gradient():
    """What the forward keeps for the backward besides the inputs: one uint8
    ``[T, V / 8]`` tensor for a top-k + top-p region (no FP32 or boolean ``[T, V]``)."""
    fn, inputs, _ = _inputs("topk_topp", torch.bfloat16)
    x = inputs[0].detach().clone().requires_grad_()
    kept = []

    def pack(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="chunked_logits")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x, *inputs[1:]).sum().backward()
    big = [k for k in kept if k[1] and k[1][0] == T and len(k[1]) == 2 and k[1][1] > 1]
    assert (torch.uint8, (T, V // 8)) in big, kept
    assert all(k == (torch.uint8, (T, V // 8)) or k[0] == torch.bfloat16 for k in big), kept


@pytest.mark.parametrize("name", ["topk_topp", "forward_kl"])
def test_backward_under_the_users_saved_tensor_hooks(name):
    """Forward and backward under ``save_on_cpu`` (activation offloading): the backward
    bodies set the user's hooks aside (``torch.func.vjp`` refuses to run under them) and
    give the gradients they give without them."""
    fn, inputs, grad_pos = _inputs(name, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="chunked_logits")
    plain = run(compiled, inputs, grad_pos)
    with torch.autograd.graph.save_on_cpu():
        hooked = run(compiled, inputs, grad_pos)
    for a, b in zip(plain[0] + plain[1], hooked[0] + hooked[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_from_saved_statistics_is_the_forward_and_its_gradient(dim):
    """The backward's values bit for bit those of the forward's decomposition, and the
    gradient autograd gives ``log_softmax`` / ``softmax`` (FP64, to rounding)."""
    z = torch.randn(5, 7, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    z[0, 0, :3] = float("-inf")
    g = torch.randn(5, 7, 11, dtype=torch.float64)
    for stats, given, ref in ((log_softmax_stats, log_softmax_given, torch.log_softmax),
                              (softmax_stats, softmax_given, torch.softmax)):
        out, a, b = stats(z, dim)
        assert torch.allclose(out, ref(z, dim), atol=1e-12, equal_nan=True)
        x = z.clone().requires_grad_()
        again = given(x, a, b, dim)
        assert torch.equal(again, out)
        (grad,) = torch.autograd.grad(again, x, g)
        y = z.clone().requires_grad_()
        (want,) = torch.autograd.grad(ref(y, dim), y, g)
        assert torch.allclose(grad, want, atol=1e-12)


@pytest.mark.sampled(5)
@pytest.mark.parametrize("name", ["forward_kl", "jsd", "topk_topp", "ce_label_smoothing",
                                  "ce_weight_smoothing"])
def test_saved_normalizers_as_accurate_as_stock(name):
    """(A cross-entropy of class indices is built in the body as torch computes it, a
    ``log_softmax`` and ``nll_loss`` and the smoothing term, so its softmax is saved too.)"""
    fn, inputs, grad_pos = _inputs(name, torch.bfloat16)
    c = _check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_saved_normalizers") == 1, c
    c = _check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8, save_normalizers=False)
    assert "row_local_saved_normalizers" not in c, c


@pytest.mark.parametrize("save", [True, False])
def test_backward_does_not_reduce_the_softmax_again(save):
    """Forward KL (student and teacher log_softmax): with the statistics saved the
    backward bodies run no max over the rows and no log_softmax; without, both."""
    fn, inputs, _ = _inputs("forward_kl", torch.bfloat16)
    x = inputs[0].detach().clone().requires_grad_()
    seen = _ops_of_bodies(fn, x, *inputs[1:], save_normalizers=save)
    assert x.grad is not None
    again = {"amax", "_log_softmax"} & seen["backward"].names
    assert not again if save else again, seen["backward"].names
