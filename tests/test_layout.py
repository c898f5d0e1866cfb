"""The repository's import rules: tests import only support modules (never a test_*.py)
and no benchmark, benchmarks never import tests (what both need, the workloads and the
generated-code check, is ``fx_passes.testing``), and the package's stages import downwards."""

from __future__ import annotations

import ast
import pathlib
import re

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


@pytest.mark.parametrize("path", sorted((ROOT / "tests").glob("*.py")), ids=lambda p: p.name)
def test_tests_import_no_benchmark(path):
    assert not [n for n in imported(path) if n == "benchmarks" or n.startswith("benchmarks.")]


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").rglob("*.py")), ids=lambda p: p.name)
def test_benchmarks_import_no_tests(path):
    assert not [n for n in imported(path) if n == "tests" or n.startswith("tests.")]


# The package's stages, lowest first (issue 20): a module imports only from its own
# folder (acyclically) or from a lower stage.  Each folder's __init__ says what it holds.
STAGES = (("config",), ("env", "compat"), ("reporting",), ("fx",), ("kernels",), ("match",), ("rewrite",),
          ("distributed",), ("pipeline",), ("entry",), ("__init__", "__main__"), ("testing",))
LEVEL = {name: i for i, names in enumerate(STAGES) for name in names}
PACKAGE = ROOT / "fx_passes"


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _stage(module: str) -> str:
    return module.split(".")[1] if module != "fx_passes" else "__init__"


def package_imports() -> dict[str, set[str]]:
    """Each fx_passes module -> the fx_passes modules it imports (anywhere in the file)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        package = package.removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = (package.rsplit(".", node.level - 1)[0] if node.level > 1 else package) \
                    if node.level else ""
                mod = ".".join(filter(None, [base, node.module or ""]))
                for alias in node.names:
                    full = f"{mod}.{alias.name}"
                    deps.add(full if full in modules or f"{full}.__init__" in modules else mod)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d.removesuffix(".__init__") for d in deps
                       if d.startswith("fx_passes") and d.removesuffix(".__init__") != name
                       and (d in modules or f"{d}.__init__" in modules)}
    return {k.removesuffix(".__init__"): v for k, v in graph.items()}


def test_package_imports_point_down_only():
    bad = []
    for name, deps in package_imports().items():
        for dep in deps - {"fx_passes"}:  # (the package's lazy public names)
            mine, theirs = _stage(name), _stage(dep)
            if mine == theirs and mine not in STAGES[0] + STAGES[1]:
                continue  # inside one folder: test_package_has_no_import_cycle
            if LEVEL[theirs] >= LEVEL[mine]:
                bad.append(f"{name} imports {dep} (stage {theirs} is not below {mine})")
    assert not bad, "\n".join(bad)


def test_package_has_no_import_cycle():
    graph = package_imports()
    state: dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for d in graph.get(n, ()):
            if d == "fx_passes":
                continue  # the package's lazy public names
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [n, d]))
            if d not in state:
                visit(d, path + [n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])


# A module docstring states the module's contract; longer reasoning goes into ``# NOTE [title]``
# blocks in the code, measurements into docs/ (with their command), history nowhere.
DOCSTRING_LINES = 20
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)


def docstring_problems(path: pathlib.Path) -> list[str]:
    """What breaks the docstring rule in one module: a module docstring over
    ``DOCSTRING_LINES`` lines, or any docstring naming an issue by number."""
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree, clean=False) or ""
    bad = [f"module docstring of {len(doc.splitlines())} lines (at most {DOCSTRING_LINES})"
           ] if len(doc.splitlines()) > DOCSTRING_LINES else []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = ast.get_docstring(node, clean=False) or ""
            bad += [f"{getattr(node, 'name', 'module')}: names {m.group()!r}"
                    for m in ISSUE_REFERENCE.finditer(text)]
    return bad


def test_docstring_problems_are_caught(tmp_path):
    long = tmp_path / "m.py"
    long.write_text('"""' + "line\n" * DOCSTRING_LINES + 'one too many"""\n')
    history = tmp_path / "h.py"
    history.write_text('"""Short."""\n\n\ndef f():\n    """Fixed in issue 34."""\n')
    fits = tmp_path / "ok.py"
    fits.write_text('"""' + "line\n" * (DOCSTRING_LINES - 1) + 'last"""\n')
    assert len(docstring_problems(long)) == 1 and "issue 34" in docstring_problems(history)[0]
    assert docstring_problems(fits) == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_docstrings_state_the_contract(path):
    assert docstring_problems(path) == []


# Options travel as named fields, so no function takes more than MOST parameters, but the
# thin ones at an op's flat edge (decorated ``custom_op``, ``register_fake`` or ``emitted``),
# each at most THIN statements that unpack and call on: why those stay flat, and this rule,
# in ``fx_passes/kernels/ops/args.py``'s docstring.
MOST, THIN = 8, 8
def _decorators(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def wide_functions(root: pathlib.Path) -> set[str]:
    """``path::name`` of each function over MOST parameters that is not a thin edge."""
    wide = set()
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _parameters(fn) <= MOST:
                continue
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            edge = _decorators(fn) & {"custom_op", "register_fake", "emitted"}
            if not (edge and len(body) <= THIN):
                wide.add(f"{path.relative_to(root).as_posix()}::{fn.name}")
    return wide


def test_no_function_takes_more_than_eight_parameters():
    assert wide_functions(PACKAGE) == set(), f"more than {MOST} parameters: use op_args' types"


def test_a_wide_function_is_caught(tmp_path):
    (tmp_path / "m.py").write_text("def f(a, b, c, d, e, f, g, h, i):\n    return a\n\n"
                                   "def ok(self, a, b, c, d, e, f, g, h):\n    return a\n\n"
                                   "@torch.library.custom_op('x::y', mutates_args=())\n"
                                   "def op(a, b, c, d, e, f, g, h, i):\n    return call(a)\n")
    assert wide_functions(tmp_path) == {"m.py::f"}


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml lists the packages explicitly: a folder missing there is missing from a
    normal (non-editable) install, and its imports fail only for users."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    folders = {_module(p.parent) for p in PACKAGE.rglob("__init__.py")}
    assert folders == listed, f"not in pyproject: {folders - listed}; not a folder: {listed - folders}"
