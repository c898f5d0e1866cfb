"""The compiled bodies of vocab-parallel stages (:mod:`fx_passes.distributed.vocab_parallel`).

A rewritten stage's reductions are an FX graph ``fn(x, *operands) -> tuple`` (the region's
own ops replayed), registered under a key that the rewritten graph passes to the stage's
custom op.  Here each key's forward and vector-Jacobian product are compiled by Inductor
once (fused kernels that read the model-precision logits: no FP32 ``[.., V]`` buffer), and
run eagerly if compiling fails.
"""

from __future__ import annotations

import hashlib
import types

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule

from .. import compat
from ..reporting.report import COUNTER, log

__all__ = ["register", "function", "body", "backward_body"]

_FUNCTIONS: dict[str, GraphModule] = {}
_COMPILED: dict = {}


def register(gm: GraphModule) -> str:
    """The key of ``gm`` (by its code: the same stage in two graphs shares one body)."""
    key = hashlib.sha256(gm.code.encode()).hexdigest()[:24]
    _FUNCTIONS.setdefault(key, gm)
    return key


def function(key: str) -> GraphModule:
    """The stage's reductions, uncompiled (fake-tensor shapes, eager fallback)."""
    return _FUNCTIONS[key]


def _own_code(fn, name: str):
    """``fn`` with a code object of its own: Dynamo keeps its compiled graphs and guards
    per code object, so each stage's body gets its own cache (one closure shared by all
    stages would recompile from one to the next and hit the recompile limit)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _fallback(compiled, eager, what: str):
    """``compiled``, or ``eager`` from the first time ``compiled`` raises (a compile
    failure inside a training step must not end it): the same maths without Inductor's
    fused kernels, so FP32 ``[.., V]`` temporaries exist again; said once in the log."""
    state = {"fn": compiled}

    def call(*args):
        if state["fn"] is compiled:
            try:
                return compiled(*args)
            except Exception:  # noqa: BLE001 - any compile failure: fall back, say so
                log.warning("chunked_logits: compiling the vocab-parallel body %s failed; it runs "
                            "eagerly from now on (same results, FP32 temporaries)", what, exc_info=True)
                counters[COUNTER]["shard_body_eager"] += 1
                state["fn"] = eager
        return state["fn"](*args)
    return call


def body(key: str):
    """The stage's reductions, compiled by Inductor once per key (fused kernels that read
    the model-precision logits: no FP32 [.., V] buffer)."""
    if key not in _COMPILED:
        fn = _FUNCTIONS[key]

        def reductions(*args):
            return fn(*args)
        run = _fallback(_compile(_own_code(reductions, f"shard_reduce_{key}")), reductions, key)

        def call(*args):  # one dispatch-key set and grad mode on every call (Dynamo guards on them)
            with compat.below_autograd_no_grad():
                return run(*(a.detach() for a in args))
        _COMPILED[key] = call
    return _COMPILED[key]


def backward_body(key: str, wanted: tuple[int, ...]):
    """``(*inputs, *grads) -> grads of inputs[i] for i in wanted``, where inputs are
    ``(x, *operands)``: the vector-Jacobian product of the stage's reductions, compiled
    once per key (a pointwise pass that writes the logits gradient in model precision)."""
    if (key, wanted) not in _COMPILED:
        fn = _FUNCTIONS[key]
        n = sum(1 for node in fn.graph.nodes if node.op == "placeholder")

        def vjp(*args):
            inputs, grads = args[:n], args[n:]

            def partial(*diff):
                full = list(inputs)
                for i, d in zip(wanted, diff):
                    full[i] = d
                return tuple(fn(*full))
            _, pullback = torch.func.vjp(partial, *(inputs[i] for i in wanted))
            return pullback(tuple(grads))
        name = f"shard_reduce_backward_{key}_{'_'.join(map(str, wanted))}"
        run = _fallback(_compile(_own_code(vjp, name)), vjp, name)

        def call(*args):
            with torch.no_grad():
                return run(*(a.detach() for a in args))
        _COMPILED[(key, wanted)] = call
    return _COMPILED[(key, wanted)]
