"""The package with torch alone (issue 55, item 1): torch does not require numpy, nor does
pyproject, so nothing in ``fx_passes`` may use it.  ``make test`` runs this file (and the
others ``BARE_TESTS`` names in the Makefile) a second time in ``.venv-bare``, a venv with
torch, pytest and expecttest only; there ``CHUNKED_LOGITS_BARE=1`` and numpy must be absent.

The three regions whose lm_head runs inside the row-local call (counter
``row_local_lm_head_in_call``), forward and backward, as accurate as stock: the call's
backward reads a host flag, which ``flag.numpy()`` did (``RuntimeError: Numpy is not
available`` with torch alone, where stock runs).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

import fx_passes
from tests import row_local_cases as rl
from tests.numerics import F32

T, V, H = rl.T, rl.V, 32
BARE = os.environ.get("CHUNKED_LOGITS_BARE") == "1"


def kl_batchmean_3d(hidden, weight, teacher, up=F32):
    """Distillation on ``[B, S, V]`` logits: ``batchmean`` divides by B."""
    s = (hidden @ weight.T).to(up).log_softmax(-1)
    t = teacher.to(up).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def soft_label_ce(hidden, weight, probs, up=F32):
    """Cross-entropy against given probabilities, with label smoothing (the target is a
    graph input: one the region computed would be declined)."""
    probs = probs if probs.dtype == up else probs.to(up)
    return F.cross_entropy((hidden @ weight.T).to(up), probs, label_smoothing=0.1)


def vocab_mean_regulariser(hidden, weight, labels, up=F32):
    """Cross-entropy plus a penalty on each row's mean logit over the vocabulary."""
    z = (hidden @ weight.T).to(up)
    return F.cross_entropy(z, labels) + 0.01 * z.mean(-1).square().mean()


def _inputs(name):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) / 4).bfloat16()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    if name == "kl_batchmean_3d":
        return kl_batchmean_3d, (hidden.view(2, T // 2, H), weight, teacher.view(2, T // 2, V))
    if name == "soft_label_ce":
        return soft_label_ce, (hidden, weight, teacher.float().softmax(-1))
    return vocab_mean_regulariser, (hidden, weight, torch.randint(0, V, (T,), generator=g))


@pytest.mark.parametrize("name", ["kl_batchmean_3d", "soft_label_ce", "vocab_mean_regulariser"])
def test_the_lm_head_in_the_call_runs_without_numpy(name):
    fn, inputs = _inputs(name)
    c = rl.check(fn, inputs, (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head_in_call") == 1, c


@pytest.mark.skipif(not BARE, reason="the bare pass of make test (CHUNKED_LOGITS_BARE=1) checks its venv")
def test_the_bare_venv_has_no_numpy():
    """Else the pass above proves nothing: torch would find numpy."""
    assert importlib.util.find_spec("numpy") is None
    with pytest.raises(RuntimeError, match="Numpy is not available"):
        torch.ones(1).numpy()


def _numpy_uses(path: pathlib.Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            uses += [a.name for a in node.names if a.name.split(".")[0] == "numpy"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numpy":
            uses.append(f"from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr == "numpy":
            uses.append(f".numpy (line {node.lineno})")
    return [f"{path.name}: {u}" for u in uses]


def test_no_numpy_anywhere_in_the_package():
    """Every module, including those no test here runs: no ``import numpy`` and no
    ``.numpy`` attribute (``Tensor.numpy()``)."""
    root = pathlib.Path(fx_passes.__file__).parent
    uses = [u for path in sorted(root.rglob("*.py")) for u in _numpy_uses(path)]
    assert not uses, uses
