"""Tensor-parallel plans derived from the model's own forward.

Note [derived tensor-parallel plans]
`tensor_parallel.plan: "auto"` on a model with no built-in plan (and DeepSpeed's
`tensor_parallel.autotp_size`) derives one, in four steps, all on a copy of the model whose parameters
are fake tensors (no memory, no compute; engine/tensor_parallel/derive/trace.py):
1. Trace: one forward in training mode on an example input (token ids for a model with an embedding,
   else one tensor for its first linear layer), recording every op. Layers a plan can replace are one
   op each: exactly nn.Linear, Conv1D and nn.Embedding with nothing but weight and bias (a subclass
   may compute something else, so its own ops are traced and it stays whole).
2. Propagate (propagate.py, rules.py): a linear layer whose input is whole is tried column-parallel,
   its output split along the features; the rules carry the split through the ops between layers:
   elementwise ops, reshapes that keep it on an outer dim (features -> heads, heads -> features),
   transposes, attention and matmuls over the heads, splits of a fused output into equal parts
   (q, k, v: "colwise_qkv"). A linear layer that receives it is row-parallel. Where a split reaches an
   op that needs the whole tensor (a norm over the features, the residual add, an op the rules do not
   know), the layer that made it is left whole, or gathered where that op is the loss or the model's
   output (the lm_head); the pass then runs again, until nothing moves. Embeddings of the input ids are
   vocabulary-parallel; a layer whose parameters another op or layer reads (a tied weight used by
   hand), or another module also holds, and tied layers whose styles would shard differently are left
   whole. Arguments of a form the rules do not read stop the split too.
3. Check: the same forward on the copy with each planned layer replaced by one of its per-rank shape
   must run the same ops, produce the whole trace's shapes with every split dim divided by tp, and
   pass the same scalar arguments (or a size divided by tp): a scale computed from a per-rank width
   (`h / math.sqrt(h.shape[-1])`) shows in no shape but in those. A forward that
   takes a width from an attribute (`view(B, T, self.n_head, D)`, `split(self.n_embd)`) fails that;
   so the attributes of the modules doing split work whose values equal a split size (in every
   module of that class) are tried at their per-rank values, the smallest set that passes kept (those
   are the plan's adjustments, as the built-in plans' are; an attribute that only happens to equal a
   split size stays). When none passes, the model is refused, naming the module and the op whose
   shape would be wrong.
4. The plan names modules exactly, and the parameters no planned layer owns that meet a split tensor (Note
   [partial gradients of whole parameters]); dropout called on split activations draws per-rank masks
   (Note [tensor-parallel RNG]), and dropout on whole activations inside such a module the shared ones;
   a module dropping out both is refused (no stream suits both).
Every layer left whole stays correct; a model where nothing splits is refused, naming the first
linear layer and why.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.tensor_parallel.derive.propagate import Layer, Pass, propagate, styles_of
from engine.tensor_parallel.derive.trace import (
    BATCH,
    Op,
    Ref,
    Trace,
    TraceFailed,
    example_input,
    fake_copy,
    linear_features,
    module_kind,
    trace,
)
from engine.tensor_parallel.rng import Stream

MAX_ATTRIBUTE_GROUPS = 6  # subsets tried: 2**6 forwards on fake tensors at most


@dataclass
class DerivedPlan:
    styles: dict[str, str]  # exact module name -> style
    adjustments: list[tuple[str, str, int]] = field(default_factory=list)  # (module name, attribute, per-rank value)
    rng: dict[str, Stream] = field(default_factory=dict)
    partial_gradients: tuple[str, ...] = ()  # whole parameters whose gradient each tp rank computes a part of


@dataclass
class _Mismatch:
    index: int  # how far the check got
    text: str


def derive_plan(model: nn.Module, tp: int) -> DerivedPlan:
    """A 1D plan for `model` at tensor-parallel size `tp` (Note [derived tensor-parallel plans])."""
    cls = type(model).__name__
    model_copy = traced(model)
    copy, mode, whole = model_copy.copy, model_copy.mode, model_copy.whole
    layers = layers_of(copy)
    settled, decisions, first = propagate(whole, layers, tp, frozenset(id(p) for p in copy.parameters()))
    styles = styles_of(settled, decisions, layers)
    if not any(style in ("colwise", "colwise_qkv", "rowwise") for style in styles.values()):
        raise ValueError(f"tensor_parallel.plan \"auto\": found no pair of linear layers to split in {cls}: "
                         f"{_why_none(first, whole, layers)}{_subclassed_linears(model)}; give tensor_parallel.plan "
                         f"as {{module-name glob: style}}, or use tensor_parallel.size 1")
    _install_per_rank_layers(copy, styles, tp, mode)
    changes = adjustments(model_copy, settled, tp, cls)
    names = {id(p): n for n, p in copy.named_parameters()}
    partial = sorted(names[pid] for pid in settled.partial if pid in names)  # (a replaced layer's: split, not whole)
    return DerivedPlan(styles, changes, _streams(settled, cls), tuple(partial))


@dataclass(frozen=True)
class TracedCopy:
    """A fake copy of the model, its fake mode, the example input's args and kwargs, and the copy's traced forward
    (the whole model's shapes, which the per-rank copy is checked against)."""

    copy: nn.Module
    mode: FakeTensorMode
    args: tuple
    kwargs: dict
    whole: Trace


def traced(model: nn.Module, kind=module_kind, batch: int = BATCH) -> TracedCopy:
    """The model copied onto fake tensors and its forward traced on an example input."""
    mode = FakeTensorMode()
    described = "an example input"
    try:
        copy = fake_copy(model, mode)
        args, kwargs, described = example_input(copy, mode, batch)
        return TracedCopy(copy, mode, args, kwargs, trace(copy, args, kwargs, mode, kind))
    except Exception as error:  # the user's model and forward: whatever fails is reported, with the fix
        where = f" in module {error.module!r}" if isinstance(error, TraceFailed) else ""
        raise ValueError(f"tensor_parallel.plan \"auto\": {type(model).__name__} has no built-in plan, and deriving "
                         f"one runs its forward on fake tensors with {described}{where}, which failed: {error}; give "
                         f"tensor_parallel.plan as {{module-name glob: style}}") from error


def layers_of(model: nn.Module, kind=module_kind) -> dict[str, Layer]:
    """The linear layers and embeddings; one whose parameter another module also holds (BERT's MLM head keeps its
    decoder's bias as its own) is marked so, since replacing the layer would leave that module the old tensor."""
    holders: dict[int, set[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(name)
    layers = {}
    for name, module in model.named_modules():
        what = kind(module)
        if what is not None:
            width = linear_features(module)[1] if what == "linear" else module.num_embeddings
            params = tuple(id(p) for p in module.parameters(recurse=False))
            held_elsewhere = any(kind(model.get_submodule(h)) is None for p in params for h in holders[p])
            layers[name] = Layer(what, width, not isinstance(module, (nn.Linear, nn.Embedding)), params,
                                 held_elsewhere)
    return layers


def _why_none(first: Pass, whole: Trace, layers: dict[str, Layer]) -> str:
    called = [op.module for op in whole.ops if op.name == "linear_module"]
    if not called:
        return "its forward calls no nn.Linear or Conv1D layer"
    name = called[0]
    if name in first.blocked:
        blocked, module = first.blocked[name]
        return f"the output of {name!r} cannot stay split up to another linear layer: {blocked.reason}" \
               f"{f' (in {module!r})' if module else ''}"
    if name in first.foreign or layers[name].held_elsewhere:
        return f"the parameters of {name!r} are read or held outside it"
    return f"the output of {name!r} reaches no other linear layer"


def _subclassed_linears(model: nn.Module) -> str:
    """A note on the layers a plan could not replace because they subclass nn.Linear with a forward of their own."""
    kinds = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, nn.Linear) and type(m) is not nn.Linear and module_kind(m) is None})
    return (f" ({', '.join(kinds)}: subclasses of nn.Linear with a forward of their own, traced as their ops "
            "rather than replaced)") if kinds else ""


def _install_per_rank_layers(copy: nn.Module, styles: dict[str, str], tp: int, mode: FakeTensorMode) -> None:
    """Every split linear layer of the copy replaced by an nn.Linear of one rank's shape."""
    for name, style in styles.items():
        module = copy.get_submodule(name)
        if style not in ("colwise", "colwise_qkv", "rowwise"):
            continue
        features_in, features_out = linear_features(module)
        if style == "rowwise":
            features_in //= tp
        else:
            features_out //= tp
        with mode:
            local = nn.Linear(features_in, features_out, bias=module.bias is not None, dtype=module.weight.dtype,
                              device=module.weight.device)
        parent, _, attr = name.rpartition(".")
        setattr(copy.get_submodule(parent) if parent else copy, attr, local)


def _check(model_copy: TracedCopy, settled: Pass, tp: int, kind=module_kind) -> _Mismatch | None:
    """The per-rank copy's forward against the whole one's shapes, every split dim divided by tp."""
    failure, whole = None, model_copy.whole
    try:
        local = trace(model_copy.copy, model_copy.args, model_copy.kwargs, model_copy.mode, kind)
    except TraceFailed as error:
        local, failure = error.partial, error
    for i, (w, lo) in enumerate(zip(whole.ops, local.ops)):
        expected = [tuple(s // tp if state is not None and d == state.dim else s for d, s in enumerate(o.shape))
                    for o, state in zip(w.outputs, settled.op_states[i])]
        got = [o.shape for o in lo.outputs]
        if (w.name, w.module) != (lo.name, lo.module):
            return _Mismatch(i, f"module {w.module!r}: split over {tp} ranks, runs {lo.name} where the whole model "
                                f"runs {w.name}")
        if got != expected:
            return _Mismatch(i, f"module {w.module!r}: split over {tp} ranks, {w.name} gives "
                                f"{[list(g) for g in got]} where {[list(e) for e in expected]} is needed")
        scalars = _scalar_difference(w, lo, tp)
        if scalars is not None:
            return _Mismatch(i, f"module {w.module!r}: split over {tp} ranks, {w.name} is passed {scalars[1]!r} "
                                f"where the whole model passes {scalars[0]!r}")
    if failure is None and len(local.ops) != len(whole.ops):
        return _Mismatch(min(len(local.ops), len(whole.ops)), f"split over {tp} ranks, the forward runs "
                                                              f"{len(local.ops)} ops where the whole model runs "
                                                              f"{len(whole.ops)}")
    if failure is not None:
        return _Mismatch(len(local.ops), f"module {failure.module!r}: split over {tp} ranks, its forward fails: "
                                         f"{failure}")
    return None


def _scalars(value) -> list:
    if isinstance(value, slice):
        return [value.start, value.stop, value.step]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _scalars(v)]
    if isinstance(value, dict):
        return [s for k in sorted(value) for s in [k, *_scalars(value[k])]]
    return [] if isinstance(value, Ref) else [value]


def _scalar_difference(whole: Op, local: Op, tp: int) -> tuple | None:
    """The first non-tensor argument the per-rank op gets that the whole one does not: equal, or a size divided by
    tp (a view's heads, a split's width). A scale computed from a per-rank width (1/sqrt(self.n_embd//self.n_head)
    with only n_embd adjusted) differs, and is caught here where no shape shows it."""
    w, lo = _scalars((whole.args, whole.kwargs)), _scalars((local.args, local.kwargs))
    if len(w) != len(lo):
        return "its arguments", "others"
    for a, b in zip(w, lo):
        same = a == b if not isinstance(a, float) or not math.isnan(a) else isinstance(b, float) and math.isnan(b)
        scaled = type(a) is int and type(b) is int and b * tp == a
        if not (same or scaled):
            return a, b
    return None


def _attribute_groups(copy: nn.Module, whole: Trace, settled: Pass, tp: int) -> list[tuple[str, str, list[str]]]:
    """(class, attribute, modules): an int attribute that, in every module of the class doing split work, equals
    the whole size of a split dim of an op it runs."""
    sizes: dict[str, set[int]] = {}
    for op, states in zip(whole.ops, settled.op_states):
        if not op.name.endswith("_module"):
            for out, state in zip(op.outputs, states):
                if state is not None:
                    sizes.setdefault(op.module, set()).add(out.shape[state.dim])
    by_class: dict[str, list[str]] = {}
    for name in sizes:
        by_class.setdefault(type(copy.get_submodule(name)).__name__, []).append(name)
    groups = []
    for cls, names in by_class.items():
        attrs = set.intersection(*({a for a, v in vars(copy.get_submodule(n)).items()
                                    if type(v) is int and not a.startswith("_") and v in sizes[n] and v % tp == 0}
                                   for n in names))
        groups += [(cls, attr, names) for attr in sorted(attrs)]
    return groups


def adjustments(model_copy: TracedCopy, settled: Pass, tp: int, cls: str,
                kind=module_kind) -> list[tuple[str, str, int]]:
    """The smallest set of attribute groups at their per-rank values under which the check passes (an attribute
    that only happens to equal a split size, GPT-NeoX's rotary_ndims, must not change)."""
    copy = model_copy.copy
    groups = _attribute_groups(copy, model_copy.whole, settled, tp)
    subsets = [[]] if len(groups) > MAX_ATTRIBUTE_GROUPS else \
        [list(s) for k in range(len(groups) + 1) for s in itertools.combinations(groups, k)]
    furthest = None
    for subset in subsets:
        changes = [(name, attr, getattr(copy.get_submodule(name), attr) // tp)
                   for _cls, attr, names in subset for name in names]
        saved = [(name, attr, getattr(copy.get_submodule(name), attr)) for name, attr, _ in changes]
        for name, attr, value in changes:
            setattr(copy.get_submodule(name), attr, value)
        mismatch = _check(model_copy, settled, tp, kind)
        for name, attr, value in saved:
            setattr(copy.get_submodule(name), attr, value)
        if mismatch is None:
            return changes
        furthest = mismatch if furthest is None or mismatch.index > furthest.index else furthest
    raise ValueError(f"tensor_parallel.plan \"auto\": cannot split {cls} safely: {furthest.text} (a width taken "
                     f"from the whole model: write -1 for the split dim in view/reshape, or give "
                     f"tensor_parallel.plan as {{module-name glob: style}})")


def _streams(settled: Pass, cls: str) -> dict[str, Stream]:
    """A module whose dropout acts on split activations draws per-rank masks; a dropout module on whole activations
    inside it the shared ones. One module dropping out both is refused: no stream is right for both."""
    rng = {module: Stream.SHARDED for module, split in settled.dropouts if split}
    for module, split in settled.dropouts:
        if split:
            continue
        if module in rng:
            raise ValueError(f"tensor_parallel.plan \"auto\": cannot split {cls} safely: module {module!r} applies "
                             f"dropout to split activations and to whole ones, which need per-rank and shared masks; "
                             f"give each its own nn.Dropout module, or give tensor_parallel.plan as "
                             f"{{module-name glob: style}}")
        if any(s == "" or module.startswith(s + ".") for s in rng):
            rng[module] = Stream.REPLICATED
    return rng
