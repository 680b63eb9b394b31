"""The host step in tiles (Note [the host step in tiles]): offloaded, and in memory over fp32 masters on the CPU;
what it allocates, and that it trains as the step over staged fp32 gradients does."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import initialize
from engine.models.gpt import GPT, GPTConfig
from engine.zero.fused_tiles import MastersFromSources
from offload.device_memory import DEVICE_TO_HOST, SEPARATE_ENV, DeviceMemory
from offload.staging_ring import StagingRing
from tests.reference import assert_close_relative, assert_params_close, trained_params

LARGE = 1 << 20  # bytes
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


class LargeAllocations(TorchDispatchMode):
    """Records every op that returns a fresh tensor (not a view, not in place) of at least LARGE bytes."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = not any(a.alias_info is not None for a in func._schema.returns)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if fresh and isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= LARGE:
                self.seen.append(f"{func} -> {tuple(t.shape)} {t.dtype}")
        return out


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=256))


def _config(precision: str, offload: bool) -> dict:
    zero = {"stage": 2, "chunk_size": 1 << 20}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": ADAMW},
            "gradient_clipping": 0.5, "zero_optimization": zero, "steps_per_print": 10**9,
            **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
            **({"fp16": {"enabled": True, "initial_scale_power": 8}} if precision == "fp16" else {})}


def _train(engine, steps: int = 3, watch: LargeAllocations | None = None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        x = torch.randint(0, 256, (2, 8), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        if watch is not None and i == steps - 1:
            with watch:
                engine.step()
        else:
            engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_the_offloaded_step_allocates_no_large_host_tensor_and_trains_as_in_memory(monkeypatch, precision):
    monkeypatch.setenv(SEPARATE_ENV, "1")
    reference = initialize(_gpt(), _config(precision, offload=False))
    expected = _train(reference)
    engine = initialize(_gpt(), _config(precision, offload=True))
    watch = LargeAllocations()
    losses = _train(engine, watch=watch)
    assert watch.seen == []  # the scratch tiles were made by the first step and are reused
    assert engine.skipped_steps == reference.skipped_steps == 0
    assert_close_relative(losses, expected)
    assert_params_close(trained_params(engine), trained_params(reference))
    assert all(info["tiled"] for *_, info in engine.optimizer._items)
    engine.close()
    reference.close()


def test_the_allocation_check_sees_a_large_fresh_tensor():
    watch = LargeAllocations()
    with watch:
        torch.empty(LARGE // 4 + 1).float()
        torch.zeros(16)
    assert len(watch.seen) == 1


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_masters_stepped_from_their_16_bit_gradients_equal_staged_ones_bit_for_bit(precision, stage):
    """The config's AdamW steps the masters in tiles from the 16-bit gradients; a client's torch AdamW (fused) is
    pointed at the masters and steps staged fp32 gradients: the same values, bit for bit, overflow skips included
    (fp16 starts at a loss scale of 2^30)."""
    def run(client: bool):
        cfg = _config(precision, offload=False)
        cfg["zero_optimization"]["stage"] = stage
        if precision == "fp16":
            cfg["fp16"]["initial_scale_power"] = 30
        model = _gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                      weight_decay=ADAMW["weight_decay"], fused=True) if client else None
        if client:
            del cfg["optimizer"]
        engine = initialize(model, cfg, optimizer=optimizer)
        watch = LargeAllocations()
        losses = _train(engine, steps=4, watch=None if client else watch)
        out = (type(engine.optimizer), losses, trained_params(engine), engine.skipped_steps, watch.seen)
        engine.close()
        return out

    tiled, staged = run(client=False), run(client=True)
    assert tiled[0] is MastersFromSources and staged[0] is not MastersFromSources
    assert tiled[1] == staged[1] and tiled[3] == staged[3]
    assert (tiled[3] > 0) == (precision == "fp16")
    for name, value in staged[2].items():
        assert torch.equal(tiled[2][name], value), name
    assert tiled[4] == []  # no fp32 gradient staged: nothing large allocated by the step


@pytest.mark.parametrize("backwards", [1, 2])
def test_the_norm_taken_as_shards_go_down_equals_the_one_read_back(monkeypatch, backwards):
    """Note [the norm where the gradient is reduced]: one backward at the boundary leaves every shard's norms
    measured before the step; a second one adds to the shards, and their norms are read back instead. Either way
    the clipped update equals the in-memory one."""
    monkeypatch.setenv(SEPARATE_ENV, "1")
    engines = [initialize(_gpt(), _config("bf16", offload=offload)) for offload in (False, True)]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for _ in range(backwards):
            x = torch.randint(0, 256, (2, 8), generator=g)
            for engine in engines:
                engine.backward(engine(x, x))
        measured = len(engines[1].chunked._retired_norms)
        assert measured == (len(engines[1].chunked.states) if backwards == 1 else 0)
        for engine in engines:
            engine.step()
    assert engines[1].get_global_grad_norm() == engines[0].get_global_grad_norm() > 0.5  # clipped at 0.5
    assert_params_close(trained_params(engines[1]), trained_params(engines[0]))
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("precision,stage,per_tensor", [("bf16", 2, False), ("fp32", 2, False), ("fp16", 3, False),
                                                        ("bf16", 2, True)])
def test_the_steps_copies_across_the_bus_are_non_blocking_from_pinned_memory(monkeypatch, precision, stage,
                                                                              per_tensor):
    """Note [staged copies], through the recording seam: every copy backward and the step make across the bus is
    issued non-blocking from pinned host memory (what a GPU is asked for; a CPU-only torch has none to pin), and the
    bytes are what they move: the reduced gradient shards down as backward retires them; in the step, the rounded
    16-bit values up, or fp32 values of the device down and back up. per_tensor: torch's single-tensor AdamW
    (`torch_adam`), stepped a whole tensor at a time, not in tiles."""
    monkeypatch.setenv(SEPARATE_ENV, "1")
    cfg = _config(precision, offload=True)
    cfg["zero_optimization"]["stage"] = stage
    cfg["optimizer"]["params"]["torch_adam"] = per_tensor
    engine = initialize(_gpt(), cfg)
    assert all(info["tiled"] != per_tensor for *_, info in engine.optimizer._items)
    memory = engine.optimizer.manager.memory
    _train(engine, steps=1)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    loss = engine(x, x)
    memory.requests.clear()
    down = memory.bus.device_to_host
    engine.backward(loss)
    stepped = sum(p.numel() for _, p, _, _ in engine.optimizer._items)
    width = 4 if precision == "fp32" else 2
    assert memory.bus.device_to_host - down == width * stepped  # each gradient shard once
    up, down = memory.bus.host_to_device, memory.bus.device_to_host
    engine.step()
    assert memory.requests and all(pinned and non_blocking for _, pinned, non_blocking in memory.requests), \
        dict(memory.requests)
    assert memory.bus.host_to_device - up == width * stepped
    assert memory.bus.device_to_host - down == (4 * stepped if precision == "fp32" else 0)
    engine.close()


def test_micro_batch_gradients_added_on_the_host_come_down_through_pinned_tiles(monkeypatch):
    """Note [staged copies]: with gradient accumulation, each micro-batch's shard goes down (the first into the
    held buffer, the next ones added to it a pinned tile at a time), all non-blocking, and the accumulated
    update equals the one without offload."""
    monkeypatch.setenv(SEPARATE_ENV, "1")
    engines = []
    for offload in (False, True):
        cfg = _config("bf16", offload=offload)
        cfg["gradient_accumulation_steps"] = 3
        engines.append(initialize(_gpt(), cfg))
    reference, engine = engines
    memory = engine.optimizer.manager.memory
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        memory.requests.clear()
        down = memory.bus.device_to_host
        for _ in range(3):
            x = torch.randint(0, 256, (2, 8), generator=g)
            for e in engines:
                e.backward(e(x, x))
                e.step()
        assert all(pinned and non_blocking for _, pinned, non_blocking in memory.requests), dict(memory.requests)
        stepped = sum(p.numel() for _, p, _, _ in engine.optimizer._items)
        assert memory.bus.device_to_host - down == 3 * 2 * stepped  # every micro-batch's bf16 shard, once
    assert_params_close(trained_params(engine), trained_params(reference))
    for e in engines:
        e.close()


def test_micro_batch_gradients_accumulate_on_the_device_where_its_budget_holds_them(monkeypatch):
    """With a device_budget that holds the gradient shards but not their optimizer states (Note [device tier]),
    once the first step has traced the chunks' use, the micro-batches add into the shards on the device and each
    shard goes down once per step, to be stepped on the host with its states; the result equals the run without
    offload."""
    monkeypatch.setenv(SEPARATE_ENV, "1")
    engines = []
    for offload in (False, True):
        cfg = _config("bf16", offload=offload)
        cfg["gradient_accumulation_steps"] = 3
        if offload:
            cfg["memory"] = {"device_budget": "8MB"}
        engines.append(initialize(_gpt(), cfg))
    reference, engine = engines
    manager = engine.optimizer.manager
    stepped = sum(p.numel() for _, p, _, _ in engine.optimizer._items)
    assert 2 * stepped < 8_000_000 < 12 * stepped  # the bf16 gradient shards fit, their fp32 states do not
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        bus, moved = manager.memory.bus.device_to_host, manager.stats.moved_bytes["device->cpu"]
        for _ in range(3):
            x = torch.randint(0, 256, (2, 8), generator=g)
            for e in engines:
                e.backward(e(x, x))
                e.step()
        if step > 0:
            assert manager.memory.bus.device_to_host == bus  # no micro-batch's shard went down on its own
            assert manager.stats.moved_bytes["device->cpu"] - moved == 2 * stepped  # each shard once, to be stepped
    assert_params_close(trained_params(engine), trained_params(reference))
    for e in engines:
        e.close()


class Copies(TorchDispatchMode):
    """Records the source address of every copy_."""

    def __init__(self):
        super().__init__()
        self.sources: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "aten::copy_":
            self.sources.append(args[1].data_ptr())
        return func(*args, **(kwargs or {}))


def test_tiles_of_the_device_come_down_one_tile_ahead_of_the_host():
    """Note [staged copies]: while the host works on tile i, tile i + 1 is already on its way down, into the other
    slot; every tile arrives whole, and the two slots alternate."""
    memory = DeviceMemory("cpu", separate=True)
    ring = StagingRing(memory, tile=64)
    device = torch.arange(5 * 64 - 10, dtype=torch.float32)
    starts = list(range(0, device.numel(), 64))
    watch, seen, slots = Copies(), [], []
    with watch:
        for start, slot, key in ring.tiles_down(device, 64):
            issued = list(watch.sources)
            seen.append(start)
            slots.append(slot.data_ptr())
            assert torch.equal(slot, device[start:start + 64])
            following = starts[starts.index(start) + 1:]
            if following:  # the next tile's copy was issued before the host got this one
                assert device[following[0]:].data_ptr() in issued
                assert device[following[1]:].data_ptr() not in issued if len(following) > 1 else True
            ring.send_slot_up(device[start:start + slot.numel()], slot.mul_(2), key)
    assert seen == starts
    assert len(set(slots)) == 2 and all(a != b for a, b in zip(slots, slots[1:]))
    assert torch.equal(device, torch.arange(5 * 64 - 10, dtype=torch.float32) * 2)
    assert memory.requests[(DEVICE_TO_HOST, True, True)] == len(starts)
