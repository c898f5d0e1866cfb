"""Programs for the op-rule suite (tests/test_op_rules.py, issue 32): each puts one op of
the table (``fx_passes/fx/op_rules.py``), with one value of a keyword argument that
changes its meaning, into a loss tail (the lm_head loss path) or into a row-local body
(the row-local loss and the vocabulary-block sweeps).

A program is ``fn(h, w, tok, adv, sign, teacher, class_w, old, up)``: ``up`` is the dtype the
logits are upcast to (FP32 for eager and ours, FP64 for the reference); ``low`` below is
the model dtype a tail rounds to (bf16 or fp16, or FP64 in the reference: stock Inductor
keeps a fused kernel's values in FP32, its roundings to 16 bits skipped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

T, H, V = 48, 16, 256
F32, BF16 = torch.float32, torch.bfloat16

# Budgets (bytes) that make 1, 3 and 8 row chunks of T rows (and 1, 4, 8 vocabulary blocks
# in the row-local sweeps): the row-local paths take ``budget // (8 V)`` rows a chunk and
# ``budget // (8 T)`` columns a block; the lm_head loss path ``budget // (4 V)`` rows, but
# at least 4 chunks (``tiling.forward_rows``: never more than a quarter of the logits), so
# 4, 6 and 8 chunks there.
LM_HEAD_BUDGETS = {4: 4 * V * (T // 4), 6: 4 * V * (T // 6), 8: 4 * V * (T // 8)}
ROW_LOCAL_BUDGETS = {1: 8 * V * T, 3: 8 * V * (T // 3), 8: 8 * V * (T // 8)}


def inputs() -> dict[str, torch.Tensor]:
    """The second half of the rows repeats the first, rolled by 5 rows (``sign`` is +1 on
    the first, -1 on the second): a tail's sum of ``lp * sign`` is 0 exactly, its partial
    sums over the row chunks are not, so rounding them shows."""
    g = torch.Generator().manual_seed(32)
    half = torch.randn(T // 2, H, generator=g).to(BF16)
    tok = torch.randint(0, V, (T // 2,), generator=g)
    out = {
        "h": torch.cat([half, half.roll(5, 0)]),
        "w": (torch.randn(V, H, generator=g) * 2 / H**0.5).to(BF16),
        "tok": torch.cat([tok, tok.roll(5, 0)]),
        "adv": torch.randn(T, generator=g),
        "sign": torch.cat([torch.ones(T // 2), -torch.ones(T - T // 2)]),
        "teacher": torch.randn(T, V, generator=g),
        "class_w": torch.rand(V, generator=g) + 0.5,
    }
    # old log-probs (a reference policy's): the token log-probs within 0.02, so that
    # ``lp - old`` is small and a 16-bit rounding of either shows in its sum
    lp = _lp(out["h"].double(), out["w"].double(), out["tok"], torch.float64)
    out["old"] = (lp + 0.02 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    return out


def _low(up: torch.dtype, low: torch.dtype = BF16) -> torch.dtype:
    return low if up == F32 else up


def _lp(h, w, tok, up):
    return torch.log_softmax((h @ w.T).to(up), -1).gather(-1, tok[:, None]).squeeze(-1)


# ---- loss tails: the lm_head's token log-probs reduced to the loss -------------------------------------

def _tail(fn):
    """A tail on the token log-probs ``lp`` (one lm_head region: ``lp`` computed once)."""
    return lambda h, w, tok, adv, sign, up: fn(_lp(h, w, tok, up), adv.to(up), sign.to(up), up)


TAILS = {
    "div": _tail(lambda lp, adv, sign, up: torch.div(-(lp * adv).sum(), 3.0)),
    "div_floor": _tail(lambda lp, adv, sign, up: torch.div(-(lp * adv).sum(), 3.0, rounding_mode="floor")),
    "div_trunc": _tail(lambda lp, adv, sign, up: torch.div(-(lp * adv).sum(), 3.0, rounding_mode="trunc")),
    "mul_neg": _tail(lambda lp, adv, sign, up: -((lp * adv).sum() * 0.5)),
    "add_alpha": _tail(lambda lp, adv, sign, up: torch.add(-(lp * adv).sum(), lp.mean(), alpha=0.25)),
    "sub_alpha": _tail(lambda lp, adv, sign, up: torch.sub(lp.mean(), (lp * adv).sum(), alpha=2.0)),
    "mean": _tail(lambda lp, adv, sign, up: -(lp * adv).mean()),
    "sum_dtype": _tail(lambda lp, adv, sign, up: -(lp * adv).sum(dtype=torch.float64).to(up)),
    # a sum in the model dtype whose partial sums over the row chunks are large and cancel
    "sum_low": _tail(lambda lp, adv, sign, up: -(lp.to(_low(up)) * sign.to(_low(up))).sum()),
    "mean_low": _tail(lambda lp, adv, sign, up: -(lp.to(_low(up)) * sign.to(_low(up))).mean()),
    "rsub_pos": _tail(lambda lp, adv, sign, up: +(1.0 - (lp * adv).sum())),
    "rsub_alpha": _tail(lambda lp, adv, sign, up: torch.rsub((lp * adv).sum(), 1.0, alpha=0.5)),
    "mean_dtype": _tail(lambda lp, adv, sign, up: -(lp * adv).mean(dtype=torch.float64).float()),
    "conversions": _tail(lambda lp, adv, sign, up: (lp * adv).sum().double().float().type_as(sign.sum())),
    "half": _tail(lambda lp, adv, sign, up: (lp * adv).mean().half()),
    "bfloat16": _tail(lambda lp, adv, sign, up: (lp * adv).mean().bfloat16()),
    "row_div_floor": _tail(lambda lp, adv, sign, up: (torch.div(lp * 4, 1.5, rounding_mode="floor")
                                                      + lp * adv).sum()),
    "row_clamp": _tail(lambda lp, adv, sign, up: (lp.clamp(min=-6.0) * adv).mean()),
}


# ---- row-local bodies on the lm_head's logits (one value a row, reduced to the loss) -------------------

def _z(h, w, up):
    return (h @ w.T).to(up)


def _body(fn):
    """A body on the logits ``z`` (one lm_head matmul: ``z`` computed once)."""
    return lambda h, w, tok, teacher, class_w, up: fn(_z(h, w, up), tok, teacher.to(up), class_w.to(up))


BODIES = {
    "ce": _body(lambda z, tok, t, cw: F.cross_entropy(z, tok, reduction="none")),
    "ce_smoothing": _body(lambda z, tok, t, cw: F.cross_entropy(z, tok, label_smoothing=0.1,
                                                                reduction="none")),
    "ce_probs": _body(lambda z, tok, t, cw: F.cross_entropy(z, t.softmax(-1), reduction="none")),
    "ce_probs_smoothing": _body(lambda z, tok, t, cw: F.cross_entropy(z, t.softmax(-1), label_smoothing=0.2,
                                                                      reduction="none")),
    "ce_weight_smoothing": _body(lambda z, tok, t, cw: F.cross_entropy(z, tok, weight=cw, label_smoothing=0.1,
                                                                       reduction="none")),
    "z_mean": _body(lambda z, tok, t, cw: torch.logsumexp(z, -1) - z.mean(-1)),
    "z_mean_keepdim": _body(lambda z, tok, t, cw: torch.logsumexp(z - z.mean(-1, keepdim=True), -1)),
    "z_var": _body(lambda z, tok, t, cw: torch.logsumexp(z, -1) + 0.1 * z.var(-1)),
    "z_var_biased": _body(lambda z, tok, t, cw: torch.logsumexp(z, -1) + 0.1 * z.var(-1, correction=0)),
    "kl": _body(lambda z, tok, t, cw: F.kl_div(z.log_softmax(-1), t.log_softmax(-1), log_target=True,
                                               reduction="none").sum(-1)),
}


# ---- loss tails that round per-row values to 16 bits (issue 55) ---------------------------------------
# Stock Inductor runs a tail in one fused kernel: the per-row values stay in FP32 (its
# 16-bit casts skipped), the sum is rounded once.  Rounding each row's value (or an
# operand the graph computes) to 16 bits first is a different, less accurate answer.

F16 = torch.float16


def _low_tail(fn):
    """A tail on the token log-probs ``lp`` and the old log-probs ``old`` (FP32)."""
    return lambda h, w, tok, adv, old, up: fn(_lp(h, w, tok, up), adv.to(up), old.to(up), up)


LOW_TAILS = {
    # (the spelling: per-token values in bf16 times an FP32 weight, summed in FP32)
    "lp_bfloat16": _low_tail(lambda lp, adv, old, up: -(lp.to(_low(up)) * adv).sum()),
    "kl_bf16_sum": _low_tail(lambda lp, adv, old, up: (lp.to(_low(up)) - old.to(_low(up))).sum()),
    "kl_bf16_mean": _low_tail(lambda lp, adv, old, up: (lp.to(_low(up)) - old.to(_low(up))).mean()),
    "kl_fp16_to": _low_tail(lambda lp, adv, old, up: (lp.to(_low(up, F16)) - old.to(_low(up, F16))).float()
                            .sum()),
    # (a bf16 weight the graph computes: stock fuses its cast into the tail's kernel too)
    "weight_bf16_mean": _low_tail(lambda lp, adv, old, up: -(lp * adv.to(_low(up))).mean()),
    # taken: one rounding of the whole sum (its dtype), and an exact conversion of a mask
    "sum_dtype_bf16": _low_tail(lambda lp, adv, old, up: -(lp * adv).sum(dtype=_low(up))),
    "mask_bf16": _low_tail(lambda lp, adv, old, up: -(lp * adv * (old < -5.5).to(_low(up))).sum()),
}


def tail_program(name: str):
    if name in LOW_TAILS:
        low = LOW_TAILS[name]

        def fn(h, w, tok, adv, sign, teacher, class_w, old, up=F32):
            return low(h, w, tok, adv, old, up)
    else:
        body = TAILS[name]

        def fn(h, w, tok, adv, sign, teacher, class_w, old, up=F32):
            return body(h, w, tok, adv, sign, up)
    fn.__name__ = f"tail_{name}"
    return fn


def body_program(name: str):
    body = BODIES[name]

    def fn(h, w, tok, adv, sign, teacher, class_w, old, up=F32):
        return (body(h, w, tok, teacher, class_w, up) * adv.to(up)).mean()
    fn.__name__ = f"body_{name}"
    return fn
