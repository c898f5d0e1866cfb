"""One program per entry of ``fx_passes.fx.op_rules.ZERO_ROWS`` (the rows a loss leaves
out): the op on the path from a per-row log-prob to the mask (or the mask itself).  Read
by the lm_head path's generator (``tests/test_rows_that_count.py``, compiled) and the
row-local rules' (``tests/test_body_mask.py``, no compile)."""

import torch


def _where(x, m):
    return torch.where(m, x, 0.0)


ENTRIES = {
    "convert": lambda lp, adv, m, mf: _where(lp.to(torch.float64), m).float(),
    "float": lambda lp, adv, m, mf: _where(lp.double().float() * adv, m),
    "double": lambda lp, adv, m, mf: _where(lp.double() * adv, m).float(),
    "half": lambda lp, adv, m, mf: _where(lp.half() * adv.half(), m).float(),
    "bfloat16": lambda lp, adv, m, mf: _where(lp.bfloat16() * adv, m),
    "to": lambda lp, adv, m, mf: _where(lp.to(torch.float64) * adv, m).to(torch.float32),
    "type": lambda lp, adv, m, mf: _where(lp.type(torch.float64) * adv, m).float(),
    "type_as": lambda lp, adv, m, mf: _where(lp.double().type_as(adv) * adv, m),
    "detach": lambda lp, adv, m, mf: _where(lp * adv + 0.1 * lp.detach(), m),
    "clone": lambda lp, adv, m, mf: _where(lp.clone() * adv, m),
    "contiguous": lambda lp, adv, m, mf: _where(lp.contiguous() * adv, m),
    "positive": lambda lp, adv, m, mf: _where(+lp * adv, m),
    "view": lambda lp, adv, m, mf: _where((lp * adv).view(-1), m),
    "reshape": lambda lp, adv, m, mf: _where((lp * adv).reshape(-1), m),
    "flatten": lambda lp, adv, m, mf: _where((lp * adv).flatten(), m),
    "unsqueeze": lambda lp, adv, m, mf: _where((lp * adv).unsqueeze(-1), m.unsqueeze(-1)).squeeze(-1),
    "squeeze": lambda lp, adv, m, mf: _where((lp * adv).unsqueeze(0).squeeze(0), m),
    "neg": lambda lp, adv, m, mf: _where(-lp * adv, m),
    "add": lambda lp, adv, m, mf: _where(lp * adv + adv, m),
    "sub": lambda lp, adv, m, mf: _where(adv - lp * adv, m),
    "rsub": lambda lp, adv, m, mf: _where(torch.rsub(lp * adv, 1.0), m),
    "mul": lambda lp, adv, m, mf: lp * adv * mf,
    "div": lambda lp, adv, m, mf: _where(lp / (adv.abs() + 0.5), m),
    "where": lambda lp, adv, m, mf: _where(lp * adv, m),
    "masked_fill": lambda lp, adv, m, mf: (lp * adv).masked_fill(~m, 0.0),
    "exp": lambda lp, adv, m, mf: _where(torch.exp(lp + 5.0) * adv, m),
    "log": lambda lp, adv, m, mf: _where(torch.log(lp.exp() + 1.0) * adv, m),
    "pow": lambda lp, adv, m, mf: _where((lp * 0.5).pow(3) * adv + lp ** 2, m),
    "square": lambda lp, adv, m, mf: _where(torch.square(lp) * adv, m),
    "clamp": lambda lp, adv, m, mf: _where(torch.clamp(lp, -3.0, 0.0) * adv, m),
    "clip": lambda lp, adv, m, mf: _where(lp.clip(min=-3.0) * adv, m),
    "clamp_min": lambda lp, adv, m, mf: _where(lp.clamp_min(-3.0) * adv, m),
    "clamp_max": lambda lp, adv, m, mf: _where(lp.clamp_max(-5.0) * adv, m),
    "min": lambda lp, adv, m, mf: _where(torch.min(lp * adv, lp.clamp(-3.0, 0.0) * adv), m),
    "max": lambda lp, adv, m, mf: _where(torch.max(lp * adv, lp.clamp(-3.0, 0.0) * adv), m),
    "minimum": lambda lp, adv, m, mf: torch.minimum(lp * adv, lp * 0.5) * mf,
    "maximum": lambda lp, adv, m, mf: torch.maximum(lp * adv, lp * 0.5) * mf,
    # (a comparison: 0 or 1 added to the log-prob, so the product is finite only by its rule;
    # ATen's long names are op_name's short ones)
    "gt": lambda lp, adv, m, mf: (torch.greater(lp, -3.0).float() + lp) * adv * mf,
    "lt": lambda lp, adv, m, mf: ((lp < adv).float() + lp) * adv * mf,
    "ge": lambda lp, adv, m, mf: (torch.greater_equal(lp, -3.0).float() + lp) * adv * mf,
    "le": lambda lp, adv, m, mf: (torch.less_equal(lp, lp * 0.5).float() + lp) * adv * mf,
    "eq": lambda lp, adv, m, mf: ((lp == -3.0).float() + lp) * adv * mf,
    "ne": lambda lp, adv, m, mf: (torch.not_equal(lp, adv).float() + lp) * adv * mf,
}
