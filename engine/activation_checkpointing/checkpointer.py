"""Activation checkpointing: torch's non-reentrant checkpoint with the engine's RNG streams, saved-input
placement and recompute timing, applied to chosen modules or called by the user.

Note [activation checkpointing]
A checkpointed module keeps only its inputs from the forward; backward runs its forward again
(the recompute) to rebuild what its own backward needs. torch.utils.checkpoint (non-reentrant)
does the work; the engine adds:
- where it applies: the config's `modules` (class names or name globs) or, by default, the
  children of the model's largest ModuleList of same-class modules (the transformer blocks),
  every `every_n`-th of them. The module's own `forward` is replaced on the instance (a method
  bound to it, so a deepcopy of the model runs its own weights), not the module by a wrapper, so
  state-dict keys, tp-plan globs and ZeRO hooks see the model unchanged, and hooks on the module
  itself stay outside the checkpoint (they do not run twice);
- the same dropout masks in the recompute: torch restores the default generator and the
  generator of every device among the positional arguments (so on CUDA an empty device tensor is
  always passed along: inputs given as keyword arguments are not seen); under tensor parallelism
  the per-rank stream lives outside them (Note [tensor-parallel RNG]), so the streams' state at
  the forward is put back for the recompute and the current state after it;
- ZeRO-3 needs nothing more: the recompute runs inside backward, where the gatherer gathers a
  module's chunks on demand and leaves them to backward's release (Note [gathering around modules]);
- partition_activations / cpu_checkpointing: Note [saved inputs of a checkpoint];
- profile: the time spent recomputing (wall clock; the device is synchronized around it), for
  the monitor; synchronize_checkpoint_boundary: the device is synchronized at both ends of every
  checkpointed forward.
A key/value cache (Hugging Face use_cache=True) would be updated a second time by the recompute: as
transformers does under its own gradient checkpointing, a checkpointed module is called with use_cache False
and without the cache, given by keyword or by position (a module that only reads it,
`_can_checkpoint_with_cache`, keeps it), and the run says so once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from engine.activation_checkpointing.saved_inputs import InputStore
from engine.activation_checkpointing.selection import select_modules
from engine.config_sections import ActivationCheckpointingConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.rng import RNGStreams

logger = logging.getLogger(__name__)
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")  # transformers' names over versions


class ActivationCheckpointing:
    """The run's checkpointing options; `checkpoint` is a drop-in for torch.utils.checkpoint.checkpoint."""

    def __init__(self, config: ActivationCheckpointingConfig, device: torch.device, streams: RNGStreams | None = None,
                 tp: TPGroup | None = None, recompute_context: Callable | None = None):
        """recompute_context: a context every recompute runs in besides the user's (sequence parallelism's split
        attention)."""
        self.config = config
        self.device = device
        self.streams = streams
        self.store = InputStore(device, tp if config.partition_activations else None, config.cpu_checkpointing)
        self.recompute_seconds = 0.0  # profile: summed over the run
        self.recomputes = 0
        self.wrapped: list[str] = []  # names of the modules whose forward is checkpointed
        self.recompute_context = recompute_context
        self.told_cache = False  # the cache taken out of a checkpointed call, said once

    # ---- modules --------------------------------------------------------------------------------
    def wrap_modules(self, model: nn.Module) -> list[str]:
        """Checkpoints the forward of the modules the config selects; returns their names."""
        for name, module in select_modules(model, self.config.modules, self.config.every_n):
            self._wrap(name, module)
        return self.wrapped

    def _wrap(self, name: str, module: nn.Module) -> None:
        if "forward" in vars(module):
            raise RuntimeError(f"{name} ({type(module).__name__}): its forward is already replaced on the instance "
                               "(checkpointed twice, or by another library); checkpoint it once")

        module.forward = CheckpointedForward(self, name, module)
        self.wrapped.append(name)

    def forward_of(self, name: str, owner: nn.Module, args: tuple, kwargs: dict):
        """A wrapped module's forward: checkpointed where autograd records."""
        forward = functools.partial(type(owner).forward, owner)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return self._run(forward, *self._without_cache(name, owner, args, kwargs), name)

    def _without_cache(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A checkpointed call's arguments without a key/value cache, as transformers' own checkpointing passes
        them (Note [activation checkpointing])."""
        reads_only = getattr(module, "_can_checkpoint_with_cache", False)
        positional = not reads_only and any(_is_cache(v) for v in args)
        taken = [k for k in CACHE_ARGUMENTS if not reads_only and _is_cache(kwargs.get(k))]
        other = [k for k, v in kwargs.items() if _is_cache(v) and k not in CACHE_ARGUMENTS and not reads_only]
        if other:
            raise RuntimeError(f"{name} ({type(module).__name__}) is checkpointed and was passed a key/value cache as "
                               f"{other[0]!r}, which its recompute would update a second time; train with "
                               "use_cache=False, or leave this module out of activation_checkpointing.modules")
        if not kwargs.get("use_cache") and not taken and not positional:
            return args, kwargs
        if not self.told_cache:
            self.told_cache = True
            logger.warning("activation checkpointing: %s (%s) was called with a key/value cache, which its "
                           "recompute would update a second time; it runs with use_cache=False and no cache, as "
                           "transformers does under gradient checkpointing (said once)", name, type(module).__name__)
        args = tuple(None if positional and _is_cache(v) else v for v in args)
        kwargs = {**kwargs, **dict.fromkeys(taken)}
        return args, ({**kwargs, "use_cache": False} if "use_cache" in kwargs else kwargs)

    # ---- the checkpoint -------------------------------------------------------------------------
    def checkpoint(self, function, *args, use_reentrant: bool | None = None, preserve_rng_state: bool = True,
                   context_fn=None, determinism_check: str = "default", debug: bool = False, early_stop: bool = True,
                   **kwargs):
        """`function(*args, **kwargs)`, checkpointed as torch.utils.checkpoint.checkpoint(use_reentrant=False)
        does, with the config's options (Note [activation checkpointing])."""
        if use_reentrant:
            raise ValueError("engine.checkpoint is non-reentrant only (the recompute runs inside the same "
                             "backward, which ZeRO-3 and tensor parallelism rely on); drop use_reentrant=True")
        if debug:
            raise ValueError("engine.checkpoint(debug=True) is not supported: torch's debug mode replaces the "
                             "context_fn that restores the engine's RNG streams; debug with "
                             "torch.utils.checkpoint.checkpoint directly")
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        site = getattr(function, "__qualname__", type(function).__name__)
        return self._run(function, args, kwargs, site, preserve_rng_state, context_fn, determinism_check, early_stop)

    def _run(self, function, args: tuple, kwargs: dict, site: str, preserve_rng_state: bool = True, context_fn=None,
             determinism_check: str = "default", early_stop: bool = True):
        def contexts():
            user_forward, user_recompute = context_fn() if context_fn is not None else (None, None)
            streams = self.streams.snapshot() if self.streams is not None and preserve_rng_state else None
            return self._forward_context(user_forward), _Recompute(self, user_recompute, streams)

        options = dict(use_reentrant=False, preserve_rng_state=preserve_rng_state, context_fn=contexts,
                       determinism_check=determinism_check, early_stop=early_stop)
        # torch restores the RNG of the devices among its positional arguments: name the device
        marker = [torch.empty(0, device=self.device)] if self.device.type == "cuda" else []
        eligible = [self.store.eligible(v) for v in (*args, *kwargs.values())] if self.store.active else []
        if not any(eligible):  # keyword arguments by closure, as torch keeps them: no name can clash
            count = len(args)
            return torch_checkpoint(lambda *a: function(*a[:count], **kwargs), *args, *marker, **options)
        # Note [saved inputs of a checkpoint]: the region keeps stand-ins, never the inputs themselves
        places = [("arg", i) for i in range(len(args))] + [("kw", k) for k in kwargs]
        values = [*args, *kwargs.values()]
        packed = [(place, *self.store.pack(value, site)) for place, value, ok in zip(places, values, eligible) if ok]
        kept_args = [None if e else v for v, e in zip(args, eligible)]
        kept_kwargs = {k: v for (k, v), e in zip(kwargs.items(), eligible[len(args):]) if not e}
        first_forward = {"inputs": [v for v, e in zip(values, eligible) if e]}
        del values

        def region(*payloads):
            inputs = first_forward.pop("inputs", None)  # None: this is the recompute
            call_args, call_kwargs = list(kept_args), dict(kept_kwargs)
            for n, ((kind, key), _, stored) in enumerate(packed):
                value = inputs[n].detach() if inputs is not None else self.store.restore(payloads[n], stored)
                value = self.store.rejoin(value, stored)
                if kind == "arg":
                    call_args[key] = value
                else:
                    call_kwargs[key] = value
            del inputs
            return function(*call_args, **call_kwargs)

        try:
            out = torch_checkpoint(region, *[payload for _, payload, _ in packed], *marker, **options)
        finally:
            first_forward.clear()
        self.store.copies_done([stored for *_, stored in packed])
        return out

    # ---- contexts -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _forward_context(self, user_context):
        self._synchronize(self.config.synchronize_checkpoint_boundary)
        with user_context if user_context is not None else contextlib.nullcontext():
            yield
        self._synchronize(self.config.synchronize_checkpoint_boundary)

    def _synchronize(self, wanted: bool) -> None:
        if wanted and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _Recompute:
    """The context torch enters around every recompute of one checkpoint (again for each backward through
    a retained graph): the tp streams as they were at the forward, and the recompute's time."""

    def __init__(self, owner: ActivationCheckpointing, user_context, streams_at_forward):
        self.owner, self.user_context, self.streams_at_forward = owner, user_context, streams_at_forward
        self._entered: list[tuple] = []  # (the streams' state before, start time) per entry

    def __enter__(self):
        owner = self.owner
        current = owner.streams.snapshot() if self.streams_at_forward is not None else None
        if self.streams_at_forward is not None:
            owner.streams.restore(self.streams_at_forward)
        owner._synchronize(owner.config.profile)
        stack = contextlib.ExitStack()
        self._entered.append((current, time.perf_counter(), stack))
        try:
            if owner.recompute_context is not None:
                stack.enter_context(owner.recompute_context())
            if self.user_context is not None:
                stack.enter_context(self.user_context)
        except BaseException:
            stack.close()
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        try:
            return bool(self._entered[-1][2].__exit__(*exc))
        finally:
            self._leave()

    def _leave(self) -> None:
        owner = self.owner
        current, start, _ = self._entered.pop()
        owner._synchronize(owner.config.profile)
        owner.recompute_seconds += time.perf_counter() - start
        owner.recomputes += 1
        if current is not None:
            owner.streams.restore(current)




def _is_cache(value) -> bool:
    return hasattr(value, "get_seq_length")  # a transformers Cache


class CheckpointedForward:
    """A module's `forward` attribute while it is checkpointed. It reaches its module weakly: the module holds it,
    and a bound method would be a reference cycle keeping a dropped model's memory until Python's cyclic collector
    runs. A deepcopy of the module gets one bound to the copy, as a bound method would be."""

    def __init__(self, checkpointing: ActivationCheckpointing, name: str, module: nn.Module):
        self._checkpointing, self._name, self._module = checkpointing, name, weakref.ref(module)

    @property
    def __self__(self) -> nn.Module:
        """The module, as a bound method's `__self__` is."""
        return self._module()

    def __call__(self, *args, **kwargs):
        return self._checkpointing.forward_of(self._name, self._module(), args, kwargs)

    def __deepcopy__(self, memo: dict) -> CheckpointedForward:
        module = self._module()
        return CheckpointedForward(self._checkpointing, self._name, memo.get(id(module), module))
