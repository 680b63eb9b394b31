"""The model's list of repeated blocks (its layers), which activation checkpointing wraps and a pipeline cuts."""

from __future__ import annotations

from torch import nn


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, list) of the model's largest ModuleList whose children are all of one class; largest by the
    parameters it holds, then by length (so a model's layers win over one layer's list of experts). None when
    the model has none."""
    best, best_size = None, (0, 0)
    for name, m in model.named_modules():
        kinds = {type(c) for c in m.children()}
        if isinstance(m, nn.ModuleList) and len(kinds) == 1 and not issubclass(*kinds, (nn.ModuleList, nn.ModuleDict)):
            size = (sum(p.numel() for p in m.parameters()), len(m))
            if best is None or size > best_size:
                best, best_size = (name, m), size
    return best
