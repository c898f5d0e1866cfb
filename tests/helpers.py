"""Small helpers shared by the tests: capture a Dynamo graph, run the passes on it."""

from __future__ import annotations

import json
import os

import torch
from torch._dynamo.utils import counters

from fx_passes import Config
from fx_passes.passes import transform


def dynamo_graph(fn, *args, dynamic=False) -> torch.fx.GraphModule:
    """The (single) Dynamo graph of ``fn`` on ``args``, as the backend receives it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=dynamic, fullgraph=True)(*args)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def rewrite(fn, *args, dynamic=False, **options) -> tuple[str, str]:
    """(code before, code after) of the passes on ``fn``'s Dynamo graph."""
    gm = dynamo_graph(fn, *args, dynamic=dynamic)
    before = gm.code.strip()
    after = transform(gm, Config.from_options(options)).code.strip()
    return before, after


def ensure_backend() -> None:
    """Register ``backend="chunked_logits"`` when the package is importable but not
    installed (``PYTHONPATH=.`` on a machine without ``pip install``): the name
    normally comes from the package's entry point."""
    from torch._dynamo.backends.registry import lookup_backend, register_backend
    from torch._dynamo.exc import InvalidBackend

    from fx_passes.backend import chunked_logits
    try:
        lookup_backend("chunked_logits")
    except InvalidBackend:
        register_backend(chunked_logits, name="chunked_logits")


def chunked_counters() -> dict:
    return dict(counters["chunked_logits"])


def clean_env(**extra: str) -> dict:
    """This process's environment without the package's switches (CHUNKED_LOGITS*), plus
    ``extra``: what a fresh process that knows nothing of chunked-logits would see."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKED_LOGITS")}
    env.update(extra)
    return env


def last_json(stdout: str) -> dict:
    """The JSON object a child process printed on its last line."""
    return json.loads(stdout.strip().splitlines()[-1])
