"""Whole parameters that meet the splits of a plan the user gave (Note [partial gradients under a given plan]).

Note [partial gradients under a given plan]
A plan given as {glob: style}, or a built-in plan named for a model of another class, splits what it names,
and the whole parameters downstream can meet those splits just as under a derived plan (Note [partial
gradients of whole parameters]): Qwen3's per-head q/k norms under the Llama-shaped plan that splits q_proj
and k_proj by columns. Each rank would step its own part of such a parameter's gradient, silently. So the
forward is traced on fake tensors as for a derived plan, with the given styles held fixed instead of chosen
(every nn.Linear, Conv1D and nn.Embedding, subclasses included, is one op: the plan replaces what it names
whatever its class), and the same pass follows the splits:
- a parameter that meets a split only gets its gradient summed over the tp group (PartialGradientSum);
- a parameter that meets a split and has a whole use too, or a whole tensor a gradient flows through that
  meets a split (a gate computed from the hidden state), cannot be summed right: refused, naming both.
Where the split reaches an op the rules do not know, the user's plan is trusted there and the pass loses the
split from that op on. A forward that cannot run on fake tensors is not checked, and says so.
Under Megatron sequence parallelism every replicated parameter's gradient is summed already
(engine/tensor_parallel/sequence_1d.py).
"""

from __future__ import annotations

import fnmatch
import warnings

from torch import nn

from engine.tensor_parallel.derive import layers_of, traced
from engine.tensor_parallel.derive.propagate import Decisions, Propagation
from engine.tensor_parallel.derive.rules import Blocked, Split
from engine.tensor_parallel.derive.trace import module_kind

SPLITS_OUTPUT = ("colwise", "colwise_qkv")


def replaceable_kind(module: nn.Module) -> str | None:
    """What a plan's style can replace: a layer a derivation would, or any subclass of one."""
    if module_kind(module) is not None:
        return module_kind(module)
    conv1d = type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and module.weight.dim() == 2
    if isinstance(module, nn.Linear) or conv1d:
        return "linear"
    return "embedding" if isinstance(module, nn.Embedding) else None


class GivenPropagation(Propagation):
    """One pass that follows the given styles instead of trying them."""

    def __init__(self, trace, layers, tp, styles: dict[str, str], params):
        super().__init__(trace, layers, tp, Decisions(), params)
        self.styles = styles

    def _module(self, op, ins):
        name, inp = op.module, op.args[0]
        state = ins.get(inp.id)
        style = self.styles.get(name)
        if state is not None and style != "rowwise":
            raise Blocked(state.sources, f"{name!r} ({style or 'whole'}) takes it whole")
        if style in SPLITS_OUTPUT:
            return [Split(len(op.outputs[0].shape) - 1, frozenset([name]))]
        return [None]


def partial_gradients_of(model: nn.Module, styles: dict[str, str], tp: int) -> tuple[str, ...]:
    """The names of the whole parameters whose gradient each tp rank computes a part of under the 1D plan
    `styles` ({glob: style}); raises where no sum makes the gradient right."""
    try:
        model_copy = traced(model, replaceable_kind)
        copy, whole = model_copy.copy, model_copy.whole
    except ValueError as error:
        warnings.warn(f"tensor_parallel.plan: {type(model).__name__}'s forward does not run on fake tensors "
                      f"({error.__cause__}), so whether whole parameters meet the plan's splits is not checked "
                      "(Note [partial gradients under a given plan])", stacklevel=3)
        return ()
    layers = layers_of(copy, replaceable_kind)
    named = {name: style for name in layers
             if (style := next((s for g, s in styles.items() if fnmatch.fnmatchcase(name, g)), None)) is not None}
    result = GivenPropagation(whole, layers, tp, named, frozenset(id(p) for p in copy.parameters())).run()
    names = {id(p): n for n, p in copy.named_parameters()}
    owned = {pid for name in named for pid in layers[name].params if named[name] != "replicate"}
    for blocked, module in result.blocked.values():
        if blocked.kind == "gradient":
            raise ValueError(f"tensor_parallel.plan: in {module!r}, {blocked.reason}: the gradient into the whole "
                             f"tensor would be each rank's part of it, from the split of "
                             f"{', '.join(sorted(blocked.sources))}; leave those layers whole (\"replicate\")")
    for pid in sorted(result.partial.keys() & result.whole_use - owned, key=names.get):
        raise ValueError(f"tensor_parallel.plan: parameter {names[pid]!r} meets activations split by "
                         f"{', '.join(sorted(result.partial[pid]))} and is also used on whole ones, so its gradient is "
                         f"neither whole nor a sum of the ranks' parts; leave those layers whole (\"replicate\")")
    return tuple(sorted(names[pid] for pid in result.partial.keys() - owned))
