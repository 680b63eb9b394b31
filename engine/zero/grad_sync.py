"""Data-parallel gradient reduction, chunk by chunk, launched during backward.

Note [reduction order]
Every rank must issue collectives in the same order, so chunks are launched in one fixed
sequence: backward runs roughly in reverse of the model's parameter order, and a chunk is
complete when its earliest parameter (in model order) has its gradient, so the sequence sorts
chunks by that parameter's position, last first. With one param group that is simply the last
chunk down to the first; with several (e.g. decay / no-decay), whose chunks interleave in the
model, it still follows backward. A chunk is launched only when it and every chunk before it
in the sequence are complete (completion order varies, and a parameter unused in this step
never completes its chunk); whatever is left when backward returns is launched then, in the
same sequence. A chunk's arrived gradients (against one expected per member) are kept in its
ChunkState (Note [chunk phases]).

Note [several synchronized backward passes]
DeepSpeed lets a script call backward more than once at an accumulation boundary (its GAN example
backpropagates a discriminator's real and fake losses apart), each reducing what has accumulated so
far, and the update sees the sum. Here a reduction sums the ranks' chunks, so reducing a chunk that
already holds a sum would count it once per rank. Before a second synchronized backward of the same
step (stages 0 and 1: full gradient chunks; stages 2 and 3 reduce every backward's gradients into
their shards anyway), every reduced element is therefore made to add up to its sum once over the
ranks of its group: a reduce-scattered chunk keeps this rank's shard and zeroes the rest (which holds
unreduced values of the earlier backward); an all-reduced chunk, the same sum on every rank, is
divided by the group's size on each (as DeepSpeed averages in place; exact for a power of two). The
next reduction then adds the earlier sum once to the new gradients, and the overlap of reductions
with backward is the same as for one backward.

Note [hybrid sharding]
`zero_optimization.mics_shard_size` s (DeepSpeed's MiCS; FSDP's HYBRID_SHARD) splits the ZeRO group's ranks
(dp × sp) into shard groups of s consecutive ranks, each holding one whole copy of the sharded states, and replica
groups joining the ranks at the same place in every copy (engine/mesh.py: dp = dp_replicate × dp_shard). The
chunks are sharded s ways (ShardPlace rank and count within the shard group); parameters are gathered, and
updated shards all-gathered, within the shard group only, so the gathers never cross the copies. A gradient
chunk is reduced in two phases: over the shard group (reduce-scattered, or all-reduced), then what this rank
keeps (its shard, or the whole chunk) all-reduced over its replica group; the result is the sum over every
rank, as without hybrid sharding. Both phases are issued together, when the chunk is launched, so every rank
issues its collectives on the two groups in one order (NCCL can deadlock otherwise); the second waits for the
first on a side stream on CUDA (compute goes on), in the launching thread on gloo. With one rank per shard group
the first phase is skipped. The loss is still divided by the whole data-parallel size. The squared gradient
norm is one sum over every rank of each rank's share (1/copies) of its shard's squares: a sum over each shard
group alone could round differently in each copy (another algorithm, another order), and the copies, clipped by
different factors, would drift apart. The starting values and a `modifier_rank`'s values are broadcast over
every rank holding the chunk. A checkpoint records s shards, written by the first copy's ranks (ZeRO ranks
0 … s-1; the reader takes shard d from ZeRO rank d).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter, all_reduce_sum, reduce_scatter_sum_in_place, shard_of
from engine.mesh import Mesh
from engine.zero.chunked_params import ChunkedParams
from engine.zero.hooks import ZeroHooks


class GradReducer:
    """Sums gradient chunks over the data-parallel group asynchronously as backward fills them: each
    chunk all-reduced, or reduce-scattered when the chunks are sharded (Note [sharding policy]: each
    rank then holds the sum of its own shard only).

    overlap=False (`zero_optimization.overlap_comm: false`) launches every reduction only after
    backward returns instead of during it; reduce_scatter=False (`zero_optimization.reduce_scatter:
    false`) all-reduces sharded chunks too (DeepSpeed's option: more traffic, same result).
    """

    def __init__(self, chunked: ChunkedParams, mesh: Mesh, counter: CommCounter, hooks: ZeroHooks,
                 overlap: bool = True, reduce_scatter: bool = True, on_chunk_complete=None):
        """Reduces over the mesh's shard group; under hybrid sharding also across its replicate group, the ranks
        holding the same shards in the other copies (Note [hybrid sharding]). One rank (a ZeRO group of 1) pages its
        gradient shards (Note [paging in one process]): nothing to sum, the chunks' shards are retired as they
        complete."""
        group, peers, replicas = mesh.shard.group, mesh.zero.size > 1, mesh.replicate.group
        self.chunked = chunked
        # stage 3: a chunk whose gradients are all in (Note [gathering around modules])
        self.on_chunk_complete = on_chunk_complete
        self.scatter = chunked.sharded and reduce_scatter
        self.peers = peers
        if replicas is not None and dist.get_world_size(group) == 1:  # one rank per copy: reduce over the copies
            group, replicas = replicas, None
        self.group = group
        self.replicas = replicas
        self._copies = dist.get_world_size(replicas) if replicas is not None else 1
        device = chunked.states[0].grad_chunk.payload.device if chunked.states else torch.device("cpu")
        # the stream a second phase waits on its first (Note [hybrid sharding])
        self._side = torch.cuda.Stream(device) if replicas is not None and device.type == "cuda" else None
        self.counter = counter
        self.overlap = overlap
        self.states = chunked.states  # Note [chunk phases]: each chunk's gradients arrived, against those expected
        self._chunk_of = chunked.chunk_index()
        first_use = [min(chunked.position_of(p) for p in s.params) for s in self.states]
        # Note [reduction order]: the launch sequence, and each chunk's place in it
        self.sequence = sorted(range(len(self.states)), key=lambda c: first_use[c], reverse=True)
        self._place = {c: i for i, c in enumerate(self.sequence)}
        self._armed = False  # inside a synchronized backward
        self._cursor = len(self.sequence)  # place in the sequence of the next launch; len: all launched
        # overlap, for the last synchronized backward: gradients that had arrived when the first
        # reduction started (small is good), and chunks launched before backward returned
        self.grads_before_first_launch: int | None = None
        self.launched_during_backward = 0
        self._works: list[tuple[int, object]] = []  # (chunk, its collective in flight)
        self._launched_unfinished = 0  # reductions the armed backward launched, until it completes
        hooks.on_grad_accumulated(chunked.params, self._on_grad_ready)  # Note [zero hooks]
        self._retires = chunked.shards_grads  # reduced shards join persistent buffers (Note [sharded gradients])
        # given to `arm` for a backward whose shards are final (Note [stepping in backward]): called with a
        # chunk index once that chunk's reduced shard is retired
        self._on_shard_reduced = None
        self._measure = None
        self._callback_error: BaseException | None = None

    def arm(self, on_shard_reduced=None, measure=None) -> None:
        """The coming backward ends the accumulation: reduce chunks as they complete. on_shard_reduced(chunk), if
        given, runs once each chunk's reduced shard is retired (Note [stepping in backward]); measure(chunk), if
        given, just before a reduced shard that is the whole of its gradient goes down (Note [the norm where the
        gradient is reduced])."""
        self._on_shard_reduced = on_shard_reduced
        self._measure = measure
        for state in self.states:
            state.arrived.clear()
        self._cursor = 0
        self._launched_unfinished = 0
        self._armed = True
        self.grads_before_first_launch = None
        self.launched_during_backward = 0

    def launched_since_armed(self) -> bool:
        """Whether the backward armed last launched a reduction and has not completed."""
        return self._launched_unfinished > 0

    def disarm(self) -> None:
        """After a failed backward: launch nothing more from hooks, and let what was launched finish now
        (every rank launched the same prefix of the sequence), so no late reduction lands in a later step."""
        self._armed = False
        self._on_shard_reduced = None  # a failed backward updates nothing more
        self.wait()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        chunk = self._chunk_of[id(p)]
        state = self.states[chunk]
        state.accept_grad(p)  # Note [sharded gradients]; stages 0-1: Note [parameters as chunk views]
        if not self._armed:
            return
        if id(p) in state.arrived or self._place[chunk] < self._cursor:
            self.disarm()
            raise RuntimeError(
                f"parameter '{self.chunked.name_of(p)}' received a second gradient in one synchronized backward, "
                "after its chunk was already being all-reduced (reentrant activation checkpointing, or a parameter "
                "used inside and outside a checkpointed region, does this); use torch.utils.checkpoint with "
                "use_reentrant=False")
        state.arrived.add(id(p))
        if self.on_chunk_complete is not None and state.ready_grads == state.expected_grads:
            self.on_chunk_complete(chunk)
        if not self.overlap:
            return
        before = self._cursor
        self._launch_while(lambda c: self.states[c].ready_grads >= self.states[c].expected_grads)
        if self._cursor > before:
            self.launched_during_backward += self._cursor - before
            if self.grads_before_first_launch is None:
                self.grads_before_first_launch = sum(s.ready_grads for s in self.states)

    def _launch(self, index: int) -> None:
        if self._retires:
            self._retire_finished()  # frees finished chunks' buffers during backward, not only after it
            self.states[index].complete_grads()  # zeros where this rank had no gradient: the others may
        place = self.states[index].place  # expert chunks reduce over their own group (Note [expert parallelism])
        if not self.peers:
            work = _DONE
        elif self.scatter:
            work = reduce_scatter_sum_in_place(self._payload(index), place.group_or(self.group), place.rank,
                                               place.count, self.counter, async_op=True)
        else:
            work = all_reduce_sum(self._payload(index), place.group_or(self.group), self.counter, async_op=True)
        if self.replicas is not None and self.peers:  # (no expert chunk under hybrid sharding: ParallelDims)
            with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
                work.wait()  # Note [hybrid sharding]: the second phase, issued now, after the first
                work = all_reduce_sum(self._kept(index), self.replicas, self.counter, async_op=True)
        self._works.append((index, work))
        self._launched_unfinished += 1

    def _payload(self, index: int):
        """What chunk `index` reduces: Note [chunk packing] leaves padding only at a chunk's end, so an all-reduce
        takes the used prefix alone (a reduce-scatter takes the whole chunk: its shards are equal slices of it)."""
        chunk = self.states[index].grad_chunk
        return chunk.payload if self.scatter else chunk.payload.narrow(0, 0, chunk.used)

    def _kept(self, index: int):
        """What this rank holds reduced after the first phase: its shard of a reduce-scattered chunk, or the used
        prefix of an all-reduced one."""
        place = self.states[index].place
        return shard_of(self._payload(index), place.rank, place.count) if self.scatter else self._payload(index)

    def finish_backward(self) -> None:
        """Launches the chunks backward did not complete (unused parameters, or all without overlap), in order."""
        self._armed = False
        self._launch_while(lambda c: True)

    def complete_backward(self) -> None:
        """After a synchronized backward: every chunk launched and reduced (as with DDP, the gradients are reduced
        when backward returns); raises what on_shard_reduced raised, once all of that has finished."""
        self.finish_backward()
        self.wait()
        self._launched_unfinished = 0
        self._on_shard_reduced = None
        error, self._callback_error = self._callback_error, None
        if error is not None:
            raise error

    def keep_reduced_once(self) -> None:
        """Before another synchronized backward of this step (Note [several synchronized backward passes])."""
        for state in self.states:
            place, payload = state.place, state.grad_chunk.payload
            if self.scatter:  # under hybrid sharding, every copy holds the shard's sum: a share of it each
                kept = shard_of(payload, place.rank, place.count) / self._copies
                payload.zero_()
                shard_of(payload, place.rank, place.count).copy_(kept)
            else:
                payload.div_(dist.get_world_size(place.group_or(self.group)) * self._copies)

    def _launch_while(self, may_launch) -> None:
        while self._cursor < len(self.sequence) and may_launch(self.sequence[self._cursor]):
            self._launch(self.sequence[self._cursor])
            self._cursor += 1

    def holds_unreduced(self) -> bool:
        """Stage 2/3: whether some full gradient chunk holds gradients no reduction took yet (backward passes
        inside accumulate_locally)."""
        return any(state.grad_live for state in self.states)

    def reduce_all(self) -> None:
        """Reduces every chunk now (no synchronized backward ran since the last update)."""
        self.arm()
        self.finish_backward()
        self.wait()
        self._launched_unfinished = 0

    def wait(self) -> None:
        while self._works:  # popped one by one: a retire that raises is not repeated by the next wait
            index, work = self._works.pop(0)
            work.wait()
            if self._retires:
                self._retire(index)

    def _retire_finished(self) -> None:
        """Retires the leading reductions that have finished (in launch order, as every rank launches them)."""
        while self._works and self._works[0][1].is_completed():
            index, work = self._works.pop(0)
            work.wait()
            self._retire(index)

    def _retire(self, index: int) -> None:
        if not self.states[index].grad_fresh:  # adds to what was there: a norm measured before is stale
            self.chunked.forget_retired_norm(index)
        elif self._measure is not None:
            self._measure(index)
        self.states[index].retire()
        if self._on_shard_reduced is not None:
            try:
                self._on_shard_reduced(index)
            except BaseException as e:
                # kept, not raised: this rank must go on launching the same reductions as the others, or they hang
                self._on_shard_reduced, self._callback_error = None, e


class _Done:
    """The handle of a reduction with no peers to wait for (one rank)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


_DONE = _Done()
