"""Recompiles and caching.

* ``dynamic=True``: a loop over 20 different lengths compiles once (and the rewrite
  holds on every length).
* FX graph cache, across processes (tests/cache_child.py, a temporary
  TORCHINDUCTOR_CACHE_DIR): hit with the same code and config; missed when the config
  changes and when the pass's code changes.
* ``ChunkedLogitsPass.uuid()`` (the pre-grad pass's part of Inductor's cache key)
  changes with the config and with the content of any source file of the package.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import fx_passes
import fx_passes.compat
import fx_passes.pipeline
from fx_passes import ChunkedLogitsPass, Config
from fx_passes.entry.backend import chunked_logits
from tests.helpers import isa_probes_settled

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHILD = pathlib.Path(__file__).resolve().parent / "cache_child.py"


# ---- recompiles ----------------------------------------------------------------------------------

def shifted_step(logits, tokens, advantages):
    """A policy-gradient step on [B, S, V] logits with the usual shift."""
    z = logits[:, :-1].float() / 0.7
    logp = torch.log_softmax(z, dim=-1)
    logprob = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(torch.softmax(z, dim=-1) * logp).sum(-1)
    return -(logprob * advantages[:, 1:]).mean() - 0.01 * entropy.mean()


class CountingBackend:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return chunked_logits(gm, example_inputs)


def step_inputs(seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, seq, 37, generator=g) * 3).bfloat16().requires_grad_()
    return x, torch.randint(0, 37, (2, seq), generator=g), torch.randn(2, seq, generator=g)


def test_dynamic_true_compiles_once_for_20_lengths() -> None:
    backend = CountingBackend()
    compiled = torch.compile(shifted_step, backend=backend, dynamic=True)
    # 20 sequence lengths, so 20 numbers of scored rows (S - 1 >= 2).  None equals the
    # batch (2) or the vocabulary (37): Dynamo would give equal sizes one symbol.
    lengths = [3, 5, 8, 11, 13, 17, 20, 23, 29, 31, 40, 41, 50, 64, 65, 77, 90, 100, 128, 150]
    assert len(set(lengths)) == 20
    for i, seq in enumerate(lengths):
        x, tok, adv = step_inputs(seq, i)
        loss = compiled(x, tok, adv)
        loss.backward()
        x_ref = x.detach().clone().requires_grad_()
        want = shifted_step(x_ref, tok, adv)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=1e-2, atol=1e-3)
    assert backend.graphs == 1
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["chunked_logits"]["rewritten"] == 1
    assert counters["chunked_logits"]["declined"] == 0


def test_default_dynamic_compiles_at_most_twice() -> None:
    """dynamic=None (the default): one static graph, then one dynamic graph for all others."""
    backend = CountingBackend()

    def score(logits, tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(-1, tokens[:, None]).squeeze(-1)
    compiled = torch.compile(score, backend=backend)
    with torch.no_grad():
        for seq in range(3, 23):
            g = torch.Generator().manual_seed(seq)
            x = torch.randn(seq, 37, generator=g).bfloat16()
            tok = torch.randint(0, 37, (seq,), generator=g)
            torch.testing.assert_close(compiled(x, tok), score(x, tok), rtol=1e-5, atol=1e-5)
    assert backend.graphs == 2
    assert counters["chunked_logits"]["rewritten"] == 2


# ---- uuid ------------------------------------------------------------------------------------------

@pytest.fixture
def package_copy(tmp_path):
    """A copy of fx_passes, for source_hash(root) to read."""
    copy = tmp_path / "fx_passes"
    shutil.copytree(fx_passes.pipeline.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_uuid_is_stable_for_the_same_code_and_config() -> None:
    assert ChunkedLogitsPass().uuid() == ChunkedLogitsPass(Config()).uuid()
    assert ChunkedLogitsPass(Config(strict=True)).uuid() == ChunkedLogitsPass(Config(strict=True)).uuid()


def test_uuid_changes_with_the_config() -> None:
    names = [f for f in Config.__dataclass_fields__ if isinstance(getattr(Config(), f), bool)]
    uuids = {ChunkedLogitsPass(Config(**{f: not getattr(Config(), f)})).uuid() for f in names}
    assert len(uuids) == len(names) and ChunkedLogitsPass().uuid() not in uuids


def test_uuid_carries_the_source_hash() -> None:
    assert fx_passes.pipeline.source_hash()[:16] in ChunkedLogitsPass().uuid()


@pytest.mark.parametrize("file", ["pipeline.py", "kernels/log_softmax/given.py", "match/upcast_regions.py",
                                  "config.py", "distributed/one_pass.py"])
def test_source_hash_changes_when_a_source_file_changes(package_copy, file) -> None:
    source_hash = fx_passes.pipeline.source_hash
    assert source_hash(package_copy) == source_hash()  # a copy with the same content: the same key
    (package_copy / file).write_text((package_copy / file).read_text() + "\n# changed\n")
    assert source_hash(package_copy) != source_hash()


def test_source_hash_changes_when_a_source_file_is_added(package_copy) -> None:
    (package_copy / "kernels" / "extra.py").write_text("X = 1\n")
    assert fx_passes.pipeline.source_hash(package_copy) != fx_passes.pipeline.source_hash()


# ---- FX graph cache across processes ---------------------------------------------------------------

def run_child(cache_dir, options: dict, pythonpath: pathlib.Path = ROOT) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_LOGS"))}
    # (isa_probes_settled: the CPU's best ISA without compiling a probe for each, ~6.5 CPU-s
    # in a new cache directory; the ISA picked, and every cache key, is the same in each child)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(pythonpath),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_COMPILE_THREADS="1", **isa_probes_settled())
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(options)], env=env, cwd=str(cache_dir),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hits(mode: dict) -> tuple[int, int]:
    c = mode["inductor"]
    return c.get("fxgraph_cache_hit", 0), c.get("fxgraph_cache_miss", 0)


ALL_DEFAULT = {"train": {}, "score": {}, "pre_grad": {}, "installed": {}}
# Which modes AOTAutograd's cache stores: the backend and install() mark the functions a
# rewritten graph calls cacheable; a ChunkedLogitsPass set by hand marks nothing.  From
# torch 2.12 (pre_grad_pass_timing) that cache checks the graph before the pre-grad passes
# (the pass's uuid in its key), so the hand-set pass's graphs are stored too; before, it
# checks the rewritten graph, and bypasses them (docs/enabling.md).
AOT_STORED = [m for m in ALL_DEFAULT if m != "pre_grad" or fx_passes.compat.PRE_GRAD_PASS_TIMING]


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One cache directory, filled by a first process with the default config."""
    cache = tmp_path_factory.mktemp("inductor_cache")
    first = run_child(cache, ALL_DEFAULT)
    assert pathlib.Path(first["fx_passes"]).resolve() == ROOT / "fx_passes" / "__init__.py"
    for mode in ALL_DEFAULT:
        assert first[mode]["chunked_logits"] == {"rewritten": 1}, mode
    assert hits(first["train"]) == (0, 2)  # forward and backward graphs
    assert hits(first["score"]) == (0, 1)
    assert hits(first["pre_grad"]) == (0, 1)
    assert hits(first["installed"]) == (0, 1)
    for mode in ALL_DEFAULT:  # AOTAutograd's cache stores them too (row_stats is marked cacheable)
        stored = {"autograd_cache_miss": 1, "autograd_cache_saved": 1}
        bypassed = {"autograd_cache_bypass": 1}
        assert first[mode]["aot_autograd"] == (stored if mode in AOT_STORED else bypassed), mode
    return cache, first


# The other config, run by the warm process after the default modes (their hits come first):
# the backend with another option, the pre-grad pass with another setting.
OTHER_CONFIG = {"score@off": {"rewrite": False}, "pre_grad@strict": {"strict": True}}


@pytest.fixture(scope="module")
def warm(cold) -> dict:
    """A second process on the cold one's cache: the default modes, then ``OTHER_CONFIG``."""
    cache, _ = cold
    return run_child(cache, {**ALL_DEFAULT, **OTHER_CONFIG})


@pytest.mark.slow  # (the fixtures' cold process, then a warm one)
def test_fx_graph_cache_hit_in_a_new_process(cold, warm) -> None:
    cache, first = cold
    assert hits(warm["train"]) == (2, 0)
    assert hits(warm["score"]) == (1, 0)
    assert hits(warm["pre_grad"]) == (1, 0)
    assert hits(warm["installed"]) == (1, 0)
    for mode in ALL_DEFAULT:
        assert warm[mode]["checksum"] == first[mode]["checksum"], mode
        warm_start = {"autograd_cache_hit": 1} if mode in AOT_STORED else {"autograd_cache_bypass": 1}
        assert warm[mode]["aot_autograd"] == warm_start, mode
    assert warm["uuid"] == first["uuid"] == warm["pre_grad"]["uuid"]


@pytest.mark.slow  # (the same warm process)
def test_fx_graph_cache_missed_when_the_config_changes(cold, warm) -> None:
    """The backend: another config is another graph.  The pre-grad pass: another uuid, even
    for a setting (strict) that leaves the graph as it was."""
    cache, first = cold
    assert warm["score@off"]["chunked_logits"] == {"would_rewrite": 1}
    assert hits(warm["score@off"]) == (0, 1)
    assert warm["pre_grad@strict"]["uuid"] != first["uuid"]
    assert hits(warm["pre_grad@strict"]) == (0, 1)


@pytest.mark.slow  # (a fresh process)
def test_fx_graph_cache_missed_when_the_pass_code_changes(cold, tmp_path) -> None:
    """A copy of the package whose backward doubles the gradient: a new process that imports
    it must not get the old compiled graphs from the cache (it must compute the new gradient)."""
    cache, first = cold
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "fx_passes", pkg / "fx_passes", ignore=shutil.ignore_patterns("__pycache__"))
    ops = pkg / "fx_passes" / "kernels" / "log_softmax" / "given.py"
    text = ops.read_text()
    assert text.count("return grad_z.to(x.dtype)\n") == 1, "log_softmax/given.py changed: update the test"
    ops.write_text(text.replace("return grad_z.to(x.dtype)\n", "return (2 * grad_z).to(x.dtype)\n"))

    changed = run_child(cache, {"train": {}, "pre_grad": {}}, pythonpath=pkg)
    assert pathlib.Path(changed["fx_passes"]).resolve() == (pkg / "fx_passes" / "__init__.py").resolve()
    assert changed["train"]["chunked_logits"] == {"rewritten": 1}
    assert hits(changed["train"])[1] >= 1  # the backward graph at least is compiled anew
    assert "autograd_cache_hit" not in changed["train"]["aot_autograd"]  # the source hash is in its key
    loss, grad = changed["train"]["checksum"]
    assert loss == first["train"]["checksum"][0]
    assert grad == pytest.approx(2 * first["train"]["checksum"][1], rel=1e-2)  # the new code ran
    assert changed["uuid"] != first["uuid"]  # the source hash is part of the pre-grad key
    if fx_passes.compat.PRE_GRAD_PASS_TIMING:  # the lookup before the pass: its uuid in the key
        assert hits(changed["pre_grad"]) == (0, 1)
    else:  # (torch < 2.12: the key is the graph the pass wrote, which a backward's change leaves)
        assert changed["pre_grad"]["checksum"] == first["pre_grad"]["checksum"]
