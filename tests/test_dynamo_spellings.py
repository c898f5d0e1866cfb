"""The lm_head's transposed weight in each spelling Dynamo records.

``w.T`` and ``w.mT`` are ``getattr(w, "T")`` nodes up to torch 2.13 and ATen calls
(``aten.numpy_T``, ``aten.mT``) from torch 2.14 on, which the matcher and the view
analysis (``fx/graph_ops.attribute_view``) read as the same.  The tests respell a graph as
torch 2.14 records it (:func:`as_torch_2_14`), so a run on either torch checks both: the
lm_head fuses, the result is the graph's own, and an in-place write through the
transpose after the matmul still keeps the matmul where it was.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes import Config
from fx_passes.fx.graph_ops import attribute_view
from fx_passes.fx.placement import view_family
from fx_passes.pipeline import transform
from tests.helpers import dynamo_graph

T, H, V = 24, 16, 96
# What torch 2.14's Dynamo records for the attribute (the overload packet, as it does)
TORCH_2_14 = {"T": torch.ops.aten.numpy_T, "mT": torch.ops.aten.mT}


def as_torch_2_14(gm: torch.fx.GraphModule) -> int:
    """Respell ``gm``'s ``getattr(w, "T" / "mT")`` nodes as the ATen calls torch 2.14
    records; the count respelled (0 on torch 2.14, where Dynamo made them already)."""
    graph, count = gm.graph, 0
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is getattr and n.args[1:] in (("T",), ("mT",)):
            with graph.inserting_before(n):
                new = graph.call_function(TORCH_2_14[n.args[1]], (n.args[0],))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            count += 1
    gm.recompile()
    return count


def _logprob(logits, tok):
    return torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)


SPELLINGS = {
    "w.T": lambda h, w, tok: _logprob(h @ w.T, tok),
    "w.mT": lambda h, w, tok: _logprob(h @ w.mT, tok),
    "w.t()": lambda h, w, tok: _logprob(h @ w.t(), tok),
    "w.transpose(0, 1)": lambda h, w, tok: _logprob(h @ w.transpose(0, 1), tok),
    "torch.t(w)": lambda h, w, tok: _logprob(torch.matmul(h, torch.t(w)), tok),
    "torch.transpose(w, 1, 0)": lambda h, w, tok: _logprob(torch.matmul(h, torch.transpose(w, 1, 0)), tok),
    "F.linear": lambda h, w, tok: _logprob(F.linear(h, w), tok),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, H, generator=g).bfloat16(), (torch.randn(V, H, generator=g) / 4).bfloat16(),
            torch.randint(0, V, (T,), generator=g))


def _run(gm: torch.fx.GraphModule, h, w, tok) -> torch.Tensor:
    """``gm`` on the inputs, by its placeholders' names (Dynamo orders them by first use)."""
    by_name = {"L_h_": h, "L_w_": w, "L_tok_": tok}
    (out,) = gm(*[by_name[p.target] for p in gm.graph.find_nodes(op="placeholder")])
    return out


def _rewritten(fn, respell: bool):
    """(the Dynamo graph, respelled as torch 2.14 records it if ``respell``; its rewrite)."""
    gm = dynamo_graph(fn, *_inputs())
    if respell:
        as_torch_2_14(gm)
        assert not any(n.target is getattr for n in gm.graph.nodes)
    counters.clear()
    return gm, transform(gm, Config.from_options({}))


RESPELLED = [("w.T", True), ("w.mT", True)]


@pytest.mark.parametrize("spelling,respell", [*((s, False) for s in SPELLINGS), *RESPELLED],
                         ids=[*SPELLINGS, *(f"{s}-as_torch_2_14" for s, _ in RESPELLED)])
def test_the_lm_head_fuses_in_every_spelling(spelling, respell):
    gm, new = _rewritten(SPELLINGS[spelling], respell)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    matmuls = (torch.matmul, F.linear)
    assert not [n for n in new.graph.nodes if n.op == "call_function" and n.target in matmuls]
    want, got = _run(gm, *_inputs()), _run(new, *_inputs())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # (FP32 log-probs of the same bf16 logits)


def w_changed_through_its_transpose(h, w, tok):
    w = w * 1
    logits = h @ w.T
    w.mT.mul_(0.5)  # w's storage, through another view, written after the matmul read it
    return _logprob(logits, tok)


@pytest.mark.parametrize("respell", [False, True], ids=["as_traced", "as_torch_2_14"])
def test_a_write_through_the_transpose_keeps_the_matmul(respell):
    """The matmul may not move past the write: the transpose is a view of ``w`` in either
    spelling (``fx/placement.view_family``), so the lm_head is not fused and the result is
    the graph's own (with the write ignored it would be the log-probs of half the logits)."""
    gm, new = _rewritten(w_changed_through_its_transpose, respell)
    assert [attribute_view(n) for n in gm.graph.nodes if attribute_view(n)] == ["T", "mT"]
    got = dict(counters["chunked_logits"])
    assert got.get("lm_head_fused") is None and got.get("lm_head_not_fused") == 1, got
    torch.testing.assert_close(_run(new, *_inputs()), _run(gm, *_inputs()), rtol=0, atol=1e-5)


@pytest.mark.parametrize("respell", [False, True], ids=["as_traced", "as_torch_2_14"])
def test_the_attribute_views_share_the_weights_storage(respell):
    """``w.T`` and ``w.mT`` are views of ``w`` in either spelling: one view family, which
    a fused op that saves the weight checks later writes against (``mutation_of``)."""
    gm = dynamo_graph(w_changed_through_its_transpose, *_inputs())
    if respell:
        assert as_torch_2_14(gm) == 2 or not any(n.target is getattr for n in gm.graph.nodes)
    views = [n for n in gm.graph.nodes if attribute_view(n)]
    (w,) = {n.args[0] for n in views}
    assert view_family(views[0]) == {w, *views}
