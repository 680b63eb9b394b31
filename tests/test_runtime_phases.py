"""The ZeRO runtime's phases (Note [step phases]): profiler ranges, illegal moves, and the public steps of
initialize() used on their own."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine import initialize
from engine.config import load_config
from engine.initialization import build_chunk_optimizer, chunk_parameters
from engine.mesh import Mesh
from engine.zero.chunk_state import ChunkPhase
from engine.zero.offload_policy import OffloadPolicy
from engine.zero.policy import ChunkKind
from engine.zero.runtime import TrainingPhase
from offload.chunk import Location
from tests.distributed import run_distributed
from tests.reference import assert_close_relative, tiny_gpt, token_batches, train_engine, train_reference

PHASES = ["pre_forward", "post_forward", "pre_backward", "post_backward", "pre_step", "update", "post_step"]
CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "steps_per_print": 10**6}


def _profiled_phases(engine, x) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.backward(engine(x, x))
        engine.step()
    names = [e.name for e in prof.events()]
    return [phase for phase in PHASES if f"tiers.zero.{phase}" in names]


def test_every_phase_of_a_step_is_a_profiler_range():
    engine = initialize(tiny_gpt(), CONFIG)
    x = token_batches(1, 4)[0]
    assert _profiled_phases(engine, x) == PHASES
    assert engine.runtime.phase is TrainingPhase.IDLE


def _stage3_phases_worker(rank, world):
    engine = initialize(tiny_gpt(), {**CONFIG, "train_micro_batch_size_per_gpu": 2,
                                     "zero_optimization": {"stage": 3}})
    x = token_batches(1, 4)[0][rank * 2:(rank + 1) * 2]
    return _profiled_phases(engine, x)


def test_every_phase_of_a_stage3_step_is_a_profiler_range_on_every_rank():
    assert run_distributed(_stage3_phases_worker, 2) == [PHASES, PHASES]


@pytest.mark.parametrize("stage", [0, 2])
def test_stages_0_to_2_have_a_gatherer_over_no_chunk(stage):
    """Note [stage predicates]: the gatherer exists for every stage; with every chunk WHOLE (the degenerate layout:
    one shard, the payload) it hooks no module and a step gathers nothing."""
    engine = initialize(tiny_gpt(), {**CONFIG, "zero_optimization": {"stage": stage}})
    shards = engine.chunked.sharded_params  # the degenerate layout: every chunk one whole shard, none transient
    assert not engine.chunked.gathers_params and shards.transient == () and shards.shard_bytes() == 0
    assert all(s.phase is ChunkPhase.WHOLE and _same_tensor(s.param_shard, s.param_chunk.payload)
               for s in shards.states)
    hooks = [h for m in engine.module.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert not any(getattr(h, "__self__", None) is engine.gatherer for h in hooks)
    x = token_batches(1, 4)[0]
    engine.backward(engine(x, x))
    engine.step()
    assert engine.gatherer.prefetched == 0 and engine.comm.all_gather_bytes == 0
    assert engine.runtime.phase is engine.gatherer.phase is TrainingPhase.IDLE
    # one rank keeps whole gradient chunks under stage 2 too: each one its own shard, zeroed by the update
    grads = engine.chunked.sharded_grads
    assert not engine.chunked.shards_grads and grads.shard_bytes() == 0 and grads.managed is None
    assert all(_same_tensor(s.grad_shard, s.grad_chunk.payload) and not s.grad_chunk.payload.any()
               for s in grads.states)


def _same_tensor(view: torch.Tensor, payload: torch.Tensor) -> bool:
    """A view of all of `payload` (one rank's one shard), no memory of its own."""
    return view.data_ptr() == payload.data_ptr() and view.shape == payload.shape


def test_a_step_from_inside_a_forward_is_refused_and_the_engine_goes_on():
    torch.manual_seed(0)
    engine = initialize(tiny_gpt(), CONFIG)
    handle = engine.module.lm_head.register_forward_hook(lambda *args: engine.step())
    x = token_batches(1, 4)[0]
    with pytest.raises(RuntimeError, match="step cannot start while the forward is running"):
        engine(x, x)
    assert engine.runtime.phase is TrainingPhase.IDLE and engine.global_step == engine.micro_step == 0
    handle.remove()
    engine.backward(engine(x, x))
    engine.step()
    assert engine.global_step == 1


def test_a_failed_update_leaves_the_engine_idle():
    engine = initialize(tiny_gpt(), CONFIG)
    x = token_batches(1, 4)[0]
    engine.backward(engine(x, x))
    engine.module.lm_head.weight.data = engine.module.lm_head.weight.data.clone()  # no longer in its chunk
    with pytest.raises(RuntimeError, match="no longer lives in its chunk"):
        engine.step()
    assert engine.runtime.phase is TrainingPhase.IDLE


def test_offload_policy_homes_each_kind_as_the_table_says(tmp_path):
    def homes(stage, bf16=False, param=None, dp=1):
        zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
        if param:
            zero["offload_param"] = {"device": param, "nvme_path": str(tmp_path)}
        cfg = load_config({**CONFIG, "bf16": {"enabled": bf16}, "zero_optimization": zero})
        chunked = chunk_parameters(tiny_gpt(), cfg, _single_rank_view(dp), [{"params": list(tiny_gpt().parameters())}])
        return OffloadPolicy.from_config(cfg, grads_sharded=chunked.shards_grads, masters=chunked.has_masters).homes

    assert homes(1) == {ChunkKind.OPTIM: Location.NVME}
    # one rank keeps its gradient shards too, to send them to the host with the states (Note [device tier])
    assert homes(2) == {ChunkKind.OPTIM: Location.NVME, ChunkKind.GRAD: Location.NVME}
    assert homes(2, dp=2) == {ChunkKind.OPTIM: Location.NVME, ChunkKind.GRAD: Location.NVME}
    # 16-bit gradient shards go with the masters (Note [offloaded master weights])
    assert homes(2, bf16=True, dp=2) == {ChunkKind.OPTIM: Location.NVME, ChunkKind.GRAD: Location.NVME}
    assert homes(3, param="cpu", dp=2) == {ChunkKind.OPTIM: Location.NVME, ChunkKind.GRAD: Location.NVME,
                                           ChunkKind.PARAM: Location.CPU}
    # one rank pages its shards (Note [paging in one process])
    assert homes(3, bf16=True, param="nvme") == {ChunkKind.OPTIM: Location.NVME, ChunkKind.GRAD: Location.NVME,
                                                 ChunkKind.PARAM: Location.NVME}
    # without offload_param one rank keeps whole parameter chunks, and its gradient shards go with the states
    assert homes(3) == {ChunkKind.OPTIM: Location.NVME, ChunkKind.GRAD: Location.NVME}


def _single_rank_view(dp: int) -> Mesh:
    """Rank 0 of a data-parallel world of `dp`, as far as chunking needs it (no process group is used)."""
    return Mesh.layout("cpu", zero=dp)


def test_the_public_steps_compose_into_what_initialize_builds():
    """chunk_parameters and build_chunk_optimizer, called by hand on a plain model, train it like PyTorch."""
    cfg = load_config({**CONFIG, "zero_optimization": {"stage": 1}})
    model = tiny_gpt()
    mesh = _single_rank_view(1)
    chunked = chunk_parameters(model, cfg, mesh, [{"params": list(model.parameters())}])
    optimizer = build_chunk_optimizer(cfg, chunked, mesh.device)
    batches = token_batches(3, 4)
    losses = []
    for x in batches:
        loss = model(x, x)
        loss.backward()
        chunked.sync_views()
        optimizer.step()
        chunked.zero_grads()
        losses.append(loss.item())
    reference, _ = train_reference(tiny_gpt(), batches, lambda params: torch.optim.AdamW(params, lr=1e-3))
    assert_close_relative(losses, reference)
    engine_losses, _ = train_engine(initialize(tiny_gpt(), cfg), batches, 0, 1, 1)
    assert_close_relative(engine_losses, reference)
