"""CUDA-graph safety stated for every op (issue 55, item 6): each op of the
``chunked_logits`` torch.library namespace has a row in docs/gpu.md's table ("CUDA
graphs"): ``cudagraph_unsafe`` exactly when the op carries ``torch.Tag.cudagraph_unsafe``,
``capture-safe`` with the reason otherwise; the table names no op that does not exist.
An op added later without a row fails here (tests/test_gpu_registry.py checks the code's
``@emitted`` decision against the same tags).
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re

import torch

import fx_passes

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "gpu.md"
ROW = re.compile(r"^\| `(\w+)` \| (capture-safe|cudagraph_unsafe) \| (.*) \|$")


def namespace_ops() -> dict[str, bool]:
    """Every op registered under ``chunked_logits::`` (every module of the package imported:
    an op is defined where its module is) -> whether it is tagged unsafe."""
    for info in pkgutil.walk_packages(fx_passes.__path__, "fx_passes."):
        importlib.import_module(info.name)
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("chunked_logits::")}
    ns = torch.ops.chunked_logits
    return {name: torch.Tag.cudagraph_unsafe in getattr(ns, name).default.tags for name in names}


def doc_table(text: str) -> dict[str, tuple[str, str]]:
    """op -> (decision, why) of the table under "## CUDA graphs"."""
    section = text.split("## CUDA graphs", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if m := ROW.match(line.strip()):
            assert m[1] not in rows, f"{m[1]} has two rows"
            rows[m[1]] = (m[2], m[3].strip())
    return rows


def undecided(ops: dict[str, bool], table: dict[str, tuple[str, str]]) -> list[str]:
    """What is wrong, one line per op: missing, disagreeing with its tag, or without a reason."""
    wrong = []
    for name, unsafe in sorted(ops.items()):
        decision, why = table.get(name, (None, ""))
        if decision is None and not unsafe:
            wrong.append(f"{name}: neither tagged cudagraph_unsafe nor listed capture-safe in docs/gpu.md")
        elif decision is None:
            wrong.append(f"{name}: tagged cudagraph_unsafe, no row in docs/gpu.md")
        elif (decision == "cudagraph_unsafe") != unsafe:
            wrong.append(f"{name}: docs/gpu.md says {decision}, its tags say "
                         f"{'cudagraph_unsafe' if unsafe else 'capture-safe'}")
        elif not why:
            wrong.append(f"{name}: no reason in docs/gpu.md")
    wrong += [f"{name}: listed in docs/gpu.md, not an op" for name in sorted(set(table) - set(ops))]
    return wrong


def test_every_op_is_tagged_unsafe_or_documented_capture_safe():
    ops = namespace_ops()
    assert len(ops) >= 24, sorted(ops)  # (the namespace as of issue 55: a failed import would empty it)
    assert not undecided(ops, doc_table(DOC.read_text())), undecided(ops, doc_table(DOC.read_text()))


def test_an_op_without_a_row_fails():
    """The check itself: a new untagged op, a row that contradicts the tag, a row for no op."""
    table = {"a": ("capture-safe", "device work"), "b": ("capture-safe", "x"), "gone": ("capture-safe", "x")}
    assert undecided({"a": False, "b": True, "new": False}, table) == [
        "b: docs/gpu.md says capture-safe, its tags say cudagraph_unsafe",
        "new: neither tagged cudagraph_unsafe nor listed capture-safe in docs/gpu.md",
        "gone: listed in docs/gpu.md, not an op"]
