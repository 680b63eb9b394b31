"""The engine's model states as a checkpoint reads and writes them: per chunk, this rank's values and optimizer states.

Note [checkpoint layout]
A checkpoint stores what each rank steps, chunk by chunk (Note [sharding policy]): for chunk i of a
tensor-parallel rank's chunk list, the rank's stepped range of elements [start, start + n) — the
whole chunk when optimizer states are not sharded (stage 0: data-parallel rank 0 writes it), else
its shard — as fp32 values (the masters under bf16 / fp16, Note [master weights]) and each
optimizer state tensor of the same shape (Adam's exp_avg, exp_avg_sq; the scalar "step" beside
them). The manifest records every chunk's parameters (name, offset, shape) and how the tensor-
parallel ranks cut each one (its placement's cut, Note [placements]), so a parameter's elements can be found
in the files whatever layout later reads them: that is what makes resharding (another dp, tp,
stage or offload) and consolidation (`tiers convert`) possible without a conversion step.
Gradients are not saved: a checkpoint is taken at an accumulation boundary, where they are zero.
Frozen parameters (in frozen chunks: Note [frozen chunks], gathered for the save under stage 3),
parameters outside chunks and buffers are saved whole by data-parallel rank 0 of each tensor-parallel
rank ("extra" entries), and loaded into their chunks (this rank's shard of a frozen chunk).
The manifest lists every saved chunk once (format version 3, for every layout): its key in the files, its size,
the file holding each of its shards in shard order, and its members with their placements (name in the whole model,
the tensor-parallel piece, the slice of a fused expert tensor). The ranks of one chunk are found by its home, the
global rank holding its shard 0, so that a chunk a pipeline stage, an ep rank or a tensor-parallel rank saved is
listed apart from the others' without the saver asking which parallelism made them. Chunk members carry their
names in the whole model (Note [pipeline stages of an unmodified model]), so a name is found in whichever chunk
holds it; a tied weight two stages hold is saved by both and read from the first. "parts" keeps each part of the
model's param groups and lr-scheduler state (Feature.stage: a pipeline stage's optimizer has the groups of the
parameters it holds); "state_dict_keys" are the unsplit model's, "tp_specs" every part's cuts, and "aliases" every
part's, including a stage's later key for a tied weight it holds (the last stage's lm_head.weight -> wte.weight).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn

from engine.comm import shard_range
from engine.placement import Placement
from engine.zero.chunk_state import ShardPlace
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
                 placements: dict[str, Placement] | None = None):
        """placements: chunked parameters' (Note [placements]) by name in the whole model; by default each whole."""
        self.chunked = chunked
        self.placements = placements or {}
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
        named = [(self.chunked.name_of(p), slot) for p, slot in self.chunked.chunk_members(index)]
        placed = [(self.placements.get(name, Placement(name)), slot) for name, slot in named]
        return [Member(at.name, slot.offset, tuple(slot.shape), at.base, at.whole) for at, slot in placed]

    def stepped_members(self, index: int) -> list[tuple[Member, int, int]]:
        """The members of chunk `index` with elements in this rank's stepped range: (member, lo, hi), the range
        [lo, hi) of chunk elements they hold there."""
        start, n = self.stepped_range(index)
        spans = [(m, max(start, m.offset), min(start + n, m.offset + m.numel)) for m in self.members(index)]
        return [(m, lo, hi) for m, lo, hi in spans if lo < hi]

    def place(self, index: int) -> ShardPlace:
        """The ranks chunk `index` is reduced over and sharded across, and this rank's shard."""
        return self.chunked.states[index].place

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
        if chunked.has_masters:
            with chunked.masters.master(index, writes=writes) as master:  # maybe offloaded
                yield master
        elif chunked.gathers_params:
            with chunked.sharded_params.shard(index, writes=writes) as shard:  # maybe offloaded
                yield shard
        else:
            yield self._stepped[index]

    @property
    def values_offloaded(self) -> bool:
        """Whether `values` may be views of a chunk manager's buffers (valid only inside the block)."""
        chunked = self.chunked
        return chunked.masters.offloaded if chunked.has_masters else chunked.gathers_params

    @contextlib.contextmanager
    def optimizer_state(self, index: int, writes: bool):
        """The optimizer's state tensors of chunk `index` by name ({} before a torch optimizer's first step)."""
        if self._offloaded:
            with self.optimizer.accessed_state(index, writes) as state:
                yield state
            return
        state = self.optimizer.state.get(self._stepped[index], {})
        yield {k: v for k, v in state.items() if torch.is_tensor(v)}

    def state_entries(self, index: int) -> dict[str, tuple[Fraction, torch.dtype]] | None:
        """The tensor optimizer states of chunk `index` by name: entries per stepped element and dtype (Note [block-wise
        optimizer states]); None: the optimizer keeps the same states, one fp32 entry per element, for every chunk."""
        if self._offloaded:
            return self.optimizer.state_entries(index)
        if hasattr(self.optimizer, "state_entries"):
            return self.optimizer.state_entries(self._stepped[index])
        return None

    def install_optimizer_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Loading into a torch optimizer: its states replaced by `states` (chunk index -> name -> tensor), placed as
        torch places loaded states (Optimizer.load_state_dict: the parameter's device and dtype, "step" as is); a
        TiledAdam's keep their own dtypes (block-wise bytes, fp32 moments of bf16 masters), which torch would cast."""
        if hasattr(self.optimizer, "state_entries"):
            for index, state in states.items():
                stepped = self._stepped[index]
                self.optimizer.state[stepped] = {k: v if k == "step" else v.to(stepped.device)
                                                 for k, v in state.items()}
            return
        saved = self.optimizer.state_dict()
        saved["state"] = states
        self.optimizer.load_state_dict(saved)

    def finish_loading(self) -> None:
        """After values were written: 16-bit parameters from their masters; the full chunks from the shards are the
        caller's (an all-gather, as after every update)."""
        if self.chunked.has_masters:
            self.chunked.masters.update_params()

    @property
    def offloaded(self) -> bool:
        return self._offloaded


def chunked_tensors(chunked: ChunkedParams) -> dict[str, torch.Tensor]:
    """Every chunked parameter by its name in the whole model."""
    return {chunked.name_of(p): p for i in range(chunked.chunk_count()) for p, _ in chunked.chunk_members(i)}


def extra_entries(module: nn.Module, chunked: ChunkedParams) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state-dict entries outside chunks (frozen parameters, buffers) by key, and aliases: a key whose tensor is
    another key's (tied weights) -> that first key, or the chunked parameter's own name when it differs from the key
    (a pipeline stage holding a tied weight under its later key: Note [checkpoint layout])."""
    extras, aliases, first = {}, {}, {}
    chunk_of = chunked.chunk_index()
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
            continue
        first[id(tensor)] = chunked.name_of(tensor) if id(tensor) in chunk_of else key
        if first[id(tensor)] != key:
            aliases[key] = first[id(tensor)]
        if id(tensor) not in chunk_of:
            extras[key] = tensor
    return extras, aliases
