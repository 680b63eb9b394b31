"""One object per chunk index: its members, where its values live, its phase, its gradients, and the operations
that move it between phases.

Note [chunk phases]
A chunk index names one parameter chunk and the gradient chunk at the same index (Note [parameters
as chunk views]). What the ZeRO runtime knows about that pair is in one ChunkState, built once by
ChunkedParams, and the chunk's own operations are its methods: `gather`, `wait`, `release`,
`take_shard` and `refresh_shard` for its parameters; `accept_grad`, `complete_grads`, `retire` and
`zero_grad_shard` for its gradients. Its shards are read and written through their ShardStores
(Note [shard stores]), so the same method serves a shard in memory and one in a chunk manager.
The group-level classes only schedule: the gatherer (stage 3) picks which chunk to gather and
release when, the reducer which to reduce and retire when; ShardedParams and ShardedGrads keep
the group's totals. Stages 0-2 are the degenerate layout (Note [stage predicates]): every chunk is
WHOLE (its shard a view of its payload, that always holds), so `release` and `gather` have nothing
to do; under stages 0-1 its gradient shard is a view of its whole gradient chunk too, so `retire` has
nothing to do and `zero_grad_shard` zeroes the chunk. `chunked.states[7]` (its repr, or
`describe()`) answers "what state is chunk 7 in?":
- its members: the parameters, their slots, their gradient views, and under stage 3 the modules
  that directly own them (whose forward gathers the chunk, Note [gathering around modules]);
- where its values live: the full payloads, this rank's parameter shard and gradient shard
  (Notes [sharded parameters], [sharded gradients]), the tensors the optimizer steps, and the
  handles of the manager chunks holding the shards when they are offloaded;
- its phase, one ChunkPhase (FSDP2's ShardedState plays this part there):
    WHOLE      never sharded: the full payload always holds the values (stages 0-2, and stage-3
               chunks below the persistence threshold)
    SHARDED    stage 3, released: the payload's storage has size 0, this rank's shard holds its values
    GATHERING  the storage is back and the all-gather is in flight
    GATHERED   the full values are in the payload
  A stage-3 chunk starts GATHERED (its payload holds the starting values until the shards take
  them) and then cycles SHARDED → GATHERING → GATHERED → SHARDED; _LEGAL lists exactly these
  moves and any other raises (a release goes through GATHERED: it waits for the gather first);
- gradient readiness in the current backward: which members' gradients arrived in a synchronized
  backward (against the number expected), which members wrote their view of the full gradient
  buffer, whether that buffer has storage, and whether the gradient shard is still logically zero.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter, all_gather_into, shard_of
from engine.zero.int8_frozen import Int8Rows
from engine.zero.shard_store import ShardStore
from offload.chunk import Chunk, Slot


class ChunkPhase(enum.Enum):
    WHOLE = "whole"          # never sharded: the payload always holds the full values
    SHARDED = "sharded"      # storage of size 0; only this rank's shard holds its values
    GATHERING = "gathering"  # storage back, all-gather in flight
    GATHERED = "gathered"    # full values in the payload


_LEGAL: dict[ChunkPhase, frozenset[ChunkPhase]] = {
    ChunkPhase.WHOLE: frozenset(),
    ChunkPhase.SHARDED: frozenset({ChunkPhase.GATHERING}),
    ChunkPhase.GATHERING: frozenset({ChunkPhase.GATHERED}),
    ChunkPhase.GATHERED: frozenset({ChunkPhase.SHARDED}),
}


class IllegalPhaseTransition(RuntimeError):
    """A chunk was asked to move between two phases that Note [chunk phases] does not connect."""


@dataclass(frozen=True)
class ShardPlace:
    """Which ranks a chunk is reduced over and sharded across: this rank holds shard `rank` of `count` (count 1:
    the whole chunk); `group` None is the data-parallel group, a group of its own holds expert chunks (Note
    [expert parallelism])."""

    rank: int = 0
    count: int = 1
    group: dist.ProcessGroup | None = None

    def group_or(self, default: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return self.group if self.group is not None else default


@dataclass(eq=False, repr=False)
class ChunkState:
    """Everything about chunk `index` (Note [chunk phases])."""

    index: int
    params: list[nn.Parameter]  # members, in chunk order
    slots: list[Slot]  # their places in the param chunk (and in the grad chunk: the same slots)
    param_chunk: Chunk
    grad_chunk: Chunk | None  # None: a frozen chunk (Note [frozen chunks]), which has no gradients
    grad_views: list[torch.Tensor]  # each member's view into the grad chunk (none for a frozen chunk)
    phase: ChunkPhase = ChunkPhase.WHOLE
    persistent: bool = False  # stage 3: below the persistence threshold, never released
    place: ShardPlace = ShardPlace()  # the ranks it is reduced over and sharded across
    int8: Int8Rows | None = None  # an int8 frozen chunk: its shards hold int8 values (Note [int8 frozen chunks])
    # where this rank's values live
    # this rank's shards, in memory or managed (Note [shard stores]); set by ShardedParams / ShardedGrads, and under
    # the degenerate layout (Note [stage predicates]) the whole payload
    param_store: ShardStore | None = None  # the parameter shard
    grad_store: ShardStore | None = None  # the reduced gradient shard
    stepped: torch.Tensor | None = None  # what the optimizer steps: payload, shard, or fp32 master
    stepped_grad: torch.Tensor | None = None  # its .grad
    # stage 3 gathering (Note [gathering around modules])
    writer: torch.Tensor | None = None  # aliases the payload's storage with its own version counter
    gather_work: object | None = None  # the all-gather in flight (GATHERING)
    owners: set[nn.Module] = field(default_factory=set)  # modules directly owning members
    done: set[nn.Module] = field(default_factory=set)  # owners whose forward finished in this pass
    held: int = 0  # gathered() blocks holding it
    # gradient readiness (Notes [reduction order], [sharded gradients])
    arrived: set[int] = field(default_factory=set)  # ids of members with a gradient in this synchronized backward
    written: set[int] = field(default_factory=set)  # ids of members whose view of the full buffer holds a gradient
    shards_grads: bool = False  # stages 2-3: gradients persist as grad_store's shard (else the whole chunk is it)
    grad_live: bool = False  # stages 2-3: the full gradient buffer has storage
    grad_fresh: bool = True  # stages 2-3: the gradient shard is logically zero (not written since zero())

    def __post_init__(self) -> None:
        self._grad_view_of = {id(p): view for p, view in zip(self.params, self.grad_views)}

    @property
    def frozen(self) -> bool:
        """Its parameters do not train: no gradient chunk, master or optimizer state (Note [frozen chunks])."""
        return self.grad_chunk is None

    # ---- phase ---------------------------------------------------------------------------------
    def to(self, new: ChunkPhase) -> None:
        """Moves to phase `new`; raises unless Note [chunk phases] allows it."""
        if new not in _LEGAL[self.phase]:
            allowed = ", ".join(sorted(p.name for p in _LEGAL[self.phase])) or "none"
            raise IllegalPhaseTransition(f"chunk {self.index}: {self.phase.name} → {new.name} is not a legal phase "
                                         f"change (from {self.phase.name}: {allowed}); see Note [chunk phases]")
        self.phase = new

    # ---- where this rank's shards live (Note [shard stores]) ------------------------------------
    @property
    def param_shard(self) -> torch.Tensor | None:
        """This rank's parameter shard (a placeholder when offloaded: Note [offloaded parameter shards])."""
        return None if self.param_store is None else self.param_store.tensor

    @property
    def param_handle(self) -> int | None:
        return None if self.param_store is None else self.param_store.handle

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """This rank's reduced gradient shard (a placeholder when offloaded: Note [offloaded gradient shards])."""
        return None if self.grad_store is None else self.grad_store.tensor

    @property
    def grad_handle(self) -> int | None:
        return None if self.grad_store is None else self.grad_store.handle

    # ---- parameters: gather, wait, release (Note [sharded parameters]) ---------------------------
    def gather(self, group: dist.ProcessGroup | None, counter: CommCounter) -> bool:
        """Starts gathering a released chunk (a collective: every rank gathers the same chunks in the same order);
        returns whether a gather started (a chunk not SHARDED has its values already)."""
        if self.phase is not ChunkPhase.SHARDED:
            return False
        writer, place = self.writer, self.place
        writer.untyped_storage().resize_(self.param_chunk.nbytes)
        target = writer  # an int8 chunk gathers its int8 values, dequantized once waited for
        if self.int8 is not None:
            target = torch.empty(writer.numel(), dtype=torch.int8, device=writer.device)
        shard = self.param_store.on_device(target, place.rank, place.count)  # an offloaded one: into its own slot
        if place.count > 1:
            self.gather_work = all_gather_into(target, shard, place.group_or(group), counter, async_op=True)
        elif self.int8 is not None:  # one rank: its int8 shard is the chunk, dequantized from where it is
            target = shard
        elif shard.data_ptr() != target.data_ptr():  # one rank: its shard is the chunk (Note [paging in one process])
            target.copy_(shard)
        if self.int8 is not None:
            self.int8.gathering = target
        self.to(ChunkPhase.GATHERING)
        return True

    def wait(self) -> None:
        """Waits for the gather in flight, if any (GATHERING → GATHERED)."""
        if self.phase is ChunkPhase.GATHERING:
            work, self.gather_work = self.gather_work, None
            if work is not None:
                work.wait()
            if self.int8 is not None:  # Note [int8 frozen chunks]
                gathered, self.int8.gathering = self.int8.gathering, None
                self.int8.dequantize_chunk(gathered, self.writer)
            self.to(ChunkPhase.GATHERED)

    def release(self) -> bool:
        """Frees the full storage (waiting for a gather in flight first); returns whether it did. A WHOLE chunk (stages
        0-2, persistent chunks: one shard that always holds) has nothing to release."""
        if self.phase is ChunkPhase.WHOLE or self.phase is ChunkPhase.SHARDED:
            return False
        self.wait()
        self.writer.untyped_storage().resize_(0)
        self.to(ChunkPhase.SHARDED)
        return True

    def take_shard(self) -> None:
        """The full payload holds the starting values: this rank's shard of them goes to where the shard lives."""
        if self.phase is not ChunkPhase.WHOLE:
            self.param_store.write_home(shard_of(self._stored(self.param_chunk.payload, keep_scales=False),
                                                 self.place.rank, self.place.count))

    def refresh_shard(self) -> None:
        """After the gathered chunk was modified (the same way on every rank): its shard keeps the new values."""
        if self.phase is not ChunkPhase.WHOLE:
            with self.param_store.access(writes=True) as shard:
                shard.copy_(shard_of(self._stored(self.writer, keep_scales=True), self.place.rank, self.place.count))

    def _stored(self, full: torch.Tensor, keep_scales: bool) -> torch.Tensor:
        """The full chunk's values as its shards keep them: int8 in an int8 chunk (every rank quantizes the same
        values the same way; keep_scales: rows left as they were keep their values), else themselves."""
        return full if self.int8 is None else self.int8.quantize_chunk(full, keep_scales)

    # ---- gradients: accept, complete, retire (Note [sharded gradients]) -------------------------
    def accept_grad(self, p: nn.Parameter) -> None:
        """The gradient autograd just gave member `p` moves into its view of the gradient chunk (p.grad becomes
        the view). Stages 0-1 (no gradient shard): the chunk always has storage and autograd accumulated into the
        view already, unless user code replaced .grad."""
        view = self.grad_view(p)
        if p.grad is view:
            return
        if not self.shards_grads:
            self.adopt_grad(p)
            return
        self._materialize_grads()
        if id(p) in self.written:  # a second gradient for it in this backward (without the reducer armed)
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
            self.written.add(id(p))
        p.grad = view

    def adopt_grad(self, p: nn.Parameter) -> None:
        """Note [parameters as chunk views]: a .grad replaced by user code is copied back into the chunk."""
        view = self.grad_view(p)
        if p.grad is view or (self.shards_grads and p.grad is None):
            return
        if p.grad is not None:
            view.copy_(p.grad)
        # None: no local gradient since the user dropped it; the view already holds what the chunk
        # has (zeros, or other ranks' contributions after the all-reduce): keep it, never zero it
        p.grad = view

    def complete_grads(self) -> torch.Tensor:
        """The full gradient buffer for its reduce-scatter: zeros where no gradient arrived, and in the padding. The
        degenerate layout's chunk is that already (zeroed after each update, accumulated into by backward)."""
        if not self.shards_grads:
            return self.grad_chunk.payload
        self._materialize_grads()
        payload, used = self.grad_chunk.payload, self.grad_chunk.used
        for p, view in zip(self.params, self.grad_views):
            if id(p) not in self.written:
                view.zero_()
                p.grad = view
                self.written.add(id(p))
        payload.narrow(0, used, payload.numel() - used).zero_()
        return payload

    def retire(self) -> None:
        """After the reduce-scatter: this rank's shard of the sum joins its gradient shard; the full buffer goes. The
        degenerate layout's reduced chunk is its shard already."""
        if not self.shards_grads:
            return
        self.grad_store.accumulate(shard_of(self.grad_chunk.payload, self.place.rank, self.place.count),
                                   first=self.grad_fresh)
        self.grad_fresh = False
        self.release_grads()

    def release_grads(self) -> None:
        """The full gradient buffer loses its storage (its views stay valid); the members' .grad become None."""
        for p in self.params:
            p.grad = None
        self.grad_chunk.payload.untyped_storage().resize_(0)
        self.grad_live = False

    def zero_grad_shard(self) -> None:
        """The gradient shard becomes logically zero (lazily: Note [sharded gradients]); a full buffer left live (a
        backward that raised half-way) goes. The degenerate layout's shard, the whole chunk, is zeroed."""
        if not self.shards_grads:
            self.grad_chunk.payload.zero_()
            return
        self.grad_fresh = True
        self.grad_store.forget()  # a managed shard reads as zeros again without I/O
        if self.grad_live:
            self.release_grads()

    def _materialize_grads(self) -> None:
        if not self.grad_live:
            self.grad_chunk.payload.untyped_storage().resize_(self.grad_chunk.nbytes)
            self.written.clear()
            self.grad_live = True

    # ---- members and gradients -----------------------------------------------------------------
    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        return self._grad_view_of[id(p)]

    @property
    def expected_grads(self) -> int:
        """Gradients a backward delivers to this chunk: one per member (none to a frozen chunk)."""
        return 0 if self.frozen else len(self.params)

    @property
    def ready_grads(self) -> int:
        return len(self.arrived)

    @property
    def numel(self) -> int:
        """Elements of the chunk (its capacity, padding included)."""
        return self.param_chunk.numel

    # ---- reading it ----------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"ChunkState(chunk {self.index}: {self.phase.name}, {len(self.params)} params, "
                f"{self.param_chunk.used}/{self.numel} elements {self.param_chunk.dtype}, "
                f"grads {self.ready_grads}/{self.expected_grads})")

    def describe(self, names: dict[int, str] | None = None) -> str:
        """Every field that says where the chunk is, one per line (names: id(parameter) -> its name)."""
        names = names or {}
        members = ", ".join(names.get(id(p), f"<{tuple(p.shape)}>") for p in self.params)
        lines = [repr(self), f"  members: {members}"]
        if self.frozen:
            lines.append("  frozen (no gradients, masters or optimizer states)"
                         + (", int8 shards with per-row scales" if self.int8 is not None else ""))
        if self.persistent:
            lines.append("  persistent (below the persistence threshold: never released)")
        for what, shard, handle in (("param", self.param_shard, self.param_handle),
                                    ("grad", self.grad_shard, self.grad_handle)):
            if shard is not None:
                where = f"manager chunk {handle}" if handle is not None else "in memory"
                lines.append(f"  {what} shard: {shard.numel()} elements, {where}")
        if self.owners:
            done = f", {len(self.done)} done this pass" if self.done else ""
            lines.append(f"  owned by: {', '.join(sorted(type(m).__name__ for m in self.owners))}{done}")
        if self.held:
            lines.append(f"  held gathered by {self.held} gathered() block(s)")
        if self.shards_grads:
            lines.append(f"  full grad buffer: {'live' if self.grad_live else 'released'}, "
                         f"{len(self.written)} member(s) written; shard {'zero' if self.grad_fresh else 'accumulated'}")
        return "\n".join(lines)
