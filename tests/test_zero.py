"""ZeRO over chunks: each stage equals single-process PyTorch on the same global batch, keeps the
model-state bytes the ZeRO formulas give, and sends what DDP sends (stage 1)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine import ConfigError, initialize
from engine.checkpoint import CheckpointError
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw

STEPS = 4
GLOBAL_BATCH = 8


def zero_config(stage: int, micro: int, accumulation: int, chunk_size: int = 20_000, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "gradient_clipping": 1.0,
        # threshold 0: under stage 3 every parameter of the tiny model is sharded (the default keeps them all whole)
        "zero_optimization": {"stage": stage, "chunk_size": chunk_size, "stage3_param_persistence_threshold": 0,
                              **zero},
        "steps_per_print": 10**6,
    }


def model_state_bytes(engine) -> dict[str, int]:
    """Counted from the tensors themselves, not from the engine: chunk payload storages and optimizer states."""
    chunked = engine.chunked
    params = sum(c.payload.untyped_storage().nbytes() for g in chunked.groups + chunked.frozen_groups
                 for c in g.param_chunks.chunks)  # frozen chunks: parameters without gradients (Note [frozen chunks])
    grads = sum(c.payload.untyped_storage().nbytes() for g in chunked.groups for c in g.grad_chunks.chunks)
    if chunked.shards_grads:  # stages 2, 3: the persistent shards (the chunks hold no storage now)
        grads += sum(s.untyped_storage().nbytes() for s in chunked.sharded_grads.shards)
    if chunked.gathers_params:  # stage 3: shards of their own (persistent chunks' shards are views)
        params += sum(s.untyped_storage().nbytes() for s, keep in zip(chunked.sharded_params.shards,
                                                                      chunked.sharded_params.persistent) if not keep)
    states = sum(v.numel() * v.element_size() for s in engine.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0)  # not the scalar step counters
    if chunked.masters is not None:  # bf16 / fp16: the fp32 master weights are optimizer state
        states += sum(m.untyped_storage().nbytes() for m in chunked.masters.masters)
    return {"param": params, "grad": grads, "optim": states}


def _zero_worker(rank, world, stage, accumulation, reduce_scatter=True):
    micro = GLOBAL_BATCH // world // accumulation
    engine = initialize(tiny_gpt(seed=rank), zero_config(stage, micro, accumulation, reduce_scatter=reduce_scatter))
    losses, norms = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, accumulation)
    comm = dataclasses.replace(engine.comm)  # before gathering the weights to compare them
    chunk_numel = sum(c.payload.numel() for g in engine.chunked.groups for c in g.grad_chunks.chunks)
    state_bytes = model_state_bytes(engine)
    prefetched = engine.gatherer.prefetched if engine.gatherer else None
    return losses, norms, trained_params(engine), state_bytes, comm.ring_bytes(world), comm.broadcast_bytes, \
        chunk_numel, prefetched


@pytest.fixture(scope="module")
def reference():
    model = tiny_gpt()
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, norms, param_snapshot(model)


# ZeRO paper, fp32 Adam (param, grad, exp_avg + exp_avg_sq): bytes per parameter, replicated + sharded over N
FORMULA = {1: {"param": (4, 0), "grad": (4, 0), "optim": (0, 8)},
           2: {"param": (4, 0), "grad": (0, 4), "optim": (0, 8)},
           3: {"param": (0, 4), "grad": (0, 4), "optim": (0, 8)}}


def _stages_worker(rank, world, accumulation):
    return [_zero_worker(rank, world, stage, accumulation) for stage in (1, 2, 3)]


@pytest.mark.parametrize("world,accumulation", [(2, 2), (4, 1)])
def test_stages_1_to_3_match_single_process_and_their_memory_and_traffic(reference, world, accumulation):
    """Stages 1, 2 and 3 in one group of `world` processes."""
    per_rank = run_distributed(_stages_worker, world, args=(accumulation,), timeout_s=300)
    for i, stage in enumerate((1, 2, 3)):
        check_stage(reference, [rank_results[i] for rank_results in per_rank], stage, world, accumulation)


def check_stage(reference, results: list, stage: int, world: int, accumulation: int) -> None:
    ref_losses, ref_norms, ref_params = reference
    mean_losses = [sum(r[0][i] for r in results) / world for i in range(STEPS)]
    assert_close_relative(mean_losses, ref_losses)
    assert_close_relative(results[0][1], ref_norms)  # the global norm, summed over the shards
    for r in results:
        assert_params_close(r[2], ref_params)

    psi = sum(p.numel() for p in ref_params.values())
    padding = 20_000 * 4  # at most one chunk of padding per kind, in bytes
    for r in results:  # stage 1: 4Ψ + 4Ψ + 8Ψ/N; stage 2: 4Ψ + 4Ψ/N + 8Ψ/N; stage 3: 16Ψ/N
        for kind, (replicated, sharded) in FORMULA[stage].items():
            expected = replicated * psi + sharded * psi / world
            assert abs(r[3][kind] - expected) <= 0.05 * expected + padding, (kind, r[3][kind], expected)
    # a reduce-scatter and an all-gather of each chunk per step send what one all-reduce of it sends
    # (DDP: 2(N-1)/N per byte), plus the global norm's sum of squares (one float64 all-reduce);
    # stage 2 reduce-scatters at every micro-step (Note [sharded gradients]); stage 3 also gathers
    # every chunk for each forward and each backward, and after the update nothing (Note [sharded parameters])
    collectives = {1: 2, 2: accumulation + 1, 3: 3 * accumulation}[stage]
    for r in results:
        chunk_numel = r[6]
        assert psi <= chunk_numel <= 1.25 * psi  # this test's small fixed chunk size pads up to a fifth
        per_step = (world - 1) / world * (collectives * 4 * chunk_numel + 2 * 8)
        sent = r[4] - r[5]  # without the start-up broadcast of rank 0's parameters
        assert sent == pytest.approx(STEPS * per_step, rel=1e-12), (sent, STEPS * per_step)
        if accumulation == 1:  # DDP all-reduces each chunk once per step: stage 3 sends at most 1.5x that
            ddp = (world - 1) / world * 2 * 4 * chunk_numel
            assert sent / STEPS <= 1.5 * ddp + 16
        if stage == 3:
            assert r[7] > 0  # steps after the first gather ahead of demand, in the traced order


def test_stage_1_with_all_reduce_instead_of_reduce_scatter_trains_the_same(reference):
    ref_losses, _, ref_params = reference
    results = run_distributed(_zero_worker, 2, args=(1, 1, False))
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for r in results:
        assert_params_close(r[2], ref_params)


def _client_optimizer_worker(rank, world):
    model = tiny_gpt(seed=0)
    cfg = zero_config(1, GLOBAL_BATCH // world, 1)
    del cfg["optimizer"]
    engine = initialize(model, cfg, optimizer=adamw(model.parameters()),
                        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1)
    state_numel = sum(v.numel() for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0)
    return losses, param_snapshot(engine.module), state_numel


def test_stage_1_shards_a_client_optimizer(reference):
    ref_losses, _, ref_params = reference
    results = run_distributed(_client_optimizer_worker, 2)
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    psi = sum(p.numel() for p in ref_params.values())
    for r in results:
        assert_params_close(r[1], ref_params)
        assert r[2] <= 2 * psi / 2 + 2 * 20_000  # exp_avg + exp_avg_sq of half the elements (plus padding)


def _bound_scheduler_worker(rank, world):
    model = tiny_gpt(seed=0)
    opt = adamw(model.parameters())
    halving = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    cfg = zero_config(1, GLOBAL_BATCH // world, 1)
    del cfg["optimizer"]
    engine = initialize(model, cfg, optimizer=opt, lr_scheduler=halving)
    rates = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        x = batch[rank * (GLOBAL_BATCH // world):(rank + 1) * (GLOBAL_BATCH // world)]
        engine.backward(engine(x, x))
        engine.step()
        rates.append(engine.get_lr()[0])
    return engine.optimizer is opt, rates, param_snapshot(engine.module)


def _plain_halving_run():
    model = tiny_gpt(seed=0)
    opt = adamw(model.parameters())
    halving = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for x in token_batches(STEPS, GLOBAL_BATCH):
        model(x, x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the config's gradient_clipping
        opt.step()
        opt.zero_grad()
        halving.step()
    return param_snapshot(model)


def test_stage_1_steps_a_scheduler_bound_to_the_client_optimizer():
    """As DeepSpeed does, the client optimizer itself steps the shards, so a scheduler built on it before
    initialize() drives the engine's updates (a rebuilt optimizer would leave every update at the first rate)."""
    reference = _plain_halving_run()
    for same, rates, params in run_distributed(_bound_scheduler_worker, 2):
        assert same
        assert rates == pytest.approx([ADAMW["lr"] * 0.5 ** (k + 1) for k in range(STEPS)])
        assert_params_close(params, reference)


def test_a_client_group_split_into_chunk_kinds_or_all_frozen_keeps_its_place():
    """Stage 3 with a persistence threshold packs a group's small parameters apart from its sharded ones,
    and a group whose parameters are all frozen packs none: the client keeps one group per own group, each holding
    its parameters' stepped tensors, so a scheduler's per-group rates still land on the right ones."""
    model = tiny_gpt()
    blocks = [p for n, p in model.named_parameters() if "blocks." in n]
    others = [p for p in model.parameters() if all(p is not b for b in blocks)]
    frozen = [blocks[0]]
    frozen[0].requires_grad_(False)
    opt = torch.optim.AdamW([{"params": blocks[1:], "lr": 1e-3}, {"params": frozen, "lr": 5e-4},
                             {"params": others, "lr": 2e-3}])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 1.0, lambda s: 0.5 ** s])
    cfg = {**zero_config(3, 2, 1), "bf16": {"enabled": True}}  # fp32 masters: the client is pointed at them
    del cfg["optimizer"]
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1000  # norms and biases whole
    engine = initialize(model, cfg, optimizer=opt, lr_scheduler=schedule)
    assert engine.optimizer is opt and [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4, 2e-3]
    kinds = {(g.origin, g.persistent) for g in engine.chunked.groups}
    assert (0, True) in kinds and (0, False) in kinds  # the first group split in two
    for origin, own in enumerate([blocks[1:], [], others]):  # each chunk group remembers the group it came from
        assert {id(p) for g in engine.chunked.groups if g.origin == origin for p in g.params} == {id(p) for p in own}
    stepped = {id(s.stepped) for g in engine.chunked.groups for s in g.states}
    assert opt.param_groups[1]["params"] == []
    for origin, group in enumerate(opt.param_groups):
        expected = [id(s.stepped) for g in engine.chunked.groups if g.origin == origin for s in g.states]
        assert [id(p) for p in group["params"]] == expected and set(expected) <= stepped
    x = token_batches(1, 2)[0]
    engine.backward(engine(x, x))
    engine.step()
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4, 1e-3]  # the scheduler stepped the client's groups
    engine.close()


def test_a_scheduler_built_on_another_optimizer_is_refused():
    model = tiny_gpt()
    stray = torch.optim.lr_scheduler.LambdaLR(adamw(tiny_gpt().parameters()), lambda s: 0.5 ** s)
    with pytest.raises(ConfigError, match="drives the optimizer it was built on, which is not the one the engine"):
        initialize(model, {k: v for k, v in zero_config(1, 2, 1).items() if k != "optimizer"},
                   optimizer=adamw(model.parameters()), lr_scheduler=stray)


def _grouped_engine(stage: int, rates: tuple[float, float]):
    """The config's AdamW over two param groups (the blocks, the rest) at `rates`; stage 3 keeps small parameters
    whole (threshold 1000), so its groups split into more chunk groups than stage 2's."""
    model = tiny_gpt()
    blocks = [p for n, p in model.named_parameters() if "blocks." in n]
    others = [p for n, p in model.named_parameters() if "blocks." not in n]
    cfg = zero_config(stage, 2, 1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    return initialize(model, cfg, model_parameters=[{"params": blocks, "lr": rates[0]},
                                                    {"params": others, "lr": rates[1]}])


def test_a_checkpoint_whose_groups_regroup_takes_one_set_of_options_or_is_refused(tmp_path):
    """Loading under another grouping (here stage 2's groups into stage 3's split ones): one set of saved options
    goes to every group; different ones cannot be told apart and are refused, not zipped onto the wrong groups."""
    for rates, name in (((1e-3, 1e-3), "same"), ((1e-3, 2e-3), "different")):
        saved = _grouped_engine(2, rates)
        for group in saved.optimizer.param_groups:
            group["lr"] *= 0.7  # a scheduled rate the load must restore
        saved.save_checkpoint(str(tmp_path / name))
        saved.close()
        loading = _grouped_engine(3, (5e-3, 5e-3))
        assert len(loading.optimizer.param_groups) > len(saved.optimizer.param_groups)
        if name == "same":
            loading.load_checkpoint(str(tmp_path / name))
            assert [g["lr"] for g in loading.optimizer.param_groups] == pytest.approx([7e-4] * len(
                loading.optimizer.param_groups))
        else:
            with pytest.raises(CheckpointError, match="so which is which is unknown"):
                loading.load_checkpoint(str(tmp_path / name))
        loading.close()


def test_stage_1_in_one_process_keeps_the_client_optimizer():
    model = tiny_gpt()
    opt = adamw(model.parameters())
    cfg = zero_config(1, 2, 1)
    del cfg["optimizer"]
    engine = initialize(model, cfg, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    assert engine.optimizer is opt and not engine.chunked.sharded  # one shard: nothing to rebuild


def _stage_2_no_sync_worker(rank, world):
    engine = initialize(tiny_gpt(), zero_config(2, 2, 2))
    x = token_batches(1, 4)[0][rank * 2:(rank + 1) * 2]
    engine.backward(engine(x, x))
    grads_after_backward = [p.grad for p in engine.module.parameters()]
    try:
        with engine.no_sync():
            pass
    except RuntimeError as e:
        return str(e), all(g is None for g in grads_after_backward)
    return None, None


def test_stage_2_refuses_no_sync_and_leaves_no_full_gradients_between_backward_passes():
    for message, grads_none in run_distributed(_stage_2_no_sync_worker, 2):
        assert message is not None and "not possible with ZeRO stage 2" in message
        assert grads_none  # only the rank's shards persist (Note [sharded gradients])


def _failed_backward_worker(rank, world, stage):
    engine = initialize(tiny_gpt(seed=rank), zero_config(stage, GLOBAL_BATCH // world, 1))
    block = engine.module.blocks[-1]  # backward reaches it first: some chunks already hold gradients
    fail_once = [True]

    def raise_in_backward(module, args, output):
        def hook(grad):
            if fail_once[0]:
                fail_once[0] = False
                raise RuntimeError("injected failure half-way through backward")
            return grad
        output.register_hook(hook)

    handle = block.register_forward_hook(raise_in_backward)
    x = token_batches(1, GLOBAL_BATCH, seed=99)[0][rank * 4:(rank + 1) * 4]
    try:
        engine.backward(engine(x, x))
    except RuntimeError as e:
        assert "injected failure" in str(e)
    handle.remove()
    engine.zero_grad()  # drops what the failed backward left (live chunks included)
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1)
    return losses, trained_params(engine)


@pytest.mark.parametrize("stage", [2, 3])
def test_after_a_failed_backward_and_zero_grad_training_goes_on_as_if_nothing_happened(reference, stage):
    ref_losses, _, ref_params = reference
    results = run_distributed(_failed_backward_worker, 2, args=(stage,))
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params in results:
        assert_params_close(params, ref_params)


def _whole_weights_worker(rank, world, stage):
    engine = initialize(tiny_gpt(seed=rank), zero_config(stage, GLOBAL_BATCH // world, 1))
    train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1)
    full, rank0 = engine.full_state_dict(), engine.full_state_dict(rank0_only=True)
    weight = engine.module.lm_head.weight
    with engine.gathered_parameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.25)  # only rank 0 changes it; on exit every rank has it
    with engine.gathered_parameters([weight]):
        after_modify = weight.detach().clone()
    train_engine(engine, token_batches(1, GLOBAL_BATCH, seed=5), rank, world, 1)
    return full, rank0, after_modify, trained_params(engine)


@pytest.mark.parametrize("stage", [2, 3])
def test_full_state_dict_and_gathered_parameters(reference, stage):
    _, _, ref_params = reference
    results = run_distributed(_whole_weights_worker, 2, args=(stage,))
    for rank, (full, rank0, after_modify, _params) in enumerate(results):
        assert full.keys() == tiny_gpt().state_dict().keys()
        assert_params_close({k: full[k] for k in ref_params}, ref_params)  # the trained weights, on every rank
        assert (rank0 is None) == (rank != 0)
        assert torch.equal(after_modify, torch.full_like(after_modify, 0.25))
    for name in results[0][3]:  # still one model after rank 0's modification and one more step
        assert torch.equal(results[0][3][name], results[1][3][name]), name


def test_gathered_parameters_modifier_keeps_the_edit_when_one_rank_pages(tmp_path):
    """One process paging its chunks (offload_param, Note [paging in one process]): an edit inside
    gathered_parameters(modifier_rank=0) reaches the shard and its fp32 master, and so the next forward."""
    cfg = zero_config(3, GLOBAL_BATCH, 1)
    cfg["bf16"] = {"enabled": True}
    for part in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][part] = {"device": "cpu"}
    engine = initialize(tiny_gpt(), cfg)
    weight = engine.module.lm_head.weight
    with engine.gathered_parameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.fill_(0.25)
    with engine.gathered_parameters([weight]):
        assert torch.equal(weight, torch.full_like(weight, 0.25))
    engine.close()


def _offload_worker(rank, world, stage, device, nvme_dir, param_device):
    cfg = zero_config(stage, GLOBAL_BATCH // world // 2, 2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": device, "nvme_path": nvme_dir}  # buffer_count 4
    if param_device:
        cfg["zero_optimization"]["offload_param"] = {"device": param_device, "nvme_path": nvme_dir}
    cfg["aio"] = {"block_size": 4096}  # small blocks: the CPU window (4 state chunks) is then far below all states
    engine = initialize(tiny_gpt(seed=rank), cfg)
    assert engine.get_lr() == [ADAMW["lr"]]  # the config's options reach the offloaded optimizer's groups
    losses, norms = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 2)
    stats = engine.optimizer.manager.stats
    in_memory = model_state_bytes(engine)  # counted outside the manager
    params = trained_params(engine)
    engine.close()
    return losses, norms, params, stats, in_memory


@pytest.mark.parametrize("stage,device,param_device,world", [
    (1, "cpu", None, 2), (1, "nvme", None, 2), (2, "cpu", None, 2), (2, "nvme", None, 2), (3, "cpu", None, 2),
    (3, "nvme", None, 2), (3, "cpu", "cpu", 2), (3, "nvme", "nvme", 2), (3, "nvme", "nvme", 4),
    (3, "cpu", "cpu", 1), (3, "nvme", "nvme", 1), (3, "cpu", "nvme", 1)])
def test_offload_matches_single_process(reference, tmp_path, stage, device, param_device, world):
    """world 1: in this process, without a process group (Note [paging in one process])."""
    ref_losses, ref_norms, ref_params = reference
    args = (stage, device, str(tmp_path), param_device)
    results = [_offload_worker(0, 1, *args)] if world == 1 else run_distributed(_offload_worker, world, args=args)
    assert_close_relative([sum(r[0][i] for r in results) / world for i in range(STEPS)], ref_losses)
    assert_close_relative(results[0][1], ref_norms)
    psi = sum(p.numel() for p in ref_params.values())
    in_manager = 8 + (4 if param_device else 0)  # exp_avg + exp_avg_sq (+ the parameter shard) per element owned
    for _, _, params, stats, in_memory in results:
        assert_params_close(params, ref_params)
        assert in_memory["optim"] == 0  # the engine's own optimizer holds no state tensors
        if param_device:
            assert in_memory["param"] == 0  # no shard outside the manager, no gathered chunk between steps
        if stage >= 2:
            assert in_memory["grad"] == 0  # gradient shards live in the manager too (freed after each step)
        held = stats.resident_bytes["cpu"] + stats.resident_bytes["nvme"]
        assert in_manager * psi / world <= held
        if "nvme" in (device, param_device):
            assert stats.moved_bytes["nvme->cpu"] > 0
        if device == "nvme" == (param_device or "nvme"):
            assert stats.resident_bytes["nvme"] > 0
            streamed = in_manager + (4 if stage >= 2 else 0)  # bytes per owned element that pass through the manager
            assert stats.peak_bytes["cpu"] < streamed * psi / world  # only a window of chunks in memory at once
    if "nvme" in (device, param_device):
        # later steps read ahead from the first step's trace; a prefetch never waits for its room to be written, so
        # one rank starved of CPU by the machine's load can start none (Note [prefetch retry]): count all ranks'
        assert sum(r[3].prefetches for r in results) > 0
    assert os.listdir(tmp_path) == []  # the swap files went with the engine


def test_optimizer_offload_follows_the_lr_schedule(tmp_path):
    """A scheduler drives the offloaded optimizer exactly as it drives the in-memory one."""
    runs = []
    for offload in (None, {"device": "nvme", "nvme_path": str(tmp_path)}):
        cfg = zero_config(0, 4, 1)
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = offload
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}
        engine = initialize(tiny_gpt(), cfg)
        lrs = []
        for x in token_batches(4, 4):
            lrs.append(engine.get_lr()[0])
            engine.backward(engine(x, x))
            engine.step()
        engine.close()
        runs.append((lrs, param_snapshot(engine.module)))
    assert runs[0][0] == runs[1][0] and runs[0][0][-1] > 0.0
    assert_params_close(runs[1][1], runs[0][1])


def test_cpu_budget_caps_the_offloaded_optimizer_states(tmp_path):
    """memory.cpu_budget replaces the default window: the CPU tier never holds more, and training matches."""
    runs = []
    for budget in (None, 400 * 1024):  # state chunks of ~164 KiB: room for two, the default window holds four
        cfg = zero_config(0, 4, 1)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
        cfg["aio"] = {"block_size": 4096}
        if budget:
            cfg["memory"] = {"cpu_budget": budget}
        engine = initialize(tiny_gpt(), cfg)
        train_engine(engine, token_batches(3, 4), 0, 1, 1)
        stats = engine.optimizer.manager.stats
        engine.close()
        runs.append((stats, param_snapshot(engine.module)))
    assert runs[1][0].peak_bytes["cpu"] <= 400 * 1024 < runs[0][0].peak_bytes["cpu"]
    assert_params_close(runs[1][1], runs[0][1])
