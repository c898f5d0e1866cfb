import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with no compiled code and empty counters."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
