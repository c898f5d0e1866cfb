"""A graph break between the upcast and the loss: the graph that made the FP32 logits and
returned them at the break, and the graph that takes them, are named (near misses) with
the break's source line and what to change; and a custom autograd.Function around the
log-probs that Dynamo traces is matched like any other region."""

from __future__ import annotations

import re

import torch
from torch._dynamo.utils import counters

from fx_passes.reporting.session import session
from tests.helpers import chunked_counters

T, H, V = 8, 16, 64
HERE = re.escape(__file__)


def _hints() -> list[str]:
    return [e.what for e in session.events if e.kind == "near_miss"]


def _line(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / 4).bfloat16()
    return h, w, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)


def fused_first(logits, tokens):
    try:  # a fused kernel when it is installed, as trainers do
        from not_an_installed_kernel_package import logprobs  # noqa: F401  # import
        return logprobs(logits, tokens)
    except ImportError:
        pass
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)


def step_import(h, w, tokens, adv):
    logits = (h @ w.T).float() / 0.7  # upcast
    return -(fused_first(logits, tokens) * adv).mean()  # call


def test_import_in_try_breaks_the_graph_near_miss_names_graph_break_and_fix():
    torch._dynamo.reset()
    counters.clear()
    torch.compile(step_import, backend="chunked_logits")(*_inputs())
    (hint,) = _hints()
    call, imp, up = _line("call"), _line("import"), _line("upcast")
    assert re.fullmatch(
        r"graph [0-9]+/[0-9]+ of step_import "
        r"" + re.escape(f"(ends at {__file__}:{call}) returns the FP32 logits ")
        + r"\w+ " + re.escape(f"[{T}, {V}] (upcast at ") + r"\w+ " + re.escape(
            f'(File "{__file__}", line {up}, in step_import)) because Dynamo breaks the graph at '
            f'{__file__}:{call} '
            f"(step_import) -> {__file__}:{imp} (fused_first) (Import failure): the loss that reads them "
            f"is not "
            "in this graph, so the pass cannot remove the FP32 copy: move the import out of the compiled "
            "code "
            "(to module level, or done once before torch.compile), so that Dynamo traces the upcast and the "
            "loss as one graph"), hint), hint


def logprobs_after_break(logits, tokens):
    torch._dynamo.graph_break()  # break
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)


def step_break(h, w, tokens, adv):
    logits = (h @ w.T).to(torch.float32)  # upcast2
    return -(logprobs_after_break(logits, tokens) * adv).mean()  # call2


def test_graph_taking_fp32_logits_after_a_break_names_both_graphs():
    torch._dynamo.reset()
    counters.clear()
    torch.compile(step_break, backend="chunked_logits")(*_inputs())
    made, taken = _hints()
    call, brk = _line("call2"), _line("break")
    where = re.escape(f"{__file__}:{call} (step_break) -> {__file__}:{brk} (logprobs_after_break)")
    assert re.search(r"^graph [0-9]+/[0-9]+ of step_break .* returns the FP32 logits .* because Dynamo "
                     r"breaks the graph at " + where, made), made
    assert re.fullmatch(
        r"graph [0-9]+/[0-9]+ of \w+ \(ends at " + HERE + r":[0-9]+\) takes the FP32 logits \w+ "
        + re.escape(f"[{T}, {V}] that ") + r"graph [0-9]+/[0-9]+ of step_break .* made \(upcast at .*\) and "
        r"returned at the graph break at "
        r"" + where + r" \(.*\): the upcast and the loss are in two graphs, so "
        r"this one sees FP32 logits already and the other returns them whole: remove the break "
        r".*", taken), taken
    assert chunked_counters().get("declined:NOT_LOW_PRECISION") == 1


def test_no_break_no_hint():
    def step(h, w, tokens, adv):
        logits = (h @ w.T).float()
        return -(torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1) * adv).mean()
    torch._dynamo.reset()
    counters.clear()
    torch.compile(step, backend="chunked_logits")(*_inputs())
    assert _hints() == [] and chunked_counters().get("rewritten") == 1


class _VocabEntropy(torch.autograd.Function):
    """Entropy of the rows of FP32 logits with a hand-written backward (as a
    vocab-parallel entropy is written, on one shard)."""

    @staticmethod
    def forward(ctx, logits):
        top = logits.amax(-1, keepdim=True)  # forward
        total = (logits - top).exp().sum(-1, keepdim=True)
        p = (logits - top).exp() / total
        entropy = total.log().squeeze(-1) + top.squeeze(-1) - (p * logits).sum(-1)
        ctx.save_for_backward(p, logits)
        return entropy

    @staticmethod
    def backward(ctx, grad):
        p, logits = ctx.saved_tensors
        mean = (p * logits).sum(-1, keepdim=True)
        return -grad.unsqueeze(-1) * p * (logits - mean)


def entropy_via_function(h, w):
    return _VocabEntropy.apply((h @ w.T).float()).mean()  # apply


def test_custom_autograd_function_on_fp32_logits_is_a_near_miss_naming_it():
    h, w, _, _ = _inputs()
    torch._dynamo.reset()
    counters.clear()
    h.requires_grad_()
    loss = torch.compile(entropy_via_function, backend="chunked_logits")(h, w)
    loss.backward()
    (hint,) = _hints()
    apply, fwd = _line("apply"), _line("forward")
    assert re.fullmatch(
        re.escape("the FP32 logits ") + r"\w+" + re.escape(f" [{T}, {V}] (upcast at ") + r"\w+ " + re.escape(
            f'(File "{__file__}", line {apply}, in entropy_via_function)) are read by the custom '
            f'autograd.Function _VocabEntropy (forward at File "{__file__}", line {fwd}, in forward), whose '
            "forward and hand-written backward the pass does not rewrite, so the FP32 copy and what the "
            "Function "
            "saves for backward stay: compute it with torch ops outside an autograd.Function (the pass "
            "derives "
            "the backward itself), or pass the model-precision logits into the Function and upcast one "
            "chunk of "
            "rows at a time inside it"), hint), hint
    p = torch.softmax((h.double() @ w.double().T), -1)  # (the Function is run as written)
    expected = -(p * p.log()).sum(-1).mean()
    assert abs(loss.item() - expected.item()) < 1e-3


def test_the_function_is_named_from_its_call_line_with_or_without_carets():
    """Dynamo's stack trace ends with the call's source line, then (torch 2.13) a line of
    carets under it (2.11 and 2.12 write none): the Function's name is read either way."""
    from types import SimpleNamespace

    from fx_passes.match.near_miss import _function_name
    frames = '  File "a.py", line 3, in outer\n    return model.apply(x)\n  File "a.py", line 9, in step\n' \
             '    return _VocabEntropy.apply(logits).mean()\n'
    for trace in (frames, frames + "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"):
        assert _function_name(SimpleNamespace(meta={"stack_trace": trace})) == "_VocabEntropy"
    assert _function_name(SimpleNamespace(meta={})) == "(its name unknown)"
