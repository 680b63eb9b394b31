"""deepspeed.runtime.pipe: where DeepSpeed defines its pipeline classes (deepspeed.pipe re-exports them)."""

from engine.compat.deepspeed.runtime.pipe import engine, module  # noqa: F401
from engine.compat.deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
