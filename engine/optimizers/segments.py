"""Where each parameter lies inside the flat tensors an optimizer steps (chunk payloads)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segments:
    """Per stepped tensor (by id), the (offset, numel) of each parameter it holds. A tensor not listed is one
    parameter: itself, whole."""

    by_tensor: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def of(self, tensor: torch.Tensor) -> list[tuple[int, int]]:
        return self.by_tensor.get(id(tensor), [(0, tensor.numel())])

    def views(self, stepped: torch.Tensor, *alike: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per parameter inside `stepped` (padding left out), its flat view there and in each of `alike` (tensors
        laid out as `stepped`: its update, its states)."""
        flats = [t.view(-1) for t in (stepped, *alike)]
        return [tuple(f.narrow(0, offset, numel) for f in flats) for offset, numel in self.of(stepped)]
