"""The launcher: ``chunked-logits run [options] -- script.py args...`` in fresh processes."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from fx_passes.config import Config
from fx_passes.entry import launcher as cli
from tests.helpers import clean_env, last_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent

# A script that knows nothing about chunked-logits: compiles with stock inductor.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch._dynamo.utils import counters

    def logprob(logits, tokens):
        logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    if __name__ == "__main__":
        x = torch.randn(16, 256).to(torch.bfloat16)
        tok = torch.randint(0, 256, (16,))
        out = torch.compile(logprob)(x, tok)
        torch.testing.assert_close(out, logprob(x, tok), atol=0.05, rtol=0)
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                          "counters": dict(counters["chunked_logits"]),
                          "env": os.environ.get("CHUNKED_LOGITS"),
                          "options": os.environ.get("CHUNKED_LOGITS_OPTIONS")}))
""")

# No compile: how the launcher runs the target, exit codes.
NOCOMPILE = textwrap.dedent("""
    import json, sys
    print(json.dumps({"argv": sys.argv, "name": __name__}))
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


def launch(args: list[str], cwd, env=None, timeout=300, exe=None) -> subprocess.CompletedProcess:
    exe = exe or [str(BIN / "chunked-logits")]
    return subprocess.run([*exe, *args], capture_output=True, text=True, cwd=cwd,
                          env=env or clean_env(), timeout=timeout)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_launcher_runs_the_script_with_the_pass(script, tmp_path):
    proc = launch(["run", "--summary-json", str(tmp_path / "s.json"), "--",
                   str(script), "--lr", "1e-5", "--report-only", "--", "x"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    # the script's own arguments pass through untouched, even ones that look like ours
    assert out["argv"] == [str(script), "--lr", "1e-5", "--report-only", "--", "x"]
    assert out["name"] == "__main__" and out["path0"] == str(tmp_path)
    assert out["counters"] == {"rewritten": 1}
    assert out["env"] == "1"  # Python subprocesses of the script get the switch too
    assert json.loads(out["options"])["report_only"] is False
    assert "chunked_logits summary [pid" in proc.stderr and "1 region rewritten" in proc.stderr
    assert "logprob over (16, 256)" in proc.stderr and "train.py" in proc.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["counters"] == {"rewritten": 1} and data["installed"]
    assert [e["kind"] for e in data["events"]] == ["rewritten"]
    assert data["events"][0]["fp32_bytes_avoided"] == 4 * 16 * 256


def test_launcher_options_map_to_config(script, tmp_path):
    proc = launch(["run", "--report-only", "--no-temperature-after-upcast", "--summary-json",
                   str(tmp_path / "s.json"), str(script)], cwd=tmp_path)  # no "--": also fine
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["counters"] == {"would_rewrite": 1}
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["config"]["report_only"] is True and data["config"]["temperature_after_upcast"] is False
    assert "would be rewritten (report_only)" in proc.stderr


def test_kill_switch_under_the_launcher(tmp_path):
    """The graphs themselves: test_install.py::test_env_switch_fresh_processes (kill switch
    = stock code).  Here: the launcher says so, installs nothing and exports nothing."""
    (tmp_path / "job.py").write_text(
        "import json, os, sys\nprint(json.dumps({'env': os.environ.get('CHUNKED_LOGITS'), "
        "'installed': 'fx_passes.entry.install' in sys.modules}))\n")
    proc = launch(["run", "--", "job.py"], cwd=tmp_path, env=clean_env(CHUNKED_LOGITS_DISABLE="1"))
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout) == {"env": None, "installed": False}
    assert "CHUNKED_LOGITS_DISABLE=1 is set" in proc.stderr
    assert "disabled by CHUNKED_LOGITS_DISABLE=1; no graph was changed" in proc.stderr


def test_exit_code_module_mode_and_python_dash_m(tmp_path):
    (tmp_path / "job.py").write_text(NOCOMPILE)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(NOCOMPILE)

    proc = launch(["run", "--", "job.py", "3"], cwd=tmp_path)
    assert proc.returncode == 3
    assert last_json(proc.stdout) == {"argv": ["job.py", "3"], "name": "__main__"}
    assert "no graph was compiled with Inductor" in proc.stderr  # the summary still prints

    proc = launch(["run", "--summary", "never", "--", "-m", "pkg.job", "0", "--flag"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    assert out["name"] == "__main__" and out["argv"][1:] == ["0", "--flag"]
    assert out["argv"][0].endswith(os.path.join("pkg", "job.py")) and proc.stderr == ""

    proc = launch(["-m", "fx_passes", "run", "--summary", "auto", "--", "job.py"], cwd=tmp_path,
                  exe=[sys.executable])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # "auto": nothing compiled, nothing to say


def test_script_exception_propagates_with_summary(tmp_path):
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom')\n")
    proc = launch(["run", "--", "boom.py"], cwd=tmp_path)
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr and "chunked_logits summary" in proc.stderr


RUN_USAGE = ("usage: chunked-logits run [options] -- script.py [args...]\n"
             "       chunked-logits run [options] -- -m module [args...]\n")


def test_usage_errors(tmp_path):
    """Each error of ``run`` comes with run's own usage, not the top-level one."""
    proc = launch(["run", "--report-onyl", "--", "x.py"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        RUN_USAGE + "chunked-logits run: error: unrecognized arguments: --report-onyl\n")
    proc = launch(["run"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(RUN_USAGE) and "missing the script" in proc.stderr
    proc = launch(["run", "--", "missing.py"], cwd=tmp_path)
    assert proc.returncode != 0 and "can't open file" in proc.stderr


@pytest.mark.parametrize("argv,error", [
    (["run", "--strcit", "--", "x.py"], "unrecognized arguments: --strcit"),
    (["run", "--chunk-budget-mib", "abc", "--", "x.py"],
     "argument --chunk-budget-mib: invalid float value: 'abc'"),
    (["run", "--chunk-budget-mib", "0", "--", "x.py"],
     "chunked_logits option 'chunk_budget_mib' must be a positive number of MiB, got 0.0; "
     "e.g. chunk_budget_mib=32"),
    (["run", "--lm-head-plan", "fast", "--", "x.py"], "argument --lm-head-plan: invalid choice: 'fast'"),
    (["run", "--report-only", "x.py", "--", "y.py"], "unexpected arguments before '--': x.py"),
])
def test_parse_errors_show_runs_usage(argv, error, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(RUN_USAGE)
    assert err.splitlines()[2].startswith(f"chunked-logits run: error: {error}")


def test_version(capsys):
    import fx_passes

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"chunked-logits {fx_passes.__version__}\n"


def test_help_is_plain_text_with_the_documented_types():
    text = cli.build_parser().run_parser.format_help()
    assert "``" not in text and ":mod:" not in text and ":func:" not in text and "`" not in text
    assert "--chunk-budget-mib FLOAT" in text and "STR" not in text  # docs/enabling.md
    assert "--lm-head-plan {auto,two_sweeps,fp32_tiles,blocks,gpu,kept_logits}" in text
    assert "drop x / 1 and x * 1 everywhere in the graph. [on]" in " ".join(text.split())
    assert cli.plain("see :mod:`fx_passes.kernels` and ``x / 1``, :func:`~a.b`") == (
        "see fx_passes.kernels and x / 1, a.b")


def test_every_config_field_has_a_flag():
    text = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help()

    for f in dataclasses.fields(Config):
        flag = f.name.replace("_", "-")
        assert f"--{flag}" in text
        if isinstance(f.default, bool):
            assert f"--no-{flag}" in text
    args = cli.build_parser().parse_args(["run", "--report-only", "--no-rewrite", "x.py"])
    assert cli.config_options(args) == {"report_only": True, "rewrite": False}


@pytest.mark.slow
def test_torchrun_rank0_prints_each_rank_writes_its_own(script, tmp_path):
    torchrun = shutil.which("torchrun", path=str(BIN))
    assert torchrun, "torchrun is installed with torch"
    logs = tmp_path / "summaries"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", str(BIN / "chunked-logits"),
         "run", "--summary-dir", str(logs), "--summary-json", str(logs / "rank{rank}.json"), "--",
         str(script)],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env(OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("chunked_logits summary") == 1  # rank 0 only, in one piece
    assert "chunked_logits summary [rank 0," in proc.stderr
    assert sorted(p.name for p in logs.iterdir()) == [
        "chunked_logits.rank0.txt", "chunked_logits.rank1.txt", "rank0.json", "rank1.json"]
    for r in (0, 1):
        text = (logs / f"chunked_logits.rank{r}.txt").read_text()
        assert text.startswith(f"chunked_logits summary [rank {r},") and "1 region rewritten" in text
        assert json.loads((logs / f"rank{r}.json").read_text())["counters"] == {"rewritten": 1}


@pytest.fixture
def summary_settings():
    from fx_passes.reporting import summary

    saved = summary.settings()
    yield summary
    summary.restore(saved)


def _data(**over):
    data = {"rank": None, "pid": 1, "disabled": False, "installed": True, "pass_dropped": False,
            "config": None, "graphs_seen": 1, "counters": {"rewritten": 1},
            "events": [{"kind": "rewritten", "where": "float_1 (File \"x.py\", line 3, in f)",
                        "what": "logprob over (16, 256) (temperature /0.7)", "fp32_bytes_avoided": 16384,
                        "reason": None}]}
    data.update(over)
    return data


def test_summary_ranks_and_files(summary_settings, capfd, tmp_path):
    summary = summary_settings
    summary.configure(mode="always", ranks="0", directory=str(tmp_path))
    summary.write_summary(_data(rank=1))
    assert capfd.readouterr().err == ""  # rank 1 stays quiet by default ...
    assert (tmp_path / "chunked_logits.rank1.txt").read_text().startswith("chunked_logits summary [rank 1,")
    summary.configure(ranks="all")
    summary.write_summary(_data(rank=1))
    err = capfd.readouterr().err  # ... or prints, every line tagged with its rank
    assert err and all(line.startswith("[rank 1] ") for line in err.splitlines())
    summary.write_summary(_data(rank=0))
    assert "16.0 KiB" in capfd.readouterr().err


def test_summary_text_cases():
    from fx_passes.reporting.summary import format_text

    once = _data()["events"][0]
    twice = _data(events=[{**once, "run": 1}, {**once, "run": 2, "what": "logprob over (s0, 256)"}])
    assert "(x2 compiles)" in format_text(twice) and "1 region rewritten" in format_text(twice)
    two = _data(events=[{**once, "run": 1}, {**once, "run": 1}])  # one graph, one place: two calls
    assert "2 regions rewritten" in format_text(two)
    failed = format_text(_data(events=[], counters={"pass_failed": 1}))
    assert "the pass failed on 1 graph(s)" in failed
    assert "disabled by CHUNKED_LOGITS_DISABLE=1" in format_text(_data(disabled=True))
    assert "was replaced after the install" in format_text(_data(pass_dropped=True))
    nothing = format_text(_data(events=[], counters={}, graphs_seen=0))
    assert "no graph was compiled with Inductor" in nothing
