"""Note [one gradient factor]: the unscaling and the clipping reach torch's fused Adam as one grad_scale; no pass
multiplies the gradients, and training matches plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import initialize
from engine.models.gpt import GPT, GPTConfig
from engine.zero.gradient_factor import kernel_grad_scale, scaled_by
from offload.device_memory import SEPARATE_ENV
from tests.reference import assert_close_relative, assert_params_close, param_snapshot, trained_params
from tests.test_mixed_precision import LOSS_RTOL

LARGE = 1 << 16  # elements: a multiplication over this many is a pass over gradients, not over scalars
SCALING_OPS = {"aten::mul_", "aten::mul", "aten::_foreach_mul_", "aten::_foreach_mul", "aten::div_", "aten::div",
               "aten::_foreach_div_"}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class ScalingPasses(TorchDispatchMode):
    """Records every multiplication or division over a tensor of at least LARGE elements."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SCALING_OPS:
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            if any(isinstance(t, torch.Tensor) and t.numel() >= LARGE for t in tensors):
                self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=256))


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 8), generator=g) for _ in range(steps)]


def _config(stage: int, precision: str, offload: bool) -> dict:
    zero = {"stage": stage, "chunk_size": 1 << 20}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
            "gradient_clipping": 0.05, "zero_optimization": zero, "steps_per_print": 10**9,
            **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
            **({"fp16": {"enabled": True, "initial_scale_power": 8}} if precision == "fp16" else {})}


def _train(engine, batches, watch: ScalingPasses) -> list[float]:
    losses = []
    for x in batches:
        loss = engine(x, x)
        engine.backward(loss)
        with watch:
            engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage,precision,offload", [(2, "fp32", False), (1, "fp32", False), (2, "fp32", True),
                                                     (3, "bf16", False), (2, "fp16", True)])
def test_the_step_multiplies_no_gradient_and_clips_as_plain_pytorch(monkeypatch, stage, precision, offload):
    """Clipping is active every step (0.05 against norms of ~1); fp16 also unscales. The fp32 runs match plain
    PyTorch (fused AdamW after clip_grad_norm_); every run matches the same engine with torch's single-tensor
    AdamW (`torch_adam`), whose gradients are multiplied before it steps."""
    monkeypatch.setenv(SEPARATE_ENV, "1")
    batches = _batches(3)
    watch = ScalingPasses()
    engine = initialize(_gpt(), _config(stage, precision, offload))
    losses = _train(engine, batches, watch)
    assert watch.seen == []
    assert engine.skipped_steps == 0

    unfused = _config(stage, precision, offload)
    unfused["optimizer"]["params"]["torch_adam"] = True  # torch's single-tensor AdamW: gradients multiplied first
    multiplied = initialize(_gpt(), unfused)
    multiplied_watch = ScalingPasses()
    rtol = {"fp32": 1e-5, "bf16": LOSS_RTOL[torch.bfloat16], "fp16": LOSS_RTOL[torch.float16]}[precision]
    assert_close_relative(losses, _train(multiplied, batches, multiplied_watch), rtol=rtol)
    assert multiplied_watch.seen  # the check sees the passes where they are made
    if precision == "fp32":
        assert_params_close(trained_params(engine), trained_params(multiplied))
        reference = _gpt()
        opt = torch.optim.AdamW(reference.parameters(), **ADAMW, fused=True)
        expected = []
        for x in batches:
            loss = reference(x, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            expected.append(loss.item())
        assert_close_relative(losses, expected)
        assert_params_close(trained_params(engine), param_snapshot(reference))
    engine.close()
    multiplied.close()


def test_a_power_of_two_factor_gives_the_multiplication_bit_for_bit():
    g = torch.randn(4096, dtype=torch.float32)
    assert torch.equal(g / kernel_grad_scale([2.0 ** -12]), g * 2.0 ** -12)
    assert kernel_grad_scale([1.0, 1.0]) is None
    assert kernel_grad_scale([0.5, 0.25]).item() == 8.0


def test_an_optimizer_already_carrying_a_grad_scale_is_refused_unchanged():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], fused=True)
    opt.grad_scale = torch.tensor(4.0)
    with pytest.raises(RuntimeError, match="grad_scale"):
        with scaled_by(opt, (0.5,)):
            pass
    assert opt.grad_scale.item() == 4.0
    del opt.grad_scale
    with scaled_by(opt, (0.5,)):
        assert opt.grad_scale.item() == 2.0
    assert not hasattr(opt, "grad_scale")
