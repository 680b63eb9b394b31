"""The `offload` section of scripts/gpu_check.py: offload on the GPU side by side, in one call.

On one model (the `gpt` section's ~1.28 B GPT, bf16, seq 1024 x 2; a tiny one with --simulate) and the same
batches, each timed per phase (forward, backward, step; the device synchronized after each) and whole
(`total_s`, what the ratios take), median of the steps after the first:
  plain_pytorch                    everything on the GPU (the device's compute for one step)
  tiers_stage3_offload_cpu         ZeRO-3, parameters and optimizer states on the CPU
  tiers_stage2_offload_optimizer   ZeRO-2, optimizer states (and fp32 masters) on the CPU
  fsdp2_cpu_offload                torch's FSDP2 with CPUOffloadPolicy (bf16 compute, fp32 reduce), one rank,
                                   torch's fused AdamW on the CPU
  host_floor                       torch's fused AdamW on the CPU over as many fp32 elements (the host's floor)
and the bus: pinned host <-> device copies of 256 MB; also initialize's device peak of the fully offloaded
run against the 16-bit model (Note [a bounded start]). The ratios the offload issue's targets are taken on:
stage 3 step / host floor, stage 3 step / FSDP2-offload step, stage 2 step / max(device compute, host floor,
bus time of its bytes).
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from scripts.gpu_check_sections import (
    _collect,
    _device,
    _gpt,
    _peaks,
    _reset_peak,
    _sync,
    _tier_config,
    big_gpt_run,
)

PHASES = ("forward", "backward", "step")


def section_offload(simulate: bool) -> dict:
    device = _device(simulate)
    shape, seq, micro, batches = big_gpt_run(simulate)
    owns_group = not dist.is_initialized()
    if owns_group:  # FSDP2 needs a process group; Tiers uses the same world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        out = {"bus": _bus(device)}
        runs = {"plain_pytorch": _plain,
                "tiers_stage3_offload_cpu": lambda *a: _tiers(*a, _tier_config(3, micro, True, param_offload=True)),
                "tiers_stage2_offload_optimizer": lambda *a: _tiers(*a, _tier_config(2, micro, offload=True)),
                "fsdp2_cpu_offload": _fsdp2}
        for name, run in runs.items():
            out[name] = run(_gpt(simulate, shape), batches, device)
            _collect(device)  # each run's memory gone before the next
    finally:
        if owns_group:
            dist.destroy_process_group()
    params = out["plain_pytorch"]["params"]
    out["host_floor"] = _host_floor(params)
    tokens = micro * seq
    for run in (r for r in out.values() if isinstance(r, dict) and "total_s" in r):
        run["tokens_per_s"] = round(tokens / run["total_s"], 1)
        run["model_tflops"] = round(6 * params * tokens / run["total_s"] / 1e12, 2)
    floor, stage3, stage2 = out["host_floor"]["step_s"], out["tiers_stage3_offload_cpu"], out[
        "tiers_stage2_offload_optimizer"]
    bus_s = (stage2["bus_bytes_per_step"] / out["bus"]["bytes_per_s"]) if out["bus"] else 0.0
    out["stage3_offload_init_peak_over_16bit_model"] = round(stage3["init_peak_device_bytes"] / (2 * params), 4)
    out["ratios"] = {
        "stage3_step_over_host_floor": round(stage3["total_s"] / floor, 3),  # target <= 2
        "stage3_step_over_fsdp2_offload_step": round(stage3["total_s"] / out["fsdp2_cpu_offload"]["total_s"], 3),
        "stage2_step_over_max_compute_floor_bus": round(
            stage2["total_s"] / max(out["plain_pytorch"]["total_s"], floor, bus_s), 3),  # target <= 1.3
        "stage2_bus_seconds": round(bus_s, 4)}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phased(batches, device: torch.device, forward, backward, step) -> dict:
    """Times forward / backward / step of each batch (synchronized after each phase); medians over the steps after
    the first (which compiles, pins and faults memory in)."""
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    losses = []
    for x in batches:
        x = x.to(device)
        t0 = time.perf_counter()
        loss = forward(x)
        _sync(device)
        t1 = time.perf_counter()
        backward(loss)
        _sync(device)
        t2 = time.perf_counter()
        step()
        _sync(device)
        t3 = time.perf_counter()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            times[phase].append(seconds)
        losses.append(loss.item())
    medians = {f"{p}_s": round(statistics.median(v[1:] or v), 4) for p, v in times.items()}
    total = [sum(times[p][i] for p in PHASES) for i in range(len(batches))]
    return {"losses": losses, **medians, "total_s": round(statistics.median(total[1:] or total), 4)}


def _plain(model, batches, device: torch.device) -> dict:
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def forward(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(x, x)

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    out = _phased(batches, device, forward, lambda loss: loss.backward(), step)
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def _tiers(model, batches, device: torch.device, cfg: dict) -> dict:
    from engine import initialize
    _reset_peak(device)
    start = time.perf_counter()
    engine = initialize(model, cfg)
    _sync(device)
    init_s = time.perf_counter() - start
    manager = getattr(engine.optimizer, "manager", None)
    # initialize's device peak (Note [a bounded start]): the allocator's; on the seam, what the engine sampled
    init_peak = _peaks(device).get("peak_allocated_bytes", manager.memory.sampled_peak if manager else 0)
    bus_before = _bus_bytes(manager)
    out = _phased(batches, device, lambda x: engine(x, x), engine.backward, engine.step)
    out.update(init_s=round(init_s, 2), init_peak_device_bytes=init_peak)
    out["bus_bytes_per_step"] = (_bus_bytes(manager) - bus_before) // len(batches)
    engine.close()
    return out


def _bus_bytes(manager) -> int:
    if manager is None:
        return 0
    moved = manager.stats.moved_bytes
    return manager.memory.bus.total + moved["cpu->device"] + moved["device->cpu"]


def _fsdp2(model, batches, device: torch.device) -> dict:
    """FSDP2 with torch's CPU offload: fp32 parameters and states on the CPU, bf16 compute on the device, torch's
    AdamW stepping on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # (no pinned memory without an accelerator)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, offload_policy=offload, mp_policy=mixed)
    fully_shard(model, offload_policy=offload, mp_policy=mixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)  # the floor's kernel

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    out = _phased(batches, device, lambda x: model(x, x), lambda loss: loss.backward(), step)
    return out


def _host_floor(numel: int, steps: int = 3) -> dict:
    """torch's fused AdamW on the CPU over `numel` fp32 elements, the median of `steps` after one."""
    p = torch.nn.Parameter(torch.full((numel,), 0.01))  # (randn of billions of elements takes longer than the steps)
    p.grad = torch.full((numel,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return {"step_s": round(statistics.median(times[1:]), 4), "elements": numel, "threads": torch.get_num_threads()}


def _bus(device: torch.device) -> dict:
    """Pinned host <-> device copies of 256 MB, seconds each way and the slower direction's bytes per second;
    {} without a device of its own."""
    if device.type != "cuda":
        return {}
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    seconds = {}
    for name, (dst, src) in {"host_to_device": (dev, host), "device_to_host": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        _sync(device)
        t = time.perf_counter()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        _sync(device)
        seconds[name] = (time.perf_counter() - t) / 4
    return {**{f"{k}_s": round(v, 5) for k, v in seconds.items()}, "bytes_per_s": n / max(seconds.values())}
