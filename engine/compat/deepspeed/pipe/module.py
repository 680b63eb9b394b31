"""deepspeed.pipe.PipelineModule, LayerSpec and TiedLayerSpec on Tiers' pipeline.

Note [a PipelineModule on Tiers' pipeline]
DeepSpeed's PipelineModule is a list of layers run in order (each layer's output is the next one's
input), cut into num_stages contiguous runs by partition_method; the last stage applies loss_fn to
its output and the micro-batch's labels. Here it is an nn.Module whose forward runs its layers in
that order, each held by a _PipeLayer in the block list `layers` (one class, so Tiers' splitter
finds it: Note [pipeline stages of an unmodified model]). The cut is computed here, as DeepSpeed
computes it from partition_method ("parameters": balanced by trainable parameters, "uniform":
DeepSpeed's equal counts, "type:regex": balanced by the layers whose class name matches), and
handed to deepspeed.initialize as the config's `pipeline.partition` (the names of the blocks that
start each stage) with `pipeline.stages` = num_stages: Tiers' splitter then cuts exactly there.
Every rank builds every layer (LayerSpecs included) in order, so the initial weights are those of
one process building the whole list; the split then keeps each rank's stages only.
A TiedLayerSpec's module is built once per key and held by every block that uses it: within a
stage that is one module, across stages Tiers' shared parameters (held by both ranks, started from
the lowest one's values, gradients summed before each update) are DeepSpeed's tied weights. As
DeepSpeed ties only `tied_weight_attr` across stages, a tied module with other parameters used on
two stages is refused (DeepSpeed would keep those per stage).
activation_checkpoint_interval > 0 (the module's, or the config's pipeline section's, which wins as in
DeepSpeed) turns on the config's activation_checkpointing: Tiers checkpoints each layer on its own
where DeepSpeed checkpoints runs of `interval` layers (the same training, other memory figures).
Only one tensor crosses a stage boundary in Tiers' pipeline: a stage whose last layer returns a
tuple is refused at its first forward, naming the layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.compat.deepspeed.runtime.utils import set_random_seed
from engine.compat.deepspeed.unsupported import refuse
from engine.pipeline.partition import balanced_starts

LIST_NAME = "layers"


class LayerSpec:
    """A layer built later, as `typename(*module_args, **module_kwargs)`."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec of the same key (an embedding and the output head);
    forward_fn(module, inputs), when given, is called in place of the module's forward."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class _PipeLayer(nn.Module):
    """One entry of the layer list: a module, a tied module with its forward_fn, or a plain function."""

    def __init__(self, index: int, module: nn.Module | None, function=None):
        super().__init__()
        self.index, self.layer, self.function = index, module, function
        self.sends_on = False  # the last layer of a stage before the last: its output crosses to the next rank

    def forward(self, x):
        if self.function is not None:
            out = self.function(self.layer, x) if self.layer is not None else self.function(x)
        else:
            out = self.layer(x)
        if self.sends_on and not torch.is_tensor(out):
            raise ValueError(f"PipelineModule layer {self.index} ends a pipeline stage and returned "
                             f"{type(out).__name__}; Tiers' pipeline sends one tensor between stages: make the layers "
                             "at stage boundaries return a tensor, or choose a partition_method that cuts elsewhere")
        return out


@dataclass(frozen=True)
class _SeedState:
    """seed_layers: each layer built after seeding base_seed + its index; each forward reseeds per micro-batch."""

    enabled: bool
    base_seed: int
    seed_fn: object


class PipelineModule(nn.Module):
    """Note [a PipelineModule on Tiers' pipeline]."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=None, checkpointable_layers=None, dynamic_shape=False):
        super().__init__()
        if topology is not None:
            refuse("PipelineModule(topology=...)", "PipelineModule(num_stages=N): Tiers lays out the pipeline and "
                   "data-parallel ranks itself (tensor_parallel in the config for model parallelism)")
        if num_stages is None:
            raise RuntimeError("must provide num_stages or topology")
        if activation_checkpoint_func is not None or checkpointable_layers is not None:
            refuse("PipelineModule(activation_checkpoint_func= / checkpointable_layers=)",
                   "the config's activation_checkpointing section (`modules` names what to checkpoint)")
        self.num_stages = int(num_stages)
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.seed = _SeedState(bool(seed_layers), int(base_seed), seed_fn)
        self.micro_offset = [0]  # a list: every stage's view of this module counts the same forwards
        specs = list(layers)
        if not specs:
            raise ValueError("PipelineModule(layers=[]): give at least num_stages layers")
        self._tied_specs: dict[object, list[int]] = {}
        self.layers = nn.ModuleList(self._build(i, spec) for i, spec in enumerate(specs))
        self.loss_fn = loss_fn  # after the layers: a loss module with parameters belongs to the last stage
        self.parts = _partition(specs, self.layers, self.num_stages, str(partition_method))
        for stage in range(self.num_stages - 1):
            self.layers[self.parts[stage + 1] - 1].sends_on = True
        self._check_ties(specs)

    def _build(self, index: int, spec) -> _PipeLayer:
        if isinstance(spec, PipelineModule):
            raise NotImplementedError("PipelineModule inside a PipelineModule: give its layers instead")
        if self.seed.enabled and isinstance(spec, (LayerSpec, nn.Module)):
            self._reseed(self.seed.base_seed + index)
        if isinstance(spec, TiedLayerSpec):
            modules = self.__dict__.setdefault("_tied_modules", {})
            if spec.key not in modules:
                modules[spec.key] = spec.build()
            self._tied_specs.setdefault(spec.key, []).append(index)
            return _PipeLayer(index, modules[spec.key], spec.forward_fn)
        if isinstance(spec, LayerSpec):
            return _PipeLayer(index, spec.build())
        if isinstance(spec, nn.Module):
            return _PipeLayer(index, spec)
        if callable(spec):
            return _PipeLayer(index, None, spec)
        raise TypeError(f"PipelineModule layer {index}: {type(spec).__name__} is not an nn.Module, a LayerSpec or a "
                        "callable")

    def _check_ties(self, specs: list) -> None:
        """A tied module on two stages shares all its parameters here; DeepSpeed ties only tied_weight_attr."""
        for key, indices in self._tied_specs.items():
            stages = {self.stage_owner(i) for i in indices}
            spec = specs[indices[0]]
            module = self.__dict__["_tied_modules"][key]
            untied = [n for n, _ in module.named_parameters() if n not in spec.tied_weight_attr]
            if len(stages) > 1 and untied:
                refuse(f"TiedLayerSpec {key!r} on stages {sorted(stages)} with parameters {untied} not in "
                       f"tied_weight_attr {spec.tied_weight_attr} (DeepSpeed keeps those apart per stage)",
                       "tied_weight_attr naming every parameter of the tied module, or a partition_method that puts "
                       "its uses on one stage")

    def _reseed(self, seed: int) -> None:
        (self.seed.seed_fn or set_random_seed)(seed)

    def forward(self, *inputs):
        """The layers in order, each taking the previous one's output (one input unwrapped, several a tuple)."""
        x = inputs[0] if len(inputs) == 1 else inputs
        self.micro_offset[0] += 1
        offset = self.micro_offset[0] + 1
        for block in self.layers:
            if self.seed.enabled:  # DeepSpeed's per-micro-batch seed for each layer's randomness (dropout)
                self._reseed(self.seed.base_seed * offset + _index_of(block))
            x = block(x)
        return x

    # ---- DeepSpeed's queries --------------------------------------------------------------------
    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer {layer_idx} of {len(self.layers)}")
        return max(s for s in range(self.num_stages) if self.parts[s] <= layer_idx)

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_first_blocks(self) -> list[str]:
        """The names of the blocks starting each stage: the config's pipeline.partition for this cut."""
        return [f"{LIST_NAME}.{start}" for start in self.parts[:-1]]

    def topology(self):
        refuse("PipelineModule.topology()", "engine.mesh (Tiers' ranks: mesh.pp.rank, mesh.dp.rank, ...)")


def _index_of(block: nn.Module) -> int:
    """A block's index in the whole layer list (a stage's first and last blocks are wrapped by the split)."""
    return next(m.index for m in block.modules() if isinstance(m, _PipeLayer))


def _partition(specs: list, layers: nn.ModuleList, stages: int, method: str) -> list[int]:
    """The first layer of each stage, then the layer count (DeepSpeed's `parts`)."""
    count = len(specs)
    if stages > count:
        raise ValueError(f"PipelineModule: {stages} stages need at least {stages} layers, and there are {count}; "
                         "use fewer num_stages")
    lowered = method.lower()
    if lowered == "uniform":
        size, extra = divmod(count, stages)
        return [s * size + min(s, extra) for s in range(stages)] + [count]
    if lowered == "parameters":
        weights = [float(sum(p.numel() for p in layer.parameters() if p.requires_grad)) for layer in layers]
    elif lowered.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1.0 if pattern.search(_type_name(spec)) else 0.0 for spec in specs]
        if not any(weights):
            raise RuntimeError(f"Partitioning '{method}' found no valid layers to partition.")
    else:
        raise NotImplementedError(f"Partitioning method {method} not implemented: use \"parameters\", \"uniform\" or "
                                  "\"type:<regex>\"")
    return balanced_starts(weights, stages) + [count]


def _type_name(spec) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", "")
