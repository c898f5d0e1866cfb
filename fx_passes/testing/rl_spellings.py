"""The RL frameworks' log-prob spellings, written here in our own words, each
with its upcast dtype ``up`` as a parameter (``up=torch.float64`` is the FP64 reference),
the lm_head in the graph, and their inputs.  Tests: tests/test_rl_spellings.py; measured:
benchmarks/rl_spellings.py.

* ``stacked_logsumexp``: per sequence, ``torch.stack([logsumexp(l) for l in logits])``
  with a gather beside it (an FP32 branch of a selective log-softmax);
* ``zipped_rows``: per sequence, log-softmax and gather of its labels, stacked;
* ``row_slices``: a logsumexp per slice of rows, ``cat`` (a chunked logsumexp);
* ``split_rows`` / ``chunk_rows``: the same with ``split`` / ``chunk``;
* ``in_place_temperature``: the fresh FP32 copy divided in place, then log-probs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

F32 = torch.float32
TEMPERATURE = 0.7
ROWS_PER_SLICE = 24  # (not a divisor of the row counts used: a short last slice)


def _picked(logits, tokens):
    return torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)


def stacked_logsumexp(hidden, weight, tokens, up=F32):
    logits = (hidden @ weight.T).to(up)  # [B, S, V]
    lse = torch.stack([torch.logsumexp(seq, dim=-1) for seq in logits])
    return _picked(logits, tokens) - lse


def zipped_rows(hidden, weight, tokens, up=F32):
    logits = hidden @ weight.T  # [B, S, V]
    per_seq = []
    for seq, seq_tokens in zip(logits, tokens):
        logp = F.log_softmax(seq.to(up), dim=-1)
        per_seq.append(_picked(logp, seq_tokens))
    return torch.stack(per_seq)


def row_slices(hidden, weight, tokens, up=F32):
    logits = (hidden @ weight.T).to(up)  # [T, V]
    n = logits.shape[0]
    lse = torch.cat([torch.logsumexp(logits[s:s + ROWS_PER_SLICE], dim=-1)
                     for s in range(0, n, ROWS_PER_SLICE)])
    return _picked(logits, tokens) - lse


def split_rows(hidden, weight, tokens, up=F32):
    logits = (hidden @ weight.T).to(up)
    lse = torch.cat([part.logsumexp(-1) for part in logits.split(ROWS_PER_SLICE)])
    return _picked(logits, tokens) - lse


def chunk_rows(hidden, weight, tokens, up=F32):
    logits = (hidden @ weight.T).to(up)
    lse = torch.cat([torch.logsumexp(part / TEMPERATURE, -1) for part in torch.chunk(logits, 3)])
    return _picked(logits, tokens) / TEMPERATURE - lse


def in_place_temperature(hidden, weight, tokens, up=F32):
    logits = hidden @ weight.T
    logits = logits.to(up)
    logits.div_(TEMPERATURE)
    return _picked(torch.log_softmax(logits, dim=-1), tokens)


# name -> (fn, batched: [B, S, V] logits, else [T, V])
CASES = {
    "stacked_logsumexp": (stacked_logsumexp, True),
    "zipped_rows": (zipped_rows, True),
    "row_slices": (row_slices, False),
    "split_rows": (split_rows, False),
    "chunk_rows": (chunk_rows, False),
    "in_place_temperature": (in_place_temperature, False),
}


def inputs(name: str, batch: int, seq: int, hidden: int, vocab: int, dtype=torch.bfloat16, seed: int = 0):
    """(fn, (hidden, weight, tokens)) of case ``name``: ``[batch, seq]`` rows, batched or flat."""
    fn, batched = CASES[name]
    g = torch.Generator().manual_seed(seed)
    shape = (batch, seq) if batched else (batch * seq,)
    h = torch.randn(*shape, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5 * 4).to(dtype)
    tokens = torch.randint(0, vocab, shape, generator=g)
    return fn, (h, w, tokens)
