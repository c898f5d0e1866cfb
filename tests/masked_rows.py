"""Shared by the rows-that-count tests (issue 36): the inputs of a masked lm_head step, its
poisoned variants and the NaN / inf pattern of its results."""

import torch

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
