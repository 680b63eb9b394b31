"""Pieces of tensor parallelism: the vocab-parallel cross-entropy, user plans, and the errors plans give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import initialize
from engine.config import ConfigError
from engine.tensor_parallel import TPGroup, apply_tensor_parallel, vocab_parallel_cross_entropy
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
)
from tests.test_data_parallel import adamw
from tests.test_tensor_parallel import GLOBAL_BATCH, STEPS, TP_RTOL, build, tp_config


def _cross_entropy_worker(rank, world):
    import torch.distributed as dist
    tp = TPGroup(dist.group.WORLD, world, rank)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 16, generator=g) * 3
    target = torch.randint(0, 16, (6, 5), generator=g)
    target[0, :2] = -100  # ignored positions
    width = 16 // world
    mine = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, tp)
    loss.backward()
    return loss.item(), mine.grad, logits, target


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_equals_torchs_on_the_full_logits(world):
    results = run_distributed(_cross_entropy_worker, world)
    logits, target = results[0][2].requires_grad_(), results[0][3]
    expected = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), ignore_index=-100)
    expected.backward()
    width = 16 // world
    for rank, (loss, grad, _, _) in enumerate(results):
        assert abs(loss - expected.item()) <= 1e-6 * abs(expected.item())
        torch.testing.assert_close(grad, logits.grad[..., rank * width:(rank + 1) * width], rtol=1e-5, atol=1e-7)


# the first matching glob wins: down_proj before the other mlp projections
LLAMA_USER_PLAN = {"model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
                   "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.down_proj": "rowwise",
                   "model.layers.*.mlp.*_proj": "colwise", "lm_head": "colwise"}


def shifted_loss(logits: torch.Tensor, x: torch.Tensor, loss_fn) -> torch.Tensor:
    return loss_fn(logits[:, :-1], x[:, 1:])


def _user_plan_worker(rank, world):
    cfg = tp_config(world, 1)
    cfg["tensor_parallel"]["plan"] = LLAMA_USER_PLAN
    engine = initialize(build("llama", seed=rank), cfg)
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        logits = engine(input_ids=x).logits  # this rank's slice of the vocabulary
        assert logits.shape[-1] == 256 // world
        loss = shifted_loss(logits, x, engine.tensor_parallel.cross_entropy)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def test_a_user_plan_with_a_split_lm_head_and_the_vocab_parallel_loss_trains_llama():
    reference = build("llama")
    ref_losses, _ = train_reference(reference, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0,
                                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    for losses, full in run_distributed(_user_plan_worker, 2):
        assert_close_relative(losses, ref_losses, rtol=TP_RTOL)
        params = param_snapshot(reference)
        assert_params_close({k: full[k] for k in params}, params, rtol=TP_RTOL)


# --- plan errors (no communication needed: one process stands in for rank 0 of 2) ---------------

TP2 = TPGroup(None, 2, 0)


def test_plan_errors_name_the_module_and_the_fix():
    with pytest.raises(ValueError, match=r"tensor_parallel.plan\['lm_head'\]: style 'column' is not a 1d style"):
        apply_tensor_parallel(tiny_gpt(n_head=4), {"lm_head": "column"}, TP2)
    with pytest.raises(ValueError, match=r"style \"vocab\" is for nn.Embedding, but 'lm_head' is a Linear"):
        apply_tensor_parallel(tiny_gpt(n_head=4), {"lm_head": "vocab"}, TP2)
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to wte.weight, which the plan splits differently"):
        apply_tensor_parallel(tiny_gpt(n_head=4), {"wte": "vocab", "lm_head": "rowwise"}, TP2)
    with pytest.raises(ValueError, match=r"blocks.0.attn.n_head = 2 does not split into 4 tensor-parallel parts"):
        apply_tensor_parallel(tiny_gpt(n_head=2), "auto", TPGroup(None, 4, 0))
    with pytest.raises(ValueError, match=r"no built-in 1d plan 'Bert'"):
        apply_tensor_parallel(tiny_gpt(n_head=4), "Bert", TP2)


def test_tensor_parallel_needs_as_many_processes_and_a_config_optimizer():
    with pytest.raises(ValueError, match="tensor_parallel.size 2 needs 2 processes"):
        initialize(tiny_gpt(n_head=4), tp_config(2, 1))
    with pytest.raises(ConfigError, match="tensor_parallel.size: 2 .* must be a square"):
        initialize(tiny_gpt(n_head=4), {**tp_config(2, 1), "tensor_parallel": {"size": 2, "mode": "2d"}})


# --- dropout streams (Note [tensor-parallel RNG]) ---------------------------------------------


def _dropout_worker(rank, world):
    from engine.tensor_parallel.rng import Stream
    # ranks seeded differently (seed = rank): initialize makes the default stream the same across the tp group
    engine = initialize(tiny_gpt(seed=rank, n_head=4, dropout=0.2), tp_config(world, 1))
    outputs = []
    engine.module.blocks[-1].register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
    losses = []
    for x in token_batches(2, GLOBAL_BATCH):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    streams = engine.tensor_parallel.streams
    with streams.using(Stream.SHARDED):
        sharded = torch.rand(8)
        with streams.using(Stream.REPLICATED):
            nested_replicated = torch.rand(8)
    replicated = torch.rand(8)
    return losses, outputs, sharded, nested_replicated, replicated


def test_dropout_draws_one_mask_on_replicated_activations_and_per_rank_masks_on_split_ones():
    (losses0, out0, sharded0, nested0, rep0), (losses1, out1, sharded1, nested1, rep1) = \
        run_distributed(_dropout_worker, 2)
    assert losses0 == losses1  # dropout on replicated activations agreed, or the ranks would differ here
    for a, b in zip(out0, out1):
        assert torch.equal(a, b)
    assert not torch.equal(sharded0, sharded1)  # each rank's own stream for split activations
    assert torch.equal(nested0, nested1) and torch.equal(rep0, rep1)  # the shared stream, also nested inside


def test_a_plan_that_cannot_split_the_model_leaves_it_untouched():
    model = tiny_gpt(n_head=2)
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(ValueError, match="n_head = 2 does not split into 4"):
        apply_tensor_parallel(model, "auto", TPGroup(None, 4, 0))
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert model.blocks[0].attn.n_head == 2
