"""chunked-logits: never materialise FP32 [T, V] logits under torch.compile.

    torch.compile(model, backend="chunked_logits")                 # the backend
    torch.compile(model, backend="chunked_logits", options={...})  # with a Config
    fx_passes.install(**options)                                   # into backend="inductor"
    fx_passes.summary() / fx_passes.summary_text()                 # what was rewritten, and why not
    chunked-logits run [options] -- script.py args...              # the launcher
    CHUNKED_LOGITS=1 python script.py                              # the environment switch

See README.md for what gets rewritten and docs/ for the details.

The names below are imported on first use, so that ``import fx_passes`` (which the
environment switch does at interpreter start) does not import torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "chunked_logits": ".entry.backend",
    "Config": ".config",
    "ChunkedLogitsPass": ".pipeline",
    "transform": ".pipeline",
    "Reason": ".reporting.report",
    "install": ".entry.install",
    "uninstall": ".entry.install",
    "installed_config": ".entry.install",
    "summary": ".reporting.public",
    "summary_text": ".reporting.public",
    "SummaryCallback": ".entry.hf",
}

__all__ = ["chunked_logits", "Config", "ChunkedLogitsPass", "transform", "Reason",
           "install", "uninstall", "installed_config", "summary", "summary_text", "SummaryCallback"]


TYPE_CHECKING = False  # not `from typing import ...`: keep this import cheap


def __getattr__(name: str):
    import importlib

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif not name.startswith("__"):
        try:  # a submodule: fx_passes.pipeline, fx_passes.reporting.report, ...
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .config import Config
    from .entry.backend import chunked_logits
    from .entry.hf import SummaryCallback
    from .entry.install import install, installed_config, uninstall
    from .pipeline import ChunkedLogitsPass, transform
    from .reporting.public import summary, summary_text
    from .reporting.report import Reason
