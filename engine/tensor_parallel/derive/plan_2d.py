"""2D tensor-parallel plans derived from the model's own forward.

Note [derived 2D plans]
`tensor_parallel.plan: "auto"` at mode "2d" on a model with no built-in 2D plan derives one from the
same traced forward as a 1D plan (Note [derived tensor-parallel plans]), with layer norms and RMS
norms recorded as one op each. Under 2D every activation is split [batch/q, seq, hidden/q] (Note
[2D tensor parallelism]), so nothing may stay whole: every module holding parameters becomes a 2D
layer, and every op between them must keep the hidden split.
1. Map: exactly nn.Linear / Conv1D -> linear_2d (linear_2d_qkv where its output is split into 3
   equal fused parts), nn.Embedding -> embedding_2d (position_embedding_2d for ids the forward makes
   itself), nn.LayerNorm, nn.RMSNorm or a *RMSNorm whose output on a test input is Norm2D's (so not
   Gemma's 1 + weight) -> norm_2d. Any other module holding parameters is refused by name.
2. Propagate (the 1D derivation's rules): every layer's output is split along its last dim, and
   every linear layer and norm must receive its input split so. Where the split reaches the loss or
   the model's output, the linear layer that made it is the classifier (classifier_2d_gather: its
   logits are gathered whole, which the loss meets). Everything else that would need the whole hidden
   dimension (a functional norm, a cat along it, an op the rules do not know), a layer's parameter
   read outside its layer, and dropout on the whole logits are refused, naming the op's module.
3. Check: the forward with every layer at its per-rank shape must give each op the whole shape with
   the split dim divided by q and the same scalars; attributes read for widths are set to their
   per-rank values where that makes it pass, exactly as in 1D (the plan's adjustments).
4. Batch: the batch is cut into the q blocks before the forward (Note [2D batch inputs]), so a
   second pass carries a split along dim 0 from the token ids (the forward's first argument) through
   every layer (the classifier gathers it back) by the same rules: an op that mixes the samples (a
   mean over the batch, a cat along it) is refused. Per sample are: the token ids, the inputs 2D cuts
   by name (Note [2D batch inputs]), and a tensor the forward makes with the example batch's size
   first (a mask built from the ids' shape; the example batch, 7q, is chosen unlike the usual widths):
   on a rank it is made from the cut ids. Another input of that size (2D passes it whole), a
   parameter or a buffer, or what the forward computes from them without the split batch, is not:
   an op meeting one with the split batch is refused, naming the op. (Rows the forward numbers
   itself, `arange(batch)` added as values, are still taken per sample: the same arange indexing a
   per-sample mask is how Hugging Face builds its padding mask, and the trace does not tell the two
   uses apart.)
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from engine.tensor_parallel.derive import DerivedPlan, adjustments, traced
from engine.tensor_parallel.derive.propagate import Decisions, Layer, Pass, Propagation
from engine.tensor_parallel.derive.rules import Blocked, Split
from engine.tensor_parallel.derive.trace import Trace, linear_features, module_kind
from engine.tensor_parallel.inputs_2d import PER_SAMPLE

BATCH_PER_BLOCK = 7  # the traced batch is 7q: divisible by q, and unlike the usual widths (so that a tensor of
# that size first can be taken for a per-sample one)


def kind_2d(module: nn.Module) -> str | None:
    """The 1D derivation's layers, and "norm" for the norm classes Norm2D takes (its math is checked apart)."""
    kind = module_kind(module)
    if kind is None and (isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("RMSNorm")):
        own = {name for name, _ in module.named_parameters(recurse=False)}
        return "norm" if own <= {"weight", "bias"} and not list(module.named_buffers(recurse=False)) else None
    return kind


def _refuse(cls: str, what: str) -> ValueError:
    return ValueError(f"tensor_parallel.plan \"auto\" (mode \"2d\", \"2.5d\" or \"3d\"): cannot split {cls}: {what}; "
                      f"on these grids every activation is split by batch and hidden, and every layer with "
                      f"parameters too, so give tensor_parallel.plan as {{module-name glob: style}}, or use "
                      f"tensor_parallel.mode \"1d\"")


class Propagation2D(Propagation):
    """One pass under 2D: every layer's output split along its last dim (the classifiers' whole)."""

    follows_gradients = False

    def _module(self, op, ins: dict) -> list:
        name, layer, inp = op.module, self.layers[op.module], op.args[0]
        state = ins.get(inp.id)
        last_out = len(op.outputs[0].shape) - 1
        if inp.id in self.owner:
            self.result.foreign.add(self.owner[inp.id])
        if layer.kind == "embedding":
            if state is not None:
                raise Blocked(state.sources, f"the embedding {name!r} looks up split ids")
            if inp.id in self.from_input:
                self.result.vocab.add(name)
            return [Split(last_out, frozenset([name]))]
        if state is None or state.dim != len(inp.shape) - 1:
            got = "whole" if state is None else f"split along dim {state.dim}"
            raise Blocked(frozenset([name]), f"{name!r} gets its input {got}, where 2D splits the features")
        if state.fresh:
            self.require_parts(state.sources, 1)
        if layer.kind == "linear" and name in self.decisions.gathered:
            return [None]
        return [Split(last_out, frozenset([name]), fresh=layer.kind == "linear")]


class BatchPropagation(Propagation):
    """The batch split instead: the token ids (the forward's first argument) cut along dim 0, carried through
    every layer (the classifiers gather it back) and, by the same rules, through the ops between them."""

    follows_gradients = False

    def __init__(self, trace: Trace, layers: dict[str, Layer], q: int, decisions: Decisions, cut: set[int],
                 held: set[int]):
        """cut: the ids of the inputs 2D cuts (the token ids first); held: those of the model's parameters and
        buffers."""
        super().__init__(trace, layers, q, decisions)
        self.per_sample, self.batch = Split(0, frozenset(["the batch"])), BATCH_PER_BLOCK * q
        self.states.update((ref_id, self.per_sample) for ref_id in cut)
        # every rank holds these whole: the inputs 2D does not cut, the parameters and buffers, and what the
        # forward computes from them without the split batch
        self.whole = (set(trace.inputs) - cut) | held

    def _function(self, op, refs: list, ins: dict) -> list:
        """A tensor the forward made with the batch's size first (a mask from the ids' shape) is per sample too:
        on a rank it is made from the cut ids (Note [derived 2D plans])."""
        if any(s is not None for s in ins.values()):
            for ref in refs:
                if ins.get(ref.id) is None and ref.shape[:1] == (self.batch,) and ref.id not in self.whole:
                    ins[ref.id] = self.per_sample
        outs = super()._function(op, refs, ins)
        if all(s is None for s in outs) and any(r.id in self.whole for r in refs):
            self.whole.update(out.id for out in op.outputs)
        return outs

    def _module(self, op, ins: dict) -> list:
        name, layer, inp = op.module, self.layers[op.module], op.args[0]
        state = ins.get(inp.id)
        if state is None or (layer.kind == "linear" and name in self.decisions.gathered):
            return [None]
        if layer.kind != "embedding" and state.dim == len(inp.shape) - 1:
            raise Blocked(state.sources, f"{name!r} takes the batch dim as its features")
        return [Split(state.dim, state.sources)]


def derive_plan_2d(model: nn.Module, q: int, batch_parts: int | None = None) -> DerivedPlan:
    """A 2D plan for `model` on a grid splitting the hidden dimension into q parts and the batch into `batch_parts`
    (2D: both q; 2.5D: q and depth·q; 3D: q² and q; Note [derived 2D plans], [tensor-parallel grids])."""
    cls = type(model).__name__
    batch_parts = batch_parts or q
    _check_modules(model, cls)
    model_copy = traced(model, kind_2d, BATCH_PER_BLOCK * batch_parts)
    copy, mode, whole = model_copy.copy, model_copy.mode, model_copy.whole
    layers = {name: Layer(kind, 0, False, tuple(id(p) for p in m.parameters(recurse=False)))
              for name, m in copy.named_modules() if (kind := kind_2d(m)) is not None}
    result, decisions = _propagate(whole, layers, q, cls)
    held = {id(t) for t in copy.parameters()} | {id(t) for t in copy.buffers()}
    batch = BatchPropagation(whole, layers, batch_parts, decisions, _cut_inputs(copy, model_copy.args), held).run()
    for blocked, module in batch.blocked.values():
        where = repr(module) if module else "the model's own forward"
        raise _refuse(cls, f"the forward mixes the samples of its batch, which 2D cuts into {batch_parts} blocks "
                           f"before it runs: {blocked.reason} (in {where})")
    styles = {}
    for name, layer in layers.items():
        if layer.kind == "embedding":
            styles[name] = "embedding_2d" if name in result.vocab else "position_embedding_2d"
        elif layer.kind == "norm":
            styles[name] = "norm_2d"
        elif name in decisions.gathered:
            styles[name] = "classifier_2d_gather"
        else:
            styles[name] = "linear_2d_qkv" if result.parts.get(name) == {3} else "linear_2d"
    _install_per_rank_layers(copy, styles, q, mode, cls)
    return DerivedPlan(styles, adjustments(model_copy, result, q, cls, kind_2d))


def _cut_inputs(model: nn.Module, args: tuple) -> set[int]:
    """The ids of the example arguments 2D cuts to the batch block (Note [2D batch inputs]): the first (the token
    ids) and those named as per-sample inputs."""
    names = [p.name for p in inspect.signature(model.forward).parameters.values()]
    return {id(a) for i, (name, a) in enumerate(zip(names, args)) if i == 0 or name in PER_SAMPLE}


def _check_modules(model: nn.Module, cls: str) -> None:
    """Every module holding parameters is a layer 2D can replace; every norm computes what Norm2D computes."""
    for name, module in model.named_modules():
        kind = kind_2d(module)
        if kind is None and any(True for _ in module.parameters(recurse=False)):
            raise _refuse(cls, f"module {name!r} ({type(module).__name__}) holds parameters and is not an exact "
                               f"nn.Linear, Conv1D, nn.Embedding, nn.LayerNorm or RMSNorm")
        if kind == "norm" and not _computes_norm_2d(module):
            raise _refuse(cls, f"module {name!r} ({type(module).__name__}) does not compute the layer or RMS norm "
                               f"that norm_2d computes (x / rms(x) * weight + bias) on a test input (on the meta "
                               f"device, only torch's own norms are taken)")


def _computes_norm_2d(module: nn.Module) -> bool:
    """module(x) against Norm2D's math on a test input (the module's own parameters; no state changes)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    shape = tuple(module.normalized_shape) if hasattr(module, "normalized_shape") else tuple(weight.shape)
    if len(shape) != 1:
        return False
    if weight is not None and weight.is_meta:  # no values to compare (a model built on meta for the estimate)
        return type(module) in (nn.LayerNorm, nn.RMSNorm)
    dtype = weight.dtype if weight is not None else torch.float32
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    eps = torch.finfo(dtype).eps if eps is None else eps
    device = weight.device if weight is not None else torch.device("cpu")
    x = torch.randn(3, shape[0], generator=torch.Generator().manual_seed(0)).to(device, dtype) * 3 + 1
    with torch.no_grad():
        h = x.float()
        if not (isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")):
            h = h - h.mean(-1, keepdim=True)
        expected = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        expected = expected * weight if weight is not None else expected
        expected = expected + bias if bias is not None else expected
        got = module(x)
    return isinstance(got, torch.Tensor) and got.shape == expected.shape and \
        torch.allclose(got.float(), expected.float(), rtol=1e-3, atol=1e-3)


def _propagate(whole: Trace, layers: dict[str, Layer], q: int, cls: str) -> tuple[Pass, Decisions]:
    """Passes until the classifiers settle; refuses whatever cannot keep the split."""
    decisions = Decisions()
    for _ in range(len(layers) + 2):  # each further pass adds a classifier
        result = Propagation2D(whole, layers, q, decisions).run()
        ends = {source for blocked, _module in result.blocked.values() if blocked.kind in ("output", "loss")
                for source in blocked.sources}
        if not ends <= decisions.gathered and all(layers[s].kind == "linear" for s in ends):
            decisions.gathered |= ends
            continue
        break
    for source, (blocked, module) in result.blocked.items():
        if blocked.kind == "op":
            where = repr(module) if module else "the model's own forward"
            raise _refuse(cls, f"{blocked.reason} (in {where})")
        raise _refuse(cls, f"{blocked.reason} gets split features from {source!r}, which is no linear layer that "
                           f"could be its output layer")
    if result.foreign:
        raise _refuse(cls, f"the parameters of {sorted(result.foreign)[0]!r} are read outside it")
    fused = sorted(name for name, parts in result.parts.items() if parts not in ({1}, {3}))
    if fused:
        raise _refuse(cls, f"the output of {fused[0]!r} is split into other than 1 or 3 equal fused parts")
    whole_dropout = next((module for module, split in result.dropouts if not split), None)
    if whole_dropout is not None:
        raise _refuse(cls, f"module {whole_dropout!r} applies dropout to activations every rank of a row holds whole "
                           f"(the logits)")
    return result, decisions


def _install_per_rank_layers(copy: nn.Module, styles: dict[str, str], q: int, mode, cls: str) -> None:
    """Every layer of the copy replaced by a module of one rank's shape (for the check, step 3)."""
    for name, style in styles.items():
        module = copy.get_submodule(name)
        with mode:
            local = _per_rank(name, module, style, q, cls)
        parent, _, attr = name.rpartition(".")
        setattr(copy.get_submodule(parent) if parent else copy, attr, local)


def _per_rank(name: str, module: nn.Module, style: str, q: int, cls: str) -> nn.Module:
    device = next(iter(module.parameters()), torch.empty(0)).device
    if style in ("embedding_2d", "position_embedding_2d"):
        return nn.Embedding(module.num_embeddings, _part(module.embedding_dim, q, name, cls), device=device)
    if style == "norm_2d":
        weight = getattr(module, "weight", None)
        width = weight.shape[0] if weight is not None else module.normalized_shape[0]
        return nn.LayerNorm(_part(width, q, name, cls), device=device)
    features_in, features_out = linear_features(module)
    if style == "classifier_2d_gather" and module.bias is not None:
        raise _refuse(cls, f"the output layer {name!r} has a bias, which classifier_2d does not support")
    out = features_out if style == "classifier_2d_gather" else _part(features_out, q, name, cls)
    return nn.Linear(_part(features_in, q, name, cls), out, bias=module.bias is not None, device=device)


def _part(width: int, q: int, name: str, cls: str) -> int:
    if width % q:
        raise _refuse(cls, f"module {name!r}: a width of {width} does not split into the {q} blocks of the mesh side")
    return width // q
