"""The pass on a real model: a tiny Hugging Face Llama in bf16, built from a config
(no downloads), compiled together with its loss (`ForCausalLMLoss`)."""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.numerics import assert_stock_logits

transformers = pytest.importorskip("transformers")

V = 4096


@pytest.fixture(scope="module")
def model():
    # one decoder layer: the tests are about the lm_head and the loss, which a second layer
    # leaves as they are (it only added its kernels to every compile)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def batch(B=2, S=48):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt that is not trained on
    return ids, labels


# (make test-full; make test: the SFT example, ForCausalLMLoss with labels, in test_examples)
@pytest.mark.full
def test_model_with_labels_fires_on_its_loss(model):
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels)
    stock = torch.compile(model, backend="inductor")(input_ids=ids, labels=labels)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="chunked_logits")(input_ids=ids, labels=labels)
    c = counters["chunked_logits"]
    assert c["rewritten"] == 1, dict(c)
    # the model returns its logits too: the chunk loop writes them (tests/test_lm_head.py has
    # the numerics, and the backward with and without the logits' gradient)
    assert c["lm_head_fused"] == 1 and c["lm_head_returns_logits"] == 1, dict(c)
    assert torch.allclose(out.loss, ref.loss, atol=2e-2)
    assert_stock_logits(out.logits, stock.logits)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-1, rtol=1e-2)


def test_training_step_without_logits_fuses_the_lm_head(model):
    ids, labels = batch()

    def step(ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    model.zero_grad()
    stock_loss = torch.compile(step, backend="inductor")(ids, labels)
    stock_grad = model.model.embed_tokens.weight.grad.clone()  # tied with lm_head
    torch._dynamo.reset()
    counters.clear()
    model.zero_grad()
    loss = torch.compile(step, backend="chunked_logits")(ids, labels)
    grad = model.model.embed_tokens.weight.grad
    c = counters["chunked_logits"]
    assert c["rewritten"] == 1 and c["lm_head_fused"] == 1, dict(c)
    assert torch.allclose(loss, stock_loss, atol=1e-3)
    # tied weights: the lm_head gradient and the embedding gradient add up in bf16
    assert (grad.float() - stock_grad.float()).abs().max() <= 2e-2 * stock_grad.float().abs().max()
