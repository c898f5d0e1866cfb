"""Shared by the rows-that-count tests (issue 36): the inputs of a masked lm_head step, its
poisoned variants and the NaN / inf pattern of its results; a step's run, its FP64
reference, ours compiled with a small budget, and stock compiled once for every share of
masked rows (:class:`StockOnce`)."""

import torch
from torch._dynamo.utils import counters

from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.numerics import TOLERANCES

T, H, V = 96, 64, 1024
BF16, FP16 = TOLERANCES[0].values[1:], TOLERANCES[1].values[1:]  # (out_rtol, grad_rtol)
EAGER = lambda fn, options: fn  # noqa: E731 - chunk bodies run eagerly (faster to compile)


def _inputs(dtype, masked=0.5, t=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    tok = torch.randint(0, V, (t,), generator=g)
    adv = torch.randn(t, generator=g)
    mask = (torch.arange(t) % 32 >= round(32 * masked)).float()  # the first share of each 32 rows out
    return [h, w, tok, adv, mask]


def _pattern(out):
    return [(int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum()))
            for t in (*out[0], *out[1])]


def _poisoned(kind):
    h, w, tok, adv, mask = _inputs(torch.bfloat16, 0.5)
    if kind == "h+inf, a masked row":
        h[1, 5] = float("inf")
    elif kind == "h nan, a kept row":
        h[20, 0] = float("nan")
    elif kind == "w+inf":
        w[9, 4] = float("inf")
    elif kind == "adv+inf, a masked row":
        adv[2] = float("inf")
    elif kind == "adv nan, a masked row":
        adv[3] = float("nan")
    elif kind == "adv -200, a masked row":  # (ppo_clip's ratio overflows there)
        adv[4] = -200.0
    elif kind == "every row masked":
        mask.zero_()
    elif kind == "no row masked":
        mask.fill_(1)
    return [h, w, tok, adv, mask]


KINDS = ["h+inf, a masked row", "h nan, a kept row", "w+inf", "adv+inf, a masked row",
         "adv nan, a masked row", "adv -200, a masked row", "every row masked", "no row masked"]


def every_row_said() -> list[str]:
    """What the rewrites recorded since ``session.reset()`` say about a masked loss that
    runs every row (NOTE [why every row runs]): the text after "though ...: "."""
    from fx_passes.reporting.session import session
    return [e.what.split("though ", 1)[1] for e in session.events if "though " in e.what]


def run(fn, xs, scale=1.0):
    """``fn``'s loss and the gradients of its first two inputs (``scale``: the incoming gradient)."""
    leaves = [x.detach().clone().requires_grad_(i < 2) for i, x in enumerate(xs)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves[:2], grad_outputs=torch.tensor(scale, dtype=out.dtype))
    return [out.detach()], list(grads)


def reference(fn, xs, scale=1.0):
    return run(lambda *a: fn(*a, up=torch.float64), [x.double() if x.is_floating_point() else x for x in xs],
               scale)


def compile_ours(fn, plan="two_sweeps", dynamic=False, **options):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend="chunked_logits", dynamic=dynamic,
                         options={"lm_head_plan": plan, "chunk_budget_mib": 0.125, **options})


def run_ours(compiled, xs, scale=1.0):
    """A run of ``compiled`` (its first compiles it), with its counters."""
    with cpu_out_dtype_kernels(), compiling_with(EAGER):
        return run(compiled, xs, scale), dict(counters["chunked_logits"])


def ours(fn, xs, plan="two_sweeps", dynamic=False, scale=1.0, **options):
    return run_ours(compile_ours(fn, plan, dynamic, **options), xs, scale)


class StockOnce:
    """(FP64 reference, stock's run) on ``inputs_of(dtype, share)``: stock compiled once per
    (fn, dtype, dynamic, scale) and run on every share of masked rows in ``shares`` (values
    only: one program runs them all), for every plan and test of a module."""

    def __init__(self, inputs_of, shares):
        self.inputs_of, self.shares, self.runs = inputs_of, shares, {}

    def __call__(self, fn, dtype, masked, dynamic=False, scale=1.0):
        key = (fn, dtype, dynamic, scale)
        if key not in self.runs:
            torch._dynamo.reset()
            stock = torch.compile(fn, backend="inductor", dynamic=dynamic)
            self.runs[key] = {m: (reference(fn, xs, scale), run(stock, xs, scale))
                              for m in self.shares for xs in [self.inputs_of(dtype, m)]}
        return self.runs[key][masked]
