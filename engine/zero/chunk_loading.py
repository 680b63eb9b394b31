"""Values written into the chunks from outside the optimizer: zero_init's parameters (Note [zero_init]), the
starting values of a bounded start (Note [a bounded start]), and fp32 masters following parameters that user code
changed (Note [master weights])."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import broadcast_from, shard_range
from engine.zero.chunk_state import ChunkPhase, ChunkState
from engine.zero.int8_frozen import Int8Rows
from engine.zero.weight_files import FileRange


class ChunkLoading:
    """ChunkedParams' loading of values (a part of it: the attributes below are ChunkedParams')."""

    all_states: list[ChunkState]  # trainable and frozen chunks (Note [frozen chunks])

    def load(self, p: nn.Parameter, value: torch.Tensor, keep_scales: bool = False) -> None:
        """Note [zero_init]: parameter `p`'s values into its chunk view, or with stage 3 into this rank's shard.
        keep_scales: an int8 chunk tries each row's own scale first (a checkpoint's values: Note [int8 frozen
        chunks]); else the values are new and quantized afresh."""
        flat = value.reshape(-1)
        if self._int8_of(p) is not None:  # every rank has the whole value: each sets every row's scale
            self._fill_int8(p, lambda lo, hi: flat[lo:hi], whole=True, keep_scales=keep_scales)
            return
        self._fill(p, lambda target, first: target.copy_(flat.narrow(0, first, target.numel())))

    def load_loose(self, group, comm) -> None:
        """In a model built under zero_init, the parameters made outside the block with their values (PEFT's
        adapters): rank 0's values (broadcast over each chunk's group; `group` for dense ones) into their chunks."""
        loose, self._loose = self._loose, []
        for p, value in loose:
            state = self.all_states[self._slot_of[id(p)][0]]
            value = value.to(state.param_chunk.payload.device)
            chunk_group = state.place.group_or(group)
            if dist.is_initialized() and dist.get_world_size(chunk_group) > 1:
                broadcast_from(value, 0, chunk_group, comm)
            self.load(p, value)

    def load_file(self, p: nn.Parameter, source: FileRange) -> int:
        """Note [streamed weights]: as `load`, reading from the file only the elements this rank keeps; returns the
        bytes read."""
        if self._int8_of(p) is not None:  # the rows its elements touch; finish_loading joins the ranks' scales
            read = self._fill_int8(p, lambda lo, hi: source.read(lo, hi - lo), whole=False, keep_scales=False)
            return read * source.dtype.itemsize
        return self._fill(p, source.read_into) * source.dtype.itemsize

    def _int8_of(self, p: nn.Parameter) -> Int8Rows | None:
        return self.all_states[self._slot_of[id(p)][0]].int8

    def _fill_int8(self, p: nn.Parameter, values: Callable[[int, int], torch.Tensor], whole: bool,
                   keep_scales: bool) -> int:
        """Note [int8 frozen chunks]: the part of `p` this rank keeps, quantized by rows, into its int8 shard;
        values(lo, hi): elements [lo, hi) of `p`'s flattened values. Returns the elements read."""
        index, slot = self._slot_of[id(p)]
        state = self.all_states[index]
        part = self._owned_range(index, slot)
        if part is None:
            return state.int8.fill(slot.offset, values, None, 0, whole, keep_scales) if whole else 0
        start, lo, hi = part
        with state.param_store.access(writes=True) as shard:
            return state.int8.fill(slot.offset, values, shard.narrow(0, lo - start, hi - lo), lo - slot.offset,
                                   whole, keep_scales)

    def _fill(self, p: nn.Parameter, fill: Callable[[torch.Tensor, int], object]) -> int:
        """fill(target, first): elements [first, first + target.numel()) of `p`'s flattened values into `target`,
        for the part of `p` this rank keeps; returns that part's number of elements."""
        index, slot = self._slot_of[id(p)]
        state = self.all_states[index]
        if state.phase is ChunkPhase.WHOLE:  # the payload always holds the values (Note [chunk phases])
            fill(state.param_chunk.payload.narrow(0, slot.offset, slot.numel), 0)
            return slot.numel
        part = self._owned_range(index, slot)
        if part is None:
            return 0
        start, lo, hi = part
        with state.param_store.access(writes=True) as shard:  # in memory or in a manager
            fill(shard.narrow(0, lo - start, hi - lo), lo - slot.offset)
        return hi - lo

    def fill_from_sources(self, index: int) -> bool:
        """Note [a bounded start]: chunk `index`'s full payload gets storage and its parameters' starting values
        (from wherever the model held them); False if it has none waiting (not a stage-3 chunk, zero_init, or
        filled already)."""
        sources = self._sources.pop(index, None)
        if sources is None:
            return False
        state = self.all_states[index]
        payload = state.param_chunk.payload
        with torch.no_grad():
            state.writer.untyped_storage().resize_(state.param_chunk.nbytes)
            for slot, source in sources:
                state.param_chunk.view(slot).copy_(source)
            payload.narrow(0, state.param_chunk.used, payload.numel() - state.param_chunk.used).zero_()
        return True

    def finish_loading(self, group: dist.ProcessGroup | None = None) -> None:
        """After every `load`: zero the padding (uninitialized memory) and, with stage 3, release the chunks; int8
        chunks take every rank's scales (over each chunk's group; `group` for dense ones)."""
        for state in self.all_states:
            if state.int8 is not None:
                state.int8.join_scales(state.place.group_or(group))
        with torch.no_grad():
            for state in self.all_states:
                chunk = state.param_chunk
                if state.phase is not ChunkPhase.WHOLE:  # stage 3, not persistent: the shard holds the values
                    start, n = shard_range(chunk.numel, state.place.rank, state.place.count)
                    tail = max(chunk.used - start, 0)
                    if tail < n:
                        with state.param_store.access(writes=True) as shard:
                            shard.narrow(0, tail, n - tail).zero_()
                else:
                    chunk.payload.narrow(0, chunk.used, chunk.numel - chunk.used).zero_()
        if self.has_masters:
            self.masters.sync_from_params()
        for state in self.all_states:
            if state.phase is not ChunkPhase.WHOLE:  # stage 3: loaded into the shards, the full chunks go
                self.sharded_params.release(state.index)

    def master_values(self, p: nn.Parameter, full_master_chunk: torch.Tensor) -> torch.Tensor:
        """`p`'s fp32 values, cut from the full (gathered) master chunk it lives in."""
        _, slot = self._slot_of[id(p)]
        return full_master_chunk.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def load_masters(self, values: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Whole fp32 values of parameters (the same on every rank) into the part of their masters this rank steps:
        a whole-weights load keeps the fp32 values its 16-bit parameters round (Note [master weights])."""
        if not self.has_masters:
            return
        with torch.no_grad():
            for p, value in values:
                index, slot = self._slot_of.get(id(p), (None, None)) if id(p) in self._chunk_of else (None, None)
                part = self._owned_range(index, slot) if index is not None else None
                if part is not None:
                    start, lo, hi = part
                    flat = value.reshape(-1)
                    with self.masters.master(index, writes=True) as master:
                        master.narrow(0, lo - start, hi - lo).copy_(flat.narrow(0, lo - slot.offset, hi - lo))

    def resync_masters(self, params: list[nn.Parameter]) -> None:
        """After user code changed these parameters (the same way on every rank): their masters' parts
        follow (Note [master weights]); other parameters' masters keep their fp32 values."""
        if not self.has_masters:
            return
        with torch.no_grad():
            for p in params:
                index, slot = self._slot_of.get(id(p), (None, None)) if id(p) in self._chunk_of else (None, None)
                part = self._owned_range(index, slot) if index is not None else None
                if part is not None:
                    start, lo, hi = part
                    with self.masters.target(index, writes=False) as target, \
                            self.masters.master(index, writes=True) as master:  # wherever they live
                        master.narrow(0, lo - start, hi - lo).copy_(target.narrow(0, lo - start, hi - lo))
