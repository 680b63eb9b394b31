"""Chunks: views alias their chunk, packing follows registration order, capacity search limits padding."""

from __future__ import annotations

import pytest
import torch

from offload.chunk import ChunkList, best_capacity, padded_size, plan_slots


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
    assert sizes == [10, 10, 25, 2]  # oversized tensor gets its own chunk; the last chunk is trimmed


def test_capacity_search_reduces_padding_and_respects_bounds():
    # blocks of 6 + 6 + 3 elements waste a lot at capacity 10 (each chunk holds one 6)
    shapes = [torch.Size([6]), torch.Size([6]), torch.Size([3])] * 20
    best = best_capacity(shapes, 20)
    assert 10 <= best <= 20
    assert padded_size(shapes, best) < padded_size(shapes, 20)
    assert padded_size(shapes, best) == min(padded_size(shapes, c) for c in range(10, 21))
    assert best_capacity([torch.Size([5])], 100) == 5  # a small model: one chunk of its size


def test_first_chunk_may_be_smaller():
    shapes = [torch.Size([3]), torch.Size([3]), torch.Size([8]), torch.Size([2]), torch.Size([5])]
    slots, sizes = plan_slots(shapes, capacity=10, first_capacity=4)
    assert [(s.chunk, s.offset) for s in slots] == [(0, 0), (1, 0), (2, 0), (2, 8), (3, 0)]
    assert sizes == [4, 10, 10, 5]
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


def test_fast_padded_size_agrees_with_the_packing_it_summarizes():
    import random

    rng = random.Random(0)
    for _ in range(300):
        shapes = [torch.Size([rng.choice([1, 3, 7, 20, 64, 100, 300])]) for _ in range(rng.randint(1, 40))]
        capacity, align = rng.randint(1, 200), rng.choice([1, 4, 16])
        first = rng.choice([None, rng.randint(1, 100)])
        assert padded_size(shapes, capacity, align, first) == sum(plan_slots(shapes, capacity, align, first)[1])

