"""Batch invariance under backend="chunked_logits" (what true-on-policy RL needs).

A row's token log-prob and entropy must be bitwise identical whether the row is
computed alone, in a batch of 7 or in a batch of 4096.  The pass computes each row
independently (fx_passes/kernels/log_softmax/given.py), so the only thing that can break this is the order in
which Inductor's generated kernels reduce over the vocabulary.  On CPU that order
changes exactly when Inductor parallelizes the vocabulary reduction across threads,
which docs/batch-invariance.md spells out; the tests here pin both sides of that line.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters


def logprob_entropy(logits, tokens):
    z = logits.float() / 0.7
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(torch.softmax(z, dim=-1) * logp).sum(-1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), entropy


def make(rows: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    return x, torch.randint(0, vocab, (rows,), generator=g)


def differences(compiled, x, tok, batches, singles) -> list[str]:
    """Rows whose results differ between the full batch and smaller batches / single rows."""
    full = compiled(x, tok)
    bad = []
    for n in batches:
        part = compiled(x[:n], tok[:n])
        for k, name in enumerate(("logprob", "entropy")):
            for i in range(n):
                if not torch.equal(part[k][i], full[k][i]):
                    bad.append(f"{name} of row {i} in a batch of {n}: {part[k][i].item()!r} "
                               f"vs {full[k][i].item()!r} in a batch of {len(x)}")
    for i in singles:  # each row alone, at its own offset in the logits buffer
        one = compiled(x[i:i + 1], tok[i:i + 1])
        for k, name in enumerate(("logprob", "entropy")):
            if not torch.equal(one[k][0], full[k][i]):
                bad.append(f"{name} of row {i} alone: {one[k][0].item()!r} vs {full[k][i].item()!r}")
    return bad


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_rows_bitwise_identical_in_batches_of_1_7_4096(dynamic) -> None:
    x, tok = make(4096, 64)
    compiled = torch.compile(logprob_entropy, backend="chunked_logits", dynamic=dynamic)
    assert differences(compiled, x, tok, batches=[7, 1], singles=range(7)) == []
    assert counters["chunked_logits"]["rewritten"] >= 1
    assert counters["chunked_logits"]["declined"] == 0


def test_dynamic_rows_bitwise_identical_at_a_real_vocabulary() -> None:
    """With dynamic=True every batch of 2+ rows runs one kernel: invariant at any V."""
    x, tok = make(64, 32768)
    compiled = torch.compile(logprob_entropy, backend="chunked_logits", dynamic=True)
    assert differences(compiled, x, tok, batches=[2, 3, 7], singles=[]) == []


def test_single_thread_is_bitwise_invariant_at_a_real_vocabulary() -> None:
    """The workaround docs/batch-invariance.md gives: one thread, no parallel reduction."""
    x, tok = make(8, 32768)
    with torch._inductor.config.patch({"cpp.threads": 1}):
        compiled = torch.compile(logprob_entropy, backend="chunked_logits", dynamic=False)
        assert differences(compiled, x, tok, batches=[3], singles=[0, 5]) == []


# A vocabulary big enough for Inductor to split a 1-row reduction across the threads
# (V // threads >= config.cpp.min_chunk_size = 512), with room to spare.
BIG_V = max(32768, 1024 * torch.get_num_threads())


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: Inductor never parallelizes a reduction")
def test_docs_example_where_invariance_does_not_hold() -> None:
    """docs/batch-invariance.md: a row computed alone (a static 1-row kernel) at V=32768 is
    reduced by several threads, so it may differ from the same row in a batch.  If this
    test fails, this torch no longer does that: update the docs (and this test)."""
    x, tok = make(8, BIG_V)
    compiled = torch.compile(logprob_entropy, backend="chunked_logits", dynamic=False)
    bad = differences(compiled, x, tok, batches=[], singles=range(8))
    assert bad, "every row alone matched its batch: docs/batch-invariance.md says they may not"


# ---- logits from an lm_head in the graph: the chunk loop ----------------------------------------------

def lm_head_logprob_entropy(hidden, weight, tokens):
    return logprob_entropy(hidden @ weight.T, tokens)


def lm_head_inputs(rows: int, vocab: int, width: int = 16):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=g).bfloat16()
    weight = (torch.randn(vocab, width, generator=g) * 3 / width ** 0.5).bfloat16()
    return hidden, weight, torch.randint(0, vocab, (rows,), generator=g)


def test_lm_head_rows_bitwise_identical_once_the_chunk_body_is_compiled() -> None:
    """The matmul fused into the chunk loop, V = 64: once the chunk body has been compiled
    for the big batch, smaller batches reuse that kernel and match it bit for bit.  (A
    batch of n rows is cut into chunks of n // 4 rows at this size; n = 12 and 8 give
    chunks of 3 and 2 rows.  A chunk of one row runs the 1-row kernel instead, which may
    differ: docs/batch-invariance.md.)"""
    hidden, weight, tok = lm_head_inputs(4096, 64)
    compiled = torch.compile(lm_head_logprob_entropy, backend="chunked_logits", dynamic=True)
    compiled(hidden, weight, tok)
    full = compiled(hidden, weight, tok)
    for n in (12, 8):
        part = compiled(hidden[:n].clone(), weight, tok[:n].clone())
        assert all(torch.equal(part[k], full[k][:n]) for k in range(2)), n


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: Inductor never parallelizes a reduction")
def test_docs_example_lm_head_row_alone_in_its_chunk() -> None:
    """docs/batch-invariance.md: with the lm_head fused and the default chunk budget
    (32 MiB: 256 rows per forward chunk at V = 32768), a batch of 257 rows leaves its last
    row alone in a chunk, computed by the 1-row kernel; in a batch of 300 the same row is in
    a 44-row chunk.  Its results differ."""
    hidden, weight, tok = lm_head_inputs(300, 32768, width=64)
    compiled = torch.compile(lm_head_logprob_entropy, backend="chunked_logits", dynamic=True)
    paired = compiled(hidden, weight, tok)
    alone = compiled(hidden[:257].clone(), weight, tok[:257].clone())
    assert all(torch.equal(alone[k][:256], paired[k][:256]) for k in range(2))
    assert not all(torch.equal(alone[k][256], paired[k][256]) for k in range(2)), \
        "the row alone in its chunk matched: docs/batch-invariance.md says it may not"
