"""lm_head inside the chunk: never materialise the logits when a matmul makes them.

When the region's logits are ``hidden @ weight.T`` (``linear``/``matmul``, with or
without bias) in the same graph and nothing else reads them, the region calls the
custom op ``chunked_logits::lm_head_stats`` instead of reading logits:

* forward: a loop over row chunks; per chunk the logits chunk is computed in model
  precision, upcast, scaled in FP32 and reduced; only per-row results are kept.
* backward: a loop over vocabulary blocks; per block the logits of all rows are
  recomputed, the pointwise gradient is formed from the saved lse (and entropy),
  ``grad_weight[block]`` is accumulated in FP32 and stored in model precision once
  (never accumulated across chunks in bf16), and ``grad_hidden`` is accumulated in
  an FP32 ``[T, H]`` buffer.  Blocking the vocabulary (not the rows) is what avoids
  both a full FP32 ``[V, H]`` accumulator and bf16 accumulation of ``grad_weight``.
  On GPUs a block is one model-precision matmul over all rows (FP32 accumulation
  inside it); on CPUs, whose matmuls run on FP32 copies, a block is cut into row
  tiles (FP32 copies of one tile's rows, a ``[cols, H]`` FP32 accumulator for the
  block), so no FP32 copy of the whole ``hidden`` exists.

Chunk and block sizes come from ``Config.chunk_budget_mib``.  The per-chunk and
per-block bodies are compiled by Inductor (``dynamic=True``, once per dtype), so
generated kernels carry the hot path; the loops themselves run in Python, which
is why the op is opaque to the outer graph.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from .graph_ops import canon, is_low_precision, meta
from .ops import _grad_logits, _log_probs, _scaled, _shift_and_log_sum

__all__ = ["LMHead", "match_lm_head", "lm_head_row_stats"]


@dataclasses.dataclass
class LMHead:
    logits: Node  # the matmul / linear node, erased by the rewrite
    hidden: Node
    weight: Node  # [V, H]
    bias: Optional[Node]
    transpose: Optional[Node]  # the weight.T node of a matmul form, erased if unused


def _weight_of_transpose(node) -> Optional[Node]:
    """``W`` when ``node`` is ``W.T`` / ``W.t()`` / ``W.transpose(0, 1)`` of a 2-D W."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1:] in (("T",), ("mT",)):
        src = node.args[0]
    elif node.op == "call_method" and node.target == "t" and len(node.args) == 1:
        src = node.args[0]
    elif node.op == "call_method" and node.target == "transpose" and tuple(node.args[1:]) in ((0, 1), (1, 0), (-1, -2), (-2, -1)):
        src = node.args[0]
    else:
        return None
    v = meta(src)
    return src if isinstance(src, Node) and isinstance(v, torch.Tensor) and v.dim() == 2 else None


def _producer(x: Node) -> Optional[LMHead]:
    if x.op == "call_function" and x.target in (F.linear, torch._C._nn.linear):
        args = list(x.args) + [None] * 3
        hidden, weight = args[0], x.kwargs.get("weight", args[1])
        bias = x.kwargs.get("bias", args[2])
        return LMHead(x, hidden, weight, bias, None)
    is_matmul = (x.op == "call_function" and x.target in (__import__("operator").matmul, torch.matmul, torch.mm)) or (
        x.op == "call_method" and x.target in ("matmul", "mm", "__matmul__"))
    if is_matmul and len(x.args) == 2:
        weight = _weight_of_transpose(x.args[1])
        if weight is not None:
            return LMHead(x, x.args[0], weight, None, x.args[1])
    return None


def match_lm_head(region) -> tuple[Optional[LMHead], str]:
    """The lm_head producing the region's logits, or None with the reason it stays."""
    x = region.x
    head = _producer(x) if isinstance(x, Node) else None
    if head is None:
        return None, ""  # not an lm_head: nothing to say
    reads = set(region.roles) | ({region.moved_scale} if region.moved_scale is not None else set())
    if any(u not in reads for u in x.users) or region.meta_users:
        return None, "the logits are also used outside the region; the matmul runs once in full"
    h, w, b = meta(head.hidden), meta(head.weight), meta(head.bias) if head.bias is not None else None
    ok = (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and h.dim() >= 1
          and is_low_precision(head.hidden) and h.dtype == w.dtype == meta(x).dtype
          and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == w.dtype)))
    if not ok:
        return None, "the matmul's operands are not a model-precision [.., H] x [V, H] lm_head"
    for view in region.views:
        if canon(view) in ("reshape", "flatten") and meta(view).dim() != 2:
            return None, f"the row view {view.name} is not a flatten to [N, V]"
    return head, ""


# --- the custom op ----------------------------------------------------------------

@functools.lru_cache(None)
def _compiled(fn):
    # emulate_precision_casts: round the logits to the model dtype where the bodies say
    # so (``.to(dtype)``), as the unfused graph does; without it Inductor keeps FP32 in
    # registers, and the backward's recomputed logits would not match the forward's lse.
    compiled = torch.compile(fn, dynamic=True, fullgraph=True,
                             options={"emulate_precision_casts": True})

    @functools.wraps(fn)
    def call(*args):
        # The op's first call and later ones can see different requires_grad flags,
        # thread-local dispatch-key sets and grad modes (Dynamo guards on all three):
        # detached tensors, one key set and no_grad, so each body compiles once.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch.no_grad():
            return compiled(*args)
    return call


def _fwd_chunk(h, w, b, tokens, scale, is_div: bool, want_entropy: bool):
    z = _scaled(F.linear(h, w, b).to(h.dtype), scale, is_div)
    m, log_s = _shift_and_log_sum(z)
    lse = log_s + m
    logprob = None
    if tokens is not None:
        logprob = _log_probs(z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), m, log_s)
    entropy = None
    if want_entropy:
        logp = _log_probs(z, m.unsqueeze(-1), log_s.unsqueeze(-1))
        entropy = -(logp.exp() * logp).sum(-1)
    return lse, logprob, entropy


def _bwd_block(h, w, b, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, is_div: bool,
               dtype: torch.dtype):
    """Model-precision gradient of this block's logits (``ops._grad_logits``, as ops.RowStats).

    ``h``/``w``/``b`` may be FP32 copies of the model-precision operands (see
    ``_fp32_gemm``): the logits are rounded to ``dtype`` as the forward's were.
    """
    logits = F.linear(h, w, b).to(dtype)
    logp = _scaled(logits, scale, is_div) - lse.unsqueeze(-1)
    return _grad_logits(logp, tokens, entropy, g_lse, g_logprob, g_entropy, scale, is_div).to(dtype)


def _budget(budget_bytes: int, n: int, vocab: int) -> int:
    """The configured working set, but never more than a quarter of the FP32 logits:
    a small problem gets several chunks too, instead of one chunk bigger than stock."""
    return max(1, min(budget_bytes, n * vocab))


def _backward_tiles(budget: int, n: int, vocab: int, width: int,
                    device: torch.device) -> tuple[int, int, bool]:
    """(columns per vocabulary block, rows per row tile, FP32 GEMMs?) of the backward.

    On GPUs a block holds all rows (one model-precision matmul per block writes
    ``grad_weight[block]``, FP32 accumulation inside it): about ``budget / (8 T)``
    columns.  On CPUs the matmuls run on FP32 copies, made per tile so that no FP32
    copy of the whole ``hidden`` exists: blocks of ``budget / (16 H)`` columns with
    their own FP32 ``[cols, H]`` accumulator for ``grad_weight[block]`` (half the
    budget with the FP32 copy of the weight block), row tiles filling the other half
    (per element: bf16 logits, bf16 and FP32 gradient, FP32 matmul output; plus the
    FP32 copy of the ``hidden`` rows).
    """
    if not _fp32_gemm(device):
        return max(1, _budget(budget, n, vocab) // (8 * max(1, n))), max(1, n), False
    cols = max(1, min(vocab, budget // (16 * width)))
    rows = max(1, min(n, (budget // 2) // (12 * cols + 4 * width)))
    return cols, rows, True


def _even_splits(total: int, most: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into the fewest pieces of at most ``most``, their sizes
    differing by at most one (no 1-row remainder tile with its own 1-row kernel)."""
    k = -(-total // max(1, most))
    q, extra = divmod(total, max(1, k))
    bounds, start = [], 0
    for i in range(k):
        end = start + q + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _fp32_gemm(device: torch.device) -> bool:
    """Run the backward's matmuls on FP32 copies of the bf16/fp16 operands?

    The result is the same maths as a model-precision matmul (exact products of the
    model-precision values, FP32 accumulation, one rounding), and on CPUs without
    native bf16 matmul units FP32 GEMM is the faster kernel (measured: the backward
    of W4 about 1.5x faster).  GPUs keep their bf16/fp16 tensor-core matmuls.
    """
    return device.type == "cpu"


@torch.library.custom_op("chunked_logits::lm_head_stats", mutates_args=())
def lm_head_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                  want_entropy: bool, budget_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    lse, logprob, entropy = (hidden.new_zeros(n, dtype=torch.float32) for _ in range(3))
    rows = max(1, _budget(budget_bytes, n, vocab) // (4 * vocab))
    body = _compiled(_fwd_chunk)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        tok = tokens[r0:r1] if tokens is not None else None
        c_lse, c_lp, c_ent = body(hidden[r0:r1], weight, bias, tok, scale, scale_is_div, want_entropy)
        lse[r0:r1] = c_lse
        if c_lp is not None:
            logprob[r0:r1] = c_lp
        if c_ent is not None:
            entropy[r0:r1] = c_ent
    return lse, logprob, entropy


@lm_head_stats.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes):
    n = hidden.shape[0]
    return tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("chunked_logits::lm_head_stats_backward", mutates_args=())
def lm_head_stats_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           tokens: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
                           g_lse: torch.Tensor, g_logprob: torch.Tensor, g_entropy: torch.Tensor,
                           scale: Optional[torch.Tensor], scale_is_div: bool,
                           budget_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, vocab, width = hidden.shape[0], weight.shape[0], hidden.shape[1]
    grad_weight = torch.empty_like(weight)
    grad_bias = torch.zeros(vocab if bias is not None else 0, dtype=weight.dtype, device=weight.device)
    acc = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    cols, rows, fp32 = _backward_tiles(budget_bytes, n, vocab, width, hidden.device)
    body = _compiled(_bwd_block)
    for v0, v1 in _even_splits(vocab, cols):
        w32 = weight[v0:v1].float()
        b_blk = bias[v0:v1] if bias is not None else None
        w_in = w32 if fp32 else weight[v0:v1]
        b_in = b_blk.float() if fp32 and b_blk is not None else b_blk
        # grad_weight[block]: FP32 accumulation (inside one matmul, or across the row
        # tiles in this [cols, H] FP32 block), stored in model precision once
        gw = torch.zeros(v1 - v0, width, dtype=torch.float32, device=weight.device) if fp32 else None
        gb = torch.zeros(v1 - v0, dtype=torch.float32, device=weight.device) if bias is not None else None
        for r0, r1 in _even_splits(n, rows):
            h_in = hidden[r0:r1].float() if fp32 else hidden[r0:r1]
            g = body(h_in, w_in, b_in, tokens[r0:r1] - v0, lse[r0:r1],
                     entropy[r0:r1] if entropy is not None else None, g_lse[r0:r1],
                     g_logprob[r0:r1], g_entropy[r0:r1], scale, scale_is_div, hidden.dtype)
            g32 = g.float()
            if fp32:
                gw.addmm_(g32.t(), h_in)
            else:  # one row tile: all rows
                torch.mm(g.t(), hidden, out=grad_weight[v0:v1])
            acc[r0:r1].addmm_(g32, w32)
            if gb is not None:
                gb += g32.sum(0)
        if gw is not None:
            grad_weight[v0:v1] = gw
        if gb is not None:
            grad_bias[v0:v1] = gb
    return acc.to(hidden.dtype), grad_weight, grad_bias


@lm_head_stats_backward.register_fake
def _(hidden, weight, bias, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, scale_is_div,
      budget_bytes):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            weight.new_empty(weight.shape[0] if bias is not None else 0))


def _setup(ctx, inputs, output):
    hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes = inputs
    lse, _, entropy = output
    ctx.save_for_backward(hidden, weight, bias, tokens, scale, lse, entropy if want_entropy else None)
    ctx.has_tokens, ctx.scale_is_div, ctx.budget = tokens is not None, scale_is_div, budget_bytes


def _backward(ctx, g_lse, g_logprob, g_entropy):
    hidden, weight, bias, tokens, scale, lse, entropy = ctx.saved_tensors
    zeros = lse.new_zeros(lse.shape)
    g_lse = g_lse if g_lse is not None else zeros
    g_logprob = g_logprob if (g_logprob is not None and ctx.has_tokens) else zeros
    g_entropy = g_entropy if (g_entropy is not None and entropy is not None) else zeros
    if tokens is None:
        tokens = torch.zeros(lse.shape, dtype=torch.long, device=lse.device)
    gh, gw, gb = lm_head_stats_backward(hidden, weight, bias, tokens, lse, entropy, g_lse, g_logprob,
                                        g_entropy, scale, ctx.scale_is_div, ctx.budget)
    return gh, gw, (gb if bias is not None else None), None, None, None, None, None


lm_head_stats.register_autograd(_backward, setup_context=_setup)


def lm_head_row_stats(hidden, weight, bias, tokens, scale, scale_is_div: bool, want_entropy: bool,
                      budget_bytes: int):
    """Called from rewritten graphs: ``row_stats`` of ``hidden @ weight.T + bias``.

    ``hidden`` is ``[.., H]``; results have ``hidden``'s shape without the last dim.
    """
    rows_shape = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    tok2 = tokens.reshape(-1) if tokens is not None else None
    if scale is not None and not isinstance(scale, torch.Tensor):
        scale = torch.scalar_tensor(scale, dtype=torch.float32, device=hidden.device)
    lse, logprob, entropy = lm_head_stats(h2, weight, bias, tok2, scale, scale_is_div, want_entropy,
                                          budget_bytes)
    return (lse.reshape(rows_shape), logprob.reshape(rows_shape) if tokens is not None else None,
            entropy.reshape(rows_shape) if want_entropy else None)
