"""fx_passes.install / uninstall: the passes inside the stock ``inductor`` backend.

In-process tests compile tiny functions; the fresh-process tests (subprocesses)
check the environment switch, the kill switch and that nothing of this package is
imported, or changes a graph, while the switch is unset.
"""

from __future__ import annotations

import json
import os
import pathlib
import site
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import fx_passes
from fx_passes import Config, compat, env
from fx_passes.entry import install as hook
from fx_passes.reporting.session import session
from tests.codegen import full_fp32_buffers
from tests.helpers import clean_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
T, V = 16, 256
RUN = os.urandom(8).hex()


def logprob(logits, tokens):
    logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def escaping(logits, tokens):
    """Declined: the FP32 logits are a graph output."""
    z = logits.float()
    return torch.log_softmax(z, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1), z


def policy_loss(logits, tokens, adv):
    return -(logprob(logits, tokens) * adv).mean()


def inputs(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, V, generator=g) * 3).to(torch.bfloat16).requires_grad_(requires_grad)
    return x, torch.randint(0, V, (T,), generator=g)


class Recorder(CustomGraphPass):
    """A user's own pass: counts the graphs it sees, changes nothing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def __call__(self, graph) -> None:
        self.calls += 1

    def uuid(self) -> str:
        # unique, so that Inductor's FX graph cache misses and the post-grad pass runs
        return f"recorder-{self.name}-{id(self)}-{os.getpid()}-{RUN}"


# Inductor's pre-grad pass timing, where torch has the setting (>= 2.12: compat.PRE_GRAD_PASS_TIMING)
DEFAULT_TIMING = {"pre_grad_pass_timing": "default"} if compat.PRE_GRAD_PASS_TIMING else {}
# install() chains with a user's own pre-grad pass where Inductor takes lists (>= 2.13)
needs_pass_lists = pytest.mark.skipif(not compat.PASS_LISTS, reason="torch < 2.13: no pass lists")
needs_timing = pytest.mark.skipif(not compat.PRE_GRAD_PASS_TIMING, reason="torch < 2.12: no timing setting")


@pytest.fixture(autouse=True)
def _clean_install():
    """No install, no user pass and no event leaks out of a test."""
    session.reset()
    with inductor_config.patch(pre_grad_custom_pass=None, joint_custom_pre_pass=None,
                               post_grad_custom_post_pass=None, **DEFAULT_TIMING):
        try:
            yield
        finally:
            fx_passes.uninstall()
    session.reset()


def same_code(a: list[str], b: list[str]) -> bool:
    """Generated code equal up to the per-process graph counter ("# AOT ID: ['0_inference']")."""
    def strip(codes):
        return ["\n".join(ln for ln in c.splitlines() if not ln.startswith("# AOT ID")) for c in codes]
    return strip(a) == strip(b)


def chunked() -> dict:
    return dict(counters["chunked_logits"])


def ours() -> list:
    return [p for p in compat.custom_graph_passes(inductor_config.pre_grad_custom_pass)
            if isinstance(p, hook.InstalledPass)]


# --- install / uninstall in this process ------------------------------------------


def test_install_rewrites_under_stock_inductor():
    x, tok = inputs()
    expected = logprob(x, tok)
    result = fx_passes.install()
    assert isinstance(result.config, Config) and fx_passes.installed_config() == Config()
    out, codes = run_and_get_code(torch.compile(logprob, backend="inductor"), x, tok)
    assert chunked() == {"rewritten": 1}
    assert full_fp32_buffers(codes, T, V) == []
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    assert [e.kind for e in session.events] == ["rewritten"]
    assert fx_passes.uninstall() is True
    assert inductor_config.pre_grad_custom_pass is None
    assert getattr(inductor_config, "pre_grad_pass_timing", "default") == "default"
    assert fx_passes.installed_config() is None
    assert fx_passes.uninstall() is False  # nothing left to remove


def test_install_twice_rewrites_once_and_replaces_options():
    fx_passes.install()
    fx_passes.install()
    assert len(ours()) == 1
    fx_passes.install(report_only=True)
    assert len(ours()) == 1 and fx_passes.installed_config().report_only
    torch.compile(logprob)(*inputs())
    assert chunked() == {"would_rewrite": 1}


def test_install_and_backend_rewrite_each_region_once():
    fx_passes.install()
    x, tok = inputs()
    torch.compile(logprob, backend="chunked_logits")(x, tok)
    torch.compile(escaping, backend="chunked_logits")(x, tok)
    # the installed pass leaves the backend's graphs alone: no second decline either
    assert chunked() == {"rewritten": 1, "declined": 1, "declined:ESCAPES": 1}
    assert [e.kind for e in session.events] == ["rewritten", "declined"]


def test_backend_options_win_over_installed_ones():
    fx_passes.install(report_only=True)
    torch.compile(logprob, backend="chunked_logits")(*inputs())
    assert chunked() == {"rewritten": 1}


@needs_pass_lists
@pytest.mark.parametrize("container", ["single", "list", "tuple"])
def test_user_pre_grad_pass_is_chained_and_restored(container):
    mine = Recorder("pre")
    value = {"single": mine, "list": [mine], "tuple": (mine,)}[container]
    inductor_config.pre_grad_custom_pass = value
    fx_passes.install()
    now = inductor_config.pre_grad_custom_pass
    assert isinstance(now, list if container == "list" else tuple)
    assert isinstance(now[0], hook.InstalledPass) and now[1] is mine  # ours first, theirs kept
    torch.compile(logprob)(*inputs())
    assert mine.calls == 1 and chunked() == {"rewritten": 1}
    fx_passes.uninstall()
    assert inductor_config.pre_grad_custom_pass == value
    if container == "single":
        assert inductor_config.pre_grad_custom_pass is mine


@needs_pass_lists
def test_user_pass_set_after_install_is_kept_by_a_second_install():
    fx_passes.install()
    mine = Recorder("late")
    inductor_config.pre_grad_custom_pass = mine  # the user replaces ours ...
    assert fx_passes.installed_config() is None
    fx_passes.install()  # ... and installing again chains both
    assert ours() and mine in inductor_config.pre_grad_custom_pass
    fx_passes.uninstall()
    assert inductor_config.pre_grad_custom_pass is mine


@needs_pass_lists
def test_plain_callable_user_pass_is_chained():
    calls = []
    inductor_config.pre_grad_custom_pass = lambda graph: calls.append(graph)
    with fx_passes.install():
        torch.compile(logprob)(*inputs())
    assert len(calls) == 1 and chunked() == {"rewritten": 1}
    assert callable(inductor_config.pre_grad_custom_pass) and not ours()


@pytest.mark.parametrize("how", ["install", "backend"])
def test_user_joint_and_post_grad_passes_run(how):
    joint, post = Recorder("joint"), Recorder("post")
    inductor_config.joint_custom_pre_pass = joint
    inductor_config.post_grad_custom_post_pass = post
    x, tok = inputs(requires_grad=True)
    adv = torch.randn(T)
    if how == "install":
        fx_passes.install()
    fn = torch.compile(policy_loss, backend="inductor" if how == "install" else "chunked_logits")
    loss = fn(x, tok, adv)
    loss.backward()
    assert chunked() == {"rewritten": 1}
    assert joint.calls == 1  # the joint graph (forward + backward)
    assert post.calls >= 1  # the post-grad graph(s)
    assert inductor_config.joint_custom_pre_pass is joint
    assert inductor_config.post_grad_custom_post_pass is post
    x2 = x.detach().clone().requires_grad_(True)
    policy_loss(x2, tok, adv).backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-3, rtol=2e-2)


@pytest.mark.injects_faults
def test_pass_failure_falls_back_to_stock_under_install(monkeypatch):
    """Early pre-grad timing: the fall-back rebuilds the graph before AOT autograd reads
    Dynamo's placeholder metadata; the compile must still succeed, unchanged."""
    import fx_passes.pipeline

    def boom(graph, config):
        raise RuntimeError("injected")

    x, tok = inputs()
    _, stock = run_and_get_code(torch.compile(logprob), x, tok)
    torch._dynamo.reset()
    monkeypatch.setattr(fx_passes.pipeline, "run_passes", boom)
    fx_passes.install()
    with pytest.warns(UserWarning, match="the pass failed on this graph"):
        out, codes = run_and_get_code(torch.compile(logprob), x, tok)
    assert chunked() == {"pass_failed": 1} and same_code(codes, stock)
    torch.testing.assert_close(out, logprob(x, tok), atol=0.05, rtol=0)


def test_context_manager_and_nesting():
    with fx_passes.install() as outer:
        assert fx_passes.installed_config() == outer.config
        with fx_passes.install(report_only=True):
            assert fx_passes.installed_config().report_only
        assert fx_passes.installed_config() == Config()  # the outer install is back
        torch.compile(logprob)(*inputs())
    assert fx_passes.installed_config() is None and inductor_config.pre_grad_custom_pass is None
    assert chunked() == {"rewritten": 1}


@needs_timing
def test_explicit_late_timing_is_left_alone():
    with inductor_config.patch(pre_grad_pass_timing="late"):
        with fx_passes.install():
            assert inductor_config.pre_grad_pass_timing == "late"
        assert inductor_config.pre_grad_pass_timing == "late"


def test_unknown_option_is_an_error():
    with pytest.raises(ValueError, match="did you mean 'report_only'"):
        fx_passes.install(report_onyl=True)
    assert inductor_config.pre_grad_custom_pass is None


def test_kill_switch_turns_the_installed_pass_off(monkeypatch):
    x, tok = inputs()
    _, stock = run_and_get_code(torch.compile(logprob), x, tok)
    torch._dynamo.reset()
    monkeypatch.setenv("CHUNKED_LOGITS_DISABLE", "1")
    fx_passes.install()
    _, killed = run_and_get_code(torch.compile(logprob), x, tok)
    assert chunked() == {} and same_code(killed, stock)
    torch._dynamo.reset()
    _, backend = run_and_get_code(torch.compile(logprob, backend="chunked_logits"), x, tok)
    assert chunked() == {} and same_code(backend, stock)


def test_uuid_follows_options_and_kill_switch(monkeypatch):
    a, b = hook.InstalledPass(Config()), hook.InstalledPass(Config(report_only=True))
    assert a.uuid() != b.uuid() and a.uuid() == hook.InstalledPass(Config()).uuid()
    on = a.uuid()
    monkeypatch.setenv("CHUNKED_LOGITS_DISABLE", "1")
    assert a.uuid() != on


@pytest.mark.parametrize("text, expected", [
    ("", {}),
    ('{"report_only": true}', {"report_only": True}),
    ("report_only", {"report_only": True}),
    ("report-only, no-temperature-after-upcast", {"report_only": True, "temperature_after_upcast": False}),
    ("strict=0,remove_div_by_one=yes", {"strict": False, "remove_div_by_one": True}),
])
def test_options_from_env(text, expected):
    assert env.options(text) == expected


# --- fresh processes: the environment switch ----------------------------------------

PROBE = textwrap.dedent("""
    import hashlib, json, sys
    at_start = sorted(m for m in sys.modules if m.startswith(("fx_passes", "torch")))
    import torch
    after_torch = sorted(m for m in sys.modules if m.startswith("fx_passes"))
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    def logprob(logits, tokens):
        logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    x = torch.randn(16, 256).to(torch.bfloat16)
    tok = torch.randint(0, 256, (16,))
    _, codes = run_and_get_code(torch.compile(logprob), x, tok)
    print(json.dumps({
        "at_start": at_start, "after_torch": after_torch,
        "after_compile": sorted(m for m in sys.modules if m.startswith("fx_passes")),
        "counters": dict(counters["chunked_logits"]),
        # the AOT ID line numbers graphs per process (or the process that filled the cache)
        "code": hashlib.sha256("\\n".join(ln for c in codes for ln in c.splitlines()
                                         if not ln.startswith("# AOT ID")).encode()).hexdigest(),
    }))
""")


def probe(tmp_path, **env: str) -> tuple[dict, str]:
    script = tmp_path / "probe.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=clean_env(**env), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
def test_env_switch_fresh_processes(tmp_path):
    """Unset: nothing imported, nothing changed.  Set: the pass fires, with a summary.
    Set with the kill switch: the same code as unset."""
    from concurrent.futures import ThreadPoolExecutor

    envs = [{}, {"CHUNKED_LOGITS": "1"}, {"CHUNKED_LOGITS": "1", "CHUNKED_LOGITS_DISABLE": "1"},
            {"CHUNKED_LOGITS": "1", "CHUNKED_LOGITS_OPTIONS": "report_only",
             "CHUNKED_LOGITS_SUMMARY": "never"}]
    (tmp_path / "probe.py").write_text(PROBE)
    with ThreadPoolExecutor(2) as pool:  # 2 cores
        results = list(pool.map(lambda e: probe(tmp_path, **e), envs))
    (off, off_err), (on, on_err), (killed, killed_err), (opts, opts_err) = results
    assert off["at_start"] == [] and off["after_torch"] == [] and off["after_compile"] == []
    assert off["counters"] == {} and "chunked_logits" not in off_err

    started = ["fx_passes", "fx_passes.entry", "fx_passes.entry.autoinstall", "fx_passes.env"]
    assert on["at_start"] == started  # no torch at start
    assert on["after_torch"] == started  # lazy until Inductor
    assert "fx_passes.entry.install" in on["after_compile"]
    assert on["counters"] == {"rewritten": 1}
    assert on["code"] != off["code"]
    assert "chunked_logits summary" in on_err and "1 region rewritten" in on_err

    assert killed["counters"] == {} and killed["code"] == off["code"]
    assert killed["after_compile"] == started
    assert "chunked_logits summary" not in killed_err

    assert opts["counters"] == {"would_rewrite": 1} and opts["code"] == off["code"]
    assert "chunked_logits summary" not in opts_err


def test_pth_file_is_installed():
    paths = [pathlib.Path(p) / "chunked_logits.pth" for p in site.getsitepackages()]
    found = [p for p in paths if p.exists()]
    assert found, f"chunked_logits.pth not in {site.getsitepackages()}: reinstall with pip install -e ."
    text = found[0].read_text()
    assert text.startswith("import os;") and "CHUNKED_LOGITS" in text
    assert "fx_passes.entry.autoinstall" in text


def test_build_backend_adds_pth_to_a_wheel(tmp_path):
    """What pip install (normal or -e) gets: the backend's post-processing of a wheel."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_with_pth
    finally:
        sys.path.remove(str(ROOT / "tools"))
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "")
        z.writestr("demo-1.0.dist-info/RECORD", "demo/__init__.py,sha256=x,0\ndemo-1.0.dist-info/RECORD,,\n")
    build_with_pth.add_pth(str(wheel))
    build_with_pth.add_pth(str(wheel))  # idempotent
    with zipfile.ZipFile(wheel) as z:
        assert z.read("chunked_logits.pth").decode() == build_with_pth.PTH_TEXT
        record = z.read("demo-1.0.dist-info/RECORD").decode().splitlines()
        assert z.namelist().count("chunked_logits.pth") == 1
    assert record[-1] == "demo-1.0.dist-info/RECORD,,"
    assert record[1].startswith("chunked_logits.pth,sha256=")


def _setuptools_builds_wheels() -> bool:
    """This environment's setuptools has its own ``bdist_wheel`` (70.1 on: pyproject's build
    requirement, which pip's build isolation installs; a venv of Python 3.11 starts with 65)."""
    import importlib.metadata
    major, minor = (int(p) for p in importlib.metadata.version("setuptools").split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.mark.skipif(not _setuptools_builds_wheels(), reason="this environment's setuptools is older than "
                    "pyproject's build requirement (70.1), which the test's --no-build-isolation uses")
def test_normal_wheel_install_env_switch(tmp_path):
    """pip wheel + pip install --target: the .pth lands at the root and works from there."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (wheel,) = wheels.glob("chunked_logits-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    assert (target / "chunked_logits.pth").exists()
    # -S: no site-packages of this venv (whose own .pth would import the editable copy);
    # addsitedir processes the target's .pth files as site.py does for site-packages.
    code = ("import site, sys; site.addsitedir(sys.argv[1]); a = sys.modules['fx_passes.entry.autoinstall']; "
            "print(a.__file__, a._hooks in sys.meta_path, 'torch' in sys.modules)")
    env = {k: v for k, v in clean_env(CHUNKED_LOGITS="1").items() if k != "PYTHONPATH"}  # (a checkout's)
    out = subprocess.run([sys.executable, "-S", "-c", code, str(target)], capture_output=True, text=True,
                         env=env, timeout=120, check=True, cwd=tmp_path).stdout
    path, hooked, torch_imported = out.split()
    assert path.startswith(str(target)) and hooked == "True" and torch_imported == "False"


def test_options_from_env_numeric_and_string_fields():
    # chunk_budget_mib (None by default) and lm_head_plan: values parsed as JSON, else kept as text
    assert env.options("chunk_budget_mib=64") == {"chunk_budget_mib": 64}
    assert env.options("chunk-budget-mib=0.5,lm_head_plan=gpu") == {"chunk_budget_mib": 0.5,
                                                                    "lm_head_plan": "gpu"}
    assert env.options('{"chunk_budget_mib": 2}') == {"chunk_budget_mib": 2}
    assert Config(**env.options("chunk_budget_mib=64")).chunk_budget_mib == 64
    with pytest.raises(ValueError, match="report_only"):
        env.options("report_only=maybe")


def test_install_marks_row_stats_cacheable_and_uninstall_restores():
    from torch._inductor import config as inductor_config
    with inductor_config.patch(unsafe_marked_cacheable_functions={"mine.op": "1"}):
        with fx_passes.install():
            marks = dict(inductor_config.unsafe_marked_cacheable_functions)
            assert marks["mine.op"] == "1" and "fx_passes.kernels.log_softmax.given.row_stats" in marks
            assert marks["fx_passes.kernels.log_softmax.given.row_stats"].startswith("chunked_logits-")
        assert inductor_config.unsafe_marked_cacheable_functions == {"mine.op": "1"}


def test_package_and_env_module_import_no_torch():
    """``import fx_passes`` and the environment module (read at interpreter start) stay torch-free."""
    code = ("import sys, fx_passes, fx_passes.env, fx_passes.config; fx_passes.env.options('strict'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=clean_env(), timeout=120, check=True).stdout
    assert out.split() == ["False"]


def test_session_collects_what_the_summary_says_and_resets():
    """One owner of the session's events: install notes its config, the pass records events,
    a replaced pre_grad_custom_pass shows as dropped, and reset starts over."""
    from fx_passes.reporting import summary

    fx_passes.install(report_only=True)
    x = torch.randn(8, 32).bfloat16()
    torch.compile(lambda x: torch.logsumexp(x.float(), -1))(x)
    data = summary.collect()
    assert data["installed"] and data["config"]["report_only"] and data["graphs_seen"] == 1
    assert [e["kind"] for e in data["events"]] == ["would_rewrite"] and not data["pass_dropped"]
    inductor_config.pre_grad_custom_pass = None  # a user's assignment over the install
    assert summary.collect()["pass_dropped"]
    session.reset()
    data = summary.collect()
    assert (data["installed"], data["graphs_seen"], data["events"], data["pass_dropped"]) == (
        False, 0, [], False)
