"""The offloaded host step in tiles (Note [the host step in tiles]): what it allocates, and that it trains as the
in-memory step does."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import initialize
from engine.models.gpt import GPT, GPTConfig
from offload.device_memory import SEPARATE_ENV
from tests.reference import assert_close_relative, assert_params_close, trained_params

LARGE = 1 << 20  # bytes


class LargeAllocations(TorchDispatchMode):
    """Records every op that returns a fresh tensor (not a view, not in place) of at least LARGE bytes."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = not any(a.alias_info is not None for a in func._schema.returns)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if fresh and isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= LARGE:
                self.seen.append(f"{func} -> {tuple(t.shape)} {t.dtype}")
        return out


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=256))


def _config(precision: str, offload: bool) -> dict:
    zero = {"stage": 2, "chunk_size": 1 << 20}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 0.5, "zero_optimization": zero, "steps_per_print": 10**9,
            **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
            **({"fp16": {"enabled": True, "initial_scale_power": 8}} if precision == "fp16" else {})}


def _train(engine, steps: int = 3, watch: LargeAllocations | None = None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        x = torch.randint(0, 256, (2, 8), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        if watch is not None and i == steps - 1:
            with watch:
                engine.step()
        else:
            engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_the_offloaded_step_allocates_no_large_host_tensor_and_trains_as_in_memory(monkeypatch, precision):
    monkeypatch.setenv(SEPARATE_ENV, "1")
    reference = initialize(_gpt(), _config(precision, offload=False))
    expected = _train(reference)
    engine = initialize(_gpt(), _config(precision, offload=True))
    watch = LargeAllocations()
    losses = _train(engine, watch=watch)
    assert watch.seen == []  # the scratch tiles were made by the first step and are reused
    assert engine.skipped_steps == reference.skipped_steps == 0
    assert_close_relative(losses, expected)
    assert_params_close(trained_params(engine), trained_params(reference))
    assert all(info["tiled"] for *_, info in engine.optimizer._items)
    engine.close()
    reference.close()


def test_the_allocation_check_sees_a_large_fresh_tensor():
    watch = LargeAllocations()
    with watch:
        torch.empty(LARGE // 4 + 1).float()
        torch.zeros(16)
    assert len(watch.seen) == 1
