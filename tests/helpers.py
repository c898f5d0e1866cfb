"""Small helpers shared by the tests: capture a Dynamo graph, run the passes on it."""

from __future__ import annotations

import json

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from fx_passes import Config, env
from fx_passes.fx.graph_ops import attribute_view
from fx_passes.pipeline import transform


def dynamo_graph(fn, *args, dynamic=False) -> torch.fx.GraphModule:
    """The (single) Dynamo graph of ``fn`` on ``args``, as the backend receives it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=dynamic, fullgraph=True)(*args)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def rewrite_graphs(fn, *args, dynamic=False, **options) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(graph before, graph after) of the passes on ``fn``'s Dynamo graph."""
    gm = dynamo_graph(fn, *args, dynamic=dynamic)
    return gm, transform(gm, Config.from_options(options))


def rewrite(fn, *args, dynamic=False, **options) -> tuple[str, str]:
    """(code before, code after) of the passes on ``fn``'s Dynamo graph."""
    before, after = rewrite_graphs(fn, *args, dynamic=dynamic, **options)
    return before.code.strip(), after.code.strip()


def ops(gm: torch.fx.GraphModule) -> str:
    """The graph's calls in order, one word each: ``.float`` for a method call
    (``x.float()``) or an attribute view (``.T``: Dynamo's ``getattr`` up to torch 2.13,
    ``aten.numpy_T`` from 2.14), ``log_softmax`` for a function (``torch.log_softmax``,
    ``F.log_softmax``) or operator (``truediv`` for ``/``).  Placeholders, outputs and the
    names Dynamo gives nodes are left out: what a graph computes, in words that stay the
    same across torch versions (Dynamo's printing of a graph does not)."""
    words = []
    for n in gm.graph.nodes:
        if attribute_view(n):  # ``w.T``: getattr up to torch 2.13, aten.numpy_T from 2.14
            words.append(f".{attribute_view(n)}")
        elif n.op == "call_method":
            words.append(f".{n.target}")
        elif n.op == "call_function":
            words.append(getattr(n.target, "__name__", str(n.target)))
        elif n.op in ("call_module", "get_attr"):
            words.append(f"{n.op}:{n.target}")
    return " ".join(words)


def assert_retained_backward_repeats(loss: torch.Tensor, *leaves: torch.Tensor) -> None:
    """``loss.backward(retain_graph=True)`` then ``loss.backward()``: the second gives
    each leaf's first gradient, bit for bit."""
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss.backward()
    assert all(torch.equal(t.grad, f) for t, f in zip(leaves, first))


def chunked_counters() -> dict:
    return dict(counters["chunked_logits"])


def clean_env(**extra: str) -> dict:
    """What a fresh process that knows nothing of chunked-logits would see (see
    ``fx_passes.env.without_ours``)."""
    return env.without_ours(**extra)


def last_json(stdout: str) -> dict:
    """The JSON object a child process printed on its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


class LargestFP32(TorchDispatchMode):
    """The element count of the largest FP32 tensor any op allocates (views excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t._is_view():
                self.largest = max(self.largest, t.numel())
        return out

    def eager_bodies(self, body, options):
        """A chunk-body compiler (``body_compiler.compiling_with(big.eager_bodies)``): each
        body runs eagerly under this mode, which sees every op it runs, forward and backward."""
        def watched(*args):
            with self:
                return body(*args)
        return watched


def made_otherwise_before(version: str, why: str):
    """A test that reads what torch ``version`` and later make (generated code, Dynamo's
    names, stock's buffers), marked as failing before it, saying what older ones make
    (strict: one that passes there is reported)."""
    import pytest
    from torch.torch_version import TorchVersion
    return pytest.mark.xfail(TorchVersion(torch.__version__) < version, strict=True,
                             reason=f"torch < {version}: {why}")


class RowGathers(TorchDispatchMode):
    """Appends to ``seen`` the shape of each ``aten.gather`` from a tensor whose last size is
    ``width`` (a logits row: NOTE [a body that writes over its logits])."""

    def __init__(self, width: int, seen: list) -> None:
        super().__init__()
        self.width, self.seen = width, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.gather.default and args[0].shape[-1] == self.width:
            self.seen.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def auto_plan_computes_gradients_in_forward(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the lm_head loop's ``"auto"`` plan on this CPU computes the gradients in the
    forward: ``two_sweeps`` on CPUs with bf16 units does (the loss in the graph runs as
    ``lm_head_loss``), ``fp32_tiles`` on AVX2-only CPUs does not.  A test whose subject is
    not the plan expects what this says, so the suite passes on both kinds of CPU."""
    from fx_passes.kernels.tiling import backward_plan
    from fx_passes.rewrite.loss_tail import PLANS
    return backward_plan(torch.device("cpu"), dtype) in PLANS


def isa_probes_settled() -> dict[str, str]:
    """``TORCHINDUCTOR_VEC_ISA_OK=1`` where this process found that every vector ISA the
    CPU lists builds and loads: a child then picks the same ISA without probing, which in
    a cold cache costs ~6 s of probe compiles; else nothing (the child probes)."""
    from torch._inductor import cpu_vec_isa as isa

    if not hasattr(isa, "x86_isa_checker"):
        return {}
    cpu = isa.x86_isa_checker()
    listed = [i for i in isa.supported_vec_isa_list if all(flag in cpu for flag in str(i).split())]
    return {"TORCHINDUCTOR_VEC_ISA_OK": "1"} if listed and isa.valid_vec_isa_list() == listed else {}
