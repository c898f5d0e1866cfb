"""Child process of tests/test_gpu_registry.py: one training step of a distillation loss
whose lm_head runs inside the row-local call (``row_local_sweeps``, ``row_local_loss``
or ``row_local_head`` by the options), compiled in the cache TORCHINDUCTOR_CACHE_DIR
names; prints one JSON line: AOTAutograd's and Inductor's cache counters, our counters
and a checksum.

    python tests/registry_cache_child.py '{"gradients_in_forward": false}'
"""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

from tests import sweep_cases as sweeps


def main() -> None:
    options = json.loads(sys.argv[1])
    fn, inputs, grad_pos = sweeps.case("forward_kl")
    leaves = [t.detach().clone().requires_grad_(i in grad_pos) for i, t in enumerate(inputs)]
    loss = torch.compile(fn, backend="chunked_logits", options=options)(*leaves)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.sum().backward()
    print(json.dumps({
        "aot_autograd": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "chunked_logits": dict(counters["chunked_logits"]),
        "checksum": [loss.sum().item(), *(leaves[i].grad.float().abs().sum().item() for i in grad_pos)],
    }))


if __name__ == "__main__":
    main()
