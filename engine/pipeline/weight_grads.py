"""Zero bubble's split backward: the input's gradient now (I), the parameters' later (W), without walking the
graph twice.

Note [splitting backward into input and weight passes]
A stage's autograd graph runs from its output down to its input; each parameter hangs off it by a
short side branch (a Linear's weight: the transpose and the matmul that uses it). I computes the
input's gradient only. Walking the graph again from the output for W would recompute every
activation gradient down the stage, nearly a second backward. Instead, before I runs, the nodes
where a parameter's branch joins the input's path are found (walking up from each parameter until
a node on a path to the input is reached), and a hook on each keeps the gradient I passes through
it. W then starts autograd at those nodes with the kept gradients and walks only down the
branches to the parameters: torch.autograd.backward from GradientEdges with `inputs=` the
parameters, so the gradients accumulate into .grad through the usual hooks (ZeRO's included).
Parameters whose branches meet at the same join node are done in one call; when a call starts at
several join nodes of which one lies below another, the lower one's gradient is pinned to what I
kept, so nothing is counted twice. A stage with no input that needs a gradient (the first) has no
input path: its W is the whole backward, and I does nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    joins: list[Node] = field(default_factory=list)
    kept: dict[Node, tuple] = field(default_factory=dict)  # join node -> the gradients I passed into it


class WeightPass:
    """What W needs after I: the join nodes' kept gradients, grouped by the parameters below them."""

    def __init__(self, groups: list[_Group]):
        self.groups = groups

    def run(self) -> None:
        """Accumulates the parameters' gradients into .grad."""
        for group in self.groups:
            edges, grads = [], []
            for node in group.joins:
                for i, g in enumerate(group.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            pins = [node.register_prehook(lambda _, kept=group.kept[node]: kept)
                    for node in group.joins if node in group.kept] if len(group.joins) > 1 else []
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
            finally:
                for handle in pins:
                    handle.remove()
        self.groups = []  # the graph can go


def input_grad(output: torch.Tensor, output_grad: torch.Tensor | None, stage_input: torch.Tensor,
               params: list[torch.Tensor]) -> tuple[torch.Tensor, WeightPass]:
    """I: the gradient of `stage_input`, keeping at the join nodes what W needs (Note [splitting backward into
    input and weight passes])."""
    groups = _groups(output, stage_input, params)
    hooks = []
    for group in groups:
        for node in group.joins:
            hooks.append(node.register_prehook(lambda grads, g=group, n=node: g.kept.__setitem__(n, grads)))
    try:
        (grad,) = torch.autograd.grad(output, stage_input, output_grad, retain_graph=True)
    finally:
        for handle in hooks:
            handle.remove()
    return grad, WeightPass(groups)


def _groups(output: torch.Tensor, stage_input: torch.Tensor, params: list[torch.Tensor]) -> list[_Group]:
    parents = _parents(output.grad_fn)
    on_input_path = _above(get_gradient_edge(stage_input).node, parents, stop=set())
    group_of_join: dict[Node, _Group] = {}
    for p in params:
        if not p.requires_grad:
            continue
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # not used by this stage's forward
        joins = _above(node, parents, stop=on_input_path) & on_input_path
        groups = {id(group_of_join[j]): group_of_join[j] for j in joins if j in group_of_join}
        merged = _Group(params=[p], joins=sorted(joins, key=id))
        for other in groups.values():  # parameters meeting at a join are done together
            merged.params += other.params
            merged.joins = sorted(set(merged.joins) | set(other.joins), key=id)
        for j in merged.joins:
            group_of_join[j] = merged
    unique = {id(g): g for g in group_of_join.values()}
    return list(unique.values())


def _parents(root: Node | None) -> dict[Node, list[Node]]:
    """Every node of the graph under `root` -> the nodes whose backward feeds it (its parents towards the
    output)."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    if root is None:
        return parents
    parents[root] = []
    stack, seen = [root], {root}
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _above(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """The nodes on paths from `start` up to the output, not going past nodes in `stop` (which are included)."""
    found, stack = {start}, [start]
    while stack:
        node = stack.pop()
        if node in stop and node is not start:
            continue
        for parent in parents.get(node, ()):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found
