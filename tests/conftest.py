# ruff: noqa: E402 (the C++ compiler is chosen before torch is imported)
import importlib.util
import zlib

from tests import harness

# Before torch: Inductor reads CXX once, when its config loads (tests/harness.py).
harness.link_kernels_with_gold()

import pytest
import torch
import torch.distributed as dist
from _pytest.mark import ParameterSet
from torch._dynamo.utils import counters

from fx_passes.reporting.session import session
from tests.numerics import FULL_MATRIX

harness.skip_guard_latency_probe()
harness.collect_garbage_less_often()

# Without hypothesis (``make test-bare``'s venv: torch, pytest, expecttest) the modules that
# import it are not collected; every other module imports with torch alone.
if importlib.util.find_spec("hypothesis") is None:
    collect_ignore = ["test_properties.py", "test_hostile.py", "test_op_rules.py"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``full`` (a costly variant of what other tests in ``make test`` cover)
    run only under ``make test-full``, as the full dtype products do, and so do the cases a
    family marked ``sampled`` leaves out (:func:`_sampled_in`).  The slow tests'
    modules run first (:func:`_slow_modules_first`)."""
    if not FULL_MATRIX:
        skip = pytest.mark.skip(reason="a costly variant of covered behaviour: make test-full runs it")
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(skip)
            elif not _sampled_in(item):
                item.add_marker(pytest.mark.skip(reason="a case of a sampled family: make test-full runs it"))
    items[:] = _slow_modules_first(items)


def _sampled_in(item) -> bool:
    """Whether ``make test`` runs this case of a family marked ``sampled(n)`` (default 2;
    unmarked tests always run).  Over one list of cases: every n-th, the phase moving on by
    one after each n of them (0, 3, 4, 7, 8 ... for n = 2), so a second axis that the list
    alternates (the dtypes of ``dtype_matrix``) still runs every value.  Over stacked
    ``parametrize`` lists: the cases whose positions sum to a multiple of n, a diagonal
    that keeps every value of each list."""
    marker = item.get_closest_marker("sampled")
    if marker is None or not hasattr(item, "callspec"):
        return True
    n = marker.args[0] if marker.args else 2
    positions = [_position(mark, item.callspec.params) for mark in item.iter_markers("parametrize")]
    # (each family starts at a phase of its own, so families over one list, as the
    # vocab-parallel heads, run different cases of it)
    phase = zlib.crc32(item.originalname.encode()) % n
    if len(positions) == 1:
        return (positions[0] + positions[0] // n + phase) % n == 0
    return (sum(positions) + phase) % n == 0


def _position(mark, params: dict) -> int:
    """Where this case's values stand in one ``parametrize`` list."""
    names = mark.args[0]
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    values = [params[n] for n in names]
    for pos, entry in enumerate(mark.args[1]):
        entry = entry.values if isinstance(entry, ParameterSet) else entry if len(names) > 1 else (entry,)
        if all(a is b for a, b in zip(entry, values, strict=True)):
            return pos
    raise AssertionError(f"{names}={values!r} is not in its parametrize list")


def _slow_modules_first(items: list) -> list:
    """Every module with a test marked ``slow`` (that runs) first, its slow tests at its
    head; otherwise collection order.  pytest-xdist hands each worker a contiguous part of
    the collection, run in order, and a worker's last two tests cannot be stolen: a
    fresh-process test of a minute or more collected near the end (benchmarks/tests comes
    last) ends the run on one worker.  At the front they overlap the other workers' parts.
    Modules move whole, so a module-scoped fixture is still set up once per worker."""
    def slow(item) -> bool:
        return item.get_closest_marker("slow") is not None and (
            FULL_MATRIX or item.get_closest_marker("full") is None)

    rank: dict = {}
    for item in items:
        if slow(item):
            rank.setdefault(item.path, len(rank))
    return sorted(items, key=lambda item: (rank.get(item.path, len(rank)),
                                           item.path not in rank or not slow(item)))


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test starts with no compiled code, empty counters and no events, and ends
    with no ``pass_failed``: a pass that raises on any graph is a bug (issue 19), unless
    the test injects the fault itself (``@pytest.mark.injects_faults``)."""
    torch._dynamo.reset()
    counters.clear()
    session.reset()
    yield
    failed = counters["chunked_logits"].get("pass_failed", 0)
    torch._dynamo.reset()
    if failed and request.node.get_closest_marker("injects_faults") is None:
        pytest.fail(f"the pass failed {failed} time(s) in this test (counters['chunked_logits']"
                    "['pass_failed']); only a test marked injects_faults may see that")


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group for the module's vocab-parallel graphs (the collectives run,
    the graph is what a rank of many compiles)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
