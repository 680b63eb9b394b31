"""Data-parallel gradient reduction, chunk by chunk, launched during backward.

Note [reduction order]
Every rank must issue collectives in the same order. Gradient chunks complete in backward
order, roughly from the last chunk to the first, but not exactly (and a parameter unused in
this step never completes its chunk). So a chunk's all-reduce is launched only when it and
every chunk after it are complete, from the last chunk down; whatever is left when backward
returns is launched then, in the same order. All ranks thus launch the same sequence.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter, all_reduce_sum
from engine.zero.chunked_params import ChunkedParams


class GradReducer:
    """Sums gradient chunks over the data-parallel group asynchronously as backward fills them.

    overlap=False (`zero_optimization.overlap_comm: false`) launches every reduction only after
    backward returns instead of during it.
    """

    def __init__(self, chunked: ChunkedParams, group: dist.ProcessGroup | None, counter: CommCounter,
                 overlap: bool = True):
        self.chunked = chunked
        self.group = group
        self.counter = counter
        self.overlap = overlap
        # Note [chunk packing] leaves padding only at a chunk's end: reduce the used prefix alone
        self.payloads = [c.payload.narrow(0, 0, c.used) for g in chunked.groups for c in g.grad_chunks.chunks]
        self._chunk_of: dict[int, int] = {}
        self._expected = [0] * len(self.payloads)
        base = 0
        for g in chunked.groups:
            for p, slot in zip(g.params, g.grad_chunks.slots):
                self._chunk_of[id(p)] = base + slot.chunk
                self._expected[base + slot.chunk] += 1
            base += len(g.grad_chunks)
        self._ready = [0] * len(self.payloads)
        self._fired: set[int] = set()
        self._armed = False  # inside a synchronized backward
        self._next = -1  # next chunk index to launch (from the last down); -1: all launched
        self._works: list = []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in chunked.params]

    def arm(self) -> None:
        """The coming backward ends the accumulation: reduce chunks as they complete."""
        self._ready = [0] * len(self.payloads)
        self._fired.clear()
        self._next = len(self.payloads) - 1
        self._armed = True

    def disarm(self) -> None:
        """After a failed backward: launch nothing more from hooks."""
        self._armed = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self.chunked.adopt_foreign_grad(p)
        if not self._armed:
            return
        chunk = self._chunk_of[id(p)]
        if id(p) in self._fired or chunk > self._next:
            self.disarm()
            raise RuntimeError(
                f"parameter '{self.chunked.name_of(p)}' received a second gradient in one synchronized backward, "
                "after its chunk was already being all-reduced (reentrant activation checkpointing, or a parameter "
                "used inside and outside a checkpointed region, does this); use torch.utils.checkpoint with "
                "use_reentrant=False")
        self._fired.add(id(p))
        self._ready[chunk] += 1
        if not self.overlap:
            return
        while self._next >= 0 and self._ready[self._next] >= self._expected[self._next]:
            self._launch(self._next)
            self._next -= 1

    def _launch(self, index: int) -> None:
        self._works.append(all_reduce_sum(self.payloads[index], self.group, self.counter, async_op=True))

    def finish_backward(self) -> None:
        """Launches the chunks backward did not complete (unused parameters, or all without overlap), in order."""
        self._armed = False
        while self._next >= 0:
            self._launch(self._next)
            self._next -= 1

    def reduce_all(self) -> None:
        """Reduces every chunk now (no synchronized backward ran since the last update)."""
        self.arm()
        self.finish_backward()
        self.wait()

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
