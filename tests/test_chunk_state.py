"""One state per chunk (Note [chunk phases]): the phase table, and the phases a real stage-3 run goes through."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from engine import initialize
from engine.zero.chunk_layout import ChunkLayout
from engine.zero.chunk_state import ChunkPhase, ChunkState, IllegalPhaseTransition
from engine.zero.chunked_params import ChunkedParams
from tests.distributed import run_distributed
from tests.reference import micro_batches, tiny_gpt, token_batches
from tests.test_zero import GLOBAL_BATCH, zero_config

P = ChunkPhase
# written out here on purpose: the legal moves Note [chunk phases] names, and nothing else
LEGAL = {(P.SHARDED, P.GATHERING), (P.GATHERING, P.GATHERED), (P.GATHERED, P.SHARDED)}


def _state(phase: ChunkPhase, index: int = 7) -> ChunkState:
    chunked = ChunkedParams([{"params": [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]}],
                            ChunkLayout(16), torch.device("cpu"))
    state = chunked.states[0]
    state.index, state.phase = index, phase
    return state


@pytest.mark.parametrize("old,new", list(itertools.product(ChunkPhase, repeat=2)),
                         ids=lambda p: p.name)
def test_only_the_listed_phase_transitions_are_legal(old, new):
    state = _state(old)
    if (old, new) in LEGAL:
        state.to(new)
        assert state.phase is new
        return
    with pytest.raises(IllegalPhaseTransition) as error:
        state.to(new)
    message = str(error.value)
    assert "chunk 7" in message and f"{old.name} → {new.name}" in message, message
    assert state.phase is old


def test_an_unsharded_chunk_is_whole_and_answers_what_state_it_is_in():
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(20))]
    chunked = ChunkedParams([{"params": params}], ChunkLayout(20), torch.device("cpu"),
                            names={id(p): f"w{i}" for i, p in enumerate(params)})
    assert [s.index for s in chunked.states] == list(range(chunked.chunk_count()))
    assert all(s.phase is ChunkPhase.WHOLE for s in chunked.states)
    first = chunked.states[0]
    assert first.params == params[:2] and first.expected_grads == 2 and first.ready_grads == 0
    assert first.stepped is first.param_chunk.payload and first.stepped_grad is first.grad_chunk.payload
    assert repr(first).startswith("ChunkState(chunk 0: WHOLE, 2 params, 17/17 elements")  # trimmed to its tensors
    assert "members: w0, w1" in chunked.describe(0)


def _phases(engine) -> list[str]:
    return [s.phase.name for s in engine.chunked.states]


def _stage3_worker(rank, world):
    # threshold 100: the layer norms' small parameters get persistent (WHOLE) chunks, the rest are sharded
    engine = initialize(tiny_gpt(seed=rank), zero_config(3, GLOBAL_BATCH // world, 1, chunk_size=6_000,
                                                         stage3_param_persistence_threshold=100))
    chunked = engine.chunked
    linear = engine.module.blocks[0].attn.c_proj  # a large weight (sharded), a small bias (persistent)
    chunks = [chunked.chunk_index()[id(linear.weight)], chunked.chunk_index()[id(linear.bias)]]
    seen_in_forward: list[list[str]] = []
    # registered after the gatherer's: runs once the module's chunks were demanded
    linear.register_forward_pre_hook(lambda m, a: seen_in_forward.append(
        [chunked.states[c].phase.name for c in chunks]))
    record = {"start": _phases(engine), "persistent": [s.persistent for s in chunked.states]}
    (x,) = micro_batches(token_batches(1, GLOBAL_BATCH)[0], rank, world, 1)
    loss = engine(x, x)
    record["in_forward"] = seen_in_forward[0]
    record["after_forward"] = _phases(engine)
    engine.backward(loss)
    record["after_backward"] = _phases(engine)
    record["grads"] = [(s.ready_grads, s.expected_grads, s.grad_live, s.grad_fresh) for s in chunked.states]
    engine.step()
    record["after_step"] = _phases(engine)
    record["grads_after_step"] = [(s.grad_live, s.grad_fresh) for s in chunked.states]
    with engine.gathered_parameters():
        record["in_gathered"] = _phases(engine)
        record["held"] = [s.held for s in chunked.states]
    record["after_gathered"] = _phases(engine)
    record["describe"] = chunked.describe(chunks[0])
    return record


def test_stage3_chunk_phases_through_forward_backward_and_step():
    for record in run_distributed(_stage3_worker, 2):
        persistent = record["persistent"]
        assert any(persistent) and not all(persistent), persistent
        at_rest = ["WHOLE" if keep else "SHARDED" for keep in persistent]
        assert record["start"] == at_rest  # the shards took the starting values and released the chunks
        assert record["in_forward"] == ["GATHERED", "WHOLE"]
        assert record["after_forward"] == at_rest  # the pass released what it gathered
        assert record["after_backward"] == at_rest
        # every member's gradient arrived in the synchronized backward; reduced shards hold them, buffers are gone
        assert all(ready == expected > 0 and not live and not fresh
                   for ready, expected, live, fresh in record["grads"]), record["grads"]
        assert record["after_step"] == at_rest
        assert all(not live and fresh for live, fresh in record["grads_after_step"])  # zeroed (lazily) by the step
        assert record["in_gathered"] == ["WHOLE" if keep else "GATHERED" for keep in persistent]
        assert record["held"] == [1] * len(persistent)  # the block holds every chunk it asked for
        assert record["after_gathered"] == at_rest
        described = record["describe"]
        assert "SHARDED" in described and "blocks.0.attn.c_proj.weight" in described and "owned by:" in described, \
            described
