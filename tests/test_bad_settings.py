"""Bad inputs and settings: each one gets the exact message the user sees.

``torch.compile`` does not call the backend until the compiled function is first
called (it only looks the backend up), so that is where a bad ``options={...}`` shows:
as a plain ValueError (``fx_passes.entry.backend.OptionError``) with our message only,
not wrapped in Dynamo's ``BackendCompilerFailed`` and without its footer.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import traceback

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes import ChunkedLogitsPass, Config, env
from tests.helpers import clean_env

NAMES = ", ".join(f.name for f in dataclasses.fields(Config))
BOOLS = [f.name for f in dataclasses.fields(Config) if f.type == "bool"]
INDUCTOR_HINT = "(Inductor settings go under options={'inductor': {...}})"


def unknown(key: str, hint: str = "") -> str:
    return f"unknown chunked_logits option {key!r}; {hint}valid options: {NAMES} {INDUCTOR_HINT}"


def fn(x):
    return torch.logsumexp(x.float(), dim=-1)  # rewritten when the pass runs


def first_call_error(**compile_kwargs) -> ValueError:
    """What the user sees on the first call of torch.compile(fn, backend="chunked_logits", ...):
    a ValueError, its text ours alone, its traceback from the user's call to the backend."""
    compiled = torch.compile(fn, backend="chunked_logits", **compile_kwargs)  # no error yet
    with pytest.raises(ValueError) as info:
        compiled(torch.randn(3, 5).bfloat16())
    err = info.value
    assert not isinstance(err, torch._dynamo.exc.BackendCompilerFailed)
    shown = traceback.format_exception(err)
    assert shown[-1] == f"fx_passes.entry.backend.OptionError: {err}\n"  # no Dynamo footer
    assert "first_call_error" in shown[1] and "in chunked_logits" in shown[-2] and len(shown) == 5
    return err


# ---- Config.from_options ----------------------------------------------------------------------------

def test_unknown_option_without_a_close_name() -> None:
    with pytest.raises(ValueError) as info:
        Config.from_options({"bogus": 1})
    assert str(info.value) == unknown("bogus")


@pytest.mark.parametrize("typo,meant", [("strcit", "strict"), ("report-only", "report_only"),
                                        ("remove_div_by_1", "remove_div_by_one"),
                                        ("temperature_after_upcasts", "temperature_after_upcast")])
def test_unknown_option_suggests_the_close_name(typo, meant) -> None:
    with pytest.raises(ValueError) as info:
        Config.from_options({typo: True})
    assert str(info.value) == unknown(typo, f"did you mean {meant!r}? ")


def test_unknown_keyword_override() -> None:
    with pytest.raises(ValueError) as info:
        Config.from_options(None, stirct=True)
    assert str(info.value) == unknown("stirct", "did you mean 'strict'? ")


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", [1, 0, "yes", "False", None, 1.0])
def test_non_bool_values(name, value) -> None:
    with pytest.raises(ValueError) as info:
        Config.from_options({name: value})
    assert str(info.value) == f"chunked_logits option {name!r} must be True or False, got {value!r}"


@pytest.mark.skipif("chunk_budget_mib" not in NAMES, reason="no chunk budget option")
@pytest.mark.parametrize("value", [0, -1, "32", True, float("nan"), "auto"])
def test_bad_chunk_budget(value) -> None:
    with pytest.raises(ValueError) as info:
        Config.from_options({"chunk_budget_mib": value})
    assert str(info.value) == ("chunked_logits option 'chunk_budget_mib' must be a positive number of "
                               f"MiB, got {value!r}; e.g. chunk_budget_mib=32")


@pytest.mark.parametrize("value", ["gpu2", "", None, 1])
def test_bad_lm_head_plan_names_the_plans(value):
    with pytest.raises(ValueError) as info:
        Config.from_options({"lm_head_plan": value})
    assert str(info.value) == ("chunked_logits option 'lm_head_plan' must be one of 'auto', 'two_sweeps', "
                               f"'fp32_tiles', 'blocks', 'gpu', 'kept_logits', got {value!r}; e.g. "
                               "lm_head_plan='auto'")


def test_chunk_budget_unset_is_the_devices() -> None:
    """None (the default) leaves the lm_head loop's budget to the device (0 reaches the
    loop: kernels.tiling.resolve_budget); every other loop takes 32 MiB, as an explicit
    budget is the same for all."""
    assert Config().chunk_budget_mib is None
    assert (Config().chunk_budget_bytes, Config().device_budget_bytes) == (32 * 2**20, 0)
    assert Config(chunk_budget_mib=None) == Config() == Config.from_options({"chunk_budget_mib": None})
    explicit = Config.from_options({"chunk_budget_mib": 1.5})
    assert explicit.chunk_budget_bytes == explicit.device_budget_bytes == 3 * 2**19


def test_good_options_round_trip() -> None:
    cfg = Config.from_options({"strict": True}, report_only=True)
    assert cfg.strict and cfg.report_only and cfg == Config(strict=True, report_only=True)
    assert Config.from_options(None) == Config() == Config.from_options({})


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().strict = True


# ---- through torch.compile ----------------------------------------------------------------------------

def test_compile_with_unknown_option_fails_on_first_call() -> None:
    err = first_call_error(options={"bogus": 1})
    assert str(err) == unknown("bogus")
    assert counters["chunked_logits"] == {}  # nothing ran


def test_compile_with_a_typo_fails_with_the_suggestion() -> None:
    err = first_call_error(options={"strict ": True})
    assert str(err) == unknown("strict ", "did you mean 'strict'? ")


def test_compile_with_non_bool_option() -> None:
    err = first_call_error(options={"rewrite": "no"})
    assert str(err) == "chunked_logits option 'rewrite' must be True or False, got 'no'"


def test_compile_with_unknown_inductor_setting() -> None:
    err = first_call_error(options={"inductor": {"bogus_setting": 1}})
    assert str(err) == ("chunked_logits: unknown Inductor setting options['inductor']['bogus_setting']: "
                        "torch._inductor.config.bogus_setting does not exist")


def test_compile_with_unknown_mode() -> None:
    err = first_call_error(mode="bogus-mode")
    assert str(err).startswith("chunked_logits: mode='bogus-mode': Unrecognized mode=bogus-mode, "
                               "should be one of: ")


def test_compile_with_inductor_settings_not_a_dict() -> None:
    err = first_call_error(options={"inductor": "max-autotune"})
    assert str(err) == (
        "chunked_logits: options['inductor'] must be a dict of Inductor settings, got str "
        "'max-autotune'; for an Inductor mode use torch.compile(..., mode='max-autotune') or e.g. "
        "options={'inductor': {'max_autotune': True}}")


def test_compile_with_options_not_a_mapping() -> None:
    err = first_call_error(options=["strict"])
    assert str(err) == (
        "chunked_logits: options must be a dict of option names to values, got list ['strict']; "
        "e.g. options={'strict': True}")


def test_pre_grad_pass_with_a_dict_instead_of_a_config() -> None:
    with pytest.raises(TypeError) as err:
        ChunkedLogitsPass({"strict": True})
    assert str(err.value) == (
        "ChunkedLogitsPass takes a fx_passes.Config, got dict {'strict': True}; "
        "e.g. ChunkedLogitsPass(Config.from_options({'strict': True}))")


# ---- the kill switch --------------------------------------------------------------------------------

@pytest.mark.parametrize("value,off", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                       ("0", False), ("", False), ("no", False), ("off", False)])
def test_kill_switch_values(value, off, monkeypatch) -> None:
    monkeypatch.setenv(env.KILL_SWITCH, value)
    assert env.disabled() is off


def test_kill_switch_makes_the_backend_stock_inductor(monkeypatch) -> None:
    monkeypatch.setenv(env.KILL_SWITCH, "1")
    x = torch.randn(4, 9).bfloat16()
    got = torch.compile(fn, backend="chunked_logits")(x)
    assert counters["chunked_logits"].get("rewritten", 0) == 0
    torch.testing.assert_close(got, fn(x))


# ---- a bad CHUNKED_LOGITS_OPTIONS ------------------------------------------------------------------

@pytest.mark.parametrize("value,error", [
    ("bogus", unknown("bogus")),
    ('{"strict": 1}', "chunked_logits option 'strict' must be True or False, got 1"),
    ("report_only,lm_head_plan=fast", "chunked_logits option 'lm_head_plan' must be one of 'auto', "
     "'two_sweeps', 'fp32_tiles', 'blocks', 'gpu', 'kept_logits', got 'fast'; e.g. lm_head_plan='auto'"),
])
def test_bad_env_options_stop_the_process_at_start(value, error) -> None:
    """The switch asked for the pass: a process whose options are wrong does not start
    (exit code 2, the message alone), rather than run for hours without the pass."""
    proc = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60,
                          env=clean_env(CHUNKED_LOGITS="1", CHUNKED_LOGITS_OPTIONS=value))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"chunked_logits: CHUNKED_LOGITS_OPTIONS={value!r} is not valid: {error}\n"
                           "chunked_logits: this process stops here; fix CHUNKED_LOGITS_OPTIONS, or unset "
                           "CHUNKED_LOGITS to run without the pass\n")
    killed = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True,
                            timeout=60,
                            env=clean_env(CHUNKED_LOGITS="1", CHUNKED_LOGITS_OPTIONS=value,
                                          CHUNKED_LOGITS_DISABLE="1"))
    assert (killed.returncode, killed.stdout, killed.stderr) == (0, "ran\n", "")  # the kill switch wins
