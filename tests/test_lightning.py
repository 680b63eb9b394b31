"""Lightning over a Tiers engine (Note [Lightning's Trainer over an engine], Note [Fabric's loop over an engine]).

One user script (tests/lightning_scripts/train_gpt.py), started as a user starts it: Lightning's launcher starts the
second process. In it a small GPT-2 from transformers trains two epochs (AdamW, a warmup schedule Lightning steps,
accumulation 2, clipping 1.0) under strategy="ddp", the reference, and under TiersStrategy at ZeRO-2 and at ZeRO-3
(a config of "auto" values); a run resumed from the ZeRO-2 run's checkpoint after the first epoch; the same loop in
Fabric under DDP and under TiersFabricStrategy; then the misuses each strategy must refuse. Every process saves what
it saw, and each strategy must equal its DDP reference: every process's losses and the final weights at fp32 1e-5.
"""

from pathlib import Path

import pytest
import torch

from engine.integrations.lightning import lightning_config
from tests.distributed import run_user_script
from tests.reference import assert_close_relative, assert_params_close

SCRIPT = Path(__file__).resolve().parent / "lightning_scripts" / "train_gpt.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lightning")
    run_user_script(SCRIPT, ["--out", str(out)], cwd=out, timeout_s=300)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def assert_same_training(runs: list[dict], name: str, reference: str, rtol: float = 1e-5) -> None:
    for per_process in runs:
        expected = per_process[reference]["losses"]
        losses = per_process[name]["losses"]
        assert len(losses) in (len(expected), len(expected) // 2), (len(losses), len(expected))
        assert_close_relative(losses, expected[len(expected) - len(losses):], rtol)
    assert_params_close(runs[0][name]["state"], runs[0][reference]["state"], rtol)
    assert runs[1][name]["state"] is None or name.startswith("fabric")  # the Trainer's full weights: rank 0 only


@pytest.mark.parametrize("name", ["tiers_zero2", "tiers_zero3"])
def test_the_trainer_under_tiers_strategy_equals_ddp(runs, name):
    assert_same_training(runs, name, "ddp")


def test_bf16_mixed_under_tiers_strategy_equals_ddp_bf16_mixed(runs):
    """fp32 weights and a bf16-autocast forward (the config's torch_autocast), as DDP's bf16-mixed runs; the
    reduction order's rounding is amplified by bf16 activations, hence 1e-3."""
    assert_same_training(runs, "tiers_bf16", "ddp_bf16", rtol=1e-3)
    with pytest.raises(AssertionError):  # the tolerance still tells bf16-mixed from fp32 training
        assert_params_close(runs[0]["tiers_bf16"]["state"], runs[0]["ddp"]["state"], 1e-3)


def test_a_run_resumed_from_a_tiers_checkpoint_equals_the_uninterrupted_ddp_run(runs):
    assert len(runs[0]["tiers_resumed"]["losses"]) == len(runs[0]["ddp"]["losses"]) // 2  # the second epoch only
    assert_same_training(runs, "tiers_resumed", "ddp")


def test_fabric_under_tiers_equals_fabric_under_ddp(runs):
    assert_same_training(runs, "fabric_tiers_zero2", "fabric_ddp")


def test_a_fabric_run_resumed_with_fabric_load_equals_the_uninterrupted_ddp_run(runs):
    """fabric.save after the first epoch (the model, the optimizer, a scheduler, a counter), fabric.load into a fresh
    setup: the second epoch goes on as DDP's."""
    assert len(runs[0]["fabric_tiers_resumed"]["losses"]) == len(runs[0]["fabric_ddp"]["losses"]) // 2
    assert_same_training(runs, "fabric_tiers_resumed", "fabric_ddp")


REFUSALS = {
    "partial_accumulation": "ends with a partial accumulation of 2",
    "accumulation_contradiction": "gradient_accumulation_steps is 4 in the config but accumulate_grad_batches gives 2",
    "clip_by_value": "clips by the global norm only",
    "half_true": "HalfPrecision is not built",
    "config_and_module_optimizers": "an optimizer both in the config and in GPTModule.configure_optimizers",
    "fabric_docs_accumulation": "no_backward_sync(enabled=False) at micro-batch 1 of the engine's 2",
    "fabric_clip": "remove fabric.clip_gradients",
    "fabric_early_step": "optimizer.step() before the accumulation's last micro-batch",
    "accumulation_schedule": "GradientAccumulationScheduler under TiersStrategy is not built",
    "sync_batchnorm": "sync_batchnorm=True under TiersStrategy is not built",
    "gradient_hook": "GradNormLogger overrides on_before_optimizer_step, where under ZeRO stage 2",
    "ddp_arguments": "find_unused_parameters configure DDP's wrapper",
    "fabric_zero_grad_inside": "optimizer.zero_grad() inside an accumulation",
    "fabric_no_zero_grad": "fabric.backward after an update without optimizer.zero_grad()",
    "fabric_load_without_model": "pass the model",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_misuse_is_refused_on_every_process(runs, case):
    for per_process in runs:
        message = per_process["refusals"][case]
        assert message is not None and REFUSALS[case] in message, message


def test_the_arguments_fill_auto_values_and_contradictions_are_refused():
    auto = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    filled = lightning_config(auto, precision="bf16-mixed", accumulation=4, clipping=0.5, micro_batch=8)
    assert filled == {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
                      "bf16": {"enabled": True}, "fp16": {"enabled": False}}  # "auto": DeepSpeed's bf16 section
    assert lightning_config({}, precision="32-true", accumulation=1)["gradient_clipping"] == 0.0
    assert lightning_config({"gradient_clipping": 2.0}, precision="32-true")["gradient_clipping"] == 2.0
    mixed = lightning_config({}, precision="bf16-mixed")  # DDP's bf16-mixed: fp32 weights, bf16 autocast
    assert mixed["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and "bf16" not in mixed
    assert lightning_config({"fp16": {"enabled": True}}, precision="16-mixed")["fp16"] == {"enabled": True}
    with pytest.raises(ValueError, match="has no engine equivalent; enable the config's fp16 section"):
        lightning_config({}, precision="16-mixed")
    with pytest.raises(ValueError) as refused:
        lightning_config({"gradient_clipping": 2.0, "fp16": {"enabled": True}}, precision="bf16-mixed", clipping=1.0)
    assert "gradient_clipping is 2.0 in the config but gradient_clip_val gives 1.0" in str(refused.value)
    assert "precision='bf16-mixed' but the config enables fp16" in str(refused.value)
    for config, words in [({"tensor_parallel": {"size": 2}}, "tensor, pipeline or sequence parallelism"),
                          ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "layer_major": True}}},
                           "layer_major"),
                          ({}, "precision='64-true' is not built")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            lightning_config(config, precision="64-true" if not config else "32-true")
