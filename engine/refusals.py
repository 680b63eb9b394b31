"""What initialize() refuses before it builds anything, asked of a config alone (`refused`: no process group, no
model), and the registry of the refusals the README states (REFUSALS): each claim with the configs that ask for it.
The README's "not with" clauses are rendered from the registry (scripts/readme_features.py), and a test runs every
ask through `refused`, so a claim the checks do not make fails the suite, as the composition grid's cells do."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from engine.config import load_config
from engine.config_checks import check_framework_run, check_run
from engine.mesh import Mesh, ParallelDims
from engine.optim import check_compressed_run

# what every ask's config has besides its own keys: one micro-batch of one sample, an optimizer from the config
BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def fewest_ranks(cfg) -> ParallelDims:
    """The smallest world `cfg`'s degrees run on (ParallelDims raises for degrees no world fits); hybrid sharding
    with two copies at least."""
    tp, pp, sp, ep = (cfg.tensor_parallel.size, cfg.pipeline.stages, cfg.sequence_parallel.size,
                      cfg.moe.expert_parallel_size)
    shard = max(cfg.zero_optimization.mics_shard_size, 0)
    dp = next((d for d in range(1, 2 * ep * max(shard, 1) + 1)
               if d * sp % ep == 0 and (not shard or d * sp % shard == 0 and d * sp > shard)), 1)
    return ParallelDims(pp * dp * sp * tp, pp=pp, sp=sp, tp=tp, ep=ep,
                        tp_mode=cfg.tensor_parallel.mode, tp_depth=cfg.tensor_parallel.depth, shard=shard)


def refused(config: dict, zero_init: bool = False, runner: str | None = None) -> str | None:
    """The error initialize() raises for `config` (over BASE's keys) before building anything, on the fewest ranks
    its degrees need; None when it is accepted. zero_init: the model is built under engine.zero_init(); runner: a
    framework's trainer drives the engine (its name): the error its integration raises then too."""
    try:
        cfg = load_config(merged(BASE, copy.deepcopy(config)))
        dims = fewest_ranks(cfg)
        mesh = Mesh.layout(zero=dims.dp * dims.sp, tp=dims.tp, pp=dims.pp, sp=dims.sp, ep=dims.ep)
        check_run(cfg, mesh, built_under_zero_init=zero_init)
        check_compressed_run(cfg, mesh)
        if runner is not None:
            check_framework_run(cfg, runner, "its sampler", "it calls the engine")
    except ValueError as e:  # ConfigError is one
        return str(e)
    return None


def merged(base: dict, fragment: dict) -> dict:
    """A copy of `base` with `fragment`'s keys set, sections merged key by key."""
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class Ask:
    """A feature's config with another's (or with a model built under zero_init, or a framework's trainer driving
    the engine): refused together with an error naming `names`, and each accepted alone. With nothing beside it
    (`other` empty, no zero_init, no runner), the feature's config is a setting refused by itself."""

    feature: dict
    other: dict
    names: str
    zero_init: bool = False
    runner: str | None = None

    def error(self) -> str | None:
        """The error the two together raise (None: accepted)."""
        return refused(merged(self.feature, self.other), self.zero_init, self.runner)

    @property
    def combined(self) -> bool:
        return bool(self.other) or self.zero_init or self.runner is not None

    def errors_alone(self) -> tuple[str | None, str | None]:
        """The errors of the feature alone and of the other alone (with zero_init and the runner); a setting refused
        by itself has none to give."""
        if not self.combined:
            return None, None
        return refused(self.feature), refused(self.other, self.zero_init, self.runner)


@dataclass(frozen=True)
class Refusal:
    """A combination the README says is not built: its feature row (scripts/readme_features.py's ids), the words it
    says it in, and the configs that ask for it."""

    row: str
    claim: str
    asks: tuple[Ask, ...]


def _offload(stage: int = 3, **offload_optimizer) -> dict:
    return {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", **offload_optimizer}}}


_TP, _PP, _SP, _EP = ({"tensor_parallel": {"size": 2}}, {"pipeline": {"stages": 2}}, {"sequence_parallel": {"size": 2}},
                      {"moe": {"expert_parallel_size": 2}})
_GRIDS = ({"size": 8, "mode": "2.5d", "depth": 2}, {"size": 8, "mode": "3d"})
_ONE_BIT = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}}
_LOW_BIT = {"optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-3}}}
_INT8_BASE = {"zero_optimization": {"stage": 3, "quantize_frozen": "int8"}}
_LAYER_MAJOR = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                      "offload_param": {"device": "cpu", "layer_major": True}}}

REFUSALS = (
    Refusal("optimizers", "the 1-bit family at ZeRO stage 0 with data parallelism only, not with fp16", (
        Ask(_ONE_BIT, {"fp16": {"enabled": True}}, "fp16.enabled"),
        Ask(_ONE_BIT, {"zero_optimization": {"stage": 1}}, "zero_optimization.stage"),
        Ask(_ONE_BIT, _TP, "optimizer.type"),
        Ask(_ONE_BIT, _PP, "optimizer.type"),
    )),
    Refusal("optimizers", "8/4-bit not yet with tensor, expert or pipeline parallelism",
            tuple(Ask(_LOW_BIT, f, "optimizer.type") for f in (_TP, _EP, _PP))),
    Refusal("offload_optimizer", "`step_in_backward` not with fp16 or pipeline stages",
            tuple(Ask(_offload(2, step_in_backward=True), f, "step_in_backward")
                  for f in ({"fp16": {"enabled": True}}, _PP))),
    Refusal("offload_param", "needs `offload_optimizer`", (
        Ask({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, {},
            "zero_optimization.offload_param"),
    )),
    Refusal("offload_param", "`layer_major` not yet with tp, sp, ep or pp",
            tuple(Ask(_LAYER_MAJOR, f, "layer_major") for f in (_TP, _SP, _EP, _PP))),
    Refusal("finetuning", "the int8 base not yet with tensor, pipeline or expert parallelism",
            tuple(Ask(_INT8_BASE, f, "quantize_frozen") for f in (_TP, _PP, _EP))),
    Refusal("tp1d", "`zero_init` not yet with tensor parallelism", (
        Ask(_TP, {}, "tensor_parallel", zero_init=True),
    )),
    Refusal("tp_grids", "not yet with pipeline, sequence or expert parallelism", tuple(
        Ask({"tensor_parallel": grid}, other, key) for grid in _GRIDS
        for other, key in ((_PP, "tensor_parallel.mode"), (_SP, "sequence_parallel.size"),
                           (_EP, "moe.expert_parallel_size")))),
    Refusal("checkpoints", "one directory shared by all ranks (`use_node_local_storage` is refused)", (
        Ask({"checkpoint": {"use_node_local_storage": True}}, {}, "checkpoint.use_node_local_storage"),
    )),
    *(Refusal(row, "not yet with tensor, pipeline or sequence parallelism, or `layer_major`", (
        *(Ask(f, {}, "with tensor, pipeline or sequence parallelism", runner=runner) for f in (_TP, _PP, _SP)),
        Ask(_LAYER_MAJOR, {}, "layer_major", runner=runner),
    )) for row, runner in (("hf_trainer", "the Hugging Face Trainer"), ("lightning", "Lightning"))),
)
