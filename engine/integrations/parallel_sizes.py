"""How a DeepSpeed-style config divides the processes: those that share each sample (tensor, pipeline and sequence
parallelism) and those that see different samples (data parallelism), read from the config's dict before it is
loaded, as a framework's data loader must know them."""

from __future__ import annotations

from engine.config import load_layout_sections


def data_parallel_size(config: dict, world_size: int) -> int:
    """The processes that see different samples: the world over model_parallel_size."""
    parts = model_parallel_size(config)
    if world_size % parts:
        raise ValueError(f"{world_size} processes do not divide into tensor × pipeline × sequence-parallel groups of "
                         f"{parts}; launch a multiple of {parts} processes")
    return world_size // parts


def model_parallel_size(config: dict) -> int:
    """The processes that share each sample: the tensor, pipeline and sequence-parallel sizes, read as load_config
    reads them (Tiers' keys or DeepSpeed's: tensor_parallel.autotp_size, sequence_parallel_size)."""
    cfg = load_layout_sections(config)
    return cfg.tensor_parallel.size * cfg.pipeline.stages * cfg.sequence_parallel.size
