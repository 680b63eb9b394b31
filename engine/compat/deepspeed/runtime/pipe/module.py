"""deepspeed.runtime.pipe.module: PipelineModule, LayerSpec, TiedLayerSpec (engine.compat.deepspeed.pipe.module)."""

from engine.compat.deepspeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
