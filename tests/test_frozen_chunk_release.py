"""When stage 3's backward may release a frozen chunk early (Note [frozen chunks]): a frozen module applied twice keeps
its chunk until both calls' backward are done, and a module that also trains a parameter of its own keeps its frozen
chunk to the pass end; both train as plain PyTorch does."""

from __future__ import annotations

import torch
from torch import nn

from engine import initialize
from engine.zero.chunk_state import ChunkPhase
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_frozen_chunks import stage_config
from tests.test_zero import GLOBAL_BATCH

WIDTH = 16


class FrozenTwice(nn.Module):
    """A trainable layer, then one frozen Linear applied twice in a row, then a trainable head."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = self.frozen(h)
        h = self.frozen(h)
        return self.head(h).square().mean()


class FrozenWeightTrainableScale(nn.Module):
    """Owns a frozen weight W and a trainable scale s and computes with `W * s`: s's gradient reads W."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5, requires_grad=False)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, h):
        return h @ (self.weight * self.scale).t()


class ScaledModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.scaled = FrozenWeightTrainableScale()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.scaled(torch.tanh(self.first(x)))).square().mean()


def batches(steps: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(GLOBAL_BATCH, WIDTH, generator=generator) for _ in range(steps)]


def build(model_class):
    torch.manual_seed(0)
    return model_class()


def train_recording_phase(model_class, frozen_name: str):
    """Trains on stage 3 (paging in one process); records the frozen chunk's phase when `first`'s weight gets its
    gradient (the frozen module's backward, or every call's, is then done)."""
    engine = initialize(build(model_class), stage_config(3, 1, offload="cpu"))
    chunked = engine.chunked
    frozen = dict(engine.module.named_parameters())[frozen_name]
    chunk = chunked.param_chunk_index()[id(frozen)]
    assert chunked.all_states[chunk].frozen
    seen = []
    engine.module.first.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(chunked.all_states[chunk].phase))
    losses, _ = train_engine(engine, batches(), 0, 1, 1, loss_fn=lambda e, x: e(x))
    params = trained_params(engine)
    engine.close()
    return losses, params, seen


def reference(model_class):
    model = build(model_class)
    losses, _ = train_reference(model, batches(), adamw, clip=1.0, loss_fn=lambda m, x: m(x))
    return losses, param_snapshot(model)


def test_a_frozen_module_applied_twice_keeps_its_chunk_until_both_calls_backward_is_done():
    """Two calls count twice: the second call's backward does not release the chunk the first call's backward still
    reads; once both are done (the trainable layer before them gets its gradient) it is released."""
    losses, params, seen = train_recording_phase(FrozenTwice, "frozen.weight")
    ref_losses, ref_params = reference(FrozenTwice)
    assert_close_relative(losses, ref_losses)
    assert_params_close(params, ref_params)
    assert seen == [ChunkPhase.SHARDED] * 3


def test_a_module_training_a_parameter_of_its_own_keeps_its_frozen_chunk_to_the_pass_end():
    """`W * s`: s's gradient reads the frozen W, so W's chunk is not released when the module's input gradient is
    computed (still gathered when the layer before gets its gradient), and training equals plain PyTorch."""
    losses, params, seen = train_recording_phase(ScaledModel, "scaled.weight")
    ref_losses, ref_params = reference(ScaledModel)
    assert_close_relative(losses, ref_losses)
    assert_params_close(params, ref_params)
    assert seen == [ChunkPhase.GATHERED] * 3
