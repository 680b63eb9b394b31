"""engine.moe's edges: router losses from the config, TensorBoard telemetry (tokens per expert, drop rate, all-to-all
bytes equal to what the routing sent), the capacity cut, and the refusals that name their fix."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine import initialize
from engine.moe import MoE
from engine.moe.dispatch import capacity_of, order_assignments
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.moe_models import (
    Expert,
    MixtralSparseMoeBlock,
    ModuleListMoEModel,
    UserMoEModel,
    hf_loss,
    mixtral,
    qwen_moe,
    user_loss,
)
from tests.reference import assert_params_close, micro_batches, param_snapshot, tiny_gpt, train_reference
from tests.test_data_parallel import adamw
from tests.test_moe import BATCH, SEQ, batches, config

pytest.importorskip("transformers")

AUX, Z = 0.01, 0.001


def _losses_worker(rank, world):
    engine = initialize(UserMoEModel(drop_tokens=False, aux_weight=0.0), config(1, 2, aux_loss_coef=AUX, z_loss_coef=Z))
    for x in batches():
        (micro,) = micro_batches(x, rank, world, 1)
        engine.backward(user_loss(engine, micro))
        engine.step()
    full = engine.full_state_dict()
    engine.close()
    return full


def test_router_losses_from_the_config_are_trained(two_ranks):
    """moe.aux_loss_coef and z_loss_coef: the engine adds coef·l_aux + coef·z-loss of every engine.moe.MoE layer to
    the loss it backpropagates; the result equals plain PyTorch adding them by hand."""
    model = UserMoEModel(drop_tokens=False, aux_weight=0.0)
    seen = {}
    model.moe.gate.register_forward_hook(lambda m, i, out: seen.update(logits=out[0]))
    model.moe.register_forward_hook(lambda m, i, out: seen.update(l_aux=out[1]))

    def loss_fn(m, x):
        total = 0.0
        for part in micro_batches(x, 0, 1, 2):
            loss = user_loss(m, part)
            z_loss = torch.logsumexp(seen["logits"], dim=-1).square().mean()
            total = total + loss + AUX * seen["l_aux"] + Z * z_loss
        return total / 2

    train_reference(model, batches(), adamw, clip=1.0, loss_fn=loss_fn)
    for params in two_ranks[("losses",)]:
        assert_params_close({k: v for k, v in params.items() if k in dict(model.named_parameters())},
                            param_snapshot(model))


def _telemetry_worker(rank, world, log_dir, capacity_factor):
    cfg = config(0, 2, **({"capacity_factor": capacity_factor} if capacity_factor else {}))
    cfg["tensorboard"] = {"enabled": True, "output_path": log_dir, "job_name": "moe"}
    engine = initialize(mixtral(), cfg)
    for x in batches()[:2]:
        (micro,) = micro_batches(x, rank, world, 1)
        engine.backward(hf_loss(engine, micro))
        engine.step()
    engine.close()  # flushes the monitor


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_telemetry_counts_what_the_routing_sent(two_ranks, two_ranks_log_dir, capacity_factor):
    """Per step and layer: every rank's tokens per expert add up to the kept assignments (all of them dropless,
    fewer under a capacity factor, as the drop rate says), and rank 0's all-to-all bytes are exactly its routing's:
    the per-expert counts (E int64) once, and in forward and backward the rows it sent and those it received."""
    assert two_ranks[("telemetry", capacity_factor)] == [None, None]  # the case ran on both ranks
    tmp_path = two_ranks_log_dir / str(capacity_factor)
    events = EventAccumulator(str(tmp_path / "moe"))
    events.Reload()
    experts, hidden, k, tokens_rank0 = 4, 32, 2, BATCH // 2 * SEQ
    for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        counts = [[p.value for p in events.Scalars(f"MoE/{layer}/tokens_expert_{e}")] for e in range(experts)]
        drops = [p.value for p in events.Scalars(f"MoE/{layer}/drop_rate")]
        sent = [p.value for p in events.Scalars(f"MoE/{layer}/all_to_all_bytes")]
        for step in range(2):
            kept = sum(c[step] for c in counts)
            assert kept == pytest.approx(BATCH * SEQ * k * (1 - drops[step]))
            assert (drops[step] > 0.3) if capacity_factor else (drops[step] == 0.0)
            received = counts[0][step] + counts[1][step]  # rank 0 holds experts 0 and 1
            if capacity_factor is None:
                assert sent[step] == experts * 8 + 2 * (tokens_rank0 * k + received) * hidden * 4


def test_capacity_keeps_first_choices_first():
    """GShard's priority: an over-full expert keeps every token's first choice before any second choice, in token
    order; the capacity is ⌈cf·k·T/E⌉ (at least min_capacity)."""
    chosen = torch.tensor([[0, 1], [1, 0], [0, 1], [2, 0]])  # [T=4, k=2]
    order, kept = order_assignments(chosen, 3, capacity=2)
    assert kept.tolist() == [2, 2, 1]
    # choice-major indices (choice j of token t is j·T + t): expert 0 keeps tokens 0, 2 (first choices) and drops
    # the second choices of tokens 1 and 3; expert 1 keeps token 1's first choice and token 0's second
    assert order.tolist() == [0, 2, 1, 4, 3]
    assert capacity_of(64, 2, 4, 1.25, 4) == 40 and capacity_of(4, 1, 8, 1.0, 4) == 4
    assert capacity_of(4, 1, 8, None, 4) is None


def _refusals_worker(rank, world):
    errors = []
    cases = [(lambda: mixtral(), config(0, 3)), (lambda: tiny_gpt(), config(0, 2)),
             (lambda: UserMoEModel(ep_size=4, num_experts=8), config(0, 2)),
             (lambda: mixtral(), config(0, 2, z_loss_coef=0.1)),
             (lambda: mixtral(), config(0, 2, aux_loss_coef=0.1)),
             (lambda: mixtral(), {**config(0, 2), "tensor_parallel": {"size": 2, "sequence_parallel": True}}),
             (lambda: _frozen_expert(), config(0, 2))]
    for build, cfg in cases:
        with pytest.raises(ValueError) as e:
            initialize(build(), cfg)
        errors.append(str(e.value))
    return errors


def _frozen_expert():
    model = UserMoEModel()
    model.moe.experts[0].fc1.bias.requires_grad_(False)
    return model


def test_refusals_name_the_fix(two_ranks):
    errors = two_ranks[("refusals",)][0]
    expected = ["must divide the data-parallel size 2", "no MoE layer Tiers can split",
                "ep_size=4) but moe.expert_parallel_size is 2", "z-loss is added by engine.moe.MoE",
                "output_router_logits=True", "with tensor_parallel.sequence_parallel is not built",
                "buffers or frozen parameters"]
    for error, text in zip(errors, expected):
        assert text in error, error


@pytest.mark.parametrize("args, text", [({"use_tutel": True}, "use_tutel"), ({"ep_size": 3}, "not a multiple"),
                                        ({"k": 5}, "1 <= k <= num_experts"),
                                        ({"noisy_gate_policy": "Gumbel"}, "noisy_gate_policy")])
def test_moe_layer_refuses_what_it_cannot_do(args, text):
    with pytest.raises(ValueError, match=text):
        MoE(8, Expert(8), num_experts=4, **args)


def test_routed_layers_keep_names_and_classes():
    """In one process, a `moe` section routes a model's own MoE layers through Tiers' dispatch: a 4.x block stays an
    instance of its class (transformers finds router logits by class), 5.x experts keep their module path; every
    state-dict key is unchanged."""
    for build in (ModuleListMoEModel, qwen_moe):
        keys = list(build().state_dict())
        engine = initialize(build(), {**config(0, 1, capacity_factor=4.0), "train_batch_size": 2})
        assert list(engine.module.state_dict()) == keys
        assert set(engine.experts.layers) and all(name in dict(engine.module.named_modules())
                                                  for name in engine.experts.layers)
        if build is ModuleListMoEModel:
            assert all(isinstance(b, MixtralSparseMoeBlock) for b in engine.module.blocks)


def _modifier_worker(rank, world, stage):
    engine = initialize(UserMoEModel(drop_tokens=False), config(stage, 2))
    with engine.gathered_parameters(modifier_rank=0):
        for p in engine.module.parameters():
            p.data.fill_(rank + 1.0)
    full = engine.full_state_dict()
    engine.close()
    return full


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_modifier_keeps_each_ranks_experts(two_ranks, stage):
    """gathered_parameters(modifier_rank=0) at ep 2: dense parameters take rank 0's values on every rank; each ep
    rank's experts take the values of the rank holding them in the modifier's place (rank 1's experts: rank 1's),
    not rank 0's copies of other experts."""
    for state in two_ranks[("modifier", stage)]:
        for name, value in state.items():
            expert = int(name.split(".")[2]) if name.startswith("moe.experts.") else None
            expected = 2.0 if expert is not None and expert >= 2 else 1.0
            assert torch.all(value == expected), name


# --- every two-rank case above in one spawned group: start-up, not the cases, dominates their time ------------

TWO_RANK_CASES = [("losses",), ("telemetry", None), ("telemetry", 0.5), ("modifier", 1), ("modifier", 3),
                  ("refusals",)]  # last: it ends with refused initializations


def _two_rank_cases_worker(rank, world, log_dir):
    workers = {"losses": _losses_worker, "modifier": _modifier_worker, "refusals": _refusals_worker,
               "telemetry": lambda r, w, cf: _telemetry_worker(r, w, f"{log_dir}/{cf}", cf)}
    return run_cases(rank, TWO_RANK_CASES, lambda kind, *args: workers[kind](rank, world, *args))


@pytest.fixture(scope="module")
def two_ranks_log_dir(tmp_path_factory):
    """The telemetry cases' TensorBoard folders, one per capacity factor."""
    return tmp_path_factory.mktemp("moe_api_tensorboard")


@pytest.fixture(scope="module")
def two_ranks(two_ranks_log_dir) -> dict[tuple, list]:
    """Each two-rank case's results in rank order, keyed by the case."""
    per_rank = run_distributed(_two_rank_cases_worker, 2, args=(str(two_ranks_log_dir),), timeout_s=600)
    return results_by_case(per_rank)
