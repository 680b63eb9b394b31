"""The transformers model a user's model is, or wraps (a PEFT model), for the features that follow transformers'
conventions: labels shifted inside the model, attention through AttentionInterface, a key/value cache."""

from __future__ import annotations

from torch import nn


def transformers_model(model: nn.Module) -> nn.Module | None:
    """`model` itself when it is a transformers model, else the model a PEFT wrapper wraps (get_base_model), else
    None; a transformers module elsewhere inside (a small encoder beside the user's own layers) does not count."""
    candidates = [model]
    if callable(getattr(model, "get_base_model", None)):
        candidates.append(model.get_base_model())
    return next((m for m in candidates if type(m).__module__.startswith("transformers.")
                 and hasattr(getattr(m, "config", None), "_attn_implementation")), None)
