"""One rank of a distributed training step (DDP or FSDP2, gloo on CPU) under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/distributed_step.py --setup ddp --out out/
    torchrun --standalone --nproc-per-node 2 examples/distributed_step.py --setup fsdp2 --out out/
    torchrun --standalone --nproc-per-node 2 examples/distributed_step.py --setup fsdp2 --out out/ \\
        --lm-head-in loss --head logprob entropy ce

(tests/test_distributed.py and benchmarks/distributed.py run it too.)

Each rank trains the same bf16 model on its own shard of the batch, once with stock
Inductor and once with the pass, for each loss head asked for, and writes
``rank<r>.json``: per head, the pass's counters and events, and for loss and every
gradient the error of both against an FP64 reference computed in this process from the
same bf16 weights (what one process would compute for the whole batch, so the
comparison is against the single-process answer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fx_passes
from fx_passes.reporting.session import session

TEMPERATURE = 0.7
HEADS = ("logprob", "entropy", "ce")


def token_loss(logits: torch.Tensor, tok: torch.Tensor, head: str, up=torch.float32) -> torch.Tensor:
    """The trainer's loss on the logits, as user code writes it (``up`` = FP64 for the reference)."""
    z = logits.to(up) / TEMPERATURE
    if head == "ce":
        return F.cross_entropy(z.flatten(0, -2), tok.flatten())
    logp = torch.log_softmax(z, dim=-1)
    if head == "entropy":
        return -(logp.exp() * logp).sum(-1).mean()
    return -logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1).mean()


class TinyLM(torch.nn.Module):
    """Embedding, two MLP blocks, lm_head and the loss in one module: what DDP wraps."""

    def __init__(self, vocab: int, hidden: int, head: str) -> None:
        super().__init__()
        self.head = head
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, tok: torch.Tensor, up=torch.float32) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + F.gelu(block(h))
        return token_loss(self.lm_head(h), tok, self.head, up)


def llama(vocab: int, hidden: int):
    """A tiny Hugging Face Llama from a config (no download), untied so the lm_head
    weight belongs to the FSDP root alone."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


class HFStep(torch.nn.Module):
    """The Llama's logits and the trainer's loss on them, so the loss is in the compiled graph.

    ``lm_head_in="model"`` takes ``.logits`` from the model's forward; ``"loss"`` takes the
    last hidden state from ``model.model`` and applies ``model.lm_head`` here, next to the
    loss, so that a graph break inside the model cannot separate the two."""

    def __init__(self, model, head: str, lm_head_in: str = "model") -> None:
        super().__init__()
        self.model, self.head, self.lm_head_in = model, head, lm_head_in

    def forward(self, ids: torch.Tensor, tok: torch.Tensor, up=torch.float32) -> torch.Tensor:
        if self.lm_head_in == "loss":
            logits = self.model.lm_head(self.model.model(input_ids=ids).last_hidden_state)
        else:
            logits = self.model(input_ids=ids).logits
        return token_loss(logits, tok, self.head, up)


def build(args) -> torch.nn.Module:
    """The same bf16 weights on every rank and in every run of this process."""
    torch.manual_seed(0)
    if args.setup == "ddp":
        return TinyLM(args.vocab, args.hidden, args.head).to(torch.bfloat16)
    return HFStep(llama(args.vocab, args.hidden), args.head, args.lm_head_in).to(torch.bfloat16)


def wrap(model: torch.nn.Module, args) -> torch.nn.Module:
    if args.setup == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def batch(args, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the global batch."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.world, args.batch, args.seq), generator=g)
    tok = torch.randint(0, args.vocab, (args.world, args.batch, args.seq), generator=g)
    return ids[rank], tok[rank]


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (FSDP2 keeps a shard per rank)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.replace("module.", "").replace("_orig_mod.", "")] = g.detach().clone()
    return out


@contextlib.contextmanager
def ours(backend: str):
    """The pass, the way the run asks for it: its backend, or installed into stock Inductor."""
    if backend == "install":
        with fx_passes.install():
            yield "inductor"
    else:
        yield backend


class BucketCount(logging.Handler):
    """How many buckets DDPOptimizer split the graph into (it says so at INFO level)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.buckets = None
        logger = logging.getLogger("torch._dynamo.backends.distributed")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "created %d buckets" in str(record.msg):
            self.buckets = record.args[1]


def compiled_model(args, backend: str, reset: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A fresh wrapped model and its ``torch.compile`` (after ``torch._dynamo.reset()``
    unless ``reset=False``: frames compiled before are served where their guards hold)."""
    if reset:
        torch._dynamo.reset()
    model = wrap(build(args), args)
    return model, torch.compile(model, backend=backend)


def step(args, rank: int, backend: str, reset: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward of the wrapped, compiled model on this rank's shard."""
    model, compiled = compiled_model(args, backend, reset)
    ids, tok = batch(args, rank)
    loss = compiled(ids, tok)
    loss.backward()
    return loss.detach().float(), full_grads(model)


def reference(args) -> tuple[list[float], dict[str, torch.Tensor]]:
    """FP64 from the bf16 weights: each rank's loss, and the gradient of their mean
    (what DDP and FSDP2 average), for the whole batch in one process."""
    model = build(args).double()
    shards = [batch(args, r) for r in range(args.world)]
    losses = [model(ids, tok, up=torch.float64) for ids, tok in shards]
    (sum(losses) / args.world).backward()
    return [loss.item() for loss in losses], full_grads(model)


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (got.double() - ref).abs()
    return {"max": diff.max().item(), "mean": diff.mean().item(), "scale": ref.abs().max().item()}


def compare(loss, grads, ref_loss: float, ref_grads) -> dict:
    return {"loss": {"max": abs(loss.item() - ref_loss), "scale": abs(ref_loss)},
            "grads": {k: errors(g, ref_grads[k]) for k, g in grads.items()}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=["ddp", "fsdp2"], required=True)
    p.add_argument("--head", choices=HEADS, nargs="+", default=["logprob"],
                   help="one or more loss heads, each run in turn in this process")
    p.add_argument("--backend", choices=["chunked_logits", "install", "inductor"], default="chunked_logits",
                   help="the pass's backend, or fx_passes.install() + inductor (stock: benchmark only)")
    p.add_argument("--lm-head-in", choices=["model", "loss"], default="model",
                   help="fsdp2: the lm_head run by the HF model's forward, or by the step next to its loss")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--out", type=pathlib.Path, required=True)
    return p.parse_args(argv)


def run_heads(args, rank: int) -> dict[str, dict]:
    """Stock for every head, then the pass for every head, then the FP64 references.
    One Dynamo reset before each backend's steps, not one per step: what the heads share
    (FSDP2's decoder layers, the pass's chunk bodies) is traced and compiled once per
    backend; each head's own graph (its loss) compiles in its step, the pass's counters
    and events are taken per head."""
    per_head = {head: argparse.Namespace(**{**vars(args), "head": head}) for head in args.head}
    torch._dynamo.reset()
    stock = {head: step(a, rank, "inductor", reset=False) for head, a in per_head.items()}
    torch._dynamo.reset()
    out = {}
    for head, a in per_head.items():
        counters.clear()
        session.reset()
        with ours(args.backend) as backend:
            loss, grads = step(a, rank, backend, reset=False)
        ref_losses, ref_grads = reference(a)
        out[head] = {"counters": dict(counters["chunked_logits"]),
                     "events": [f"{e.kind}: {e.what}" for e in session.events],
                     "stock": compare(*stock[head], ref_losses[rank], ref_grads),
                     "ours": compare(loss, grads, ref_losses[rank], ref_grads)}
    return out


def run(args: argparse.Namespace) -> None:
    """One run on the initialised process group (tests/torchrun_cases.py runs several in
    one torchrun start): each head in turn, then ``rank<r>.json``."""
    rank, args.world = dist.get_rank(), dist.get_world_size()
    buckets = BucketCount()
    try:
        heads = run_heads(args, rank)
    finally:
        logging.getLogger("torch._dynamo.backends.distributed").removeHandler(buckets)
    result = {"rank": rank, "world": args.world, "ddp_buckets": buckets.buckets, "heads": heads}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    run(args)
    dist.destroy_process_group()

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
