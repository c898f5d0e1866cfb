"""Hostile programs for the placement rule (issue 19, fx_passes/fx/placement.py).

A program is one region written as a list of statements (:data:`REGIONS`: plain logits,
four row-local regions (issue 21: a top-k masked log-prob; a label-smoothed CE reduced
over the rows plus a z-loss; a label-smoothed CE of ``h @ w.T``, whose matmul the call
runs chunk by chunk; a top-p masked log-prob of ``h @ w.T``, whose matmul the call runs
whole), the lm_head matmul in the graph (per-token results; a loss
the graph reduces, whose gradients the fused loop computes in the forward; per-token results
read through a mask computed after the region; the same in the row-local engine), the lm_head whose logits
the graph also returns, a vocab-parallel region on a one-rank group) with one *state change* put into it
(:data:`CHANGES`): a statement inserted at a slot, or a run of the region's statements
wrapped in a ``with`` block.  Every slot and every run from the region's first absorbed
statement to its last is generated (:func:`programs`), so each change is tried at each
position between the first node the rewrite absorbs and its last reader.

Each program runs eagerly in FP64 (the reference) and FP32 (stock), and through the pass
(Dynamo capture, the passes, the rewritten graph run eagerly: tests/test_hostile.py);
outputs, gradients and ``requires_grad`` must match (property_programs.assert_no_worse).
"""

from __future__ import annotations

import dataclasses
import itertools
import textwrap
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

T, H, V = 6, 8, 16
TEMPERATURE = 0.7

# Each region: (arguments, statements, returned names, index of the first statement the
# rewrite absorbs).  ``h = h * 1`` / ``w = w * 1`` make non-leaf tensors that may be
# changed in place; ``up`` is FP32, or FP64 for the reference.
# a vocab-parallel region's stages (Megatron's spelling on a one-rank group)
_VOCAB = [
    "h = h * 1",
    "w = w * 1",
    "logits = h @ w.T",
    "z = logits.to(up) / 0.7",
    "m = funcol.all_reduce(z.detach().amax(-1), 'max', dist.group.WORLD)",
    "zs = z - m.unsqueeze(-1)",
    "s = funcol.all_reduce(zs.exp().sum(-1), 'sum', dist.group.WORLD)",
]

REGIONS: dict[str, tuple[str, list[str], str, int]] = {
    "plain": ("x, tok", [
        "x = x * 1",
        "z = x.to(up)",
        "z = z / 0.7",
        "lp = torch.log_softmax(z, -1)",
        "picked = lp.gather(-1, tok[:, None]).squeeze(-1)",
        "ent = -(lp.exp() * lp).sum(-1)",
    ], "picked, ent", 1),
    # row-local regions (issue 21, match/row_local.py): a top-k masked log-prob, and a
    # label-smoothed CE (reduced over the rows outside the region) plus a z-loss
    "topk": ("x, tok", [
        "x = x * 1",
        "z = x.to(up)",
        "z = z / 0.7",
        "kth = z.topk(8, -1).values[:, -1:]",
        "z = z.masked_fill(z < kth, -30.0)",
        "lp = torch.log_softmax(z, -1)",
        "picked = lp.gather(-1, tok[:, None]).squeeze(-1)",
    ], "picked", 1),
    "smoothing": ("x, tok", [
        "x = x * 1",
        "z = x.to(up)",
        "ce = torch.nn.functional.cross_entropy(z, tok, label_smoothing=0.1)",
        "zl = torch.logsumexp(z, -1).pow(2)",
        "loss = ce + 1e-4 * zl.mean()",
    ], "loss", 1),
    # row-local regions on the lm_head's logits: the call runs the matmul chunk by chunk
    # (a body that splits: kernels/row_local/sweeps.py) or whole (a top-p mask's sort:
    # kernels/row_local/head.py)
    "head_smoothing": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "ce = torch.nn.functional.cross_entropy(logits.to(up), tok, label_smoothing=0.1)",
    ], "ce", 2),
    "head_topp": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "z = logits.to(up)",
        "sp, order = z.softmax(-1).sort(-1, descending=True)",
        "lp = z.masked_fill(((sp.cumsum(-1) - sp) > 0.5).scatter(-1, order, (sp.cumsum(-1) - sp) > 0.5), "
        "float('-inf')).log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)",
    ], "lp", 2),
    "lm_head": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "z = logits.to(up)",
        "z = z / 0.7",
        "lp = torch.log_softmax(z, -1)",
        "picked = lp.gather(-1, tok[:, None]).squeeze(-1)",
        "ent = -(lp.exp() * lp).sum(-1)",
    ], "picked, ent", 2),
    # the loss in the graph: the gradients computed in the forward (issue 22, kernels/log_softmax/loss.py)
    "loss": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "z = logits.to(up)",
        "lp = torch.log_softmax(z, -1)",
        "picked = lp.gather(-1, tok[:, None]).squeeze(-1)",
        "loss = -(picked * torch.linspace(-1, 1, picked.shape[0], dtype=picked.dtype)).mean()",
    ], "loss", 2),
    # per-token results read through a mask computed after the region: its ops move before
    # the call, which then leaves the masked rows out (issue 36, rewrite/skip_rows.skip_unread_rows)
    "masked": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "z = logits.to(up)",
        "lp = torch.log_softmax(z, -1)",
        "picked = lp.gather(-1, tok[:, None]).squeeze(-1)",
        "m = (tok % 3 > 0).to(up)",
        "loss = -(picked * m).sum() / m.sum()",
    ], "loss, (picked * m).detach()", 2),
    # the same read through a sum per sequence and what is computed from it (a GSPO-like
    # sequence ratio, returned too): NOTE [values of several rows read back by a row]
    "masked_sequences": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "z = logits.to(up)",
        "lp = torch.log_softmax(z, -1)",
        "picked = lp.gather(-1, tok[:, None]).squeeze(-1).view(2, -1)",
        "m = (tok % 3 > 0).to(up).view(2, -1)",
        "n = m.sum(-1, keepdim=True).clamp(min=1)",
        "ratio = torch.exp(((picked + 2.0) * m).sum(-1, keepdim=True) / n)",
        "loss = -((torch.minimum(ratio, ratio.clamp(0.9, 1.1)) * m).sum(-1, keepdim=True) / n).mean()",
    ], "loss, ratio.detach()", 2),
    # the same in the row-local engine: a label-smoothed CE per token (a body the lm_head
    # path does not derive), its per-row results kept (kernels/row_local/masked.py)
    "masked_row_local": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "ce = torch.nn.functional.cross_entropy(logits.to(up), tok, label_smoothing=0.1, reduction='none')",
        "m = (tok % 3 > 0).to(up)",
        "kept = (ce * m).detach()",
        "loss = (ce * m).sum() / m.sum()",
    ], "loss, kept", 2),
    "returned": ("h, w, tok", [
        "h = h * 1",
        "w = w * 1",
        "logits = h @ w.T",
        "loss = torch.nn.functional.cross_entropy(logits.to(up), tok)",
    ], "loss, logits", 2),
    "vocab": ("h, w, tok", [
        *_VOCAB,
        "picked = zs.gather(-1, tok[:, None]).squeeze(-1)",
        "lp = picked - s.log()",
    ], "lp", 2),
    # the vocab-parallel one-pass loop with a mask computed after it, its masked per-token
    # values returned too (distributed/shard_mask.py: the rows it leaves out are skipped)
    "masked_vocab": ("h, w, tok", [
        *_VOCAB,
        "lp = zs.gather(-1, tok[:, None]).squeeze(-1) - s.log()",
        "keep = (tok % 3 > 0).to(up)",
        "loss = -(lp * keep).sum() / keep.sum()",
    ], "loss, (lp * keep).detach()", 2),
}

# Each change: ("insert", statement) or ("wrap", with-header); {V} is the vocabulary size.
# Inserts go after ``h = h * 1`` / ``x = x * 1``, so they change non-leaf tensors (and the
# token input); a program eager refuses (a tensor saved for the backward changed) is skipped.
CHANGES: dict[str, tuple[str, str]] = {
    "no_grad": ("wrap", "with torch.no_grad():"),
    "enable_grad": ("wrap", "with torch.enable_grad():"),  # (a switch when scoring under no_grad)
    "inference_mode": ("wrap", "with torch.inference_mode():"),
    "autocast": ("wrap", "with torch.autocast('cpu', dtype=torch.bfloat16):"),
    "mul_h": ("insert", "h.mul_(0.5)"),
    "zero_h_view": ("insert", "h[1:3].zero_()"),
    "mul_w": ("insert", "w.mul_(1.5)"),
    "zero_w_view": ("insert", "w[:4].zero_()"),
    "mul_x": ("insert", "x.mul_(2)"),
    "zero_x_view": ("insert", "x[:, 3:5].zero_()"),
    "mul_logits": ("insert", "logits.mul_(2)"),
    "tok_add": ("insert", "tok.add_(1); tok.remainder_({V})"),
    "rng": ("insert", "noise = torch.rand(())"),
    "seed": ("insert", "torch.manual_seed(0)"),  # (a graph break: the region is split in two graphs)
}

# which changes apply to which region (the tensor they change must exist there)
_LM_CHANGES = ("no_grad", "enable_grad", "inference_mode", "autocast", "seed", "mul_h", "zero_h_view",
               "mul_w", "zero_w_view", "mul_logits", "tok_add", "rng")
_X_CHANGES = ("no_grad", "enable_grad", "inference_mode", "autocast", "mul_x", "zero_x_view", "tok_add",
              "rng", "seed")
_APPLIES = {
    "plain": _X_CHANGES,
    "topk": _X_CHANGES,
    "smoothing": _X_CHANGES,
    "head_smoothing": _LM_CHANGES,
    "head_topp": _LM_CHANGES,
    "lm_head": _LM_CHANGES,
    "loss": _LM_CHANGES,
    # (the mask's hazards: its input changed in place between the region and the mask, and
    # the in-place changes and graph breaks around the call; the grad-mode wraps are lm_head's)
    "masked": ("tok_add", "mul_h", "zero_h_view", "mul_w", "mul_logits", "rng", "seed"),
    "masked_row_local": ("tok_add", "mul_h", "mul_logits", "seed"),
    "masked_sequences": ("tok_add", "mul_h", "mul_logits", "seed"),
    "returned": _LM_CHANGES,
    "vocab": ("no_grad", "enable_grad", "mul_h", "zero_w_view", "mul_logits", "tok_add"),
    "masked_vocab": ("tok_add",),  # (the mask's input changed in place at each place)
}


@dataclasses.dataclass(frozen=True)
class Program:
    region: str
    change: str
    where: tuple[int, ...]  # insert: (slot,); wrap: (first, last) statements, inclusive
    train: bool

    @property
    def id(self) -> str:
        mode = 'train' if self.train else 'score'
        return f"{self.region}-{self.change}-{'_'.join(map(str, self.where))}-{mode}"

    def source(self) -> str:
        args, stmts, returned, _ = REGIONS[self.region]
        kind, text = CHANGES[self.change]
        text = text.format(V=V)
        lines = list(stmts)
        if kind == "insert":
            lines.insert(self.where[0], text)
        else:
            a, b = self.where
            lines = lines[:a] + [text] + ["    " + s for s in lines[a:b + 1]] + lines[b + 1:]
        body = textwrap.indent("\n".join(lines + [f"return {returned}"]), "    ")
        return f"def program({args}, up=torch.float32):\n{body}\n"

    def function(self) -> Callable:
        namespace = {"torch": torch, "funcol": funcol, "dist": dist}
        exec(compile(self.source(), f"<hostile {self.id}>", "exec"), namespace)
        return namespace["program"]


def programs(train: Optional[bool] = None) -> list[Program]:
    """Every (region, change, position) and training / scoring, as described above."""
    out = []
    for region, changes in _APPLIES.items():
        n, first = len(REGIONS[region][1]), REGIONS[region][3]
        for change, tr in itertools.product(changes, (False, True)):
            if train is not None and tr != train:
                continue
            if CHANGES[change][0] == "insert":
                places = [(i,) for i in range(first, n + 1)]
            else:
                places = [(a, b) for a in range(first, n) for b in range(a, n)]
            out += [Program(region, change, p, tr) for p in places]
    return out


def make_inputs(p: Program, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    tok = torch.randint(0, V, (T,), generator=g)
    if args_of(p)[0] == "x":
        x = (torch.randn(T, V, generator=g) * 3).to(dtype).requires_grad_(p.train)
        return {"x": x, "tok": tok}
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_(p.train)
    w = (torch.randn(V, H, generator=g) * (9 / H) ** 0.5).to(dtype).requires_grad_(p.train)
    return {"h": h, "w": w, "tok": tok}


def args_of(p: Program) -> tuple[str, ...]:
    return tuple(a.strip() for a in REGIONS[p.region][0].split(","))
