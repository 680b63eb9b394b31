"""One pipeline rank's share of a model, its activations in flight and its bubble, for the estimate.

Note [estimating a pipeline]
With `pipeline.stages` = P (world = P x dp x tp) and v virtual stages per rank, the model is cut
into P·v stages and stage s lives on rank s mod P (Note [pipeline schedules as data]):
  units       the model's layer stack (its largest ModuleList or Sequential) gives one unit per
              layer; the modules before it (embeddings) are one unit, always on the first stage,
              and those after it (final norm, output head, the loss) one unit on the last; a
              tied embedding / output head is held by both
  partition   "parameters": contiguous stages with the largest stage's parameters smallest;
              "time": the same with the parameters matmuls use (embedding lookups cost nothing);
              "uniform": the same number of layers per stage; a list of module names: the units
              those names start begin a stage
  states      each rank's parameters (its v stages') are chunked and sharded over dp exactly as
              without a pipeline (Note [estimating model states])
  activations one micro-batch's bytes of a stage are what its units' forwards leave alive for the
              backward (Note [tracing activations]); walking the rank's actions (+ at F, - at B
              or W) gives the most it holds at once (GPipe: m micro-batches; 1F1B and zero bubble:
              P - r on rank r), plus the whole model's backward working memory (the step's
              peak less what its forward holds; the same for every rank, so too much for the
              ranks without the output head)
  time        `simulate` with unit costs gives the bubble (1F1B, GPipe: (P-1)/(m+P-1)); a step's
              compute is the busiest rank's share of the matmul parameters / (1 - bubble) of one
              unpipelined replica's, plus the point-to-point bytes: each micro-batch's output
              forward and its gradient back across every stage boundary
The estimator takes the rank whose device peak is highest as the strategy's row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from engine.estimate.activations import ActivationTrace
from engine.pipeline.schedules import ActionKind, Schedule, build_schedule
from engine.pipeline.simulate import simulate

PARTITIONS = ("parameters", "uniform", "time")


@dataclass(frozen=True)
class PipelineSpec:
    """The config's `pipeline` section (defaults as engine/config.py gives them)."""

    stages: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: str | tuple[str, ...] = "parameters"

    @classmethod
    def of(cls, config: dict, parsed: object = None) -> "PipelineSpec":
        """From the parsed config's `pipeline` section where it has one, else from the raw dict's."""
        section = getattr(parsed, "pipeline", None)
        if section is not None and hasattr(section, "stages"):
            values = {k: getattr(section, k) for k in ("stages", "schedule", "virtual_stages", "partition")
                      if hasattr(section, k)}
        else:
            values = {k: v for k, v in (config.get("pipeline") or {}).items()
                      if k in ("stages", "schedule", "virtual_stages", "partition")}
        if isinstance(values.get("partition"), (list, tuple)):
            values["partition"] = tuple(values["partition"])
        return cls(**values)


@dataclass(frozen=True)
class Unit:
    """A module (or the modules before / after the layer stack) that goes to one stage whole."""

    name: str
    kind: str  # "head": before the layers, "layer", "tail": after them
    modules: tuple[nn.Module, ...]
    params: tuple[int, ...]  # indexes into the trainable parameters (a tied weight in each unit using it)
    matmul_params: int  # elements of its parameters outside embeddings (what its compute grows with)


def model_units(model: nn.Module, trainable: Sequence[nn.Parameter]) -> list[Unit]:
    """Note [estimating a pipeline]: the model's units in forward order (registration order)."""
    index = {id(p): i for i, p in enumerate(trainable)}
    stack = _layer_stack(model)
    head: list[tuple[str, nn.Module]] = []
    layers: list[tuple[str, nn.Module]] = []
    tail: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        if module is stack:
            layers.extend((prefix + name, child) for name, child in module.named_children())
            return
        for name, child in module.named_children():
            if any(m is stack for m in child.modules()):
                walk(child, f"{prefix}{name}.")
            else:
                (tail if layers else head).append((prefix + name, child))

    if stack is None:  # no layer stack: the top-level children are the layers
        layers = list(model.named_children()) or [("", model)]
    else:
        walk(model, "")
    placed = {id(p) for _, m in head + layers + tail for p in m.parameters()}
    owned = [p for p in model.parameters() if id(p) in index and id(p) not in placed]

    def unit(name: str, kind: str, modules: list[nn.Module], extra: Sequence[nn.Parameter] = ()) -> Unit:
        params = {index[id(p)] for m in modules for p in m.parameters() if id(p) in index}
        params |= {index[id(p)] for p in extra}
        matmul = sum(p.numel() for m in modules for sub in m.modules() if not isinstance(sub, nn.Embedding)
                     for p in sub.parameters(recurse=False) if id(p) in index)
        return Unit(name, kind, tuple(modules), tuple(sorted(params)), matmul)

    out = []
    if head or owned:  # parameters of the modules on the path to the stack count as the head's
        out.append(unit(",".join(n for n, _ in head) or "(own)", "head", [m for _, m in head], owned))
    out += [unit(n, "layer", [m]) for n, m in layers]
    if tail:
        out.append(unit(",".join(n for n, _ in tail), "tail", [m for _, m in tail]))
    return out


def _layer_stack(model: nn.Module) -> nn.Module | None:
    """The ModuleList or Sequential of 2+ children holding the most parameters (the shallowest of equals)."""
    best, best_params = None, -1
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            count = sum(p.numel() for p in module.parameters())
            if count > best_params:
                best, best_params = module, count
    return best


def partition(units: Sequence[Unit], count: int, how: str | tuple[str, ...], sizes: Sequence[int]) -> list[list[int]]:
    """Note [estimating a pipeline]: the unit indexes of each of `count` contiguous stages; `sizes` are the
    trainable parameters' element counts."""
    n = len(units)
    if isinstance(how, tuple):
        return _named_partition(units, count, how)
    if how not in PARTITIONS:
        raise ValueError(f"pipeline.partition: {how!r} is not one of {', '.join(PARTITIONS)} or a list of module "
                         "names")
    layers = [i for i, u in enumerate(units) if u.kind == "layer"]
    if how == "uniform":
        if len(layers) < count:
            raise ValueError(f"pipeline: {count} stages of the same number of layers, but the model has "
                             f"{len(layers)} layers; use fewer stages")
        per, extra = divmod(len(layers), count)
        bounds = [0]
        for s in range(count):
            bounds.append(bounds[-1] + per + (s < extra))
        groups = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
        groups[0] = list(range(layers[0])) + groups[0]
        groups[-1] = groups[-1] + list(range(layers[-1] + 1, n))
        return groups
    if n < count:
        raise ValueError(f"pipeline: {count} stages, but the model splits into only {n} units (its "
                         f"{len(layers)} layers, the modules before and after them); use fewer stages")

    def weight(u: Unit) -> int:
        return u.matmul_params if how == "time" else sum(sizes[i] for i in u.params)

    return [list(range(a, b)) for a, b in _balanced([weight(u) for u in units], count)]


def _balanced(weights: Sequence[int], count: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of `count` non-empty parts with the heaviest part as light as can be."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for i in range(k, n - (count - k) + 1):
            for t in range(k - 1, i):
                value = max(best[k - 1][t], prefix[i] - prefix[t])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, t
    ends, i = [], n
    for k in range(count, 0, -1):
        ends.append((cut[k][i], i))
        i = cut[k][i]
    return ends[::-1]


def _named_partition(units: Sequence[Unit], count: int, names: tuple[str, ...]) -> list[list[int]]:
    starts = {0}
    for name in names:
        found = next((i for i, u in enumerate(units) for part in u.name.split(",")
                      if part == name or part.startswith(name + ".")), None)
        if found is None:
            raise ValueError(f"pipeline.partition: no module {name!r} starts a unit of the model (units: "
                             f"{', '.join(u.name for u in units)})")
        starts.add(found)
    bounds = sorted(starts) + [len(units)]
    if len(bounds) - 1 != count:
        raise ValueError(f"pipeline.partition: the names {list(names)} start {len(bounds) - 1} stages, but the "
                         f"pipeline has {count}; name the module that starts each stage")
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class PipelineEstimate:
    """Note [estimating a pipeline]: what the pipeline of one strategy costs."""

    stages: int  # pipeline ranks P
    schedule: str
    virtual_stages: int
    microbatches: int  # m = gradient_accumulation_steps
    bubble: float  # idle fraction of the step (simulated, unit costs)
    in_flight: tuple[int, ...]  # per rank: the most micro-batch stages whose activations it holds at once
    stage_params: tuple[int, ...]  # per stage: parameters it holds (a tied weight on both its stages)
    p2p_bytes: int  # per step: what the rank sending most sends (activations forward, gradients back)
    compute_factor: float  # a step's compute time over one unpipelined replica's for the same m micro-batches
    rank: int = 0  # the rank the estimate's row describes (the highest device peak)

    @property
    def starved(self) -> bool:
        """Fewer micro-batches than pipeline ranks: most of the step idles."""
        return self.microbatches < self.stages


@dataclass(frozen=True)
class RankShare:
    """One pipeline rank: the trainable parameters it holds (indexes, in the model's order), its activations."""

    params: tuple[int, ...]
    activations: int


def plan_pipeline(spec: PipelineSpec, units: Sequence[Unit], sizes: Sequence[int], trace: ActivationTrace | None,
                  microbatches: int, micro_batch: int) -> tuple[PipelineEstimate, list[RankShare]]:
    """Note [estimating a pipeline] for `spec` at `microbatches` micro-batches of `micro_batch` samples."""
    p, v = spec.stages, spec.virtual_stages
    schedule = build_schedule(spec.schedule, p, microbatches, v)
    sim = simulate(schedule)
    stages = partition(units, p * v, spec.partition, sizes)
    stage_params = [sorted({i for u in group for i in units[u].params}) for group in stages]
    held = trace.held_at(micro_batch) if trace is not None and trace.small.held else [0] * len(units)
    saved = [sum(held[u] for u in group) for group in stages]
    transient = max(trace.peak_at(micro_batch) - sum(held), 0) if trace is not None else 0
    shares = []
    for rank in range(p):
        mine = sorted({i for s in range(rank, p * v, p) for i in stage_params[s]})
        shares.append(RankShare(tuple(mine), _peak_held(schedule, rank, saved) + transient))
    outputs = trace.outputs_at(micro_batch) if trace is not None and trace.small.outputs else [0] * len(units)
    boundary = [outputs[group[-1]] for group in stages]
    sent = [sum(microbatches * ((boundary[s] if s < p * v - 1 else 0) + (boundary[s - 1] if s > 0 else 0))
                for s in range(rank, p * v, p)) for rank in range(p)]
    time = [sum(units[u].matmul_params for u in group) for group in stages]
    if not sum(time):
        time = [sum(sizes[i] for i in params) for params in stage_params]
    busiest = max(sum(time[s] for s in range(rank, p * v, p)) for rank in range(p)) / max(sum(time), 1)
    estimate = PipelineEstimate(p, spec.schedule, v, microbatches, sim.bubble, sim.peak_in_flight,
                                tuple(sum(sizes[i] for i in params) for params in stage_params), max(sent),
                                busiest / (1 - sim.bubble))
    return estimate, shares


def _peak_held(schedule: Schedule, rank: int, saved: Sequence[int]) -> int:
    """The most activation bytes `rank` holds at once walking its actions: a forward adds its stage's bytes for
    one micro-batch, the backward that frees them (whole, or W) takes them away."""
    held = peak = 0
    for a in schedule.actions[rank]:
        if a.kind is ActionKind.FORWARD:
            held += saved[a.stage]
            peak = max(peak, held)
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            held -= saved[a.stage]
    return peak
