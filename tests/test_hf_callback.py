"""``fx_passes.SummaryCallback``: the summary in a Trainer's logs, once, as flat numbers."""

from __future__ import annotations

import pytest
import torch

import fx_passes

transformers = pytest.importorskip("transformers")


def logprob(logits, tokens):
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)


def test_callback_logs_the_summary_once():
    callback = fx_passes.SummaryCallback()
    assert isinstance(callback, transformers.TrainerCallback)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    logs = {"loss": 1.0}
    callback.on_log(None, state, control, logs=logs)
    assert logs == {"loss": 1.0}  # nothing compiled yet: nothing to say

    logits, tokens = torch.randn(4, 32).bfloat16(), torch.randint(0, 32, (4,))
    torch.compile(logprob, backend="chunked_logits")(logits, tokens)
    state.log_history.append({"loss": 0.5, "step": 1})
    logs = {"loss": 0.5}
    callback.on_log(None, state, control, logs=logs)
    want = {"chunked_logits/regions_rewritten": 1, "chunked_logits/regions_would_rewrite": 0,
            "chunked_logits/regions_left_to_stock": 0, "chunked_logits/regions_declined": 0,
            "chunked_logits/estimated_bytes_avoided": 4 * 4 * 32,
            "chunked_logits/graphs_compiled": 1, "chunked_logits/pass_failed": 0,
            "chunked_logits/near_misses": 0}
    assert logs == {"loss": 0.5, **want}
    assert state.log_history[-1] == {"loss": 0.5, "step": 1, **want}

    later = {"loss": 0.25}
    callback.on_log(None, state, control, logs=later)
    assert later == {"loss": 0.25}  # once
