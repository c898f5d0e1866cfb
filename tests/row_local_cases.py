"""Row-local losses (issue 21), each written with its upcast dtype ``up`` as a parameter
(``up=torch.float64`` is the FP64 reference), and their inputs.

Sampling filters follow the rollout engines' order: temperature, then top-k, then top-p,
then min-p, each renormalising over the tokens it keeps (``-inf`` for the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import chunked_counters
from tests.numerics import assert_no_less_accurate, reference, run

F32 = torch.float32
NEG_INF = float("-inf")
TEMPERATURE = 0.7


def filtered(z, k=0, p=1.0, min_p=0.0):
    """Temperature-scaled logits ``z`` with the sampler's filters applied."""
    if k:
        kth = z.topk(k, dim=-1).values[..., -1, None]
        z = z.masked_fill(z < kth, NEG_INF)
    if p < 1.0:
        probs = z.softmax(-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) > p  # keeps the tokens until mass p (the top one always)
        z = z.masked_fill(drop.scatter(-1, order, drop), NEG_INF)
    if min_p:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), NEG_INF)
    return z


def topk_logprob(logits, tokens, up=F32):
    z = filtered(logits.to(up) / TEMPERATURE, k=20)
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def topk_topp_logprob(logits, tokens, up=F32):
    z = filtered(logits.to(up) / TEMPERATURE, k=50, p=0.9)
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def minp_logprob(logits, tokens, up=F32):
    z = filtered(logits.to(up) / TEMPERATURE, min_p=0.05)
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def topp_policy_loss(logits, tokens, old_logp, adv, mask, up=F32):
    """GRPO's clipped loss on top-p renormalised log-probs, masked token mean."""
    logp = topk_topp_logprob(logits, tokens, up)
    ratio = torch.exp(logp - old_logp.to(up))
    per_tok = -torch.minimum(ratio * adv.to(up), ratio.clamp(0.8, 1.2) * adv.to(up))
    return (per_tok * mask.to(up)).sum() / mask.to(up).sum()


def forward_kl(student, teacher, up=F32):
    s = torch.log_softmax(student.to(up) / TEMPERATURE, -1)
    t = torch.log_softmax(teacher.to(up) / TEMPERATURE, -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def reverse_kl(student, teacher, up=F32):
    s = torch.log_softmax(student.to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    return (s.exp() * (s - t)).sum(-1).mean()


def jsd(student, teacher, beta=0.3, up=F32):
    """Generalised JSD as in Liger / TRL's GKD: beta KL(t||m) + (1 - beta) KL(s||m)."""
    s = torch.log_softmax(student.to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    m = torch.logsumexp(torch.stack([s + torch.log1p(torch.tensor(-beta, dtype=up)),
                                     t + torch.log(torch.tensor(beta, dtype=up))]), dim=0)
    kl_t = (t.exp() * (t - m)).sum(-1)
    kl_s = (s.exp() * (s - m)).sum(-1)
    return (beta * kl_t + (1 - beta) * kl_s).mean()


def jsd_rowwise(student, teacher, beta=0.3, up=F32):
    """JSD with the mixture written row by row (no stack across a new leading dim)."""
    s = torch.log_softmax(student.to(up), -1)
    t = torch.log_softmax(teacher.to(up), -1)
    log_1mb, log_b = torch.log1p(torch.tensor(-beta, dtype=up)), torch.log(torch.tensor(beta, dtype=up))
    m = torch.logaddexp(s + log_1mb, t + log_b)
    kl_t = (t.exp() * (t - m)).sum(-1)
    kl_s = (s.exp() * (s - m)).sum(-1)
    return (beta * kl_t + (1 - beta) * kl_s).mean()


def kl_div_log_target(student, teacher, up=F32):
    return F.kl_div(torch.log_softmax(student.to(up), -1), torch.log_softmax(teacher.to(up), -1),
                    reduction="batchmean", log_target=True)


def kl_div_probs(student, teacher, up=F32):
    return F.kl_div(torch.log_softmax(student.to(up), -1), torch.softmax(teacher.to(up), -1),
                    reduction="batchmean")


def kl_div_sum(student, teacher, up=F32):
    return F.kl_div(torch.log_softmax(student.to(up), -1), torch.softmax(teacher.to(up), -1),
                    reduction="sum")


def ce_label_smoothing(logits, labels, up=F32):
    return F.cross_entropy(logits.to(up), labels, label_smoothing=0.1)


def ce_weight_smoothing(logits, labels, weight, up=F32):
    return F.cross_entropy(logits.to(up), labels, weight=weight.to(up), label_smoothing=0.1)


def ce_weight_sum(logits, labels, weight, up=F32):
    return F.cross_entropy(logits.to(up), labels, weight=weight.to(up), reduction="sum")


def ce_smoothing_flattened(logits, labels, up=F32):
    """Hugging Face's spelling: [B, S, V] logits upcast, then viewed as [B * S, V]."""
    z = logits.to(up).view(-1, logits.shape[-1])
    return F.cross_entropy(z, labels.view(-1), label_smoothing=0.1, ignore_index=-100)


def kl_div_flattened(student, teacher, up=F32):
    """``[B, S, V]`` logits, both flattened after the upcast (Hugging Face style): one
    region reads both."""
    s = student.to(up).view(-1, student.shape[-1]).log_softmax(-1)
    t = teacher.to(up).view(-1, teacher.shape[-1]).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def ce_smoothing_per_token(logits, labels, tok_w, up=F32):
    """Per-token weights on label-smoothed CE (reduction none), then a weighted mean."""
    per = F.cross_entropy(logits.to(up), labels, label_smoothing=0.2, reduction="none")
    return (per * tok_w.to(up)).sum() / tok_w.to(up).sum()


def ce_smoothing_z_loss(logits, labels, up=F32):
    """Label-smoothed CE plus a z-loss (PaLM's ``1e-4 * logsumexp**2``) over the rows kept."""
    z = logits.to(up)
    keep = labels != -100
    z_loss = (torch.logsumexp(z, -1).pow(2) * keep).sum() / keep.sum()
    return F.cross_entropy(z, labels, label_smoothing=0.1) + 1e-4 * z_loss


def dpo_loss(logits, tokens, ref_logp, up=F32):
    """DPO on top-k log-probs: sequences of 4 tokens, chosen then rejected halves."""
    logp = topk_logprob(logits, tokens, up) - ref_logp.to(up)
    seq = logp.reshape(-1, 4).sum(-1)
    chosen, rejected = seq.chunk(2)
    return -F.logsigmoid(0.1 * (chosen - rejected)).mean()


def gspo_loss(logits, tokens, old_logp, adv, up=F32):
    """GSPO: the sequence-level ratio (mean log-ratio over each sequence of 8 tokens)."""
    logp = topk_logprob(logits, tokens, up)
    seq_ratio = torch.exp((logp - old_logp.to(up)).reshape(-1, 8).mean(-1))
    return -torch.minimum(seq_ratio * adv.to(up), seq_ratio.clamp(0.9, 1.1) * adv.to(up)).mean()


# --- inputs --------------------------------------------------------------------------

def distinct_logits(rows: int, vocab: int, dtype, seed: int = 0, top: float = 8.0) -> torch.Tensor:
    """Logits with no two equal values in a row: the ``vocab`` representable values of
    ``dtype`` just below ``top``, shuffled per row.  A sort or a top-k / top-p cut then
    has one answer (with ties, two correct sorts may keep different tokens)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.tensor(top, dtype=dtype).view(torch.int16) - torch.arange(vocab, dtype=torch.int16)
    values = bits.view(dtype)
    assert (values > 0).all() and values.unique().numel() == vocab
    return torch.stack([values[torch.randperm(vocab, generator=g)] for _ in range(rows)])


def kept_tokens(logits: torch.Tensor, rank: int = 1) -> torch.Tensor:
    """The ``rank``-th most likely token of each row: kept by every filter above."""
    return logits.float().topk(rank + 1, -1).indices[:, rank].contiguous()


# --- the test cases (tests/test_row_local.py, tests/test_saved_for_backward.py) ---------------------

T, V = 64, 1024  # T rows (a multiple of 8 for the sequence losses), V distinct values per row


def inputs(name: str, dtype):
    """(fn, inputs, grad positions) of case ``name``."""
    g = torch.Generator().manual_seed(1)
    x = distinct_logits(T, V, dtype)
    teacher = distinct_logits(T, V, dtype, seed=2)
    tokens = kept_tokens(x)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::7] = -100
    per_row = lambda: torch.rand(T, generator=g) + 0.5  # noqa: E731
    old_logp = topk_topp_logprob(x, tokens, up=torch.float64).float() + 0.05 * torch.randn(T, generator=g)
    mask = (torch.rand(T, generator=g) > 0.2).float()
    weight = torch.rand(V, generator=g) + 0.5
    table = {
        "topk": (topk_logprob, (x, tokens)),
        "topk_topp": (topk_topp_logprob, (x, tokens)),
        "minp": (minp_logprob, (x, tokens)),
        "topp_policy": (topp_policy_loss, (x, tokens, old_logp, torch.randn(T, generator=g), mask)),
        "forward_kl": (forward_kl, (x, teacher)),
        "reverse_kl": (reverse_kl, (x, teacher)),
        "jsd": (jsd_rowwise, (x, teacher)),
        "kl_div_log_target": (kl_div_log_target, (x, teacher)),
        "kl_div_probs": (kl_div_probs, (x, teacher)),
        "kl_div_sum": (kl_div_sum, (x, teacher)),
        "ce_label_smoothing": (ce_label_smoothing, (x, labels)),
        "ce_weight_smoothing": (ce_weight_smoothing, (x, labels, weight)),
        "ce_weight_sum": (ce_weight_sum, (x, labels, weight)),
        "ce_smoothing_per_token": (ce_smoothing_per_token, (x, labels, per_row())),
        "ce_smoothing_z_loss": (ce_smoothing_z_loss, (x, labels)),
        "ce_smoothing_flattened": (ce_smoothing_flattened, (x.view(4, T // 4, V), labels.view(4, T // 4))),
        "kl_div_flattened": (kl_div_flattened, (x.view(4, T // 4, V), teacher.view(4, T // 4, V))),
        "dpo": (dpo_loss, (x, tokens, old_logp)),
        "gspo": (gspo_loss, (x, tokens, old_logp, torch.randn(T // 8, generator=g))),
    }
    fn, inputs = table[name]
    return fn, inputs, (0,)


CASES = ["topk", "topk_topp", "minp", "topp_policy", "forward_kl", "reverse_kl", "jsd", "kl_div_log_target",
         "kl_div_probs", "kl_div_sum", "ce_label_smoothing", "ce_weight_smoothing", "ce_weight_sum",
         "ce_smoothing_per_token", "ce_smoothing_z_loss", "ce_smoothing_flattened", "kl_div_flattened", "dpo",
         "gspo"]


_RUNS: dict = {}


def reference_and_stock(fn, inputs, grad_pos, dynamic=False):
    """(FP64 reference, stock Inductor's run) of ``fn`` on ``inputs``, computed once per
    process: several tests (and files) compare the same case with other options or plans,
    and stock's compile is most of what a case costs."""
    entries = _RUNS.setdefault((fn, tuple(grad_pos), dynamic), [])
    for seen, runs in entries:
        if len(seen) == len(inputs) and all(
                a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
                for a, b in zip(seen, inputs)):
            return runs
    torch._dynamo.reset()
    runs = reference(fn, inputs, grad_pos), run(torch.compile(fn, backend="inductor", dynamic=dynamic),
                                                inputs, grad_pos)
    entries.append(([t.detach().clone() for t in inputs], runs))
    return runs


def check(fn, inputs, grad_pos, dtype, out_rtol, grad_rtol, dynamic=False, **options):
    """Rewritten (counters) and no less accurate than stock against FP64; the counters.
    The engine is what these cases test: it runs even where stock would be left the region
    (``leave_to_stock=False``, ``match/worth.py``; ``tests/test_worth.py`` tests that step)."""
    options.setdefault("leave_to_stock", False)
    ref, stock = reference_and_stock(fn, inputs, grad_pos, dynamic)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=dynamic, options=options)
    ours = run(compiled, inputs, grad_pos)
    c = chunked_counters()
    assert c.get("row_local", 0) >= 1 and not c.get("declined") and not c.get("pass_failed"), c
    assert not c.get("row_local_body_eager"), c  # (every chunk body compiled)
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)
    return c
