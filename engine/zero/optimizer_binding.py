"""What the optimizer steps: torch param groups over the chunks' stepped tensors (whole payloads, this rank's
shards, or fp32 masters), each bound to its gradient (Note [parameters as chunk views])."""

from __future__ import annotations

import torch

from engine.optimizers.stochastic_rounding import KeySpan, parameter_key
from engine.zero.chunk_state import ChunkState


class OptimizerBinding:
    """ChunkedParams' binding of the optimizer to the chunks (a part of it: the attributes below are
    ChunkedParams')."""

    states: list[ChunkState]

    def optimizer_param_groups(self) -> list[dict]:
        """Torch param groups over whole chunk payloads (or this rank's shards); each one's .grad is its grad chunk."""
        self.rebind_optimizer_grads()
        return [{"params": [s.stepped for s in g.states], **g.options} for g in self.groups]

    def stepped_by_origin(self, count: int) -> list[list[torch.Tensor]]:
        """The stepped tensors (payloads, shards or masters) of each of the `count` param groups the chunks were
        packed from, in order: a group split by dtype, persistence or placement comes back whole, and one whose
        parameters are all frozen comes back empty."""
        self.rebind_optimizer_grads()
        stepped: list[list[torch.Tensor]] = [[] for _ in range(count)]
        for g in self.groups:
            stepped[g.origin] += [s.stepped for s in g.states]
        return stepped

    def rebind_optimizer_grads(self) -> None:
        """Optimizers' zero_grad(set_to_none) drops payload .grad; put the grad chunks back."""
        for state in self.states:
            state.stepped.grad = state.stepped_grad

    def stepped_grad_chunks(self) -> dict[int, int]:
        """id(stepped tensor) -> the manager chunk of its gradient shard, when those are managed."""
        if not self.grads_managed:
            return {}
        return {id(s.stepped): s.grad_handle for s in self.states}

    def grad_shards(self) -> list[torch.Tensor]:
        """The gradient elements this rank updates from: its shard of every grad chunk (all of them unsharded)."""
        return [s.stepped_grad for s in self.states]

    @property
    def grads_managed(self) -> bool:
        """Gradient shards in the chunk manager (Note [offloaded gradient shards])."""
        return self.sharded_grads.managed is not None

    def key_spans(self) -> dict[int, list[KeySpan]]:
        """id(stepped tensor) -> where each parameter's elements lie in it (Note [keyed stochastic rounding])."""
        spans = {}
        for index, state in enumerate(self.states):
            here = []
            for p, slot in self.chunk_members(index):
                owned = self._owned_range(index, slot)
                if owned is not None:
                    start, lo, hi = owned
                    here.append(KeySpan(lo - start, hi - lo, parameter_key(self.name_of(p)), lo - slot.offset))
            spans[id(state.stepped)] = here
        return spans
