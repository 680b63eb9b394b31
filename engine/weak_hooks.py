"""Parameter hooks that hold their owner weakly.

Note [weak parameter hooks]
A hook registered on a parameter lives in the parameter's autograd metadata, which Python's garbage
collector does not traverse once C++ also holds the tensor (a chunk view, a parameter the autograd graph
has seen). A hook holding its owner strongly then closes a cycle no collection breaks:
parameter → hook → owner → engine → model → parameter. A dropped engine kept its model, its chunks and
its process groups to interpreter exit, where gloo's threads were torn down during finalization and could
abort the process ("terminate called without an active exception", tests/test_shutdown.py). So every hook
on a parameter reaches its owner, and any tensor it is bound to, through weak references; once they are
gone the hook does nothing.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class WeakMethodHook:
    """Calls `method(*bound, *hook_args)` while the method's object and the `bound` tensors are alive; returns
    None (leaves the gradient as it is) once any of them is gone."""

    def __init__(self, method: Callable, *bound: torch.Tensor):
        self._method = weakref.WeakMethod(method)
        self._bound = tuple(weakref.ref(t) for t in bound)

    def __call__(self, *hook_args):
        method = self._method()
        bound = tuple(ref() for ref in self._bound)
        if method is None or any(t is None for t in bound):
            return None
        return method(*bound, *hook_args)
