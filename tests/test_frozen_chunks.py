"""Frozen parameters in chunks of their own (Note [frozen chunks]): a tiny GPT with its embeddings and first
attention frozen trains as plain PyTorch does under every ZeRO stage, fp32 and bf16, with stage 3's frozen shards
sharded and offloaded (CPU, NVMe: never written after the start), unfreezing refused, and checkpoints keeping the
frozen weights bit for bit."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from engine import initialize, zero_init
from engine.checkpoint.files import CheckpointError
from engine.compat import deepspeed
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    step_masters,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_mixed_precision import LOSS_RTOL, WEIGHT_RTOL
from tests.test_zero import GLOBAL_BATCH, zero_config

STEPS = 3
FROZEN = ("wte.", "wpe.", "blocks.0.attn.")  # the embeddings (tied to the head) and the first block's attention


def frozen_gpt(seed: int = 0) -> torch.nn.Module:
    model = tiny_gpt(seed)
    for name, p in model.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    return model


def frozen_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def reference_fp32():
    """Plain PyTorch: AdamW over the trainable parameters, gradients clipped at 1.0."""
    model = frozen_gpt()
    losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, param_snapshot(model)


def reference_bf16():
    """Plain PyTorch mixed precision as the engine runs bf16: the whole model in bf16 under autocast, fp32 masters
    of the trainable parameters stepped from the widened gradients and rounded back."""
    model = frozen_gpt().to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in trainable]
    opt = adamw(masters)
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)
        loss.float().backward()
        step_masters(masters, trainable, opt, clip=1.0)
        losses.append(loss.item())
    return losses, param_snapshot(model)


CPU_BUDGET = 200 * 1024  # bytes: through NVMe, the manager's CPU tier holds a few chunks, so chunks are paged out


def stage_config(stage: int, world: int, dtype: torch.dtype = torch.float32, offload: str | None = None,
                 nvme_dir: str | None = None) -> dict:
    cfg = zero_config(stage, GLOBAL_BATCH // world, 1)
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    if offload is not None:
        path = {"nvme_path": nvme_dir} if offload == "nvme" else {}
        cfg["zero_optimization"]["offload_param"] = {"device": offload, **path}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, **path}
    if offload == "nvme":
        cfg["aio"] = {"block_size": 4096}
        cfg["memory"] = {"cpu_budget": CPU_BUDGET}
    return cfg


def train_case(rank: int, world: int, cfg: dict, under_zero_init: bool = False) -> dict:
    """Trains a frozen GPT built from this rank's seed (the engine starts every rank from rank 0's values; built
    under zero_init, each rank materializes its shards of rank 0's model) and reports what the test checks."""
    with zero_init() if under_zero_init else contextlib.nullcontext():
        model = frozen_gpt(seed=rank)
    engine = initialize(model, cfg)
    chunked = engine.chunked
    out = {"trainable_chunks": len(chunked.states), "frozen_chunks": len(chunked.frozen_states),
           "frozen_members": sorted(chunked.name_of(p) for s in chunked.frozen_states for p in s.params),
           "optimizer_tensors": sum(len(g["params"]) for g in engine.optimizer.param_groups)}
    manager = getattr(engine.optimizer, "manager", None)
    written_at_start = manager.stats.nvme_written_bytes["frozen"] if manager is not None else None
    out["losses"], _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1)
    if chunked.gathers_params and manager is None:  # between steps every chunk is released: shards only
        out["param_bytes"] = engine.device_state_bytes()["param"]
        out["frozen_shard_bytes"] = sum(s.param_shard.untyped_storage().nbytes() for s in chunked.frozen_states)
        out["frozen_chunk_bytes"] = sum(s.param_chunk.nbytes for s in chunked.frozen_states)
        out["all_chunk_bytes"] = sum(s.param_chunk.nbytes for s in chunked.all_states)
    if manager is not None:
        stats = manager.stats
        out["frozen_written"] = (written_at_start, stats.nvme_written_bytes["frozen"])
        out["frozen_shard_bytes"] = sum(s.param_shard.numel() * s.param_shard.element_size()
                                        for s in chunked.frozen_states)
        out["frozen_clean_drops"] = stats.clean_drops_by_kind["frozen"]
        out["frozen_nvme_reads"] = stats.nvme_read_bytes["frozen"]
    out["params"] = trained_params(engine)
    engine.close()
    return out


def test_backward_releases_a_frozen_chunk_once_its_modules_backward_is_done():
    """Stage 3 (paging in one process): no gradient arrives to say a frozen chunk is done in backward; it is
    released once the backward of its modules has computed their inputs' gradients, not kept to the pass end. When
    the first block's trainable ln_1 gets its gradient, the frozen attention right after it is released."""
    engine = initialize(frozen_gpt(), stage_config(3, 1, offload="cpu"))
    chunked = engine.chunked
    attention = chunked.param_chunk_index()[id(engine.module.blocks[0].attn.c_proj.weight)]
    assert chunked.all_states[attention].frozen
    seen = []
    engine.module.blocks[0].ln_1.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(chunked.all_states[attention].phase.name))
    train_engine(engine, token_batches(2, GLOBAL_BATCH), 0, 1, 1)
    engine.close()
    assert seen == ["SHARDED", "SHARDED"]


def test_deepspeed_marks_and_gathers_frozen_parameters_under_stage_3():
    """Through the DeepSpeed API, a frozen stage-3 parameter is marked as sharded (ds_id, ds_status NOT_AVAILABLE
    between passes) like a trainable one, so that code gathering by the marks (an RLHF save) reads its whole
    values inside GatheredParameters."""
    start = param_snapshot(frozen_gpt())
    engine, *_ = deepspeed.initialize(model=frozen_gpt(), config=stage_config(3, 1, offload="cpu"))
    status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    wpe = engine.module.wpe.weight
    assert not wpe.requires_grad and hasattr(wpe, "ds_id") and wpe.ds_status is status.NOT_AVAILABLE
    fetch = [p for p in engine.module.parameters() if p.ds_status == status.NOT_AVAILABLE]
    with deepspeed.zero.GatheredParameters(fetch):
        assert wpe.ds_status is status.AVAILABLE
        read = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    assert all(torch.equal(read[n], start[n]) for n in start)


def test_a_model_with_nothing_to_train_is_refused():
    model = frozen_gpt()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no trainable parameters"):
        initialize(model, stage_config(3, 1))


def unfreezing_case(rank: int, world: int) -> dict:
    """Unfreezing a frozen parameter, or freezing a trainable one, after initialize is refused at the next backward
    (engine.backward or the loss's own backward()) or, toggled between backward and step, at the step; before
    anything is updated."""
    engine = initialize(frozen_gpt(), stage_config(3, world))
    x = token_batches(1, GLOBAL_BATCH)[0][rank::world]
    before = trained_params(engine)
    errors = {}

    def refused(name: str, path: str, run) -> None:
        p = dict(engine.module.named_parameters())[name]
        with pytest.raises(RuntimeError) as error:
            run(lambda: p.requires_grad_(not p.requires_grad))
        errors[(name, path)] = str(error.value)
        p.requires_grad_(not p.requires_grad)
        engine.zero_grad()

    def between_backward_and_step(toggle) -> None:
        engine.backward(engine(x, x))
        toggle()
        engine.step()

    for name in ("wpe.weight", "blocks.1.mlp.c_fc.weight"):
        refused(name, "engine.backward", lambda toggle: (toggle(), engine.backward(engine(x, x))))
        refused(name, "loss.backward", lambda toggle: (toggle(), engine(x, x).backward()))
        refused(name, "step", between_backward_and_step)
    after = trained_params(engine)
    engine.close()
    return {"errors": errors, "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


def checkpoint_case(rank: int, world: int, save_dir: str, cfg: dict, load_cfg: dict) -> dict:
    """Saves after training, loads into an engine built from other weights: every parameter, frozen ones
    included, comes back bit for bit; training then goes on as the saving engine's would."""
    batches = token_batches(STEPS + 1, GLOBAL_BATCH)
    saving = initialize(frozen_gpt(), cfg)
    train_engine(saving, batches[:STEPS], rank, world, 1)
    saving.save_checkpoint(save_dir, tag="frozen")
    saved = trained_params(saving)
    next_loss, _ = train_engine(saving, batches[STEPS:], rank, world, 1)
    saving.close()
    loading = initialize(frozen_gpt(seed=7), load_cfg)
    before_load = trained_params(loading)
    loading.load_checkpoint(save_dir, tag="frozen")
    loaded = trained_params(loading)
    loaded_next_loss, _ = train_engine(loading, batches[STEPS:], rank, world, 1)
    loading.close()
    frozen = frozen_names(frozen_gpt())
    return {"equal": {n: torch.equal(saved[n], loaded[n]) for n in saved}, "saved": saved,
            "differed_before": [n for n in frozen if not torch.equal(saved[n], before_load[n])],
            "next_loss": (next_loss, loaded_next_loss)}


def _two_rank_cases(rank: int, world: int, nvme_dir: str) -> dict:
    """Every two-rank case in one spawned group (a spawn costs seconds), each on an engine of its own."""
    cases = {
        "stage1": lambda: train_case(rank, world, stage_config(1, world)),
        "stage2": lambda: train_case(rank, world, stage_config(2, world)),
        "stage3": lambda: train_case(rank, world, stage_config(3, world)),
        "stage3_bf16": lambda: train_case(rank, world, stage_config(3, world, torch.bfloat16)),
        "stage3_cpu": lambda: train_case(rank, world, stage_config(3, world, offload="cpu")),
        "stage3_nvme": lambda: train_case(rank, world, stage_config(3, world, offload="nvme",
                                                                    nvme_dir=f"{nvme_dir}/train")),
        "stage3_nvme_zero_init": lambda: train_case(rank, world, stage_config(3, world, offload="nvme",
                                                                              nvme_dir=f"{nvme_dir}/init"),
                                                    under_zero_init=True),
        "checkpoint": lambda: checkpoint_case(rank, world, f"{nvme_dir}/ckpt", stage_config(3, world),
                                              stage_config(3, world)),
        "checkpoint_bf16": lambda: checkpoint_case(rank, world, f"{nvme_dir}/ckpt_bf16",
                                                   stage_config(3, world, torch.bfloat16),
                                                   stage_config(3, world, torch.bfloat16)),
        "checkpoint_nvme": lambda: checkpoint_case(
            rank, world, f"{nvme_dir}/ckpt_nvme", stage_config(3, world, offload="nvme", nvme_dir=f"{nvme_dir}/a"),
            stage_config(3, world, offload="nvme", nvme_dir=f"{nvme_dir}/b")),
        "unfreezing": lambda: unfreezing_case(rank, world),
    }
    return {name: result for (name,), result in run_cases(rank, [(n,) for n in cases], lambda n: cases[n]()).items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """{case name: [rank 0's result, rank 1's result]}."""
    tmp = tmp_path_factory.mktemp("frozen")
    for swap in ("train", "init", "a", "b"):
        (tmp / swap).mkdir()
    tmp = str(tmp)
    per_rank = run_distributed(_two_rank_cases, 2, args=(tmp,), timeout_s=300)
    return {"dir": tmp, **results_by_case(per_rank)}


@pytest.fixture(scope="module")
def references() -> dict:
    return {torch.float32: reference_fp32(), torch.bfloat16: reference_bf16()}


def assert_trains_as_reference(result: dict, reference, dtype: torch.dtype, world: int = 1) -> None:
    ref_losses, ref_params = reference
    start = param_snapshot(frozen_gpt().to(dtype))
    frozen = frozen_names(frozen_gpt())
    assert result["frozen_members"] == sorted(n for n in frozen if n != "lm_head.weight")
    assert result["frozen_chunks"] >= 1 and result["trainable_chunks"] >= 1
    # the optimizer steps the trainable chunks only: one tensor per trainable chunk
    assert result["optimizer_tensors"] == result["trainable_chunks"]
    for name in frozen:  # never updated: bit for bit the start (rank 0's values, in the compute dtype)
        assert torch.equal(result["params"][name].to(dtype), start[name]), name
    if dtype == torch.float32:
        assert_close_relative(result["losses"], ref_losses)
        assert_params_close(result["params"], ref_params)
    else:  # two ranks reduce 16-bit gradients (each rounded) where one process computes them in one pass
        assert_close_relative(result["losses"], ref_losses, rtol=world * LOSS_RTOL[dtype])
        for name, expected in ref_params.items():
            torch.testing.assert_close(result["params"][name].float(), expected.float(), rtol=WEIGHT_RTOL[dtype],
                                       atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("stage,dtype,offload", [(0, torch.float32, None), (1, torch.float32, None),
                                                 (2, torch.float32, None), (3, torch.float32, None),
                                                 (0, torch.bfloat16, None), (3, torch.float32, "cpu")])
def test_one_process_trains_frozen_chunks_as_plain_pytorch(stage, dtype, offload, references):
    assert_trains_as_reference(train_case(0, 1, stage_config(stage, 1, dtype, offload)), references[dtype], dtype)


def test_activation_checkpointing_recomputes_through_frozen_chunks(references):
    """Stage 3 (paging in one process) with the blocks checkpointed: their frozen chunks are gathered again for the
    recomputation inside backward, and training equals plain PyTorch."""
    cfg = dict(stage_config(3, 1, offload="cpu"), activation_checkpointing={"enabled": True})
    assert_trains_as_reference(train_case(0, 1, cfg), references[torch.float32], torch.float32)


@pytest.mark.parametrize("case,dtype", [("stage1", torch.float32), ("stage2", torch.float32),
                                        ("stage3", torch.float32), ("stage3_bf16", torch.bfloat16),
                                        ("stage3_cpu", torch.float32), ("stage3_nvme", torch.float32),
                                        ("stage3_nvme_zero_init", torch.float32)])
def test_two_ranks_train_frozen_chunks_as_plain_pytorch(case, dtype, two_ranks, references):
    mean_losses = [sum(step) / 2 for step in zip(*(r["losses"] for r in two_ranks[case]))]  # each rank's half batch
    for result in two_ranks[case]:
        assert_trains_as_reference(dict(result, losses=mean_losses), references[dtype], dtype, world=2)


def test_stage_3_shards_frozen_chunks_across_the_ranks(two_ranks):
    """Between steps a rank holds 1/world of every chunk, frozen ones included, and no full chunk."""
    for result in two_ranks["stage3"]:
        assert result["frozen_chunk_bytes"] > 0
        assert result["frozen_shard_bytes"] * 2 == result["frozen_chunk_bytes"]
        assert result["param_bytes"] * 2 == result["all_chunk_bytes"]


@pytest.mark.parametrize("case", ["stage3_nvme", "stage3_nvme_zero_init"])
def test_offloaded_frozen_shards_are_never_written_after_the_start(case, two_ranks):
    """Through NVMe, each frozen shard is written once, at the start (or as zero_init materializes it); training
    reads them (page-outs are drops) and writes none."""
    for result in two_ranks[case]:
        at_start, after = result["frozen_written"]
        assert at_start >= result["frozen_shard_bytes"] > 0
        assert after == at_start
        assert result["frozen_nvme_reads"] > 0 and result["frozen_clean_drops"] > 0


def test_unfreezing_or_freezing_after_initialize_is_refused(two_ranks):
    for result in two_ranks["unfreezing"]:
        errors = result["errors"]
        for path in ("engine.backward", "loss.backward", "step"):
            unfrozen, frozen = errors[("wpe.weight", path)], errors[("blocks.1.mlp.c_fc.weight", path)]
            assert "'wpe.weight' was unfrozen" in unfrozen and "build the engine again" in unfrozen, path
            assert "'blocks.1.mlp.c_fc.weight' was frozen" in frozen, path
        assert result["unchanged"]


@pytest.mark.parametrize("case", ["checkpoint", "checkpoint_bf16", "checkpoint_nvme"])
def test_a_checkpoint_keeps_frozen_parameters_bit_for_bit(case, two_ranks):
    for result in two_ranks[case]:
        # the loading engine started from other frozen weights (biases start at zero in both)
        assert {"wte.weight", "wpe.weight", "blocks.0.attn.c_attn.weight"} <= set(result["differed_before"])
        assert all(result["equal"].values()), [n for n, same in result["equal"].items() if not same]
        saving, loading = result["next_loss"]
        assert loading == saving


@pytest.mark.parametrize("stage", [0, 2])
def test_a_two_rank_stage_3_checkpoint_loads_into_one_process(stage, two_ranks):
    """Resharding: the 2-rank stage-3 checkpoint loads into one process at stage 0 or 2 (the frozen parameters into
    chunks laid out for one rank), every parameter bit for bit, and the next step's loss is the two ranks' mean."""
    saved = two_ranks["checkpoint"][0]["saved"]
    engine = initialize(frozen_gpt(seed=7), stage_config(stage, 1))
    engine.load_checkpoint(f"{two_ranks['dir']}/ckpt", tag="frozen")
    loaded = trained_params(engine)
    next_loss, _ = train_engine(engine, token_batches(STEPS + 1, GLOBAL_BATCH)[STEPS:], 0, 1, 1)
    engine.close()
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
    ranks_next_loss = sum(r["next_loss"][0][0] for r in two_ranks["checkpoint"]) / 2
    assert_close_relative(next_loss, [ranks_next_loss])


def test_changing_what_trains_goes_through_the_whole_state_dict(tmp_path):
    """A checkpoint loads into an engine training the same parameters only: one saved with wpe frozen is refused by
    an engine training it, naming the way that works, the whole state dict into a new model before initialize, which
    then trains (wpe included) as plain PyTorch does from the same values."""
    batches = token_batches(2, GLOBAL_BATCH)
    engine = initialize(frozen_gpt(), stage_config(3, 1))
    train_engine(engine, batches[:1], 0, 1, 1)
    engine.save_checkpoint(str(tmp_path), tag="frozen")
    state = engine.full_state_dict()
    engine.close()
    model = frozen_gpt(seed=7)
    model.wpe.weight.requires_grad_(True)
    model.load_state_dict(state)
    reference = copy.deepcopy(model)
    engine = initialize(model, stage_config(3, 1))
    with pytest.raises(CheckpointError, match=r"trainable here but frozen in the checkpoint: \['wpe.weight'\]") as e:
        engine.load_checkpoint(str(tmp_path), tag="frozen")
    assert "engine.full_state_dict()" in str(e.value) and "model.load_state_dict(state)" in str(e.value)
    losses, _ = train_engine(engine, batches[1:], 0, 1, 1)
    params = trained_params(engine)
    engine.close()
    ref_losses, _ = train_reference(reference, batches[1:], adamw, clip=1.0)
    assert_close_relative(losses, ref_losses)
    assert_params_close(params, param_snapshot(reference))
    assert not torch.equal(params["wpe.weight"], state["wpe.weight"])


def test_loading_wider_frozen_values_into_bf16_chunks_says_it_rounds(tmp_path):
    """Frozen chunks hold the compute dtype: an fp32 checkpoint's frozen parameters load into a bf16 engine rounded,
    and the load warns with their count and both dtypes."""
    saving = initialize(frozen_gpt(), stage_config(3, 1))
    saving.save_checkpoint(str(tmp_path), tag="fp32")
    saved = trained_params(saving)
    saving.close()
    loading = initialize(frozen_gpt(seed=7), stage_config(3, 1, torch.bfloat16))
    count = len(loading.chunked.frozen_params)
    with pytest.warns(UserWarning, match=f"{count} frozen parameters .* saved in torch.float32 and are loaded rounded "
                                         "to torch.bfloat16"):
        loading.load_checkpoint(str(tmp_path), tag="fp32")
    loaded = trained_params(loading)
    loading.close()
    for name in frozen_names(frozen_gpt()):
        assert torch.equal(loaded[name], saved[name].to(torch.bfloat16)), name


def test_excluding_frozen_parameters_from_a_16_bit_export_follows_the_engine_layout():
    """exclude_frozen_parameters leaves out what the engine froze at initialize, even with requires_grad toggled
    since (the toggle is refused at the next backward or step, but an export may come first)."""
    engine, *_ = deepspeed.initialize(model=frozen_gpt(), config=stage_config(3, 1))
    engine.module.wpe.weight.requires_grad_(True)
    engine.module.blocks[1].mlp.c_fc.weight.requires_grad_(False)
    state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    engine.close()
    assert "wpe.weight" not in state and "blocks.0.attn.c_attn.weight" not in state
    assert "blocks.1.mlp.c_fc.weight" in state and "blocks.0.ln_1.weight" in state
