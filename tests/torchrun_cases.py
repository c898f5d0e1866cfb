"""Several runs of one example in a single torchrun start (tests/test_distributed.py,
tests/test_vocab_parallel.py):

    torchrun --standalone --nproc-per-node N tests/torchrun_cases.py examples.distributed_step \\
        '{"ddp": ["--setup", "ddp", "--out", "out/ddp"], "fsdp2": [...]}'

Each rank starts Python, torch, the process group and Inductor once, then runs each
argument list in turn through the example's ``run`` (what its ``main`` runs between
``init_process_group`` and ``destroy_process_group``); each run writes its own
``--out``.  One start instead of one per case: each start costs every rank an
interpreter, torch's import, a rendezvous and Inductor's first compile.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))  # (the script's own folder is tests/: the examples live beside it)
    import torch.distributed as dist

    example = importlib.import_module(sys.argv[1])
    cases = json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    for argv in cases.values():
        example.run(example.parse_args(argv))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
