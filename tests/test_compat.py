"""fx_passes.compat: each check of a private torch API answers on this torch, and a
missing one turns its feature off instead of failing."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.config as inductor_config

import fx_passes
from fx_passes import compat
from tests.helpers import dynamo_graph

VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def test_each_check_answers_on_this_torch():
    assert compat.available() == {
        "log_api_usage_once": True,
        "unsafe_marked_cacheable_functions": True,
        "pre_grad_pass_timing": VERSION >= (2, 12),
        "pre_grad_pass_lists": VERSION >= (2, 13),
        "restart_analysis": True,
        "auto_dispatch_below_autograd": True,
        "cpu_matmul_features": True,
    }
    assert compat.TELEMETRY_FUNCTIONS == (torch._C._log_api_usage_once,)
    assert compat.CONTROL_FLOW_ERRORS == (torch._dynamo.exc.RestartAnalysis,)


def test_cpu_matmul_in_hardware_reads_the_cpu_flags():
    """The answer torch's own checks give, which on Linux are the CPU's flags."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert compat.cpu_matmul_in_hardware(torch.bfloat16) == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert compat.cpu_matmul_in_hardware(torch.float16) == ("amx_fp16" in flags)
    assert not compat.cpu_matmul_in_hardware(torch.float32)


def test_custom_graph_passes_reads_every_form():
    def a(graph):
        pass

    def b(graph):
        pass

    assert compat.custom_graph_passes(None) == ()
    assert compat.custom_graph_passes(a) == (a,)
    assert compat.custom_graph_passes([a, b]) == (a, b) == compat.custom_graph_passes((a, b))


def test_dynamo_node_attributes_of_placeholders():
    gm = dynamo_graph(lambda x: x.float().sum(), torch.randn(3))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert "_dynamo_source" in compat.dynamo_node_attributes(placeholder)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert all(k.startswith("_dynamo") for k in compat.dynamo_node_attributes(output))


def test_below_autograd_no_grad():
    key = torch._C.DispatchKey.ADInplaceOrView
    assert torch.is_grad_enabled() and not torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    with compat.below_autograd_no_grad():
        assert not torch.is_grad_enabled()
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    assert torch.is_grad_enabled() and not torch._C._dispatch_tls_is_dispatch_key_excluded(key)


@pytest.fixture
def no_install():
    timing = {"pre_grad_pass_timing": "default"} if compat.PRE_GRAD_PASS_TIMING else {}
    with inductor_config.patch(pre_grad_custom_pass=None, **timing):
        try:
            yield
        finally:
            fx_passes.uninstall()


def test_without_pass_lists_install_leaves_a_user_pass_alone(no_install, monkeypatch, caplog):
    def mine(graph):
        pass

    monkeypatch.setattr(compat, "PASS_LISTS", False)
    inductor_config.pre_grad_custom_pass = mine
    with caplog.at_level(logging.WARNING, logger="fx_passes"):
        fx_passes.install()
    assert inductor_config.pre_grad_custom_pass is mine and fx_passes.installed_config() is None
    assert "not installed" in caplog.text and "backend='chunked_logits'" in caplog.text


def test_without_cacheable_marks_install_does_not_mark(no_install, monkeypatch):
    monkeypatch.setattr(compat, "CACHEABLE_MARKS", False)
    with inductor_config.patch(unsafe_marked_cacheable_functions={}):
        fx_passes.install()
        assert fx_passes.installed_config() is not None
        assert inductor_config.unsafe_marked_cacheable_functions == {}
        fx_passes.uninstall()
        assert inductor_config.unsafe_marked_cacheable_functions == {}
