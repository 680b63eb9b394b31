"""fp32 master weights for parameter chunks kept in a 16-bit compute dtype (bf16 / fp16).

Note [master weights]
With `bf16` or `fp16` enabled, parameter and gradient chunks hold the compute dtype (2 bytes per
element), so the model runs on 16-bit weights and autograd writes 16-bit gradients into the
chunks. The optimizer steps fp32 masters instead: one per stepped tensor (the whole chunk, or this
rank's shard of it once optimizer states are sharded — the masters are optimizer state, kind
OPTIM in Note [sharding policy]). That is the ZeRO paper's 2Ψ + 2Ψ + 12Ψ split (fp32 master,
exp_avg, exp_avg_sq). At each update:
- `stage_grads`: each master's .grad, an fp32 tensor whose storage is empty between updates, is
  filled from its 16-bit gradient (unscaling, the norm and clipping then work in fp32);
- the optimizer steps the masters;
- `update_params` rounds the masters into the 16-bit tensors the model uses, which are then
  all-gathered as usual (half the bytes of fp32);
- `drop_grads` empties the fp32 gradients again.
As in DeepSpeed, the masters start as the 16-bit weights widened (`sync_from_params`, once every
rank holds its starting values). fp32 runs have no masters: their chunks are stepped directly.

Note [offloaded master weights]
With `offload_optimizer` the masters are optimizer state like Adam's moments (kind OPTIM, Note
[offload policy]), so they live in the same ChunkManager, one "master" chunk per stepped tensor,
homed with the states (as ZeRO-Offload keeps fp32 masters beside Adam on the CPU); the master
tensors become placeholders (storage of size 0, as offloaded parameter shards are). The offloaded
optimizer then steps each master's manager view and rounds it into its 16-bit tensor at once
(which may itself be in the manager: Note [offloaded parameter shards]), so no update holds more
than one tensor's fp32 values outside the manager. When the gradient shards are in the manager too
(stage 2-3: Note [offloaded gradient shards]) they stay 16-bit there, and the step widens each one
as it steps it, instead of staging fp32 gradients for every master before the update. Bytes per
parameter, stage 3 with parameters offloaded over N ranks: 2/N (16-bit parameter shard) + 2/N
(16-bit gradient shard) + 12/N (fp32 master, exp_avg, exp_avg_sq), all of it on the offload tier;
the compute device holds the gathered 16-bit chunks of the modules running and the CPU a window of
the streamed chunks. Every access to a master (checkpoints, full_state_dict, gathered_parameters)
goes through `master(index, writes)`, wherever it lives.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from engine.zero.shard_store import MemoryStore, ShardStore, manage
from offload.chunk import Location
from offload.manager import ChunkManager


class MasterWeights:
    """fp32 masters of the 16-bit tensors an optimizer would otherwise step, with fp32 gradients."""

    def __init__(self, targets: list[torch.Tensor], grad_sources: list[torch.Tensor], placeholders: bool = False):
        """targets[i]: the 16-bit tensor master i stands for; grad_sources[i]: its 16-bit gradient; placeholders:
        the masters have no storage from the start, for a chunk manager to hold them (Note [a bounded start]).
        Each tensor without storage is released as soon as it is made: never more than one at a time."""
        self.targets = targets
        self.grad_sources = grad_sources
        # where each master's values live (Note [shard stores])
        self.stores: list[ShardStore] = [MemoryStore(_made_empty(t.shape, t.device, placeholders)) for t in targets]
        self.masters = [store.tensor for store in self.stores]
        self.grads = [_made_empty(g.shape, g.device, True) for g in grad_sources]
        self._grad_nbytes = [g.numel() * 4 for g in self.grads]
        self.offloaded = False  # Note [offloaded master weights]: the stores are manager chunks
        self._target_access: Callable[[int, bool], ContextManager[tuple[torch.Tensor, Location]]] | None = None

    def offload_to(self, manager: ChunkManager, homes: list[Location],
                   target_access: Callable[[int, bool], ContextManager[tuple[torch.Tensor, Location]]] | None) -> None:
        """Note [offloaded master weights]: master i moves into `manager` on homes[i] (as zeros: `sync_from_params`
        writes them) and becomes a placeholder; `target_access(i, writes)` gives 16-bit tensor i wherever it lives,
        with its tier (None: the targets are the in-memory tensors, on the device)."""
        self._target_access = target_access
        # zeros, without a payload or a file, until written
        self.stores = [manage(store, manager, "master", home) for store, home in zip(self.stores, homes)]
        self.offloaded = True

    @property
    def handles(self) -> list[int] | None:
        """The masters' manager chunks (Note [offloaded master weights]); None while in memory."""
        return [store.handle for store in self.stores] if self.offloaded else None

    def master(self, index: int, writes: bool) -> ContextManager[torch.Tensor]:
        """Master `index`, wherever it lives, for the duration of the block."""
        return self.stores[index].access(writes)

    @contextlib.contextmanager
    def target(self, index: int, writes: bool):
        """The 16-bit tensor master `index` stands for, wherever it lives."""
        with self.placed_target(index, writes) as (tensor, _):
            yield tensor

    def placed_target(self, index: int, writes: bool) -> ContextManager[tuple[torch.Tensor, Location]]:
        """The 16-bit tensor master `index` stands for and the tier it is on (DEVICE: in memory)."""
        if self._target_access is None:
            return contextlib.nullcontext((self.targets[index], Location.DEVICE))
        return self._target_access(index, writes)

    def sync_from_params(self) -> None:
        """Masters := their 16-bit tensors, widened."""
        with torch.no_grad():
            for i in range(len(self.masters)):
                with self.target(i, writes=False) as target, self.master(i, writes=True) as master:
                    master.copy_(target)

    def stage_grads(self) -> None:
        with torch.no_grad():
            for grad, source, nbytes in zip(self.grads, self.grad_sources, self._grad_nbytes):
                grad.untyped_storage().resize_(nbytes)
                grad.copy_(source)

    def update_params(self) -> None:
        """16-bit tensors := their masters, rounded."""
        with torch.no_grad():
            for i in range(len(self.masters)):
                with self.master(i, writes=False) as master, self.target(i, writes=True) as target:
                    target.copy_(master)

    def drop_grads(self) -> None:
        for grad in self.grads:
            grad.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        """Bytes of the masters held in memory (offloaded ones are counted by their manager)."""
        return sum(m.untyped_storage().nbytes() for m in self.masters)


def _made_empty(shape: torch.Size, device: torch.device, released: bool) -> torch.Tensor:
    """An uninitialized fp32 tensor; released: its storage freed at once (resize_ gives it back when needed)."""
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if released:
        t.untyped_storage().resize_(0)
    return t
