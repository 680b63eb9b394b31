"""The training strategies the estimate and `tiers tune` compare, each a change to the user's config."""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """A ZeRO stage, where optimizer states and parameter shards live, a tensor-parallel size and a pipeline
    (`pp` stages run by `schedule`, `virtual_stages` per rank; world = pp x dp x tp)."""

    stage: int
    tp: int = 1
    offload_optimizer: str = "none"  # none, cpu, nvme
    offload_param: str = "none"
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def name(self) -> str:
        parts = ["DDP" if self.stage == 0 else f"ZeRO-{self.stage}"]
        if self.tp > 1:
            parts.insert(0, f"TP{self.tp}")
        if self.pp > 1:
            parts.insert(0, f"PP{self.pp}-{self.schedule}" + (f"-v{self.virtual_stages}" if self.virtual_stages > 1
                                                               else ""))
        if self.offload_optimizer != "none":
            parts.append(f"optim->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param->{self.offload_param}")
        return " ".join(parts)

    def config(self, base: dict, nvme_path: str | None) -> dict:
        """`base` (a config dict) with this strategy's keys set and every other key kept."""
        config = copy.deepcopy(base)
        zero = config.setdefault("zero_optimization", {})
        zero["stage"] = self.stage
        for key, device in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if device == "none":  # the whole section goes: its other keys (step_in_backward, ...) need offload
                zero.pop(key, None)
                continue
            section = {k: v for k, v in zero.get(key, {}).items() if k not in ("device", "nvme_path")}
            section["device"] = device
            if device == "nvme":
                section["nvme_path"] = nvme_path or "nvme"
            zero[key] = section
        if self.offload_optimizer == "none":
            config.get("memory", {}).pop("cpu_budget", None)  # a CPU budget needs offload (config validation)
        tensor_parallel = config.setdefault("tensor_parallel", {})
        tensor_parallel["size"] = self.tp
        if self.tp == 1:
            config.pop("tensor_parallel")
        if self.pp == 1:
            config.pop("pipeline", None)
        else:  # the section's other keys (partition) are kept
            pipeline = config.setdefault("pipeline", {})
            pipeline.update(stages=self.pp, schedule=self.schedule, virtual_stages=self.virtual_stages)
            if self.virtual_stages == 1:
                pipeline.pop("virtual_stages")
        return config


def candidate_strategies(world: int, tp_sizes: list[int], nvme: bool = True, offload_param: bool = True,
                         pp_sizes: list[int] = (), schedule: str = "1f1b", virtual_stages: int = 1) -> list[Strategy]:
    """Every stage / offload / tensor-parallel combination worth comparing at `world` ranks, cheapest
    communication first: DDP, ZeRO-1/2, TP, ZeRO-3, pipelines, then CPU offload and NVMe (parameters offloaded
    too, in one data-parallel rank as well: Note [paging in one process]). offload_param=False leaves out
    parameter offload. Each pipeline size in `pp_sizes` (world = pp x dp x tp) runs `schedule` (with
    `virtual_stages` per rank) with DDP, ZeRO-1 and ZeRO-1 with the optimizer on the CPU (ZeRO-2/3 would reduce
    or gather every micro-batch)."""
    offloads = ["cpu"] + (["nvme"] if nvme else [])
    for tp in tp_sizes:
        if tp < 1 or world % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the world size {world}")
    for pp in pp_sizes:
        if pp < 1 or world % pp:
            raise ValueError(f"pipeline size {pp} does not divide the world size {world}")
    sharded = [tp for tp in tp_sizes if world // tp > 1]  # ZeRO stages need 2+ data-parallel ranks
    out = [Strategy(0, tp) for tp in tp_sizes]
    out += [Strategy(stage, tp) for tp in sharded for stage in (1, 2)]
    out += [Strategy(3, tp) for tp in sharded]
    for tp in tp_sizes:
        for stage in ([1, 2, 3] if tp in sharded else [1, 3]):
            if tp in sharded or stage == 1:
                out += [Strategy(stage, tp, device) for device in offloads]
            if stage == 3 and offload_param:
                out += [Strategy(3, tp, device, device) for device in offloads]
    for pp in (pp for pp in pp_sizes if pp > 1):
        for tp in (tp for tp in tp_sizes if world % (pp * tp) == 0):
            dp = world // (pp * tp)
            pipeline = {"pp": pp, "schedule": schedule, "virtual_stages": virtual_stages}
            out += [Strategy(0, tp, **pipeline)]
            out += [Strategy(1, tp, **pipeline)] if dp > 1 else []
            out += [Strategy(1, tp, "cpu", **pipeline)]
    return sorted(out, key=lambda s: (s.offload_optimizer != "none", s.offload_optimizer == "nvme", s.pp > 1,
                                      s.stage == 3, s.tp > 1, s.pp, s.stage))
