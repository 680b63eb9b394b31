"""ZeRO stages as a policy over chunk kinds (../shared/DESIGN.md: "a ZeRO stage is a policy").

Note [sharding policy]
Each kind of chunk is either replicated on every data-parallel rank or sharded: every chunk's
payload is cut into `dp` equal contiguous shards (chunks are sized to a multiple of `dp`) and rank
r owns shard r. The stage only decides which kinds are sharded:
  stage 0   nothing                                  (plain data parallelism)
  stage 1   optimizer states (and fp32 masters)      gradients reduce-scattered, params all-gathered
  stage 2   + gradients                              each rank keeps its gradient shard (Note [sharded gradients])
  stage 3   + parameters                             gathered around each use (Note [sharded parameters])
Everything else follows from the table: when optimizer states are sharded, a rank needs only its
shard of the summed gradient (a reduce-scatter instead of an all-reduce: half the traffic) and
updates only its shard of each parameter chunk, after which the chunks are all-gathered — the
same bytes on the wire as one all-reduce, so stage 1 costs what DDP costs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ChunkKind(enum.Enum):
    PARAM = "param"
    GRAD = "grad"
    OPTIM = "optim"  # optimizer states and fp32 master copies


_SHARDED_BY_STAGE: dict[int, frozenset[ChunkKind]] = {
    0: frozenset(),
    1: frozenset({ChunkKind.OPTIM}),
    2: frozenset({ChunkKind.OPTIM, ChunkKind.GRAD}),
    3: frozenset({ChunkKind.OPTIM, ChunkKind.GRAD, ChunkKind.PARAM}),
}


@dataclass(frozen=True)
class ShardingPolicy:
    """Which chunk kinds are sharded over the data-parallel group (Note [sharding policy])."""

    stage: int

    def __post_init__(self):
        if self.stage not in _SHARDED_BY_STAGE:
            raise ValueError(f"ZeRO stage must be one of 0, 1, 2, 3, got {self.stage}")

    def shards(self, kind: ChunkKind) -> bool:
        return kind in _SHARDED_BY_STAGE[self.stage]
