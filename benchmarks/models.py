"""The model matrix: every tiny *ForCausalLM family, one training step with labels, each mode.

    .venv/bin/python benchmarks/models.py --out docs/models.md            # V 32768, T 2048
    .venv/bin/python benchmarks/models.py --vocab 4096 --seq-len 256 --families llama,gemma2

Every (family, mode) runs in a fresh child process (``benchmarks/model_cases.py`` has
the modes and the method): first the FP64 reference, which the other modes of the
family read from a file.  Raw results land in ``--json`` as they come; ``--out``
gets the tables (``benchmarks/model_report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory import MALLOC_ENV  # noqa: E402
from benchmarks.run import parse_names  # noqa: E402
from fx_passes.env import without_ours  # noqa: E402
from fx_passes.testing.models import FAMILIES  # noqa: E402

RESULT_TAG = "@@RESULT "
STEP_MODES = ("stock", "chunked", "install", "stock_nologits", "chunked_nologits")
# install() runs the same passes on the same graphs as the backend; the Trainer runs show that path
DEFAULT_MODES = ("stock", "chunked", "stock_nologits", "chunked_nologits")
TRAINER_FAMILIES = ("llama", "gemma2", "qwen3_moe")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list (default: all)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma list of {', '.join(STEP_MODES)} (default: all but install)")
    p.add_argument("--trainer-families", default=",".join(TRAINER_FAMILIES),
                   help="families that also run HF Trainer(torch_compile=True) ('' for none)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=2048, help="T: tokens of the one sequence of a step")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured one (the first compiles)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (and compile threads) per child")
    p.add_argument("--timeout", type=int, default=900, help="seconds per child process")
    p.add_argument("--json", default="bench_out/models.json", help="raw results, written as they come")
    p.add_argument("--out", default=None, help="write the markdown tables here (e.g. docs/models.md)")
    p.add_argument("--from-json", default=None, help="only render the tables of a run's --json file")
    args = p.parse_args(argv)
    args.families = parse_names(args.families, FAMILIES)
    args.modes = parse_names(args.modes, STEP_MODES)
    args.trainer_families = parse_names(args.trainer_families, FAMILIES)
    return args


def child_env(threads: int) -> dict:
    """A fresh process that knows nothing of the package's switches (CHUNKED_LOGITS=1 would
    put the pass into the stock baseline), with fixed malloc thresholds (benchmarks/README.md)."""
    return without_ours(**MALLOC_ENV, TORCHINDUCTOR_COMPILE_THREADS=str(threads),
                        OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def spawn(args, family: str, mode: str, ref_path: str) -> dict:
    """Run one case in a child; its result, or the error that stopped it."""
    cmd = [sys.executable, "-c", "from benchmarks.model_cases import main; main()",
           "--family", family, "--mode", mode, "--ref", ref_path, "--vocab", str(args.vocab),
           "--seq-len", str(args.seq_len), "--layers", str(args.layers), "--warmup", str(args.warmup),
           "--threads", str(args.threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(args.threads),
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"family": family, "mode": mode, "error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["(no output)"]
    return {"family": family, "mode": mode, "error": f"exit {proc.returncode}: {tail[-1][:300]}"}


def header(args) -> dict:
    """What the tables were made with: the command, the commit and the versions."""
    import torch
    import transformers
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    command = " ".join([".venv/bin/python", "benchmarks/models.py", *sys.argv[1:]])
    return {"command": command, "commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "vocab": args.vocab, "seq_len": args.seq_len,
            "layers": args.layers, "threads": args.threads, "warmup": args.warmup}


def cases(args):
    """(family, mode) in the order they run: each family's reference first."""
    for family in args.families:
        yield family, "ref"
        for mode in args.modes:
            yield family, mode
        if family in args.trainer_families:
            yield family, "trainer"


def write_tables(meta: dict, results: list[dict], out: str | None) -> None:
    from benchmarks import model_report
    text = model_report.render(meta, results)
    print(text)
    if out:
        pathlib.Path(out).write_text(text)


def main(argv=None) -> None:
    from benchmarks import model_report
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        return write_tables(saved["meta"], saved["results"], args.out)
    meta = header(args)
    print(json.dumps(meta), flush=True)
    results: list[dict] = []
    pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family, mode in cases(args):
            t0 = time.time()
            res = spawn(args, family, mode, os.path.join(tmp, f"{family}.pt"))
            res["wall_s"] = time.time() - t0
            results.append(res)
            line = model_report.one_line(res)
            print(f"{family:<12} {mode:<17} {line}  ({res['wall_s']:.0f} s)", flush=True)
            pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    write_tables(meta, results, args.out)


if __name__ == "__main__":
    main()
