"""engine.train_batch under a pipeline config (Note [a pipelined step]): unmodified models split at their blocks
(Note [pipeline stages of an unmodified model]) train exactly as one process trains the whole model (fp32 1e-5):
every schedule, pp 2 and 4, dp × pp under ZeRO-1, tied weights, activation checkpointing, Hugging Face models."""

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

STEPS, GLOBAL_BATCH, LAYERS = 3, 8, 4


def example_gpt(seed: int = 0, tied: bool = True):
    return tiny_gpt(seed, n_layer=LAYERS, tie_weights=tied)


def hf_gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=LAYERS, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt": example_gpt, "gpt_untied": lambda: example_gpt(tied=False), "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = MODELS[name]()
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0,
                                    loss_fn=lambda m, x: _loss(m(input_ids=x, labels=x)))
    return losses, param_snapshot(model), norms


def _loss(out):
    return out if torch.is_tensor(out) else out.loss


def pipeline_config(pp: int, schedule: str, dp: int, accumulation: int, v: int = 1, stage: int = 0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp // accumulation,
            "gradient_accumulation_steps": accumulation, "optimizer": {"type": "AdamW", "params": ADAMW},
            "gradient_clipping": 1.0, "steps_per_print": 10**6,
            # small chunks: several per stage, so stage 3 has chunks to gather ahead
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "chunk_size": 20_000},
            "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v}, **extra}


def stage_params(engine) -> dict[str, torch.Tensor]:
    """This rank's parameters under their names in the whole model (gathered under stage 3)."""
    names = engine.pipeline.split.names
    with engine.gathered_parameters():
        local = {names[id(p)]: p.detach().clone() for p in engine.module.parameters()}
    if engine.tensor_parallel is not None:  # whole weights from the tp shards (Note [tensor-parallel plans])
        return engine.tensor_parallel.join_state_dict(local, engine.device)
    return local


def _worker(rank, world, name, pp, schedule, accumulation, v, stage, extra):
    tp = extra.get("tensor_parallel", {}).get("size", 1)
    engine = initialize(MODELS[name](), pipeline_config(pp, schedule, world // pp // tp, accumulation, v, stage,
                                                        **extra))
    assert (engine.tensor_parallel is not None) == (tp > 1)
    dp_rank, dp = engine.dp_rank, engine.dp_world_size  # Note [data-parallel coordinates]
    assert (dp, engine.num_stages) == (world // pp // tp, pp)
    losses, norms = [], []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        mbs = [{"input_ids": x, "labels": x} for x in micro_batches(batch, dp_rank, dp, accumulation)]
        losses.append(engine.train_batch(iter(mbs)))
        norms.append(engine.get_global_grad_norm())
    gatherer = engine.gatherer
    traces = None if gatherer is None else (gatherer.prefetched, {str(k): t.divergences
                                                                  for k, t in gatherer.traces.items()})
    return losses, norms, stage_params(engine), traces


def check_against_reference(name: str, world: int, pp: int, schedule: str, accumulation: int = 4, v: int = 1,
                            stage: int = 0, extra: dict | None = None) -> None:
    ref_losses, ref_params, ref_norms = reference(name)
    results = run_distributed(_worker, world, args=(name, pp, schedule, accumulation, v, stage, extra or {}),
                              timeout_s=240)
    for losses, norms, _, traces in results:  # the step's loss and the global norm on every rank
        assert_close_relative(losses, ref_losses)
        assert_close_relative(norms, ref_norms)
        if stage == 3:  # each action follows its own gather trace: none diverged, and chunks were prefetched
            prefetched, divergences = traces
            assert prefetched > 0 and not any(divergences.values()), traces
    held: dict[str, torch.Tensor] = {}
    assert all(len(params) < len(ref_params) for _, _, params, _ in results)  # each rank holds its stages only
    for _, _, params, _ in results:
        for key, value in params.items():
            if key in held:  # a parameter two stages hold (tied), or every data-parallel rank: the same values
                torch.testing.assert_close(value, held[key], rtol=0, atol=0)
            held[key] = value
    assert_params_close(held, ref_params)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_example_gpt_at_pp2_equals_one_process(schedule):
    check_against_reference("gpt", 2, 2, schedule)


@pytest.mark.parametrize("schedule,v", [("zero_bubble", 1), ("interleaved", 2)])
def test_interleaved_and_zero_bubble_equal_one_process(schedule, v):
    check_against_reference("gpt", 2, 2, schedule, v=v)


def test_pp4_with_untied_weights():
    check_against_reference("gpt_untied", 4, 4, "1f1b")


@pytest.mark.parametrize("stage,schedule,v", [(1, "1f1b", 1), (2, "1f1b", 1), (3, "1f1b", 1),
                                              (3, "zero_bubble", 1), (3, "interleaved", 2)])
def test_dp2_by_pp2_under_zero(stage, schedule, v):
    """Gradients accumulate per stage over the micro-batches and are reduced once per step; stage 3 gathers each
    module's parameters around its forward and backward (every parameter sharded: threshold 0), prefetching by a
    trace per stage and action kind (two stages per rank under interleaved)."""
    check_against_reference("gpt", 4, 2, schedule, accumulation=2, stage=stage, v=v)


@pytest.mark.parametrize("name,schedule", [("hf_gpt2", "gpipe"), ("hf_gpt2", "1f1b"), ("hf_llama", "gpipe"),
                                           ("hf_llama", "1f1b")])
def test_hugging_face_models_at_pp2(name, schedule):
    """GPT-2 (lm_head tied to wte across the first and last stage; blocks return tuples) and Llama (rotary
    position embeddings and the causal mask computed before the blocks, on every stage)."""
    check_against_reference(name, 2, 2, schedule)


def test_with_activation_checkpointing():
    check_against_reference("gpt", 2, 2, "1f1b", extra={"activation_checkpointing": {"enabled": True}})


def test_pp2_by_tp2():
    """Tensor parallelism inside each stage: the plan shards the blocks, then the pipeline cuts them."""
    check_against_reference("gpt_untied", 4, 2, "1f1b", extra={"tensor_parallel": {"size": 2}})
