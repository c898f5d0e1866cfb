"""Should a row-local region be rewritten?  (:func:`fx_passes.match.row_local.find_row_region`
answers "can it be?"; this answers "does it pay?", as Inductor's ``pad_mm`` does.)

The row-local engine pays by not holding FP32 ``[rows, .., V]`` tensors.  Stock Inductor
holds none either for a region that reads only logits the graph is given (no lm_head
matmul to fuse) and whose every op it fuses into its row reductions, forward and
backward, saving only the model-precision input and a few numbers a row: conversions,
``+ - * /``, ``neg`` / ``exp`` / ``log`` / a power by a number, views, ``log_softmax``,
sums, means and ``logsumexp`` over the row, ``kl_div`` of log-probability targets and
``cross_entropy`` / ``nll_loss`` of class indices (weights and label smoothing included).
There the chunk loop only costs time, so such a region is left to stock with the reason
logged (:data:`LEFT_TO_STOCK`).  Anything else (a gather, a mask, a sort, a top-k, a scan,
``logaddexp``, a ``softmax`` ...) may make stock keep a ``[rows, V]`` tensor, and the region is rewritten.
``tests/test_worth.py`` checks this verdict against the code stock Inductor generates.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from ..fx.graph_ops import canon, meta, op_name, tensor_input
from .row_local import RowRegion, loss_arg
from .upcast import upcast_input

__all__ = ["left_to_stock", "LEFT_TO_STOCK", "FUSED_BY_STOCK"]

LEFT_TO_STOCK = ("stock Inductor holds no FP32 [rows, V] tensor here (it fuses every op into its row "
                 "reductions)")

# ops stock Inductor fuses into its row reductions with nothing [rows, V] saved for the backward
# (not ``softmax``: stock writes its exponentials to an FP32 [rows, V] buffer, forward and backward)
FUSED_BY_STOCK = frozenset({
    "float", "to", "type_as", "detach", "clone", "contiguous", "view", "reshape", "flatten",
    "add", "sub", "rsub", "mul", "div", "neg", "exp", "log", "pow",
    "log_softmax", "logsumexp", "sum", "mean", "kl_div", "cross_entropy", "nll_loss",
})


def _fused_by_stock(n: Node) -> bool:
    name = op_name(n)
    if canon(n) != "convert" and name not in FUSED_BY_STOCK:
        return False
    if name in ("cross_entropy", "nll_loss"):
        target = meta(loss_arg(n, "target"))
        return isinstance(target, torch.Tensor) and not target.is_floating_point()  # class indices
    if name == "kl_div":  # (of probabilities: torch's xlogy, whose backward stock saves a mask for)
        return loss_arg(n, "log_target", False) is True
    if name == "pow":
        return isinstance(n.args[1] if len(n.args) > 1 else n.kwargs.get("exponent"), (int, float))
    if name in ("sum", "mean", "logsumexp"):
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
        src = meta(tensor_input(n))
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return isinstance(src, torch.Tensor) and all(isinstance(d, int) and d % src.dim() == src.dim() - 1
                                                     for d in dims)  # over the row's last dim only
    return True


_VIEWS = frozenset({"getitem", "view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", "narrow"})


def _given(x: Optional[Node]) -> bool:
    """Are logits ``x`` an input of the graph (or a view of one): no matmul to fuse?"""
    while isinstance(x, Node) and x.op != "placeholder" and op_name(x) in _VIEWS:
        x = tensor_input(x)
    return isinstance(x, Node) and x.op == "placeholder"


def left_to_stock(region: RowRegion) -> Optional[str]:
    """Why stock Inductor should run ``region`` (:data:`LEFT_TO_STOCK`), or None: rewrite it."""
    logits = [x for x in map(upcast_input, (*region.seeds, *region.flattened)) if x is not None]
    if not logits or not all(map(_given, logits)) or not all(_fused_by_stock(n) for n in region.nodes):
        return None
    return LEFT_TO_STOCK
