"""The model matrix's tables, from the children's results (benchmarks/models.py).

Only what the children printed goes in: a number a case did not produce is ``-``,
a case that failed shows ``ERROR`` and its message is listed under the tables.
"""

from __future__ import annotations

import re
from collections import defaultdict

__all__ = ["one_line", "render", "lm_head_state", "decline_reasons"]

NOT_FUSED = "lm_head not fused: "


def lm_head_state(res: dict) -> str:
    """fused / not fused (why) / none seen: what the pass did with the lm_head matmul."""
    c = res.get("counters", {})
    if c.get("lm_head_returns_logits"):
        return "fused, the loop also writes the returned logits"
    if c.get("lm_head_fused"):
        return "fused"
    reasons = sorted({e["what"].split(NOT_FUSED, 1)[1] for e in res.get("events", [])
                      if e["kind"] == "rewritten" and NOT_FUSED in e["what"]})
    if reasons:
        return "not fused: " + "; ".join(reasons)
    return "no lm_head next to the upcast" if c.get("rewritten") else "-"


def decline_reasons(res: dict) -> dict[str, int]:
    """``{REASON: count}`` from the counters (``declined:<REASON>``)."""
    return {k.split(":", 1)[1]: v for k, v in sorted(res.get("counters", {}).items())
            if k.startswith("declined:")}


def _declines(res: dict) -> str:
    reasons = decline_reasons(res)
    return ", ".join(f"{k} x{v}" for k, v in reasons.items()) or "0"


def _num(x, fmt: str = ".1e") -> str:
    return "-" if x is None else format(x, fmt)


def one_line(res: dict) -> str:
    """The progress line of one case."""
    if "error" in res:
        return "ERROR " + res["error"][:200]
    if res["mode"] == "ref":
        return "FP64 reference saved"
    if res["mode"] == "trainer":
        rewritten = res["counters"].get("rewritten", 0)
        return f"losses {res['stock_losses']} / {res['losses']}, rewritten {rewritten}"
    return (f"peak {res['peak_mib']:.1f} MiB, loss err {_num(res.get('loss_err'))}, "
            f"grad err {_num(res.get('grad_err_max'))}, rewritten {res['counters'].get('rewritten', 0)}, "
            f"lm_head {lm_head_state(res)}, declined {_declines(res)}")


def _short(where: str) -> str:
    """``x (File ".../loss_utils.py", line 61, in F)`` -> ``loss_utils.py:61 F``: file, line, function."""
    m = re.search(r'File "([^"]+)", line (\d+), in (\S+)\)', where)
    return f"{m[1].rsplit('/', 1)[-1]}:{m[2]} {m[3]}" if m else where


def _pair(by_mode: dict, a: str, b: str, key: str, fmt: str) -> str:
    def cell(mode):
        res = by_mode.get(mode)
        if res is None:
            return "-"
        return "ERROR" if "error" in res else _num(res.get(key), fmt)
    return f"{cell(a)} / {cell(b)}"


def _graphs(res: dict) -> str:
    """Graphs Dynamo compiled, and its graph breaks: a break between the lm_head and the loss
    puts them in different graphs, where no pass can fuse them."""
    if "graphs" not in res:
        return "-"
    return f"{res['graphs']}" + (f" ({res['graph_breaks']} breaks)" if res.get("graph_breaks") else "")


def _rewritten(res: dict) -> str:
    n = str(res.get("counters", {}).get("rewritten", 0))
    return f"{n}, then ERROR" if "error" in res else n


def _install(by_mode: dict) -> str:
    install, ours = by_mode.get("install", {}), by_mode.get("chunked", {})
    if "error" in install:
        return "ERROR"
    same = "same loss" if install.get("loss") == ours.get("loss") else f"loss {install.get('loss')}"
    return f"{install['counters'].get('rewritten', 0)}, {same}"


def _step_row(family: str, by_mode: dict, with_install: bool) -> str:
    ours = by_mode.get("chunked", {})
    cells = [family, ours.get("logit_transform", "-"), _rewritten(ours), lm_head_state(ours), _declines(ours),
             _graphs(ours),
             _pair(by_mode, "stock", "chunked", "loss_err", ".1e"),
             _pair(by_mode, "stock", "chunked", "grad_err_head", ".1e"),
             _pair(by_mode, "stock", "chunked", "grad_err_max", ".1e"),
             _pair(by_mode, "stock", "chunked", "peak_mib", ".0f")]
    if with_install:
        cells.append(_install(by_mode))
    return "| " + " | ".join(cells) + " |"


def _nologits_row(family: str, by_mode: dict) -> str:
    ours = by_mode.get("chunked_nologits", {})
    cells = [family, _rewritten(ours), lm_head_state(ours), _declines(ours), _graphs(ours),
             _pair(by_mode, "stock_nologits", "chunked_nologits", "loss_err", ".1e"),
             _pair(by_mode, "stock_nologits", "chunked_nologits", "grad_err_max", ".1e"),
             _pair(by_mode, "stock_nologits", "chunked_nologits", "peak_mib", ".0f")]
    return "| " + " | ".join(cells) + " |"


def _trainer_row(family: str, res: dict) -> str:
    if "error" in res:
        return f"| {family} | ERROR | - | - | - |"
    def losses(key):
        return ", ".join(f"{x:.4f}" for x in res[key])
    return (f"| {family} | {res['counters'].get('rewritten', 0)} | {losses('stock_losses')} "
            f"| {losses('losses')} | {res['max_loss_diff']:.1e} |")


def _events(by_family: dict) -> list[str]:
    """Every distinct thing the pass logged, per family and mode."""
    lines = []
    for family, by_mode in by_family.items():
        for mode, res in by_mode.items():
            for e in res.get("events", []):
                why = f" [{e['reason']}]" if e["reason"] else ""
                lines.append(f"* {family} / {mode}: {e['kind']}{why} {e['what']} at `{_short(e['where'])}`")
    return lines


def _reason_index(by_family: dict) -> list[str]:
    """decline reason / lm_head_not_fused reason -> the families that showed it."""
    index: dict[str, set] = defaultdict(set)
    for family, by_mode in by_family.items():
        for mode, res in by_mode.items():
            for reason in decline_reasons(res):
                index[f"declined:{reason}"].add(f"{family} ({mode})")
            state = lm_head_state(res)
            if mode in ("chunked", "install", "chunked_nologits", "trainer") and state not in ("fused", "-"):
                index[f"lm_head {state}"].add(f"{family} ({mode})")
    return [f"* `{k}`: {', '.join(sorted(v))}" for k, v in sorted(index.items())]


def render(meta: dict, results: list[dict]) -> str:
    by_family: dict[str, dict] = defaultdict(dict)
    for res in results:
        by_family[res["family"]][res["mode"]] = res
    out = ["# The model matrix", "",
           (f"Produced by `{meta['command']}` at commit `{meta['commit']}`, torch {meta['torch']}, "
           f"transformers {meta['transformers']}; V {meta['vocab']}, T {meta['seq_len']} (one sequence), "
           f"{meta['layers']} layer(s), hidden 64, bf16, {meta['threads']} thread(s), "
           f"{meta['warmup']} warm-up steps before the measured one."), "",
           "## A training step with `labels`: `torch.compile(model)`, the model returns loss and logits", "",
           ("Errors are against the same model in FP64 (eager); grad errors are max|g - g64| / max|g64|, "
            "for the lm_head weight and the worst parameter.  Peak: extra host memory of one step "
            "(VmHWM - VmRSS), fresh process per case.  Graphs: what Dynamo compiled under `chunked_logits`.  "
            "`rewritten`, `lm_head`, `declined`: the `chunked_logits` case (`ERROR`: the compile failed "
            "after the pass ran; the message is under the tables)."), ""]
    with_install = any("install" in m for m in by_family.values())
    header = ("| family | logit transform | rewritten | lm_head | declined | graphs | loss err stock / ours "
              "| lm_head grad err stock / ours | max grad err stock / ours | peak MiB stock / ours |")
    if with_install:
        header += " install: rewritten, loss vs backend |"
    out += [header, "| --- " * header.count(" | ") + "| --- |"]
    out += [_step_row(f, m, with_install) for f, m in by_family.items()]
    out += ["", "## No logits returned: a compiled function calls the model and returns only the loss", "",
            ("| family | rewritten | lm_head | declined | graphs | loss err stock / ours "
             "| max grad err stock / ours | peak MiB stock / ours |"),
            "| --- " * 8 + "|"]
    out += [_nologits_row(f, m) for f, m in by_family.items()]
    trainer = [(f, m["trainer"]) for f, m in by_family.items() if "trainer" in m]
    if trainer:
        out += ["", "## HF `Trainer(torch_compile=True)`: 2 AdamW steps without / with `fx_passes.install()`",
                "",
                "| family | rewritten | losses stock | losses with the pass | max diff |",
                "| --- | --- | --- | --- | --- |"]
        out += [_trainer_row(f, r) for f, r in trainer]
    out += ["", "## Decline and lm_head reasons, by family", "", *_reason_index(by_family),
            "", "## Everything the pass logged", "", *_events(by_family)]
    errors = [f"* {r['family']} / {r['mode']}: `{r['error']}`" for r in results if "error" in r]
    if errors:
        out += ["", "## Errors", "", *errors]
    return "\n".join(out) + "\n"
