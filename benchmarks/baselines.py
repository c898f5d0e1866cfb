"""Other fused lm_head losses: Liger-Kernel and Cut Cross-Entropy (the GPU check), and torch
core's chunked ``F.linear_cross_entropy`` (run.py, on any device).

Neither is a dependency of this package: each is used only when it imports, and only
on CUDA (their kernels are Triton).  Each applies only to the workloads whose maths its
API computes exactly from ``hidden`` and ``weight`` (temperature 1, the same loss), so
its errors against FP64 are read against the same reference as ours:

* WV (mean cross-entropy of ``hidden @ weight.T``): both.
* W4 (``-(logprob * advantages).mean()``): Cut Cross-Entropy's ``reduction="none"``
  gives the per-token ``-logprob`` and takes a per-token gradient.  Liger's fused
  linear cross-entropy computes its gradients inside the forward for a loss that is
  then only scaled, so per-token advantages cannot be applied after it.

Torch's ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` (torch >= 2.13)
is a *peer* of run.py: a mode of its own, eager (``torch_lce``) or under stock Inductor
(``torch_lce_compiled``), on WV, the mean cross-entropy of ``hidden @ weight.T``.  Compiled,
it runs with ``allow_retain_graph=True``: torch forces that setting under ``torch.compile``
anyway, but with the default it first calls ``warnings.warn``, which Dynamo cannot trace:
the graph breaks there and the op runs eagerly (no graph at all).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

__all__ = ["BASELINES", "PEERS", "applies_to", "baseline_fn", "peer_fn", "peers_for", "peer_unavailable",
           "unavailable"]

BASELINES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}  # mode -> module to import


def liger_lm_head_ce(hidden, weight, labels):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")(weight, hidden, labels)
    return loss[0] if isinstance(loss, tuple) else loss  # versions with return_z_loss return a pair


def cce_lm_head_ce(hidden, weight, labels):
    from cut_cross_entropy import linear_cross_entropy
    return linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="mean")


def cce_lm_head_policy(hidden, weight, tokens, advantages):
    from cut_cross_entropy import linear_cross_entropy
    nll = linear_cross_entropy(hidden, weight, tokens, reduction="none")  # -logprob per token
    return (nll.float() * advantages).mean()


_FNS: dict[tuple[str, str], Callable] = {
    ("liger", "WV"): liger_lm_head_ce,
    ("cce", "WV"): cce_lm_head_ce,
    ("cce", "W4"): cce_lm_head_policy,
}


def applies_to(name: str) -> list[str]:
    """The baselines that compute workload ``name``'s loss."""
    return [b for b in BASELINES if (b, name) in _FNS]


def baseline_fn(mode: str, name: str) -> Callable:
    return _FNS[(mode, name)]


def unavailable(mode: str, device: torch.device) -> str | None:
    """Why baseline ``mode`` cannot run here, or None when it can."""
    module = BASELINES[mode]
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (not installed, or installed without a working Triton)
        return f"{module} is not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if device.type != "cuda":
        return f"{module} needs CUDA (Triton kernels)"
    return None


# --- torch core's chunked linear cross-entropy: a peer mode of run.py -----------------

PEERS = {  # mode -> what runs
    "torch_lce": "F.linear_cross_entropy(..., options=LinearCrossEntropyOptions()), eager",
    "torch_lce_compiled": 'the same, allow_retain_graph=True, under torch.compile(backend="inductor")',
}
PEER_WORKLOADS = ("WV",)  # the loss F.linear_cross_entropy computes: mean CE of hidden @ weight.T


def torch_lce_ce(hidden, weight, labels):
    """WV's loss by torch core's chunked path (its defaults: ``LinearCrossEntropyOptions()``)."""
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions
    return F.linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="mean",
                                  options=LinearCrossEntropyOptions())


def torch_lce_ce_compilable(hidden, weight, labels):
    """The same with the setting torch forces under compile, so that Dynamo does not break
    the graph at the warning that announces it (see the module's docstring)."""
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions
    return F.linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="mean",
                                  options=LinearCrossEntropyOptions(allow_retain_graph=True))


def peers_for(name: str) -> list[str]:
    """The peer modes that compute workload ``name``'s loss."""
    return list(PEERS) if name in PEER_WORKLOADS else []


def peer_fn(mode: str, name: str) -> Callable:
    if mode not in PEERS or name not in PEER_WORKLOADS:
        raise ValueError(f"peer mode {mode!r} does not compute workload {name!r} "
                         f"(peers run on {', '.join(PEER_WORKLOADS)})")
    return torch_lce_ce_compilable if mode == "torch_lce_compiled" else torch_lce_ce


def peer_unavailable() -> str | None:
    """Why torch's chunked ``F.linear_cross_entropy`` cannot run here, or None when it can."""
    import torch.nn.functional as F
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return (f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions "
                "(torch >= 2.13)")
    return None
