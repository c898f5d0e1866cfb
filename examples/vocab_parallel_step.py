"""One rank of a vocab-parallel (tensor-parallel lm_head) GRPO-style step, under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/vocab_parallel_step.py --out out/
    torchrun --standalone --nproc-per-node 2 examples/vocab_parallel_step.py --heads entropy,ce --out out/

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
from fx_passes.session import session

TEMPERATURE = 0.7
CLIP = 0.2
IGNORE = -100


def all_reduce(v: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron's reduce-from-tensor-parallel
    region), in plain torch: the loss is the same on every rank, so each rank's gradient
    is its own shard's.  (``funcol.all_reduce`` alone sums the gradients of every
    rank's copy of the loss in the backward: world_size times too large here.)"""
    return funcol.all_reduce(v.detach(), op, dist.group.WORLD) + (v - v.detach())


def token_stats(local: torch.Tensor, tok: torch.Tensor, lo: int, head: str, up=torch.float32):
    """Per-token log-prob of ``tok`` (or entropy) of ``softmax(logits / T)`` over the whole
    vocabulary, from this rank's shard ``local`` (``[T, V / world]``, vocabulary ids
    ``lo .. lo + V / world``): local reductions, all-reduces of ``[T]`` tensors."""
    z = local.to(up) / TEMPERATURE
    m = funcol.all_reduce(z.detach().amax(-1), "max", dist.group.WORLD)  # a shift: no gradient
    z = z - m.unsqueeze(-1)
    e = z.exp()
    s = all_reduce(e.sum(-1), "sum")
    if head == "entropy":
        return s.log() - all_reduce((e * z).sum(-1), "sum") / s
    own = (tok >= lo) & (tok < lo + local.shape[-1])
    picked = z.gather(-1, torch.where(own, tok - lo, 0).unsqueeze(-1)).squeeze(-1)
    return all_reduce(torch.where(own, picked, 0.0), "sum") - s.log()


def loss_fn(h, w_local, tok, old_logp, adv, lo: int, head: str, up=torch.float32):
    """A GRPO-style loss (clipped ratio; ``head="entropy"``: an entropy bonus;
    ``head="ce"``: cross-entropy with ignored labels) from the local lm_head shard."""
    local = h @ w_local.t()
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
        tok[::7] = IGNORE
    old_logp = torch.randn(args.rows, generator=g).clamp(max=0) - 8.0
    adv = torch.randn(args.rows, generator=g)
    return h, w, tok, old_logp, adv


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.double() - ref).abs()
    return {"max": d.max().item(), "mean": d.mean().item(), "scale": ref.abs().max().item()}


def step(head: str, backend: str, h, w_local, tok, old_logp, adv, lo: int):
    h = h.clone().requires_grad_()
    w_local = w_local.clone().requires_grad_()
    fn = loss_fn if backend == "eager" else torch.compile(loss_fn, backend=backend)
    loss = fn(h, w_local, tok, old_logp, adv, lo, head)
    loss.backward()
    return loss.detach(), h.grad, w_local.grad


def try_loss_parallel(args, h, w, tok) -> dict:
    """What DTensor users write: stock torch.compile of it (expected to fail in Dynamo)."""
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
    out = {}
    ref = None
    for name in ("eager", "inductor", "chunked_logits"):
        fn = ce if name == "eager" else torch.compile(ce, backend=name)
        counters.clear()
        try:
            with loss_parallel():
                loss = fn(h, tok)
                loss.backward()
            ref = loss.full_tensor().item() if ref is None else ref
            out[name] = {"loss": loss.full_tensor().item(), "eager_loss": ref,
                         "counters": dict(counters["chunked_logits"])}
        except Exception as e:  # noqa: BLE001 - what a user sees is the point
            out[name] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="logprob", help="comma-separated: logprob, entropy, ce")
    p.add_argument("--spelling", choices=["megatron", "loss_parallel"], default="megatron")
    p.add_argument("--backends", default="inductor,chunked_logits")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--out", type=pathlib.Path, required=True)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.vocab % world:
        raise SystemExit(f"--vocab {args.vocab} is not divisible by the world size {world}")
    shard = args.vocab // world
    lo = rank * shard
    report: dict = {"rank": rank, "world": world}
    for head in args.heads.split(","):
        h, w, tok, old_logp, adv = inputs(args, head)
        if args.spelling == "loss_parallel":
            report[head] = try_loss_parallel(args, h, w, tok.clamp(min=0))
            continue
        w_local = w[lo:lo + shard]
        ref_loss, ref_h, ref_w = reference(h, w, tok, old_logp, adv, head)
        report[head] = {}
        for backend in args.backends.split(","):
            torch._dynamo.reset()
            counters.clear()
            session.reset()
            loss, gh, gw = step(head, backend, h, w_local, tok, old_logp, adv, lo)
            dist.all_reduce(gh)  # h is replicated: its gradient is the sum of the ranks'
            report[head][backend] = {
                "counters": dict(counters["chunked_logits"]),
                "events": [e.what for e in session.events],
                "loss": errors(loss, ref_loss),
                "grads": {"lm_head_shard": errors(gw, ref_w[lo:lo + shard]), "hidden": errors(gh, ref_h)},
            }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
