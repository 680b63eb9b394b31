"""Mixture of experts with expert parallelism (Note [expert parallelism]) equals single-process PyTorch: Hugging
Face Mixtral and Qwen2-MoE (their own routers and aux losses), and a user model written around engine.moe.MoE."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.moe_models import (
    SEQ,
    VOCAB,
    ModuleListMoEModel,
    UserMoEModel,
    hf_loss,
    mixtral,
    never_route_to,
    qwen_moe,
    user_loss,
)
from tests.reference import assert_close_relative, assert_params_close, micro_batches, param_snapshot, train_reference
from tests.test_data_parallel import ADAMW, adamw

pytest.importorskip("transformers")

STEPS, BATCH = 3, 8
BUILDERS = {"mixtral": mixtral, "mixtral_aux": lambda: mixtral(output_router_logits=True, router_aux_loss_coef=0.02),
            "qwen_moe": qwen_moe, "user": lambda: UserMoEModel(drop_tokens=False),
            "user_capacity": lambda: UserMoEModel(k=1, capacity_factor=1.0, min_capacity=1, use_rts=False),
            "user_unreached": lambda: _unreached(),
            # no l_aux in the loss: the objective is then the same at every data-parallel size
            "user_no_aux": lambda: UserMoEModel(drop_tokens=False, aux_weight=0.0),
            "module_list": ModuleListMoEModel}
LOSSES = {"user": user_loss, "user_capacity": user_loss, "user_unreached": user_loss, "user_no_aux": user_loss,
          "module_list": user_loss}


def _unreached():
    model = UserMoEModel(drop_tokens=False, positive=True)
    never_route_to(model, [2, 3])  # under ep 2, rank 1's experts get no token from any rank
    return model


def batches(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def reference_run(name: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole batch: the mean of each data-parallel rank's loss (a router's aux loss is taken
    per rank's tokens, as every rank computes it)."""
    model, loss_of = BUILDERS[name](), LOSSES.get(name, hf_loss)

    def loss_fn(m, x):
        return sum(loss_of(m, part) for part in micro_batches(x, 0, 1, world)) / world

    losses, _ = train_reference(model, batches(), adamw, clip=1.0, loss_fn=loss_fn)
    return losses, param_snapshot(model)


def config(stage: int, ep: int, offload: dict | None = None, **moe) -> dict:
    """offload: e.g. {"offload_optimizer": {"device": "cpu"}}, merged into zero_optimization."""
    return {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": ADAMW}, "gradient_clipping": 1.0,
            "steps_per_print": 10**6, "moe": {"expert_parallel_size": ep, **moe},
            "zero_optimization": {"stage": stage, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0,
                                  **(offload or {})}}


def _train_worker(rank, world, name, stage, ep, offload=None, extra=None):
    engine = initialize(BUILDERS[name](), {**config(stage, ep, offload), **(extra or {})})
    loss_of = LOSSES.get(name, hf_loss)
    losses = []
    assert (engine.dp_rank, engine.dp_world_size, engine.ep_world_size) == (rank, world, ep)  # every rank: own data
    for x in batches():
        (micro,) = micro_batches(x, engine.dp_rank, engine.dp_world_size, 1)
        loss = loss_of(engine, micro)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    traffic = {n: t.tokens_per_expert.clone() for n, t in engine.experts.traffic().items()}
    return losses, engine.full_state_dict(), traffic


def assert_matches_reference(name: str, world: int, stage: int, ep: int, offload: dict | None = None,
                             extra: dict | None = None):
    ref_losses, ref_params = reference_run(name, world)
    results = run_distributed(_train_worker, world, args=(name, stage, ep, offload, extra), timeout_s=240)
    assert_close_relative([sum(r[0][i] for r in results) / world for i in range(STEPS)], ref_losses)
    for _, params, _ in results:
        assert_params_close({k: v for k, v in params.items() if k in ref_params}, ref_params)
    return results


@pytest.mark.parametrize("stage", [1, 3])
def test_mixtral_expert_parallel_matches_plain_pytorch(stage):
    """An unmodified HF Mixtral at ep 2 over 2 ranks: experts split by its own base_model_ep_plan, its router and
    load-balancing aux loss its own, expert chunks reduced and sharded over their own group."""
    assert_matches_reference("mixtral_aux" if stage == 3 else "mixtral", 2, stage, 2)


def test_mixtral_dp4_ep2_zero3():
    """dp 4 = ep 2 × edp 2: expert chunks sharded over 2 ranks, dense ones over 4."""
    assert_matches_reference("mixtral", 4, 3, 2)


def test_mixtral_experts_offloaded(tmp_path):
    """Expert chunks page like any chunk: ZeRO-3 with parameters offloaded to CPU and optimizer states to NVMe."""
    offload = {"offload_param": {"device": "cpu"},
               "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    assert_matches_reference("mixtral", 2, 3, 2, offload)


def test_qwen_moe_expert_parallel_matches_plain_pytorch():
    """Qwen2-MoE: a shared expert beside the routed ones (dense, reduced over every rank), ZeRO-2."""
    assert_matches_reference("qwen_moe", 2, 2, 2)


@pytest.mark.parametrize("name", ["user", "user_capacity"])
def test_user_moe_layer_matches_plain_pytorch(name):
    """engine.moe.MoE in a user's model (loss and l_aux inside forward): dropless top-2 at ep 4 over 4 ranks, and
    DeepSpeed's capacity mode (top-1, capacity factor 1) at ep 2."""
    world = 4 if name == "user" else 2
    results = assert_matches_reference(name, world, 2, world if name == "user" else 2)
    if name == "user_capacity":  # the cut happened: some assignments were dropped, as in the reference
        kept = sum(int(r[2]["moe"].sum()) for r in results)
        assert kept < STEPS * BATCH * SEQ


def test_moe_layer_under_activation_checkpointing():
    """The MoE layer checkpointed under ZeRO-3: its recompute in backward exchanges tokens again on every rank,
    and routing is counted once per forward (not again in the recompute)."""
    extra = {"activation_checkpointing": {"enabled": True, "modules": ["MoE"]}}
    results = assert_matches_reference("user", 2, 3, 2, extra=extra)
    assert sum(int(r[2]["moe"].sum()) for r in results) == STEPS * BATCH * SEQ * 2  # top-2, dropless


def test_module_list_blocks_of_transformers_4():
    """The 4.x layout (experts in a ModuleList, routed in the block's forward; Note [experts in a module list]) at
    ep 2 under ZeRO-3: the block keeps its class, name and return value, the loss its load-balancing term."""
    results = assert_matches_reference("module_list", 2, 3, 2)
    assert set(results[0][2]) == {"blocks.0", "blocks.1"}


def test_expert_no_token_reaches_never_hangs():
    """Experts 2 and 3 (all of rank 1's at ep 2) get no token on any rank: under ZeRO-3 their chunks are still
    gathered, reduced (zero gradients) and stepped with every rank's, and training equals the reference."""
    results = assert_matches_reference("user_unreached", 2, 3, 2)
    for _, _, traffic in results:
        assert traffic["moe"][2:].sum() == 0 and traffic["moe"][:2].sum() > 0
