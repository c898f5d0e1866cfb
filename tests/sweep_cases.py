"""The chunked row-local lm_head call's losses and inputs (``T`` rows, ``V`` columns,
hidden size ``H``), each with its upcast dtype ``up`` as a parameter, shared by
tests/test_row_local_sweeps.py and tests/test_row_local_loss.py; and a dispatch mode
that records ``[T, V]`` float allocations and the GEMMs' input dtypes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests import row_local_cases as rl
from tests.numerics import F32

T, V, H = rl.T, rl.V, 32
EAGER = lambda fn, options: fn  # noqa: E731  (bodies run eagerly, so a dispatch mode sees their ops)


def head(dtype=torch.bfloat16, seed=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(dtype), (torch.randn(V, H, generator=g) / 4).to(dtype)


def forward_kl(hidden, weight, teacher, up=F32):
    return rl.forward_kl(hidden @ weight.T, teacher, up)


def reverse_kl(hidden, weight, teacher, up=F32):
    return rl.reverse_kl(hidden @ weight.T, teacher, up)


def jsd(hidden, weight, teacher, up=F32):
    return rl.jsd_rowwise(hidden @ weight.T, teacher, up=up)


def kl_div_probs(hidden, weight, teacher, up=F32):
    return rl.kl_div_probs(hidden @ weight.T, teacher, up)


def kl_div_linear(hidden, weight, bias, teacher, up=F32):
    """``F.linear`` with a bias on ``[B, S, H]`` states, both logits flattened after the
    upcast (Hugging Face style)."""
    s = F.linear(hidden, weight, bias).to(up).view(-1, V).log_softmax(-1)
    t = teacher.to(up).view(-1, V).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def per_token_kl(hidden, weight, teacher, tok_w, up=F32):
    """Per-token KL weighted by a mask (gradients of both results' rows differ)."""
    s = torch.log_softmax((hidden @ weight.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    return ((t.exp() * (t - s)).sum(-1) * tok_w.to(up)).sum() / tok_w.to(up).sum()


def smoothed_ce(hidden, weight, labels, class_w, up=F32):
    """Label smoothing, class weights and ignored rows: the picked logit's gradient is a
    scatter of one value a row, a ``where`` on the block's columns."""
    return F.cross_entropy((hidden @ weight.T).to(up), labels, weight=class_w.to(up), label_smoothing=0.1,
                           ignore_index=-100)


def z_loss_ce(hidden, weight, labels, class_w, up=F32):
    return rl.ce_smoothing_z_loss(hidden @ weight.T, labels, up)


def topk_policy(hidden, weight, tokens, adv, up=F32):
    """A top-k mask (its threshold is one value a row) and a gathered token log-prob."""
    return -(rl.topk_logprob(hidden @ weight.T, tokens, up) * adv).mean()


def topp_policy(hidden, weight, tokens, adv, up=F32):
    """A top-p mask (a sort, a scatter): its gradient needs whole rows."""
    return -(rl.topk_topp_logprob(hidden @ weight.T, tokens, up) * adv).mean()


SPLIT = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "kl_div_probs": kl_div_probs,
         "kl_div_linear": kl_div_linear, "per_token_kl": per_token_kl, "smoothed_ce": smoothed_ce,
         "z_loss_ce": z_loss_ce, "topk_policy": topk_policy}


def case(name: str, dtype=torch.bfloat16):
    hidden, weight = head(dtype)
    teacher = rl.distinct_logits(T, V, dtype, seed=2)
    g = torch.Generator().manual_seed(5)
    if name == "kl_div_linear":
        bias = (torch.randn(V, generator=g) / 4).to(dtype)
        return kl_div_linear, (hidden.view(4, T // 4, H), weight, bias, teacher.view(4, T // 4, V)), (0, 1, 2)
    if name in ("smoothed_ce", "z_loss_ce"):
        labels = rl.kept_tokens(hidden @ weight.T)
        labels[::7] = -100
        return SPLIT[name], (hidden, weight, labels, torch.rand(V, generator=g) + 0.5), (0, 1)
    if name == "topk_policy":
        tokens = rl.kept_tokens(hidden @ weight.T)
        return topk_policy, (hidden, weight, tokens, torch.randn(T, generator=g)), (0, 1)
    if name == "per_token_kl":
        return per_token_kl, (hidden, weight, teacher, (torch.rand(T, generator=g) > 0.3).float()), (0, 1)
    return SPLIT[name], (hidden, weight, teacher), (0, 1)


def kl_rows(x, teacher):
    s = torch.log_softmax(x.float(), -1)
    t = torch.log_softmax(teacher.float(), -1)
    return ((t.exp() * (t - s)).sum(-1),)


def topk_rows(x, tokens):
    return (rl.topk_logprob(x, tokens),)


def topp_rows(x, tokens):
    return (rl.topk_topp_logprob(x, tokens),)


class Wide(TorchDispatchMode):
    """Float tensors of at least ``T x V`` elements that ops allocate (no views), and the
    input dtypes of each GEMM."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self.gemm_inputs: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.gemm_inputs |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and not func.is_view
                    and t.device.type != "meta" and t.numel() >= T * V):
                self.shapes.append((str(func), tuple(t.shape)))
        return out
