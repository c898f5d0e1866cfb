import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from fx_passes.reporting.session import session
from tests.numerics import FULL_MATRIX

# Without hypothesis (``make test-bare``'s venv: torch, pytest, expecttest) the modules that
# import it are not collected; every other module imports with torch alone.
if importlib.util.find_spec("hypothesis") is None:
    collect_ignore = ["test_properties.py", "test_hostile.py", "test_op_rules.py"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``full`` (a costly variant of what other tests in ``make test`` cover)
    run only under ``make test-full``, as the full dtype products do."""
    if FULL_MATRIX:
        return
    skip = pytest.mark.skip(reason="a costly variant of covered behaviour: make test-full runs it")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


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
