"""The engine's model states as a checkpoint reads and writes them: per chunk, this rank's values and optimizer states.

Note [checkpoint layout]
A checkpoint stores what each rank steps, chunk by chunk (Note [sharding policy]): for chunk i of a
tensor-parallel rank's chunk list, the rank's stepped range of elements [start, start + n) — the
whole chunk when optimizer states are not sharded (stage 0: data-parallel rank 0 writes it), else
its shard — as fp32 values (the masters under bf16 / fp16, Note [master weights]) and each
optimizer state tensor of the same shape (Adam's exp_avg, exp_avg_sq; the scalar "step" beside
them). The manifest records every chunk's parameters (name, offset, shape) and how the tensor-
parallel plan cut each one (Note [tensor-parallel plans]), so a parameter's elements can be found
in the files whatever layout later reads them: that is what makes resharding (another dp, tp,
stage or offload) and consolidation (`tiers convert`) possible without a conversion step.
Gradients are not saved: a checkpoint is taken at an accumulation boundary, where they are zero.
Parameters outside chunks (frozen ones) and buffers are saved whole by data-parallel rank 0 of
each tensor-parallel rank ("extra" entries).
Under a pipeline (layout "pp" > 1, manifest version 2) each pipeline rank has chunk lists of its
own, and so its own sections: "chunks", "extras", "param_groups" and "lr_scheduler" become lists by
pipeline rank (its optimizer has the param groups of the parameters it holds). Chunk members carry
their names in the whole model (Note [pipeline stages of an unmodified model]), so a name is found in
whichever stage's files hold it; a tied weight two stages hold is saved by both and read from the
first. "state_dict_keys" are the unsplit model's, and "aliases" every stage's, including a stage's
later key for a tied weight it holds (the last stage's lm_head.weight -> wte.weight).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from engine.comm import shard_range
from engine.zero.chunked_params import ChunkedParams


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # element offset in the chunk
    shape: tuple[int, ...]
    base: int = 0  # a fused expert tensor's slice: the element of the whole tensor it starts at
    whole: tuple[int, ...] | None = None  # and the whole tensor's shape (Note [expert parallelism])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return self.whole if self.whole is not None else self.shape

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Chunk elements [lo, hi) of this member as elements of the whole tensor."""
        return self.base + lo - self.offset, self.base + hi - self.offset

    def record(self) -> list:
        """As the manifest lists it: [name, offset, shape] (and [base, whole shape] for an expert slice)."""
        extent = [self.base, list(self.whole)] if self.whole is not None else []
        return [self.name, self.offset, list(self.shape), *extent]


class LiveStates:
    """Access to one rank's chunked states (values, optimizer states) wherever they live: in memory, as a stage-3
    shard, or in the offloaded optimizer's chunk manager (CPU or NVMe)."""

    def __init__(self, chunked: ChunkedParams, optimizer: torch.optim.Optimizer,
                 extents: dict[int, tuple[int, tuple[int, ...]]] | None = None):
        """extents: id(parameter) -> (base, whole shape) of fused expert tensors holding this rank's experts."""
        self.chunked = chunked
        self._extents = extents or {}
        self.optimizer = optimizer
        self._stepped = chunked.stepped_tensors()
        self._offloaded = hasattr(optimizer, "accessed_state")  # Note [offloaded optimizer states]
        stepped = {id(t) for t in self._stepped}
        if not self._offloaded and any(id(p) not in stepped for g in optimizer.param_groups for p in g["params"]):
            raise NotImplementedError(
                f"checkpointing the {type(optimizer).__name__} passed to initialize() is not supported yet at ZeRO "
                "stage 0 in fp32: it steps the model's parameters rather than their chunks, so its states cannot be "
                "found by chunk; give the optimizer in the config's 'optimizer' section (or use stage >= 1)")

    def __len__(self) -> int:
        return self.chunked.chunk_count()

    def members(self, index: int) -> list[Member]:
        return [Member(self.chunked.name_of(p), slot.offset, tuple(slot.shape), *self._extents.get(id(p), (0, None)))
                for p, slot in self.chunked.chunk_members(index)]

    def is_expert(self, index: int) -> bool:
        """Chunk `index` holds experts: reduced and sharded over its own group (Note [expert parallelism])."""
        return self.chunked.states[index].place.group is not None

    def shard_count(self, index: int) -> int:
        return self.chunked.states[index].place.count

    def chunk_numel(self, index: int) -> int:
        return self.chunked.chunk_numel(index)

    def stepped_range(self, index: int) -> tuple[int, int]:
        """(first element, count) of chunk `index` this rank steps."""
        place = self.chunked.states[index].place
        return shard_range(self.chunk_numel(index), place.rank, place.count)

    @contextlib.contextmanager
    def values(self, index: int, writes: bool):
        """This rank's stepped elements of chunk `index`, fp32 (a master under bf16 / fp16), for the block."""
        chunked = self.chunked
        if chunked.masters is not None:
            with chunked.masters.master(index, writes=writes) as master:  # maybe offloaded
                yield master
        elif chunked.sharded_params is not None:
            with chunked.sharded_params.shard(index, writes=writes) as shard:  # maybe offloaded
                yield shard
        else:
            yield self._stepped[index]

    @property
    def values_offloaded(self) -> bool:
        """Whether `values` may be views of a chunk manager's buffers (valid only inside the block)."""
        chunked = self.chunked
        return chunked.masters.offloaded if chunked.masters is not None else chunked.sharded_params is not None

    @contextlib.contextmanager
    def optimizer_state(self, index: int, writes: bool):
        """The optimizer's state tensors of chunk `index` by name ({} before a torch optimizer's first step)."""
        if self._offloaded:
            with self.optimizer.accessed_state(index, writes) as state:
                yield state
            return
        state = self.optimizer.state.get(self._stepped[index], {})
        yield {k: v for k, v in state.items() if torch.is_tensor(v)}

    def install_optimizer_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Loading into a torch optimizer: its states replaced by `states` (chunk index -> name -> tensor), placed as
        torch places loaded states (Optimizer.load_state_dict: the parameter's device and dtype, "step" as is)."""
        saved = self.optimizer.state_dict()
        saved["state"] = states
        self.optimizer.load_state_dict(saved)

    def finish_loading(self) -> None:
        """After values were written: 16-bit parameters from their masters; the full chunks from the shards are the
        caller's (an all-gather, as after every update)."""
        if self.chunked.masters is not None:
            self.chunked.masters.update_params()

    @property
    def offloaded(self) -> bool:
        return self._offloaded
