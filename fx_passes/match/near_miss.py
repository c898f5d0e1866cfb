"""Near misses: graphs the pass leaves alone where a one-line change would let it
rewrite them.  Each is said once, as a WARNING naming what to change
(``chunked_logits: near miss: ...``, :func:`fx_passes.reporting.report.record_near_miss`):

* the graph returns model-precision logits and nothing in it reduces them: the loss is
  computed outside the compiled function (:func:`loss_outside`);
* ``log_softmax`` / ``softmax`` / ``logsumexp`` of model-precision logits computed in
  model precision, with ``upgrade_low_precision`` off (:func:`model_precision_head`);
* log-probs read by advanced indexing the matcher does not take (:func:`index_spelling`);
* FP32 logits read by a custom ``autograd.Function`` Dynamo traced (:func:`custom_function`).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import canon, get_arg, is_low_precision, last_dim, meta, tensor_input
from ..reporting.report import Decline, record_near_miss
from .graph_break import compiled_function
from .lm_head import from_lm_head
from .region import where
from .upcast import HEADS, reduces_rows, upcast_ancestor, upcast_input

__all__ = ["LOGITS_MIN_VOCAB", "loss_outside", "model_precision_head", "index_spelling", "custom_function"]

# A returned model-precision tensor with a last dim this wide is taken for logits even
# when no lm_head matmul is seen making it (Llama 2's vocabulary, the smallest common one;
# hidden sizes stay below it).
LOGITS_MIN_VOCAB = 32000


def loss_outside(graph: Graph) -> None:
    """The graph returns model-precision logits ``[.., V]`` (an lm_head matmul's output,
    or a last dim of at least ``LOGITS_MIN_VOCAB``) that no softmax / loss in it reads.
    (The caller calls it for a graph with no candidate region.)"""
    out = next(iter(graph.find_nodes(op="output")), None)
    for x in _nodes(out.args) if out is not None else []:
        v = meta(x)
        if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and is_low_precision(v)):
            continue
        wide = isinstance(v.shape[-1], int) and v.shape[-1] >= LOGITS_MIN_VOCAB
        if not (wide or from_lm_head(x)) or any(canon(u) in HEADS for u in x.users):
            continue
        widen = compiled_function(graph)
        record_near_miss(where(x), (
            f"the compiled graph{' (' + widen + ')' if widen else ''} returns the {_dtype(v)} logits "
            f"{x.name} "
            f"[.., {v.shape[-1]}] and computes no loss from them, so there is nothing to rewrite: "
            f"widen {'that compile' if widen else 'the compile'} to the function that computes the loss "
            "too (torch.compile a step function that calls the model and the loss, or give the model the "
            "labels so that its forward computes the loss), with no graph break between them"))


def model_precision_head(head: Node, upgrade: bool) -> None:
    """``head`` (a log_softmax / softmax / logsumexp over the last dim) computes in model
    precision on model-precision logits that a vocabulary reduction reads, and the
    option that would take it is off."""
    x = tensor_input(head)
    if upgrade or canon(head) not in ("log_softmax", "softmax", "logsumexp") or not isinstance(x, Node):
        return
    if not (is_low_precision(x) and is_low_precision(head) and last_dim(get_arg(head, "dim"), meta(x).dim())
            and reduces_rows(x)):
        return
    record_near_miss(where(head), (
        f"{canon(head)} of the {_dtype(meta(x))} logits {x.name} is computed in {_dtype(meta(x))} (no FP32 "
        "upcast, nothing to remove): to have it computed in FP32 per chunk of rows, with no FP32 copy of "
        "the logits, set upgrade_low_precision=True (options={'upgrade_low_precision': True} or "
        "Config(upgrade_low_precision=True)); results become FP32"))


def index_spelling(decline: Decline) -> None:
    """``decline`` (an op the pass does not know reads the region) names advanced
    indexing of the log-probs: say how to write it so the pass takes it."""
    reader: Optional[Node] = getattr(decline, "reader", None)
    src = tensor_input(reader) if reader is not None and canon(reader) == "getitem" else None
    if not isinstance(src, Node) or canon(src) not in ("log_softmax", "softmax"):
        return
    index = get_arg(reader, "index")
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != meta(src).dim() or not isinstance(index[-1], Node):
        return  # (not one vocabulary entry per row picked: e.g. a mask of rows)
    spelled = ", ".join(_arg(i) for i in index)
    record_near_miss(where(reader), (
        f"{reader.name} reads {src.name} by advanced indexing ({src.name}[{spelled}]), "
        "which the pass does not take (it takes lp[torch.arange(N), tokens] of [N, V] log-probs): write it "
        f"as {src.name}.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)"))


def custom_function(graph: Graph) -> None:
    """An FP32 upcast of model-precision logits (or a tensor computed from one) read by a
    custom ``autograd.Function`` that Dynamo traced (``autograd_function_apply``): its
    forward and its hand-written backward are the user's, which the pass does not rewrite
    (it cannot prove that backward is the forward's gradient)."""
    for call in graph.nodes:
        name = getattr(call.target, "__name__", str(call.target))
        if call.op != "call_function" or "autograd_function_apply" not in name:
            continue
        for x in call.args[2:]:
            up = upcast_ancestor(x) if isinstance(x, Node) and upcast_input(x) is None else x
            v = meta(x) if isinstance(x, Node) else None
            if up is None or not (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() >= 2):
                continue
            record_near_miss(where(call), (
                f"the FP32 logits {x.name} [{', '.join(str(s) for s in v.shape)}] (upcast at "
                f"{where(up)}) are "
                f"read by the custom autograd.Function {_function_name(call)} (forward at "
                f"{_forward_line(call)}), "
                "whose forward and hand-written backward the pass does not rewrite, so the FP32 copy and "
                "what "
                "the Function saves for backward stay: compute it with torch ops outside an "
                "autograd.Function "
                "(the pass derives the backward itself), or pass the model-precision logits into the "
                "Function "
                "and upcast one chunk of rows at a time inside it"))
            break


def _function_name(call: Node) -> str:
    """The Function's name as the call's source line spells it (``Name.apply(``): the last
    line of the stack trace that has one (torch 2.13 adds a line of carets after it)."""
    lines = (call.meta.get("stack_trace") or "").strip().splitlines()
    found = next((m for m in map(re.compile(r"([\w.]+)\.apply\(").search, reversed(lines)) if m), None)
    return found.group(1) if found else "(its name unknown)"


def _forward_line(call: Node) -> str:
    body = getattr(call.graph.owning_module, str(call.args[0].target), None) if isinstance(
        call.args[0], Node) else None
    for n in getattr(getattr(body, "graph", None), "nodes", ()):
        trace = [ln.strip() for ln in (n.meta.get("stack_trace") or "").splitlines() if ln.strip().startswith(
            "File")]
        if trace:
            return trace[-1]
    return "an unknown line"


def _nodes(args) -> list[Node]:
    found: list[Node] = []
    torch.fx.node.map_arg(args, found.append)
    return list(dict.fromkeys(found))


def _arg(i) -> str:
    return i.name if isinstance(i, Node) else ":" if i == slice(None) else repr(i)


def _dtype(v: torch.Tensor) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(v.dtype, str(v.dtype))
