"""What deepspeed.initialize returns for a PipelineModule: DeepSpeed's PipelineEngine calls over Tiers' pipeline
(Note [a PipelineModule on Tiers' pipeline]).

- the config gets `pipeline.stages` = num_stages and `pipeline.partition` = the module's cut (a config naming other
  stages, another partition or virtual stages is refused naming both), and activation_checkpointing turned on
  where activation_checkpoint_interval > 0;
- train_batch() with no iterator pulls the step's micro-batches from the training_data loader, repeated (a new
  pass is the sampler's next epoch), as DeepSpeed's does; eval_batch(data_iter) needs one, as DeepSpeed's;
- both return the step's mean loss as a tensor, as DeepSpeed's.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.compat.deepspeed.engine import DeepSpeedEngine
from engine.compat.deepspeed.pipe.module import PipelineModule
from engine.compat.deepspeed.utils import RepeatingLoader
from engine.config import Config


def pipeline_config(config, module: PipelineModule):
    """`config` (a dict or a Config) with the pipeline section the module's stages and cut make."""
    if isinstance(config, Config):
        section = {"stages": config.pipeline.stages, "virtual_stages": config.pipeline.virtual_stages,
                   "partition": config.pipeline.partition}
        stages_given = config.pipeline.stages != 1
        partition_given = config.pipeline.partition != "parameters"
    else:
        section = dict(config.get("pipeline") or {})
        stages_given = section.get("stages", "auto") != "auto"
        partition_given = section.get("partition", "best") != "best"
    stages = module.num_pipeline_stages()
    if stages == 1:
        raise ValueError("PipelineModule(num_stages=1): Tiers runs train_batch with two stages or more; for one "
                         "stage, put the layers in an nn.Sequential and call engine(inputs), engine.backward(loss) "
                         "and engine.step() per micro-batch")
    if stages_given and section["stages"] != stages:
        raise ValueError(f"the config's pipeline.stages is {section['stages']} and the PipelineModule's num_stages is "
                         f"{stages}: give the stages in one place (num_stages; leave pipeline.stages out or \"auto\")")
    if partition_given:
        raise ValueError(f"the config's pipeline.partition {section['partition']!r} and the PipelineModule's "
                         "partition_method both say where stages start: give partition_method only (leave "
                         "pipeline.partition out or \"best\")")
    if section.get("virtual_stages", 1) != 1:
        raise ValueError("pipeline.virtual_stages > 1 with a PipelineModule: its cut has num_stages runs of layers, "
                         "one per rank; leave virtual_stages at 1 (or split the layers into more stages)")
    checkpointed = (section.get("activation_checkpoint_interval") or module.activation_checkpoint_interval) > 0
    cut = {"stages": stages, "partition": module.stage_first_blocks()}
    if isinstance(config, Config):
        checkpointing = dataclasses.replace(config.activation_checkpointing, enabled=True) if checkpointed \
            else config.activation_checkpointing
        return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, **cut),
                                   activation_checkpointing=checkpointing)
    made = {**config, "pipeline": {**section, **cut}}
    if checkpointed:
        made["activation_checkpointing"] = {**(config.get("activation_checkpointing") or {}), "enabled": True}
    return made


def engine_loss_fn(module: PipelineModule):
    """The loss train_batch backpropagates: loss_fn(outputs, labels), or, without one, the last layer's output
    itself, as DeepSpeed takes it; the micro-batch is (inputs, labels) either way, and only inputs enter the first
    layer."""
    return module.loss_fn if module.loss_fn is not None else _output_is_the_loss


def _output_is_the_loss(outputs, labels):
    return outputs


class PipelineEngine(DeepSpeedEngine):
    """deepspeed.runtime.pipe.engine.PipelineEngine: train_batch / eval_batch; forward, backward and step per
    micro-batch are refused by the Tiers engine, as DeepSpeed refuses them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._data_iterator = None

    def set_dataiterator(self, iterator) -> None:
        """The iterator train_batch() pulls from when given none (DeepSpeed's)."""
        self._data_iterator = iterator

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One step over gradient_accumulation_steps micro-batches ((inputs, labels) each) from `data_iter`, else
        from the last iterator given (as DeepSpeed, a given one is kept for the next calls), else from the
        training_data loader, repeated; the mean loss over them and the data-parallel ranks."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        loss = self.engine.train_batch(self._training_iterator())
        return torch.tensor(loss, dtype=torch.float32)

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches=None) -> torch.Tensor:
        """The mean loss of gradient_accumulation_steps micro-batches from `data_iter`, in eval mode."""
        if return_logits or not compute_loss or reduce_output != "avg" or not bcast_loss or num_micro_batches:
            from engine.compat.deepspeed.unsupported import refuse

            refuse("eval_batch(return_logits= / compute_loss=False / reduce_output= / bcast_loss=False / "
                   "num_micro_batches=)", "eval_batch(data_iter), which returns the mean loss on every rank")
        return torch.tensor(self.engine.eval_batch(data_iter), dtype=torch.float32)

    def is_first_stage(self) -> bool:
        return self.engine.mesh.pp.rank == 0

    def is_last_stage(self) -> bool:
        return self.engine.mesh.pp.rank == self.engine.mesh.pp.size - 1

    def _training_iterator(self):
        if self._data_iterator is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch() without data_iter pulls from the training data, and "
                                 "deepspeed.initialize got none: pass training_data=... to initialize, or call "
                                 "train_batch(data_iter)")
            self._data_iterator = iter(RepeatingLoader(self.training_dataloader))
        return self._data_iterator
