"""What a checkpoint, full_state_dict and the runtime ask of the chunks: their count, sizes, members, payloads and
stepped tensors, and the parameters' names and order (Note [checkpoint layout])."""

from __future__ import annotations

import torch
from torch import nn

from engine.zero.chunk_state import ChunkPhase, ChunkState
from offload.chunk import Slot


class ChunkQueries:
    """ChunkedParams' read-only queries (a part of it: the attributes below are ChunkedParams')."""

    states: list[ChunkState]  # the trainable chunks
    all_states: list[ChunkState]  # and the frozen ones after them (Note [frozen chunks])

    def chunk_count(self) -> int:
        """Trainable chunks (those with gradients and optimizer states); frozen ones come after them."""
        return len(self.states)

    def chunk_numel(self, index: int) -> int:
        """Elements of param chunk `index` (its capacity, padding included)."""
        return self.all_states[index].numel

    def describe(self, index: int) -> str:
        """What state chunk `index` is in (Note [chunk phases]), its members named."""
        return self.all_states[index].describe(self._names)

    def chunk_members(self, index: int) -> list[tuple[nn.Parameter, Slot]]:
        """The parameters of chunk `index` with their slots, in chunk order."""
        return list(zip(self.all_states[index].params, self.all_states[index].slots))

    def stepped_tensors(self) -> list[torch.Tensor]:
        """What the optimizer steps, one per chunk in chunk order: the whole payload, this rank's shard of it,
        or its fp32 master (an offloaded shard is a placeholder: read it through sharded_params.shard)."""
        return [s.stepped for s in self.states]

    def position_of(self, p: nn.Parameter) -> int:
        """The parameter's place in the model's parameter order (after named ones, registration order)."""
        return self._position[id(p)]

    def name_of(self, p: nn.Parameter) -> str:
        return self._names.get(id(p), f"<unnamed {tuple(p.shape)} {p.dtype}>")

    def chunk_index(self) -> dict[int, int]:
        """id(trainable parameter) -> the index of its chunk among the param chunks (the same for its grad chunk)."""
        return self._chunk_of

    def param_chunk_index(self) -> dict[int, int]:
        """id(parameter) -> the index of its param chunk, frozen ones included (Note [frozen chunks])."""
        return self._param_chunk_of

    def param_payloads(self) -> list[torch.Tensor]:
        """Every param chunk's payload, frozen ones included, by chunk index."""
        return [s.param_chunk.payload for s in self.all_states]

    def grad_payloads(self) -> list[torch.Tensor]:
        return [s.grad_chunk.payload for s in self.states]

    def states_gathered_after_step(self) -> list[ChunkState]:
        """The chunks whose full copies persist and so are all-gathered after each sharded update: all of them, or
        with stage 3 the persistent ones (the rest are gathered when next used)."""
        return [s for s in self.states if s.phase is ChunkPhase.WHOLE]
