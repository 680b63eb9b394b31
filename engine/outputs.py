"""The loss in a forward's output: a scalar tensor, the `loss` of a mapping (Hugging Face outputs), or the first
element of a tuple (Hugging Face's return_dict=False)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def _is_loss(value) -> bool:
    return torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()


def find_loss(output) -> torch.Tensor | None:
    if _is_loss(output):
        return output
    if isinstance(output, Mapping) and _is_loss(output.get("loss")):
        return output["loss"]
    if isinstance(output, tuple) and output and _is_loss(output[0]):
        return output[0]
    return None


def replace_loss(output, change: Callable[[torch.Tensor], torch.Tensor]):
    """`output` with its loss replaced by `change(loss)`; an output without a loss as it is."""
    if _is_loss(output):
        return change(output)
    if isinstance(output, Mapping) and _is_loss(output.get("loss")):
        output["loss"] = change(output["loss"])  # (Hugging Face outputs keep .loss in step)
    elif isinstance(output, tuple) and output and _is_loss(output[0]):
        output = (change(output[0]),) + output[1:]
    return output
