"""A fresh process for tests/test_vocab_parallel.py's warm-start test: a one-rank gloo
group, the fused vocab-parallel heads (functional and in-place all-reduce) compiled with
``chunked_logits``; prints the results' bits, the pass's counters and AOTAutograd's."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import fx_passes  # noqa: F401  (registers backend="chunked_logits")
from tests.shard_heads import SMALL_BUDGET, lm_inputs, logprob, logprob_inplace, with_lm_head


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    for head in (logprob, logprob_inplace):
        h, w, tok = lm_inputs(torch.bfloat16, head)
        h.requires_grad_()
        w.requires_grad_()
        torch._dynamo.reset()
        y = torch.compile(with_lm_head(head), backend="chunked_logits", options=SMALL_BUDGET)(h, w, tok)
        y.sum().backward()
        out[head.__name__] = [t.float().view(torch.int32).sum().item() for t in (y, h.grad, w.grad)]
    print(json.dumps({"bits": out, "chunked_logits": dict(counters["chunked_logits"]),
                      "aot_autograd": dict(counters["aot_autograd"])}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
