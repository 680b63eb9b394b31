"""DeepSpeed's keys and spellings (Note [reading a DeepSpeed config]): aliases load as the keys they name, "auto" inside
zero_optimization is the default, features Tiers lacks load at their off values and are refused naming the feature
otherwise, top-level keys DeepSpeed never reads are a warning, and a near miss of a known key stays an error.

Every error test asserts on the message: the key path, the value or the feature, and the fix.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import initialize
from engine.config import load_config
from engine.config_deepspeed import NEVER_PRINT
from engine.precision import PrecisionPolicy
from tests.reference import assert_params_close, param_snapshot, tiny_gpt, token_batches
from tests.test_config import raises

BATCH = {"train_micro_batch_size_per_gpu": 2}


def test_bfloat16_is_bf16():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled
    raises({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}}, "bfloat16 and bf16", "give bf16 only")


@pytest.mark.parametrize("old, new, value", [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 1234),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 77),
    ("max_live_parameters", "stage3_max_live_parameters", 999),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
    ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
])
def test_zero_names_without_stage3_prefix(old, new, value):
    zero = load_config({"zero_optimization": {"stage": 3, old: value}}).zero_optimization
    assert getattr(zero, new) == value
    raises({"zero_optimization": {old: value, new: 0 if value is True else value + 1}},
           f"zero_optimization.{old} and zero_optimization.{new} are the same setting")


def test_cpu_offload_old_spellings():
    zero = load_config({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                              "cpu_offload_use_pin_memory": True}}).zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_param.device) == ("cpu", "cpu")
    zero = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert zero.offload_optimizer.device == "none"
    raises({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
           "zero_optimization.cpu_offload", "offload_optimizer only")


def test_deepspeeds_pipeline_defaults_are_tiers_defaults():
    pipeline = load_config({**BATCH, "pipeline": {"stages": "auto", "partition": "best", "seed_layers": False,
                                                  "activation_checkpoint_interval": 0}}).pipeline
    assert (pipeline.stages, pipeline.partition) == (1, "parameters")


def test_steps_per_print_infinity_never_prints():
    assert load_config({"steps_per_print": math.inf}).steps_per_print == NEVER_PRINT
    assert load_config({"steps_per_print": None}).steps_per_print == NEVER_PRINT


def test_auto_inside_zero_is_the_default():
    zero = load_config({**BATCH, "zero_optimization": {
        "stage": 3, "stage3_max_live_parameters": "auto", "sub_group_size": "auto", "reduce_bucket_size": "auto",
        "offload_param": {"device": "cpu", "buffer_size": "auto", "pin_memory": "auto"}}}).zero_optimization
    assert zero.stage3_max_live_parameters == 1_000_000_000 and zero.sub_group_size == 1_000_000_000
    assert zero.offload_param.buffer_size == 100_000_000 and zero.offload_param.pin_memory is None
    assert zero.reduce_bucket_size == "auto"  # derived from the model (engine.initialization.chunk_layout)
    # Tiers' own "auto" (a mode, not a value to fill) stays
    offloaded = {"placement": "auto", "offload_optimizer": {"device": "cpu"}}
    assert load_config({**BATCH, "zero_optimization": offloaded}).zero_optimization.placement == "auto"


@pytest.mark.parametrize("raw, unfilled", [
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}},
     "optimizer.params.lr, optimizer.params.betas"),
    ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, "scheduler.params.warmup_max_lr"),
])
def test_auto_without_a_source_names_every_key_and_the_integrations(raw, unfilled):
    msg = raises({**BATCH, **raw}, f'{unfilled}: "auto" with nothing to derive it from', "Hugging Face Trainer",
                 "accelerate", "give numbers")
    assert msg.startswith(unfilled)


@pytest.mark.parametrize("path, off, on, feature", [
    ("aio.use_gds", False, True, "GPUDirect Storage"),
    ("zero_optimization.zero_hpz_partition_size", 1, 8, "hpZ"),
    ("zero_optimization.zero_quantized_weights", False, True, "qwZ"),
    ("zero_optimization.zero_quantized_gradients", False, True, "qgZ"),
    ("zero_optimization.zeropp_loco_param", None, {"err_beta": 0.8}, "LoCo"),
    ("zero_optimization.zenflow", None, {"topk_ratio": 0.1}, "ZenFlow"),
    ("zero_optimization.save_muon_momentum_buffer_in_memory", False, True, "Muon"),
    ("zero_optimization.leaf_module", {}, {"classes": ["Block"]}, "leaf modules"),
    ("zero_optimization.offload_optimizer.super_offload", False, True, "SuperOffload"),
    ("fp16.fp16_master_weights_and_grads", False, True, "fp16 master weights"),
    ("checkpoint.writer", None, {"type": "fast"}, "FastPersist"),
    ("tensor_parallel.preset_model", None, "llama", "preset"),
    ("gradient_allreduce_op", "mean", "sum", "summed"),
    ("managed_gradient_accumulation", True, False, "accumulation left to the user"),
    ("datastates_ckpt", False, {"host_cache_size": 16}, "DataStates"),
    ("expert_parallel", {"enabled": False}, {"enabled": True}, "expert_parallel"),
])
def test_features_tiers_lacks_load_off_and_are_refused_by_name_on(path, off, on, feature):
    load_config({**BATCH, **_nested(path, off)})
    msg = raises({**BATCH, **_nested(path, on)}, path, feature, "not supported yet")
    assert msg.startswith(path)


@pytest.mark.parametrize("path, value", [
    ("zero_optimization.memory_efficient_linear", False),
    ("zero_optimization.stage3_module_granularity_threshold", 4096),
    ("zero_optimization.stage3_allgather_sequential", True),
    ("zero_optimization.log_trace_cache_warnings", True),
    ("zero_optimization.enable_sanity_checks", True),
    ("zero_optimization.use_multi_rank_bucket_allreduce", False),
    ("zero_optimization.offload_optimizer.cpuadam_cores_perc", 0.5),
    ("checkpoint.checkpoint_serialization", False),
    ("log_level", "info"),
    ("seq_parallel_communication_data_type", "bf16"),
    ("optimizer.legacy_fusion", True),
    ("pipeline.activation_checkpoint_interval", 1),
    ("pipeline.pipe_partitioned", False),
])
def test_speed_and_logging_knobs_load_with_any_value(path, value):
    load_config({**BATCH, **_nested(path, value)})


@pytest.mark.parametrize("section, on, feature", [
    ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": True}}},
     "compression_training.weight_quantization"),
    ("compression_training", {"layer_reduction": {"enabled": True, "keep_number_layer": 6}},
     "compression_training.layer_reduction"),
    ("data_efficiency", {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {"enabled": True}}},
     "data_efficiency.data_routing.random_ltd"),
    ("compile", {"deepcompile": True, "passes": ["z3"]}, "compile.deepcompile"),
])
def test_sections_with_every_technique_off_load(section, on, feature):
    off = {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}},
                                    "layer_reduction": {"enabled": False}},
           "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {"enabled": False}},
                               "data_sampling": {"enabled": False}},
           "compile": {"deepcompile": False, "offload_parameters": True}}[section]
    load_config({**BATCH, section: off})
    msg = raises({**BATCH, section: on}, feature, "not supported yet")
    assert msg.startswith(feature)


def test_near_miss_of_a_known_key_stays_an_error():
    raises({"gradient_clippping": 1.0}, "gradient_clippping: unknown key", "Did you mean 'gradient_clipping'?")
    raises({"zero_optimization": {"zero_quantised_weights": False}}, "zero_optimization.zero_quantised_weights",
           "unknown key")


def test_new_typed_keys_parse():
    cfg = load_config({**BATCH, "prescale_gradients": True, "gradient_predivide_factor": 8,
                       "bf16": {"enabled": True, "check_grad_overflow": True},
                       "torch_autocast": {"enabled": False, "dtype": "bfloat16",
                                          "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert (cfg.prescale_gradients, cfg.gradient_predivide_factor, cfg.bf16.check_grad_overflow) == (True, 8.0, True)
    assert cfg.torch_autocast.lower_precision_safe_modules == ["torch.nn.Linear"]
    raises({"gradient_predivide_factor": 0}, "gradient_predivide_factor", "> 0")
    raises({**BATCH, "torch_autocast": {"enabled": True, "dtype": "float16"}}, "torch_autocast.dtype", "not built yet")
    raises({**BATCH, "torch_autocast": {"enabled": True}}, "torch_autocast.dtype: null", "bfloat16")
    raises({**BATCH, "torch_autocast": {"enabled": True, "dtype": "bf16"}, "fp16": {"enabled": True}},
           "torch_autocast.enabled", "enable one of them")
    # DeepSpeed's bf16 master weight example: bf16 weights under autocast to bf16, as bf16 alone runs
    both = load_config({**BATCH, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, "zero_optimization": {
        "stage": 3}})
    assert PrecisionPolicy.from_config(both) == PrecisionPolicy.from_config(load_config({**BATCH, "bf16": {
        "enabled": True}}))


def test_bf16_check_grad_overflow_skips_the_step():
    """DeepSpeed's bf16.check_grad_overflow: a step whose gradients hold inf/nan is skipped, as fp16 does; without
    it (Tiers' default) the step is taken."""
    x = token_batches(1, 2)[0]
    for check, skipped in ((True, 1), (False, 0)):
        engine = initialize(tiny_gpt(), {**BATCH, "steps_per_print": 10**6, "bf16": {
            "enabled": True, "check_grad_overflow": check}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        before = param_snapshot(engine.module)
        engine.backward(engine(x, x) * float("inf"))
        engine.step()
        after = param_snapshot(engine.module)
        assert engine.skipped_steps == skipped
        unchanged = all(torch.equal(after[n], v) for n, v in before.items())
        assert unchanged is check


def test_torch_autocast_trains_as_plain_pytorch_under_autocast():
    """torch_autocast bf16: fp32 weights, the forward under torch.autocast(bfloat16), fp32 gradients and SGD; the
    same as PyTorch's own loop doing that."""
    batches = token_batches(3, 2)
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    engine = initialize(tiny_gpt(), {**BATCH, "steps_per_print": 10**6, "optimizer": sgd,
                                     "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    model = tiny_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x, x)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.dtype == expected.dtype and abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    assert_params_close(param_snapshot(engine.module), param_snapshot(model))
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())


class _RecordsInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list = []

    def forward(self, x, extra, scale=None):
        self.seen = [x.dtype, extra["ids"].dtype, extra["w"].dtype, scale.dtype]
        return self.linear(x.float()).sum()


def test_fp16_auto_cast_casts_floating_positional_inputs():
    """DeepSpeed's fp16.auto_cast: floating tensors among the positional arguments (nested too) reach the module as
    fp16; integer tensors and keyword arguments are left as they are."""
    x, extra, scale = torch.randn(2, 4), {"ids": torch.arange(2), "w": torch.ones(2)}, torch.ones(1)
    for auto_cast, floating in ((True, torch.float16), (False, torch.float32)):
        model = _RecordsInputs()
        fp16 = {"enabled": True, "auto_cast": auto_cast}
        engine = initialize(model, {**BATCH, "steps_per_print": 10**6, "fp16": fp16,
                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        engine(x, extra, scale=scale)
        assert model.seen == [floating, torch.int64, floating, torch.float32]


def _nested(path: str, value) -> dict:
    *outer, last = path.split(".")
    out = {last: value}
    for key in reversed(outer):
        out = {key: out}
    return out


@pytest.mark.parametrize("name", ["Muon", "MuAdamW", "MuSGD", "RMSprop"])
def test_deepspeed_and_torch_optimizer_names_are_refused_by_name(name):
    """DeepSpeed's own optimizers, and any torch.optim class (DeepSpeed takes those by name), are known names:
    refused as not supported, never "unknown"."""
    msg = raises({**BATCH, "optimizer": {"type": name}}, f"optimizer.type: '{name}' is not supported yet")
    assert "unknown" not in msg
