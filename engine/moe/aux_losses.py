"""Router losses the engine adds to the user's loss (moe.aux_loss_coef / z_loss_coef on engine.moe.MoE layers).

The layers put their weighted terms here during a training forward run through the engine; engine.backward adds
them to the loss before scaling it, so they are scaled, averaged over micro-batches and reduced exactly as the
loss is. A forward run again in backward (activation checkpointing) adds nothing: the sink only takes terms
while the engine's forward runs. Every training forward since the last backward adds its terms to that backward
(several forwards whose losses one backward sums all count); a forward whose loss is dropped without a backward
leaves its terms for the next one, so skip a step after engine.backward, not between forward and backward.
"""

from __future__ import annotations

import contextlib

import torch


class AuxLossSink:
    def __init__(self):
        self._open = False
        self._terms: list[torch.Tensor] = []

    @contextlib.contextmanager
    def collecting(self):
        previous, self._open = self._open, torch.is_grad_enabled()
        try:
            yield
        finally:
            self._open = previous

    def add(self, term: torch.Tensor) -> None:
        if self._open:
            self._terms.append(term)

    def take(self) -> torch.Tensor | None:
        """The sum of the terms since the last take (None: none), which are then dropped."""
        terms, self._terms = self._terms, []
        return torch.stack([t.float() for t in terms]).sum() if terms else None
