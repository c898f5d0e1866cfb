"""chunked-logits: never materialise FP32 [T, V] logits under torch.compile.

    torch.compile(model, backend="chunked_logits")                 # the backend
    torch.compile(model, backend="chunked_logits", options={...})  # with a Config

See README.md for what gets rewritten and docs/ for the details.
"""

from .backend import chunked_logits
from .config import Config
from .passes import ChunkedLogitsPass, transform
from .report import Reason

__all__ = ["chunked_logits", "Config", "ChunkedLogitsPass", "transform", "Reason"]
__version__ = "0.1.0"
