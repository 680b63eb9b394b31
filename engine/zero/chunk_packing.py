"""Packing parameters into chunk groups: one group per optimizer param group and kind of chunk (dtype, stage 3's
persistence, expert place, int8, block-wise states), its parameters' data and gradients made views of its chunks
(Note [chunk packing])."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.zero.chunk_layout import ChunkLayout
from engine.zero.chunk_state import ChunkState, ShardPlace
from offload.chunk import ChunkList, Slot


@dataclass(frozen=True)
class ExpertChunks:
    """Note [expert parallelism]: the parameters (by id) of this rank's experts, packed into chunks of their own that
    are reduced over, and sharded across, `place`'s expert-data-parallel group."""

    params: frozenset[int]
    place: ShardPlace


@dataclass
class ChunkGroup:
    """One optimizer param group's parameters of one dtype: param chunks and grad chunks."""

    params: list[nn.Parameter]
    options: dict  # the param group's own options (lr, weight_decay, ...), without "params"
    param_chunks: ChunkList
    grad_chunks: ChunkList | None  # None: frozen parameters (Note [frozen chunks])
    persistent: bool = False  # stage 3: below the persistence threshold, never released (Note [sharded parameters])
    place: ShardPlace = ShardPlace()  # its chunks' reduction group and shards (Note [expert parallelism])
    int8: bool = False  # frozen weights kept as int8 (Note [int8 frozen chunks])
    blockwise: bool = False  # their optimizer states are quantized block-wise (Note [block-wise optimizer states])
    states: list[ChunkState] = field(default_factory=list)  # its chunks' states (Note [chunk phases])
    origin: int = -1  # the index of the param group it was packed from (-1: the frozen parameters)


class ChunkPacker:
    """Packs parameters into ChunkGroups under one layout, keeping what `ChunkedParams` loads later: the values of
    chunks that start released (`sources`, by (group, chunk)) and, when zero_init brings the values, those that came
    with theirs (`loose`)."""

    def __init__(self, layout: ChunkLayout, device: torch.device, pending: set[int], experts: ExpertChunks | None,
                 int8: frozenset[int]):
        self.layout, self.device, self.pending, self.experts, self.int8 = layout, device, pending, experts, int8
        self.dense = ShardPlace(layout.shard_rank, layout.shard_count)
        self.groups: list[ChunkGroup] = []
        self.sources: dict[tuple[int, int], list[tuple[Slot, torch.Tensor]]] = {}
        self.loose: list[tuple[nn.Parameter, torch.Tensor]] = []

    def pack(self, params: list[nn.Parameter], options: dict, trains: bool, origin: int = -1) -> None:
        """Appends a group per kind of chunk among `params` (each parameter's data, and gradient if it trains, become
        views of the group's chunks)."""
        for kind, members in self._by_kind(params, trains).items():
            self._pack_kind(kind, members, options, trains, origin)

    def _by_kind(self, params: list[nn.Parameter], trains: bool) -> dict[tuple, list[nn.Parameter]]:
        layout, experts = self.layout, self.experts
        by_kind: dict[tuple[torch.dtype, bool, ShardPlace, bool, bool], list[nn.Parameter]] = {}
        for p in params:
            quantized = not trains and id(p) in self.int8  # gathered around every use: never persistent
            persistent = layout.shard_params and p.numel() < layout.persistence_threshold and not quantized
            dtype = layout.compute_dtype if layout.compute_dtype != torch.float32 else p.dtype
            place = experts.place if experts is not None and id(p) in experts.params else self.dense
            blockwise = trains and layout.state_blocks is not None and layout.state_blocks.quantizes(p.numel())
            by_kind.setdefault((dtype, persistent, place, quantized, blockwise), []).append(p)
        return by_kind

    def _pack_kind(self, kind: tuple, members: list[nn.Parameter], options: dict, trains: bool, origin: int) -> None:
        dtype, persistent, place, quantized, blockwise = kind
        layout = self.layout
        # Note [block-wise optimizer states]: every shard a whole number of blocks
        align = layout.shard_count * (layout.state_blocks.block if blockwise else 1)
        chunking = dict(capacity=layout.capacity, device=self.device, first_capacity=layout.first_capacity,
                        align=align, dtype=dtype)
        # stage 3: a sharded chunk's full payload exists only while gathered, so it starts released and its values
        # wait where they are until `start` fills it, one chunk at a time (Note [a bounded start])
        lazy = layout.gathers_params and not persistent
        with torch.no_grad():
            # a pending parameter's values are garbage: a meta stand-in gives the shape and is not copied
            sources = [torch.empty_like(p, device="meta") if id(p) in self.pending else p.data for p in members]
            param_chunks = ChunkList(sources, released=lazy, **chunking)
            released_grads = layout.grad_sharding and layout.shard_grads
            grad_chunks = ChunkList([p.data for p in members], copy_values=False, released=released_grads,
                                    **chunking) if trains else None
        if lazy and not self.pending:
            for slot, source in zip(param_chunks.slots, sources):
                self.sources.setdefault((len(self.groups), slot.chunk), []).append((slot, source))
        elif self.pending:  # zero_init loads the others; these (PEFT's adapters) come with their values
            self.loose += [(p, p.data) for p in members if id(p) not in self.pending]
        for p, pv in zip(members, param_chunks.views):
            p.data = pv
        for p, gv in zip(members, grad_chunks.views if trains else []):
            p.grad = gv
        self.groups.append(ChunkGroup(members, options, param_chunks, grad_chunks, persistent, place, quantized,
                                      blockwise, origin=origin))
