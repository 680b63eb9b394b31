"""A token language model's training inputs, as the memory estimate and the pipeline's block timing make them.

The example GPT takes (ids, targets) positionally; a Hugging Face causal LM takes input_ids= and labels= (it
shifts the labels itself). Both read their context length from the config.
"""

from __future__ import annotations

import torch
from torch import nn

SEQ_LEN_KEYS = ("block_size", "n_positions", "max_position_embeddings")  # GPT, GPT-2, Llama and most others
LONGEST_DEFAULT_SEQ_LEN = 2048


def config_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size in the model's config; None for a model without one (not a token language model)."""
    value = getattr(getattr(model, "config", None), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def config_seq_len(model: nn.Module) -> int | None:
    """The context length in the model's config, at most LONGEST_DEFAULT_SEQ_LEN; None when it has none."""
    config = getattr(model, "config", None)
    for name in SEQ_LEN_KEYS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, LONGEST_DEFAULT_SEQ_LEN)
    return None


def token_model_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[tuple, dict]:
    """(args, kwargs) of a training forward of a token language model with `ids` as both inputs and labels."""
    if type(model).__module__.startswith("transformers."):
        return (), {"input_ids": ids, "labels": ids}
    return (ids, ids), {}
