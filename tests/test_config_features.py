"""Config checks of features: tensor-parallel sizes, activation checkpointing options, options of features
not built yet ("not supported yet") and DeepSpeed-only keys (the loader itself: test_config.py).

Every error test asserts on the message: the key path, the offending value and the fix.
"""

from __future__ import annotations

import pytest

from engine.config import load_config
from tests.test_config import raises

# --- tensor parallelism and activation checkpointing -------------------------------------------


@pytest.mark.parametrize("size", [2, 8])
def test_2d_tensor_parallelism_needs_a_square_size(size):
    raw = {"tensor_parallel": {"size": size, "mode": "2d"}}
    raises(raw, f"tensor_parallel.size: {size}", "must be a square q² with q ≥ 2", "mode \"1d\"")


@pytest.mark.parametrize(
    "checkpointing, tp, fragments",
    [
        ({"modules": ["Block"]}, {}, ["activation_checkpointing.modules", "enabled is false", '"enabled": true']),
        ({"every_n": 2}, {}, ["activation_checkpointing.every_n: 2", "enabled is false"]),
        ({"enabled": True, "modules": []}, {}, ["activation_checkpointing.modules: []", "selects no module"]),
        ({"partition_activations": True}, {}, ["activation_checkpointing.partition_activations: true",
                                               "tensor_parallel.size is 1"]),
        ({"partition_activations": True}, {"size": 4, "mode": "2d"},
         ["activation_checkpointing.partition_activations: true", 'mode "2d"']),
    ],
)
def test_activation_checkpointing_options_that_cannot_apply(checkpointing, tp, fragments):
    raises({"activation_checkpointing": checkpointing, "tensor_parallel": tp}, *fragments)


def test_activation_checkpointing_options_load():
    ac = load_config({"activation_checkpointing": {
        "enabled": True, "modules": ["GPT2Block", "transformer.h.*"], "every_n": 2, "cpu_checkpointing": True,
        "synchronize_checkpoint_boundary": True, "profile": True, "number_checkpoints": 12},
        "tensor_parallel": {"size": 2}}).activation_checkpointing
    assert (ac.enabled, ac.modules, ac.every_n, ac.cpu_checkpointing, ac.profile) == (
        True, ["GPT2Block", "transformer.h.*"], 2, True, True)
    partitioned = load_config({"activation_checkpointing": {"partition_activations": True},
                               "tensor_parallel": {"size": 2}}).activation_checkpointing
    assert partitioned.partition_activations


# --- features not supported yet ---------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, key, value",
    [
        ({"memory": {"cpu_budget": "64GB"}}, "memory.cpu_budget", '"64GB"'),  # without optimizer offload
        ({"activation_checkpointing": {"contiguous_memory_optimization": True}},
         "activation_checkpointing.contiguous_memory_optimization", "true"),
    ],
)
def test_not_yet_supported_features_say_so(raw, key, value):
    msg = raises(raw, "not supported yet", f"{key}: {value}")
    assert msg.startswith(key)


def test_parameter_offload_needs_stage_3_and_an_nvme_path(caplog):
    for device in ("cpu", "nvme"):  # below stage 3 DeepSpeed ignores offload_param: a warning, parameters stay put
        with caplog.at_level("WARNING"):
            zero = load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": device,
                                                                                     "nvme_path": "/tmp"}}})
        assert zero.zero_optimization.offload_param.device == "none"
        assert "offload_param is read at stage 3 only" in caplog.text
    raises({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "set nvme_path",
           "zero_optimization.offload_param.nvme_path")
    zero = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).zero_optimization
    assert zero.offload_param.device == "cpu"


def test_stages_1_and_2_load_and_refuse_what_they_do_not_do():
    assert load_config({"zero_optimization": {"stage": 1}}).zero_optimization.stage == 1
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.stage == 2
    raises({"zero_optimization": {"stage": 1, "allgather_partitions": False}}, "always all-gathers",
           "zero_optimization.allgather_partitions: false")


def test_optimizer_offload_loads_and_nvme_needs_a_path():
    cfg = load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
    assert cfg.zero_optimization.offload_optimizer.device == "nvme"
    raises({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
           "zero_optimization.offload_optimizer.nvme_path", "set nvme_path")


def test_cpu_budget_sizes_parse_and_bad_ones_say_how():
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    for text, expected in [("8GB", 8 * 10**9), ("8GiB", 8 << 30), ("1.5 MiB", 3 << 19), (12345, 12345)]:
        assert load_config({**offload, "memory": {"cpu_budget": text}}).memory.budget_bytes("cpu_budget") == expected
    raises({**offload, "memory": {"cpu_budget": "8 parsecs"}}, 'memory.cpu_budget: "8 parsecs" is not a size', "8GiB")


def test_not_yet_supported_features_load_at_their_off_values():
    cfg = load_config({
        "zero_optimization": {"stage": 0, "placement": "static",
                              "offload_optimizer": {"device": "none"}, "offload_param": {"device": None}},
        "tensor_parallel": {"size": 1, "mode": "1d"},
        "memory": {"device_budget": None},
        "activation_checkpointing": {"enabled": False, "partition_activations": False, "number_checkpoints": 4},
    })
    assert cfg.zero_optimization.offload_param.device is None
    assert cfg.activation_checkpointing.number_checkpoints == 4


@pytest.mark.parametrize("section", ["flops_profiler", "amp", "comms_logger", "wandb", "csv_monitor", "elasticity",
                                     "progressive_layer_drop", "quantize_training"])
def test_deepspeed_only_sections(section):
    raises({section: {"enabled": True}}, section, "not supported yet")
    cfg = load_config({section: {"enabled": False}, "train_micro_batch_size_per_gpu": 1})
    assert not hasattr(cfg, section)


@pytest.mark.parametrize("section, value", [("sparse_attention", {"mode": "fixed"}),
                                            ("data_types", {"grad_accum_dtype": "fp32"}),
                                            ("weight_quantization", {"x": 1})])
def test_deepspeed_sections_on_by_presence_are_refused(section, value):
    """DeepSpeed turns these on by the section's presence (they have no "enabled"): accepted only at DeepSpeed's
    defaults, refused by name otherwise (training without them is not what the config asks for)."""
    raises({section: value}, section, "presence", "remove")
    load_config({section: {}, "train_micro_batch_size_per_gpu": 1})


def test_deepspeed_only_section_with_settings_but_disabled_loads():
    load_config({"flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1}})


@pytest.mark.parametrize("key, off, on", [("sparse_gradients", False, True),
                                          ("communication_data_type", None, "fp32")])
def test_deepspeed_only_top_level_keys(key, off, on):
    load_config({key: off})
    raises({key: on}, key, "not supported yet")
