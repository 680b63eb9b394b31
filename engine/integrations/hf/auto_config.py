"""A DeepSpeed-style config's "auto" values, filled from Hugging Face TrainingArguments and the model.

Note [auto values from the Trainer]
transformers fills a DeepSpeed config's "auto" values from its TrainingArguments (HfTrainerDeepSpeedConfig, when
the arguments are made and when training starts); resolve_config does both at once, from the same sources with
the same formulas:
  train_micro_batch_size_per_gpu   per_device_train_batch_size
  gradient_accumulation_steps      gradient_accumulation_steps
  train_batch_size                 data-parallel size × micro batch × accumulation
  gradient_clipping                max_grad_norm
  optimizer.params                 lr learning_rate; betas [adam_beta1, adam_beta2]; eps adam_epsilon;
                                   weight_decay weight_decay
  scheduler.params                 warmup_min_lr 0; warmup_max_lr learning_rate; total_num_steps the run's
                                   optimizer steps; warmup_num_steps max(1, args.get_warmup_steps(total))
  fp16.enabled, bf16.enabled       fp16 or fp16_full_eval, bf16 or bf16_full_eval
  zero_optimization                reduce_bucket_size h²; at stage 3 stage3_prefetch_bucket_size int(0.9 h²) and
                                   stage3_param_persistence_threshold 10 h (h: the model config's hidden_size, else
                                   the largest of its hidden_sizes, else its text_config's)
Two differences: train_batch_size counts the data-parallel size (the processes over the tensor, pipeline and
sequence-parallel sizes the config sets), where transformers counts every process, which is wrong for Tiers
whenever one of those is above 1; and the micro batch and the accumulation steps are set when the config lacks
them (the engine would otherwise take 1 and step at every micro-batch of a longer accumulation, scaling the
loss by another count than the Trainer's batches have). Otherwise, as in transformers, a key the config lacks
is not added; a
value that is not "auto" and differs from what the arguments say is an error, every one of them named in one
ValueError (the micro batch and the total batch are not compared under auto_find_batch_size); the bucket sizes
and warmup_min_lr are filled, never compared. "auto" left elsewhere (keys transformers does not fill either)
reaches the config loader, which takes DeepSpeed's defaults inside zero_optimization and names the rest.
"""

from __future__ import annotations

import os

from engine.integrations.config_dict import read_config, zero_stage
from engine.integrations.parallel_sizes import data_parallel_size

AUTO = "auto"


def resolve_config(config: dict | str | os.PathLike, training_args, model=None,
                   num_training_steps: int | None = None) -> dict:
    """`config` (a dict, or a JSON file's path) with its "auto" values filled from `training_args` (transformers'
    TrainingArguments) and `model` (its config's hidden size), as Note [auto values from the Trainer] says.
    num_training_steps: the run's optimizer steps (the Trainer knows them once it has the data), for the
    scheduler's total and warmup steps; default training_args.max_steps when that is set."""
    filler = _Filler(read_config(config))
    args = training_args
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        filler.config.setdefault(key, AUTO)  # the Trainer's batches are what arrive: the engine must count them
    batch_checked = not getattr(args, "auto_find_batch_size", False)
    filler.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", batch_checked)
    filler.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    dp = data_parallel_size(filler.config, args.world_size)
    filler.fill("train_batch_size", dp * micro * accumulation,
                f"data-parallel size {dp} × per_device_train_batch_size × gradient_accumulation_steps", batch_checked)
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0, "warmup_min_lr", checked=False)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filler.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    _fill_bucket_sizes(filler, model)
    _fill_schedule_lengths(filler, args, num_training_steps)
    filler.raise_mismatches()
    return filler.config


def _fill_bucket_sizes(filler: _Filler, model) -> None:
    keys = ["zero_optimization.reduce_bucket_size"]
    if zero_stage(filler.config) == 3:
        keys += ["zero_optimization.stage3_prefetch_bucket_size",
                 "zero_optimization.stage3_param_persistence_threshold"]
    wanted = [k for k in keys if filler.is_auto(k)]
    if not wanted:
        return
    hidden = hidden_size_of(model)
    if hidden is None:
        raise ValueError(f"{', '.join(wanted)}: \"auto\" is derived from the model's hidden size, and "
                         f"{'no model was given' if model is None else 'its config has none'}; pass the model, or "
                         "give the sizes as numbers")
    sizes = {"zero_optimization.reduce_bucket_size": hidden * hidden,
             "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
             "zero_optimization.stage3_param_persistence_threshold": 10 * hidden}
    for key in wanted:
        filler.fill(key, sizes[key], "the model's hidden size", checked=False)


def hidden_size_of(model) -> int | None:
    """The hidden size transformers reads for the bucket sizes: config.hidden_size, else max(hidden_sizes), else
    the same of its text_config; None when the model has no such config."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if isinstance(getattr(cfg, "hidden_size", None), int):
            return cfg.hidden_size
        if getattr(cfg, "hidden_sizes", None):
            return max(cfg.hidden_sizes)
    return None


def _fill_schedule_lengths(filler: _Filler, args, num_training_steps: int | None) -> None:
    keys = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
    if not any(filler.has(k) for k in keys):
        return
    total = num_training_steps if num_training_steps is not None else (args.max_steps if args.max_steps > 0 else None)
    if total is None:
        auto = [k for k in keys if filler.is_auto(k)]
        if auto:
            raise ValueError(f"{', '.join(auto)}: \"auto\" is the run's number of optimizer steps, unknown here; "
                             "set max_steps in the training arguments or pass num_training_steps")
        return
    filler.fill(keys[0], total, "max_steps")
    filler.fill(keys[1], max(1, args.get_warmup_steps(total)), "warmup_steps")


class _Filler:
    """Fills dotted keys of a config whose section exists, collecting the values that contradict the arguments."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict | None, str]:
        *path, leaf = key.split(".")
        node = self.config
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def has(self, key: str) -> bool:
        node, leaf = self._node(key)
        return node is not None and leaf in node

    def is_auto(self, key: str) -> bool:
        node, leaf = self._node(key)
        return node is not None and node.get(leaf) == AUTO

    def fill(self, key: str, value, source: str, checked: bool = True) -> None:
        node, leaf = self._node(key)
        if node is None or leaf not in node:
            return
        if node[leaf] == AUTO:
            node[leaf] = value
        elif checked and node[leaf] is not None and _normalized(node[leaf]) != _normalized(value):
            self.mismatches.append(f"- {key}={node[leaf]} vs training arguments {source}={value}")

    def raise_mismatches(self) -> None:
        if self.mismatches:
            raise ValueError("the config contradicts the training arguments; set these config values to \"auto\" or "
                             "to the arguments' values:\n" + "\n".join(self.mismatches))


def _normalized(value):
    return list(value) if isinstance(value, tuple) else value
