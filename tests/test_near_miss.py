"""Near misses (a one-line change away from a rewrite: said once, naming the change) and
the common spellings the pass takes instead of hinting at them: advanced indexing as a
gather, a row slice of the lm_head's logits, ``*_like`` factories in a row-local region."""

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes import Config
from fx_passes.pipeline import transform
from fx_passes.reporting.session import session
from tests.helpers import chunked_counters, dynamo_graph, ops, rewrite_graphs
from tests.numerics import F32, TOLERANCES, assert_no_less_accurate, reference, run

BF16 = TOLERANCES[0].values  # (dtype, out_rtol, grad_rtol)
T, H, V = 13, 16, 257


def _hints() -> list[str]:
    return [e.what for e in session.events if e.kind == "near_miss"]


def _tensors(*shapes_and_kinds, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind, shape in shapes_and_kinds:
        if kind == "tok":
            out.append(torch.randint(0, V, shape, generator=g))
        else:
            out.append((torch.randn(shape, generator=g) * (3 if kind == "x" else H**-0.5)).bfloat16())
    return out


def _no_worse_than_stock(fn, inputs, grad_pos, **options):
    """``fn`` through the backend: no further from FP64 than stock Inductor (outputs and
    gradients); the counters it moved."""
    dtype, out_rtol, grad_rtol = BF16
    ref = reference(fn, inputs, grad_pos)
    stock = run(torch.compile(fn, backend="inductor"), inputs, grad_pos)
    torch._dynamo.reset()
    counters.clear()
    ours = run(torch.compile(fn, backend="chunked_logits", options=options), inputs, grad_pos)
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)
    return chunked_counters()


# --- advanced indexing: lp[arange(N), tok] is a gather --------------------------------

def logprob_indexed(x, tok, up=F32):
    lp = torch.log_softmax(x.to(up) / 0.7, -1)
    return lp[torch.arange(x.shape[0]), tok]


def test_advanced_indexing_is_rewritten_as_a_gather():
    x, tok = _tensors(("x", (T, V)), ("tok", (T,)))
    assert _no_worse_than_stock(logprob_indexed, [x, tok], (0,)) == {"rewritten": 1}
    assert _hints() == []


@pytest.mark.parametrize("dynamic", [False, True])
def test_advanced_indexing_graph(dynamic):
    x, tok = _tensors(("x", (T, V)), ("tok", (T,)))
    before, after = rewrite_graphs(logprob_indexed, x, tok, dynamic=dynamic)
    assert "log_softmax" in ops(before) and "arange" in ops(before)
    assert "row_stats" in ops(after) and "log_softmax" not in ops(after) and "arange" not in ops(after)


def test_advanced_indexing_with_several_tokens_per_row_is_a_near_miss(caplog):
    def fn(x, tok):  # [B, T, V] log-probs indexed by three tensors: not taken
        lp = torch.log_softmax(x.float(), -1)
        b, t = tok.shape
        return lp[torch.arange(b)[:, None], torch.arange(t)[None, :], tok]

    x, tok = _tensors(("x", (2, T, V)), ("tok", (2, T)))
    with caplog.at_level("WARNING", logger="fx_passes"):
        after = transform(dynamo_graph(fn, x, tok), Config())
    assert "log_softmax" in ops(after)
    (hint,) = _hints()
    assert hint.startswith("getitem_2 reads lp by advanced indexing (lp[getitem, getitem_1, l_tok_]), "
                           "which the pass does not take (it takes lp[torch.arange(N), tokens] of [N, V] "
                           "log-probs): write it as lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)"), hint
    assert "chunked_logits: near miss at " in caplog.text and ": getitem_2 reads lp" in caplog.text
    assert "test_near_miss.py" in caplog.text  # the user's source line
    assert chunked_counters() == {"near_miss": 1}


def test_an_index_of_rows_is_no_spelling_hint():
    def fn(x, rows):  # rows selected by an index: not a gather spelled as an index
        return torch.log_softmax(x.float(), -1)[rows].logsumexp(-1)

    (x,) = _tensors(("x", (T, V)))
    transform(dynamo_graph(fn, x, torch.arange(0, T, 2)), Config())
    assert _hints() == []


# --- a row slice of the lm_head's logits: done on the hidden states, the lm_head fused ----

def shifted_logprob(h, w, tok, up=F32):
    logits = (h @ w.T)[:, :-1]  # the causal shift on the logits
    return torch.log_softmax(logits.to(up), -1).gather(-1, tok[:, 1:, None]).squeeze(-1)


def last_k_entropy(h, w, up=F32):
    logits = F.linear(h, w)[:, -5:]  # logits_to_keep on the logits
    z = logits.to(up)
    return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


def softcapped_shift_ce(h, w, tok, up=F32):
    logits = (torch.tanh((h @ w.T) / 3.0) * 3.0)[:, :-1]  # Gemma2's softcap, then the shift
    return F.cross_entropy(logits.to(up).flatten(0, 1), tok[:, 1:].flatten())


@pytest.mark.sampled(3)
@pytest.mark.parametrize("fn", [shifted_logprob, last_k_entropy, softcapped_shift_ce],
                         ids=["shift", "last_k", "softcap_shift"])
def test_logits_row_slice_fuses_the_lm_head(fn):
    h, w, tok = _tensors(("x", (2, T, H)), ("w", (V, H)), ("tok", (2, T)))
    inputs = [h, w] if fn is last_k_entropy else [h, w, tok]
    moved = _no_worse_than_stock(fn, inputs, (0, 1), chunk_budget_mib=0.01)
    assert moved["rewritten"] == moved["lm_head_fused"] == 1, moved  # (CE: gradients_in_forward too)
    assert "lm_head_not_fused" not in moved and "declined" not in moved, moved


def test_logits_row_slice_read_elsewhere_keeps_the_matmul_and_says_why(caplog):
    def fn(h, w, tok):
        full = h @ w.T
        lp = torch.log_softmax(full[:, :-1].float(), -1).gather(-1, tok[:, 1:, None])
        return lp, full.sum()

    h, w, tok = _tensors(("x", (2, T, H)), ("w", (V, H)), ("tok", (2, T)))
    with caplog.at_level("INFO", logger="fx_passes"):
        transform(dynamo_graph(fn, h, w, tok), Config())
    assert chunked_counters() == {"rewritten": 1, "lm_head_not_fused": 1}
    assert "lm_head not fused: the logits are also used outside the region" in caplog.text


def test_hidden_changed_between_the_matmul_and_the_slice_keeps_the_matmul(caplog):
    def fn(h, w, tok):
        h = h * 1
        logits = h @ w.T
        h.mul_(0.5)  # the fused loop would read h after this: the matmul stays whole
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tok[:, 1:, None])

    h, w, tok = _tensors(("x", (2, T, H)), ("w", (V, H)), ("tok", (2, T)))
    with caplog.at_level("INFO", logger="fx_passes"):
        transform(dynamo_graph(fn, h, w, tok), Config())
    assert chunked_counters() == {"rewritten": 1, "lm_head_not_fused": 1}
    assert "lm_head not fused: MUTATION" in caplog.text


# --- the loss outside the compiled function ------------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids)))


def test_model_compiled_without_its_loss_is_a_near_miss(caplog):
    model = TinyLM().bfloat16()
    ids = torch.randint(0, V, (2, T))
    with caplog.at_level("WARNING", logger="fx_passes"):
        logits = torch.compile(model, backend="chunked_logits")(ids)
    F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())  # the trainer's loss, outside
    (hint,) = _hints()
    line = inspect.getsourcelines(TinyLM.forward)[1] + 1  # (the return: where the graph ends)
    compile_id = "[0-9]+/[0-9]+"
    assert re.fullmatch(
        re.escape("the compiled graph (graph ") + compile_id + re.escape(
            f" of forward (ends at {__file__}:{line})) returns the bf16 logits linear [.., 257] and computes "
            "no loss from them, so there is nothing to rewrite: widen that compile to the function that "
            "computes the loss too (torch.compile a step function that calls the model and the loss, or give "
            "the model the labels so that its forward computes the loss), with no graph break between them"),
        hint), hint
    assert "chunked_logits: near miss at linear (" in caplog.text
    assert ": the compiled graph (graph " in caplog.text
    assert counters["chunked_logits"]["near_miss"] == 1


@pytest.mark.parametrize("case", ["hidden_states", "fp32_logits", "loss_inside"])
def test_no_loss_outside_hint_where_there_is_no_such_miss(case):
    h, w, tok = _tensors(("x", (T, H)), ("w", (V, H)), ("tok", (T,)))
    fns = {
        "hidden_states": (lambda h: torch.tanh(h) * 2, (h,)),  # narrow, no lm_head
        "fp32_logits": (lambda h, w: h.float() @ w.float().T, (h, w)),
        "loss_inside": (lambda h, w, tok: (h @ w.T, F.cross_entropy((h @ w.T).float(), tok)), (h, w, tok)),
    }
    fn, args = fns[case]
    transform(dynamo_graph(fn, *args), Config())
    assert _hints() == []


# --- model-precision softmax on logits: upgrade_low_precision --------------------------

def entropy_from_logits(logits):  # verl's, on bf16 logits
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def test_model_precision_entropy_is_a_near_miss_naming_the_option(caplog):
    (x,) = _tensors(("x", (T, V)))
    with caplog.at_level("WARNING", logger="fx_passes"):
        after = transform(dynamo_graph(entropy_from_logits, x), Config())
    assert ops(after) == "softmax logsumexp mul sum sub"  # left alone
    (hint,) = _hints()  # one hint for the logits, not one per head
    assert hint == ("softmax of the bf16 logits l_logits_ is computed in bf16 (no FP32 upcast, nothing to "
                    "remove): to have it computed in FP32 per chunk of rows, with no FP32 copy of the "
                    "logits, set upgrade_low_precision=True (options={'upgrade_low_precision': True} or "
                    "Config(upgrade_low_precision=True)); results become FP32")
    assert "test_near_miss.py" in caplog.text


def test_with_the_option_the_entropy_is_rewritten_and_no_hint():
    (x,) = _tensors(("x", (T, V)))
    transform(dynamo_graph(entropy_from_logits, x), Config(upgrade_low_precision=True))
    assert chunked_counters() == {"rewritten": 1}
    assert _hints() == []


def test_attention_softmax_in_model_precision_is_no_near_miss():
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    q, k, v = _tensors(("x", (2, T, H)), ("x", (2, T, H)), ("x", (2, T, H)))
    transform(dynamo_graph(attention, q, k, v), Config())
    assert _hints() == []


# --- *_like factories: row-local; one decline per region ------------------------------

def top_p_logprob(x, tok, up=F32):
    z = x.to(up) / 0.7
    s, idx = torch.sort(z, descending=True, dim=-1)
    p = s.softmax(-1)
    s = s.masked_fill(p.cumsum(-1) - p > 0.9, float("-inf"))  # top-p: keep the head of the sorted row
    z2 = torch.full_like(z, float("-inf")).scatter(-1, idx, s)
    return torch.log_softmax(z2, -1).gather(-1, tok[:, None]).squeeze(-1)


def test_top_p_with_full_like_is_row_local():
    x, tok = _tensors(("x", (T, V)), ("tok", (T,)))
    tok = torch.sort(x.float(), -1, descending=True).indices[:, 0]  # kept tokens: finite log-probs
    moved = _no_worse_than_stock(top_p_logprob, [x, tok], (0,))
    assert moved["rewritten"] == moved["row_local"] == 1 and "declined" not in moved, moved


def test_a_declined_region_is_declined_once(caplog):
    x, tok = _tensors(("x", (T, V)), ("tok", (T,)))
    with caplog.at_level("INFO", logger="fx_passes"):
        transform(dynamo_graph(top_p_logprob, x, tok), Config(row_local=False))
    assert chunked_counters() == {"declined": 1, "declined:UNKNOWN_OP": 1}
    assert caplog.text.count("declined region") == 1
