"""One rank of a vocab-parallel (tensor-parallel lm_head) GRPO-style step, under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/vocab_parallel_step.py --out out/
    torchrun --standalone --nproc-per-node 2 examples/vocab_parallel_step.py --head entropy ce --out out/
    torchrun --standalone --nproc-per-node 4 examples/vocab_parallel_step.py --dp 2 --out out/   # TP + FSDP2
    torchrun --standalone --nproc-per-node 2 examples/vocab_parallel_step.py --vocab 2400 \
        --vocab-split 1000,1400 --chunk-budget-mib 0.05 --out out/        # uneven shards
    torchrun --standalone --nproc-per-node 4 examples/vocab_parallel_step.py --ranks 2 --out out/  # on 0, 1
    torchrun --standalone --nproc-per-node 2 examples/vocab_parallel_step.py --lm-head-plan kept_logits \
        --out out/                                                        # the logits shard kept

(tests/test_vocab_parallel.py runs it; benchmarks/vocab_parallel.py measures its step.)

Every rank holds the same hidden states ``h`` (``[T, H]``, bf16) and its own shard of the
lm_head weight (``[V / world, H]``); its logits are ``[T, V / world]``.  The loss is
written the Megatron way, on the local shard with functional collectives on ``[T]``
tensors only (:func:`token_stats`), and compiled with stock Inductor and with
``backend="chunked_logits"``.  Each rank writes ``rank<r>.json``: the pass's counters and
events, and the error of the loss and of the gradients (its weight shard, and ``h``'s
gradient summed over ranks) against an FP64 single-process reference on the whole vocabulary.

``--spelling loss_parallel`` instead tries what DTensor users write
(``ColwiseParallel(output_layouts=Shard(-1))`` + ``loss_parallel()``) under stock
``torch.compile`` and records whether Dynamo compiles it (it does not on torch 2.13).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fx_passes  # noqa: F401  (registers backend="chunked_logits")
from fx_passes.reporting.session import session

TEMPERATURE = 0.7
CLIP = 0.2
IGNORE = -100
# The ranks that share one row's vocabulary (the tensor-parallel group): all of them,
# unless --dp splits the world into data-parallel replicas of a tensor-parallel group.
TP_GROUP = None


def tp_group():
    return TP_GROUP if TP_GROUP is not None else dist.group.WORLD


def all_reduce(v: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron's reduce-from-tensor-parallel
    region), in plain torch: the loss is the same on every rank, so each rank's gradient
    is its own shard's.  (``funcol.all_reduce`` alone sums the gradients of every
    rank's copy of the loss in the backward: world_size times too large here.)"""
    return funcol.all_reduce(v.detach(), op, tp_group()) + (v - v.detach())


def token_stats(local: torch.Tensor, tok: torch.Tensor, lo: int, head: str, up=torch.float32):
    """Per-token log-prob of ``tok`` (or entropy) of ``softmax(logits / T)`` over the whole
    vocabulary, from this rank's shard ``local`` (``[T, V / world]``, vocabulary ids
    ``lo .. lo + V / world``): local reductions, all-reduces of ``[T]`` tensors."""
    z = local.to(up) / TEMPERATURE
    own = (tok >= lo) & (tok < lo + local.shape[-1])
    if head == "logprob_unshifted":  # the target logit read before the shift (Megatron's own order)
        m = funcol.all_reduce(z.amax(-1).detach(), "max", tp_group())
        se = all_reduce((z - m.unsqueeze(-1)).exp().sum(-1), "sum")
        picked = z.gather(-1, torch.where(own, tok - lo, 0).unsqueeze(-1)).squeeze(-1)
        return all_reduce(torch.where(own, picked, 0.0), "sum") - m - se.log()
    m = funcol.all_reduce(z.detach().amax(-1), "max", tp_group())  # a shift: no gradient
    z = z - m.unsqueeze(-1)
    e = z.exp()
    s = all_reduce(e.sum(-1), "sum")
    if head == "entropy":
        return s.log() - all_reduce((e * z).sum(-1), "sum") / s
    picked = z.gather(-1, torch.where(own, tok - lo, 0).unsqueeze(-1)).squeeze(-1)
    return all_reduce(torch.where(own, picked, 0.0), "sum") - s.log()


def loss_fn(h, w_local, tok, old_logp, adv, lo: int, head: str, up=torch.float32):
    """A GRPO-style loss (clipped ratio; ``head="entropy"``: an entropy bonus;
    ``head="ce"``: cross-entropy with ignored labels) from the local lm_head shard
    (a weight, or the FSDP2-wrapped ``Linear`` that holds it)."""
    local = w_local(h) if isinstance(w_local, torch.nn.Module) else h @ w_local.t()
    if head == "entropy":
        return -token_stats(local, tok, lo, head, up).mean()
    if head == "ce":
        valid = tok != IGNORE
        logp = token_stats(local, torch.where(valid, tok, 0), lo, "logprob", up)
        return -torch.where(valid, logp, 0.0).sum() / valid.sum()
    logp = token_stats(local, tok, lo, head, up)
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def reference(h, w, tok, old_logp, adv, head: str):
    """The same loss on one process, whole vocabulary, FP64."""
    h, w = h.double().requires_grad_(), w.double().requires_grad_()
    z = (h @ w.t()) / TEMPERATURE
    if head == "entropy":
        logp = torch.log_softmax(z, -1)
        loss = (logp.exp() * logp).sum(-1).mean()
    elif head == "ce":
        loss = F.cross_entropy(z, tok, ignore_index=IGNORE)
    else:
        logp = torch.log_softmax(z, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old_logp.double())
        loss = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
    loss.backward()
    return loss.detach(), h.grad, w.grad


def inputs(args, head: str):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.rows, args.hidden, generator=g) / args.hidden ** 0.25).to(torch.bfloat16)
    w = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.25).to(torch.bfloat16)
    tok = torch.randint(0, args.vocab, (args.rows,), generator=g)
    if head == "ce":
        ignored = getattr(args, "ignored", None)
        if ignored is None:
            tok[::7] = IGNORE
        else:  # (a prompt: the first rows' labels ignored)
            tok[:int(args.rows * ignored)] = IGNORE
    old_logp = torch.randn(args.rows, generator=g).clamp(max=0) - 8.0
    adv = torch.randn(args.rows, generator=g)
    return h, w, tok, old_logp, adv


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.double() - ref).abs()
    return {"max": d.max().item(), "mean": d.mean().item(), "scale": ref.abs().max().item()}


class ShardLoss(torch.nn.Module):
    """The lm_head shard and the loss in one module (``--fsdp-unit loss``): under FSDP2
    its call is the graph break, and the matmul and the loss share the graph inside."""

    def __init__(self, w_local: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w_local.clone())

    def forward(self, h, tok, old_logp, adv, lo: int, head: str):
        return loss_fn(h, self.weight, tok, old_logp, adv, lo, head)


def step(head: str, backend: str, h, w_local, tok, old_logp, adv, lo: int, dp_mesh=None, options=None,
         fsdp_unit: str = "shard"):
    """One step; with ``dp_mesh`` the shard is under FSDP2 over it: an ``nn.Linear``
    (``fsdp_unit="shard"``), or a module that also computes the loss (``"loss"``);
    ``options``: the backend's (``{"fuse_lm_head": False}``)."""
    h = h.clone().requires_grad_()
    compiled = (lambda f: f) if backend == "eager" else (
        lambda f: torch.compile(f, backend=backend, options=options))
    if dp_mesh is None:
        shard = w_local = w_local.clone().requires_grad_()
        loss = compiled(loss_fn)(h, shard, tok, old_logp, adv, lo, head)
    else:
        from torch.distributed.fsdp import fully_shard

        if fsdp_unit == "loss":
            shard = fully_shard(ShardLoss(w_local), mesh=dp_mesh)
            loss = compiled(shard)(h, tok, old_logp, adv, lo, head)
        else:
            shard = torch.nn.Linear(w_local.shape[1], w_local.shape[0], bias=False, dtype=w_local.dtype)
            with torch.no_grad():
                shard.weight.copy_(w_local)
            fully_shard(shard, mesh=dp_mesh)
            loss = compiled(loss_fn)(h, shard, tok, old_logp, adv, lo, head)
    loss.backward()
    grad = shard.grad if dp_mesh is None else shard.weight.grad.full_tensor()
    return loss.detach(), h.grad, grad


def try_loss_parallel(args, h, w, tok) -> dict:
    """What DTensor users write (cross-entropy, and log_softmax + gather), eager, under stock
    torch.compile and under the pass: the loss, the counters, or the error a user sees."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(w)
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))

    def ce(hh, t):
        return F.cross_entropy(head(hh).float() / TEMPERATURE, t)

    def gather(hh, t):  # per-token log-probs, as GRPO code writes them
        logp = torch.log_softmax(head(hh).float() / TEMPERATURE, dim=-1)
        return -logp.gather(-1, t.unsqueeze(-1)).mean()
    out = {}
    for spelling, loss in (("cross_entropy", ce), ("log_softmax_gather", gather)):
        for name in ("eager", "inductor", "chunked_logits"):
            fn = loss if name == "eager" else torch.compile(loss, backend=name)
            torch._dynamo.reset()
            counters.clear()
            try:
                with loss_parallel():
                    value = fn(h, tok)
                    value.backward()
                out[f"{spelling}/{name}"] = {"loss": value.full_tensor().item(),
                                             "counters": dict(counters["chunked_logits"])}
            except Exception as e:  # noqa: BLE001 - what a user sees is the point
                out[f"{spelling}/{name}"] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", nargs="+", choices=["logprob", "logprob_unshifted", "entropy", "ce"],
                   default=["logprob"])
    p.add_argument("--spelling", choices=["megatron", "loss_parallel"], default="megatron")
    p.add_argument("--backends", default="inductor,chunked_logits")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rows", type=int, default=96, help="rows per data-parallel replica")
    p.add_argument("--vocab-split", default=None,
                   help="the tensor-parallel ranks' shard widths, comma-separated (default: even)")
    p.add_argument("--chunk-budget-mib", type=float, default=None, help="chunked_logits' chunk budget")
    p.add_argument("--lm-head-plan", default=None, help="chunked_logits' lm_head_plan (default: auto)")
    p.add_argument("--fsdp-unit", choices=["shard", "loss"], default="shard",
                   help="with --dp: fully_shard the lm_head shard alone, or a module holding it and the loss")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas (TP + FSDP2: world = dp x tp, the shard under fully_shard)")
    p.add_argument("--ranks", type=int, default=None,
                   help="run on the first RANKS ranks of the process group (the others skip the run): one "
                        "torchrun start serves runs on several rank counts (tests/test_vocab_parallel.py)")
    p.add_argument("--out", type=pathlib.Path, required=True)
    return p.parse_args(argv)


def head_data(args, head: str, dp_rank: int, lo: int, shard: int) -> tuple:
    """This rank's rows and weight shard for ``head``, and the FP64 reference's loss and
    gradients (``h``'s, and the weight shard's averaged over the replicas, as FSDP2 does)."""
    # every replica draws all replicas' rows, keeps its own (the reference needs them all)
    h, w, tok, old_logp, adv = inputs(argparse.Namespace(**{**vars(args), "rows": args.rows * args.dp}), head)
    replicas = [slice(d * args.rows, (d + 1) * args.rows) for d in range(args.dp)]
    refs = [reference(h[r], w, tok[r], old_logp[r], adv[r], head) for r in replicas]
    rows = replicas[dp_rank]
    ref_w = sum(r[2] for r in refs) / args.dp
    return ((h[rows], w[lo:lo + shard], tok[rows], old_logp[rows], adv[rows]),
            (refs[dp_rank][0], refs[dp_rank][1], ref_w[lo:lo + shard]))


def megatron_heads(args, dp_rank: int, lo: int, shard: int, dp_mesh, options) -> dict:
    """Each head's step with each backend: counters, events and errors against FP64.
    One Dynamo reset per backend, not per step: what the heads share (the pass's stage
    bodies, FSDP2's module calls) is traced and compiled once per backend; each head's
    loss compiles in its own step, and its counters and events are taken per step."""
    data = {head: head_data(args, head, dp_rank, lo, shard) for head in args.head}
    report: dict = {head: {} for head in args.head}
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        for head, ((h, w_local, tok, old_logp, adv), (ref_loss, ref_h, ref_w)) in data.items():
            counters.clear()
            session.reset()
            loss, gh, gw = step(head, backend, h, w_local, tok, old_logp, adv, lo, dp_mesh,
                                options if backend.startswith("chunked_logits") else None, args.fsdp_unit)
            dist.all_reduce(gh, group=tp_group())  # h is replicated: its gradient sums the shards'
            report[head][backend] = {
                "counters": dict(counters["chunked_logits"]),
                "events": [e.what for e in session.events],
                "loss": errors(loss, ref_loss),
                "grads": {"lm_head_shard": errors(gw, ref_w), "hidden": errors(gh, ref_h)},
            }
    return report


def run(args: argparse.Namespace) -> None:
    """One run on the initialised process group (tests/torchrun_cases.py runs several in
    one torchrun start): each head with each backend, then ``rank<r>.json``."""
    global TP_GROUP
    TP_GROUP = None  # (a run before this one in the process may have set it)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ranks is not None and args.ranks < world:
        if args.dp > 1 or args.spelling != "megatron":
            raise SystemExit("--ranks takes neither --dp nor --spelling loss_parallel (their meshes span "
                             "the whole world)")
        group = dist.new_group(list(range(args.ranks)))  # (every rank of the world calls it)
        if rank >= args.ranks:
            return
        TP_GROUP, world = group, args.ranks
    tp, dp_rank, tp_rank, dp_mesh = world, 0, rank, None
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if world % args.dp:
            raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
        tp = world // args.dp
        mesh = init_device_mesh("cpu", (args.dp, tp), mesh_dim_names=("dp", "tp"))
        TP_GROUP, dp_mesh = mesh.get_group("tp"), mesh["dp"]
        dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    widths = [int(v) for v in args.vocab_split.split(",")] if args.vocab_split else [args.vocab // tp] * tp
    if len(widths) != tp or sum(widths) != args.vocab:
        raise SystemExit(f"--vocab {args.vocab} is not split over the tensor-parallel size {tp}: "
                         "give --vocab-split (widths summing to --vocab), or a --vocab it divides")
    shard, lo = widths[tp_rank], sum(widths[:tp_rank])
    options = {k: v for k, v in (("chunk_budget_mib", args.chunk_budget_mib),
                                 ("lm_head_plan", args.lm_head_plan)) if v} or None
    report: dict = {"rank": rank, "world": world, "dp": args.dp, "tp": tp}
    if args.spelling == "loss_parallel":
        for head in args.head:
            h, w, tok, _, _ = inputs(argparse.Namespace(**{**vars(args), "rows": args.rows * args.dp}), head)
            report[head] = try_loss_parallel(args, h, w, tok.clamp(min=0))
    else:
        report.update(megatron_heads(args, dp_rank, lo, shard, dp_mesh, options))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    run(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
