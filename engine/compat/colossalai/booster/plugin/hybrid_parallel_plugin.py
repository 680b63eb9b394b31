"""HybridParallelPlugin and MoeHybridParallelPlugin: tensor, sequence, expert and pipeline parallelism with ZeRO 0-2
on Tiers' mesh. pp_size > 1 is Tiers' pipeline on the unmodified model (pipeline.stages, Note [pipeline stages of an
unmodified model]), driven by Booster.execute_pipeline: pp_style "1f1b" and "interleaved" (num_model_chunks virtual
stages) are Tiers' schedules of those names, "zbv" its zero-bubble schedule (the same gradients, another order);
num_microbatches (or the batch over microbatch_size) is the step's gradient_accumulation_steps.

sequence_parallelism_mode: "split_gather" is Megatron's sequence parallelism inside tensor parallelism
(tensor_parallel.sequence_parallel), "all_to_all" Ulysses and "ring_attn" ring attention over sp_size ranks
(sequence_parallel.mode); "ring" (split_gather's collectives as a ring around the matmuls) is refused. As in
ColossalAI, enabling sequence parallelism without a mode means "all_to_all".
"""

from __future__ import annotations

from engine.compat.colossalai.booster.plugin.dp_plugin_base import (
    DPPluginBase,
    LossScaling,
    clipping_section,
    precision_section,
    refuse_batch_norm,
    refuse_changed,
)
from engine.compat.colossalai.unsupported import refuse

_SEQUENCE_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")


def _sequence_sections(enabled: bool, mode: str | None, tp_size: int, sp_size: int | None) -> dict:
    if not enabled:
        if sp_size not in (None, 1):
            raise ValueError(f"HybridParallelPlugin(sp_size={sp_size}) needs enable_sequence_parallelism=True")
        return {}
    mode = mode or "all_to_all"
    if mode not in _SEQUENCE_MODES:
        raise ValueError(f"HybridParallelPlugin: sequence_parallelism_mode {mode!r} is one of {_SEQUENCE_MODES}")
    if mode == "ring":
        refuse("HybridParallelPlugin(sequence_parallelism_mode=\"ring\") (Megatron sequence parallelism with ring "
               "collectives around the matmuls)", "use \"split_gather\" (the same split, gathered whole), or "
               "\"ring_attn\" for ring attention")
    if mode == "split_gather":
        if tp_size == 1:
            raise ValueError("HybridParallelPlugin: sequence_parallelism_mode \"split_gather\" splits the sequence "
                             "over the tensor-parallel ranks, and tp_size is 1; set tp_size to 2 or more")
        return {"tensor_parallel": {"sequence_parallel": True}}
    return {"sequence_parallel": {"size": sp_size or 1, "mode": "ulysses" if mode == "all_to_all" else "ring"}}


_SCHEDULES = {"1f1b": "1f1b", "interleaved": "interleaved", "zbv": "zero_bubble"}


def _pipeline(plugin: str, pp_size: int, style: str, chunks: int, count: int | None, size: int | None) -> dict | None:
    """The pipeline section and the micro-batching of pp_size > 1; None without stages."""
    if pp_size == 1:
        return None
    if style not in _SCHEDULES:
        raise ValueError(f"{plugin}: pp_style {style!r} is one of {', '.join(_SCHEDULES)}")
    if (count is None) == (size is None):
        raise ValueError(f"{plugin}(pp_size={pp_size}): give one of num_microbatches and microbatch_size")
    if style != "interleaved" and chunks != 1 and style != "zbv":
        raise ValueError(f"{plugin}: num_model_chunks {chunks} is for pp_style \"interleaved\"")
    section = {"stages": pp_size, "schedule": _SCHEDULES[style]}
    if style == "interleaved":
        section["virtual_stages"] = chunks
    return {"section": section, "num_microbatches": count, "microbatch_size": size}


class HybridParallelPlugin(DPPluginBase):
    """DDP's bucket options and the ShardFormer kernel switches tune what Tiers replaces (its chunk reduction, its
    own layers), so they are accepted and change nothing; arguments that change what is trained are mapped or
    refused."""

    def __init__(self, tp_size: int, pp_size: int, sp_size: int | None = None, precision: str = "fp16",
                 zero_stage: int = 0, enable_all_optimization: bool = False, enable_fused_normalization: bool = False,
                 enable_flash_attention: bool = False, enable_jit_fused: bool = False,
                 enable_sequence_parallelism: bool = False, sequence_parallelism_mode: str | None = None,
                 enable_sequence_overlap: bool = False, parallel_output: bool = True,
                 num_microbatches: int | None = None, microbatch_size: int | None = None,
                 initial_scale: float = 2 ** 16, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2 ** 32, max_norm: float = 0, broadcast_buffers: bool = True,
                 ddp_bucket_cap_mb: int = 25, find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, zero_bucket_size_in_m: int = 12,
                 cpu_offload: bool = False, communication_dtype=None, overlap_communication: bool = True,
                 custom_policy=None, pp_style: str = "1f1b", num_model_chunks: int = 1, scheduler_nodes=None,
                 num_layers_per_stage=None, gradient_checkpoint_config=None, enable_metadata_cache: bool = True,
                 make_vocab_size_divisible_by: int = 64, dp_outside: bool = True, overlap_p2p: bool = True,
                 overlap_allgather: bool = False, fp8_communication: bool = False, use_fp8: bool = False,
                 inner_ring_size: int | None = None):
        given = locals()
        self.pipeline = _pipeline(type(self).__name__, pp_size, pp_style, num_model_chunks, num_microbatches,
                                  microbatch_size)
        refuse_changed(type(self).__name__, given, {
            "custom_policy": None, "gradient_checkpoint_config": None, "communication_dtype": None,
            "fp8_communication": False, "use_fp8": False, "inner_ring_size": None, "broadcast_buffers": True})
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"HybridParallelPlugin: zero_stage {zero_stage} is 0, 1 or 2")
        if cpu_offload and zero_stage == 0:
            raise ValueError("HybridParallelPlugin(cpu_offload=True) offloads the ZeRO optimizer's states; set "
                             "zero_stage to 1 or 2")
        self.sections = _sequence_sections(enable_sequence_parallelism, sequence_parallelism_mode, tp_size, sp_size)
        super().__init__()
        self.tp_size, self.ep_size, self.zero_stage, self.cpu_offload = tp_size, 1, zero_stage, cpu_offload
        self.pp_size = pp_size
        self.sp_size = self.sections.get("sequence_parallel", {}).get("size", 1)
        if self.world_size % (tp_size * self.sp_size * pp_size):
            raise ValueError(f"{type(self).__name__}: tp_size {tp_size} × sp_size {self.sp_size} × pp_size {pp_size} "
                             f"must divide the world size {self.world_size}")
        self.max_norm = max_norm
        scaling = LossScaling(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                              max_scale)
        self.precision = precision_section(type(self).__name__, precision, scaling)

    def support_no_sync(self) -> bool:
        return self.zero_stage != 2

    def check_model(self, model) -> None:
        if self.zero_stage == 0:  # ColossalAI wraps the model in DDP, broadcasting rank 0's buffers every forward
            refuse_batch_norm(type(self).__name__, model, self.data_parallel()[0])

    def data_parallel(self) -> tuple[int, int]:
        """(dp size, this rank's dp place) on Tiers' mesh: pp outermost, then dp, sp, tp (Note [one mesh])."""
        inner = self.tp_size * self.sp_size
        dp = self.world_size // (inner * self.pp_size)
        return dp, self.rank // inner % dp

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    def batch_section(self, batch_size: int | None) -> dict:
        """The batch keys: one micro-batch a step, or the pipeline's micro-batches of the step's batch."""
        if self.pipeline is None:
            return super().batch_section(batch_size)
        count, size = self.pipeline["num_microbatches"], self.pipeline["microbatch_size"]
        if count is None:
            if batch_size is None:
                raise ValueError(f"{type(self).__name__}(microbatch_size={size}): pass the dataloader to boost (its "
                                 "batch size sets the micro-batch count), or give num_microbatches")
            if batch_size % size:
                raise ValueError(f"{type(self).__name__}: the batch size {batch_size} does not split into "
                                 f"micro-batches of {size}")
            count = batch_size // size
        return {"train_micro_batch_size_per_gpu": size or max((batch_size or count) // count, 1),
                "gradient_accumulation_steps": count}

    def tiers_config(self) -> dict:
        zero = {"stage": self.zero_stage}
        if self.cpu_offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"zero_optimization": zero, **self.precision, **clipping_section(self.max_norm)}
        tensor = {"size": self.tp_size, **self.sections.get("tensor_parallel", {})}
        if self.tp_size > 1:
            config["tensor_parallel"] = tensor
        if "sequence_parallel" in self.sections:
            config["sequence_parallel"] = self.sections["sequence_parallel"]
        if self.ep_size > 1:
            config["moe"] = {"expert_parallel_size": self.ep_size}
        if self.pipeline is not None:
            config["pipeline"] = self.pipeline["section"]
        return config


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """ColossalAI's order: ep_size third."""

    def __init__(self, tp_size: int, pp_size: int, ep_size: int, sp_size: int | None = None,
                 moe_dp_outside: bool = True, **kwargs):
        super().__init__(tp_size, pp_size, sp_size, **kwargs)
        dp = self.data_parallel()[0]
        if ep_size < 1 or dp % ep_size:
            raise ValueError(f"MoeHybridParallelPlugin: ep_size {ep_size} must divide the data-parallel size {dp} "
                             "(as in ColossalAI)")
        self.ep_size = ep_size
