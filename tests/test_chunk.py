"""Chunks: views alias their chunk, packing follows registration order, capacity search limits padding."""

from __future__ import annotations

import pytest
import torch

from offload.chunk import ChunkList, plan_slots


def test_views_alias_their_chunk_and_keep_values():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
    chunks = ChunkList(tensors, capacity=20)
    for t, v in zip(tensors, chunks.views):
        assert torch.equal(t, v)
    chunks.chunks[0].payload.fill_(7.0)
    assert all(float(v.flatten()[0]) == 7.0 for v in chunks.views[:2])
    chunks.views[2].fill_(-1.0)
    assert float(chunks.chunks[chunks.slots[2].chunk].payload[chunks.slots[2].offset]) == -1.0


def test_packing_is_in_registration_order_with_padding_only_at_chunk_ends():
    slots, sizes = plan_slots([torch.Size([6]), torch.Size([3]), torch.Size([4]), torch.Size([25]), torch.Size([2])],
                              10)
    assert [(s.chunk, s.offset) for s in slots] == [(0, 0), (0, 6), (1, 0), (2, 0), (3, 0)]
    assert sizes == [9, 4, 25, 2]  # an oversized tensor gets its own chunk; every chunk is trimmed to what it holds


def test_chunks_hold_no_padding_beyond_alignment():
    # a GPT block whose MLP weights nearly fill a chunk each: untrimmed, the room a weight did not fit into
    # was padding (31% of the model at the default capacity, Note [chunk packing])
    n = 1024
    block = [(n,), (n,), (3 * n * n,), (3 * n,), (n * n,), (n,), (n,), (n,), (4 * n * n,), (4 * n,), (4 * n * n,), (n,)]
    shapes = [torch.Size(s) for s in block * 4]
    total = sum(s.numel() for s in shapes)
    for align in (1, 2, 8):
        slots, sizes = plan_slots(shapes, capacity=4 * n * n, align=align, first_capacity=n * n // 2)
        assert all(size % align == 0 for size in sizes)
        assert sum(sizes) - total < align * len(sizes)  # only the rounding up to `align`
        ends = [0] * len(sizes)
        for slot in slots:  # every tensor inside its chunk, none overlapping the next
            assert slot.offset >= ends[slot.chunk] and slot.offset + slot.numel <= sizes[slot.chunk]
            ends[slot.chunk] = slot.offset + slot.numel


def test_first_chunk_may_be_smaller():
    shapes = [torch.Size([3]), torch.Size([3]), torch.Size([8]), torch.Size([2]), torch.Size([5])]
    slots, sizes = plan_slots(shapes, capacity=10, first_capacity=4)
    assert [(s.chunk, s.offset) for s in slots] == [(0, 0), (1, 0), (2, 0), (2, 8), (3, 0)]
    assert sizes == [3, 3, 10, 5]
    # a first tensor larger than the first chunk gets a chunk of its own, then regular chunks follow
    slots, sizes = plan_slots([torch.Size([6]), torch.Size([4])], capacity=10, first_capacity=4)
    assert sizes == [6, 4] and [s.chunk for s in slots] == [0, 1]


def test_tensor_states_follow_the_legal_transitions():
    from offload.states import IllegalTransition, TensorState

    chunks = ChunkList([torch.zeros(4), torch.zeros(4)], capacity=8)
    chunk = chunks.chunks[0]
    assert chunk.states == [TensorState.HOLD, TensorState.HOLD] and chunk.state is TensorState.HOLD
    chunk.set_state(0, TensorState.COMPUTE)
    assert chunk.state is TensorState.COMPUTE and chunk.pinned  # one tensor in use pins the chunk
    chunk.set_state(0, TensorState.HOLD_AFTER_FWD)
    assert chunk.state is TensorState.HOLD and not chunk.pinned
    with pytest.raises(IllegalTransition, match="HOLD_AFTER_FWD → HOLD_AFTER_BWD"):
        chunk.set_state(0, TensorState.HOLD_AFTER_BWD)  # backward must use it (COMPUTE) first
    assert chunk.states[0] is TensorState.HOLD_AFTER_FWD  # a rejected change leaves the state as it was
    chunk.set_state(0, TensorState.COMPUTE)
    chunk.set_state(0, TensorState.HOLD_AFTER_BWD)
    for i in (0, 1):
        chunk.set_state(i, TensorState.FREE)
    assert chunk.state is TensorState.FREE
    with pytest.raises(IllegalTransition, match="FREE → HOLD_AFTER_FWD"):
        chunk.set_state(1, TensorState.HOLD_AFTER_FWD)
