"""chunked-logits demo: stock Inductor vs the chunked_logits backend on one training step.

    make demo            # or: python examples/demo.py [--tokens 2048 --vocab 32768]

A tiny bf16 language model built from code (embedding, one residual MLP block,
RMSNorm, lm_head; no download) produces logits [T, V] for T tokens and a vocabulary
of V.  One GRPO-style training step (``log_softmax(logits.float() / temperature)``,
token log-probs, entropy bonus, backward) runs under ``torch.compile`` twice, each
in a fresh process:

* ``inductor``        stock Inductor: it materialises FP32 [T, V] tensors;
* ``chunked_logits``  the same code with the pass: bf16 in, per-row FP32 stats out.

For each it prints the peak extra memory of one step (after a warm-up step: read
VmRSS, write 5 to /proc/self/clear_refs to reset the high-water mark, run the step,
read VmHWM), the step time, the largest error of the token log-probs against an
FP64 reference (the same bf16 weights, every op in FP64), and what the pass rewrote.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TEMPERATURE = 0.7


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
    return model, ids, tokens, advantages


def policy_step(model, ids, tokens, advantages):
    """What an RL trainer writes: FP32 log-softmax of the logits, log-probs, entropy."""
    import torch

    logits = model(ids)  # bf16 [T, V]
    logp_all = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # FP32 [T, V]
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = -(logp * advantages).mean() - 1e-3 * entropy.mean()
    return loss, logp.detach()


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


def worker(args) -> dict:
    """One backend in this (fresh) process; returns the measurements."""
    import gc

    import torch

    model, ids, tokens, advantages = build(args)
    step = torch.compile(policy_step, backend=args.worker)

    def run():
        model.zero_grad(set_to_none=True)
        loss, logp = step(model, ids, tokens, advantages)
        loss.backward()
        return loss, logp

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
    t0 = time.perf_counter()
    loss, logp = run()
    times = [time.perf_counter() - t0]
    peak = _status("VmHWM")
    for _ in range(args.repeat - 1):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    # The FP64 reference: the same bf16 weights, every op in FP64, eagerly.
    with torch.no_grad():
        model.double()
        logits = model(ids)
        exact = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, tokens[:, None]).squeeze(-1)
    out = {
        "backend": args.worker,
        "extra_bytes": peak - rss if reset else None,
        "peak_bytes": peak,
        "step_s": min(times),
        "compile_s": compile_s,
        "max_err": (logp.double() - exact).abs().max().item(),
        "loss": loss.item(),
    }
    if args.worker == "chunked_logits":
        from fx_passes.reporting import summary

        data = summary.collect()
        out["counters"] = data["counters"]
        out["rewritten"] = summary.format_text(data)
    return out


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description="stock Inductor vs chunked_logits on one training step")
    parser.add_argument("--tokens", type=int, default=2048, help="T, rows of the logits")
    parser.add_argument("--vocab", type=int, default=32768, help="V, the vocabulary")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="timed steps (the fastest is shown)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    T, V = args.tokens, args.vocab
    print(f"chunked-logits demo: one GRPO-style training step, bf16 logits [T={T}, V={V}]\n"
          f"(an FP32 [T, V] tensor is {mib(4 * T * V)}; each backend runs in a fresh process)\n",
          flush=True)
    results = {}
    for backend in ("inductor", "chunked_logits"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, "--tokens", str(T),
               "--vocab", str(V), "--hidden", str(args.hidden), "--repeat", str(args.repeat)]
        env = {k: v for k, v in os.environ.items() if k != "CHUNKED_LOGITS"}  # stock means stock
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"demo: the {backend} run failed")
        results[backend] = json.loads(lines[-1][len("RESULT "):])

    stock, ours = results["inductor"], results["chunked_logits"]
    rows = [
        ("peak extra memory of one step", mib(stock["extra_bytes"]), mib(ours["extra_bytes"])),
        ("step time (best of --repeat)", f"{stock['step_s'] * 1e3:,.0f} ms",
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
              f"step's extra memory); step time ratio chunked/stock: {ours['step_s'] / stock['step_s']:.2f}")
    print("\nwhat the pass rewrote:\n" + ours["rewritten"].rstrip())
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
