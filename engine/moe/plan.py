"""Finding a model's MoE layers and placing their experts over the expert-parallel ranks (Note [expert parallelism]).

Three kinds of layer are found, in an unmodified model:
- engine.moe.MoE layers (the user's, DeepSpeed's API): experts as a ModuleList, kept by global id;
- a Hugging Face 5.x model's experts modules, named by its config's `base_model_ep_plan` (Note [experts of an
  unmodified model]): replaced, under the same name, by DispatchedExperts;
- a Hugging Face 4.x model's MoE blocks, experts in a ModuleList (Note [experts in a module list]): replaced,
  under the same name, by RoutedExpertList.
The last two are routed by Tiers only when the config has a `moe` section.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
from torch import nn

from engine.comm import CommCounter, all_gather_into, all_reduce_sum, broadcast_from
from engine.mesh import Mesh
from engine.moe.aux_losses import AuxLossSink
from engine.moe.dispatch import ExpertPlacement, ExpertTraffic
from engine.moe.expert_list import RoutedExpertList, is_expert_list_block, routed_block_class
from engine.moe.experts import DispatchedExperts
from engine.moe.layer import MoE

EXPERT_LISTS = (MoE, RoutedExpertList)  # experts as modules under their global ids (`<layer>.experts.<id>.`)


class ExpertParallel:
    """A model's MoE layers after placement: their expert parameters, what they routed, their router losses."""

    def __init__(self, layers: dict[str, nn.Module], sink: AuxLossSink, ep_size: int, dropped: set[int]):
        self.layers, self.sink, self.ep_size = layers, sink, ep_size
        self.dropped = frozenset(dropped)  # ids of the parameters of experts other ranks hold
        for layer in layers.values():  # routing counted in the engine's forwards only (not in recomputes)
            layer.traffic.counting = False

    def expert_params(self) -> list[nn.Parameter]:
        """This rank's experts' parameters (dense parameters of MoE layers, the gate and residual MLP, excluded)."""
        params = []
        for layer in self.layers.values():
            experts = layer.experts if isinstance(layer, EXPERT_LISTS) else layer
            params += list(experts.parameters())
        return params

    def join_state_dict(self, local: dict[str, torch.Tensor], group, counter: CommCounter,
                        device: torch.device) -> dict[str, torch.Tensor]:
        """Every expert's tensors in a state dict of this rank's (a collective over the ep group): fused expert
        tensors joined along their first dimension, engine.moe.MoE experts under their global ids."""
        if self.ep_size == 1:
            return local
        out = dict(local)
        for name, layer in self.layers.items():
            if isinstance(layer, EXPERT_LISTS):
                p = layer.placement
                for j, gid in enumerate(layer.experts):
                    prefix = f"{name}.experts.{gid}."
                    for key in [k for k in local if k.startswith(prefix)]:
                        rest = key[len(prefix):]
                        for r, t in enumerate(self._gathered(local[key], group, counter, device)):
                            out[f"{name}.experts.{r * p.local + j}.{rest}"] = t
                continue
            for key, _ in layer.named_parameters():
                full = f"{name}.{key}"
                if full in local:
                    out[full] = torch.cat(self._gathered(local[full], group, counter, device))
        return out

    def _gathered(self, t: torch.Tensor, group, counter: CommCounter, device: torch.device) -> list[torch.Tensor]:
        """Every ep rank's `t` (the same shape on each), in ep-rank order, on t's device."""
        mine = t.to(device, copy=True).contiguous()
        every = torch.empty((self.ep_size,) + tuple(mine.shape), dtype=mine.dtype, device=device)
        all_gather_into(every.view(-1), mine.view(-1), group, counter, async_op=False)
        return [x.to(t.device) for x in every.unbind(0)]

    def extents(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """id(parameter) -> (its first element in the whole tensor, the whole tensor's shape) for the fused expert
        tensors of Hugging Face layers: this rank's experts are a contiguous slice of the whole (experts first)."""
        out = {}
        for layer in self.layers.values():
            if isinstance(layer, DispatchedExperts):
                p = layer.placement
                for t in layer.parameters():
                    out[id(t)] = (p.first * math.prod(t.shape[1:]), (p.num_experts,) + tuple(t.shape[1:]))
        return out

    def names_an_expert(self, name: str) -> bool:
        """Whether `name` is a parameter of an expert kept by global id (whichever ep rank holds it)."""
        return any(re.match(re.escape(layer) + r"\.experts\.\d+\.", name) for layer, module in self.layers.items()
                   if isinstance(module, EXPERT_LISTS))

    def traffic(self) -> dict[str, ExpertTraffic]:
        return {name: layer.traffic for name, layer in self.layers.items()}

    @contextlib.contextmanager
    def collecting(self):
        """Around the engine's forward: router losses from engine.moe.MoE layers are kept for backward, and the
        routing is counted."""
        for layer in self.layers.values():
            layer.traffic.counting = True
        try:
            with self.sink.collecting():
                yield
        finally:
            for layer in self.layers.values():
                layer.traffic.counting = False

    def take_aux_loss(self) -> torch.Tensor | None:
        return self.sink.take()

    def metrics(self, groups: list, counter: CommCounter, device: torch.device) -> dict[str, float]:
        """Since the last call, summed over `groups` in turn (collectives: every rank calls it; the ranks routing
        different tokens of a layer, and under a pipeline the stages, each counting only its own layers): tokens
        each expert received, the fraction of assignments dropped by capacity, and this rank's token-exchange
        bytes."""
        metrics: dict[str, float] = {}
        names = list(self.layers)
        counts = torch.stack([self.layers[n].traffic.tokens_per_expert for n in names]).double()
        totals = torch.tensor([[float(self.layers[n].traffic.routed), float(self.layers[n].traffic.dropped)]
                               for n in names], dtype=torch.float64)
        both = torch.cat([counts.reshape(-1), totals.reshape(-1)]).to(device)  # (nccl reduces device tensors)
        if torch.distributed.is_initialized():
            for group in groups:
                all_reduce_sum(both, group, counter, async_op=False)
        both = both.cpu()
        counts, totals = both[:counts.numel()].view_as(counts), both[counts.numel():].view_as(totals)
        for i, name in enumerate(names):
            for e, c in enumerate(counts[i].tolist()):
                metrics[f"MoE/{name}/tokens_expert_{e}"] = c
            routed, dropped = totals[i].tolist()
            metrics[f"MoE/{name}/drop_rate"] = dropped / routed if routed else 0.0
            traffic = self.layers[name].traffic
            metrics[f"MoE/{name}/all_to_all_bytes"] = float(traffic.comm.all_to_all_bytes)
            traffic.reset()
        return metrics


def _pattern(key: str) -> re.Pattern:
    return re.compile(r"(?:.+\.)?" + re.escape(key).replace(r"\*", r"\d+") + r"$")


def hf_expert_modules(model: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """name -> (experts module, the parameter names split by expert), from the model's base_model_ep_plan."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    containers = [_pattern(k) for k, v in plan.items() if v == "ep_dispatch_experts"]
    split = {k: v for k, v in plan.items() if v != "ep_dispatch_experts"}
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, DispatchedExperts) or not any(p.match(name) for p in containers):
            continue
        params = [key for key, _ in module.named_parameters(recurse=False)
                  if any(_pattern(k).match(f"{name}.{key}") for k in split)]
        found[name] = (module, params)
    return found


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_expert_parallel(model: nn.Module, cfg, mesh: Mesh, comm: CommCounter, tp_split: frozenset[str] = frozenset(),
                          pipelined: bool = False) -> ExpertParallel | None:
    """Note [expert parallelism]: every MoE layer of `model` keeps this rank's experts (its place on the mesh's ep
    axis), whose values start as the ZeRO group's first rank's; None when the model has no MoE layer Tiers routes.
    `cfg`: the moe section; `tp_split`: names of the parameters a tensor-parallel plan split (none may be inside an
    MoE layer); `pipelined`: the model will be cut into pipeline stages."""
    ep_group, ep_size, ep_rank, dp_group = mesh.ep.group, mesh.ep.size, mesh.ep.rank, mesh.zero.group
    sink = AuxLossSink()
    layers: dict[str, nn.Module] = {}
    dropped: set[int] = set()
    moe_layers = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    hf = hf_expert_modules(model) if cfg.routes_model_experts else {}
    lists = {n: m for n, m in model.named_modules() if cfg.routes_model_experts and is_expert_list_block(m)
             and not isinstance(m, EXPERT_LISTS)}
    if not moe_layers and not hf and not lists:
        if cfg.enabled:
            raise ValueError(
                f"moe.expert_parallel_size {ep_size}: the model has no MoE layer Tiers can split: no engine.moe.MoE "
                "layer, and no experts module named by its config's base_model_ep_plan (Hugging Face 5.x MoE models: "
                "Mixtral, Qwen-MoE, ...); build its MoE layers with engine.moe.MoE, or set the size to 1")
        return None
    for name, module in [*moe_layers.items(), *((n, m) for n, (m, _) in hf.items()), *lists.items()]:
        _check_expert_tensors(name, module, ep_size)
        _check_whole_under_tensor_parallel(name, tp_split, ep_size)
    for name, layer in moe_layers.items():
        if layer.ep_size not in (1, ep_size):
            raise ValueError(f"{name}: engine.moe.MoE(ep_size={layer.ep_size}) but moe.expert_parallel_size is "
                             f"{ep_size}; they must agree (or leave ep_size at 1 and let the config decide)")
        placement = ExpertPlacement(layer.num_experts, ep_size, ep_rank, ep_group)
        _from_first_rank(layer.experts.parameters(), ep_size, dp_group, comm)
        dropped |= layer.keep_local_experts(placement)
        layer.aux_sink = sink
        layer.aux_loss_coef = cfg.aux_loss_coef or 0.0
        layer.z_loss_coef = cfg.z_loss_coef
        layers[name] = layer
    if hf or lists:
        _check_model_losses(model, cfg, pipelined)
    for name, (experts, params) in hf.items():
        placement = ExpertPlacement(experts.num_experts, ep_size, ep_rank, ep_group)
        _from_first_rank(experts.parameters(), ep_size, dp_group, comm)
        dispatched = DispatchedExperts(experts, params, placement, cfg.capacity_factor, cfg.min_capacity, name)
        _replace(model, name, dispatched)
        layers[name] = dispatched
    for name, block in lists.items():
        placement = ExpertPlacement(len(block.experts), ep_size, ep_rank, ep_group)
        _from_first_rank(block.experts.parameters(), ep_size, dp_group, comm)
        routed = routed_block_class(type(block))(block, placement, cfg.capacity_factor, cfg.min_capacity, name)
        dropped |= {id(p) for i, e in enumerate(block.experts) if str(i) not in routed.experts for p in e.parameters()}
        _replace(model, name, routed)
        layers[name] = routed
    return ExpertParallel(layers, sink, ep_size, dropped)


def _check_expert_tensors(name: str, layer: nn.Module, ep_size: int) -> None:
    """Experts split over ranks must be all trainable parameters: buffers and frozen parameters live outside
    chunks, where they are broadcast and saved as dense ones (one copy for every rank) - wrong for experts."""
    experts = getattr(layer, "experts", layer)
    if ep_size == 1 or not isinstance(experts, nn.Module):
        return
    buffers = [n for n, _ in experts.named_buffers()]
    frozen = [n for n, p in experts.named_parameters() if not p.requires_grad]
    if buffers or frozen:
        raise ValueError(f"{name}: its experts hold buffers or frozen parameters ({(buffers + frozen)[:3]}), which "
                         "expert parallelism does not place yet; make them trainable parameters, or use "
                         "moe.expert_parallel_size 1")


def _check_whole_under_tensor_parallel(name: str, tp_split: frozenset[str], ep_size: int) -> None:
    """Under tensor parallelism an MoE layer stays whole on every tp rank (Note [expert parallelism]): each tp
    rank routes the same tokens to the same experts. A gate split by the plan would route on part of the logits,
    an expert split by it would need its own tp collectives; neither is built."""
    split = sorted(n for n in tp_split if n.startswith(f"{name}."))
    if split:
        raise ValueError(f"{name}: tensor_parallel.plan splits parameters inside this MoE layer ({split[:3]}); with "
                         f"moe.expert_parallel_size {ep_size} the MoE layer's gate and experts stay whole on every "
                         "tensor-parallel rank (its experts are split over the ep ranks instead); remove the globs "
                         "that match them from the plan, or give an explicit plan for the dense layers")


def _from_first_rank(params, ep_size: int, group, comm: CommCounter) -> None:
    """Whole expert tensors from data-parallel rank 0 before they are split (as a tensor-parallel plan does)."""
    if ep_size == 1 or not torch.distributed.is_initialized():
        return
    with torch.no_grad():
        for p in params:
            broadcast_from(p.data, 0, group, comm)


def _check_model_losses(model: nn.Module, cfg, pipelined: bool) -> None:
    """A Hugging Face model computes its own router loss (router_aux_loss_coef); the config may set its
    coefficient, and cannot add a z-loss to a router Tiers does not own. Inside a pipeline its last stage would
    compute that loss from its own layers' router logits only (only the hidden state crosses a stage boundary)."""
    if pipelined and getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError("pipeline.stages: this model adds its routers' aux loss (output_router_logits=True) from "
                         "every MoE layer's router logits, and in a pipeline only the hidden state crosses a stage "
                         "boundary, so the last stage would see its own layers' logits only; set "
                         "output_router_logits=False in its config, or build its MoE layers with engine.moe.MoE "
                         "(moe.aux_loss_coef then adds their router losses on every stage)")
    if cfg.z_loss_coef:
        raise ValueError(f"moe.z_loss_coef {cfg.z_loss_coef}: the router z-loss is added by engine.moe.MoE layers, and "
                         "this model's routers are its own; remove the key (or build the layers with engine.moe.MoE)")
    if cfg.aux_loss_coef is None:
        return
    if not hasattr(model, "router_aux_loss_coef") or not getattr(model.config, "output_router_logits", False):
        raise ValueError(f"moe.aux_loss_coef {cfg.aux_loss_coef}: this model adds its router's aux loss only with "
                         "output_router_logits=True in its config (router_aux_loss_coef is the coefficient); set it, "
                         "or remove the key")
    model.router_aux_loss_coef = cfg.aux_loss_coef
