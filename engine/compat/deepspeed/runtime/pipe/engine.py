"""deepspeed.runtime.pipe.engine: PipelineEngine (engine.compat.deepspeed.pipe.engine)."""

from engine.compat.deepspeed.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
