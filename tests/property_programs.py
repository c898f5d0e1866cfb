"""Small programs built from the patterns the chunked-logits matcher knows, and their
neighbours, for the property tests (tests/test_properties.py).

A :class:`Case` describes one program: the logits' dtype and layout, a shift slice,
a temperature (how it is given and where it is applied), the per-row results it
computes (log-prob, entropy in three forms, logsumexp, cross-entropy / nll_loss with
an ignore_index and a reduction), masked logits, training or no_grad, static or
dynamic shapes, and at most one *twist*: a change that makes the pass decline, with
the :class:`~fx_passes.reporting.report.Reason` it must give (see ``TWISTS``).

The same program runs three ways: with ``up = .float()`` (the user's program, under
the pass or stock), and with ``up = .double()`` on FP64 copies of the inputs (the
reference).  :func:`assert_no_worse` checks that the pass's error against the
reference never exceeds stock's error plus a per-dtype tolerance, element by element,
for every output and every gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from hypothesis import assume
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from fx_passes.config import Config
from fx_passes.fx.graph_ops import canon
from fx_passes.kernels.log_softmax.given import row_stats
from fx_passes.kernels.log_softmax.lm_head import lm_head_row_stats
from fx_passes.kernels.log_softmax.lm_head_masked import lm_head_row_stats_masked
from fx_passes.kernels.log_softmax.loss import lm_head_loss
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.pipeline import ROW_LOCAL_RETRIES, transform
from fx_passes.reporting.report import COUNTER, Reason

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TEMPERATURE = 0.7

# Twist -> the reason the pass must decline with (None: it must still rewrite).
TWISTS: dict[str, Optional[Reason]] = {
    "none": None,
    "two_regions": None,  # two separate upcasts of the same logits: two rewrites
    "fp32": Reason.NOT_LOW_PRECISION,  # the logits are FP32 already
    "vocab1": Reason.VOCAB_TOO_SMALL,  # V == 1
    "per_row_after": Reason.TEMPERATURE,  # z.float() / t[:, None]
    "temp_grad": Reason.TEMPERATURE,  # a 0-d temperature that requires grad, after the upcast
    "two_scales": Reason.TEMPERATURE,  # z.float() / t * 2
    "return_z": Reason.ESCAPES,  # the graph returns the FP32 logits
    "return_logp": Reason.ESCAPES,  # ... or the FP32 log-softmax
    "return_probs": Reason.ESCAPES,  # ... or the FP32 softmax
    "consumer": Reason.UNKNOWN_OP,  # another op reads the FP32 logits (z.amax(-1))
    "softmax_dtype": Reason.UNKNOWN_OP,  # log_softmax(z, -1, dtype=torch.float64)
    "branch_view": Reason.UNKNOWN_OP,  # entropy on [B, S, V], cross-entropy on z.reshape(-1, V)
    "dim0": Reason.NOT_LAST_DIM,  # log_softmax over dim 0
    "index2": Reason.INDEX_SHAPE,  # gather of two tokens per row
    "label_smoothing": Reason.LOSS_OPTIONS,
    "ce_weight": Reason.LOSS_OPTIONS,
    "ce_3d": Reason.LOSS_OPTIONS,  # cross_entropy on [B, V, S] (class dim 1)
    "several_indices": Reason.SEVERAL_INDICES,  # token log-probs and a CE on other labels
    "late_index": Reason.ORDER,  # the tokens depend on the entropy the region computes
    "mutate_logits": Reason.MUTATION,  # x.mul_(2) between the upcast and the results
    "mutate_temp": Reason.MUTATION,  # t.mul_(2) after z = x.float() / t
    "soft_labels": Reason.LOSS_OPTIONS,  # cross_entropy with class probabilities as target
    "shape_query": None,  # the graph reads z.shape (a SymInt with dynamic=True): still rewritten
    "inner_no_grad": None,  # the whole region inside `with torch.no_grad():`
    "mutate_index": Reason.MUTATION,  # tokens.add_(1) after the first result, before the gather
    "nograd_sink": None,  # the token log-prob taken under no_grad after the entropy: detached
    "autocast_upcast": Reason.STATE,  # the upcast inside an autocast block, the reductions outside
    "return_upcast": Reason.ESCAPES,  # returns x.float() while a temperature scales it
    "mask_fp32": Reason.UNKNOWN_OP,  # x.float().masked_fill(m, -inf)
    # Known bugs (see KNOWN_BUGS): the outcome users expect; never generated until fixed.
}

# With Config.row_local (Case.row_local), what the row-local path makes of the twists the
# hand-derived path declines for a reason it retries (pipeline.ROW_LOCAL_RETRIES): None =
# rewritten into one row_local call; a Reason = declined with it.  Twists not listed keep
# their TWISTS outcome.
ROW_LOCAL_TWISTS: dict[str, Optional[Reason]] = {
    "per_row_after": None,
    "temp_grad": Reason.NOT_ROW_LOCAL,  # a 0-d tensor read whole by every chunk, and it requires grad
    "two_scales": None,
    "consumer": None,
    "softmax_dtype": None,
    "branch_view": Reason.NOT_ROW_LOCAL,  # reshape(-1, V) regroups the rows
    "dim0": Reason.NOT_ROW_LOCAL,  # log_softmax over dim 0: across rows
    "index2": None,
    "label_smoothing": None,
    "ce_weight": None,
    "ce_3d": Reason.NOT_ROW_LOCAL,  # the transpose to [B, V, S] moves the vocabulary
    "several_indices": None,
    "soft_labels": None,
    "mask_fp32": None,
}

# Cases the pass gets wrong today: twist -> the bug.  tests/test_properties.py has one strict
# xfail per bug; the generator skips them (delete an entry when its bug is fixed).
KNOWN_BUGS: dict[str, str] = {}  # none open (fixed: return_upcast, mask_fp32 reasons; NLLLoss()
# built inside the function; a SymInt ignore_index)


# Bugs of the compiled code only (the cheap path, which runs the rewritten graph eagerly,
# does not see them): tests/test_properties.py marks full-compile cases with them.
KNOWN_FULL_COMPILE_BUGS: dict[str, str] = {}  # none open (fixed: lm_head rounding, restarts)


def known_full_compile_bug(case: "Case") -> Optional[str]:
    return KNOWN_FULL_COMPILE_BUGS.get(case.twist)


def known_bug(case: "Case") -> Optional[str]:
    return KNOWN_BUGS.get(case.twist)


INDEX_HEADS = ("logprob", "take_along", "ce", "nll")
ROW_HEADS = ("ent_plogp", "ent_lse", "ent_exp", "lse")
LOSS_HEADS = ("ce", "nll")


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "bf16"  # logits dtype: bf16 | fp16 | fp32
    layout: str = "TV"  # TV: logits [T, V]; BSV: [B, S, V]
    rows: int = 5  # T, or S for BSV
    batch: int = 2  # B for BSV
    vocab: int = 11
    shift: str = "none"  # none | before | after: logits[..., :-1, :] before / after the upcast;
    #                      last: logits[:, -1] after the upcast (BSV: last-token scoring)
    upcast: str = "float"  # float | to | to_kw | type: how the FP32 upcast is spelled
    temp: str = "const"  # none | const | one | float_arg | tensor0d | per_row
    temp_where: str = "after"  # after: x.float() / t; before: (x / t).float()
    temp_op: str = "div"  # div: z / t; mul: z * (1/t); rmul: (1/t) * z
    index_head: Optional[str] = "logprob"  # None | logprob | take_along | ce | nll
    row_heads: tuple[str, ...] = ()  # subset of ROW_HEADS, computed before the index head
    reduction: str = "mean"  # of ce / nll
    ignore_index: int = -100
    explicit_kwargs: bool = False  # pass default loss kwargs explicitly
    keepdim: bool = False  # keepdim=True on logsumexp / entropy sums
    spelling: str = "torch"  # torch | F | method: how (log_)softmax is called
    dim_pos: bool = False  # dim=z.dim() - 1 instead of -1
    flatten: str = "reshape"  # reshape | flatten | view: how BSV logits become [N, V] for a loss
    mask: str = "none"  # none | data | graph | token | row: -inf logits
    noncontig: bool = False  # the logits input is column-major (a transposed buffer)
    loss_module: bool = False  # torch.nn.CrossEntropyLoss / NLLLoss instead of F.*
    lm_head: str = "none"  # none | matmul | linear | linear_bias: logits = hidden @ W.T in the graph
    chunk: str = "default"  # lm_head chunking (Config.chunk_budget_mib): default | one_row |
    #                         two_rows | all_rows | more_rows (forward rows per chunk) | one_col
    #                         (one vocabulary column per backward block)
    train: bool = False
    dynamic: bool = False
    twist: str = "none"
    seed: int = 0
    row_local: bool = False  # Config.row_local: the row-local path retries what the hand path declines

    # ---- what the pass must do ---------------------------------------------------------------
    @property
    def reason(self) -> Optional[Reason]:
        if self.row_local and self.twist in ROW_LOCAL_TWISTS:
            return ROW_LOCAL_TWISTS[self.twist]
        return TWISTS[self.twist]

    @property
    def by_row_local(self) -> bool:
        """Rewritten by the row-local path (a twist the hand-derived path declines)?"""
        return self.row_local and self.twist in ROW_LOCAL_TWISTS and self.reason is None

    @property
    def hand_rewritten(self) -> bool:
        """Rewritten by the hand-derived path (row_stats / the lm_head loop)?"""
        return TWISTS[self.twist] is None

    def acceptable_counters(self) -> list[dict[str, int]]:
        """:meth:`expected_counters`, and where the row-local path takes a twist (or
        retries the hand path's decline of it) in the plain layout only (``[T, V]`` logits
        read whole, no lm_head: a shift or a flatten in other layouts indexes or regroups
        rows), its decline too: the reason it meets first, which for a twist it declines
        anyway (``late_index``: ``ORDER``) may be the shift's ``NOT_ROW_LOCAL``; and
        ``ESCAPES`` where a result has the logits' shape (:attr:`results_like_logits`)."""
        plain = self.layout == "TV" and self.shift == "none" and self.lm_head == "none"
        retried = self.row_local and (self.by_row_local or self.reason in ROW_LOCAL_RETRIES)
        out = [self.expected_counters()]
        if retried and not plain:
            out.append({"declined": 1, "declined:NOT_ROW_LOCAL": 1})
        if self.row_local and self.results_like_logits and (self.by_row_local or self.reason is not None):
            out.append({"declined": 1, "declined:ESCAPES": 1})
        return out

    @property
    def results_like_logits(self) -> bool:
        """Does a per-row result end in a dim of the vocabulary's size (two tokens picked a
        row from a vocabulary of two; ``[B, S]`` results of ``[B, S, V]`` logits with S = V),
        so that by its shape it is an FP32 ``[rows, .., V]`` tensor the row-local path
        declines to return (``ESCAPES``)?"""
        seq = self.rows - (1 if self.shift in ("before", "after") else 0)
        return (self.twist == "index2" and self.vocab == 2) or (
            self.layout == "BSV" and self.shift != "last" and seq == self.vocab)

    def expected_counters(self) -> dict[str, int]:
        if self.by_row_local:
            return {"rewritten": 1, "row_local": 1}
        if self.reason is None:
            out = {"rewritten": 2 if self.twist == "two_regions" else 1}
            if self.lm_head_x and self.twist == "two_regions":
                out["lm_head_not_fused"] = 2  # each upcast is a region; the logits feed both
            elif self.lm_head_fused:
                out["lm_head_fused"] = 1
            return out
        return {"declined": 1, f"declined:{self.reason.name}": 1}

    @property
    def scale_moved(self) -> bool:
        """Does the pass move the temperature from before the upcast to after it (FP32
        division, no bf16 rounding: ``Config.temperature_after_upcast``)?"""
        return (self.hand_rewritten and self.temp not in ("none", "per_row") and self.temp_where == "before"
                and self.twist != "two_regions")

    @property
    def lm_head_x(self) -> bool:
        """Are the model-precision logits a region reads the lm_head matmul's output itself
        (or a row slice of it: the shift before the upcast)?
        (A temperature before the upcast is moved after it when those logits feed only this
        region and it is not per-row.)"""
        if self.lm_head == "none" or self.mask == "graph":  # (a shift before the upcast: done on hidden)
            return False
        if self.temp != "none" and self.temp_where == "before":
            return self.temp != "per_row" and self.twist != "two_regions"
        return True

    @property
    def lm_head_fused(self) -> bool:
        """Is the lm_head matmul fused into the chunk loop?"""
        return self.lm_head_x and self.hand_rewritten and self.twist != "two_regions"

    def rows_of_z(self) -> int:
        """Rows of the scaled FP32 logits every head reads."""
        if self.layout == "TV":
            return self.rows - (1 if self.shift in ("before", "after") else 0)
        if self.shift == "last":
            return self.batch
        return self.batch * (self.rows - (1 if self.shift in ("before", "after") else 0))

    def config(self) -> Config:
        """The pass's settings for this case: the lm_head chunk sizes."""
        n, v = self.rows_of_z(), self.vocab
        budget = {"default": None, "one_row": 4 * v, "two_rows": 8 * v, "all_rows": 4 * v * n,
                  "more_rows": 4 * v * (n + 3), "one_col": 8 * n}[self.chunk]
        # (the engine, also on regions stock Inductor runs as well: match/worth.py, tests/test_worth.py)
        if budget is None:
            return Config(row_local=self.row_local, leave_to_stock=False)
        return Config(chunk_budget_mib=(budget + 0.5) / 2**20, row_local=self.row_local, leave_to_stock=False)

    def options(self) -> dict[str, Any]:
        chunk = {} if self.chunk == "default" else {"chunk_budget_mib": self.config().chunk_budget_mib}
        return {**chunk, "row_local": self.row_local, "leave_to_stock": False}

    @property
    def heads(self) -> tuple[str, ...]:
        return self.row_heads + ((self.index_head,) if self.index_head else ())

    @property
    def flat(self) -> bool:
        """Do the heads read [N, V] logits (a loss on BSV logits)?"""
        return self.layout == "BSV" and any(h in LOSS_HEADS for h in self.heads) \
            and self.twist not in ("branch_view", "ce_3d")

    def label(self) -> str:
        default = Case()
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)]
        return f"Case({', '.join(diff)})"


def normalize(case: Case) -> Case:
    """Make a case consistent: the twist's requirements, sizes that the layout allows."""
    c = dataclasses.asdict(case)
    c["row_heads"] = tuple(dict.fromkeys(c["row_heads"]))
    tw = c["twist"]
    if tw == "fp32":
        c["dtype"] = "fp32"
    elif c["dtype"] == "fp32":
        c["dtype"] = "bf16"
    if tw == "vocab1":
        c["vocab"] = 1
    elif c["vocab"] < 2:
        c["vocab"] = 2
    if tw == "per_row_after":
        c["temp"], c["temp_where"] = "per_row", "after"
    elif c["temp"] == "per_row":
        c["temp_where"] = "before"
    if tw == "temp_grad":
        c["temp"], c["temp_where"] = "tensor0d", "after"
    if tw == "two_scales":
        c["temp_where"] = "after"
        if c["temp"] in ("none", "per_row"):
            c["temp"] = "const"
    if tw in ("return_logp", "dim0", "index2", "late_index", "softmax_dtype"):
        c["index_head"] = "logprob"
    if tw in ("label_smoothing", "ce_weight", "several_indices", "ce_3d"):
        c["index_head"] = "ce"
    if tw == "late_index" and not c["row_heads"]:
        c["row_heads"] = ("ent_plogp",)
    if tw == "branch_view":
        c["layout"], c["index_head"] = "BSV", "ce"
        c["row_heads"] = c["row_heads"] or ("ent_exp",)
    if tw == "ce_3d":
        c["layout"], c["row_heads"], c["shift"] = "BSV", (), "none"
        c["rows"] = max(c["rows"], 2)  # the last dim of [B, V, S] is S: one would be VOCAB_TOO_SMALL
        if c["temp"] == "per_row":
            c["temp"] = "tensor0d"
    if tw in ("return_upcast", "mutate_temp"):
        c["temp_where"] = "after"
        if c["temp"] in ("none", "per_row"):
            c["temp"] = "const" if tw == "return_upcast" else "tensor0d"
    if tw == "mutate_temp":
        c["temp"] = "tensor0d"
    if tw in ("mutate_logits", "mutate_temp"):
        c["train"] = False  # in-place on a leaf that requires grad / a saved tensor: eager errors
    if tw == "soft_labels":  # class probabilities as target: no ignore_index
        c["index_head"], c["ignore_index"], c["explicit_kwargs"] = "ce", -100, False
    if tw == "shape_query":
        c["dynamic"] = True
    if tw == "mutate_index":
        c["index_head"] = "logprob"
        c["row_heads"] = c["row_heads"] or ("ent_exp",)
    if tw == "nograd_sink":
        c["index_head"], c["train"] = "logprob", True
        c["row_heads"] = c["row_heads"] or ("ent_exp",)
    if c["shift"] == "last" and c["layout"] != "BSV":
        c["shift"] = "after"
    if c["shift"] == "last" and (tw == "ce_3d" or any(h in LOSS_HEADS for h in
                                                      c["row_heads"] + (c["index_head"],))):
        c["shift"] = "after"  # [B, V] logits and a loss: keep the loss cases [N, V]
    if c["index_head"] is None and not c["row_heads"]:
        c["row_heads"] = ("ent_plogp",)
    if c["lm_head"] != "none":  # the logits are computed: no -inf in them, no layout of their own
        c["noncontig"] = False
        if c["mask"] in ("data", "token", "row"):
            c["mask"] = "none"
    else:
        c["chunk"] = "default"
    if tw == "consumer" and c["mask"] != "none":
        c["mask"] = "none"  # amax of a masked row is fine, but keep the case simple
    lo = 2 if (c["dynamic"] or c["shift"] != "none") else 1
    c["rows"] = max(c["rows"], lo + (1 if c["dynamic"] and c["shift"] != "none" else 0))
    if c["dynamic"] and c["layout"] == "BSV":
        c["batch"] = max(c["batch"], 2)
        if c["batch"] == c["rows"]:
            c["batch"] += 1
    sizes = (c["rows"], c["batch"]) if c["layout"] == "BSV" else (c["rows"],)
    if c["dynamic"] and c["vocab"] > 1 and c["vocab"] in sizes:
        # Dynamo's duck sizing gives equal sizes one symbol: another size would recompile
        c["vocab"] = max(sizes) + 1
    return Case(**c)


# ---- the program ---------------------------------------------------------------------------------

ARGS = ("x", "tok", "labels", "t", "mask", "weight", "soft", "hidden", "lm_w", "lm_b")
UPCASTS = {"float": "{}.float()", "to": "{}.to(torch.float32)", "to_kw": "{}.to(dtype=torch.float32)",
           "type": "{}.type(torch.float32)"}


def program_source(case: Case, reference: bool = False) -> str:
    """The program as Python source, with every setting a literal (as users write them).

    ``program(x, tok, labels, t, mask, weight, soft, hidden, lm_w, lm_b) -> tuple``.  With
    ``reference=True`` the upcast is ``.double()`` (the inputs are then FP64 too).
    """
    c = case
    up = "{}.double()" if reference else UPCASTS[c.upcast]
    lines: list[str] = []
    emit = lines.append

    def sl(name: str) -> str:
        return f"{name}[:, :-1]" if c.layout == "BSV" else f"{name}[:-1]"

    def lsm(z: str, dim: str = "-1", extra: str = "") -> str:
        if c.spelling == "F":
            return f"F.log_softmax({z}, dim={dim}{extra})"
        if c.spelling == "method":
            return f"{z}.log_softmax({dim}{extra})"
        return f"torch.log_softmax({z}, {dim}{extra})"

    def sm(z: str, dim: str = "-1") -> str:
        if c.spelling == "F":
            return f"F.softmax({z}, dim={dim})"
        if c.spelling == "method":
            return f"{z}.softmax({dim})"
        return f"torch.softmax({z}, {dim})"

    def scale(v: str) -> str:
        if c.temp in ("const", "one"):
            k = TEMPERATURE if c.temp == "const" else 1.0
            s = repr(k if c.temp_op == "div" else 1.0 / k)
        else:  # float_arg, tensor0d, per_row: the input already holds the divisor / multiplier
            s = "t.unsqueeze(-1)" if c.temp == "per_row" else "t"
        return {"div": f"{v} / {s}", "mul": f"{v} * {s}", "rmul": f"{s} * {v}"}[c.temp_op]

    emit({"none": "h = x", "matmul": "h = hidden @ lm_w.T", "linear": "h = F.linear(hidden, lm_w)",
          "linear_bias": "h = F.linear(hidden, lm_w, lm_b)"}[c.lm_head])
    if reference and c.lm_head != "none":
        # The program's logits are the model-precision matmul output: take its very values
        # (the same op on the same model-precision inputs, which the FP64 ones hold
        # exactly), so that the reference differs from the program only downstream.  (Not
        # the exact product rounded once: a 16-bit GEMM on a CPU misrounds a logit now and
        # then, stock and the pass read that one alike, and stock's own rounding of a
        # temperature applied after it may land back on the exact value where the pass's
        # FP32 division cannot.)
        d = DTYPES[c.dtype]
        emit("h = h + (({}).double() - h).detach()".format({
            "matmul": f"hidden.to({d}) @ lm_w.to({d}).T", "linear": f"F.linear(hidden.to({d}), lm_w.to({d}))",
            "linear_bias": f"F.linear(hidden.to({d}), lm_w.to({d}), lm_b.to({d}))"}[c.lm_head]))
        emit("h = keep_grad(h)  # (the exact gradient of the logits: term_scales)")
    if c.mask == "graph":
        emit("h = h.masked_fill(mask, float('-inf'))")
    if c.twist == "ce_3d":
        emit("h = h.transpose(1, 2)  # [B, V, S]: the class dim is dim 1, as cross_entropy wants")
    if c.shift == "before":
        emit(f"h, tok, labels, mask = {sl('h')}, {sl('tok')}, {sl('labels')}, {sl('mask')}")
        if c.twist == "soft_labels":
            emit(f"soft = {sl('soft')}")
        if c.temp == "per_row":
            emit(f"t = {sl('t')}")
    if c.temp != "none" and c.temp_where == "before":
        emit(f"h = {scale('h')}")
        if reference and not c.scale_moved:
            # The program divides in model precision and the pass keeps that division: round
            # like the program does.  (A moved temperature is divided in FP32: no rounding.)
            emit(f"h = h.to({DTYPES[c.dtype]}).double()")
    if c.twist == "autocast_upcast":
        emit("with torch.autocast('cpu', dtype=torch.bfloat16):")
        emit(f"    z = upcast = {up.format('h')}")
    else:
        emit(f"z = upcast = {up.format('h')}")
    second = c.twist == "two_regions"
    if second:
        emit(f"z2 = {up.format('h')}")
    if c.twist == "mask_fp32":
        emit("z = z.masked_fill(mask, float('-inf'))")
    if c.temp != "none" and c.temp_where == "after":
        emit(f"z = {scale('z')}")
        if second:
            emit(f"z2 = {scale('z2')}")
    if c.twist == "two_scales":
        emit("z = z * 2.0")
    if c.twist == "mutate_logits":
        emit("h.mul_(2)")
    if c.twist == "mutate_temp":
        emit("t.mul_(2)")
    if c.shift in ("after", "last"):
        cut = sl if c.shift == "after" else (lambda n: f"{n}[:, -1]")
        emit(f"z, tok, labels = {cut('z')}, {cut('tok')}, {cut('labels')}")
        if c.twist == "soft_labels":
            emit(f"soft = {cut('soft')}")
        if second:
            emit(f"z2 = {cut('z2')}")
    if c.flat:
        emit({"reshape": "z = z.reshape(-1, z.shape[-1])", "flatten": "z = z.flatten(0, 1)",
              "view": "z = z.contiguous().view(-1, z.shape[-1])"}[c.flatten])
        emit("tok, labels = tok.reshape(-1), labels.reshape(-1)")
        if c.twist == "soft_labels":
            emit("soft = soft.reshape(-1, soft.shape[-1])")
    zl = "z"
    if c.twist == "branch_view":
        emit("zl, labels = z.reshape(-1, z.shape[-1]), labels.reshape(-1)")
        zl = "zl"
    dim = "z.dim() - 1" if c.dim_pos else "-1"
    if c.twist == "mutate_index":
        emit("idx = tok.unsqueeze(-1)")

    body: list[str] = []
    out: list[str] = []
    uses_l = any(h in ("ent_plogp", "ent_exp") for h in c.row_heads) or c.twist in (
        "several_indices", "return_logp") or (c.index_head in ("logprob", "take_along") and c.twist not in (
            "dim0", "softmax_dtype")) or (c.index_head == "nll" and c.twist != "branch_view")
    if uses_l:
        body.append(f"logp = {lsm('z', dim)}")
    if any(h in ("ent_plogp", "ent_lse") for h in c.row_heads):
        body.append(f"p = {sm('z', dim)}")
    kd = ", keepdim=True" if c.keepdim else ""
    for i, head in enumerate(c.row_heads):
        expr = {"ent_plogp": f"-(p * logp).sum(-1{kd})",
                "ent_lse": f"torch.logsumexp(z, -1{kd}) - (p * z).sum(-1{kd})",
                "ent_exp": f"-(logp.exp() * logp).sum(-1{kd})",
                "lse": f"torch.logsumexp(z, {dim}{kd})"}[head]
        body.append(f"r{i} = {expr}")
        out.append(f"r{i}")
    if c.twist == "mutate_index":
        body.append("tok.add_(1)")
        body.append("tok.remainder_(z.shape[-1])")
    if c.twist == "several_indices":
        body.append("lp_tok = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)")
        out.append("lp_tok")
    head = c.index_head
    if head in ("logprob", "take_along"):
        lp = "logp"
        if c.twist == "dim0":
            body.append(f"lp0 = {lsm('z', '0')}")
            lp = "lp0"
        elif c.twist == "softmax_dtype":
            body.append(f"lp64 = {lsm('z', dim, extra=', dtype=torch.float64')}")
            lp = "lp64"
        if c.twist == "late_index":
            body.append("idx = (tok + (r0.detach().reshape(tok.shape) > 1e9).long()).unsqueeze(-1)")
        elif c.twist == "index2":
            body.append("idx = torch.stack([tok, (tok + 1) % z.shape[-1]], -1)")
        elif c.twist != "mutate_index":
            body.append("idx = tok.unsqueeze(-1)")
        pick = f"{lp}.gather(-1, idx)" if head == "logprob" else f"torch.take_along_dim({lp}, idx, dim=-1)"
        if c.twist != "index2":
            pick += ".squeeze(-1)"
        if c.twist == "nograd_sink":
            body.append("with torch.no_grad():")
            body.append(f"    picked = {pick}")
        else:
            body.append(f"picked = {pick}")
        out.append("picked")
    elif head in ("ce", "nll"):
        kw = []
        if c.ignore_index != -100 or c.explicit_kwargs:
            kw.append(f"ignore_index={c.ignore_index}")
        if c.reduction != "mean" or c.explicit_kwargs:
            kw.append(f"reduction={c.reduction!r}")
        if head == "ce":
            if c.twist == "label_smoothing":
                kw.append("label_smoothing=0.1")
            elif c.explicit_kwargs:
                kw.append("label_smoothing=0.0")
            if c.twist == "ce_weight":
                kw.append("weight=weight")
            target = "soft" if c.twist == "soft_labels" else "labels"
            if c.loss_module:
                body.append(f"loss = torch.nn.CrossEntropyLoss({', '.join(kw)})({zl}, {target})")
            else:
                body.append(f"loss = F.cross_entropy({', '.join([zl, target] + kw)})")
        else:
            lp = lsm(zl) if c.twist == "branch_view" else "logp"
            if c.loss_module:
                body.append(f"loss = torch.nn.NLLLoss({', '.join(kw)})({lp}, labels)")
            else:
                body.append(f"loss = F.nll_loss({', '.join([lp, 'labels'] + kw)})")
        out.append("loss")
    if second:
        body.append(f"lp2 = {lsm('z2')}")
        body.append("ent2 = -(lp2.exp() * lp2).sum(-1)")
        out.append("ent2")
    extra = {"return_z": "z", "return_upcast": "upcast", "return_logp": "logp",
             "return_probs": sm("z"), "consumer": "z.amax(-1)",
             "shape_query": f"{out[-1]} * (z.shape[0] / z.shape[-1])"}.get(c.twist)
    if extra:
        body.append(f"extra = {extra}")
        out.append("extra")
    if c.twist == "inner_no_grad":
        lines = ["with torch.no_grad():"] + ["    " + ln for ln in lines + body]
    else:
        lines += body
    lines.append(f"return ({', '.join(out)},)")
    text = "\n".join("    " + ln for ln in lines)
    return f"def program({', '.join(ARGS)}):\n{text}\n"


def make_program(case: Case, reference: bool = False) -> Callable:
    """The program (see :func:`program_source`) as a function."""
    source = program_source(case, reference)
    kept: list[torch.Tensor] = []

    def keep_grad(h: torch.Tensor) -> torch.Tensor:
        if h.requires_grad:
            h.register_hook(lambda g: kept.append(g.detach()))
        return h

    namespace: dict[str, Any] = {"torch": torch, "F": F, "keep_grad": keep_grad}
    filename = f"<chunked_logits property program {'reference' if reference else 'under test'}>"
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace["program"]
    fn.source, fn.logits_grads = source, kept
    return fn


# ---- inputs ---------------------------------------------------------------------------------------

def make_inputs(case: Case, rows: Optional[int] = None, seed_offset: int = 0) -> dict[str, Any]:
    """The program's arguments (model-precision tensors, as a trainer would have them)."""
    c = case
    g = torch.Generator().manual_seed(c.seed * 7919 + seed_offset)
    rows = rows or c.rows
    lead = (rows,) if c.layout == "TV" else (c.batch, rows)
    V, dtype = c.vocab, DTYPES[c.dtype]
    x = torch.randn(*lead, V, generator=g) * 3
    tok = torch.randint(0, V, lead, generator=g)
    labels = torch.randint(0, V, lead, generator=g)
    labels[torch.rand(lead, generator=g) < 0.25] = c.ignore_index
    mask = torch.zeros(*lead, V, dtype=torch.bool)
    if c.mask != "none":
        mask = torch.rand(*lead, V, generator=g) < 0.25
        keep = torch.zeros_like(mask)
        if c.mask != "token":  # the tokens' and labels' own logits stay finite
            keep.scatter_(-1, tok.unsqueeze(-1), True)
            safe = labels.clamp(0, V - 1)
            keep.scatter_(-1, safe.unsqueeze(-1), True)
        else:
            keep[..., 0] = True  # no row is all -inf
        mask &= ~keep
        if c.mask == "row":
            mask.view(-1, V)[0] = True
    if c.mask in ("data", "token", "row"):
        x = x.masked_fill(mask, float("-inf"))
    x = x.to(dtype)
    t: Any = None
    if c.temp == "float_arg":
        t = TEMPERATURE if c.temp_op == "div" else 1 / TEMPERATURE
    elif c.temp == "tensor0d":
        t = torch.tensor(TEMPERATURE if c.temp_op == "div" else 1 / TEMPERATURE)
        t.requires_grad_(c.twist == "temp_grad")
    elif c.temp == "per_row":
        t = (torch.rand(lead, generator=g) + 0.5)
        if c.temp_where == "before":
            t = t.to(dtype)  # so that x / t stays in model precision
    weight = torch.rand(V, generator=g) + 0.5 if c.twist == "ce_weight" else None
    soft = torch.softmax(torch.randn(*lead, V, generator=g), -1) if c.twist == "soft_labels" else None
    if c.noncontig:  # same values, column-major storage
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    hidden = lm_w = lm_b = None
    if c.lm_head != "none":  # logits = hidden @ lm_w.T (+ lm_b): about N(0, 9), like x
        hidden = torch.randn(*lead, LM_HIDDEN, generator=g).to(dtype).requires_grad_(c.train)
        lm_w = (torch.randn(V, LM_HIDDEN, generator=g) * (9 / LM_HIDDEN) ** 0.5).to(dtype)
        lm_w.requires_grad_(c.train)
        if c.lm_head == "linear_bias":
            lm_b = torch.randn(V, generator=g).to(dtype).requires_grad_(c.train)
    return {"x": x.requires_grad_(c.train and c.lm_head == "none"), "tok": tok, "labels": labels,
            "t": t, "mask": mask, "weight": weight, "soft": soft, "hidden": hidden, "lm_w": lm_w,
            "lm_b": lm_b}


LM_HIDDEN = 8


def as_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    """FP64 copies of the floating-point tensors (the exact values of the model-precision ones)."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out[k] = v.detach().double().requires_grad_(v.requires_grad)
        else:
            out[k] = v
    return out


def fresh(inputs: dict[str, Any]) -> dict[str, Any]:
    """Leaf copies, so that each run gets its own .grad."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().clone().requires_grad_(v.requires_grad)
        else:
            out[k] = v
    return out


@dataclasses.dataclass
class Result:
    outputs: tuple[torch.Tensor, ...]
    grads: dict[str, torch.Tensor]
    requires_grad: tuple[bool, ...] = ()
    term_scales: dict[str, float] = dataclasses.field(default_factory=dict)  # (the reference's)


def term_scales(dz: torch.Tensor, args: dict[str, Any]) -> dict[str, float]:
    """The lm_head's gradients sum one term per row (``lm_w``, ``lm_b``) or per vocabulary
    column (``hidden``) of the logits' gradient ``dz``, each rounded to model precision
    first, by stock and the pass alike, which may round a term to different sides: the
    largest root sum of squares of an element's terms (at least its largest term), which
    that difference scales with where the sum cancels (a saturated softmax's bias gradient,
    far smaller than its terms)."""
    h, w = args["hidden"].detach().double(), args["lm_w"].detach().double()
    a = dz.reshape(-1, dz.shape[-1]).square()
    return {"lm_w": (a.t() @ h.reshape(-1, h.shape[-1]).square()).max().sqrt().item(),
            "lm_b": a.sum(0).max().sqrt().item(), "hidden": (a @ w.square()).max().sqrt().item()}


def cotangent(out: torch.Tensor, i: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 31 + i)
    return torch.randn(out.shape, generator=g, dtype=torch.float64)


def execute(fn: Callable, inputs: dict[str, Any], case: Case) -> Result:
    """Run ``fn``; in training, backpropagate fixed random cotangents of every output
    that requires grad."""
    args = fresh(inputs)
    call = lambda: fn(*(args[k] for k in ARGS))  # noqa: E731
    kept = getattr(fn, "logits_grads", [])
    kept.clear()
    if not case.train:
        with torch.no_grad():
            outs = call()
        return Result(tuple(o.detach() for o in outs), {}, tuple(o.requires_grad for o in outs))
    outs = call()
    terms = [(o * cotangent(o, i, case.seed).to(o.dtype)).sum()
             for i, o in enumerate(outs) if o.requires_grad]
    if terms:
        sum(terms).backward()
    grads = {k: v.grad for k, v in args.items()
             if isinstance(v, torch.Tensor) and v.requires_grad and v.grad is not None}
    scales = term_scales(kept[0], args) if len(kept) == 1 and kept[0].numel() else {}
    return Result(tuple(o.detach() for o in outs), grads, tuple(o.requires_grad for o in outs), scales)


# ---- comparison -----------------------------------------------------------------------------------

# Per-dtype tolerance, relative to the largest finite |reference| of the tensor compared:
# about two units in the last place of its dtype.
TOL = {torch.float64: 1e-12, torch.float32: 2.0**-19, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# FP32 results also get a few units in the last place of the largest |scaled logit| (per row
# summed into the element): log-softmax maths in FP32 is accurate to that, whatever the order of
# its operations, and the pass's order (z - logsumexp) differs from stock's ((z - max) - log(sum)).
TOL_LOGITS = 4 * torch.finfo(torch.float32).eps
# Below a dtype's smallest normal its spacing is fixed (fp16: 2^-24 under 2^-14): a gradient
# whose terms land there (a saturated softmax's (p - onehot) / T, rounded to fp16 before the
# lm_head's GEMMs, by stock and the pass alike) carries that absolute error per term, not a
# relative one.  The tolerance is at least a few such spacings (seen: an fp16 lm_head weight's
# gradient of 6e-5, the pass 1.5 spacings off at one element where stock was 0.5, its max
# error 3.4x under stock's).
SUBNORMAL_SPACINGS = 4


def logit_scale(case: Case, inputs: dict[str, Any]) -> float:
    """An upper bound of |scaled logits|: the largest finite |x| times the largest scaling."""
    x = inputs["x"].detach().double()
    if case.lm_head != "none":
        x = inputs["hidden"].detach().double() @ inputs["lm_w"].detach().double().T
        if inputs["lm_b"] is not None:
            x = x + inputs["lm_b"].detach().double()
    x = x[x.isfinite()]
    factor = {"none": 1.0, "one": 1.0, "per_row": 2.0}.get(case.temp, 1 / TEMPERATURE)
    if case.twist == "two_scales":
        factor *= 2
    return (x.abs().max().item() if x.numel() else 0.0) * factor


def _errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    got, ref = got.detach().double(), ref.detach().double()
    same = (got == ref) | (got.isnan() & ref.isnan())
    finite = got.isfinite() & ref.isfinite()
    return torch.where(same, torch.zeros_like(got),
                       torch.where(finite, (got - ref).abs(), torch.full_like(got, math.inf)))


def assert_no_worse(got: Result, stock: Result, ref: Result, what: str = "", scale: float = 0.0,
                    rows: int = 1) -> None:
    """Element by element: |got - ref| <= |stock - ref| + TOL[dtype] * max|ref| (for the
    lm_head's gradients, the magnitude of the terms they sum if larger: ``term_scales``; at
    least ``SUBNORMAL_SPACINGS`` of the dtype's subnormal spacing; + for FP32 outputs
    TOL_LOGITS * ``scale`` (the logits' scale) * rows summed into the element)."""
    pairs = [(f"output {i}", g, s, r) for i, (g, s, r) in
             enumerate(zip(got.outputs, stock.outputs, ref.outputs))]
    assert len(got.outputs) == len(stock.outputs) == len(ref.outputs), what
    assert got.requires_grad == stock.requires_grad, \
        f"{what}: outputs require grad {got.requires_grad}, stock {stock.requires_grad}"
    assert got.grads.keys() == stock.grads.keys() == ref.grads.keys(), \
        f"{what}: gradients for {sorted(got.grads)} vs stock {sorted(stock.grads)}"
    pairs += [(f"grad of {k}", got.grads[k], stock.grads[k], ref.grads[k]) for k in got.grads]
    terms = {f"grad of {k}": v for k, v in ref.term_scales.items()}
    for name, g, s, r in pairs:
        assert g.shape == s.shape, f"{what}: {name} has shape {tuple(g.shape)}, stock {tuple(s.shape)}"
        assert g.dtype == s.dtype, f"{what}: {name} has dtype {g.dtype}, stock {s.dtype}"
        eg, es = _errors(g, r), _errors(s, r)
        finite_ref = r.detach().double()[r.detach().isfinite()]
        ref_scale = finite_ref.abs().max().item() if finite_ref.numel() else 0.0
        fi = torch.finfo(g.dtype)
        tol = max(TOL[g.dtype] * max(ref_scale, terms.get(name, 0.0)),
                  SUBNORMAL_SPACINGS * fi.smallest_normal * fi.eps)
        if name.startswith("output") and g.dtype == torch.float32:
            tol += TOL_LOGITS * scale * max(1, rows // max(1, g.numel()))
        bad = eg > es + tol
        if bad.any():
            i = tuple(int(v) for v in bad.nonzero()[0])
            raise AssertionError(
                f"{what}: {name} is worse than stock at {bad.sum().item()} of {bad.numel()} elements; "
                f"first at {i}: pass {g[i].item()!r}, stock {s[i].item()!r}, fp64 {r[i].item()!r} "
                f"(tolerance {tol:.3g}); max error pass {eg.max().item():.3g}, stock {es.max().item():.3g}")


# ---- running the pass cheaply: Dynamo capture, transform, eager ------------------------------------

class CaptureAndTransform:
    """A Dynamo backend: keep the graph, apply the passes, run the result eagerly (no Inductor)."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config()
        self.graphs: list[torch.fx.GraphModule] = []
        self.transformed: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict | None = None):
        self.graphs.append(gm)
        new = transform(gm, Config.from_options(options) if options else self.config)
        self.transformed.append(new)
        return new.forward


@contextlib.contextmanager
def eager_lm_head_chunks():
    """Run the chunk loops' bodies eagerly (Inductor compiles each, seconds per variant):
    the cheap path checks the rewrite and the loop, the full-compile tests check the
    compiled bodies.  (``fx_passes.kernels.ops.body_compiler.compiling_with``, the documented seam.)"""
    with compiling_with(lambda fn, options: fn):
        yield


CHECKED_KEYS = ("rewritten", "would_rewrite", "declined", "pass_failed", "lm_head_fused", "lm_head_not_fused",
                "row_local")


def pass_counters() -> dict[str, int]:
    """The chunked_logits counters that say what happened (not div_by_one_removed)."""
    return {k: v for k, v in counters[COUNTER].items()
            if v and (k in CHECKED_KEYS or k.startswith("declined:"))}


def assert_rewritten_graph(gm: torch.fx.GraphModule, case: Case) -> None:
    """A rewritten graph keeps no FP32 upcast and no softmax-like op: only row_stats calls
    (or lm_head loop calls, which compute the loss and its gradients in the forward when
    the loss is in the graph: ``lm_head_loss``)."""
    fused_ops = (lm_head_row_stats, lm_head_row_stats_masked, lm_head_loss)
    n_stats = sum(1 for n in gm.graph.nodes if n.op == "call_function"
                  and n.target in (row_stats, *fused_ops))
    assert n_stats == case.expected_counters()["rewritten"], gm.code
    fused = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in fused_ops)
    assert fused == (1 if case.lm_head_fused else 0), gm.code
    heads = {"log_softmax", "softmax", "logsumexp", "cross_entropy", "nll_loss"}
    left = [n.format_node() for n in gm.graph.nodes if canon(n) in heads]
    assert not left, f"softmax-like ops left after the rewrite:\n{left}\n{gm.code}"
    for n in gm.graph.nodes:
        if canon(n) == "convert":
            v = n.meta.get("example_value")
            assert not (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() >= 1
                        and n.args[0].meta["example_value"].dtype in (torch.bfloat16, torch.float16)), \
                f"an FP32 upcast is left: {n.format_node()}\n{gm.code}"


def compile_fn(program: Callable, backend: Any, case: Case, **kw: Any) -> Callable:
    return torch.compile(program, backend=backend, fullgraph=True, dynamic=case.dynamic, **kw)


def pass_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "chunked_logits" in str(w.message)]


# ---- the strategy ---------------------------------------------------------------------------------

@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Half plain rewrite cases, half with one twist (a neighbour the pass must decline)."""
    twist = draw(st.one_of(st.just("none"), st.sampled_from(GENERATED_TWISTS)))
    dynamic = draw(st.booleans())
    index_head = draw(st.sampled_from((None,) + INDEX_HEADS))
    row_heads = tuple(draw(st.lists(st.sampled_from(ROW_HEADS), unique=True, max_size=2)))
    case = Case(
        dtype=draw(st.sampled_from(["bf16", "fp16"])),
        layout=draw(st.sampled_from(["TV", "BSV"])),
        rows=draw(st.integers(1, 6)),
        batch=draw(st.integers(1, 3)),
        vocab=draw(st.sampled_from([2, 3, 5, 16, 33])),
        shift=draw(st.sampled_from(["none", "before", "after", "last"])),
        upcast=draw(st.sampled_from(["float", "to", "to_kw", "type"])),
        temp=draw(st.sampled_from(["none", "const", "one", "float_arg", "tensor0d", "per_row"])),
        temp_where=draw(st.sampled_from(["after", "before"])),
        temp_op=draw(st.sampled_from(["div", "mul", "rmul"])),
        index_head=index_head,
        row_heads=row_heads,
        reduction=draw(st.sampled_from(["none", "sum", "mean"])),
        ignore_index=draw(st.sampled_from([-100, -1, 0])),
        explicit_kwargs=draw(st.booleans()),
        keepdim=draw(st.booleans()),
        spelling=draw(st.sampled_from(["torch", "F", "method"])),
        dim_pos=draw(st.booleans()),
        flatten=draw(st.sampled_from(["reshape", "flatten", "view"])),
        mask=draw(st.sampled_from(["none", "data", "graph", "token", "row"])),
        noncontig=draw(st.booleans()),
        loss_module=draw(st.booleans()),
        lm_head=draw(st.sampled_from(["none", "none", "matmul", "linear", "linear_bias"])),
        chunk=draw(st.sampled_from(["default", "one_row", "two_rows", "all_rows", "more_rows", "one_col"])),
        train=draw(st.booleans()),
        dynamic=dynamic,
        twist=twist,
        seed=draw(st.integers(0, 2**16)),
        row_local=draw(st.booleans()),
    )
    case = normalize(case)
    assume(known_bug(case) is None)
    return case


GENERATED_TWISTS = sorted(tw for tw in TWISTS if tw not in KNOWN_BUGS)
