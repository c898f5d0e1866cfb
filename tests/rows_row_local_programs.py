"""Masked row-local losses (issue 36, the row-local engine): distillation KLs,
cross-entropies (class-weighted, label-smoothed, with a z-loss, an ``nll_loss`` of
log-probs), each with its mask where users write it (in the body, in the tail, as
``ignore_index``, a class that weighs 0), and their inputs."""

import torch
import torch.nn.functional as F

from tests.numerics import F32

T, H, V = 96, 64, 1024


def _kl(h, w, teacher, up):
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    return (t.exp() * (t - s)).sum(-1)


def kd_masked_mean(h, w, teacher, labels, mask, up=F32):
    """verl / TRL's masked mean of a forward KL: ``(kl * mask).sum() / mask.sum()``."""
    return (_kl(h, w, teacher, up) * mask.to(up)).sum() / mask.to(up).sum()


def kd_column_mask(h, w, teacher, labels, mask, up=F32):
    """The mask as a column (``mask[:, None]``) on the vocabulary-wide terms, before the sum."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    return ((t.exp() * (t - s)) * mask.to(up)[:, None]).sum(-1).sum() / mask.to(up).sum()


def kd_where(h, w, teacher, labels, mask, up=F32):
    """A boolean mask selecting the rows' KL, over a clamped count."""
    return torch.where(mask > 0, _kl(h, w, teacher, up), 0.0).sum() / mask.sum().clamp(min=1)


def reverse_kl_temperature(h, w, teacher, labels, mask, up=F32):
    s = torch.log_softmax((h @ w.T).to(up) / 0.7, -1)
    t = torch.log_softmax(teacher.to(up) / 0.7, -1)
    kl = (s.exp() * (s - t)).sum(-1)
    return (kl * mask.to(up)).sum() / mask.to(up).sum()


def kd_and_logprob(h, w, teacher, labels, mask, up=F32):
    """A soft-label cross-entropy (the teacher's ``softmax``) plus the label's log-prob (a
    ``gather``), masked as a token mean."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    p = torch.softmax(teacher.to(up), -1)
    per_row = -(p * s).sum(-1) - 0.1 * s.gather(-1, labels[:, None]).squeeze(-1)
    return (per_row * mask.to(up)).sum() / mask.to(up).sum()


def ensemble_ce(h, w, teacher, labels, mask, up=F32):
    """Cross-entropy of the student and teacher logits' mean over the labels
    ``ignore_index`` keeps (``reduction='none'``, the mask its ``-100``)."""
    x = ((h @ w.T).to(up) + teacher.to(up)) / 2
    target = torch.where(mask > 0, labels, -100)
    ce = F.cross_entropy(x, target, reduction="none", ignore_index=-100)
    return ce.sum() / (target != -100).sum().clamp(min=1)


def _class_weights(up):
    """A quarter of the classes weigh 0 (a vocabulary's special tokens, say)."""
    return (torch.arange(V) % 4 != 0).to(up)


def weighted_ce(h, w, teacher, labels, mask, up=F32):
    """A class-weighted cross-entropy (its mean over the weights): a row whose label is
    ignored or weighs 0 is left out."""
    target = torch.where(mask > 0, labels, -100)
    return F.cross_entropy((h @ w.T).to(up), target, weight=_class_weights(up), ignore_index=-100)


def smoothed_ce_zloss(h, w, teacher, labels, mask, up=F32):
    """A label-smoothed cross-entropy plus a masked z-loss (``logsumexp ** 2``)."""
    x = (h @ w.T).to(up)
    target = torch.where(mask > 0, labels, -100)
    ce = F.cross_entropy(x, target, label_smoothing=0.1, ignore_index=-100)
    z = (torch.logsumexp(x, -1).pow(2) * mask.to(up)).sum() / mask.to(up).sum()
    return ce + 1e-4 * z


def sft_and_kd(h, w, teacher, labels, mask, up=F32):
    """SFT's ``nll_loss`` of the student's log-probs (``ignore_index``) plus a KL to the
    teacher on the same tokens, as a token mean."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    target = torch.where(mask > 0, labels, -100)
    nll = F.nll_loss(s, target, reduction="none")
    kd = torch.where(target != -100, (t.exp() * (t - s)).sum(-1), 0.0)
    return (nll + 0.5 * kd).sum() / (target != -100).sum().clamp(min=1)


def kd_kl_div(h, w, teacher, labels, mask, up=F32):
    """``F.kl_div(student, teacher, reduction="none", log_target=True)`` summed per token, as a
    masked mean."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    kl = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    return (kl * mask.to(up)).sum() / mask.to(up).sum()


def kd_mask_of_the_logits(h, w, teacher, labels, mask, up=F32):
    """A mask computed from the student's own logits: nothing is known before the loop."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    kl = (t.exp() * (t - s)).sum(-1)
    m = (s.amax(-1) > -2.0).to(up)
    return (kl * m).sum() / m.sum().clamp(min=1)


def kd_atan(h, w, teacher, labels, mask, up=F32):
    """``atan`` has no rule: the masked rows are computed (same results)."""
    return (_kl(h, w, teacher, up).atan() * mask.to(up)).sum() / mask.to(up).sum()


def kd_over_a_vector(h, w, teacher, labels, mask, up=F32):
    """Logits divided by one number a column: the rules read a divisor as one number a row."""
    scale = torch.linspace(0.5, 2.0, V, dtype=up)
    s = torch.log_softmax((h @ w.T).to(up) / scale, -1)
    t = torch.log_softmax(teacher.to(up), -1)
    return ((t.exp() * (t - s)).sum(-1) * mask.to(up)).sum() / mask.to(up).sum()


def reverse_kl_by_logsumexp(h, w, teacher, labels, mask, up=F32):
    """The student's log-probs as ``x - logsumexp(x)``, written out: the shifted logits'
    interval is read from the relation (at most 0), not from the logits' bound alone."""
    x = (h @ w.T).to(up)
    s = x - x.logsumexp(-1, keepdim=True)
    t = torch.log_softmax(teacher.to(up), -1)
    return ((s.exp() * (s - t)).sum(-1) * mask.to(up)).sum() / mask.to(up).sum()


def reverse_kl_by_hand(h, w, teacher, labels, mask, up=F32):
    """A softmax by hand (Megatron's spelling): the row's max subtracted, ``exp``, its sum
    (at least 1), ``log`` and a division by that sum."""
    x = (h @ w.T).to(up)
    x = x - x.max(dim=-1, keepdim=True).values
    e = x.exp()
    total = e.sum(-1, keepdim=True)
    t = torch.log_softmax(teacher.to(up), -1)
    kl = (e / total * (x - total.log() - t)).sum(-1)
    return (kl * mask.to(up)).sum() / mask.to(up).sum()


MASKED = [kd_masked_mean, kd_column_mask, kd_where, reverse_kl_temperature, kd_and_logprob, ensemble_ce,
          smoothed_ce_zloss, sft_and_kd, kd_kl_div, reverse_kl_by_logsumexp, reverse_kl_by_hand]
UNPROVEN = [kd_mask_of_the_logits, kd_atan, kd_over_a_vector]


def inputs(dtype, masked=0.5, t=T, seed=0):
    """(h, w, teacher logits, labels, mask): the first ``masked`` share of each 32 rows out."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    teacher = (torch.randn(t, V, generator=g) * 2).to(dtype)
    labels = torch.randint(0, V, (t,), generator=g)
    mask = (torch.arange(t) % 32 >= round(32 * masked)).float()
    return [h, w, teacher, labels, mask]


# Row-local regions whose per-row results the graph keeps (``row_local_sweeps_masked``):
# more than the loss leaves the graph, so no loss tail joins the body.

def kd_and_masked_kl(h, w, teacher, labels, mask, up=F32):
    """The masked-mean KL and its masked per-token values, returned for logging."""
    kl = _kl(h, w, teacher, up) * mask.to(up)
    return kl.sum() / mask.to(up).sum(), kl.detach()


def kd_and_kl_where(h, w, teacher, labels, mask, up=F32):
    """A KL selected by a boolean mask, its sum over a clamped count, and the selected values."""
    kl = torch.where(mask > 0, _kl(h, w, teacher, up), 0.0)
    return kl.sum() / mask.sum().clamp(min=1), kl.detach()


def forward_and_reverse_kl(h, w, teacher, labels, mask, up=F32):
    """Two masked-mean losses of one region: a forward and a reverse KL."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    fwd = (t.exp() * (t - s)).sum(-1)
    rev = (s.exp() * (s - t)).sum(-1)
    m = mask.to(up)
    return (fwd * m).sum() / m.sum(), (rev * m).sum() / m.sum()


def kd_and_every_kl(h, w, teacher, labels, mask, up=F32):
    """The per-token KL returned for every row: nothing can be skipped."""
    kl = _kl(h, w, teacher, up)
    return (kl * mask.to(up)).sum() / mask.to(up).sum(), kl.detach()


def kd_and_masked_top_logprobs(h, w, teacher, labels, mask, up=F32):
    """A masked KL, and each row's masked top-4 log-probs (``[n, 4]``), the mask's column
    written after the loss that reads the KL (the region reads it: it moves before the call)."""
    s = torch.log_softmax((h @ w.T).to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    kl = (t.exp() * (t - s)).sum(-1) * mask.to(up)
    loss = kl.sum() / mask.to(up).sum()
    return loss, s.topk(4, -1).values.detach() * mask.to(up)[:, None]


PER_TOKEN = [kd_and_masked_kl, kd_and_kl_where, forward_and_reverse_kl]


def poisoned(kind):
    """:func:`inputs` (bf16, half the rows masked) with one non-finite value, or a mask of
    every row or none (``kind``)."""
    h, w, teacher, labels, mask = inputs(torch.bfloat16, 0.5)
    if kind == "teacher+inf, a masked row":
        teacher[1, 7] = float("inf")
    elif kind == "teacher nan, a masked row":
        teacher[2, 9] = float("nan")
    elif kind == "h+inf, a masked row":
        h[3, 5] = float("inf")
    elif kind == "h nan, a kept row":
        h[20, 0] = float("nan")
    elif kind == "w+inf":
        w[9, 4] = float("inf")
    elif kind == "teacher -inf, a kept row":
        teacher[24, 3] = float("-inf")
    elif kind == "every row masked":
        mask.zero_()
    elif kind == "no row masked":
        mask.fill_(1)
    return [h, w, teacher, labels, mask]
