"""Register where defined (issue 34, item 3) and the CUDA graph decision (issue 35, item 2).

Every function a rewritten graph calls carries ``@emitted`` where it is defined
(``fx_passes.kernels.ops.registry``): the registry feeds Inductor's cacheable marks and
records, per custom op, whether it is capture-safe or tagged ``cudagraph_unsafe``.

* the ``call_function`` targets of graphs rewritten from a set of representative programs
  (each path: lm_head loss-in-graph and per-token, row-local with and without the
  lm_head, saved masks, loss tails, vocab-parallel stages and one pass) are torch's,
  Python's or registered; the check itself fails on an unregistered target;
* each registered op's ``torch.Tag.cudagraph_unsafe`` agrees with its entry, and every
  ``chunked_logits::`` op has an entry (an op added later without a decision fails);
* a warm start (a new process, AOTAutograd's cache filled by a first one) of a graph
  calling ``row_local_sweeps`` / ``row_local_loss`` / ``row_local_head`` is served from
  the cache (before, those three were missing from the hand-kept list: never cached).
"""

from __future__ import annotations

import builtins
import json
import operator
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fx_passes import pipeline
from fx_passes.kernels.ops import registry
from tests import row_local_cases as rl
from tests import shard_heads
from tests import sweep_cases as sweeps
from tests.helpers import isa_probes_settled, rewrite_graphs

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHILD = pathlib.Path(__file__).resolve().parent / "registry_cache_child.py"
BF16 = torch.bfloat16


def _lm_head(T=24, V=64, H=16):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(V, H, generator=g) / 4).to(BF16).requires_grad_()
    return h, w, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)


def per_token(h, w, tok):
    logp = torch.log_softmax((h @ w.T).float(), -1)
    return logp.gather(-1, tok[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def loss_in_graph(h, w, tok, adv):
    return -(per_token(h, w, tok)[0] * adv).mean()


def given_logits(z, tok):
    logp = torch.log_softmax(z.float() / 0.7, -1)
    return logp.gather(-1, tok[:, None]).squeeze(-1)


def _programs():
    """(name, fn, inputs, options): a program per path the rewrites take."""
    h, w, tok, adv = _lm_head()
    z = rl.distinct_logits(24, 64, BF16, seed=1)
    kept = rl.kept_tokens(z)
    out = [("per_token", per_token, (h, w, tok), {}),
           # (two_sweeps: the plan that runs the loss in the graph on any CPU; "auto" runs
           # fp32_tiles on an AVX2-only CPU, which computes no gradient in the forward)
           ("loss_in_graph", loss_in_graph, (h, w, tok, adv), {"lm_head_plan": "two_sweeps"}),
           ("loss_in_graph_gpu", loss_in_graph, (h, w, tok, adv), {"lm_head_plan": "gpu"}),
           ("given_logits", given_logits, (z.requires_grad_(), tok), {}),
           ("saved_masks", rl.topk_logprob, (z, kept), {}),
           ("saved_normalizers", rl.topk_topp_logprob, (z, kept), {})]
    for name in ("forward_kl", "kl_div_linear", "smoothed_ce", "per_token_kl"):
        fn, inputs, grad_pos = sweeps.case(name)
        inputs = [t.requires_grad_() if i in grad_pos else t for i, t in enumerate(inputs)]
        out += [(name, fn, inputs, {}), (f"{name}-sweeps", fn, inputs, {"gradients_in_forward": False}),
                (f"{name}-head", fn, inputs, {"row_local_sweeps": False})]
    return out


def _vp_programs():
    x, tok = shard_heads.inputs(BF16)
    h, w, t2 = shard_heads.lm_inputs(BF16, shard_heads.logprob)
    return [("vp_stages", shard_heads.logprob, (x.requires_grad_(), tok), {}),
            ("vp_one_pass", shard_heads.with_lm_head(shard_heads.logprob),
             (h.requires_grad_(), w.requires_grad_(), t2), {}),
            ("vp_inplace", shard_heads.with_lm_head(shard_heads.logprob_inplace),
             (h, w, t2), {})]


def _ours_or_foreign(target) -> bool:
    """Is ``target`` neither torch's (an op, a public function), nor Python's (operator,
    builtins): a function AOTAutograd's cache cannot vouch for unless it is marked?"""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, str)):
        return False
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator", "builtins") or target in vars(operator).values() \
            or target in vars(builtins).values():
        return False
    return not (module == "torch" or module.startswith(("torch.", "torch._C")))


def unregistered(graphs) -> set[str]:
    """The names of the call targets in ``graphs`` that are neither torch's / Python's nor
    registered (``registry.EMITTED``)."""
    names = set()
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function" and _ours_or_foreign(n.target):
                name = registry.target_name(n.target)
                if name not in registry.EMITTED:
                    names.add(name)
    return names


def _rewritten(programs) -> dict[str, torch.fx.GraphModule]:
    graphs = {}
    for name, fn, inputs, options in programs:
        before, after = rewrite_graphs(fn, *inputs, **options)
        assert after.code != before.code, f"{name}: not rewritten"
        graphs[name] = after
    return graphs


@pytest.fixture(scope="module")
def rewritten(one_rank_group):
    return {**_rewritten(_programs()), **_rewritten(_vp_programs())}


def test_every_emitted_target_is_registered(rewritten):
    targets = {registry.target_name(n.target) for gm in rewritten.values() for n in gm.graph.nodes
               if n.op == "call_function" and _ours_or_foreign(n.target)}
    # the paths above emit these (the three the hand-kept list missed among them)
    assert {"fx_passes.kernels.row_local.head.row_local_head",
            "fx_passes.kernels.row_local.sweeps.row_local_sweeps",
            "fx_passes.kernels.row_local.loss.row_local_loss",
            "fx_passes.kernels.log_softmax.loss.lm_head_loss",
            "fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats",
            "fx_passes.kernels.row_local.engine.row_local",
            "fx_passes.distributed.shard_reduce.shard_reduce",
            "fx_passes.distributed.one_pass.shard_lm_head_stages"} <= targets, targets
    assert unregistered(rewritten.values()) == set()
    marks = pipeline.with_cacheable_marks({})
    assert targets <= set(marks), targets - set(marks)


def test_the_check_fails_on_an_unregistered_target(rewritten, monkeypatch):
    """Drop one entry (as a new op without ``@emitted`` would be): the check names it."""
    name = "fx_passes.kernels.row_local.head.row_local_head"
    items = dict(registry.EMITTED._items)
    del items[name]
    monkeypatch.setattr(registry.EMITTED, "_items", items)
    assert unregistered(rewritten.values()) == {name}
    assert name not in pipeline.with_cacheable_marks({})


def _ops_namespace() -> set[str]:
    import fx_passes  # noqa: F401  (every module that defines an op is imported)
    return {name for name in dir(torch.ops.chunked_logits)
            if isinstance(getattr(torch.ops.chunked_logits, name), torch._ops.OpOverloadPacket)}


def test_each_op_has_a_capture_decision_its_tag_agrees_with():
    decided = {}
    for entry in (registry.EMITTED[k] for k in registry.EMITTED):
        for op in entry.ops:
            assert decided.setdefault(op, entry.capture) == entry.capture, (op, entry)
    defined = _ops_namespace()
    assert defined and defined <= set(decided), defined - set(decided)  # no op without a decision
    for op, capture in decided.items():
        tags = getattr(torch.ops.chunked_logits, op).default.tags
        assert (torch.Tag.cudagraph_unsafe in tags) == (capture == registry.CUDAGRAPH_UNSAFE), (op, tags)
    # the ops that keep host state are the unsafe ones
    assert decided["row_local_head"] == decided["row_local_head_backward"] == registry.CUDAGRAPH_UNSAFE
    assert decided["shard_lm_head_stages"] == registry.CUDAGRAPH_UNSAFE  # (collectives inside)


def test_a_bad_decision_is_a_value_error():
    with pytest.raises(ValueError, match="capture"):
        registry.emitted(("x",), None)
    with pytest.raises(ValueError, match="capture"):
        registry.emitted((), registry.CAPTURE_SAFE)


def _child(cache_dir, options: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_LOGS"))}
    # (isa_probes_settled: the CPU's best ISA without compiling a probe for each, ~6.5 CPU-s
    # in a new cache directory; the ISA picked, and every cache key, is the same in each child)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_COMPILE_THREADS="1", **isa_probes_settled())
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(options)], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # (two fresh processes, one after the other: a cold compile, then the warm start)
# (make test-full: test_vocab_parallel and test_recompiles_cache start warm in make test)
@pytest.mark.full
@pytest.mark.parametrize("options,counter", [({"gradients_in_forward": False}, "row_local_lm_head")],
                         ids=["row_local_sweeps"])
def test_a_warm_start_is_served_from_the_cache(tmp_path, options, counter):
    """A distillation step whose lm_head runs in ``row_local_sweeps``: the first process
    compiles and stores (AOTAutograd's cache), a second one hits and compiles nothing."""
    first = _child(tmp_path, options)
    assert first["chunked_logits"].get(counter) == 1, first
    stored = first["aot_autograd"].get("autograd_cache_saved", 0)  # (the step's graph and its bodies')
    assert stored >= 1 and first["aot_autograd"] == {"autograd_cache_miss": stored,
                                                     "autograd_cache_saved": stored}, first  # no bypass
    warm = _child(tmp_path, options)
    assert warm["aot_autograd"] == {"autograd_cache_hit": stored}, warm  # nothing compiled from scratch
    assert warm["checksum"] == first["checksum"]


def test_scalar_constants_are_made_on_the_calls_device():
    """A number a call reads whole becomes a 0-d tensor on the device of the call's
    tensors (a host tensor in a CUDA graph's inputs would keep Inductor from capturing)."""
    from torch.fx import Graph

    from fx_passes.fx.graph_ops import scalar_tensor

    g = Graph()
    x, t = g.placeholder("x"), g.placeholder("t")
    x.meta["example_value"] = torch.empty(2, 3, device="meta")
    t.meta["example_value"] = 0.7
    made = scalar_tensor(g, t, x)
    assert made.kwargs == {"dtype": torch.float32, "device": torch.device("meta")}, made.kwargs
