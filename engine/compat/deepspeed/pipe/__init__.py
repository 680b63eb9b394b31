"""deepspeed.pipe: PipelineModule, LayerSpec and TiedLayerSpec are refused by name. Tiers splits an unmodified
model into stages from the config's `pipeline` section instead (docs/parallelism.md), which a PipelineModule's
list of layers does not map onto without changing what the script's model is."""

from engine.compat.deepspeed.unsupported import refuse


class _Refused:
    def __init__(self, *args, **kwargs):
        refuse(f"deepspeed.pipe.{type(self).__name__}", "an unmodified nn.Module with the config's `pipeline` "
               "section (stages, partition, schedule) and engine.train_batch(data_iter)")


class PipelineModule(_Refused):
    pass


class LayerSpec(_Refused):
    pass


class TiedLayerSpec(_Refused):
    pass
