"""The repository's import rules: tests import only support modules (never a test_*.py),
and benchmarks never import tests (the workloads live in benchmarks/workloads.py)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "tests." * (node.level > 0 and path.parent.name == "tests") + (node.module or "")
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "tests").glob("*.py")), ids=lambda p: p.name)
def test_tests_import_no_test_module(path):
    assert not [n for n in imported(path) if n.split(".")[-1].startswith("test_")]


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_import_no_tests(path):
    assert not [n for n in imported(path) if n == "tests" or n.startswith("tests.")]
