"""Other fused lm_head losses the GPU check compares with: Liger-Kernel and Cut Cross-Entropy.

Neither is a dependency of this package: each is used only when it imports, and only
on CUDA (their kernels are Triton).  Each applies only to the workloads whose maths its
API computes exactly from ``hidden`` and ``weight`` (temperature 1, the same loss), so
its errors against FP64 are read against the same reference as ours:

* WV (mean cross-entropy of ``hidden @ weight.T``): both.
* W4 (``-(logprob * advantages).mean()``): Cut Cross-Entropy's ``reduction="none"``
  gives the per-token ``-logprob`` and takes a per-token gradient.  Liger's fused
  linear cross-entropy computes its gradients inside the forward for a loss that is
  then only scaled, so per-token advantages cannot be applied after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

__all__ = ["BASELINES", "applies_to", "baseline_fn", "unavailable"]

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
