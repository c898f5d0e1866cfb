"""Every row-local family, scoring and training, under every way of turning the pass on:
each region is rewritten once, its chunk bodies compile (no eager fall-back), nothing is
declined, and the results are the eager FP32 maths'.

The backend and ``install()`` run here; the launcher and ``CHUNKED_LOGITS=1`` each run
every case in one fresh process (``python -m tests.enabling_cases``).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import fx_passes
from tests.enabling_cases import ENGINE, FAMILIES, run_case
from tests.helpers import clean_env, last_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
CASES = [(family, grad) for family in FAMILIES for grad in (False, True)]


def assert_clean(result: dict) -> None:
    """One region rewritten, no body run eagerly, no decline, no failure."""
    seen = result["counters"]
    where = f"{result['family']} (grad={result['grad']}): {seen}"
    assert seen.get("rewritten") == 1, where
    bad = [k for k in seen if k.endswith("_eager") or k.startswith("declined") or k == "pass_failed"]
    assert not bad, where
    assert result["max_err"] < 1e-4, where


@pytest.mark.sampled(4)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("way", ["backend", "install"])
def test_in_process(way, family, grad):
    if way == "backend":
        assert_clean(run_case(family, grad, "chunked_logits"))
        return
    with fx_passes.install(**ENGINE):
        assert_clean(run_case(family, grad, "inductor"))


def _child(command: list[str], **env: str) -> list[dict]:
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env=clean_env(PYTHONPATH=str(ROOT), CHUNKED_LOGITS_SUMMARY="never", **env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "runs eagerly" not in proc.stderr, proc.stderr[-4000:]
    return last_json(proc.stdout)


@pytest.mark.slow  # (every case, compiled in a fresh process)
# (make test-full; make test starts each way in a fresh process on one case: test_install, test_launcher)
@pytest.mark.full
@pytest.mark.parametrize("way", ["launcher", "environment"])
def test_fresh_process(way):
    if way == "launcher":
        results = _child([str(BIN / "chunked-logits"), "run", "--summary", "never", "--no-leave-to-stock",
                          "--", "-m", "tests.enabling_cases"])
    else:
        results = _child([sys.executable, "-m", "tests.enabling_cases"], CHUNKED_LOGITS="1",
                         CHUNKED_LOGITS_OPTIONS="leave_to_stock=0")
    assert [(r["family"], r["grad"]) for r in results] == CASES
    for result in results:
        assert_clean(result)
