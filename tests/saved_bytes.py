"""The bytes of activations autograd keeps for backward, live and at their peak, read through saved_tensors_hooks:

    saved = SavedBytes(weights=model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, SavedBytes.unpack):
        loss = model(x)
    saved.peak
"""

from __future__ import annotations

import weakref

import torch


class SavedBytes:
    """Tensors sharing storage with `weights` (parameters autograd keeps) are not activations and are not counted."""

    def __init__(self, weights=()):
        self.live = self.peak = 0
        self.weights = {w.untyped_storage().data_ptr() for w in weights}

    def pack(self, tensor: torch.Tensor) -> "_Box":
        box = _Box(tensor)
        if tensor.untyped_storage().data_ptr() in self.weights:
            return box
        nbytes = tensor.numel() * tensor.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self._free, nbytes)  # counted until autograd drops what it kept
        return box

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    @staticmethod
    def unpack(box: "_Box") -> torch.Tensor:
        return box.tensor


class _Box:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
