"""Placeholder until the compat module lands (merge will replace this file)."""
import contextlib

import torch


@contextlib.contextmanager
def below_autograd():
    with torch._C._AutoDispatchBelowADInplaceOrView(), torch.no_grad():
        yield
