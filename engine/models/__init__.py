"""Example model (a byte-level GPT), its data pipeline, and a token language model's training inputs (inputs).

Stands alone: depends only on torch and the Python standard library.
"""

from engine.models.data import TokenBatches, default_corpus_bytes, load_corpus
from engine.models.gpt import (
    GPT,
    MLP,
    PRESETS,
    Block,
    CausalSelfAttention,
    GPTConfig,
    gpt_bench30m,
    gpt_from_preset,
    gpt_small,
    gpt_tiny,
    preset_config,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "PRESETS",
    "preset_config",
    "gpt_from_preset",
    "gpt_tiny",
    "gpt_small",
    "gpt_bench30m",
    "TokenBatches",
    "default_corpus_bytes",
    "load_corpus",
]
