"""The pass on fake CUDA tensors with a CPU-only torch (run by tests/test_fake_cuda.py in a
process of its own: an op that reaches autograd on a fake CUDA tensor aborts the process).

Each path's Dynamo graph is captured on CPU tensors, its example values are then made
fake CUDA tensors of the same shapes, dtypes and ``requires_grad``, and the passes run on
it under ``no_grad`` (the example values of the nodes they add are computed by the ops'
fake kernels without autograd); the rewritten graph then runs on fake CUDA inputs, again
under ``no_grad``.  Prints one JSON line: per path, the emitted calls, the devices of every
example value and of every factory call in the rewritten graph, and of its outputs; the
lm_head plans a CUDA device gets; the ATen calls of the ``"gpu"`` plan's chunk loops at
the recorded run's sizes (``"loops"``: tests/fake_cuda_loops.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import unittest.mock

import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fx_passes import Config
from fx_passes.fx.graph_ops import meta
from fx_passes.kernels import tiling
from fx_passes.kernels.log_softmax import lm_head_masked
from fx_passes.kernels.ops import registry
from fx_passes.pipeline import transform
from fx_passes.reporting.report import COUNTER
from tests import fake_cuda_loops, sweep_cases
from tests import row_local_cases as rl
from tests import rows_row_local_programs as rrl
from tests.cases import lm_logprob_entropy, policy_loss
from tests.helpers import dynamo_graph

# What a CPU-only torch raises where an op sets a device guard on a fake CUDA tensor
# (``Tensor.__getitem__``'s Python binding does; autograd on one aborts the process).
NO_CUDA_BUILD = "PyTorch is not linked with support for cuda devices"
FACTORIES = {torch.full, torch.zeros, torch.ones, torch.empty, torch.arange, torch.tensor,
             torch.scalar_tensor, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like}


def tempered_topk(x, tok, temp):
    """A top-k region whose temperature is a symbolic float: a scalar constant in the call."""
    z = x.float() / temp
    kth = torch.topk(z, 5, -1).values[..., -1:]
    logp = torch.log_softmax(z.masked_fill(z < kth, float("-inf")), -1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def lm_per_token(hidden, weight, tok):
    z = (hidden @ weight.T).float()
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), -(torch.softmax(z, -1) * logp).sum(-1)


def lm_ce_per_token(hidden, weight, labels):
    """A cross-entropy alone, per token: stock keeps no FP32 ``[T, V]`` (its fused kernels),
    so ``auto`` keeps no logits on a GPU (``tiling.keeps_logits``); its ignored labels
    (``ignore_index``) make it the loop that leaves them out."""
    return torch.nn.functional.cross_entropy((hidden @ weight.T).float(), labels, reduction="none")


def lm_masked_per_token(hidden, weight, tok, mask):
    """Two masked means leave the graph (a loss and a metric): the per-token call that
    leaves the masked rows out (``lm_head_row_stats_masked``)."""
    lp, ent = lm_per_token(hidden, weight, tok)
    return (-lp * mask).sum() / mask.sum(), (ent.detach() * mask).sum() / mask.sum()


def paths():
    torch.manual_seed(0)
    T, H, V = 64, 32, 256
    hidden = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    tok, adv = torch.randint(0, V, (T,)), torch.randn(T)
    logits = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    sh, sw = (t.requires_grad_() for t in sweep_cases.head())
    teacher = rl.distinct_logits(sweep_cases.T, sweep_cases.V, torch.bfloat16, seed=2)
    frozen_h, frozen_w = sweep_cases.head()
    return {
        "given_logits_stats": (policy_loss, (logits, tok, adv), {}),
        "given_logits_stats_dynamic": (policy_loss, (logits, tok, adv), {"dynamic": True}),
        "lm_head_loss_in_graph": (lm_logprob_entropy, (hidden, weight, tok, adv), {}),
        "lm_head_loss_in_graph_recompute": (lm_logprob_entropy, (hidden, weight, tok, adv),
                                            {"lm_head_plan": "gpu"}),
        "lm_head_per_token": (lm_per_token, (hidden, weight, tok), {}),
        "lm_head_per_token_recompute": (lm_per_token, (hidden, weight, tok), {"lm_head_plan": "gpu"}),
        "lm_head_ce_per_token": (lm_ce_per_token, (hidden, weight, tok), {}),
        "lm_head_ce_per_token_every_row": (lm_ce_per_token, (hidden, weight, tok),
                                           {"skip_masked_rows": False}),
        "lm_head_per_token_masked": (lm_masked_per_token, (hidden, weight, tok, (adv > 0).float()), {}),
        "row_local_given_logits": (rl.topk_logprob, (logits, tok), {}),
        "row_local_given_logits_symbolic_scalar": (tempered_topk, (logits, tok, 0.7),
                                                   {"dynamic": True, "specialize_float": False}),
        # (strict off: row_split traces the region on real tensors of the inputs' device)
        "row_local_lm_head_loss": (sweep_cases.forward_kl, (sh, sw, teacher), {"strict": False}),
        "row_local_lm_head_sweeps": (sweep_cases.forward_kl, (frozen_h, frozen_w, teacher), {}),
        # (its per-row results kept, masked: on a GPU every row runs, said)
        "row_local_lm_head_sweeps_masked": (rrl.kd_and_masked_kl, rrl.inputs(torch.bfloat16, 0.5), {}),
    }


def to_cuda(mode: FakeTensorMode, v):
    """A fake CUDA tensor like ``v`` (shape, strides, dtype, requires_grad)."""
    if not isinstance(v, torch.Tensor):
        return v
    with mode:
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
    return t.requires_grad_(v.requires_grad) if v.is_floating_point() else t


def devices(values) -> list[str]:
    leaves = torch.utils._pytree.tree_leaves(values)
    return sorted({str(v.device) for v in leaves if isinstance(v, torch.Tensor)})


def _emitted(n) -> bool:
    return (n.op == "call_function" and callable(n.target)
            and registry.target_name(n.target) in registry.EMITTED)


class EmittedCalls(torch.fx.Interpreter):
    """Runs only the emitted calls (their fake kernels, on the example values of their
    inputs) and the constants they take; every other node gives its example value.
    (The graph's own ops are not run: a CPU-only torch's ``Tensor.__getitem__`` sets a
    device guard, which raises on a fake CUDA tensor; their example values were made
    by Dynamo and the passes.)
    ``run()`` returns the results of the emitted calls."""

    def __init__(self, gm):
        super().__init__(gm)
        self.results, self.refused = [], []

    def run_node(self, n):
        if n.op == "call_function" and n.target in FACTORIES:  # (a constant the rewrite made: made here)
            return super().run_node(n)
        if not _emitted(n):
            return meta(n) if n.op != "output" else None
        try:
            out = super().run_node(n)
        except RuntimeError as e:  # (see NO_CUDA_BUILD)
            if NO_CUDA_BUILD not in str(e):
                raise
            self.refused.append(registry.target_name(n.target))
            return meta(n)
        self.results.append(out)
        return out

    def run(self):
        super().run(*[meta(p) for p in self.module.graph.find_nodes(op="placeholder")])
        return self


def fake_cuda_graph(fn, args, dynamic: bool = False, specialize_float: bool = True):
    """``fn``'s Dynamo graph, its example values made fake CUDA tensors (sizes symbolic
    with ``dynamic``: the new fake mode shares the graph's shape environment)."""
    with torch._dynamo.config.patch(specialize_float=specialize_float):
        gm = dynamo_graph(fn, *args, dynamic=dynamic)
    old = next(v for p in gm.graph.find_nodes(op="placeholder") if isinstance(v := meta(p), FakeTensor))
    mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=old.fake_mode.shape_env)
    for n in gm.graph.nodes:
        if "example_value" in n.meta:
            n.meta["example_value"] = torch.utils._pytree.tree_map(lambda v: to_cuda(mode, v),
                                                                   n.meta["example_value"])
    return gm, mode


class _Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.text = []

    def emit(self, record):
        self.text.append(logging.Formatter().format(record))


def one(gm, mode, options):
    counters.clear()
    said = _Said()
    logging.getLogger("fx_passes").addHandler(said)
    try:
        with torch.no_grad():
            new = transform(gm, Config.from_options(options))
    finally:
        logging.getLogger("fx_passes").removeHandler(said)
    failed_for_no_cuda = any("Torch not compiled with CUDA enabled" in t for t in said.text)
    emitted = sorted({registry.target_name(n.target) for n in new.graph.nodes if _emitted(n)})
    values = [meta(n) for n in new.graph.nodes if n.op != "output"]
    factories = {f"{n.name}:{n.target.__name__}": str(n.kwargs.get("device")) for n in new.graph.nodes
                 if n.op == "call_function" and n.target in FACTORIES}
    counts, masked_op = [], lm_head_masked.lm_head_stats_masked

    def counted(*args):  # (the masked op's count of rows run: kept inside the call)
        results = masked_op(*args)
        counts.extend(devices(results[4:5]))  # (lse, logprob, entropy, index, count, lse's residual)
        return results
    with torch.no_grad(), mode, unittest.mock.patch.object(lm_head_masked, "lm_head_stats_masked", counted):
        calls = EmittedCalls(new).run()
    out = calls.results
    return {"emitted": emitted, "unchanged": new is gm, "failed_for_no_cuda": failed_for_no_cuda,
            "counters": dict(counters[COUNTER]), "value_devices": devices(values),
            "factory_devices": factories, "refused": sorted(set(calls.refused)),
            "output_devices": devices(out), "count_devices": counts,
            "fake_outputs": all(isinstance(o, FakeTensor) for o in torch.utils._pytree.tree_leaves(out)
                                if isinstance(o, torch.Tensor))}


@contextlib.contextmanager
def cuda_out_dtype_kernels():
    """``aten::mm.dtype`` / ``addmm.dtype`` registered for the CUDA key, as a CUDA build
    of torch (2.8 on) has them, so that the plan a GPU gets is chosen (what they compute
    is never run here: the fake kernels give the shapes)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for op in ("mm.dtype", "addmm.dtype"):
            lib.impl(op, lambda *a, **k: None, "CUDA")
        yield
    finally:
        lib._destroy()


def plans() -> dict:
    cuda = torch.device("cuda", 0)
    return {plan: tiling.backward_plan(cuda, torch.bfloat16, plan)
            for plan in ("auto", "gpu", "blocks", "kept_logits")}


def main() -> None:
    """Each path as this torch is built (no CUDA ``mm.dtype``: the ``"blocks"`` plan),
    then with the CUDA build's ``mm.dtype`` registered (the ``"gpu"`` plan), strict off
    there (see tests/test_fake_cuda.py on what a CPU-only torch cannot run); then the
    ``"gpu"`` plan's chunk loops."""
    graphs = {}
    for name, (fn, args, options) in paths().items():
        dynamic, specialize_float = options.pop("dynamic", False), options.pop("specialize_float", True)
        graphs[name] = (fake_cuda_graph(fn, args, dynamic, specialize_float), options)
    result = {}
    kinds = (("as_built", contextlib.nullcontext, True), ("gpu_kernels", cuda_out_dtype_kernels, False))
    for kind, kernels, strict in kinds:
        with kernels():
            result[kind] = {"plans": plans(), "paths": {
                name: one(gm, mode, {"strict": strict, **options})
                for name, ((gm, mode), options) in graphs.items()}}
    with cuda_out_dtype_kernels():
        result["loops"] = fake_cuda_loops.run(FakeTensorMode())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
