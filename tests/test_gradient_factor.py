"""Note [one gradient factor]: the unscaling and the clipping reach torch's fused Adam as one grad_scale; no pass
multiplies the gradients, and training matches plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import initialize
from engine.models.gpt import GPT, GPTConfig
from engine.zero.gradient_factor import folds_factors, kernel_grad_scale, scaled_by
from offload.device_memory import SEPARATE_ENV
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    train_reference,
    trained_params,
)
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
        expected, _ = train_reference(reference, batches, lambda params: torch.optim.AdamW(params, **ADAMW, fused=True),
                                      clip=0.05)
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


def test_an_infinite_norm_clips_by_zero_as_the_multiplication_does():
    """bf16 / fp32 take the step whatever the norm (as DeepSpeed does): an infinite gradient element clips every
    gradient by 0, so finite ones step as 0 and the infinite one as NaN, the same as multiplying by the factor."""
    assert kernel_grad_scale([0.0]).item() == float("inf")
    batches = _batches(1)
    out = []
    for torch_adam in (False, True):
        cfg = _config(2, "fp32", offload=False)
        cfg["optimizer"]["params"]["torch_adam"] = torch_adam
        engine = initialize(_gpt(), cfg)
        x = batches[0]
        engine.backward(engine(x, x))
        first = next(p for p in engine.module.parameters() if p.grad is not None and p.grad.dim() == 2)
        first.grad[0, 0] = float("inf")
        engine.step()
        assert engine.skipped_steps == 0 and engine.get_global_grad_norm() == float("inf")
        out.append(trained_params(engine))
        engine.close()
    folded, multiplied = out
    assert any(t.isnan().any() for t in folded.values())
    for name, value in multiplied.items():
        torch.testing.assert_close(folded[name], value, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_client_fused_adamw_whose_first_group_is_frozen_takes_the_factor(precision):
    """A first param group whose parameters are all frozen (a frozen embedding, LoRA) is empty where the engine
    steps fp32 masters (bf16): the factor still reaches the other groups, and training matches the same client
    AdamW unfused (gradients multiplied first), and in fp32 plain PyTorch."""
    batches = _batches(3)

    def optimizer(model, fused: bool):
        embedding = [model.wte.weight, model.wpe.weight]
        for p in embedding:
            p.requires_grad_(False)
        rest = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW([{"params": embedding}, {"params": rest}], **ADAMW,
                                 **({"fused": True} if fused else {"foreach": False}))

    cfg = {k: v for k, v in _config(2, precision, offload=False).items() if k != "optimizer"}
    runs = []
    for fused in (True, False):
        model = _gpt()
        engine = initialize(model, cfg, optimizer=optimizer(model, fused))
        watch = ScalingPasses()
        runs.append((_train(engine, batches, watch), trained_params(engine), watch.seen))
        engine.close()
    (losses, params, seen), (unfused_losses, unfused_params, unfused_seen) = runs
    assert seen == [] and unfused_seen
    rtol = 1e-5 if precision == "fp32" else LOSS_RTOL[torch.bfloat16]
    assert_close_relative(losses, unfused_losses, rtol=rtol)
    if precision == "bf16":
        return
    assert_params_close(params, unfused_params)
    reference = _gpt()
    expected, _ = train_reference(reference, batches, lambda _: optimizer(reference, fused=True), clip=0.05)
    assert_close_relative(losses, expected)
    assert_params_close(params, param_snapshot(reference))


def test_groups_that_are_not_all_fused_are_multiplied_first():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    mixed = torch.optim.AdamW([{"params": [a]}, {"params": [b], "fused": False}], fused=True)
    assert not folds_factors(mixed)
    assert folds_factors(torch.optim.AdamW([a, b], fused=True))
    assert not folds_factors(torch.optim.AdamW([a.detach().bfloat16().requires_grad_()], fused=True))
