"""Note [auto values from the Trainer]: resolve_config fills a DeepSpeed config's "auto" values as transformers'
own HfTrainerDeepSpeedConfig does, from the same TrainingArguments and model, and the engine loads the result."""

from __future__ import annotations

import copy
import glob
import json
import os

import pytest

from engine.config import load_config
from engine.config_schema import ConfigError
from engine.integrations.hf import resolve_config
from engine.integrations.parallel_sizes import model_parallel_size

transformers = pytest.importorskip("transformers")
accelerate_deepspeed = pytest.importorskip("accelerate.utils.deepspeed")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# every config with an "auto" value in DeepSpeedExamples (deepspeed_examples_auto/README.md), and those among the
# other frameworks' configs the suite keeps
WITH_AUTO = sorted(p for d in ("deepspeed_examples_auto", "deepspeed_configs")
                   for p in glob.glob(os.path.join(FIXTURES, d, "*.json")) if '"auto"' in open(p).read())
STEPS = 100


DEFAULTS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=3e-4, weight_decay=0.01,
                adam_beta2=0.95, max_grad_norm=0.5, warmup_steps=0.1, report_to=[], use_cpu=True)


def training_args(tmp_path, **overrides) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(**{**DEFAULTS, "output_dir": str(tmp_path), **overrides})


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128))


class TransformersFilling(transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig,
                          accelerate_deepspeed.HfDeepSpeedConfig):
    """transformers' HfTrainerDeepSpeedConfig over accelerate's config queries, its base when the deepspeed package is
    installed (without it transformers gives the class no base, and its constructor checks deepspeed's version)."""


def transformers_fill(config: dict, args, model, steps: int) -> dict:
    """transformers' own filling, both rounds (trainer_config_process, trainer_config_finalize)."""
    hf = TransformersFilling.__new__(TransformersFilling)
    accelerate_deepspeed.HfDeepSpeedConfig.__init__(hf, copy.deepcopy(config))
    hf._dtype, hf.mismatches = None, []
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model, steps)
    return hf.config


def arguments_agreeing_with(config: dict, tmp_path, counted=model_parallel_size) -> transformers.TrainingArguments:
    """Training arguments that agree with the config's numbers (a user's, for their own config), the defaults of
    training_args elsewhere; their world is the data-parallel groups the total batch implies, times
    counted(config) processes per group."""
    def number(value):
        return value if value != "auto" else None

    params = (config.get("optimizer") or {}).get("params") or {}
    micro = number(config.get("train_micro_batch_size_per_gpu"))
    accumulation = number(config.get("gradient_accumulation_steps"))
    total = number(config.get("train_batch_size"))
    if total and not micro:  # one data-parallel group: the total is a micro batch times the accumulation
        accumulation = accumulation or 1
        micro = total // accumulation
    micro = micro or 2
    found = {"per_device_train_batch_size": micro,
             "gradient_accumulation_steps": accumulation or (total // micro if total else 4),
             "max_grad_norm": number(config.get("gradient_clipping")), "learning_rate": number(params.get("lr")),
             "adam_epsilon": number(params.get("eps")), "weight_decay": number(params.get("weight_decay")),
             "bf16": number((config.get("bf16") or {}).get("enabled")),
             "fp16": number((config.get("fp16") or {}).get("enabled"))}
    if number(params.get("betas")):
        found["adam_beta1"], found["adam_beta2"] = params["betas"]
    world = (total // (micro * found["gradient_accumulation_steps"]) if total else 1) * counted(config)

    class Processes(transformers.TrainingArguments):  # the processes the config's total batch was written for
        @property
        def world_size(self):
            return world

    values = dict(DEFAULTS, output_dir=str(tmp_path), **{k: v for k, v in found.items() if v is not None})
    return Processes(**values)


def mismatched_keys(message: str) -> list[str]:
    """The config keys a mismatch error names, one per "- key=value vs ..." line (transformers writes "- ds key")."""
    return [line.removeprefix("- ").removeprefix("ds ").split("=")[0] for line in message.splitlines()
            if line.startswith("- ")]


@pytest.mark.parametrize("path", WITH_AUTO, ids=os.path.basename)
def test_every_example_config_with_auto_values_is_filled_as_transformers_fills_it(path, tmp_path):
    with open(path) as f:  # a shell template, filled as its run.sh fills it for ZeRO 2 with AutoTP 4
        config = json.loads(f.read().replace("${zero_stage}", "2").replace("${autotp_size}", "4"))
    args, model = arguments_agreeing_with(config, tmp_path), gpt2()
    steps = (config.get("scheduler") or {}).get("params", {}).get("total_num_steps", STEPS)
    steps = STEPS if steps == "auto" else steps
    # the differences: the batch keys a config lacks are set (the Trainer's batches are what the engine counts), and
    # the total batch counts the data-parallel processes only (transformers counts every one: given those alone)
    expected = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", **config}
    data_parallel_args = arguments_agreeing_with(config, tmp_path, counted=lambda config: 1)
    try:
        theirs = transformers_fill(expected, data_parallel_args, model, steps)
    except ValueError as e:  # a value no arguments agree with (warmup_num_steps 0: transformers fills at least 1)
        with pytest.raises(ValueError) as ours:
            resolve_config(config, args, model, num_training_steps=steps)
        assert mismatched_keys(str(ours.value)) == mismatched_keys(str(e))
        return
    ours = resolve_config(config, args, model, num_training_steps=steps)
    assert ours == theirs
    assert '"auto"' not in json.dumps({k: v for k, v in ours.items() if k != "zero_optimization"})
    try:
        loaded = load_config(ours)
    except ConfigError as e:  # refused for what it asks (e.g. ZeRO++), not for an "auto" left open
        assert "auto" not in str(e)
        return
    data_parallel = args.world_size // model_parallel_size(config)
    assert loaded.batch_sizes(data_parallel).gradient_accumulation_steps == args.gradient_accumulation_steps


def test_values_that_contradict_the_arguments_are_all_named_as_transformers_names_them(tmp_path):
    config = {"gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
              "gradient_accumulation_steps": 8}
    args = training_args(tmp_path)
    with pytest.raises(ValueError) as ours:
        resolve_config(config, args, gpt2(), STEPS)
    with pytest.raises(ValueError) as theirs:
        transformers_fill(config, args, gpt2(), STEPS)
    assert mismatched_keys(str(ours.value)) == mismatched_keys(str(theirs.value)) == \
        ["gradient_accumulation_steps", "gradient_clipping", "optimizer.params.lr"]  # betas agree: (0.9, 0.95)


def test_the_total_batch_counts_data_parallel_processes_only(tmp_path):
    """Over 8 processes with tensor parallel 2 and pipeline 2, two groups see different samples."""
    class EightProcesses(transformers.TrainingArguments):
        @property
        def world_size(self):
            return 8

    args = EightProcesses(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                          report_to=[], use_cpu=True)
    config = {"train_batch_size": "auto", "tensor_parallel": {"size": 2}, "pipeline": {"stages": 2}}
    resolved = resolve_config(config, args)
    assert resolved["train_batch_size"] == 2 * 2 * 4  # transformers' rule would give 8 × 2 × 4
    assert load_config(resolved).batch_sizes(2).gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="do not divide"):
        resolve_config({**config, "sequence_parallel": {"size": 3}}, args)


def test_what_cannot_be_derived_is_named(tmp_path):
    args = training_args(tmp_path)
    with pytest.raises(ValueError, match="reduce_bucket_size: \"auto\" is derived from the model's hidden size"):
        resolve_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, args)
    with pytest.raises(ValueError, match="total_num_steps: \"auto\" is the run's number of optimizer steps"):
        resolve_config({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}, args)
    steps = resolve_config({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
                           training_args(tmp_path, max_steps=40))
    assert steps["scheduler"]["params"]["total_num_steps"] == 40


def test_a_tuple_in_a_python_config_is_the_list_the_arguments_make(tmp_path):
    config = {"optimizer": {"type": "AdamW", "params": {"betas": (0.9, 0.95)}}}
    assert resolve_config(config, training_args(tmp_path))["optimizer"]["params"]["betas"] == (0.9, 0.95)
