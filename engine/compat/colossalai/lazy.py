"""colossalai.lazy.LazyInitContext. ColossalAI records the model's initialization and replays it where boost()
places each tensor; here the model is built inside the context as it would be outside it (every tensor made at
once, on the CPU or `default_device`), and boost() shards it as it shards any model. The weights are the same;
only the building peak differs (Tiers' own engine.zero_init builds a ZeRO-3 model shard by shard)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class LazyInitContext:
    def __init__(self, tensor_cls=None, default_device=None):
        self.default_device = torch.device(default_device) if default_device is not None else None
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "LazyInitContext":
        if self._stack is not None:
            raise RuntimeError("LazyInitContext is not re-entrant (as in ColossalAI)")
        self._stack = contextlib.ExitStack()
        if self.default_device is not None:
            self._stack.enter_context(self.default_device)
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        stack.close()

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """The module, whose tensors are all made already."""
        return module
