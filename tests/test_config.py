"""Config loading against /work/shared/CONFIG.md: DeepSpeed key names and defaults, strict keys,
typed values with readable errors (batch sizes: test_config_batch.py; feature checks and "not supported
yet": test_config_features.py).

Every error test asserts on the message: the key path, the offending value, the suggestion or the
allowed values, so a regression to a vague message fails.
"""

from __future__ import annotations

import copy
import json

import pytest

from engine.config import BatchSizes, Config, ConfigError, load_config

# A realistic DeepSpeed ds_config.json for stage 0 (everything Tiers shares with DeepSpeed).
DS_CONFIG = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100},
    },
    "tensorboard": {"enabled": True, "output_path": "logs/tb", "job_name": "gpt2-small"},
    "zero_optimization": {
        "stage": 0,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
}


def raises(raw, *fragments: str) -> str:
    """Loading `raw` fails with a ConfigError whose message contains every fragment."""
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in error message: {msg}"
    return msg


# --- a DeepSpeed config loads unchanged -------------------------------------------------------


def check_ds_config(cfg: Config) -> None:
    assert cfg.train_batch_size == 32
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.gradient_accumulation_steps == 8
    assert cfg.steps_per_print == 100
    assert cfg.wall_clock_breakdown is False
    assert cfg.gradient_clipping == 1.0
    fp16 = cfg.fp16
    assert fp16.enabled is True
    assert (fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (0, 12, 500)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (3, False, 1)
    assert cfg.bf16.enabled is False
    assert cfg.optimizer.type == "Adam"
    params = cfg.optimizer.params
    assert params["lr"] == 3e-4
    assert list(params["betas"]) == [0.9, 0.95]
    assert params["eps"] == 1e-8
    assert params["weight_decay"] == 0.01
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}
    assert cfg.tensorboard.enabled is True
    assert cfg.tensorboard.log_dir.replace("\\", "/") == "logs/tb/gpt2-small"
    zero = cfg.zero_optimization
    assert zero.stage == 0
    assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)
    assert zero.allgather_bucket_size == 200_000_000 and isinstance(zero.allgather_bucket_size, int)
    assert zero.overlap_comm is True and zero.overlap is True
    assert zero.contiguous_gradients is True
    assert cfg.batch_sizes(1) == BatchSizes(32, 4, 8)


def test_deepspeed_config_loads_from_dict():
    raw = copy.deepcopy(DS_CONFIG)
    check_ds_config(load_config(raw))
    assert raw == DS_CONFIG  # the caller's dict is not modified


def test_deepspeed_config_loads_from_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    # Written as a user would: 5e8 stays a float literal in the file.
    text = json.dumps(DS_CONFIG, indent=2)
    assert "500000000.0" in text
    path.write_text(text)
    check_ds_config(load_config(path))
    check_ds_config(load_config(str(path)))


def test_load_config_passes_a_config_through():
    cfg = load_config(DS_CONFIG)
    assert load_config(cfg) is cfg


def test_defaults_match_config_md():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    fp16 = cfg.fp16
    assert fp16.enabled is False
    assert fp16.loss_scale == 0
    assert fp16.initial_scale_power == 16
    assert fp16.loss_scale_window == 1000
    assert fp16.hysteresis == 2
    assert fp16.min_loss_scale == 1
    assert cfg.bf16.enabled is False
    zero = cfg.zero_optimization
    assert zero.stage == 0
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.overlap is False  # overlap_comm defaults to true only for stage 3
    assert zero.contiguous_gradients is True
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.sub_group_size == 1_000_000_000
    assert zero.placement == "static"
    assert zero.chunk_size is None
    off = zero.offload_optimizer
    assert (off.device, off.pin_memory, off.ratio) == ("none", None, 1.0)  # None: pinned where CUDA is
    par = zero.offload_param
    assert (par.device, par.pin_memory, par.buffer_count, par.buffer_size, par.max_in_cpu) == (
        "none", None, 5, 100_000_000, 1_000_000_000)
    aio = cfg.aio
    assert (aio.block_size, aio.queue_depth, aio.single_submit, aio.overlap_events) == (1_048_576, 8, False, True)
    assert aio.threads == 1
    ac = cfg.activation_checkpointing
    assert ac.enabled is False and ac.partition_activations is False and ac.cpu_checkpointing is False
    assert ac.contiguous_memory_optimization is False and ac.number_checkpoints is None
    assert ac.synchronize_checkpoint_boundary is False and ac.profile is False
    tb = cfg.tensorboard
    assert (tb.enabled, tb.output_path, tb.job_name) == (False, "", "TiersJob")
    assert tb.log_dir.replace("\\", "/") == "runs/TiersJob"
    assert cfg.steps_per_print == 10
    assert cfg.wall_clock_breakdown is False
    assert cfg.gradient_clipping == 0
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.tensor_parallel.size == 1 and cfg.tensor_parallel.mode == "1d"
    assert cfg.memory.device_budget is None and cfg.memory.cpu_budget is None


def test_stage3_overlap_default_follows_deepspeed():
    # overlap_comm unset: true for stage 3 (the property, independent of the stage gate).
    from engine.config_sections import ZeroConfig

    assert ZeroConfig(stage=3).overlap is True
    assert ZeroConfig(stage=3, overlap_comm=False).overlap is False
    assert ZeroConfig(stage=0, overlap_comm=True).overlap is True


def test_optimizer_params_get_defaults():
    cfg = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    assert cfg.optimizer.params["lr"] == 1e-4
    assert list(cfg.optimizer.params["betas"]) == [0.9, 0.999]
    assert cfg.optimizer.params["eps"] == 1e-8
    assert cfg.optimizer.params["weight_decay"] == 0.0
    assert load_config({"optimizer": {"params": {"lr": 1e-4}}}).optimizer.type == "Adam"  # default type


def test_adam_accepts_deepspeed_only_params():
    cfg = load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}}})
    assert cfg.optimizer.params["adam_w_mode"] is False
    assert cfg.optimizer.params["torch_adam"] is True


def test_aio_thread_count_and_new_name():
    assert load_config({"aio": {"thread_count": 3}}).aio.threads == 3
    assert load_config({"aio": {"intra_op_parallelism": 5}}).aio.threads == 5
    assert load_config({"aio": {"thread_count": 4, "intra_op_parallelism": 4}}).aio.threads == 4


# --- unknown keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, path, suggestion",
    [
        ({"train_batch_sise": 8}, "train_batch_sise", "'train_batch_size'"),
        ({"zero_optimization": {"stag": 0}}, "zero_optimization.stag", "'zero_optimization.stage'"),
        ({"zero_optimization": {"offload_optimizer": {"devic": "none"}}},
         "zero_optimization.offload_optimizer.devic", "'zero_optimization.offload_optimizer.device'"),
        ({"zero_optimization": {"offload_param": {"pin_memry": False}}},
         "zero_optimization.offload_param.pin_memry", "'zero_optimization.offload_param.pin_memory'"),
        ({"fp16": {"initial_scale_powr": 16}}, "fp16.initial_scale_powr", "'fp16.initial_scale_power'"),
        ({"tensorboard": {"jobname": "x"}}, "tensorboard.jobname", "'tensorboard.job_name'"),
        ({"aio": {"queue_dept": 8}}, "aio.queue_dept", "'aio.queue_depth'"),
        ({"optimizer": {"type": "Adam", "params": {"betas1": 0.9}}}, "optimizer.params.betas1",
         "'optimizer.params.betas'"),
        ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}}, "optimizer.params.momentun",
         "'optimizer.params.momentum'"),
        ({"optimizer": {"typ": "Adam"}}, "optimizer.typ", "'optimizer.type'"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lrr": 0.1}}},
         "scheduler.params.warmup_max_lrr", "'scheduler.params.warmup_max_lr'"),
        ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_max_mon": 0.9}}},
         "scheduler.params.cycle_max_mon", "'scheduler.params.cycle_max_mom'"),
        ({"Train_Batch_Size": 8}, "Train_Batch_Size", "'train_batch_size'"),
    ],
)
def test_unknown_key_names_path_and_closest_key(raw, path, suggestion):
    msg = raises(raw, f"{path}: unknown key", f"Did you mean {suggestion}?")
    assert msg.startswith(path)


def test_unknown_key_lists_valid_keys_of_its_section():
    msg = raises({"zero_optimization": {"offload_optimizer": {"devic": "none"}}},
                 "Valid keys at 'zero_optimization.offload_optimizer'")
    for key in ("device", "nvme_path", "pin_memory", "ratio"):
        assert key in msg
    msg = raises({"train_batch_sise": 8}, "Valid keys at the top level")
    assert "gradient_accumulation_steps" in msg and "zero_optimization" in msg


def test_unknown_key_without_close_match_has_no_suggestion():
    msg = raises({"zero_optimization": {"zzzzqqq": 1}}, "zero_optimization.zzzzqqq: unknown key")
    assert "Did you mean" not in msg


def test_unknown_top_level_key_without_close_match_is_a_warning(caplog):
    """DeepSpeed ignores top-level keys it does not read; a near miss of a known key stays an error (above)."""
    with caplog.at_level("WARNING"):
        cfg = load_config({"zzzzqqq": 1, "cuda_visible_devices": "0,1", "data_parallel_size": 2,
                           "train_micro_batch_size_per_gpu": 2})
    assert cfg.train_micro_batch_size_per_gpu == 2
    for key in ("zzzzqqq", "cuda_visible_devices", "data_parallel_size"):
        assert f"top-level key '{key}' is not read" in caplog.text


def test_scheduler_param_of_another_schedule_is_unknown():
    # total_num_steps belongs to WarmupDecayLR, not WarmupLR.
    raises({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}},
           "scheduler.params.total_num_steps: unknown key", "warmup_num_steps")


def test_sgd_rejects_adam_params():
    raises({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}},
           "optimizer.params.betas: unknown key", "momentum")


# --- wrong types and ranges -------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, fragments",
    [
        ({"fp16": {"enabled": "yes"}}, ["fp16.enabled", '"yes"', "true/false"]),
        ({"train_batch_size": 3.5}, ["train_batch_size", "3.5", "an integer", '"auto"']),
        ({"train_micro_batch_size_per_gpu": "four"}, ["train_micro_batch_size_per_gpu", '"four"', "an integer"]),
        ({"steps_per_print": True}, ["steps_per_print", "true", "an integer"]),
        ({"gradient_clipping": "1.0"}, ["gradient_clipping", '"1.0"', "a number"]),
        ({"gradient_clipping": "auto"}, ["gradient_clipping", '"auto"', "Hugging Face Trainer", "accelerate"]),
        ({"wall_clock_breakdown": 1}, ["wall_clock_breakdown", "1", "true/false"]),
        ({"fp16": [True]}, ["fp16", "[true]", "an object"]),
        ({"zero_optimization": [0]}, ["zero_optimization", "[0]", "an object"]),
        ({"zero_optimization": {"offload_optimizer": "cpu"}},
         ["zero_optimization.offload_optimizer", '"cpu"', "an object"]),
        ({"optimizer": ["Adam"]}, ["optimizer", '["Adam"]', "an object"]),
        ({"optimizer": {"type": "Adam", "params": [0.1]}}, ["optimizer.params", "[0.1]", "an object"]),
        ({"tensorboard": {"output_path": 5}}, ["tensorboard.output_path", "5", "a string"]),
        ({"zero_optimization": {"reduce_bucket_size": 5.5}},
         ["zero_optimization.reduce_bucket_size", "5.5", "an integer"]),
        ({"activation_checkpointing": {"modules": "Block"}}, ["activation_checkpointing.modules", '"Block"', "a list"]),
        ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, ["optimizer.params.lr", "'fast'", "a number >= 0"]),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
         ["optimizer.params.betas", "[0.9, 1.5]", "[0, 1)"]),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "yes"}}},
         ["optimizer.params.adam_w_mode", "'yes'", "true/false"]),
    ],
)
def test_wrong_type_names_key_value_and_allowed(raw, fragments):
    msg = raises(raw, *fragments)
    assert msg.startswith(fragments[0] + ":")


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    raises(path, "expected a JSON object", "list")
    with pytest.raises(ConfigError, match="JSON file path, a dict or a Config"):
        load_config(42)


@pytest.mark.parametrize(
    "raw, path, value, bound",
    [
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage", "5", "<= 3"),
        ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage", "-1", ">= 0"),
        ({"gradient_clipping": -1}, "gradient_clipping", "-1.0", ">= 0"),  # float field: shown as a float
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis", "0", ">= 1"),
        ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window", "0", ">= 1"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale", "0.0", "> 0"),
        ({"fp16": {"initial_scale_power": 200}}, "fp16.initial_scale_power", "200", "<= 127"),
        ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, "zero_optimization.offload_optimizer.ratio",
         "1.5", "<= 1.0"),
        ({"zero_optimization": {"offload_optimizer": {"ratio": -0.1}}}, "zero_optimization.offload_optimizer.ratio",
         "-0.1", ">= 0.0"),
        ({"train_batch_size": 0}, "train_batch_size", "0", ">= 1"),
        ({"steps_per_print": 0}, "steps_per_print", "0", ">= 1"),
        ({"aio": {"queue_depth": 0}}, "aio.queue_depth", "0", ">= 1"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", "0", ">= 1"),
        ({"tensor_parallel": {"size": 0}}, "tensor_parallel.size", "0", ">= 1"),
    ],
)
def test_out_of_range_names_key_value_and_bound(raw, path, value, bound):
    raises(raw, f"{path}: {value} is out of range", f"it must be {bound}")


def test_range_boundaries_are_inclusive():
    assert load_config(
        {"zero_optimization": {"offload_optimizer": {"ratio": 1.0}}}).zero_optimization.offload_optimizer.ratio == 1.0
    assert load_config(
        {"zero_optimization": {"offload_optimizer": {"ratio": 0}}}).zero_optimization.offload_optimizer.ratio == 0.0
    assert load_config({"fp16": {"hysteresis": 1}}).fp16.hysteresis == 1
    assert load_config({"gradient_clipping": 0}).gradient_clipping == 0.0


def test_literal_choices_are_listed():
    msg = raises({"tensor_parallel": {"mode": "4d"}}, "tensor_parallel.mode", '"4d"', '"1d" or "2d" or "2.5d" or "3d"')
    assert msg.startswith("tensor_parallel.mode:")
    raises({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
           "zero_optimization.offload_optimizer.device", '"gpu"', '"none" or "cpu" or "nvme"')
    raises({"zero_optimization": {"placement": "dynamic"}}, "zero_optimization.placement", '"dynamic"',
           '"static" or "auto"')


def test_literal_choices_are_case_insensitive():
    assert load_config({"tensor_parallel": {"mode": "2D"}}).tensor_parallel.mode == "2d"
    assert (load_config({"zero_optimization": {"offload_optimizer": {"device": "None"}}})
            .zero_optimization.offload_optimizer.device == "none")
    assert load_config({"train_batch_size": "AUTO", "train_micro_batch_size_per_gpu": 2}).train_batch_size == "auto"


@pytest.mark.parametrize("given, canonical", [("adamw", "AdamW"), ("ADAM", "Adam"), ("sgd", "SGD"), ("AdamW", "AdamW")])
def test_optimizer_type_is_case_insensitive(given, canonical):
    assert load_config({"optimizer": {"type": given}}).optimizer.type == canonical


def test_float_written_integers_are_accepted_as_ints():
    cfg = load_config({"train_batch_size": 32.0, "train_micro_batch_size_per_gpu": 4,
                       "zero_optimization": {"allgather_bucket_size": 2e8, "stage3_param_persistence_threshold": 1e4}})
    assert cfg.train_batch_size == 32 and isinstance(cfg.train_batch_size, int)
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 10_000


# --- cross-key checks, optimizer and scheduler ------------------------------------------------


def test_fp16_and_bf16_are_exclusive():
    raises({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "bf16.enabled", "at most one")
    assert load_config({"bf16": {"enabled": True}}).bf16.enabled is True
    assert load_config({"fp16": {"enabled": True}, "bf16": {"enabled": False}}).fp16.enabled is True


def test_unknown_optimizer_type_suggests_closest():
    msg = raises({"optimizer": {"type": "Adamm"}}, "optimizer.type", "'Adamm'", "Did you mean 'Adam'?",
                 "Adam, AdamW, SGD")
    assert msg.startswith("optimizer.type:")
    raises({"optimizer": {"type": "AdamWW"}}, "Did you mean 'AdamW'?")


@pytest.mark.parametrize("name", ["Lion", "adagrad"])
def test_unsupported_optimizer_says_not_supported_yet(name):
    raises({"optimizer": {"type": name}}, "optimizer.type", f"'{name}'", "not supported yet", "Adam, AdamW, SGD")


def test_optimizer_off_features():
    # bias_correction false is carried to the optimizer (engine/optim.py builds Adam without bias correction)
    assert load_config({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}).optimizer.params[
        "bias_correction"] is False
    raises({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad")
    load_config({"optimizer": {"type": "Adam", "params": {"bias_correction": True, "amsgrad": False}}})


def test_scheduler_type_typo_suggests_closest():
    msg = raises({"scheduler": {"type": "WarmupLr"}}, "scheduler.type", "'WarmupLr'", "Did you mean 'WarmupLR'?",
                 "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle")
    assert msg.startswith("scheduler.type:")
    raises({"scheduler": {"type": "WarmupCosinLR", "params": {"total_num_steps": 10}}},
           "Did you mean 'WarmupCosineLR'?")
    raises({"scheduler": {"params": {"warmup_max_lr": 0.1}}}, "scheduler.type", "unknown schedule ''")


@pytest.mark.parametrize(
    "sched, missing",
    [
        ({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1}}, ["'total_num_steps'"]),
        ({"type": "WarmupCosineLR"}, ["'total_num_steps'"]),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.0}}, ["'cycle_max_lr'"]),
        ({"type": "OneCycle"}, ["'cycle_min_lr'", "'cycle_max_lr'"]),
    ],
)
def test_scheduler_missing_required_param(sched, missing):
    raises({"scheduler": sched}, "scheduler.params", f"{sched['type']} requires", *missing)


def test_schedulers_with_required_params_load():
    for sched in ({"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}},
                  {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_type": "linear"}},
                  {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}):
        assert load_config({"scheduler": sched}).scheduler.type == sched["type"]


def test_aio_thread_count_conflict():
    msg = raises({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}, "aio", "thread_count",
                 "intra_op_parallelism", "give one")
    assert msg.startswith("aio")


def test_missing_config_file_names_the_path(tmp_path):
    path = tmp_path / "nope" / "ds_config.json"
    raises(path, "not found", str(path))


def test_invalid_json_names_the_path(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,}')
    msg = raises(str(path), str(path), "not valid JSON")
    assert "line 1" in msg  # the decoder's position survives


# --- to_dict round trip -----------------------------------------------------------------------


def test_to_dict_is_plain_json():
    cfg = load_config(DS_CONFIG)
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert d["fp16"]["initial_scale_power"] == 12
    assert d["optimizer"]["type"] == "Adam"


def _drop_none(d):
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


@pytest.mark.parametrize(
    "raw",
    [
        DS_CONFIG,
        {"train_micro_batch_size_per_gpu": 2},
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
         "optimizer": {"type": "sgd", "params": {"momentum": 0.9, "nesterov": True}},
         "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
         "bf16": {"enabled": True}, "seed": 7,
         "activation_checkpointing": {"enabled": True, "modules": ["Block", "*.mlp"], "every_n": 2},
         "tensor_parallel": {"mode": "2d", "plan": {"*.attn": "column"}},
         "zero_optimization": {"chunk_size": 1 << 20, "overlap_comm": False}},
    ],
)
def test_to_dict_round_trips(raw):
    cfg = load_config(raw)
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(_drop_none(cfg.to_dict())) == cfg
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("aio", [{"thread_count": 4}, {"intra_op_parallelism": 4}])
def test_to_dict_round_trips_with_aio_threads(aio):
    cfg = load_config({"aio": aio})
    assert load_config(cfg.to_dict()) == cfg


# --- DeepSpeed keys a real ds_config.json carries that the spec says must load or say "not supported yet" ---


def test_auto_bucket_size_is_accepted():
    load_config({"zero_optimization": {"reduce_bucket_size": "auto"}})


def test_fp16_auto_cast_false_is_a_known_deepspeed_key():
    assert load_config({"fp16": {"enabled": True, "auto_cast": False}}).fp16.auto_cast is False
    assert load_config({"fp16": {"enabled": True, "auto_cast": True}}).fp16.auto_cast is True
    raises({"fp16": {"enabled": False, "auto_cast": True}}, "fp16.auto_cast", "fp16.enabled is false")


def test_scheduler_last_batch_iteration_is_a_known_deepspeed_key():
    cfg = load_config({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}}})
    assert "last_batch_iteration" not in cfg.scheduler.params
    raises({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
           "scheduler.params.last_batch_iteration", "not supported yet")


def test_scheduler_param_values_are_checked_at_load():
    raises({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
           "scheduler.params.warmup_type", "'cosine'", "'log'", "'linear'")
