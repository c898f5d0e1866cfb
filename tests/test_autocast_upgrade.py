"""Implicit upcasts (autocast) and the opt-in FP32 upgrade of model-precision heads."""

import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes.testing.workloads import Workload
from tests.codegen import allocations, full_fp32_buffers, step_codes
from tests.helpers import chunked_counters, clean_env, last_json, made_otherwise_before, rewrite


def ce_autocast(x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(x / 0.7, y, ignore_index=-100)  # FP32 under autocast, no .float()


def test_autocast_cross_entropy_is_rewritten_and_accurate():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 3001, generator=g) * 3).bfloat16().requires_grad_()
    y = torch.randint(0, 3001, (96,), generator=g)
    y[::7] = -100
    ref = F.cross_entropy(x.double() / 0.7, y, ignore_index=-100)
    stock = torch.compile(ce_autocast, backend="inductor")(x, y)
    torch._dynamo.reset()
    ours = torch.compile(ce_autocast, backend="chunked_logits")(x, y)
    assert chunked_counters() == {"rewritten": 1}
    assert ours.dtype == stock.dtype == torch.float32
    assert (ours.double() - ref).abs() <= (stock.double() - ref).abs() + 1e-6
    ours.backward()  # the backward runs and lands in bf16
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_autocast_region_logged_as_implicit(caplog):
    with caplog.at_level("INFO", logger="fx_passes"):
        rewrite(ce_autocast, torch.randn(8, 64).bfloat16(), torch.randint(0, 64, (8,)))
    assert "implicit (autocast) upcast" in caplog.text


def test_mutation_inside_region_is_declined():
    def fn(x, tok):
        z = x.float()
        x.mul_(2)  # the rewrite would read x after this
        return torch.log_softmax(z, -1).gather(-1, tok[:, None]), x.sum()

    x, tok = torch.randn(8, 32).bfloat16(), torch.randint(0, 32, (8,))
    # A declined graph is compiled exactly as stock Inductor compiles it (compiled and
    # eager results differ in the last bits, and by how much depends on the CPU).
    stock = torch.compile(fn, backend="inductor")(x.clone(), tok)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="chunked_logits")(x.clone(), tok)
    assert chunked_counters() == {"declined": 1, "declined:MUTATION": 1}
    for g, s in zip(got, stock):
        torch.testing.assert_close(g, s, rtol=0, atol=0)


# --- upgrade_low_precision (off by default) -----------------------------------------

def bf16_logprob(logits, tokens, temperature=0.7):
    """What several RL trainers do: temperature and log_softmax in bf16, no upcast."""
    logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def bf16_logprob_entropy(logits, tokens):
    logits = logits / 0.7
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def bf16_logprob_per_sequence(logits, tokens):
    """The memory-bounding form: one sequence of the batch at a time."""
    return torch.stack([bf16_logprob(logits[i], tokens[i]) for i in range(logits.shape[0])])


def fp64_logprob_entropy(logits, tokens):
    logp = torch.log_softmax(logits.double() / 0.7, -1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.fixture(scope="module")
def big():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 1024, 32000, generator=g) * 3).bfloat16()
    return logits, torch.randint(0, 32000, (4, 1024), generator=g)


@pytest.mark.sampled
@pytest.mark.parametrize("fn", [bf16_logprob, bf16_logprob_entropy, bf16_logprob_per_sequence])
def test_upgrade_gives_fp32_accuracy(big, fn):
    logits, tokens = big
    ref = fp64_logprob_entropy(logits, tokens)
    with torch.no_grad():
        base = torch.compile(fn, backend="chunked_logits")(logits, tokens)
        moved = chunked_counters()
        assert moved.pop("near_miss", 0) >= 1, "the option named (fx_passes/match/near_miss.py)"
        assert moved == {}, "off by default: untouched"
        torch._dynamo.reset()
        up = torch.compile(fn, backend="chunked_logits",
                           options={"upgrade_low_precision": True})(logits, tokens)
    # (the loop over the sequences is merged into one region: rewrite/row_slices.py)
    merged = 1 if fn is bf16_logprob_per_sequence else 0
    assert counters["chunked_logits"]["rewritten"] == 1
    assert counters["chunked_logits"]["row_slices_merged"] == merged
    base, up = (b if isinstance(b, tuple) else (b,) for b in (base, up))
    for got, before, r in zip(up, base, ref):
        assert got.dtype == torch.float32  # bf16 results would throw the gain away
        assert (got.double() - r).abs().max() <= 1e-4
        assert (before.double() - r).abs().max() > 1e-2  # what the bf16 path gave


@made_otherwise_before("2.13", "stock's bf16 graph keeps one FP32 [T] vector less")
def test_upgrade_allocates_no_more_than_the_bf16_graph():
    w = Workload("bf16", bf16_logprob_entropy, False, None, (0, 0))
    g = torch.Generator().manual_seed(0)
    inputs = ((torch.randn(512, 4096, generator=g) * 3).bfloat16(),
              torch.randint(0, 4096, (512,), generator=g))

    def total_bytes(codes):
        size = {"torch.float32": 4, "torch.bfloat16": 2, "torch.int64": 8, "torch.bool": 1}
        out = 0
        for dims, dtype in (a for c in codes for a in allocations(c)):
            n = 1
            for d in dims:
                n *= int(d)
            out += n * size.get(dtype, 8)
        return out

    stock = step_codes(w, torch.compile(w.fn, backend="inductor"), inputs)
    torch._dynamo.reset()
    ours = step_codes(w, torch.compile(w.fn, backend="chunked_logits",
                                       options={"upgrade_low_precision": True}), inputs)
    assert counters["chunked_logits"]["rewritten"] == 1
    assert full_fp32_buffers(ours, 512, 4096) == []
    assert total_bytes(ours) <= total_bytes(stock)


def test_upgrade_off_leaves_graph_untouched_and_on_says_so(caplog):
    before, after = rewrite(bf16_logprob, torch.randn(8, 64).bfloat16(), torch.randint(0, 64, (8,)))
    assert before == after and chunked_counters() == {"near_miss": 1}  # (naming the option)
    with caplog.at_level("INFO", logger="fx_passes"):
        _, after = rewrite(bf16_logprob, torch.randn(8, 64).bfloat16(), torch.randint(0, 64, (8,)),
                           upgrade_low_precision=True)
    assert "row_stats" in after
    assert "upgraded to FP32" in caplog.text


# --- the upgrade through every way of enabling the pass -------------------------------

UPGRADE_SCRIPT = '''
import json
import torch
from torch._dynamo.utils import counters

def logprob(logits, tokens):  # a trainer's bf16-only path, compiled with stock inductor
    logits = logits / 0.7
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

g = torch.Generator().manual_seed(0)
x = (torch.randn(64, 2048, generator=g) * 3).bfloat16()
tok = torch.randint(0, 2048, (64,), generator=g)
with torch.no_grad():
    out = torch.compile(logprob)(x, tok)
ref = torch.log_softmax(x.double() / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
print(json.dumps({"counters": dict(counters["chunked_logits"]), "dtype": str(out.dtype),
                  "err": (out.double() - ref).abs().max().item()}))
'''


def _run_script(tmp_path, argv, **env):
    script = tmp_path / "job.py"
    script.write_text(UPGRADE_SCRIPT)
    proc = subprocess.run([*argv, str(script)], capture_output=True, text=True,
                          env=clean_env(TORCH_LOGS="fx_passes", **env), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return last_json(proc.stdout), proc.stderr


@pytest.mark.slow
# (the upgrade's positive runs are make test-full's: make test upgrades in-process, above)
@pytest.mark.parametrize("how", [pytest.param("launcher flag", marks=pytest.mark.full),
                                 pytest.param("env switch", marks=pytest.mark.full),
                                 "env switch, option unset"])
def test_upgrade_through_launcher_and_env_switch(tmp_path, how):
    launcher = [str(pathlib.Path(sys.executable).parent / "chunked-logits"), "run",
                "--upgrade-low-precision", "--"]
    argv, env = {
        "launcher flag": (launcher, {}),
        "env switch": ([sys.executable], {"CHUNKED_LOGITS": "1",
                                          "CHUNKED_LOGITS_OPTIONS": "upgrade_low_precision"}),
        "env switch, option unset": ([sys.executable], {"CHUNKED_LOGITS": "1"}),
    }[how]
    out, err = _run_script(tmp_path, argv, **env)
    if how.endswith("unset"):  # off by default: the bf16 graph and its error stay
        assert out["counters"] == {"near_miss": 1} and out["dtype"] == "torch.bfloat16" and out["err"] > 1e-2
        assert "upgraded to FP32" not in err and "set upgrade_low_precision=True" in err
    else:
        assert out["counters"] == {"rewritten": 1} and out["dtype"] == "torch.float32"
        assert out["err"] <= 1e-4
        assert "upgraded to FP32" in err


def test_upgrade_through_install_and_backend_options():
    import fx_passes
    x = (torch.randn(32, 512) * 3).bfloat16()
    tok = torch.randint(0, 512, (32,))
    ref = torch.log_softmax(x.double() / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    with fx_passes.install(upgrade_low_precision=True):
        out = torch.compile(bf16_logprob)(x, tok)
    assert chunked_counters() == {"rewritten": 1}
    assert out.dtype == torch.float32 and (out.double() - ref).abs().max() <= 1e-4
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.install():  # installed without the option: untouched
        out = torch.compile(bf16_logprob)(x, tok)
    assert chunked_counters() == {"near_miss": 1} and out.dtype == torch.bfloat16
