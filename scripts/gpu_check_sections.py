"""The sections of scripts/gpu_check.py, each a function returning what it measured (run one per child process)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import platform
import sys
import tempfile
import time

import torch

from offload.device_memory import SEPARATE_ENV

H100_BF16_DENSE_FLOPS = 989e12  # the peak MFU is taken against


def run_section(name: str, simulate: bool) -> dict:
    if simulate:
        os.environ[SEPARATE_ENV] = "1"
    section = globals().get(f"section_{name}")
    if section is None:  # a section in a file of its own: scripts/gpu_check_<name>.py
        section = getattr(importlib.import_module(f"scripts.gpu_check_{name}"), f"section_{name}")
    with contextlib.redirect_stdout(sys.stderr):  # the child's stdout carries its JSON only
        return section(simulate)


def _device(simulate: bool) -> torch.device:
    return torch.device("cpu" if simulate else "cuda", 0 if not simulate else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _collect(device: torch.device) -> None:
    """Frees what earlier runs left for the cyclic collector, so that each run's peaks are its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _peaks(device: torch.device, baseline: int = 0) -> dict:
    """The allocator's peaks since the last reset, above `baseline` (what was allocated before the run began)."""
    if device.type != "cuda":
        return {}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device) - baseline,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}


# ---- env ---------------------------------------------------------------------------------------------------------
def section_env(simulate: bool) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "simulate": simulate}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        out.update(device=torch.cuda.get_device_name(0), memory_bytes=total, free_bytes=free,
                   nccl=torch.distributed.is_nccl_available(), capability=list(torch.cuda.get_device_capability(0)))
    dist = torch.distributed
    out["collectives"] = {n: hasattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single",
                                                         "all_gather_into_tensor", "reduce_scatter_tensor")}
    out["imports"] = {}
    for module in ("psutil", "numpy", "aiofiles", "xxhash", "safetensors", "tensorboard", "transformers",
                   "engine", "offload"):
        try:
            importlib.import_module(module)
            out["imports"][module] = "ok"
        except Exception as e:  # noqa: BLE001 - reported, not raised: this is the report
            out["imports"][module] = f"{type(e).__name__}: {e}"
    return out


# ---- device tier -------------------------------------------------------------------------------------------------
def _gpt(simulate: bool, big: dict | None = None):
    from engine.models.gpt import GPT, preset_config
    torch.manual_seed(0)
    if simulate:
        return GPT(preset_config("tiny", n_layer=4, n_embd=128, n_head=4, block_size=64))
    return GPT(preset_config("small", **(big or dict(n_layer=8, n_head=16, n_embd=1024, vocab_size=32000,
                                                     block_size=512))))


def _tier_config(stage: int, micro: int, offload: bool, param_offload: bool = False, device_budget=None,
                 nvme_dir: str | None = None) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    home = {"device": "nvme", "nvme_path": nvme_dir} if nvme_dir else {"device": "cpu"}
    if offload:
        zero["offload_optimizer"] = dict(home)
    if param_offload:
        zero["offload_param"] = dict(home)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "gradient_clipping": 1.0,
           "zero_optimization": zero, "steps_per_print": 10**9}
    if device_budget is not None:
        cfg["memory"] = {"device_budget": device_budget}
    return cfg


def _train_tiers(model, cfg: dict, batches, device: torch.device) -> dict:
    from engine import initialize
    _collect(device)
    baseline = _allocated(device)
    _reset_peak(device)
    start = time.perf_counter()
    engine = initialize(model, cfg)
    _sync(device)
    init = {"init_seconds": round(time.perf_counter() - start, 2),
            **{f"init_{k}": v for k, v in _peaks(device, baseline).items()}}
    init["init_device_state_bytes"] = sum(engine.device_state_bytes().values())
    manager = getattr(engine.optimizer, "manager", None)
    if manager is not None:  # the seam's measure of initialize's peak (Note [a bounded start])
        init["init_sampled_device_peak_bytes"] = manager.memory.sampled_peak
    losses, between, sampled_peak, times = [], [], 0, []
    for x in batches:
        _reset_peak(device)
        t = time.perf_counter()
        x = x.to(device)
        loss = engine(x, x)
        sampled_peak = max(sampled_peak, sum(engine.device_state_bytes().values()))
        engine.backward(loss)
        sampled_peak = max(sampled_peak, sum(engine.device_state_bytes().values()))
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        between.append(engine.device_state_bytes())
    out = {"losses": losses, "step_ms": [round(1e3 * s, 1) for s in times], **init, **_peaks(device, baseline),
           "device_bytes_between_steps": between[-1], "sampled_device_state_peak_bytes": sampled_peak,
           "allocated_before_bytes": baseline}
    if manager is not None:
        stats = manager.stats
        bus = manager.memory.bus.total + stats.moved_bytes["cpu->device"] + stats.moved_bytes["device->cpu"]
        out.update(moved_bytes=dict(stats.moved_bytes), bus_bytes=bus, engine_bus_bytes=manager.memory.bus.total,
                   device_tier_peak_bytes=stats.peak_bytes.get("device", 0), pinned=manager.pool.pinned,
                   device_budget=manager.budgets.device)
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    engine.close()
    del engine, model, x, loss
    _sync(device)
    # a closed, dropped engine should hold no device memory; what only the cyclic collector frees is reported apart
    out["left_after_close_bytes"] = _allocated(device) - baseline
    _collect(device)
    out["left_after_collect_bytes"] = _allocated(device) - baseline
    return out


def section_device_tier(simulate: bool) -> dict:
    device = _device(simulate)
    seq, micro, steps = (64, 4, 3) if simulate else (512, 4, 4)
    g = torch.Generator().manual_seed(1)
    vocab = 256 if simulate else 32000
    batches = [torch.randint(0, vocab, (micro, seq), generator=g) for _ in range(steps)]
    plain = _train_tiers(_gpt(simulate), _tier_config(2, micro, offload=False), batches, device)
    offloaded = _train_tiers(_gpt(simulate), _tier_config(2, micro, offload=True), batches, device)
    rel = max(abs(a - b) / abs(b) for a, b in zip(offloaded["losses"], plain["losses"]))
    # the same update on the host (offloaded) and on the device: CPU and CUDA Adam kernels may differ in the last bit
    tolerance = 1e-5 if simulate else 2e-3
    psi = offloaded["params"]
    budget = 4 * psi if simulate else 1 << 30  # a third of the fp32 master and Adam states
    cfg = _tier_config(3, micro, offload=True, param_offload=True, device_budget=budget)
    cfg["zero_optimization"]["chunk_size"] = psi // 16  # chunks that a share of fits in the budget
    budgeted = _train_tiers(_gpt(simulate), cfg, batches, device)
    auto_cfg = _tier_config(3, micro, offload=True, param_offload=True)
    auto_cfg["zero_optimization"].update(placement="auto", chunk_size=psi // 16)
    if simulate:  # the seam's device: the process as it is now plus room for a third of the states
        import psutil
        os.environ["TIERS_DEVICE_MEMORY_BYTES"] = str(psutil.Process().memory_info().rss + budget)
        auto_cfg["memory"] = {"device_margin": 0}
    auto = _train_tiers(_gpt(simulate), auto_cfg, batches, device)
    auto_rel = max(abs(a - b) / abs(b) for a, b in zip(auto["losses"], offloaded["losses"]))
    peak = offloaded.get("peak_allocated_bytes", offloaded["sampled_device_state_peak_bytes"])
    model_16bit = 2 * psi
    return {
        "device_bytes_between_steps": offloaded["device_bytes_between_steps"],
        "device_peak_bytes": peak,
        "init_device_peak_bytes": offloaded.get("init_peak_allocated_bytes",
                                                offloaded["init_sampled_device_peak_bytes"]),
        "device_budget": budget,
        "budgeted_device_tier_peak_bytes": budgeted["device_tier_peak_bytes"],
        "budgeted_within_budget": budgeted["device_tier_peak_bytes"] <= budget,
        "bus_bytes_per_param_per_step": round(offloaded["bus_bytes"] / psi / steps, 3),
        "losses_equal": rel <= tolerance, "losses_max_relative_difference": rel,
        "auto_losses_max_relative_difference": auto_rel, "auto_device_tier_peak_bytes": auto["device_tier_peak_bytes"],
        # Note [a bounded start]: ZeRO-3 with parameters offloaded starts within its device budget (the states the
        # budget lets live on the device, plus one chunk at a time); without a budget see gpt's stage-3 offload run
        "stage3_budgeted_init_device_peak_bytes": budgeted.get("init_peak_allocated_bytes",
                                                               budgeted["init_sampled_device_peak_bytes"]),
        "model_16bit_bytes": model_16bit,
        "peak_measured_by": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
        "engine.device_state_bytes, sampled after forward, backward and step (the seam has no allocator)",
        "runs": {"stage2_bf16": plain, "stage2_bf16_offload_cpu": offloaded, "stage3_offload_device_budget": budgeted,
                 "stage3_offload_auto": auto},
    }


# ---- chunk manager under a lagging stream ------------------------------------------------------------------------
def section_manager(simulate: bool) -> dict:
    result = {"main": _manager_stress(simulate, ops=400)}
    if not simulate and os.environ.get("TORCH_CUDA_SANITIZER") != "1":
        import subprocess
        code = ("import json,sys; sys.path.insert(0, %r); from scripts.gpu_check_sections import _manager_stress; "
                "print(json.dumps(_manager_stress(False, ops=60)))" % os.path.dirname(os.path.dirname(
                    os.path.abspath(__file__))))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40,
                              env=dict(os.environ, TORCH_CUDA_SANITIZER="1"))
        result["sanitizer"] = (done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip()
                               else {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-3000:]})
    return result


def _manager_stress(simulate: bool, ops: int) -> dict:
    """Random writes through accessed chunks on a small device budget, each after a kernel that keeps the compute
    stream busy, so that copies on the side stream race it unless ordered; checked byte-exact against a CPU shadow."""
    from offload.chunk import Location
    from offload.device_memory import DeviceMemory
    from offload.manager import Budgets, ChunkManager
    from offload.nvme import NvmeSettings
    device = _device(simulate)
    g = torch.Generator().manual_seed(0)
    sizes = [int(torch.randint(1000, 50_000, (1,), generator=g)) for _ in range(24)]
    shadow = [torch.randn(n, generator=g) for n in sizes]
    budget = sum(sizes) * 4 // 4  # a quarter of the chunks fit on the device at once
    with tempfile.TemporaryDirectory() as nvme, ChunkManager(device, Budgets(device=budget, cpu=sum(sizes) * 4 // 2),
                                                             nvme=NvmeSettings(nvme), memory=DeviceMemory(device, True),
                                                             pin_memory=device.type == "cuda") as manager:
        refs = [manager.register("stress", [t])[0].chunk for t in shadow]
        for i in range(ops):
            c = int(torch.randint(0, len(refs), (1,), generator=g))
            where = Location.DEVICE if torch.rand(1, generator=g).item() < 0.7 else Location.CPU
            (view,) = manager.access(refs[c], where)
            if device.type == "cuda" and where is Location.DEVICE:
                torch.cuda._sleep(200_000)  # the compute stream lags behind the host
            delta = float(i % 7 + 1)
            view.add_(delta)
            shadow[c].add_(delta)
            manager.release(refs[c])
            manager.end_iteration() if i % 40 == 39 else None
        _sync(device)
        mismatched = 0
        for c, ref in zip(refs, shadow):
            with manager.accessed(c, Location.CPU, writes=False) as (view,):
                mismatched += int(not torch.equal(view.cpu(), ref))
        stats = manager.stats
    return {"ops": ops, "chunks": len(refs), "mismatched_chunks": mismatched, "evictions": stats.evictions,
            "moved_bytes": dict(stats.moved_bytes)}


# ---- ring attention ----------------------------------------------------------------------------------------------
def section_ring(simulate: bool) -> dict:
    from engine.sequence_parallel import Attending
    from engine.sequence_parallel.ring_attention import KeyBlock, attend_block
    device = _device(simulate)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g).to(device, torch.bfloat16) for _ in range(3))
    pos = torch.arange(64, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out, _ = attend_block(q, pos, KeyBlock(k, v, pos), Attending(32 ** -0.5), fused=False)
    qd, kd, vd = (t.double() for t in (q, k, v))
    scores = (qd @ kd.transpose(-1, -2)) * 32 ** -0.5
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool, device=device).triu(1), float("-inf"))
    reference = torch.softmax(scores, -1) @ vd
    error = (out.double() - reference).abs().max().item()
    return {"max_abs_error_vs_fp64": error, "bf16_half_step_bound": reference.abs().max().item() * 2 ** -8,
            "ok": error <= reference.abs().max().item() * 2 ** -8 + 1e-6}


# ---- a ~1.2 B GPT ------------------------------------------------------------------------------------------------
def big_gpt_run(simulate: bool) -> tuple[dict | None, int, int, list[torch.Tensor]]:
    """The ~1.28 B GPT's shape (None: the tiny one), seq, micro batch and batches of the gpt and offload sections."""
    shape = None if simulate else dict(n_layer=24, n_head=16, n_embd=2048, vocab_size=32000, block_size=1024)
    seq, micro, steps = (64, 4, 3) if simulate else (1024, 2, 3)
    vocab = 256 if simulate else 32000
    g = torch.Generator().manual_seed(1)
    return shape, seq, micro, [torch.randint(0, vocab, (micro, seq), generator=g) for _ in range(steps)]


def section_gpt(simulate: bool) -> dict:
    device = _device(simulate)
    shape, seq, micro, batches = big_gpt_run(simulate)
    out = {"plain_pytorch": _train_plain(_gpt(simulate, shape), batches, device)}
    configs = {"tiers_stage0": _tier_config(0, micro, offload=False),  # (fully offloaded: the offload section)
               "tiers_stage3_offload_device_budget": _tier_config(3, micro, offload=True, param_offload=True,
                                                                  device_budget="8GB" if not simulate else 4_000_000)}
    for name, cfg in configs.items():
        run = _train_tiers(_gpt(simulate, shape), cfg, batches, device)
        run.pop("device_bytes_between_steps", None)
        out[name] = run
    tokens = micro * seq
    for run in (r for r in out.values() if isinstance(r, dict)):
        step = sorted(run["step_ms"])[len(run["step_ms"]) // 2] / 1e3  # the median step
        run["tokens_per_s"] = round(tokens / step, 1)
        run["mfu"] = round(6 * out["plain_pytorch"]["params"] * tokens / step / H100_BF16_DENSE_FLOPS, 4)
    return out


def _train_plain(model, batches, device: torch.device) -> dict:
    _collect(device)
    baseline = _allocated(device)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses, times = [], []
    _reset_peak(device)
    for x in batches:
        t = time.perf_counter()
        x = x.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return {"losses": losses, "step_ms": [round(1e3 * s, 1) for s in times], **_peaks(device, baseline),
            "params": sum(p.numel() for p in model.parameters())}


# ---- zero_init to NVMe -------------------------------------------------------------------------------------------
def section_zero_init(simulate: bool) -> dict:
    from engine import initialize, zero_init
    from engine.models.gpt import GPT, preset_config
    device = _device(simulate)
    shape = dict(n_layer=4, n_embd=128, n_head=4, block_size=64) if simulate else dict(
        n_layer=24, n_head=16, n_embd=1024, vocab_size=32000, block_size=512)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERS_NVME_DIR")) as nvme:
        cfg = _tier_config(3, 2, offload=True, param_offload=True, nvme_dir=nvme)
        _reset_peak(device)
        start = time.perf_counter()
        with zero_init(cfg):
            model = GPT(preset_config("small", **shape))
        x = torch.randint(0, 256, (2, 64)).to(device)
        engine = initialize(model, cfg)
        init_seconds = time.perf_counter() - start
        init_peaks = _peaks(device)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        _sync(device)
        stats = engine.optimizer.manager.stats
        out = {"params": sum(p.numel() for p in engine.module.parameters()), "init_seconds": round(init_seconds, 2),
               **{f"init_{k}": v for k, v in init_peaks.items()}, "loss": loss.item(), **_peaks(device),
               "resident_bytes": stats.resident_bytes, "moved_bytes": dict(stats.moved_bytes),
               "device_state_bytes": engine.device_state_bytes()}
        engine.close()
    return out
