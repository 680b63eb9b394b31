"""How the parameters are packed into chunks and split across ranks: the settings ChunkedParams packs by, resolved
once from the config (engine/initialization.py's chunk_parameters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.optimizers.blockwise_states import BlockwiseStates


@dataclass(frozen=True)
class ChunkLayout:
    """capacity / first_capacity: elements per chunk (Note [chunk packing]); shard_count, shard_rank: the ZeRO shards
    and this rank's; shard_grads / shard_params: the stage's ShardingPolicy (Note [sharding policy]);
    persistence_threshold: stage 3 keeps smaller parameters whole (Note [sharded parameters]); compute_dtype bf16 /
    fp16: 16-bit chunks with fp32 masters (Note [master weights]), or none (fp32_masters False: Note [bf16 master
    weights]); page_params: stage 3's shards (and stage 2's gradient shards) even with one shard, so that
    offload_param can page chunks in around their use (Note [paging in one process]); page_grads: gradient shards
    even with one shard, for an offloaded optimizer to take them to the host (Note [device tier]); offloaded: the
    kinds ("param", "grad", "optim") a chunk manager will hold, whose shards and masters start as placeholders (Note
    [a bounded start]); state_blocks: the parameters whose optimizer states it quantizes go into chunks of their
    own, aligned to its blocks (Note [block-wise optimizer states])."""

    capacity: int
    first_capacity: int | None = None
    shard_count: int = 1
    shard_rank: int = 0
    shard_grads: bool = False
    shard_params: bool = False
    persistence_threshold: int = 0
    compute_dtype: torch.dtype = torch.float32
    page_params: bool = False
    page_grads: bool = False
    offloaded: frozenset[str] = frozenset()
    fp32_masters: bool = True
    state_blocks: BlockwiseStates | None = None

    def __post_init__(self):
        for what, value in (("capacity", self.capacity), ("first chunk capacity",
                                                          self.first_capacity or self.shard_count)):
            if value % self.shard_count:
                raise ValueError(f"chunk {what} {value} is not a multiple of the shard count {self.shard_count}")

    @property
    def sharding(self) -> bool:
        """Per-rank shards of the parameter chunks exist (of the whole chunk, with one rank)."""
        return self.shard_count > 1 or self.page_params

    @property
    def grad_sharding(self) -> bool:
        return self.sharding or self.page_grads

    @property
    def gathers_params(self) -> bool:
        """Stage 3: a chunk's full payload exists only while gathered (Note [sharded parameters])."""
        return self.shard_params and self.sharding
