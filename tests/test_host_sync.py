"""No host sync in a step (issue 35, items 1 and 5): after warm-up, a compiled training
step of every path the pass rewrites, with each plan a GPU can run forced, reads no
device value back to the host: the profiler records no ``aten::_local_scalar_dense``,
``item``, ``equal`` or ``is_nonzero``.  On a GPU each is a sync that stalls the CPU's
run-ahead, and inside a captured CUDA graph it raises.

The plans a GPU runs: ``"gpu"`` (here on the test-only CPU kernels of
``mm(..., out_dtype=)``) and ``"blocks"``.  ``"two_sweeps"`` / ``"fp32_tiles"`` are CPU
plans: with the loss in the graph, ``"two_sweeps"`` reads the incoming gradient on a CPU
(a read of host memory there), and forced on another device it reads nothing (it
recomputes); the per-token path reads nothing on any plan.  Each case also asserts its
rewrite's counter, so a path that stopped being rewritten fails instead of passing
vacuously.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fx_passes.kernels.ops.registry import GRAPH_BODIES
from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests import row_local_cases as rl
from tests import shard_heads
from tests import sweep_cases as sweeps
from tests.helpers import chunked_counters

SYNCS = ("aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero")
# Factories that make a host tensor unless given a device.  In a body the pass runs on
# the step's tensors (a loss's scalar part, a region's ops), a host tensor is moved to
# the GPU: a copy that syncs the host every step, which a CPU profile cannot see (the
# GPU check found one: a loss's constant factor, ``-mean``'s -1, made by
# ``scalar_tensor`` and copied over).
FACTORIES = {torch.scalar_tensor, torch.tensor, torch.as_tensor, torch.full, torch.zeros, torch.ones,
             torch.empty, torch.arange}
BF16, F32 = torch.bfloat16, torch.float32
T, V, H = 48, 160, 32


def host_reads(fn, inputs, grad_pos, options, g=0.3) -> tuple[list[str], dict]:
    """The sync ops a compiled step of ``fn`` (forward, and backward with an incoming
    gradient ``g`` per element) records after two warm-up steps, and the counters."""
    compiled = torch.compile(fn, backend="chunked_logits", options=options)

    def step():
        leaves = [t.detach().clone().requires_grad_(i in grad_pos) for i, t in enumerate(inputs)]
        out = compiled(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, [leaves[i] for i in grad_pos], torch.full_like(out, g))
    plan = options.get("lm_head_plan")
    with cpu_out_dtype_kernels() if plan == "gpu" else contextlib.nullcontext():
        step()
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    reads = sorted({e.name for e in prof.events() if e.name in SYNCS})
    return reads + host_made(), chunked_counters()


def host_made() -> list[str]:
    """The bodies' factory calls that make a host tensor (no ``device``; ``as_tensor`` of
    a number): each a host-to-device copy a step on a GPU (see FACTORIES)."""
    found = []
    for key in GRAPH_BODIES:
        graph = getattr(GRAPH_BODIES[key], "graph", None)
        for n in graph.nodes if graph is not None else ():
            if n.op != "call_function" or n.target not in FACTORIES or n.kwargs.get("device") is not None:
                continue
            if n.target is torch.as_tensor and isinstance(n.args[0], torch.fx.Node):
                continue  # (of a tensor: no copy)
            found.append(f"host tensor in body {key}: {n.format_node()}")
    return found


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(BF16)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 4).to(BF16)
    return hidden, weight, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)


def lm_head_per_token(hidden, weight, tokens):
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def lm_head_loss(hidden, weight, tokens, adv):
    return -(lm_head_per_token(hidden, weight, tokens) * adv).mean()


SMALL = {"chunk_budget_mib": 0.02}  # several row chunks and vocabulary blocks


@pytest.mark.parametrize("plan", ["gpu", "blocks", "two_sweeps", "fp32_tiles"])
def test_lm_head_per_token(plan):
    h, w, tok, _ = _head()
    reads, c = host_reads(lm_head_per_token, (h, w, tok), (0, 1), {"lm_head_plan": plan, **SMALL})
    assert c.get("lm_head_fused") == 1, c
    assert reads == [], reads


@pytest.mark.parametrize("plan", ["gpu", "blocks"])
def test_lm_head_loss_in_graph(plan):
    h, w, tok, adv = _head()
    reads, c = host_reads(lm_head_loss, (h, w, tok, adv), (0, 1), {"lm_head_plan": plan, **SMALL})
    assert c.get("lm_head_fused") == 1 and c.get("gradients_in_forward", 0) == int(plan == "gpu"), c
    assert reads == [], reads


@pytest.mark.parametrize("options", [
    {"lm_head_plan": "gpu"},                                   # row_local_loss: grads in forward
    {"lm_head_plan": "gpu", "gradients_in_forward": False},   # row_local_sweeps
    {"row_local_sweeps": False},                               # row_local_head: the matmul in the call
], ids=["loss-gpu", "sweeps", "head"])
def test_row_local_with_the_lm_head(options):
    fn, inputs, grad_pos = sweeps.case("forward_kl")
    reads, c = host_reads(fn, inputs, grad_pos, {**options, "chunk_budget_mib": 0.05})
    assert c.get("row_local_lm_head") == 1 or c.get("row_local") == 1, c
    assert reads == [], reads


def test_row_local_given_logits_and_saved_masks():
    """A top-k filtered log-prob on given logits: row_local, the kept mask saved as bits."""
    logits = rl.distinct_logits(T, V, BF16, seed=1)
    tokens = rl.kept_tokens(logits)
    reads, c = host_reads(rl.topk_logprob, (logits, tokens), (0,), {"chunk_budget_mib": 0.01})
    assert c.get("row_local") == 1 and c.get("row_local_saved_masks") == 1, c
    assert reads == [], reads


@pytest.mark.usefixtures("one_rank_group")
def test_vocab_parallel_lm_head_on_one_rank():
    """The one-pass call (the glue's collectives inside; the row chunks agreed with the
    other ranks in the warm-up, then without a collective)."""
    fn = shard_heads.with_lm_head(shard_heads.logprob)
    h, w, tok = shard_heads.lm_inputs(BF16, shard_heads.logprob)
    reads, c = host_reads(fn, (h, w, tok), (0, 1), dict(shard_heads.SMALL_BUDGET))
    assert c.get("vocab_parallel_one_pass", 0) + c.get("vocab_parallel", 0) >= 1, c
    assert reads == [], reads
