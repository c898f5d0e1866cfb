"""Tiny decoder-only ``*ForCausalLM`` models of each transformers family, built from a config.

No downloads: each family is a config class, a model class and the few settings that
make it tiny (1 layer, hidden 64, 4 heads) or that its real checkpoints use where the
config's default would hide what the family does to its logits (Granite's
``logits_scaling`` defaults to 1; its released models divide by 8).  Classes are
looked up by name, so a family the installed transformers lacks is reported, not fatal.
"""

from __future__ import annotations

import torch

from fx_passes.testing.workloads import UpcastToFp64

__all__ = ["FAMILIES", "build_model", "make_batch", "logit_transform", "make_step", "reference", "errors"]

HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 128
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

# family -> (config class, model class, settings beyond the common tiny ones)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, **MOE}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "shared_expert_intermediate_size": 64, **MOE}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 16}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": 16}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
}

# GPT-2 names its sizes differently; every other family takes the common names.
GPT2_NAMES = {"n_embd": HIDDEN, "n_layer": None, "n_head": HEADS, "n_positions": None}


def _config(family: str, vocab: int, seq_len: int, layers: int):
    import transformers
    config_cls, _, extra = FAMILIES[family]
    cls = getattr(transformers, config_cls)
    if family == "gpt2":
        sizes = {**GPT2_NAMES, "n_layer": layers, "n_positions": seq_len}
    else:
        sizes = {"hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": layers,
                 "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS,
                 "max_position_embeddings": seq_len}
    # token ids 0-2 for pad/bos/eos: some defaults (Phi3's pad 32000) lie outside a small vocabulary
    specials = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return cls(vocab_size=vocab, **sizes, **specials, **extra)


def build_model(family: str, vocab: int, seq_len: int, layers: int = 1, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The family's tiny model with seeded weights, in ``dtype``, in train mode.

    Dropout is 0 in every family's defaults, so train mode changes nothing but the flag
    a training step would set.
    """
    import transformers
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILIES[family][1])
    model = model_cls(_config(family, vocab, seq_len, layers)).to(dtype)
    return model.train()


def make_batch(vocab: int, seq_len: int, batch: int = 1, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels): random tokens, the first eighth of each row a prompt (-100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[:, : seq_len // 8] = -100
    return ids, labels


def logit_transform(model: torch.nn.Module) -> str:
    """What the family does to the logits between the lm_head and the loss, from its config."""
    c = model.config
    if getattr(c, "final_logit_softcapping", None):
        return f"softcap tanh(x/{c.final_logit_softcapping:g})*{c.final_logit_softcapping:g}"
    if getattr(c, "logits_scaling", None) not in (None, 1.0):
        return f"x / {c.logits_scaling:g}"
    if getattr(c, "logit_scale", None) not in (None, 1.0):
        return f"x * {c.logit_scale:g}"
    return "none"


# how each mode of benchmarks/model_cases.py compiles the step (ref and trainer run elsewhere)
BACKEND = {"stock": "inductor", "chunked": "chunked_logits", "install": "inductor",
           "stock_nologits": "inductor", "chunked_nologits": "chunked_logits"}


def make_step(model, mode: str):
    """``step(ids, labels) -> (loss, model outputs or None)`` for ``mode``: forward, backward."""
    if mode == "install":
        import fx_passes
        fx_passes.install()
    if mode.endswith("_nologits"):
        def loss_only(ids, labels):
            return model(input_ids=ids, labels=labels).loss
        compiled = torch.compile(loss_only, backend=BACKEND[mode])

        def step(ids, labels):
            loss = compiled(ids, labels)
            loss.backward()
            return loss.detach(), None
        return step
    compiled = torch.compile(model, backend=BACKEND[mode])

    def step(ids, labels):
        # the outputs (logits included) stay alive until the step ends, as in a trainer
        out = compiled(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.detach(), out
    return step


def reference(model, ids, labels) -> dict:
    """Loss and parameter gradients of ``model`` in FP64, eager: the ground truth.

    MoE experts run one by one: ``grouped_mm``, their default, has no FP64 kernel.
    """
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    model = model.double()
    with UpcastToFp64():
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def errors(model, loss: torch.Tensor, ref: dict) -> dict:
    """|loss - FP64|, and per parameter max|grad - FP64| / max|FP64 grad| (lm_head's and the max)."""
    rel = {}
    for name, p in model.named_parameters():
        want = ref["grads"][name]
        rel[name] = ((p.grad.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    head = model.get_output_embeddings().weight
    head_name = next(n for n, p in model.named_parameters() if p is head)
    return {"loss": loss.item(), "loss_err": abs(loss.item() - ref["loss"]),
            "grad_err_head": rel[head_name], "grad_err_max": max(rel.values()),
            "grad_err_max_param": max(rel, key=rel.get)}
