"""deepspeed.pipe: PipelineModule, LayerSpec and TiedLayerSpec over Tiers' pipeline (Note [a PipelineModule on
Tiers' pipeline]); deepspeed.initialize given a PipelineModule returns a PipelineEngine (train_batch, eval_batch)."""

from engine.compat.deepspeed.pipe.engine import PipelineEngine, engine_loss_fn, pipeline_config
from engine.compat.deepspeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "TiedLayerSpec", "engine_loss_fn", "pipeline_config"]
