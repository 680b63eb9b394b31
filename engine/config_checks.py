"""Every check of a combination of settings, in one place: what a config alone rules out (`check_config`,
run by load_config), what it rules out with the objects passed to initialize() (`check_client_objects`), and
with the run it is given to (`check_run`: the world size, a client optimizer or scheduler, a model built under
zero_init; `check_offload` also guards build_chunk_optimizer used on its own). initialize() runs them before
it builds anything. Each error names the key, the value and the fix."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

from engine.config_schema import ConfigError
from engine.grid_shapes import tp_grid_problem

if TYPE_CHECKING:
    import torch

    from engine.config_sections import Config
    from engine.mesh import Mesh

OFFLOADED = ("cpu", "nvme")  # offload devices that offload ("none" and null are both off)


def check_config(cfg: Config) -> None:
    """Combinations a config alone rules out, and features of later releases: their keys parse, but only their
    off values are accepted."""
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one.")
    given = [value not in (None, "auto") for value in (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                                          cfg.gradient_accumulation_steps)]
    if given == [False, False, True]:
        raise ConfigError("batch size: gradient_accumulation_steps alone is not enough; "
                          "also set train_batch_size or train_micro_batch_size_per_gpu.")
    zero = cfg.zero_optimization
    grid_problem = _grid_problem(cfg)
    checks = [
        (cfg.fp16.max_loss_scale > 0 and cfg.fp16.loss_scale > 0, "fp16.max_loss_scale", cfg.fp16.max_loss_scale,
         "caps a dynamic loss scale, and fp16.loss_scale sets a static one; remove one of them"),
        (0 < cfg.fp16.max_loss_scale < 2.0 ** cfg.fp16.initial_scale_power, "fp16.max_loss_scale",
         cfg.fp16.max_loss_scale, f"caps the dynamic loss scale below its start, 2^{cfg.fp16.initial_scale_power}; "
         "raise it, lower initial_scale_power, or use 0 (no cap)"),
        (cfg.fp16.auto_cast and not cfg.fp16.enabled, "fp16.auto_cast", True, "casts the forward's inputs to fp16, "
         "for a model trained in fp16, and fp16.enabled is false; set fp16.enabled to true, or remove auto_cast"),
        (cfg.torch_autocast.enabled and not cfg.torch_autocast.is_bf16, "torch_autocast.dtype",
         cfg.torch_autocast.dtype, "autocast to fp16 (which needs DeepSpeed's GradScaler; also torch's "
         "default on CUDA when dtype is not given) is not built yet; set \"dtype\": \"bfloat16\", or use fp16.enabled"),
        # with bf16.enabled (DeepSpeed's bf16 master weight example): bf16 weights, the forward under autocast to
        # bf16, which is how bf16 runs anyway
        (cfg.torch_autocast.enabled and cfg.fp16.enabled, "torch_autocast.enabled", True,
         "runs the forward under autocast to bf16, and fp16.enabled keeps fp16 weights; enable one of them"),
        (zero.stage >= 1 and not zero.allgather_partitions, "zero_optimization.allgather_partitions", False,
         "Tiers always all-gathers the updated shards; remove the key or set it to true"),
        (not zero.load_from_fp32_weights, "zero_optimization.load_from_fp32_weights", False,
         "rebuilding the fp32 master weights from the 16-bit ones on load is not built yet (Tiers loads the saved "
         "fp32 masters); remove the key or set it to true"),
        (not zero.contiguous_gradients, "zero_optimization.contiguous_gradients", False,
         "Tiers always keeps gradients in contiguous chunks; remove the key or set it to true"),
        (zero.offload_optimizer.device == "nvme" and not zero.offload_optimizer.nvme_path,
         "zero_optimization.offload_optimizer.nvme_path", None,
         "device \"nvme\" needs a directory on the NVMe disk; set nvme_path"),
        (zero.offload_optimizer.device in ("cpu", "nvme") and zero.offload_optimizer.ratio != 1.0 and zero.stage != 3,
         "zero_optimization.offload_optimizer.ratio", zero.offload_optimizer.ratio,
         "offloading a share of the optimizer states needs ZeRO stage 3, as in DeepSpeed; set stage 3, or use 1.0"),
        (zero.offload_param.device in OFFLOADED and zero.stage != 3, "zero_optimization.offload_param.device",
         zero.offload_param.device, "parameters are offloaded only when they are sharded: set zero_optimization.stage "
         "to 3, or use \"none\""),
        (zero.offload_param.device == "nvme" and not zero.offload_param.nvme_path,
         "zero_optimization.offload_param.nvme_path", None, "device \"nvme\" needs a directory on the NVMe disk; set "
         "nvme_path"),
        (zero.mics_shard_size == 0, "zero_optimization.mics_shard_size", 0, "a shard group of no ranks; give the "
         "ranks one copy of the ZeRO states spans (e.g. the GPUs of a node), or -1 to shard across all of them"),
        (zero.mics_shard_size > 0 and zero.stage == 0, "zero_optimization.mics_shard_size", zero.mics_shard_size,
         "sets how far ZeRO shards the model states, and stage 0 shards none; set zero_optimization.stage to 1-3 "
         "(DeepSpeed's MiCS is stage 3), or remove the key"),
        (zero.stage3_max_reuse_distance != 1_000_000_000, "zero_optimization.stage3_max_reuse_distance",
         zero.stage3_max_reuse_distance, "Tiers releases a chunk once the modules using it are done and gathers "
         "ahead by the recorded trace, without a reuse distance; remove the key"),
        (cfg.checkpoint.load_universal, "checkpoint.load_universal", True,
         "Tiers reads its own checkpoints only, and every one of them loads under any layout (Note [reading a "
         "checkpoint anywhere]) without a conversion; remove the key"),
        (cfg.checkpoint.use_node_local_storage, "checkpoint.use_node_local_storage", True,
         "node-local checkpoint storage is not supported yet: every rank writes into one directory on a filesystem "
         "all ranks share; remove the key"),
        (cfg.checkpoint.parallel_write.pipeline_stage, "checkpoint.parallel_write.pipeline_stage", True,
         "every rank already writes its own file, pipeline stages included; remove the key"),
        (zero.placement == "auto" and zero.offload_optimizer.device not in OFFLOADED, "zero_optimization.placement",
         zero.placement, "places the chunks the chunk manager holds, and nothing is offloaded; set "
         "zero_optimization.offload_optimizer.device (and offload_param.device) to cpu or nvme, or use \"static\""),
        (cfg.tensor_parallel.depth != 1 and cfg.tensor_parallel.mode != "2.5d", "tensor_parallel.depth",
         cfg.tensor_parallel.depth, f"is the number of grids of mode \"2.5d\", and the mode is "
         f"\"{cfg.tensor_parallel.mode}\"; remove it, or set mode \"2.5d\""),
        (grid_problem is not None, "tensor_parallel.size", cfg.tensor_parallel.size, grid_problem),
        (cfg.memory.budget_bytes("device_margin") is not None and zero.placement != "auto", "memory.device_margin",
         cfg.memory.device_margin, "is the device memory placement \"auto\" keeps free, and placement is "
         "\"static\"; set zero_optimization.placement to \"auto\", or remove the key"),
        (cfg.memory.device_budget is not None and zero.offload_optimizer.device not in OFFLOADED,
         "memory.device_budget", cfg.memory.device_budget, "caps the chunks the chunk manager pages onto the device, "
         "and nothing is offloaded; set zero_optimization.offload_optimizer.device (and offload_param.device) to cpu "
         "or nvme, or remove the key"),
        (cfg.memory.budget_bytes("cpu_budget") is not None and zero.offload_optimizer.device not in OFFLOADED,
         "memory.cpu_budget", cfg.memory.cpu_budget, "a CPU budget without optimizer offload is not supported yet "
         "(in this release it caps the offloaded optimizer states only); set "
         "zero_optimization.offload_optimizer.device, or remove the key"),
    ]
    ac, tp = cfg.activation_checkpointing, cfg.tensor_parallel
    checks += [
        (ac.modules is not None and not ac.enabled, "activation_checkpointing.modules", ac.modules,
         "selects the modules checkpointed when enabled is true, and enabled is false; set \"enabled\": true, or "
         "remove modules"),
        (ac.modules == [], "activation_checkpointing.modules", ac.modules,
         "an empty list selects no module; name class names or module-name globs, or remove the key for the "
         "model's blocks"),
        (ac.every_n != 1 and not ac.enabled, "activation_checkpointing.every_n", ac.every_n,
         "thins out the modules checkpointed when enabled is true, and enabled is false; set \"enabled\": true, "
         "or remove every_n"),
        (ac.partition_activations and tp.size == 1, "activation_checkpointing.partition_activations", True,
         "splits a checkpoint's saved inputs over the tensor-parallel ranks, and tensor_parallel.size is 1; set "
         "tensor_parallel.size to 2 or more, or set it to false"),
        (ac.partition_activations and tp.mode != "1d" and tp.size > 1, "activation_checkpointing.partition_activations",
         True, f"splits inputs that every tensor-parallel rank holds whole; under mode \"{tp.mode}\" each rank holds "
         "its own block of the activations already; set it to false"),
        (ac.partition_activations and tp.sequence_parallel and tp.size > 1,
         "activation_checkpointing.partition_activations", True, "splits inputs that every tensor-parallel rank holds "
         "whole; under tensor_parallel.sequence_parallel each rank holds its own part of the sequence already; set "
         "it to false"),
        (ac.contiguous_memory_optimization, "activation_checkpointing.contiguous_memory_optimization", True,
         "copying saved inputs into one preallocated buffer is not supported yet; set it to false"),
    ]
    checks += _pipeline_checks(cfg)
    checks += _bf16_master_checks(cfg)
    checks += _layer_major_checks(cfg)
    sp = cfg.sequence_parallel
    checks += [
        (tp.sequence_parallel and tp.size == 1, "tensor_parallel.sequence_parallel", True,
         "splits the activations between the tensor-parallel layers over the tensor-parallel ranks, and "
         "tensor_parallel.size is 1; set the size to 2 or more, or use the top-level sequence_parallel (Ulysses, "
         "ring) without tensor parallelism"),
        (tp.sequence_parallel and tp.mode != "1d", "tensor_parallel.sequence_parallel", True,
         f"is for mode \"1d\"; under mode \"{tp.mode}\" every activation is split over the mesh already; set it to "
         "false"),
        (sp.enabled and tp.size > 1 and tp.mode != "1d", "sequence_parallel.size", sp.size,
         f"sequence parallelism with {tp.mode.upper()} tensor parallelism is not built yet; use tensor_parallel.mode "
         "\"1d\" with it"),
        (cfg.moe.expert_parallel_size > 1 and tp.size > 1 and tp.mode != "1d", "moe.expert_parallel_size",
         cfg.moe.expert_parallel_size, f"expert parallelism with {tp.mode.upper()} tensor parallelism is not built "
         "yet (each rank holds a block of the activations, and the router needs whole tokens); use "
         "tensor_parallel.mode \"1d\""),
        (cfg.moe.expert_parallel_size > 1 and tp.size > 1 and tp.sequence_parallel, "moe.expert_parallel_size",
         cfg.moe.expert_parallel_size, "expert parallelism with tensor_parallel.sequence_parallel is not built yet "
         "(each tp rank would route its own part of the sequence, and the experts' gradients would differ over the "
         "tp ranks holding them); set tensor_parallel.sequence_parallel to false, or use the top-level "
         "sequence_parallel (Ulysses, ring) with it"),
        (sp.enabled and tp.sequence_parallel, "sequence_parallel.size", sp.size,
         "Ulysses or ring over the sequence together with tensor_parallel.sequence_parallel (Megatron's) is not "
         "built; use one of them"),
    ]
    for failed, key, value, why in checks:
        if failed:
            raise ConfigError(f"{key}: {json.dumps(value)} — {why}.")


PARTITIONS = ("parameters", "uniform", "time")
# what Tiers' tiled Adam steps (Note [bf16 master weights], [block-wise optimizer states])
LOW_BIT = ("AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit")
TILED_ADAM = ("Adam", "AdamW", *LOW_BIT)


def tiled_bf16_masters(cfg: Config) -> bool:
    """bf16 masters that Tiers' tiled Adam steps: with fp32 moments, or rounded stochastically."""
    bf16 = cfg.bf16
    return bf16.bf16_master_weights_and_grads and (bf16.stochastic_rounding or not bf16.bf16_optimizer_states)


def _bf16_master_checks(cfg: Config) -> list[tuple[bool, str, object, str]]:
    """DeepSpeed's rules for its low-precision masters (Note [bf16 master weights]), and Tiers' for stochastic
    rounding."""
    bf16, zero, opt = cfg.bf16, cfg.zero_optimization, cfg.optimizer
    masters = bf16.bf16_master_weights_and_grads
    checks = [
        (masters and not bf16.enabled, "bf16.bf16_master_weights_and_grads", True,
         "keeps the master weights of a model trained in bf16, and bf16.enabled is false; set bf16.enabled to true"),
        (masters and zero.stage == 0, "bf16.bf16_master_weights_and_grads", True,
         "needs ZeRO stage 1-3, as in DeepSpeed; set zero_optimization.stage to 1, 2 or 3"),
        (bf16.bf16_optimizer_states and not masters, "bf16.bf16_optimizer_states", True,
         "keeps the moments of bf16 master weights, as in DeepSpeed; set bf16.bf16_master_weights_and_grads to true"),
        (bf16.stochastic_rounding and not masters, "bf16.stochastic_rounding", True,
         "rounds bf16 master weights as they are updated, and the masters are fp32; set "
         "bf16.bf16_master_weights_and_grads to true"),
        (masters and not bf16.bf16_optimizer_states and zero.offload_optimizer.device not in OFFLOADED
         and (opt is None or opt.type not in LOW_BIT),
         "bf16.bf16_optimizer_states", False, "fp32 moments beside bf16 master weights are stepped on the offloaded "
         "states, as in DeepSpeed (its CPU Adam); set zero_optimization.offload_optimizer.device to cpu or nvme, or "
         "bf16.bf16_optimizer_states to true"),
    ]
    low_bit = opt is not None and opt.type in LOW_BIT
    checks += [
        (low_bit and cfg.tensor_parallel.size > 1, "optimizer.type", opt and opt.type, "block-wise states of "
         "tensor-parallel slices are not built yet (a checkpoint joins each state's slices whole); use Adam or AdamW "
         "with tensor parallelism"),
        (low_bit and cfg.moe.expert_parallel_size > 1, "optimizer.type", opt and opt.type, "block-wise states of "
         "expert-parallel experts are not built yet; use Adam or AdamW with expert parallelism"),
    ]
    checks.append((low_bit and cfg.pipeline.enabled, "optimizer.type", opt and opt.type, "block-wise states with "
                   "pipeline parallelism are not built yet (each stage would record its own state names in a "
                   "checkpoint); use Adam or AdamW with pipeline stages"))
    if opt is not None and tiled_bf16_masters(cfg):
        why = ("fp32 moments" if not bf16.bf16_optimizer_states else "stochastic rounding") + " of bf16 masters"
        checks.append((opt.type not in TILED_ADAM, "optimizer.type", opt.type,
                       f"{why} are stepped by Tiers' tiled Adam; use Adam, AdamW or a low-bit AdamW, or "
                       "bf16.bf16_optimizer_states without stochastic_rounding"))
    checks.append((masters and opt is not None and opt.type in ("Adam", "AdamW")
                   and not opt.params.get("bias_correction", True), "optimizer.params.bias_correction", False,
                   "bf16 masters are stepped by Tiers' tiled Adam, which corrects the bias; remove the key"))
    return checks


def _layer_major_checks(cfg: Config) -> list[tuple[bool, str, object, str]]:
    """Note [layer-major accumulation]: what running a step's micro-batches block by block needs."""
    zero, key = cfg.zero_optimization, "zero_optimization.offload_param.layer_major"
    if not zero.offload_param.layer_major:
        return []
    others = [name for name, on in (("pipeline", cfg.pipeline.enabled), ("tensor", cfg.tensor_parallel.size > 1),
                                    ("sequence", cfg.sequence_parallel.enabled),
                                    ("expert", cfg.moe.expert_parallel_size > 1)) if on]
    return [
        (zero.stage != 3 or zero.offload_param.device not in OFFLOADED, key, True,
         "saves reads of offloaded parameters, which exist under ZeRO stage 3 with offload_param.device cpu or nvme "
         f"(this run: stage {zero.stage}, offload_param.device {json.dumps(zero.offload_param.device)}); set both, "
         "or remove layer_major"),
        (bool(others), key, True, f"running micro-batches block by block with {' or '.join(others)} parallelism is "
         "not built yet; remove layer_major"),
    ]


def _pipeline_checks(cfg: Config) -> list[tuple[bool, str, object, str]]:
    """Note [pipeline stages of an unmodified model]: what a pipeline config alone rules out."""
    pp = cfg.pipeline
    partition_ok = (pp.partition in PARTITIONS if isinstance(pp.partition, str)
                    else all(isinstance(name, str) for name in pp.partition))
    return [
        (pp.schedule == "interleaved" and pp.virtual_stages < 2 and pp.enabled, "pipeline.virtual_stages",
         pp.virtual_stages, "schedule \"interleaved\" runs 2 or more stages per rank; set virtual_stages to 2 or "
         "more, or use schedule \"1f1b\""),
        (pp.schedule != "interleaved" and pp.virtual_stages != 1, "pipeline.virtual_stages", pp.virtual_stages,
         f"only schedule \"interleaved\" runs several stages per rank (this config: \"{pp.schedule}\"); set "
         "schedule to \"interleaved\", or virtual_stages to 1"),
        (not partition_ok, "pipeline.partition", pp.partition,
         f"is one of {', '.join(PARTITIONS)}, or a list of the module names that start each stage"),
        (pp.enabled and cfg.tensor_parallel.size > 1 and cfg.tensor_parallel.mode != "1d", "tensor_parallel.mode",
         cfg.tensor_parallel.mode, f"{cfg.tensor_parallel.mode.upper()} tensor parallelism inside a pipeline stage is "
         "not built yet; use mode \"1d\" with pipeline.stages > 1"),
    ]


def _grid_problem(cfg: Config) -> str | None:
    """Why tensor_parallel.size does not make its mode's grid (Note [tensor-parallel grids]); None: it does."""
    tp = cfg.tensor_parallel
    return tp_grid_problem(tp.size, tp.mode, tp.depth) if tp.depth == 1 or tp.mode == "2.5d" else None


def check_run(cfg: Config, mesh: Mesh, *, optimizer=None, lr_scheduler=None, model_parameters=None,
              built_under_zero_init: bool = False) -> None:
    """What `cfg` rules out for this run (after check_client_objects, which needs no process group): the batch
    sizes over these ranks, the layout, offloading, a client optimizer rebuilt over shards."""
    cfg.batch_sizes(mesh.dp.size)  # raises when the batch sizes do not add up over these ranks
    if cfg.pipeline.enabled:
        _check_pipeline_run(cfg, mesh, built_under_zero_init)
    if mesh.tp.size > 1:
        _check_tensor_parallel(optimizer, model_parameters, built_under_zero_init)
    _check_step_in_backward(cfg, mesh)
    check_quantize_frozen(cfg, mesh)
    if cfg.moe.enabled and built_under_zero_init:
        raise ConfigError("moe.expert_parallel_size: building the model under zero_init() is not supported yet with "
                          "expert parallelism; build it normally (each rank keeps only its experts after initialize)")
    check_offload(cfg, mesh.zero.size, optimizer)
    sharded = cfg.zero_optimization.stage >= 1 and mesh.zero.size > 1
    rebuilt = sharded or cfg.bf16.enabled or cfg.fp16.enabled or built_under_zero_init or cfg.pipeline.enabled
    if optimizer is not None and rebuilt:
        _check_client_optimizer_rebuild(optimizer, lr_scheduler, cfg.pipeline.enabled)


def _check_pipeline_run(cfg: Config, mesh: Mesh, built_under_zero_init: bool) -> None:
    pp = cfg.pipeline
    accumulation = cfg.batch_sizes(mesh.dp.size).gradient_accumulation_steps
    if pp.schedule == "interleaved" and accumulation % pp.stages:
        raise ConfigError(f"gradient_accumulation_steps: {accumulation} — schedule \"interleaved\" runs the "
                          f"micro-batches in rounds of pipeline.stages ({pp.stages}); use a multiple of {pp.stages}")
    if built_under_zero_init and pp.partition == "time":
        raise ConfigError("pipeline.partition: \"time\" — measures each block's forward on the whole model, and a "
                          "model built under zero_init() has no parameter values before initialize() builds its "
                          "stages'; use \"parameters\" or \"uniform\", or name the stages' first blocks")


def _optional_needs(cfg: Config) -> list[tuple[str, str, Callable[[], object]]]:
    """(the key that needs it, the module, what imports it and names the install) per optional package `cfg` uses."""
    from engine.optimizers.blockwise_states import import_torchao
    from engine.optimizers.params import LOW_BIT_OPTIMIZERS
    from engine.zero.int8_frozen import import_primitives

    needs = []
    if cfg.optimizer is not None and cfg.optimizer.type in LOW_BIT_OPTIMIZERS:
        needs.append((f"optimizer.type: {json.dumps(cfg.optimizer.type)}", "torchao.optim", import_torchao))
    if cfg.zero_optimization.quantize_frozen == "int8":
        needs.append(('zero_optimization.quantize_frozen: "int8"', "torchao.quantization.quant_primitives",
                      import_primitives))
    return needs


def optional_packages(cfg: Config) -> tuple[str, ...]:
    """The optional modules a run of `cfg` imports (the estimate's runtime probe imports them too)."""
    return tuple(module for _, module, _ in _optional_needs(cfg))


def check_packages(cfg: Config) -> None:
    """The optional packages `cfg` trains with, imported now: a missing one is named at initialize, before anything
    is built, not inside the first step (where step_in_backward would already have updated some shards)."""
    for key, _, load in _optional_needs(cfg):
        try:
            load()
        except ImportError as e:
            raise ConfigError(f"{key} needs a package this environment lacks ({e.__cause__ or e}): {e}") from e


def check_client_objects(cfg: Config, optimizer=None, lr_scheduler=None, model_parameters=None) -> None:
    """The optimizer, scheduler and parameters passed to initialize(), against the config's sections."""
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer: given both in the config and as initialize(optimizer=...); keep one")
    if optimizer is None and cfg.optimizer is None:
        raise ConfigError("optimizer: missing; "
                          "add an 'optimizer' section to the config or pass initialize(optimizer=...)")
    if optimizer is not None and tiled_bf16_masters(cfg):
        raise ConfigError("optimizer: bf16 masters with fp32 moments or stochastic rounding are stepped by Tiers' "
                          "tiled Adam (Note [bf16 master weights]), built from the config; give an optimizer section "
                          "(Adam or AdamW) instead of initialize(optimizer=...)")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler: given both in the config and as initialize(lr_scheduler=...); keep one")
    bound = getattr(lr_scheduler, "optimizer", None) if hasattr(lr_scheduler, "step") else None
    if bound is not None and bound is not optimizer:
        raise ConfigError("lr_scheduler: the scheduler object drives the optimizer it was built on, which is not the "
                          "one the engine steps (" + ("the config's" if optimizer is None else "the one passed") +
                          "); build it on the optimizer passed to initialize, or pass a callable that takes the "
                          "engine's optimizer (e.g. lambda opt: LambdaLR(opt, f))")
    if optimizer is not None and model_parameters is not None:
        raise ValueError("model_parameters is for the config's optimizer; "
                         "a passed optimizer already names its parameters")


def check_loss_fn(cfg: Config, loss_fn) -> None:
    """initialize(loss_fn=...): the loss train_batch takes where a schedule runs the micro-batches."""
    if loss_fn is not None and not (cfg.pipeline.enabled or cfg.zero_optimization.offload_param.layer_major):
        raise ValueError("initialize(loss_fn=...) is the loss train_batch uses under a pipeline config (or "
                         "offload_param.layer_major), and this config has neither; compute the loss yourself and call "
                         "engine.backward(loss)")
    if loss_fn is not None and cfg.pipeline.enabled and cfg.sequence_parallel.enabled:
        raise ValueError("initialize(loss_fn=...) under sequence_parallel would take this rank's part of each "
                         "sequence's output with the whole sequence's labels; pass the labels in the micro-batch "
                         "(e.g. {\"input_ids\": x, \"labels\": y}) so that the model's own loss is split with it")


def check_framework_run(cfg: Config, runner: str, sampler: str, calls: str) -> None:
    """A framework's trainer driving the engine (runner: its name): `sampler` gives every process other samples,
    and `calls` the engine one micro-batch at a time; what neither allows is refused."""
    if cfg.tensor_parallel.size * cfg.pipeline.stages * cfg.sequence_parallel.size > 1:
        raise ValueError(f"{runner} with tensor, pipeline or sequence parallelism is not built yet ({sampler} gives "
                         "every process other samples); train with data parallelism and ZeRO")
    if cfg.zero_optimization.offload_param.layer_major:
        raise ValueError("zero_optimization.offload_param.layer_major needs every micro-batch of a step at once "
                         f"(engine.train_batch), and {calls} one micro-batch at a time; remove it")


def _check_client_optimizer_rebuild(client: torch.optim.Optimizer, lr_scheduler, pipelined: bool) -> None:
    """ZeRO stage >= 1, bf16/fp16 and zero_init point a client optimizer at the shards or masters (a scheduler
    built on it still drives it); pipeline stages rebuild it over the stage's parameters."""
    if pipelined and lr_scheduler is not None and hasattr(lr_scheduler, "step"):
        raise ValueError("under pipeline stages the optimizer passed to initialize() is rebuilt over the stage's "
                         "parameters, so a scheduler built on it would drive the old one; pass lr_scheduler as a "
                         "callable that takes the optimizer (e.g. lambda opt: LambdaLR(opt, f))")
    if client.state:
        raise ValueError(f"the {type(client).__name__} passed to initialize() already holds state, kept for "
                         "whole parameters, while with ZeRO stage >= 1, bf16/fp16 or pipeline stages it steps this "
                         "rank's shards or masters; pass a freshly built optimizer (load states with load_checkpoint)")


def _check_tensor_parallel(optimizer, model_parameters, built_under_zero_init: bool) -> None:
    if optimizer is not None or model_parameters is not None:
        raise ConfigError("tensor_parallel: the plan replaces the model's layers and their parameters, so an optimizer "
                          "or model_parameters built before initialize() would name the old ones; give the optimizer "
                          "in the config's 'optimizer' section (not supported yet with tensor parallelism)")
    if built_under_zero_init:
        raise ConfigError("tensor_parallel: building the model under zero_init() is not supported yet with tensor "
                          "parallelism; build it normally (each rank then keeps only its shards after initialize)")


def check_offload(cfg: Config, dp_world_size: int, optimizer=None) -> None:
    """What offloading needs: the config's optimizer, stepping where parameter shards live (stage 3 over 2 or
    more ranks, fp32), one swap directory."""
    zero = cfg.zero_optimization
    offload, offload_param = zero.offload_optimizer, zero.offload_param
    if offload_param.device in OFFLOADED and (optimizer is not None or offload.device not in OFFLOADED):
        raise ConfigError("zero_optimization.offload_param: offloaded parameter shards are stepped by the offloaded "
                          "optimizer where they live; "
                          "also set zero_optimization.offload_optimizer.device (cpu or nvme) "
                          "and give the optimizer in the config's 'optimizer' section")
    if optimizer is not None and offload.device in OFFLOADED:
        raise ConfigError("zero_optimization.offload_optimizer: offloading a client optimizer's states is not "
                          "supported yet; give the optimizer in the config's 'optimizer' section instead")
    if offload_param.device not in OFFLOADED:
        return
    if offload.device == "nvme" == offload_param.device and offload_param.nvme_path != offload.nvme_path:
        raise ConfigError("zero_optimization.offload_param.nvme_path: Tiers keeps parameter shards and optimizer "
                          "states in one swap directory; give both the same nvme_path")


def check_quantize_frozen(cfg: Config, mesh: Mesh) -> None:
    """Note [int8 frozen chunks]: int8 chunks are gathered around their use, so stage 3; on one mesh axis."""
    zero = cfg.zero_optimization
    if zero.quantize_frozen == "none":
        return
    key = f"zero_optimization.quantize_frozen: \"{zero.quantize_frozen}\""
    if zero.stage != 3:
        raise ConfigError(f"{key} keeps frozen weights as int8 and dequantizes them when gathered, which needs "
                          f"ZeRO stage 3 (this run: stage {zero.stage}); set stage 3, or remove quantize_frozen")
    parallel = [name for name, size in (("tensor", mesh.tp.size), ("pipeline", mesh.pp.size),
                                        ("expert", mesh.ep.size)) if size > 1]
    if parallel:
        raise ConfigError(f"{key} is not built yet with {' or '.join(parallel)} parallelism; train with data "
                          "parallelism (and sequence parallelism), or remove quantize_frozen")


def _check_step_in_backward(cfg: Config, mesh: Mesh) -> None:
    """Note [stepping in backward]: what updating each gradient shard as soon as it is reduced needs."""
    zero = cfg.zero_optimization
    if not zero.offload_optimizer.step_in_backward:
        return
    key = "zero_optimization.offload_optimizer.step_in_backward"
    if zero.offload_optimizer.device not in OFFLOADED:
        raise ConfigError(f"{key}: steps the offloaded optimizer; set zero_optimization.offload_optimizer.device to "
                          "cpu or nvme, or remove step_in_backward")
    if cfg.pipeline.enabled:
        raise ConfigError(f"{key}: a pipeline schedule accumulates every micro-batch's gradients before the step, so "
                          "no shard is ready during a backward; remove step_in_backward with pipeline.stages > 1")
    if zero.stage < 2:  # an offloaded optimizer keeps gradient shards from stage 2, in one process too
        raise ConfigError(f"{key}: needs gradient shards, i.e. ZeRO stage 2 or 3 (this run: stage {zero.stage}); "
                          "set stage 2 or 3, or remove step_in_backward")
    if cfg.fp16.enabled:
        raise ConfigError(f"{key}: fp16 skips a step whose gradients overflow, which is known only once every "
                          "gradient is in, and step_in_backward updates before that; use bf16 (no loss scaling), "
                          "or remove step_in_backward")
    if cfg.bf16.enabled and cfg.bf16.check_grad_overflow:
        raise ConfigError(f"{key}: bf16.check_grad_overflow skips a step whose gradients overflow, which is known only "
                          "once every gradient is in, and step_in_backward updates before that; set "
                          "bf16.check_grad_overflow to false, or remove step_in_backward")
    if cfg.gradient_clipping > 0:
        raise ConfigError(f"{key}: clipping by the global gradient norm needs every gradient before the first "
                          f"update, and step_in_backward updates during backward; set gradient_clipping to 0 "
                          f"(it is {cfg.gradient_clipping}) or remove step_in_backward")
