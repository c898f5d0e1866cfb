"""chunked-logits demo: stock Inductor vs the chunked_logits backend on one training step.

    make demo            # or: python examples/demo.py [--tokens 2048 --vocab 32768 --threads 1]

A tiny bf16 language model built from code (embedding, one residual MLP block,
RMSNorm, lm_head; no download) produces logits [T, V] for T tokens and a vocabulary
of V.  One GRPO-style training step (``log_softmax(logits.float() / temperature)``,
token log-probs, entropy bonus, backward) runs under ``torch.compile`` with two
backends:

* ``inductor``        stock Inductor: it materialises FP32 [T, V] tensors;
* ``chunked_logits``  the same code with the pass: bf16 in, per-row FP32 stats out.

Three child processes, one after the other:

* memory, one per backend (a fresh process each, so one backend's heap cannot hide
  the other's peak): the peak extra memory of one step (after a warm-up step: read
  VmRSS, write 5 to /proc/self/clear_refs to reset the high-water mark, run the step,
  read VmHWM), the largest error of the token log-probs against an FP64 reference
  (the same bf16 weights, every op in FP64), and what the pass rewrote;
* time: both backends compiled in one process, then ``--steps`` steps each with the
  backends taking turns (A, B, A, B, ...), so that a slow moment of a shared machine
  hits both; the median step of each and their ratio.  One thread by default
  (``--threads``, as benchmarks/run.py is run for the README): with every core in use,
  a machine shared with other work gives ratios that move by 2x from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

TEMPERATURE = 0.7
BACKENDS = ("inductor", "chunked_logits")


def build(args):
    import torch

    class RMSNorm(torch.nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(dim))

        def forward(self, x):
            var = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight

    class TinyLM(torch.nn.Module):
        """Embedding -> residual MLP block -> RMSNorm -> lm_head: logits [T, V]."""

        def __init__(self, vocab: int, hidden: int) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.norm1 = RMSNorm(hidden)
            self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
            self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)
            self.norm2 = RMSNorm(hidden)
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids):
            h = self.embed(ids)
            h = h + self.down(torch.nn.functional.silu(self.up(self.norm1(h))))
            return self.lm_head(self.norm2(h))

    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.hidden).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    advantages = torch.randn(args.tokens, generator=g)
    if not args.padding:
        return model, ids, tokens, advantages
    mask = torch.ones(args.tokens)
    mask[args.tokens - round(args.padding * args.tokens):] = 0  # the padding after the completion
    return model, ids, tokens, advantages, mask


def policy_step(model, ids, tokens, advantages):
    """What an RL trainer writes: FP32 log-softmax of the logits, log-probs, entropy."""
    import torch

    logits = model(ids)  # bf16 [T, V]
    logp_all = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # FP32 [T, V]
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = -(logp * advantages).mean() - 1e-3 * entropy.mean()
    return loss, logp.detach()


def padded_policy_step(model, ids, tokens, advantages, mask):
    """``policy_step`` on a padded batch (``--padding``), as verl and TRL write it: each
    token's loss and entropy averaged over the completion mask, the log-probs returned
    masked (0 on padding)."""
    import torch

    logits = model(ids)  # bf16 [T, V]
    logp_all = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # FP32 [T, V]
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = (-(logp * advantages) * mask).sum() / mask.sum() - 1e-3 * (entropy * mask).sum() / mask.sum()
    return loss, (logp * mask).detach()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _compile(backend: str, padded: bool = False):
    """``policy_step`` (``padded_policy_step``) compiled with ``backend``, on its own copy of
    the code object, so that Dynamo keeps one cache per backend when both run in one process."""
    import torch

    step = padded_policy_step if padded else policy_step
    fn = types.FunctionType(step.__code__.replace(), step.__globals__, f"{step.__name__}_{backend}",
                            step.__defaults__, step.__closure__)
    return torch.compile(fn, backend=backend)


def _runner(step, model, *inputs):
    def run():
        model.zero_grad(set_to_none=True)
        loss, logp = step(model, *inputs)
        loss.backward()
        return loss, logp
    return run


def _summary_text() -> str:
    """What the pass rewrote in this process, as the exit summary prints it."""
    import fx_passes

    if hasattr(fx_passes, "summary_text"):  # the public report
        return fx_passes.summary_text()
    from fx_passes.reporting import summary  # fx_passes releases before the public report

    return summary.format_text(summary.collect())


def memory_worker(args) -> dict:
    """One backend in this (fresh) process: peak extra memory, error, what was rewritten."""
    import gc

    import torch
    from torch._dynamo.utils import counters

    model, ids, tokens, *rest = build(args)
    run = _runner(_compile(args.worker, bool(args.padding)), model, ids, tokens, *rest)
    t0 = time.perf_counter()
    run()  # compile + first run
    compile_s = time.perf_counter() - t0
    run()  # warm-up
    model.zero_grad(set_to_none=True)
    gc.collect()
    _malloc_trim()  # hand freed heap back to the OS, so that RSS is what is live
    rss = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    loss, logp = run()
    peak = _status("VmHWM")
    # The FP64 reference: the same bf16 weights, every op in FP64, eagerly.
    with torch.no_grad():
        model.double()
        logits = model(ids)
        exact = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, tokens[:, None]).squeeze(-1)
        exact = exact * rest[1] if args.padding else exact
    out = {
        "backend": args.worker,
        "extra_bytes": peak - rss if reset else None,
        "peak_bytes": peak,
        "compile_s": compile_s,
        "max_err": (logp.double() - exact).abs().max().item(),
        "loss": loss.item(),
    }
    if args.worker == "chunked_logits":
        out["counters"] = dict(counters["chunked_logits"])
        out["rewritten"] = _summary_text()
    return out


def time_worker(args) -> dict:
    """Both backends in this process, their steps interleaved: median step time of each."""
    model, ids, tokens, *rest = build(args)
    runs = {b: _runner(_compile(b, bool(args.padding)), model, ids, tokens, *rest) for b in BACKENDS}
    for run in runs.values():
        run()  # compile + first run
        run()  # warm-up
    times = {b: [] for b in BACKENDS}
    for _ in range(args.steps):
        for backend, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[backend].append(time.perf_counter() - t0)
    return {b: {"step_s": statistics.median(ts), "step_min_s": min(ts), "n_steps": len(ts)}
            for b, ts in times.items()}


def worker(args) -> dict:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return time_worker(args) if args.worker == "time" else memory_worker(args)


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def child(args, what: str) -> dict:
    """Run this script as a fresh process for ``what`` (a backend's memory, or "time")."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", what, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--steps", str(args.steps),
           "--threads", str(args.threads), "--padding", str(args.padding)]
    env = {k: v for k, v in os.environ.items() if k != "CHUNKED_LOGITS"}  # stock means stock
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"demo: the {what} run failed")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description="stock Inductor vs chunked_logits on one training step")
    parser.add_argument("--tokens", type=int, default=2048, help="T, rows of the logits")
    parser.add_argument("--vocab", type=int, default=32768, help="V, the vocabulary")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=7,
                        help="timed steps per backend, interleaved (the median is shown)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--padding", type=float, default=0.0,
                        help="share of the rows that are padding (the last ones): the loss and entropy "
                             "averaged over the completion mask (padded_policy_step)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.threads < 0 or not 0 <= args.padding < 1:
        parser.error("--steps must be at least 1, --threads at least 0 and --padding in [0, 1)")

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    T, V = args.tokens, args.vocab
    threads = args.threads or "torch's default number of"
    padded = f", the last {args.padding:.0%} of the rows padding" if args.padding else ""
    print(f"chunked-logits demo: one GRPO-style training step, bf16 logits [T={T}, V={V}]{padded}\n"
          f"(an FP32 [T, V] tensor is {mib(4 * T * V)}; memory: each backend in a fresh process; "
          f"time: {args.steps} steps each, interleaved, {threads} thread(s))\n", flush=True)
    results = {backend: child(args, backend) for backend in BACKENDS}
    timing = child(args, "time")
    for backend in BACKENDS:
        results[backend].update(timing[backend])
    stock, ours = results["inductor"], results["chunked_logits"]
    ratio = ours["step_s"] / stock["step_s"]
    results["time_ratio"] = ratio
    rows = [
        ("peak extra memory of one step", mib(stock["extra_bytes"]), mib(ours["extra_bytes"])),
        (f"step time (median of {args.steps})", f"{stock['step_s'] * 1e3:,.0f} ms",
         f"{ours['step_s'] * 1e3:,.0f} ms"),
        ("max |log-prob error| vs FP64", f"{stock['max_err']:.2e}", f"{ours['max_err']:.2e}"),
        ("loss", f"{stock['loss']:.6f}", f"{ours['loss']:.6f}"),
        ("compile + first step", f"{stock['compile_s']:,.1f} s", f"{ours['compile_s']:,.1f} s"),
    ]
    print(f"{'':<32}{'stock inductor':>16}{'chunked_logits':>16}")
    for name, a, b in rows:
        print(f"{name:<32}{a:>16}{b:>16}")
    if stock["extra_bytes"] and ours["extra_bytes"] is not None:
        saved = stock["extra_bytes"] - ours["extra_bytes"]
        print(f"\nmemory saved per step: {mib(saved)} ({saved / stock['extra_bytes']:.0%} of the stock "
              f"step's extra memory)")
    print(f"step time, chunked_logits vs stock: {ratio:.2f}x (lower is better)")
    print("\nwhat the pass rewrote:\n" + ours["rewritten"].rstrip())
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
