"""Golden FX dumps of the graph after the passes, and what the graph computed before.

They read like documentation of what gets rewritten: each test's function is the
user's code, ``ops(before)`` lists the calls of its Dynamo graph in order (``.float``
is ``x.float()``, ``truediv`` is ``/``), and the golden text is the rewritten graph.
The "before" side is asserted as that list, not as Dynamo's printing of the graph,
which changes across the supported torch versions.  Regenerate the goldens on
purpose with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py`` and review
the diff.
"""

import re

import torch
import torch.nn.functional as F
from expecttest import TestCase

from tests.helpers import chunked_counters, ops, rewrite, rewrite_graphs

V = 16


def logits(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, V, dtype=dtype)


def tokens(*shape):
    return torch.randint(0, V, shape)


def logprob_t07(x, tok):
    logp = torch.log_softmax(x.float() / 0.7, dim=-1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


class TestGolden(TestCase):
    def test_logprob_temperature_07(self):
        before, after = rewrite_graphs(logprob_t07, logits(8), tokens(8))
        self.assertEqual(ops(before), ".float truediv log_softmax .unsqueeze .gather .squeeze")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_tok_ = L_tok_
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, l_tok_, 0.7, True, False);  l_x_ = l_tok_ = None
    getitem = row_stats[1];  row_stats = None
    unsqueeze_1 = getitem.unsqueeze(-1);  getitem = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze,)""")
        self.assertEqual(chunked_counters(), {"rewritten": 1})

    def test_logprob_temperature_1_is_removed(self):
        def fn(x, tok):
            logp = torch.log_softmax(x.float() / 1.0, dim=-1)
            return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

        before, after = rewrite_graphs(fn, logits(8), tokens(8))
        self.assertEqual(ops(before), ".float truediv log_softmax .unsqueeze .gather .squeeze")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_tok_ = L_tok_
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, l_tok_, None, True, False);  l_x_ = l_tok_ = None
    getitem = row_stats[1];  row_stats = None
    unsqueeze_1 = getitem.unsqueeze(-1);  getitem = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze,)""")

    def test_logprob_tensor_temperature_in_bf16_moves_after_upcast(self):
        def fn(x, tok, t):
            logp = F.log_softmax((x / t).to(torch.float32), -1)
            return torch.take_along_dim(logp, tok.unsqueeze(-1), dim=-1).squeeze(-1)

        before, after = rewrite_graphs(fn, logits(8), tokens(8), torch.tensor(0.7))
        self.assertEqual(ops(before), "truediv .to log_softmax .unsqueeze take_along_dim .squeeze")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_t_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_t_ = L_t_
    l_tok_ = L_tok_
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, l_tok_, l_t_, True, False);  l_x_ = l_tok_ = l_t_ = None
    getitem = row_stats[1];  row_stats = None
    unsqueeze_1 = getitem.unsqueeze(-1);  getitem = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze,)""")

    def test_temperature_stays_in_bf16_when_asked(self):
        def fn(x, tok, t):
            logp = F.log_softmax((x / t).to(torch.float32), -1)
            return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

        _, after = rewrite(fn, logits(8), tokens(8), torch.tensor(0.7), temperature_after_upcast=False)
        self.assertExpectedInline(after, """\
def forward(self, L_x_ : torch.Tensor, L_t_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_t_ = L_t_
    l_tok_ = L_tok_
    truediv = l_x_ / l_t_;  l_x_ = l_t_ = None
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(truediv, l_tok_, None, True, False);  truediv = l_tok_ = None
    getitem = row_stats[1];  row_stats = None
    unsqueeze_1 = getitem.unsqueeze(-1);  getitem = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze,)""")

    def test_entropy_forms(self):
        def fn(x):
            z = x.float()
            a = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
            return a

        def fn2(x):
            z = x.float()
            return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)

        _, after = rewrite(fn, logits(8))
        self.assertExpectedInline(after, """\
def forward(self, L_x_ : torch.Tensor):
    l_x_ = L_x_
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, None, None, True, True);  l_x_ = None
    getitem = row_stats[2];  row_stats = None
    neg = -getitem;  getitem = None
    a = -neg;  neg = None
    return (a,)""")
        _, after = rewrite(fn2, logits(8))
        self.assertExpectedInline(after, """\
def forward(self, L_x_ : torch.Tensor):
    l_x_ = L_x_
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, None, None, True, True);  l_x_ = None
    getitem = row_stats[2];  row_stats = None
    return (getitem,)""")

    def test_shift_slice_bsv_logprob_and_entropy_share_upcast(self):
        def fn(x, tok):
            z = x[:, :-1].float() / 0.7
            logp = torch.log_softmax(z, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            return logp.gather(-1, tok[:, 1:].unsqueeze(-1)).squeeze(-1), entropy

        before, after = rewrite_graphs(fn, logits(2, 5), tokens(2, 5))
        self.assertEqual(ops(before), "getitem .float truediv log_softmax .exp mul .sum neg getitem .unsqueeze .gather .squeeze")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_tok_ = L_tok_
    getitem = l_x_[(slice(None, None, None), slice(None, -1, None))];  l_x_ = None
    getitem_1 = l_tok_[(slice(None, None, None), slice(1, None, None))];  l_tok_ = None
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(getitem, getitem_1, 0.7, True, True);  getitem = getitem_1 = None
    getitem_2 = row_stats[1]
    unsqueeze_1 = getitem_2.unsqueeze(-1);  getitem_2 = None
    getitem_3 = row_stats[2];  row_stats = None
    neg = -getitem_3;  getitem_3 = None
    entropy = -neg;  neg = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze, entropy)""")

    def test_cross_entropy_hf_style(self):
        def fn(x, labels):
            x = x.float()
            labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
            return F.cross_entropy(x.view(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum")

        before, after = rewrite_graphs(fn, logits(2, 5), tokens(2, 5))
        self.assertEqual(ops(before), ".float pad getitem .view .reshape cross_entropy")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_x_ = L_x_
    l_labels_ = L_labels_
    pad = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
    labels = pad[(Ellipsis, slice(1, None, None))];  pad = None
    reshape = labels.reshape(-1);  labels = None
    reshape_1 = torch.reshape(l_x_, (-1, 16));  l_x_ = None
    ne = reshape != -100
    where = torch.where(ne, reshape, 0);  reshape = None
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(reshape_1, where, None, True, False);  reshape_1 = where = None
    getitem = row_stats[1];  row_stats = None
    neg = -getitem;  getitem = None
    where_1 = torch.where(ne, neg, 0.0);  ne = neg = None
    sum_1 = where_1.sum();  where_1 = None
    return (sum_1,)""")

    def test_nll_loss_mean(self):
        def fn(x, labels):
            return F.nll_loss(F.log_softmax(x.float(), -1), labels, ignore_index=3)

        _, after = rewrite(fn, logits(8), tokens(8))
        self.assertExpectedInline(after, """\
def forward(self, L_x_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_x_ = L_x_
    l_labels_ = L_labels_
    ne = l_labels_ != 3
    where = torch.where(ne, l_labels_, 0);  l_labels_ = None
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, where, None, True, False);  l_x_ = where = None
    getitem = row_stats[1];  row_stats = None
    neg = -getitem;  getitem = None
    where_1 = torch.where(ne, neg, 0.0);  neg = None
    sum_1 = where_1.sum();  where_1 = None
    sum_2 = ne.sum();  ne = None
    truediv = sum_1 / sum_2;  sum_1 = sum_2 = None
    return (truediv,)""")

    def test_dynamic_shapes(self):
        before, after = rewrite_graphs(logprob_t07, logits(8), tokens(8), dynamic=True)
        self.assertEqual(ops(before), ".float truediv log_softmax .unsqueeze .gather .squeeze")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, s77 : torch.SymInt, s27 : torch.SymInt, L_x_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_tok_ = L_tok_
    row_stats = fx_passes_kernels_log_softmax_given_row_stats(l_x_, l_tok_, 0.7, True, False);  l_x_ = l_tok_ = None
    getitem = row_stats[1];  row_stats = None
    unsqueeze_1 = getitem.unsqueeze(-1);  getitem = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze,)""")

    def test_lm_head_matmul_inside_the_region(self):
        def fn(h, w, tok):
            logp = torch.log_softmax((h @ w.T).float() / 0.7, -1)
            return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

        before, after = rewrite_graphs(fn, torch.randn(8, 4).bfloat16(), torch.randn(V, 4).bfloat16(), tokens(8),
                                chunk_budget_mib=1)
        self.assertEqual(ops(before), ".T matmul .float truediv log_softmax .unsqueeze .gather .squeeze")
        self.assertExpectedInline(after.code.strip(), """\
def forward(self, L_w_ : torch.Tensor, L_h_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_w_ = L_w_
    l_h_ = L_h_
    l_tok_ = L_tok_
    lm_head_row_stats = fx_passes_kernels_log_softmax_lm_head_lm_head_row_stats(l_h_, l_w_, None, l_tok_, 0.7, True, False, 1048576, '', 'auto');  l_h_ = l_w_ = l_tok_ = None
    getitem = lm_head_row_stats[1];  lm_head_row_stats = None
    unsqueeze_1 = getitem.unsqueeze(-1);  getitem = None
    squeeze = unsqueeze_1.squeeze(-1);  unsqueeze_1 = None
    return (squeeze,)""")
        self.assertEqual(chunked_counters(), {"rewritten": 1, "lm_head_fused": 1})

    # --- row-local regions (issue 21): the user's own ops in one row_local call ---------------
    # (the body's key is a hash of its code, which names Dynamo's nodes: shown as <key>)

    def test_row_local_top_k_log_prob(self):
        def fn(x, tok):
            z = x.float() / 0.7
            kth = z.topk(4, dim=-1).values[..., -1, None]
            logp = torch.log_softmax(z.masked_fill(z < kth, float("-inf")), dim=-1)
            return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

        before, after = rewrite_graphs(fn, logits(8), tokens(8))
        self.assertEqual(ops(before), ".float truediv .topk getitem getitem lt .masked_fill log_softmax "
                                      ".unsqueeze .gather .squeeze")
        self.assertExpectedInline(_keyless(after.code), """\
def forward(self, L_x_ : torch.Tensor, L_tok_ : torch.Tensor):
    l_x_ = L_x_
    l_tok_ = L_tok_
    unsqueeze = l_tok_.unsqueeze(-1);  l_tok_ = None
    row_local = fx_passes_kernels_row_local_engine_row_local('<key>', 0, 2, l_x_, unsqueeze);  l_x_ = unsqueeze = None
    getitem_1 = row_local[0];  row_local = None
    return (getitem_1,)""")
        self.assertEqual(chunked_counters(), {"rewritten": 1, "row_local": 1})

    def test_row_local_label_smoothing_hf_style(self):
        def fn(x, labels):
            z = x.float().view(-1, V)  # the view moves before the upcast: x.flatten(0, -2)
            return F.cross_entropy(z, labels.view(-1), label_smoothing=0.1)

        # (the engine's graph; by default stock is left this region: tests/test_worth.py)
        before, after = rewrite_graphs(fn, logits(2, 4), tokens(2, 4), leave_to_stock=False)
        self.assertEqual(ops(before), ".float .view .view cross_entropy")
        self.assertExpectedInline(_keyless(after.code), """\
def forward(self, L_x_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_x_ = L_x_
    l_labels_ = L_labels_
    view_1 = l_labels_.view(-1);  l_labels_ = None
    flatten = l_x_.flatten(0, -2);  l_x_ = None
    row_local = fx_passes_kernels_row_local_engine_row_local('<key>', 0, 2, flatten, view_1);  flatten = None
    getitem = row_local[0];  row_local = None
    sum_1 = getitem.sum();  getitem = None
    ne = view_1 != -100;  view_1 = None
    sum_2 = ne.sum();  ne = None
    truediv = sum_1 / sum_2;  sum_1 = sum_2 = None
    return (truediv,)""")
        self.assertEqual(chunked_counters(), {"rewritten": 1, "row_local": 1})


def _keyless(code: str) -> str:
    return re.sub(r"'[0-9a-f]{24}'", "'<key>'", code.strip())
