import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.session import session


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with no compiled code, empty counters and no events."""
    torch._dynamo.reset()
    counters.clear()
    session.reset()
    yield
    torch._dynamo.reset()
