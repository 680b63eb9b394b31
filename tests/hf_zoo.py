"""Tiny causal LMs built from Hugging Face config classes (no download), each with every architectural feature it has
switched on and active at the tests' sequence length: sliding windows shorter than the sequence, per-layer attention
types, softcapping, partial rotary, q/k norms, fused and sliced projections, parallel residuals, ALiBi, learned
positions, NoPE layers, scaled embeddings and logits, tied embeddings, MoE routing with shared experts.

Dropout is off everywhere (each strategy would draw other masks), and so are the MoE auxiliary losses: a router loss
taken over each rank's tokens is data parallelism's own definition, not one process's (tests/test_moe_composition.py
holds those to their per-rank reference)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

VOCAB, SEQ, WINDOW = 256, 32, 16  # every window below is WINDOW < SEQ
LAYERS = 3  # an odd cut: a later stage's first layer is not the model's (per-layer attention types follow it)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
MOE = dict(num_experts_per_tok=2, output_router_logits=False)


def _configs(t) -> dict[str, Callable[[], object]]:
    """name -> config factory (t: the transformers module)."""
    return {
        "llama": lambda: t.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
        "qwen2": lambda: t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=WINDOW),
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "phi3": lambda: t.Phi3Config(**COMMON, sliding_window=WINDOW, partial_rotary_factor=0.5,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gpt_neox": lambda: t.GPTNeoXConfig(**_no_kv(COMMON), rotary_pct=0.25, use_parallel_residual=True),
        "opt": lambda: t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, max_position_embeddings=2 * SEQ, word_embed_proj_dim=32,
                                   dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2),
        "falcon": lambda: t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                         max_position_embeddings=2 * SEQ, bias=True),
        "falcon_alibi": lambda: t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS,
                                               num_attention_heads=4, multi_query=True, alibi=True,
                                               parallel_attn=True),
        "bloom": lambda: t.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=LAYERS, n_head=4),
        "gptj": lambda: t.GPTJConfig(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=64, n_layer=LAYERS, n_head=4,
                                     rotary_dim=8, n_inner=128),
        "stablelm": lambda: t.StableLmConfig(**COMMON, partial_rotary_factor=0.25, qk_layernorm=True,
                                             use_parallel_residual=True, use_qkv_bias=True),
        "olmo2": lambda: t.Olmo2Config(**COMMON, pad_token_id=0, eos_token_id=1),
        "starcoder2": lambda: t.Starcoder2Config(**COMMON, sliding_window=WINDOW, use_bias=True),
        "phi": lambda: t.PhiConfig(**COMMON, partial_rotary_factor=0.5, qk_layernorm=True),
        "granite": lambda: t.GraniteConfig(**COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                                           attention_multiplier=0.2, logits_scaling=4.0),
        "smollm3": lambda: t.SmolLM3Config(**COMMON, no_rope_layer_interval=2, use_sliding_window=True,
                                           sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "mixtral": lambda: t.MixtralConfig(**COMMON, **MOE, num_local_experts=4, sliding_window=WINDOW),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, use_sliding_window=True,
                                              sliding_window=WINDOW, max_window_layers=1),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16, num_experts=4, moe_intermediate_size=32,
                                              norm_topk_prob=True, mlp_only_layers=[1]),
        "olmoe": lambda: t.OlmoeConfig(**COMMON, **MOE, num_experts=4, clip_qkv=8.0, pad_token_id=0,
                                       eos_token_id=1),
    }


def _no_kv(common: dict) -> dict:
    return {k: v for k, v in common.items() if k != "num_key_value_heads"}


MOE_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def names() -> list[str]:
    import transformers

    return list(_configs(transformers))


def build(name: str, seed: int = 0) -> nn.Module:
    """The model `name`, its weights drawn under `seed`."""
    import transformers

    config = _configs(transformers)[name]()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def hf_loss(model_or_engine, x: torch.Tensor) -> torch.Tensor:
    return model_or_engine(input_ids=x, labels=x).loss
