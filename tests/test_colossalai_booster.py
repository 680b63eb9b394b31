"""engine.compat.colossalai's Booster and plugins, driven as ColossalAI's examples drive them (launch_from_torch,
DistCoordinator, HybridAdam, a scheduler the script steps, booster.backward, optimizer.step/zero_grad), equal plain
single-process PyTorch on the whole batches: fp32 to 1e-5 (tensor parallel 1e-4), bf16 at the mixed-precision
tolerances; a model saved sharded loads into a freshly boosted one; what has no counterpart is refused by name."""

from __future__ import annotations

import pytest
import torch

from engine.compat import colossalai
from engine.compat.colossalai.booster import Booster
from engine.compat.colossalai.booster.optimizer_io import load_optimizer_file
from engine.compat.colossalai.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from engine.compat.colossalai.cluster import DistCoordinator
from engine.compat.colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR
from engine.compat.colossalai.nn.optimizer import HybridAdam
from engine.compat.colossalai.unsupported import NotInTiers
from tests.distributed import run_distributed
from tests.reference import (
    FP32_RTOL,
    assert_close_relative,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
    train_reference_mixed,
)
from tests.test_mixed_precision import LOSS_RTOL, WEIGHT_RTOL

STEPS, GLOBAL_BATCH, WORLD = 3, 8, 2
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
SCHEDULE = {"total_steps": 10, "warmup_steps": 2}
# 16-bit gradients summed over two ranks round apart from one process's: where a gradient is near zero, Adam's
# normalized update can turn by up to 2·lr in one step
SIXTEEN_BIT_ATOL = 2 * OPTIMIZER["lr"]

# case -> (the plugin's arguments, its precision, the clipping norm, a scheduler stepped by the script)
CASES = {
    "torch_ddp": (TorchDDPPlugin, {}, torch.float32, 0.0, True),
    "low_level_zero_1_cpu_offload": (LowLevelZeroPlugin, {"stage": 1, "precision": "fp32", "cpu_offload": True},
                                     torch.float32, 0.0, True),
    "low_level_zero_2": (LowLevelZeroPlugin, {"stage": 2, "precision": "fp32", "max_norm": 1.0}, torch.float32, 1.0,
                         True),
    "low_level_zero_2_fp16": (LowLevelZeroPlugin, {"stage": 2, "initial_scale": 2 ** 5}, torch.float16, 0.0, False),
    "gemini_static_all_offloaded": (GeminiPlugin, {"precision": "bf16", "shard_param_frac": 1.0,
                                                   "offload_optim_frac": 1.0, "offload_param_frac": 1.0},
                                    torch.bfloat16, 0.0, False),
    "gemini_auto": (GeminiPlugin, {"placement_policy": "auto", "precision": "bf16"}, torch.bfloat16, 0.0, False),
    "hybrid_tp2": (HybridParallelPlugin, {"tp_size": 2, "pp_size": 1, "precision": "fp32"}, torch.float32, 0.0,
                   True),
}


def _train(case: str):
    plugin_cls, kwargs, _, _, scheduled = CASES[case]
    coordinator = DistCoordinator()
    booster = Booster(plugin=plugin_cls(**kwargs))
    model = tiny_gpt()
    optimizer = HybridAdam(model.parameters(), **OPTIMIZER)
    scheduler = CosineAnnealingWarmupLR(optimizer, **SCHEDULE) if scheduled else None
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    dp_size, dp_rank = booster.plugin.data_parallel()
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        rows = batch.shape[0] // dp_size
        mine = batch[dp_rank * rows:(dp_rank + 1) * rows]
        loss = model(mine, mine)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / coordinator.world_size)
    whole = model.engine.full_state_dict()
    params = {n: whole[n] for n, _ in model.unwrap().named_parameters()}
    model.engine.close()
    return losses, params


def _cases_worker(rank, world, cases):
    colossalai.launch_from_torch(seed=1024)  # the group is up: only the seed and the device are set
    return {case: _train(case) for case in cases}


def _boosted(plugin, seed: int = 0):
    booster = Booster(plugin=plugin)
    model = tiny_gpt(seed=seed)
    model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), **OPTIMIZER))
    return booster, model, optimizer


def _step(booster, model, optimizer, batch) -> None:
    booster.backward(model(batch, batch), optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _save_worker(rank, world, save_dir):
    colossalai.launch_from_torch()
    booster, model, optimizer = _boosted(LowLevelZeroPlugin(stage=2, precision="fp32"))
    batches = token_batches(3, GLOBAL_BATCH)
    for batch in batches[:2]:
        _step(booster, model, optimizer, batch)
    saved = {n: t.clone() for n, t in model.engine.full_state_dict().items()}
    # a quarter MiB per shard: the 0.9 MB model spans several files, and its optimizer states more
    booster.save_model(model, f"{save_dir}/model", shard=True, size_per_shard=0.25, use_safetensors=True)
    booster.save_optimizer(optimizer, f"{save_dir}/optim", shard=True, size_per_shard=0.25)
    fresh, other, other_optimizer = _boosted(LowLevelZeroPlugin(stage=2, precision="fp32"), seed=5)
    fresh.load_model(other, f"{save_dir}/model")
    loaded = other.engine.full_state_dict()
    # the same step from the loaded weights and optimizer states, and under tensor parallelism (resharded)
    fresh.load_optimizer(other_optimizer, f"{save_dir}/optim")
    tp, tp_model, tp_optimizer = _boosted(HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"), seed=7)
    tp.load_model(tp_model, f"{save_dir}/model")
    tp.load_optimizer(tp_optimizer, f"{save_dir}/optim")
    for engine in (booster, model, optimizer), (fresh, other, other_optimizer), (tp, tp_model, tp_optimizer):
        _step(*engine, batches[2])
    return saved, loaded, {name: m.engine.full_state_dict() for name, m in
                           (("original", model), ("loaded", other), ("tensor_parallel", tp_model))}


def _reference(case: str):
    _, kwargs, dtype, clip, scheduled = CASES[case]
    batches = token_batches(STEPS, GLOBAL_BATCH)
    model = tiny_gpt()
    if dtype != torch.float32:  # fp16: the plugin's initial scale, which 3 clean steps do not move
        losses, _, masters = train_reference_mixed(model, batches, dtype, lambda ps: torch.optim.AdamW(ps, **OPTIMIZER),
                                                   clip=clip, loss_scale=kwargs.get("initial_scale", 1.0))
        return losses, masters
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    scheduler = CosineAnnealingWarmupLR(optimizer, **SCHEDULE) if scheduled else None
    losses = []
    for x in batches:
        loss = model(x, x)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, param_snapshot(model)


def test_each_plugin_trains_like_plain_pytorch_on_the_whole_batches():
    results = run_distributed(_cases_worker, WORLD, args=(tuple(CASES),), timeout_s=420)
    for case, (_, _, dtype, _, _) in CASES.items():
        ref_losses, ref_params = _reference(case)
        for losses, params in (r[case] for r in results):
            tensor_parallel = case.startswith("hybrid_tp")
            rtol = LOSS_RTOL[dtype] if dtype != torch.float32 else (1e-4 if tensor_parallel else FP32_RTOL)
            assert_close_relative(losses, ref_losses, rtol=rtol)
            for name, ref in ref_params.items():
                torch.testing.assert_close(
                    params[name].float(), ref.float(),
                    rtol=WEIGHT_RTOL[dtype] if dtype != torch.float32 else rtol * 10,
                    atol=SIXTEEN_BIT_ATOL if dtype != torch.float32 else 1e-6,
                    msg=lambda m, n=name, c=case: f"{c} {n}: {m}")


def test_a_model_and_its_optimizer_saved_sharded_load_into_freshly_boosted_ones(tmp_path):
    """The weights load exactly; the optimizer file holds plain PyTorch's AdamW states in its numbering; a step after
    loading both equals the step the saving run takes (exactly in the same layout, 1e-4 under tensor parallelism)."""
    saved, loaded, stepped = run_distributed(_save_worker, WORLD, args=(str(tmp_path),), timeout_s=240)[0]
    assert (tmp_path / "model" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "model").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "optim" / "pytorch_optim.bin.index.json").exists()
    assert (tmp_path / "optim" / "pytorch_optim_group.bin").exists()
    assert len(list((tmp_path / "optim").glob("pytorch_optim-*.bin"))) > 1
    assert not list(tmp_path.glob("*.tiers-staging"))
    assert saved.keys() == loaded.keys()
    for name in saved:
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0)
    reference = tiny_gpt()  # plain PyTorch's two steps: the states the file must hold, by torch's numbering
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **OPTIMIZER)
    train_reference(reference, token_batches(3, GLOBAL_BATCH)[:2], lambda ps: reference_optimizer)
    expected = reference_optimizer.state_dict()
    state, groups = load_optimizer_file(str(tmp_path / "optim"))
    assert [g["params"] for g in groups] == [g["params"] for g in expected["param_groups"]]
    assert groups[0]["lr"] == OPTIMIZER["lr"] and tuple(groups[0]["betas"]) == OPTIMIZER["betas"]
    assert state.keys() == expected["state"].keys()
    for pid, states in expected["state"].items():
        assert float(state[pid]["step"]) == float(states["step"]) == 2.0
        for kind in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[pid][kind], states[kind], rtol=FP32_RTOL * 10, atol=1e-9,
                                       msg=f"{pid} {kind}")
    for name, value in stepped["original"].items():
        torch.testing.assert_close(stepped["loaded"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(stepped["tensor_parallel"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def _refusal_worker(rank, world):
    colossalai.launch_from_torch(config={})  # ColossalAI before 0.3.8
    errors = []
    for make in (lambda: LowLevelZeroPlugin(stage=2, initial_scale=3.0),
                 lambda: GeminiPlugin(precision="bf16", shard_param_frac=0.5),
                 lambda: GeminiPlugin(precision="bf16", offload_param_frac=1.0),
                 lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision="bf16"),
                 lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16",
                                              enable_sequence_parallelism=True, sequence_parallelism_mode="ring"),
                 lambda: TorchDDPPlugin(fp8_communication=True),
                 lambda: Booster(plugin=LowLevelZeroPlugin(precision="bf16"), mixed_precision="bf16"),
                 lambda: Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16"),
                 lambda: Booster(plugin=TorchDDPPlugin()).boost(
                     torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
                     torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)),
                 lambda: GeminiPlugin(precision="fp32"),
                 lambda: Booster()):
        try:
            make()
            errors.append(None)
        except (NotInTiers, ValueError) as e:
            errors.append(str(e))
    return errors


def test_what_has_no_counterpart_is_refused_by_name():
    errors = run_distributed(_refusal_worker, WORLD, timeout_s=120)[0]
    expected = ["initial_scale=3.0", "shard_param_frac=0.5", "offload_param_frac=1.0", "pp_size=2",
                "sequence_parallelism_mode=\"ring\"", "fp8_communication=True", "pass precision= to the plugin",
                "mixed_precision='fp16'", "BatchNorm (1)", "precision 'fp32' is fp16 or bf16",
                "Booster() without a plugin over several processes"]
    assert len(errors) == len(expected)
    for error, text in zip(errors, expected):
        assert error is not None and text in error, (text, error)


def test_the_warmup_cosine_schedule_is_colossalais():
    """(k + 1) / W · η while k < W, then the cosine from η at k = W down to eta_min at total_steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=6, warmup_steps=2, eta_min=0.01)
    rates = []
    for _ in range(7):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:3] == pytest.approx([0.05, 0.1, 0.1])
    assert rates[4] == pytest.approx(0.01 + 0.09 * 0.5) and rates[6] == pytest.approx(0.01)


def _lora_model(seed: int = 0):
    """Hugging Face GPT-2 with PEFT's LoRA on its attention projections (A drawn after the seed, B zero)."""
    import peft

    from tests.test_tensor_parallel import build
    model = build("gpt2", seed=seed)
    torch.manual_seed(seed + 1)
    return model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)


def _lora_worker(rank, world):
    colossalai.launch_from_torch()
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    model, config = _lora_model()
    model = booster.enable_lora(model, lora_config=config)
    optimizer = HybridAdam(model.parameters(), **OPTIMIZER)  # as ColossalAI's LoRA examples: every parameter
    model, optimizer, *_ = booster.boost(model, optimizer)
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        loss = model(input_ids=batch, labels=batch).loss  # every rank the whole batch
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained = {n for n, p in model.unwrap().named_parameters() if p.requires_grad}
    return losses, model.engine.full_state_dict(), trained


def test_enable_lora_trains_the_adapter_like_plain_peft():
    pytest.importorskip("peft")
    import peft

    losses, full, trained = run_distributed(_lora_worker, WORLD, timeout_s=180)[0]
    base, config = _lora_model()
    reference = peft.get_peft_model(base, config)
    expected = {n for n, p in reference.named_parameters() if p.requires_grad}
    assert trained == expected and all("lora_" in n for n in trained)
    ref_losses, _ = train_reference(reference, token_batches(STEPS, GLOBAL_BATCH),
                                    lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], **OPTIMIZER),
                                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    assert_close_relative(losses, ref_losses)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=FP32_RTOL * 10, atol=1e-6, msg=name)


def _pipelined(style: str, seed: int = 0):
    from tests.test_tensor_parallel import build
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32", max_norm=1.0,
                                  pp_style=style)
    booster = Booster(plugin=plugin)
    model = build("gpt2", seed=seed)
    model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), **OPTIMIZER))
    return booster, model, optimizer


def _pipeline_step(booster, model, optimizer, batch) -> float:
    data_iter = iter([{"input_ids": batch, "labels": batch}])  # the step's whole batch, as a loader gives it
    out = booster.execute_pipeline(data_iter, model, lambda outputs, inputs: outputs.loss, optimizer,
                                   return_loss=True)
    optimizer.step()  # as ColossalAI's scripts do after execute_pipeline
    optimizer.zero_grad()
    return out["loss"].item()


def _pipeline_worker(rank, world, style, save_dir):
    colossalai.launch_from_torch()
    booster, model, optimizer = _pipelined(style)
    batches = token_batches(STEPS, GLOBAL_BATCH)
    losses = [_pipeline_step(booster, model, optimizer, batch) for batch in batches[:-1]]
    # saved and loaded into a fresh boost of the same stages (each stage its own tensors), then both step on
    booster.save_model(model, f"{save_dir}/model", shard=True, size_per_shard=0.25)
    booster.save_optimizer(optimizer, f"{save_dir}/optimizer", shard=True, size_per_shard=0.25)
    fresh, other, other_optimizer = _pipelined(style, seed=5)
    fresh.load_model(other, f"{save_dir}/model")
    fresh.load_optimizer(other_optimizer, f"{save_dir}/optimizer")
    losses.append(_pipeline_step(booster, model, optimizer, batches[-1]))
    loaded_loss = _pipeline_step(fresh, other, other_optimizer, batches[-1])
    with torch.no_grad():
        evaluated = booster.execute_pipeline(iter([{"input_ids": batches[-1], "labels": batches[-1]}]), model,
                                             lambda outputs, inputs: outputs.loss)["loss"].item()
    return losses, model.engine.full_state_dict(), evaluated, loaded_loss, other.engine.full_state_dict()


@pytest.mark.parametrize("style", ["1f1b", "zbv"])
def test_execute_pipeline_trains_pipeline_stages_like_plain_pytorch(style, tmp_path):
    """HybridParallelPlugin(pp_size=2, num_microbatches=2) on an unmodified Hugging Face GPT-2: execute_pipeline then
    optimizer.step() / zero_grad() each step equal one process on the whole batch (clipped at 1.0); a forward-only
    call under torch.no_grad() gives the next loss; the model and optimizer saved before the last step and loaded
    into a fresh boost (each stage its own tensors) take that step exactly as the saving run."""
    pytest.importorskip("transformers")
    from tests.test_tensor_parallel import build
    results = run_distributed(_pipeline_worker, WORLD, args=(style, str(tmp_path)), timeout_s=240)
    reference = build("gpt2")
    batches = token_batches(STEPS, GLOBAL_BATCH)
    loss_fn = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    ref_losses, _ = train_reference(reference, batches, lambda ps: torch.optim.AdamW(ps, **OPTIMIZER), clip=1.0,
                                    loss_fn=loss_fn)
    with torch.no_grad():
        ref_eval = loss_fn(reference, batches[-1]).item()
    for losses, full, evaluated, loaded_loss, loaded_full in results:
        assert_close_relative(losses, ref_losses)
        assert_close_relative([evaluated], [ref_eval])
        assert loaded_loss == losses[-1]
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=FP32_RTOL * 10, atol=1e-6, msg=name)
            torch.testing.assert_close(loaded_full[name], full[name], rtol=0, atol=0, msg=name)
