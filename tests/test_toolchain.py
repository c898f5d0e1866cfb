"""The suite's own toolchain (tests/toolchain.py): where it chose gold, the kernels Inductor
builds are linked by gold.  The suite's time depends on it, and a torch that stopped
reading ``CXX`` would drop it without a word."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch
from torch._inductor import codecache
from torch._inductor.runtime.cache_dir_utils import cache_dir

from tests import toolchain


def test_inductor_kernels_are_linked_by_gold_where_the_suite_chose_it():
    if os.environ.get("CXX") != str(toolchain.WRAPPER):
        pytest.skip("CXX is not the suite's wrapper (one of your own, or no gold here)")
    scale = 1.0 + (time.time_ns() % 997) / 1024  # a kernel no cache holds yet
    fn = torch.compile(lambda x: (x * scale).exp().sum(-1))
    fn(torch.randn(8, 16))
    libs = [lib for key in codecache.CppPythonBindingsCodeCache.cache
            for lib in pathlib.Path(cache_dir()).glob(f"*/{key}*.so")]
    assert libs, "no kernel library found in Inductor's cache"
    for lib in libs:
        assert b".note.gnu.gold-version" in lib.read_bytes(), f"{lib} was not linked by gold"
