"""Every hook ZeRO installs on the model, its parameters and its activations, registered in one place.

Note [zero hooks]
ZeRO's runtime reaches into a training step only through hooks, and all of them are registered by one
ZeroHooks object, which the runtime removes at once when the engine closes:
- around each module that owns parameters of gathered chunks (stage 3), a forward pre-hook and a
  forward hook (Note [gathering around modules]);
- on each trainable parameter, a post-accumulate-grad hook that hands its gradient to its chunk and
  schedules reductions (Note [reduction order]); it holds its owner weakly (Note [weak parameter hooks]);
- during a pass, gradient hooks on activations (a module's outputs, a leaf's inputs) that gather chunks
  again for backward: they live as long as the autograd graph that holds them, so nothing removes them.
Who owns what runs in a hook stays with the schedulers (the gatherer, the reducer); what is hooked, how
it is held, and its removal are here.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from engine.weak_hooks import WeakMethodHook


class ZeroHooks:
    """Registers every hook ZeRO installs and removes the lasting ones together (Note [zero hooks])."""

    def __init__(self):
        self._handles = []

    def around_forward(self, module: nn.Module, before: Callable, after: Callable) -> None:
        """before(module, args) runs ahead of the module's forward, after(module, args, output) once it returns."""
        self._handles.append(module.register_forward_pre_hook(before))
        self._handles.append(module.register_forward_hook(after))

    def on_grad_accumulated(self, params: list[nn.Parameter], method: Callable) -> None:
        """method(p) runs once autograd has accumulated a gradient into p.grad; the hook holds the method's object
        weakly (Note [weak parameter hooks])."""
        hook = WeakMethodHook(method)
        self._handles += [p.register_post_accumulate_grad_hook(hook) for p in params]

    @staticmethod
    def on_grads(tensors: list[torch.Tensor], fn: Callable, mode: str) -> None:
        """fn(grads) runs once backward computed the gradient of any (mode "any") or all ("all") of `tensors`;
        lives as long as the autograd graph holding them."""
        register_multi_grad_hook(tensors, fn, mode=mode)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
