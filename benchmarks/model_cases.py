"""One training step of a tiny model family under one mode: what the pass did, errors, memory.

A *mode* is how the step runs:

``ref``               the same model in FP64, eager, every FP32 upcast made FP64 (saved to a file)
``stock``             ``torch.compile(model, backend="inductor")``: the model returns loss and logits
``chunked``           ``torch.compile(model, backend="chunked_logits")``
``install``           ``fx_passes.install()`` then ``torch.compile(model, backend="inductor")``
``stock_nologits``    a compiled function that calls the model and returns only the loss, stock
``chunked_nologits``  the same under ``chunked_logits``: the lm_head may fuse here
``trainer``           HF ``Trainer(torch_compile=True)``, without then with ``fx_passes.install()``

The step is the forward with ``labels`` (the model's own ``ForCausalLMLoss``) and the
backward; no optimizer (its memory has nothing to do with the logits).  The trainer
mode runs two real optimizer steps each way and compares the logged losses.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import torch
from torch._dynamo.utils import counters

from benchmarks.memory import MIB, hwm, release, reset_peak, rss
from fx_passes.testing.models import build_model, errors, logit_transform, make_batch, make_step, reference

__all__ = ["MODES", "errors", "make_step", "reference", "run_case"]

MODES = ("ref", "stock", "chunked", "install", "stock_nologits", "chunked_nologits", "trainer")


def pass_events() -> list[dict]:
    """What the pass logged (rewritten / declined, where and why), each distinct one once."""
    from fx_passes.reporting.session import session
    seen, out = set(), []
    for e in session.events:
        key = (e.kind, e.what, e.where)
        if key not in seen:
            seen.add(key)
            out.append({"kind": e.kind, "what": e.what, "where": e.where,
                        "reason": e.reason.name if e.reason else None})
    return out


def measure(model, mode: str, ids, labels, warmup: int) -> tuple[dict, torch.Tensor]:
    """Compile and warm up, then the peak extra host memory of one step (VmHWM - VmRSS)."""
    step = make_step(model, mode)
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss, out = step(ids, labels)
        del loss, out
        model.zero_grad(set_to_none=True)
    compile_s = time.perf_counter() - t0
    release()
    before = rss()
    reset_peak()
    t0 = time.perf_counter()
    loss, out = step(ids, labels)  # the measured step: its outputs and gradients stay alive
    step_s = time.perf_counter() - t0
    peak = hwm()
    del out
    return {"peak_mib": (peak - before) / MIB, "warmup_s": compile_s, "step_s": step_s}, loss


def run_trainer(family: str, vocab: int, seq_len: int, layers: int) -> dict:
    """HF Trainer(torch_compile=True), 2 steps, stock and then under fx_passes.install()."""
    import fx_passes
    stock = train(build_model(family, vocab, seq_len, layers), vocab, seq_len)
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.install():
        ours = train(build_model(family, vocab, seq_len, layers), vocab, seq_len)
    return {"stock_losses": stock, "losses": ours,
            "max_loss_diff": max(abs(a - b) for a, b in zip(stock, ours))}


def train(model, vocab: int, seq_len: int, steps: int = 2) -> list[float]:
    """The logged losses of ``steps`` real Trainer steps (AdamW) on random tokens, batch 1."""
    import tempfile

    from transformers import Trainer, TrainingArguments
    ids, labels = make_batch(vocab, seq_len, batch=steps)
    data = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, torch_compile=True, max_steps=steps,
                                 per_device_train_batch_size=1, learning_rate=1e-3, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def error_line(e: Exception) -> str:
    """The exception's first line, and for a C++ compile error the compiler's first ``error:``."""
    lines = f"{type(e).__name__}: {e}".splitlines()
    compiler = next((ln.split(" error: ", 1)[1] for ln in lines if " error: " in ln), None)
    return (lines[0] + (f" ({compiler})" if compiler else ""))[:400]


def run_case(family: str, mode: str, vocab: int, seq_len: int, layers: int = 1, warmup: int = 2,
             ref_path: str | None = None) -> dict:
    """Everything one (family, mode) case reports; an exception becomes ``error``."""
    result: dict = {"family": family, "mode": mode}
    try:
        if mode == "trainer":
            result.update(run_trainer(family, vocab, seq_len, layers))
        else:
            model = build_model(family, vocab, seq_len, layers)
            result["logit_transform"] = logit_transform(model)
            ids, labels = make_batch(vocab, seq_len)
            if mode == "ref":
                torch.save(reference(model, ids, labels), ref_path)
                return result
            stats, loss = measure(model, mode, ids, labels, warmup)
            result.update(stats)
            if ref_path and os.path.exists(ref_path):  # a failed reference leaves no file
                result.update(errors(model, loss, torch.load(ref_path)))
    except Exception as e:  # a case that cannot compile or run is reported, not fatal
        result["error"] = error_line(e)
        result["traceback"] = traceback.format_exc()[-3000:]
    result["counters"] = dict(counters["chunked_logits"])
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["events"] = pass_events()
    return result


def main(argv=None) -> None:
    """Child entry point: one case, its result as JSON on the last stdout line."""
    import argparse
    p = argparse.ArgumentParser()
    for name in ("--family", "--mode", "--ref"):
        p.add_argument(name)
    for name in ("--vocab", "--seq-len", "--layers", "--warmup", "--threads"):
        p.add_argument(name, type=int)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = run_case(a.family, a.mode, a.vocab, a.seq_len, a.layers, a.warmup, a.ref)
    print("@@RESULT " + json.dumps(res), flush=True)
