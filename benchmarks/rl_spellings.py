"""Peak memory of the RL frameworks' log-prob spellings (``fx_passes/testing/rl_spellings.py``),
stock Inductor against ``chunked_logits``, one fresh process per (spelling, backend).

Each child builds bf16 ``hidden [T, H]`` (or ``[B, S, H]``) and ``weight [V, H]``, compiles the
spelling with the lm_head in the graph, runs one warm-up training step (forward and backward),
then reads VmRSS, resets VmHWM (``benchmarks.memory.reset_peak``), runs the step again and
reads VmHWM: the step's peak above what it started with.  The parent prints one line per
spelling with both peaks and their ratio, and what the pass did::

    python benchmarks/rl_spellings.py                      # T 2048 = 4 x 512, V 32768, H 256
    python benchmarks/rl_spellings.py --cases row_slices --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from benchmarks.memory import MALLOC_ENV, MIB, hwm, release, reset_peak, rss  # noqa: E402
from fx_passes.testing import rl_spellings as rs  # noqa: E402

BACKENDS = ("inductor", "chunked_logits")


def child(case: str, backend: str, batch: int, seq: int, hidden: int, vocab: int) -> dict:
    fn, (h, w, tokens) = rs.inputs(case, batch, seq, hidden, vocab)
    h.requires_grad_()
    w.requires_grad_()
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(fn, backend=backend)

    def step():
        (compiled(h, w, tokens) * weights).sum().backward()
        h.grad = w.grad = None

    step()  # (compiles)
    step()
    release()
    base = rss()
    reset_peak()
    step()
    peak = hwm() - base
    done = {k: v for k, v in counters["chunked_logits"].items() if v}
    return {"case": case, "backend": backend, "peak_mib": round(peak / MIB, 1), "pass": done}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(rs.CASES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--child", nargs=2, metavar=("CASE", "BACKEND"))
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child, a.batch, a.seq, a.hidden, a.vocab)))
        return
    size = ["--batch", str(a.batch), "--seq", str(a.seq), "--hidden", str(a.hidden), "--vocab", str(a.vocab)]
    print(f"T {a.batch * a.seq} ({a.batch} x {a.seq}), H {a.hidden}, V {a.vocab}, bf16; peak MiB of one "
          "training step above its start (fresh process each)")
    for case in a.cases.split(","):
        peaks, did = {}, {}
        for backend in BACKENDS:
            cmd = [sys.executable, __file__, "--child", case, backend, *size]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV},
                                 check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            peaks[backend], did = res["peak_mib"], res["pass"] or did
        ratio = peaks["chunked_logits"] / peaks["inductor"] if peaks["inductor"] else float("nan")
        print(f"{case:22s} stock {peaks['inductor']:8.1f}  chunked_logits {peaks['chunked_logits']:8.1f}  "
              f"ratio {ratio:.2f}  {did}", flush=True)


if __name__ == "__main__":
    main()
