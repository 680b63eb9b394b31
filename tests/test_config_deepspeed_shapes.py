"""DeepSpeed configs in the shapes real scripts and frameworks write them (tests/fixtures/deepspeed_configs: the
CIFAR and BERT tutorials, DeepSpeedExamples (its bf16 master-weight example's bf16_full.json too), DeepSpeed-Chat's
and OpenRLHF's get_train_ds_config, Hugging Face's documented zero2/zero3 configs before and after the Trainer fills
"auto", accelerate's plugin config), each with the outcome it must have: it loads, is refused naming the feature, or
needs an integration for its "auto" values. None may fail as an unknown key (Note [reading a DeepSpeed config])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import load_config
from engine.config_deepspeed import NEVER_PRINT
from scripts.check_deepspeed_configs import Outcome, classify, filled_like_hf_trainer, main

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_configs"
HF_AUTO = ("train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, fp16.enabled")
EXPECTED = {
    "accelerate_zero2.json": (Outcome.LOADS, ""),
    "bert_pretraining_tutorial.json": (Outcome.LOADS, ""),
    "cifar_tutorial.json": (Outcome.LOADS, ""),
    "deepspeed_019_defaults.json": (Outcome.LOADS, ""),
    "dschat_actor_zero3_offload.json": (Outcome.LOADS, ""),
    "dschat_reward_zero2_offload.json": (Outcome.LOADS, ""),
    "dschat_hybrid_engine.json": (Outcome.REFUSED, "hybrid_engine"),
    "examples_autotuning.json": (Outcome.LOADS, ""),
    "examples_bf16_master_weight_full.json": (Outcome.LOADS, ""),
    "examples_compression_off.json": (Outcome.LOADS, ""),
    "examples_imagenet_fp16.json": (Outcome.LOADS, ""),
    "examples_random_ltd.json": (Outcome.REFUSED, "data_efficiency.data_routing.random_ltd"),
    "examples_weight_quantization.json": (Outcome.REFUSED, "compression_training.weight_quantization"),
    "hf_docs_zero2_auto.json": (Outcome.NEEDS_INTEGRATION, HF_AUTO),
    "hf_docs_zero3_auto.json": (Outcome.NEEDS_INTEGRATION, HF_AUTO + ", bf16.enabled"),
    "hf_trainer_zero3_filled.json": (Outcome.LOADS, ""),
    "openrlhf_zero3.json": (Outcome.LOADS, ""),
    "openrlhf_zero2_hpz.json": (Outcome.REFUSED, "zero_optimization.zero_hpz_partition_size"),
}


def _load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_every_fixture_has_an_expected_outcome():
    assert sorted(p.name for p in FIXTURES.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_outcome(name):
    outcome, reason = EXPECTED[name]
    verdict = classify(_load(name))
    assert verdict.outcome is outcome, verdict
    assert verdict.reason.startswith(reason), verdict


def test_loaded_shapes_mean_what_deepspeed_reads():
    chat = load_config(_load("dschat_actor_zero3_offload.json"))  # "bfloat16", offload at stage 3
    assert chat.bf16.enabled and chat.zero_optimization.offload_param.device == "cpu"
    assert chat.zero_optimization.stage3_max_live_parameters == 30_000_000
    assert load_config(_load("dschat_reward_zero2_offload.json")).zero_optimization.offload_param.device == "none"
    rlhf = load_config(_load("openrlhf_zero3.json")).zero_optimization  # "auto" inside zero: the defaults
    assert (rlhf.sub_group_size, rlhf.stage3_max_live_parameters) == (1_000_000_000, 1_000_000_000)
    assert load_config(_load("openrlhf_zero3.json")).tensor_parallel.size == 1
    bert = load_config(_load("bert_pretraining_tutorial.json"))
    assert (bert.prescale_gradients, bert.gradient_predivide_factor) == (True, 8.0)
    assert bert.optimizer.params["bias_correction"] is False
    filled = load_config(_load("hf_trainer_zero3_filled.json"))
    assert filled.steps_per_print == NEVER_PRINT and filled.zero_optimization.stage3_gather_16bit_weights_on_model_save
    accelerate = load_config(_load("accelerate_zero2.json"))
    assert accelerate.batch_sizes(2).train_batch_size == 16  # "auto" derived: 4 × 2 × dp
    assert load_config(_load("examples_imagenet_fp16.json")).fp16.auto_cast
    assert load_config(_load("examples_autotuning.json")).autotuning.enabled


@pytest.mark.parametrize("name", ["hf_docs_zero2_auto.json", "hf_docs_zero3_auto.json"])
def test_hf_docs_configs_load_once_their_auto_values_are_filled(name):
    """What the Trainer hands to initialize: the "auto" batch, precision, optimizer and schedule values filled."""
    cfg = load_config(filled_like_hf_trainer(_load(name)))
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.optimizer.params["lr"] == 5e-5
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_check_script_totals(capsys):
    assert main([str(FIXTURES), "--quiet"]) == 0  # 0: no config fails as an unknown key
    out = capsys.readouterr().out
    assert "18 DeepSpeed configs" in out and "loads: 12" in out and "unknown key: 0" in out
