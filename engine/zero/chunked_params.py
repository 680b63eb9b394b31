"""The model's parameters packed into chunks: the trainable ones with a gradient chunk for each, the frozen ones in
chunks of their own.

Note [parameters as chunk views]
Each trainable parameter keeps its identity (the nn.Parameter object the model and user code
hold), but its `.data` becomes a view into a parameter chunk and its `.grad` a view into the
matching gradient chunk at the same offset. Autograd accumulates into an existing `.grad` in
place, so gradients land in the chunk directly and accumulate across micro-steps there. The
optimizer steps whole chunk payloads (one tensor per chunk), which updates every view.
If user code replaces a `.grad` (e.g. `model.zero_grad(set_to_none=True)` before a backward),
`adopt_foreign_grad` copies the new tensor into the chunk and restores the view. If it replaces
a `.data` (`model.to(...)`, `.double()`, `load_state_dict(assign=True)` after initialize), the
parameter no longer trains; `sync_views` detects that at every update and raises.
The config's optimizer steps chunk payloads, so `engine.optimizer.zero_grad()` cannot drop the
gradients; the engine zeroes the chunks itself after every update.
With sharded optimizer states (Note [sharding policy]) every chunk's size is a multiple of the
shard count and the optimizer steps only this rank's shard of each chunk: a view
payload[rank*n/w:(rank+1)*n/w] of the param chunk (engine.comm.shard_of), whose .grad is the same
range of the grad chunk. Each chunk's members, slots and stepped tensors are in its ChunkState
(Note [chunk phases]), `states[index]`.

Note [frozen chunks]
Parameters with requires_grad=False (a frozen base model under adapters; anywhere in the model, listed in a param
group or not) are packed into frozen chunks, by dtype (the compute dtype under bf16 / fp16, as the trainable
ones), after the trainable chunks: `states` are the trainable chunks, `frozen_states` the frozen ones, `all_states`
both, and chunk indices run over all of them (trainable first, so a trainable chunk's index is the same in both).
A frozen chunk has a param chunk only (its ChunkState's grad_chunk is None): no gradient chunk, fp32 master or
optimizer state; it is never reduced, stepped or counted in the gradient norm, so everything gradient- or
optimizer-side (the reducer, ShardedGrads, MasterWeights, the optimizer binding, norms, the checkpoint's chunk
layout) sees `states` only, while ShardedParams, the gatherer, loading and the runtime's start see `all_states`.
- Stages 0-2: frozen chunks are WHOLE on the device. Stage 3: sharded like trainable ones (the persistence
  threshold applies), gathered before a module's forward and again when backward reaches it (gradients flow
  through frozen weights to earlier trainable ones); after the forward they are released as trainable ones are,
  and in backward, since no gradient arrives to say they are done, once the backward of every call over them
  (counted per call: a module applied twice waits for both) has computed its inputs' gradients (the gatherer's
  `_after_frozen_backward`), or at the pass end where that does not prove the weight done with (a module owning
  one also trains a parameter of its own, a leaf input, a pipeline's passes, a leaf module's chunk).
- With offload_param (stage 3) frozen shards live in the chunk manager as kind "frozen" on the CPU or NVMe tier,
  read only (a gather accesses them with writes=False): once the start (or zero_init, or a checkpoint load) wrote
  them, `settle_frozen` puts each on its home tier, one write to NVMe, and from there a page-out is a drop. The
  manager counts NVMe writes by kind (`stats.nvme_written_bytes["frozen"]`), which stays constant over training.
- The runtime's start gives every rank rank 0's values of frozen chunks as of trainable ones.
- Whether a parameter trains is fixed at initialize(): a chunk's kind decides its gradient, master and optimizer
  state. Unfreezing a frozen parameter or freezing a trainable one afterwards is refused, naming the parameter,
  at the next backward and before any update (`check_trainability`); the fix is to build the engine again.
- Checkpoints save frozen parameters whole, as "extra" entries (gathered chunk by chunk under stage 3), and load
  them into their chunks.
- `device_state_bytes` counts them under "param".

Note [a bounded start]
initialize never holds the whole model on the device in any form on its way into chunks, so a model whose
16-bit weights exceed the device starts with offload_param (ZeRO-Infinity's promise):
- a stage-3 chunk's full payload starts released (chunks are made one at a time, each freed once its views are
  cut); its parameters' values stay where the model held them — with offload_param the sharded trainable
  parameters are left on the host by initialize — until the runtime's start fills the chunk, broadcasts it
  (rank 0's values), keeps this rank's shard (an offloaded shard goes straight to its home on the host) and
  releases it: one full chunk at a time;
- shards, gradient shards and fp32 masters that a chunk manager will hold start as placeholders, and the fp32
  master gradients are made one at a time and freed at once (they get storage only while an update stages them).
The start samples the device bytes this accounts for at its peaks (`DeviceMemory.sample`): that is what the CPU
seam can measure; on CUDA the allocator's own peak is the measure (scripts/gpu_check.py). Not yet with tensor,
pipeline or expert parallelism, whose layers are rebuilt on the device before chunking.

Note [stage predicates]
A ZeRO stage is a layout, so callers ask the layout what it does rather than which parts it lacks:
`gathers_params` (stage 3, or paging in one process: chunks are gathered around their use),
`shards_grads` (gradients persist as this rank's shards), `has_masters` (bf16 / fp16: fp32 masters are
stepped), `sharded` (more than one shard: optimizer states are split). What is the same for every stage is
not asked at all: the runtime's gatherer exists for every stage and only touches chunks that are not WHOLE,
so with none (stages 0-2) its passes cost nothing per chunk (Note [gathering around modules]); the reducer
exists whenever gradients are reduced or retired (`reduces_grads`).
`sharded_params` and `sharded_grads` exist at every stage. Where a stage does not shard them they are the
degenerate layout, marked by their flag (`ShardedParams.gathers`, `ShardedGrads.sharded`, which the first
two predicates read): each chunk is WHOLE, as a persistent stage-3 chunk is, and its shard is a view of its
payload (this rank's part where the optimizer states are sharded; a MemoryStore over it: no memory of its
own); gather, wait, release, take_shard and refresh_shard are no-ops,
`accept` adopts a replaced .grad (backward accumulated into the chunk already), `complete` is the chunk,
`retire` and `settle` do nothing, `zero` zeroes the chunk, and the byte counts of shards of their own
are 0. A step at stages 0-2 does the same arithmetic and collectives as if they were absent.
`masters` stays None under fp32 (read through `has_masters`): fp32 masters are a precision choice, not a
stage's layout, and an fp32 "master" that is the stepped tensor itself would still need every user of
masters (staging, rounding back, offload, checkpoints) to tell a copy from an alias.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import shard_of, shard_range
from engine.zero.chunk_layout import ChunkLayout
from engine.zero.chunk_loading import ChunkLoading
from engine.zero.chunk_norms import ChunkNorms
from engine.zero.chunk_packing import ChunkGroup, ChunkPacker, ExpertChunks
from engine.zero.chunk_queries import ChunkQueries
from engine.zero.chunk_state import ChunkPhase, ChunkState, ShardPlace
from engine.zero.grad_shards import ShardedGrads
from engine.zero.int8_frozen import Int8Rows
from engine.zero.master_weights import MasterWeights
from engine.zero.optimizer_binding import OptimizerBinding
from engine.zero.param_shards import ShardedParams
from offload.chunk import Slot

# how to change what trains: a checkpoint holds each parameter as it trained, so it loads into the same split only
REBUILD_TO_CHANGE_WHAT_TRAINS = (
    "state = engine.full_state_dict(), then a new model with model.load_state_dict(state), requires_grad set as "
    "wanted, and initialize(); the optimizer states start afresh")


class ChunkedParams(ChunkLoading, ChunkNorms, ChunkQueries, OptimizerBinding):
    """Owns the param and grad chunks of every trainable parameter, grouped as the optimizer groups them, and the
    param chunks of the frozen ones (Note [frozen chunks]): packs them (here) and keeps the parameters' views of
    them; loading values (ChunkLoading), gradient norms (ChunkNorms), queries (ChunkQueries) and the optimizer's
    binding (OptimizerBinding) are its parts in files of their own."""

    def __init__(self, param_groups: list[dict], layout: ChunkLayout, device: torch.device,
                 names: dict[int, str] | None = None, pending: set[int] | None = None,
                 experts: ExpertChunks | None = None, frozen: list[nn.Parameter] | None = None,
                 int8: frozenset[int] = frozenset()):
        """layout: how to pack and shard (ChunkLayout). pending: ids of parameters whose values `load` brings later
        (zero_init); memory that would only hold values transiently is then left untouched (uninitialized payloads).
        experts: parameters whose chunks have a place of their own. frozen: the model's parameters that do not train
        (in model order), packed into frozen chunks with those the param groups list (Note [frozen chunks]). int8:
        ids of frozen parameters kept in int8 chunks (Note [int8 frozen chunks])."""
        if experts is not None and layout.shard_count % experts.place.count:
            raise ValueError(f"expert chunks sharded {experts.place.count} ways must divide the shard count "
                             f"{layout.shard_count}")
        self.layout = layout
        self.shard_count, self.shard_rank = layout.shard_count, layout.shard_rank
        self.has_experts = experts is not None
        pending = pending or set()
        self.values_pending = bool(pending)
        self._names = names or {}
        packer = ChunkPacker(layout, device, pending, experts, int8)
        trainable_groups = self._pack(param_groups, frozen or [], packer)
        self._loose = packer.loose  # real values next to zero_init's (load_loose)
        self.groups: list[ChunkGroup] = packer.groups[:trainable_groups]
        self.frozen_groups: list[ChunkGroup] = packer.groups[trainable_groups:]
        self._index_states(packer, device)
        self._shard(layout)
        # names come in model order; without them, registration order stands in
        self._position = {pid: i for i, pid in enumerate(self._names)}
        for p in self.params:
            self._position.setdefault(id(p), len(self._position))

    def _pack(self, param_groups: list[dict], frozen: list[nn.Parameter], packer: ChunkPacker) -> int:
        """Packs the trainable parameters group by group, then the frozen ones (Note [frozen chunks]); returns how
        many groups train."""
        seen: set[int] = set()
        listed_frozen: list[nn.Parameter] = []
        for origin, group in enumerate(param_groups):
            trainable = []
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(f"parameter '{self.name_of(p)}' is listed twice in the param groups; list each "
                                     "parameter once")
                seen.add(id(p))
                if not p.requires_grad:
                    listed_frozen.append(p)
                    continue
                if not p.is_floating_point():
                    raise TypeError(f"parameter '{self.name_of(p)}' of dtype {p.dtype} requires grad but only floating "
                                    "dtypes train; set requires_grad=False on it")
                trainable.append(p)
            packer.pack(trainable, {k: v for k, v in group.items() if k != "params"}, trains=True, origin=origin)
        if not packer.groups:
            raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
        frozen_once: dict[int, nn.Parameter] = {}  # each once (tied), in model order, then those only the groups list
        for p in [*frozen, *listed_frozen]:
            if not p.requires_grad and p.is_floating_point():  # integer ones stay module parameters, as buffers do
                frozen_once.setdefault(id(p), p)
        trainable_groups = len(packer.groups)
        packer.pack(list(frozen_once.values()), {}, trains=False)
        return trainable_groups

    def _index_states(self, packer: ChunkPacker, device: torch.device) -> None:
        """Note [chunk phases]: one state per chunk index (param and grad chunk alike), in group order; frozen chunks
        after the trainable ones (Note [frozen chunks])."""
        self.all_states: list[ChunkState] = []
        self._slot_of: dict[int, tuple[int, Slot]] = {}  # id(parameter) -> (its chunk's index, its slot)
        self._sources: dict[int, list[tuple[Slot, torch.Tensor]]] = {}  # chunk index -> the values it starts from
        for gi, g in enumerate(packer.groups):
            base = len(self.all_states)
            for (group, chunk), values in packer.sources.items():
                if group == gi:
                    self._sources[base + chunk] = values
            self._add_states(g, base, device)
            g.states = self.all_states[base:]
        trainable_chunks = sum(len(g.param_chunks.chunks) for g in self.groups)
        self.states: list[ChunkState] = self.all_states[:trainable_chunks]  # the trainable chunks
        self.frozen_states: list[ChunkState] = self.all_states[trainable_chunks:]
        # Note [global norm under tensor parallelism]: each parameter's share of the squared global norm
        self.norm_weights: dict[int, float] = {}
        self._param_chunk_of = {pid: index for pid, (index, _) in self._slot_of.items()}
        self._chunk_of = {pid: index for pid, index in self._param_chunk_of.items() if index < trainable_chunks}
        self.params = [p for g in self.groups for p in g.params]
        self._param_views = [pv for g in self.groups for pv in g.param_chunks.views]
        self.frozen_params = [p for g in self.frozen_groups for p in g.params]
        self._frozen_views = [pv for g in self.frozen_groups for pv in g.param_chunks.views]

    def _add_states(self, g: ChunkGroup, base: int, device: torch.device) -> None:
        members: list[list[tuple[nn.Parameter, Slot]]] = [[] for _ in g.param_chunks.chunks]
        for p, slot in zip(g.params, g.param_chunks.slots):
            self._slot_of[id(p)] = (base + slot.chunk, slot)
            members[slot.chunk].append((p, slot))
        grad_chunks = g.grad_chunks.chunks if g.grad_chunks is not None else [None] * len(members)
        grad_views = g.grad_chunks.views if g.grad_chunks is not None else []
        grad_view_of = {id(p): v for p, v in zip(g.params, grad_views)}
        for i, (pc, gc, m) in enumerate(zip(g.param_chunks.chunks, grad_chunks, members)):
            phase = ChunkPhase.GATHERED if self.layout.gathers_params and not g.persistent else ChunkPhase.WHOLE
            # what the optimizer steps: whole payloads, or this rank's shards of them (made once: the
            # optimizer keys its state by these tensor objects); stage 3 / 2 / masters replace them in _shard
            self.all_states.append(ChunkState(
                index=base + i, params=[p for p, _ in m], slots=[s for _, s in m], param_chunk=pc,
                grad_chunk=gc, grad_views=[grad_view_of[id(p)] for p, _ in m if id(p) in grad_view_of],
                phase=phase, persistent=g.persistent, place=g.place,
                int8=Int8Rows([s for _, s in m], device, pc.dtype, pc.numel) if g.int8 else None,
                stepped=None if gc is None else self._owned(pc.payload, g.place),
                stepped_grad=None if gc is None else self._owned(gc.payload, g.place)))

    def _shard(self, layout: ChunkLayout) -> None:
        """What the optimizer steps: this rank's shards (stages 2 and 3) and fp32 masters of them (bf16 / fp16)."""
        # stage 3: persistent parameter shards; full chunks only while gathered (Note [sharded parameters]);
        # stages 0-2: the degenerate layout, each chunk its own one shard (Note [stage predicates]); frozen chunks too
        self.sharded_params = ShardedParams(self.all_states, placeholders="param" in layout.offloaded,
                                            gathers=layout.gathers_params)
        if layout.gathers_params:
            for state in self.states:
                state.stepped = state.param_shard
        # stage 2: persistent gradient shards; full gradient chunks only during backward (Note [sharded gradients]);
        # stages 0-1: the degenerate layout, likewise
        self.sharded_grads = ShardedGrads(self.states, placeholders="grad" in layout.offloaded,
                                          sharded=layout.shard_grads and layout.grad_sharding)
        if self.shards_grads:
            for state in self.states:
                state.stepped_grad = state.grad_shard
        # bf16 / fp16: the optimizer steps fp32 masters of the stepped tensors (Note [master weights])
        self.masters: MasterWeights | None = None
        self._retired_norms = {}  # Note [the norm where the gradient is reduced]
        if layout.compute_dtype != torch.float32 and layout.fp32_masters:
            self.masters = MasterWeights([s.stepped for s in self.states], [s.stepped_grad for s in self.states],
                                         placeholders="optim" in layout.offloaded)
            for state, master, grad in zip(self.states, self.masters.masters, self.masters.grads):
                state.stepped, state.stepped_grad = master, grad
            if not self.values_pending and not layout.gathers_params and "optim" not in layout.offloaded:
                self.masters.sync_from_params()  # again once every rank holds rank 0's values (the runtime's start)

    def _owned_range(self, index: int, slot: Slot) -> tuple[int, int, int] | None:
        """(start of this rank's elements in chunk `index`, lo, hi): the part [lo, hi) of the slot's elements
        (chunk offsets) this rank steps, or None when it steps none of them."""
        place = self.all_states[index].place
        start, n = shard_range(self.all_states[index].numel, place.rank, place.count)
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, start + n)
        return (start, lo, hi) if lo < hi else None

    # ---- what a checkpoint reads and writes (Note [checkpoint layout]) ----
    @property
    def sharded(self) -> bool:
        return self.shard_count > 1

    # ---- the layout's stage, by what it does (Note [stage predicates]) ----
    @property
    def gathers_params(self) -> bool:
        """Stage 3 (or paging): parameter chunks are gathered around their use, each rank keeping its shards."""
        return self.sharded_params.gathers

    @property
    def shards_grads(self) -> bool:
        """Stages 2 and 3 (or an offloaded optimizer's one shard): gradients persist as this rank's shards."""
        return self.sharded_grads.sharded

    @property
    def has_masters(self) -> bool:
        """bf16 / fp16: the optimizer steps fp32 masters of the stepped tensors."""
        return self.masters is not None

    def _owned(self, payload: torch.Tensor, place: ShardPlace) -> torch.Tensor:
        """This rank's shard of a payload (the whole payload when not sharded)."""
        if not self.sharded:
            return payload
        return view_of_released(payload, lambda t: shard_of(t, place.rank, place.count))

    def check_trainability(self) -> None:
        """Note [frozen chunks]: every parameter trains as it did at initialize() (requires_grad unchanged), else
        raise naming it: its chunk kind (gradients, masters, optimizer states or none) was laid out then. It checks
        this rank's parameters only: every rank must freeze the same ones (as the chunk layout they share assumes)."""
        for p in self.params:
            if not p.requires_grad:
                raise RuntimeError(
                    f"parameter '{self.name_of(p)}' was frozen (requires_grad=False) after initialize(), but it lives "
                    "in a trainable chunk whose gradient, master and optimizer states were laid out then, so it would "
                    "silently keep being updated; set requires_grad before initialize(): build the engine again "
                    f"({REBUILD_TO_CHANGE_WHAT_TRAINS})")
        for p in self.frozen_params:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter '{self.name_of(p)}' was unfrozen (requires_grad=True) after initialize(), but it lives "
                    "in a frozen chunk, which has no gradient, master or optimizer state, so it would silently never "
                    "train; set requires_grad before initialize(): build the engine again "
                    f"({REBUILD_TO_CHANGE_WHAT_TRAINS})")

    def sync_views(self) -> None:
        """Before an update: every parameter trains as at initialize() and its .data still aliases its chunk (else
        raise), every .grad is its view again."""
        self.check_trainability()
        for p, view in zip(self.frozen_params, self._frozen_views):
            if p.data_ptr() != view.data_ptr() or p.dtype != view.dtype or p.device != view.device:
                raise RuntimeError(
                    f"frozen parameter '{self.name_of(p)}' no longer lives in its chunk (now {p.dtype} on {p.device}), "
                    "so its values would be lost; convert or move the model (.to(), .half(), ...) before "
                    "initialize(), and load weights with load_state_dict() without assign=True")
        for p, view in zip(self.params, self._param_views):
            if p.data_ptr() != view.data_ptr() or p.dtype != view.dtype or p.device != view.device:
                raise RuntimeError(
                    f"parameter '{self.name_of(p)}' no longer lives in its chunk (now {p.dtype} on {p.device}), so it "
                    "would silently stop training; convert or move the model (.to(), .half(), ...) before "
                    "initialize(), and load weights with load_state_dict() without assign=True")
            if not self.shards_grads:  # stage 2: .grad is None between backward passes
                self.adopt_foreign_grad(p)

    def adopt_foreign_grad(self, p: nn.Parameter) -> None:
        """Note [parameters as chunk views]: a replaced .grad is copied back into its chunk."""
        self.states[self._chunk_of[id(p)]].adopt_grad(p)

    def zero_grads(self) -> None:
        """Zeroes the gradient shards (the degenerate layout's: the chunks); a .grad replaced by user code is
        re-adopted by the hooks or sync_views."""
        self.sharded_grads.zero()
        self.forget_retired_norm()

def view_of_released(payload: torch.Tensor, make_view):
    """make_view(payload), also where the payload's storage is released (Note [a bounded start]): a view is checked
    against its storage's size, so the storage gets its bytes back for that moment and is freed again. The view
    shares the storage, as the views of a released chunk do."""
    storage = payload.untyped_storage()
    if storage.nbytes() > 0:
        return make_view(payload)
    storage.resize_(payload.numel() * payload.element_size())
    try:
        return make_view(payload)
    finally:
        storage.resize_(0)
