"""Moving the model states off the compute device between phases and back (DeepSpeed's offload_states /
reload_states): RLHF frameworks free the device for generation or another model this way.

Note [states moved off the device]
Every state lives in storages that parameters, gradients, chunk views and optimizer states alias, so a state is
moved by its storage, not by its tensors: the storage's bytes are copied to a host buffer and the storage is
resized to nothing (its device memory freed); reloading resizes it back and copies the bytes in. Every tensor
aliasing it is then valid again, unchanged, and training goes on bit for bit. A storage shared by two kinds (with
one rank, a stage-3 shard is its chunk) moves once. Where the device is the host (Note [separate device memory])
nothing moves: the states are in host memory already. While moved, the states hold no memory, so the engine
refuses a forward, backward, step, zero_grad and saving or loading until they are reloaded.
"""

from __future__ import annotations

import enum

import torch

from engine.zero.chunked_params import ChunkedParams


class StateKind(enum.Enum):
    """DeepSpeed's OffloadStateTypeEnum values, as Tiers holds them."""

    OPTIM_STATES = "optim_states"  # the optimizer's in-memory states (not those an offloaded optimizer pages)
    HP_PARAMS = "hp_params"  # fp32 masters of 16-bit parameters
    LP_PARAMS = "lp_params"  # the parameters' chunks (and, under stage 3, their shards)
    LP_GRADS = "lp_grads"  # gradient shards (stages 2-3) and the masters' fp32 gradients
    CONTIGUOUS_GRAD_BUFFER = "contiguous_grad_buffer"  # the whole gradient chunks backward fills


def kind_tensors(kind: StateKind, chunked: ChunkedParams, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The in-memory tensors holding `kind`."""
    if kind is StateKind.OPTIM_STATES:
        if getattr(optimizer, "manager", None) is not None:
            return []  # an offloaded optimizer's states are its chunk manager's, homed off the device already
        return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    if kind is StateKind.HP_PARAMS:
        return list(chunked.masters.masters) if chunked.has_masters else []
    if kind is StateKind.LP_PARAMS:
        shards = [s.param_shard for s in chunked.all_states] if chunked.gathers_params else []  # frozen ones too
        return chunked.param_payloads() + shards
    if kind is StateKind.LP_GRADS:
        shards = list(chunked.sharded_grads.shards) if chunked.shards_grads else []
        return shards + (list(chunked.masters.grads) if chunked.has_masters else [])
    return chunked.grad_payloads()


class MovedStates:
    """The storages moved to the host, with their bytes, until they are put back."""

    def __init__(self) -> None:
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (device storage, its bytes on the host)
        self.kinds: set[StateKind] = set()

    @property
    def any(self) -> bool:
        return bool(self.kinds)

    def move_off(self, kinds: list[StateKind], chunked: ChunkedParams, optimizer, pin_memory: bool) -> None:
        """Copies each storage of `kinds` still on the device to the host and frees it on the device."""
        pin = pin_memory and torch.cuda.is_available()  # pinning needs an accelerator runtime
        seen = {device.data_ptr() for device, _ in self._moved}
        for kind in kinds:
            self.kinds.add(kind)
            for tensor in kind_tensors(kind, chunked, optimizer):
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue  # released (nothing to keep), or moved already with another kind
                seen.add(storage.data_ptr())
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
                host.copy_(_bytes_of(storage))
                storage.resize_(0)
                self._moved.append((storage, host))

    def put_back(self) -> None:
        """Every moved storage at its size again, holding its bytes."""
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host)
        self._moved.clear()
        self.kinds.clear()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as a byte tensor on its device (a tensor copy crosses devices; a storage copy need not)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
