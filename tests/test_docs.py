"""The user docs (README.md, docs/*.md) against the repository and the code.

* every relative link resolves: the file exists, and a ``#anchor`` names a heading of
  the target Markdown file by GitHub's rule for heading ids;
* the README's option table lists exactly the fields of ``fx_passes.Config`` (and the
  backend's ``inductor`` key) with their defaults;
* every ``Config(...)`` in the docs builds, and one written as a repr (all fields, from
  ``rewrite=``) is what ``repr`` of that Config gives;
* every ``options={...}`` key and every ``CHUNKED_LOGITS*`` variable the docs name exists.

The checkers are tested on bad examples too, so that a broken link fails this file.
No torch compile: this file runs in a second.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

from fx_passes import env
from fx_passes.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`+[^`]*`+")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's id of a heading: the rendered text (code spans and links keep their text,
    emphasis marks go), lower case, every character but letters, digits, ``-``, ``_`` and
    spaces dropped, spaces turned into ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The ids of a Markdown file's headings, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str):
    """(line number, target) of each Markdown link outside code (fenced or inline)."""
    for n, line in prose_lines(text):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield n, m.group(1)


def broken_links(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    """What in ``path`` does not resolve: a relative link to a missing file, or an
    anchor that no heading of the target file has."""
    problems = []
    for n, target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{n}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{where}: no heading with id {anchor!r} in {dest.name}")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not Markdown")
    return problems


def test_the_link_checker_finds_broken_links(tmp_path):
    """The checker itself: a missing file, a renamed heading and a bad same-file anchor
    are reported; good links, links inside code and external links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Other\n\n## 2. `fx_passes.install()`: the passes\n\n## Same\n\n## Same\n"
        "```\n# not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n## Known limits\n\n"
        "[ok](docs/other.md) [ok](docs/other.md#2-fx_passesinstall-the-passes) [ok](#known-limits)\n"
        "[ok](docs/other.md#same-1) [ext](https://example.com/x#y) `[in code](missing.md)`\n"
        "[missing](docs/gone.md) [renamed](docs/other.md#the-passes) [self](#limits)\n"
        "[fenced heading](docs/other.md#not-a-heading)\n"
        "```\n[in a fence](nowhere.md)\n```\n")
    problems = broken_links(page, tmp_path)
    assert [p.split(": ", 2)[1] for p in problems] == [
        "docs/gone.md", "docs/other.md#the-passes", "#limits", "docs/other.md#not-a-heading"]
    assert "no such file" in problems[0] and "no heading with id 'the-passes'" in problems[1]


def test_slugs_follow_github():
    assert slug("2. `fx_passes.install()`: the passes inside the stock `inductor` backend") == \
        "2-fx_passesinstall-the-passes-inside-the-stock-inductor-backend"
    assert slug("1b. Row-local regions (`match/row_local.py`, `rewrite/row_local.py`)") == \
        "1b-row-local-regions-matchrow_localpy-rewriterow_localpy"
    assert slug("Why nothing was rewritten") == "why-nothing-was-rewritten"
    assert slug("[TRL](docs/enabling.md#trl) and *more*") == "trl-and-more"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(page):
    assert broken_links(page, ROOT) == []


# -- the docs against the code ----------------------------------------------------------

BACKEND_ONLY = {"inductor": {}}  # options the backend takes besides Config's fields (entry/backend.py)


def option_table(text: str) -> dict[str, str]:
    """The README's ``| option | default | meaning |`` table: option -> default text."""
    rows, inside = {}, False
    for line in text.splitlines():
        if re.match(r"^\|\s*option\s*\|\s*default\s*\|", line):
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set(cells[0]) <= set("- :"):
                continue
            rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def table_mismatches(table: dict[str, str]) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(Config)} | BACKEND_ONLY
    out = [f"{name}: not in the table" for name in defaults if name not in table]
    out += [f"{name}: not an option" for name in table if name not in defaults]
    for name, text in table.items():
        if name in defaults:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            if value != defaults[name] or type(value) is not type(defaults[name]):
                out.append(f"{name}: the table says {text}, the code {defaults[name]!r}")
    return out


def test_readme_option_table_is_config():
    table = option_table((ROOT / "README.md").read_text())
    assert table, "README.md has no '| option | default | meaning |' table"
    assert table_mismatches(table) == []


def test_the_option_table_check_finds_mismatches():
    table = {f.name: repr(f.default) for f in dataclasses.fields(Config)} | {"inductor": "{}"}
    assert table_mismatches(table) == []
    bad = dict(table, strict="True", tempreature=" False")
    del bad["row_local"]
    assert sorted(table_mismatches(bad)) == [
        "row_local: not in the table", "strict: the table says True, the code False",
        "tempreature: not an option"]


CONFIG_CALL = re.compile(r"\bConfig\(([^()]*)\)")


def config_problems(text: str) -> list[str]:
    """Each ``Config(k=v, ...)`` must build; one that starts with the first field
    (a repr, as printed) must equal the repr of what it builds."""
    out = []
    first = dataclasses.fields(Config)[0].name
    for m in CONFIG_CALL.finditer(text):
        args = m.group(1).strip()
        if not args or "=" not in args:
            continue
        try:
            call = ast.parse(f"f({args})", mode="eval").body
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            built = Config(**kwargs)
        except (SyntaxError, ValueError, TypeError) as e:
            out.append(f"{m.group(0)}: {type(e).__name__}: {e}")
            continue
        if args.startswith(f"{first}=") and repr(built) != m.group(0):
            out.append(f"{m.group(0)}: the code prints {built!r}")
    return out


def test_the_config_check_finds_stale_reprs():
    assert config_problems(repr(Config()) + " and Config(report_only=True)") == []
    stale = "Config(rewrite=True, temperature_after_upcast=True, chunk_budget_mib=32.0)"
    assert "the code prints" in config_problems(stale)[0]
    assert "tempreature" in config_problems("Config(tempreature=1)")[0]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_in_docs_matches_the_code(page):
    text = page.read_text()
    assert config_problems(text) == []
    fields = {f.name for f in dataclasses.fields(Config)} | set(BACKEND_ONLY)
    for m in re.finditer(r"options=\{([^{}]*)\}", text):
        for key in re.findall(r"[\"'](\w+)[\"']\s*:", m.group(1)):
            assert key in fields, f"{page.name}: options key {key!r} is not a Config field"
    for m in re.finditer(r"\binstall\(((?:\w+=[^,()]+,?\s*)+)\)", text):
        for key in re.findall(r"(\w+)=", m.group(1)):
            assert key in fields, f"{page.name}: install({key}=...) is not a Config field"


def test_environment_variables_in_docs_exist():
    known = {v for v in vars(env).values() if isinstance(v, str) and v.startswith("CHUNKED_LOGITS")}
    assert {"CHUNKED_LOGITS", "CHUNKED_LOGITS_DISABLE", "CHUNKED_LOGITS_OPTIONS"} <= known
    for page in DOCS:
        for name in set(re.findall(r"\bCHUNKED_LOGITS\w*", page.read_text())):
            assert name in known, f"{page.name} names {name}, which fx_passes/env.py does not read"


def test_docs_have_no_internal_issue_numbers():
    """Users read these pages: no internal issue numbers."""
    for page in DOCS:
        hits = [f"{page.name}:{n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
                if re.search(r"\bissues? \d+", line, re.IGNORECASE)]
        assert hits == []


def test_readme_gives_the_two_make_commands_and_an_install_line():
    """A fresh machine: `make demo` and `make test` (what CI runs), and `pip install`."""
    text = (ROOT / "README.md").read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    assert "make demo" in lines and "make test" in lines
    assert any(line.startswith("pip install") for line in lines)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
