"""A Hugging Face GPT-2 (built from a config, no download) trains through the engine exactly as in plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw

transformers = pytest.importorskip("transformers")

STEPS = 3
GLOBAL_BATCH = 8


def hf_gpt2(seed: int = 0):
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def hf_loss(model_or_engine, x):
    return model_or_engine(input_ids=x, labels=x).loss


def _gpt2_worker(rank, world, stage):
    cfg = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "chunk_size": 50_000, "stage3_param_persistence_threshold": 0}}
    engine = initialize(hf_gpt2(), cfg)
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1, loss_fn=hf_loss)
    return losses, trained_params(engine)


@pytest.mark.parametrize("stage", [0, 3])
def test_hf_gpt2_matches_plain_pytorch(stage):
    """GPT2LMHeadModel (Conv1D layers, tied lm_head) with data parallelism and under ZeRO-3."""
    assert_matches_plain_pytorch(hf_gpt2(), _gpt2_worker, stage)


def assert_matches_plain_pytorch(reference, worker, stage: int) -> None:
    """`worker` on 2 ranks gives the losses and final parameters of `reference` trained in one process."""
    ref_losses, _ = train_reference(reference, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0, loss_fn=hf_loss)
    results = run_distributed(worker, 2, args=(stage,), timeout_s=180)
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params in results:
        assert_params_close(params, param_snapshot(reference))


def hf_llama(seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _llama_zero_worker(rank, world, stage):
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": ADAMW}, "gradient_clipping": 1.0,
           # threshold 0: every parameter of this small model sharded under stage 3 (the default keeps them all whole)
           "zero_optimization": {"stage": stage, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0},
           "steps_per_print": 10**6}
    engine = initialize(hf_llama(), cfg)
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 2, loss_fn=hf_loss)
    return losses, trained_params(engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hf_llama_zero_matches_plain_pytorch(stage):
    """LlamaForCausalLM (grouped-query attention) under ZeRO-1/2/3 on 2 ranks with accumulation and clipping."""
    assert_matches_plain_pytorch(hf_llama(), _llama_zero_worker, stage)
