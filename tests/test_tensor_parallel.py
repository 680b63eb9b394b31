"""Tensor parallelism (engine/tensor_parallel), 1D and 2D: the sharded model equals single-process PyTorch on
the same global batch (losses 1e-4 relative, full_state_dict after training), alone and under ZeRO."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
)
from tests.test_data_parallel import ADAMW, adamw

TP_RTOL = 1e-4
STEPS = 3
GLOBAL_BATCH = 8


def tp_config(tp: int, dp: int, accumulation: int = 1, stage: int = 0, mode: str = "1d", **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp // accumulation,
            "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": ADAMW},
            "gradient_clipping": 1.0,
            "tensor_parallel": {"size": tp, "mode": mode, "plan": "auto"},
            "zero_optimization": {"stage": stage, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10**6, **extra}


def build(model: str, seed: int = 0):
    """The test models, all with 4 attention heads (so that tp = 4 splits them): the example GPT, Hugging
    Face GPT-2 (Conv1D layers, fused q/k/v, tied lm_head) and Llama (grouped-query attention: 4 query,
    2 key/value heads at tp <= 2; 8 and 4 at tp = 4)."""
    if model == "gpt":
        return tiny_gpt(seed=seed, n_head=4)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if model == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    heads, kv_heads = (8, 4) if model == "llama8" else (4, 2)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=32))


def loss_of(model: str, module_or_engine, x: torch.Tensor) -> torch.Tensor:
    if model == "gpt":
        return module_or_engine(x, x)
    return module_or_engine(input_ids=x, labels=x, use_cache=False).loss  # no cache: it is refused under checkpointing


_references: dict[str, tuple] = {}


def reference(model: str) -> tuple:
    if model not in _references:
        net = build(model)
        losses, norms = train_reference(net, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0,
                                        loss_fn=lambda m, x: loss_of(model, m, x))
        _references[model] = (losses, norms, param_snapshot(net), list(build(model).state_dict()))
    return _references[model]


def _tp_worker(rank, world, model, tp, stage, accumulation, mode):
    dp = world // tp
    return train_tp(model, tp_config(tp, dp, accumulation, stage, mode), rank, tp, dp, accumulation)


def train_tp(model: str, cfg: dict, rank: int, tp: int, dp: int, accumulation: int) -> tuple:
    """STEPS steps of `model` under `cfg` (a tp group shares its data): the losses, gradient norms, whole state
    dict, parameter elements on this rank, dp rank and the sharded parameters' names."""
    engine = initialize(build(model, seed=rank), cfg)
    assert (engine.topology.tp_size, engine.dp_world_size) == (tp, dp)
    local_param_numel = sum(p.numel() for p in engine.module.parameters())
    losses, norms = [], []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        step_losses = []
        for micro in micro_batches(x, engine.dp_rank, dp, accumulation):  # a tp group shares its data
            loss = loss_of(model, engine, micro)
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
        norms.append(engine.get_global_grad_norm())
    full = engine.full_state_dict()
    return losses, norms, full, local_param_numel, engine.dp_rank, set(engine.tensor_parallel.specs)


def _tp_worker_per_model(rank, world, models, tp, stage, accumulation, mode):
    """Every model of one layout in one set of processes: the spawn costs more than a tiny model's steps."""
    return {model: _tp_worker(rank, world, model, tp, stage, accumulation, mode) for model in models}


# world, tp, ZeRO stage, accumulation, mode
LAYOUTS = [(2, 2, 0, 1, "1d"), (4, 4, 0, 2, "1d"), (4, 2, 2, 1, "1d"), (4, 2, 3, 1, "1d"), (4, 4, 0, 2, "2d")]


@pytest.mark.parametrize("world,tp,stage,accumulation,mode", LAYOUTS,
                         ids=["tp2", "tp4", "dp2xtp2-zero2", "dp2xtp2-zero3", "2x2-2d"])
def test_tensor_parallel_matches_single_process(world, tp, stage, accumulation, mode):
    """gpt, gpt2 and llama (llama8 under 1D tp 4: its heads must divide) against plain PyTorch, one layout."""
    models = ["gpt", "gpt2", "llama8" if tp == 4 and mode == "1d" else "llama"]
    results = run_distributed(_tp_worker_per_model, world, args=(models, tp, stage, accumulation, mode), timeout_s=300)
    for model in models:
        check_against_reference(model, [per_rank[model] for per_rank in results], world, tp, mode)


def test_2d_under_zero_3_over_two_data_parallel_groups():
    """dp 2 × a 2×2 mesh (8 processes): ZeRO-3 shards each 1/4 piece again over the dp group."""
    results = run_distributed(_tp_worker, 8, args=("gpt", 4, 3, 1, "2d"), timeout_s=300)
    check_against_reference("gpt", results, 8, 4, "2d")


def check_against_reference(model: str, results: list, world: int, tp: int, mode: str,
                            share: int | None = None) -> None:
    """share: the parts each sharded weight is cut into (tp, except under 2.5D, whose grids hold the same pieces)."""
    ref_losses, ref_norms, ref_params, ref_keys = reference(model)
    dp = world // tp
    mean_losses = [sum(r[0][i] for r in results) / world for i in range(STEPS)]  # each dp group's mean, averaged
    assert_close_relative(mean_losses, ref_losses, rtol=TP_RTOL)
    whole = sum(p.numel() for p in ref_params.values())
    for _losses, norms, full, local_numel, _dp_rank, sharded in results:
        assert_close_relative(norms, ref_norms, rtol=TP_RTOL)
        assert list(full) == ref_keys
        assert_params_close({k: full[k] for k in ref_params}, ref_params, rtol=TP_RTOL)
        # parameter elements per rank: 1/tp (1D) or 1/q² (2D, tp = q²) of the sharded layers plus the
        # replicated small tensors; under 2D nothing is replicated
        replicated = sum(p.numel() for name, p in ref_params.items() if name not in sharded)
        assert local_numel == (whole - replicated) / (share or tp) + replicated
        assert replicated < 0.1 * whole, (replicated, whole)
        assert mode == "1d" or replicated == 0
    for i in range(len(results)):  # ranks of one tp group see the same loss
        assert results[i][0] == results[i - i % tp][0]
    assert dp == len({r[4] for r in results})
