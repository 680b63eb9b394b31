"""Which linear layer splits by columns and which by rows (Note [derived tensor-parallel plans]).

One pass walks the recorded forward: a linear layer with a whole input is tried column-parallel (its
output split along the features), a linear layer whose input arrives split is row-parallel, and the
rules say where the split travels between them. A column-parallel try whose split reaches an op that
needs the whole tensor is settled: gathered (colwise_gather) where that op is the model's output or a
loss, else left whole; then the pass runs again, until nothing changes.

Note [partial gradients of whole parameters]
A whole tensor that meets a split one (broadcast along the split dim: the rules allow nothing else) gets
from that op only this rank's part of its gradient. The pass follows two kinds of whole tensors:
- computed from parameters and constants only (a norm's weight, Gemma's `1 + weight`): one that meets a
  split tensor is partial, and the plan sums its parameters' gradients over the tp group before they
  accumulate (engine/tensor_parallel/mappings.py), as Megatron sums layer-norm gradients under sequence
  parallelism. Qwen3's per-head q/k norms scale this rank's heads only, so each rank's gradient of the
  norm's weight is the part over its heads. A parameter with a whole use as well (entering a layer,
  meeting a whole activation, reaching the output) would then get its whole part summed tp times: the
  layers whose split it meets are left whole instead;
- a gradient flows through it from the input (a layer's output, a gate computed from the hidden state): the
  part it would get flows on into everything before it, so the layers whose split it meets are left whole.
Constants (positions, masks, rotary tables) meet split tensors freely. Without this each rank would step
its own part: the weights drift apart, silently.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import engine.tensor_parallel.derive.rules as rules
from engine.tensor_parallel.derive.rules import Blocked, Split
from engine.tensor_parallel.derive.trace import Op, Ref, Trace


@dataclass(frozen=True)
class Layer:
    kind: str  # "linear" or "embedding"
    width: int  # out features; rows of an embedding
    transposed: bool  # weight stored [in, out] (Conv1D)
    params: tuple[int, ...]  # ids of its parameters in the traced copy
    held_elsewhere: bool = False  # another module (not a layer) holds one of its parameters: left whole


@dataclass
class Decisions:
    replicated: set[str] = field(default_factory=set)  # left whole on every rank
    gathered: set[str] = field(default_factory=set)  # column-parallel with the output gathered


@dataclass
class Pass:
    op_states: list[list[Split | None]] = field(default_factory=list)
    roles: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # "colwise" / "rowwise"
    parts: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))  # fused parts its output has
    blocked: dict[str, tuple[Blocked, str]] = field(default_factory=dict)  # layer -> (why, module of the op)
    reached_row: set[str] = field(default_factory=set)  # column-parallel layers a row-parallel one consumes
    vocab: set[str] = field(default_factory=set)  # embeddings of the model's input ids, vocabulary-parallel
    foreign: set[str] = field(default_factory=set)  # layers whose parameters an op outside them reads
    dropouts: list[tuple[str, bool]] = field(default_factory=list)  # (module, on a split tensor)
    # Note [partial gradients of whole parameters]: parameter id -> the layers whose split it meets; and the
    # parameters with a whole use too (both: left whole, see settle)
    partial: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    whole_use: set[int] = field(default_factory=set)


class Propagation:
    """One pass over `trace` under `decisions`."""

    follows_gradients = True  # Note [partial gradients of whole parameters]: 1D's concern (2D splits everything)

    def __init__(self, trace: Trace, layers: dict[str, Layer], tp: int, decisions: Decisions,
                 params: frozenset[int] = frozenset()):
        """params: ids of the traced copy's parameters."""
        self.trace, self.layers, self.tp, self.decisions = trace, layers, tp, decisions
        self.owner = {pid: name for name, layer in layers.items() for pid in layer.params}
        self.states: dict[int, Split | None] = {}
        # Note [partial gradients of whole parameters]: whole tensors computed from parameters and constants only
        # (id -> those parameters), and whole tensors a gradient flows through that depend on the input too
        self.made_from: dict[int, frozenset[int]] = {pid: frozenset([pid]) for pid in params}
        self.learned: set[int] = set()
        self.from_input = set(trace.inputs)
        self.result = Pass()

    def run(self) -> Pass:
        for op in self.trace.ops:
            refs = rules.tensor_args(op)
            ins = {r.id: self.states.get(r.id) for r in refs}
            try:
                outs = self._module(op, ins) if op.name.endswith("_module") else self._function(op, refs, ins)
            except Blocked as blocked:
                for source in blocked.sources:
                    self.result.blocked.setdefault(source, (blocked, op.module))
                outs = [None] * len(op.outputs)
            if self.follows_gradients:
                self._follow_gradients(op, refs, ins, outs)
            if op.name in rules.MOVES_VALUES and any(r.id in self.from_input for r in refs):
                self.from_input.update(o.id for o in op.outputs)
            for ref, state in zip(op.outputs, outs):
                self.states[ref.id] = state
            self.result.op_states.append(outs)
        for ref in self.trace.outputs:
            self.result.whole_use |= self.made_from.get(ref.id, frozenset())
            state = self.states.get(ref.id)
            if state is not None:
                for source in state.sources:
                    self.result.blocked.setdefault(source, (Blocked(state.sources, "the model's output", "output"),
                                                            ""))
        for pid in self.result.partial.keys() & self.result.whole_use:  # neither whole nor a sum of parts: whole
            sources = frozenset(self.result.partial[pid])
            for source in sources:
                self.result.blocked.setdefault(source, (Blocked(sources, "a parameter it meets is also used on whole "
                                                                         "activations"), ""))
        return self.result

    def _follow_gradients(self, op: Op, refs: list[Ref], ins: dict, outs: list) -> None:
        """Note [partial gradients of whole parameters]: which whole tensors carry a gradient, and where parameters
        meet split tensors."""
        made_from = frozenset().union(*(self.made_from.get(r.id, frozenset()) for r in refs))
        learned = any(r.id in self.learned for r in refs)
        split = [s for s in ins.values() if s is not None]
        if op.name.endswith("_module"):  # a layer: its gradient into a whole input is whole (a split one sums it)
            self.result.whole_use |= made_from
            self.learned.update(ref.id for ref, state in zip(op.outputs, outs) if state is None)
        elif split:
            for pid in made_from:
                self.result.partial[pid].update(rules.sources_of(split))
        elif learned:
            self.result.whole_use |= made_from
            self.learned.update(ref.id for ref in op.outputs)
        elif made_from:
            for ref in op.outputs:
                self.made_from[ref.id] = self.made_from.get(ref.id, frozenset()) | made_from

    def require_parts(self, sources, parts: int) -> None:
        for source in sources:
            self.result.parts[source].add(parts)

    def _module(self, op: Op, ins: dict) -> list:
        name, layer, inp = op.module, self.layers[op.module], op.args[0]
        state = ins.get(inp.id)
        if inp.id in self.owner:  # a layer's parameter fed to another layer (x @ f(tok.weight)): left whole
            self.result.foreign.add(self.owner[inp.id])
        if layer.kind == "embedding":
            if state is not None:
                raise Blocked(state.sources, f"the embedding {name!r} looks up split ids")
            if name not in self.decisions.replicated and inp.id in self.from_input and layer.width % self.tp == 0:
                self.result.vocab.add(name)
            return [None]
        if state is not None:
            if state.dim != len(inp.shape) - 1 or name in self.decisions.replicated | self.decisions.gathered:
                raise Blocked(state.sources, f"{name!r} takes it whole")
            self.result.roles[name].add("rowwise")
            self.result.reached_row.update(state.sources)
            if state.fresh:
                self.require_parts(state.sources, 1)
            return [None]
        if name in self.decisions.replicated or name in self.decisions.gathered or layer.width % self.tp:
            return [None]
        self.result.roles[name].add("colwise")
        return [Split(len(op.outputs[0].shape) - 1, frozenset([name]), fresh=True)]

    def _function(self, op: Op, refs: list[Ref], ins: dict) -> list:
        self.result.foreign.update(self.owner[r.id] for r in refs if r.id in self.owner)
        split = [s for s in ins.values() if s is not None]
        if op.name in rules.DROPOUT and rules.drops(op):
            self.result.dropouts.append((op.module, bool(split)))
        if not split:
            return [None] * len(op.outputs)
        try:
            outs = self._rule(op, ins)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as error:  # arguments of a form the
            # rules do not read: the split stops here, which leaves its layers whole (always correct)
            raise Blocked(rules.sources_of(ins.values()), f"{op.name} with arguments the rules do not read "
                                                          f"({type(error).__name__})") from error
        if self.follows_gradients and any(r.id in self.learned and ins.get(r.id) is None for r in refs):
            # the whole tensor's gradient would be this rank's part only
            raise Blocked(rules.sources_of(ins.values()), f"{op.name} combines a split tensor with a whole one a "
                                                          "gradient flows through (broadcast along the split)",
                          "gradient")
        if op.name not in rules.KEEPS_FUSED_PARTS:
            for state in split:
                if state.fresh:
                    self.require_parts(state.sources, 1)
        return outs

    def _rule(self, op: Op, ins: dict) -> list:
        name = op.name
        if name in rules.LOSSES:
            raise Blocked(rules.sources_of(ins.values()), f"the loss {name}", "loss")
        if name in rules.ELEMENTWISE:
            return rules.elementwise(op, ins)
        if name in ("cat", "concat", "concatenate", "stack"):
            return rules.cat(op, ins)
        if name in ("matmul", "bmm", "mm"):
            return rules.matmul(op, ins)
        if name == "scaled_dot_product_attention":
            outs, drops = rules.attention(op, ins)
            if drops:
                self.result.dropouts.append((op.module, True))
            return outs
        first = op.args[0] if op.args else None
        state = ins.get(first.id) if isinstance(first, Ref) else None
        if state is None or any(s is not None for i, s in ins.items() if i != first.id):
            raise Blocked(rules.sources_of(ins.values()), f"{name} with a split argument")
        return self._on_first(op, state)

    def _on_first(self, op: Op, state: Split) -> list:
        name = op.name
        if name in rules.UNARY:
            return rules.unary(op, state)
        if name in rules.REDUCE or name in rules.ALONG:
            return rules.reduce(op, state, keep_shape=name in rules.ALONG)
        if name in ("layer_norm", "rms_norm"):
            return rules.norm(op, state)
        if name in rules.RESHAPE:
            return rules.reshape(op, state, self.tp)
        if name in rules.EXPAND or name == "repeat":
            return rules.expand(op, state)
        if name in rules.PERMUTES:
            return rules.permute(op, state)
        if name == "getitem":
            return rules.getitem(op, state)
        if name in ("narrow", "select"):
            return rules.narrow(op, state)
        if name in rules.SPLITS:
            return rules.split(op, state, self.tp, self.require_parts)
        if name == "repeat_interleave" and isinstance(rules.arg(op, 2, "dim"), int):
            return [Split(state.dim, state.sources)]
        if name == "linear":
            return rules.linear_function(op, state)
        raise Blocked(state.sources, f"{name} (not known to keep a split)")


def _shard_key(style: str | None, layer: Layer, parts: int) -> tuple | None:
    """Which dim of the weight a style shards, so that tied layers can be checked to agree."""
    if style is None:
        return None
    if style == "vocab":
        return 0, 1
    if style == "rowwise":
        return int(not layer.transposed), 1
    return int(layer.transposed), parts


def styles_of(result: Pass, decisions: Decisions, layers: dict[str, Layer]) -> dict[str, str]:
    styles = {}
    for name, layer in layers.items():
        roles = result.roles.get(name, set())
        if layer.kind == "embedding" and name in result.vocab:
            styles[name] = "vocab"
        elif name in decisions.gathered:
            styles[name] = "colwise_gather"
        elif roles == {"rowwise"}:
            styles[name] = "rowwise"
        elif roles == {"colwise"}:
            styles[name] = "colwise_qkv" if result.parts.get(name) == {3} else "colwise"
    return styles


def settle(result: Pass, decisions: Decisions, layers: dict[str, Layer]) -> bool:
    """Moves the layers the pass found misplaced to gathered or whole; says whether anything moved."""
    before = (set(decisions.replicated), set(decisions.gathered))
    for source, (blocked, _module) in result.blocked.items():
        (decisions.gathered if blocked.kind in ("output", "loss") else decisions.replicated).add(source)
    for name, roles in result.roles.items():
        unused = roles == {"colwise"} and name not in result.reached_row and name not in result.blocked
        if len(roles) > 1 or unused or result.parts.get(name, {1}) not in ({1}, {3}):
            decisions.replicated.add(name)
    decisions.replicated |= result.foreign | {name for name, layer in layers.items() if layer.held_elsewhere}
    styles = styles_of(result, decisions, layers)
    tied = defaultdict(list)
    for name, layer in layers.items():
        for pid in layer.params:
            tied[pid].append(name)
    for names in tied.values():
        keys = {_shard_key(None if n in decisions.replicated else styles.get(n), layers[n],
                           3 if styles.get(n) == "colwise_qkv" else 1) for n in names}
        if len(keys) > 1:
            decisions.replicated.update(names)
    decisions.gathered -= decisions.replicated
    return (decisions.replicated, decisions.gathered) != before


def propagate(trace: Trace, layers: dict[str, Layer], tp: int,
              params: frozenset[int] = frozenset()) -> tuple[Pass, Decisions, Pass]:
    """(the settled pass, its decisions, the first pass: what was tried first and why it did not hold). params:
    ids of the traced copy's parameters, whose partial gradients the settled pass names."""
    decisions = Decisions()
    first = None
    for _ in range(2 * len(layers) + 2):  # each pass that changes something moves at least one layer
        result = Propagation(trace, layers, tp, decisions, params).run()
        first = first or result
        if not settle(result, decisions, layers):
            return result, decisions, first
    raise AssertionError("tensor-parallel plan derivation did not settle")
