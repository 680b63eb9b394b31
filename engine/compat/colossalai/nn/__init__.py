"""colossalai.nn: the optimizers (optimizer) and the learning-rate schedulers (lr_scheduler) scripts import."""

from engine.compat.colossalai.nn import lr_scheduler, optimizer

__all__ = ["lr_scheduler", "optimizer"]
