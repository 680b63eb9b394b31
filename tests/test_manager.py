"""ChunkManager: views alias chunks, budgets hold, evictions go one tier down, errors are clear and lose nothing."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from offload.chunk import Location
from offload.errors import OffloadError, SwapDirectoryError, SwapIntegrityError, SwapWriteError
from offload.manager import BudgetError, Budgets, ChunkManager
from offload.nvme import NvmeSettings
from offload.states import IllegalTransition, TensorState

KIB = 1024


def _tensors(n: int, numel: int = 256, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _manager(tmp_path=None, device=None, cpu=None, **kw) -> ChunkManager:
    nvme = NvmeSettings(str(tmp_path), block_size=4096) if tmp_path is not None else None
    return ChunkManager("cpu", Budgets(device=device, cpu=cpu), prefetch_depth=kw.pop("prefetch_depth", 0),
                        nvme=nvme, **kw)


def _locations(m: ChunkManager, n: int) -> list[str]:
    return [m.chunk(i).location.value for i in range(n)]


def test_register_packs_in_order_and_access_returns_views_that_alias_the_chunk():
    m = _manager()
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(20), torch.randn(2)]
    refs = m.register("param", tensors, capacity=20)
    assert [(r.chunk, r.index) for r in refs] == [(0, 0), (0, 1), (1, 0), (2, 0)]  # 12 + 5 fit, 20 does not
    assert m.chunks_of("param") == [0, 1, 2] and m.chunk(0).numel == 17 and m.chunk(2).numel == 2  # trimmed
    views = m.access(0, Location.DEVICE)
    assert torch.equal(views[0], tensors[0]) and torch.equal(views[1], tensors[1])
    payload = m.chunk(0).payload
    assert views[1].data_ptr() == payload.data_ptr() + 12 * 4  # packed right after the 3x4 tensor
    views[1].fill_(3.0)
    assert torch.equal(payload[12:17], torch.full((5,), 3.0))
    assert m.chunk(0).state is TensorState.COMPUTE and m.chunk(0).pinned
    m.release(0, TensorState.HOLD_AFTER_FWD)
    assert m.chunk(0).state is TensorState.HOLD and not m.chunk(0).pinned
    with pytest.raises(IllegalTransition):
        m.release(0, TensorState.HOLD_AFTER_BWD)  # HOLD_AFTER_FWD → HOLD_AFTER_BWD skips the backward use
    m.close()


def test_eviction_goes_one_tier_down_and_the_budget_holds(tmp_path):
    m = _manager(tmp_path, device=2 * KIB, cpu=3 * KIB)  # chunks of 1 KiB: 2 on the device, 3 on the CPU
    tensors = _tensors(6)
    m.register("param", tensors, capacity=256)
    assert _locations(m, 6) == ["nvme"] * 3 + ["cpu"] * 3  # the first three went down as later ones came
    for i in range(6):
        assert torch.equal(m.access(i, Location.DEVICE)[0], tensors[i])
        m.release(i)
        assert m.used_bytes(Location.DEVICE) <= 2 * KIB and m.used_bytes(Location.CPU) <= 3 * KIB
    assert _locations(m, 6) == ["nvme", "nvme", "cpu", "cpu", "device", "device"]
    assert m.pool.free_bytes == KIB  # a kept host buffer counts against the CPU budget too
    stats = m.stats
    assert stats.evictions > 0 and stats.moved_bytes["cpu->nvme"] > 0 and stats.moved_bytes["nvme->cpu"] > 0
    m.close()


def test_nothing_evictable_is_a_clear_error_naming_budget_demand_and_pins():
    m = _manager(device=2 * KIB)
    m.register("param", _tensors(3), capacity=256)
    m.access(0)
    m.access(1)
    with pytest.raises(BudgetError) as info:
        m.access(2)
    message = str(info.value)
    assert "cannot place 1.0 KiB more on the device tier: its budget is 2.0 KiB and 2.0 KiB are in use" in message
    assert "pinned in COMPUTE: 0 (param" in message and "1 (param" in message
    assert "raise the device budget" in message
    assert m.chunk(2).location is Location.CPU  # the failed access moved nothing
    m.release(1)
    assert torch.equal(m.access(2)[0], m.access(2)[0])  # room once 1 is released: 1 goes to the CPU
    assert m.chunk(1).location is Location.CPU
    m.close()


def test_chunk_larger_than_the_budget_is_a_clear_error():
    m = _manager(device=512)
    m.register("param", _tensors(1), capacity=256)
    with pytest.raises(BudgetError, match="larger than the whole device budget"):
        m.access(0)
    m.close()


def test_free_drops_the_payload_and_a_later_access_gets_zeros(tmp_path):
    m = _manager(tmp_path, cpu=4 * KIB)
    m.register("grad", _tensors(2), capacity=256, location=Location.NVME)
    m.free(0)
    assert m.chunk(0).location is Location.RELEASED and m.used_bytes(Location.NVME) == KIB
    assert not [n for n in os.listdir(m.store.path) if n.startswith("grad.0")]  # its swap file is gone
    assert torch.equal(m.access(0, Location.CPU)[0], torch.zeros(256))
    m.close()


def test_move_refuses_a_chunk_in_compute_and_a_missing_nvme_tier():
    m = _manager()
    m.register("param", _tensors(1), capacity=256)
    m.access(0)
    with pytest.raises(OffloadError, match="in use .* release it before moving it"):
        m.move(0, Location.CPU)
    m.release(0)
    with pytest.raises(OffloadError, match="no nvme_dir"):
        m.move(0, Location.NVME)
    m.close()


def test_missing_nvme_directory_is_a_clear_error(tmp_path):
    with pytest.raises(SwapDirectoryError, match="does not exist: create it"):
        _manager(tmp_path / "absent")


def test_altered_swap_file_is_refused_and_the_chunk_stays_on_nvme(tmp_path):
    m = _manager(tmp_path)
    tensors = _tensors(2)
    m.register("param", tensors, capacity=256, location=Location.NVME)
    [name] = [n for n in os.listdir(m.store.path) if n.startswith("param.0")]
    with open(os.path.join(m.store.path, name), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    cpu_before = m.used_bytes(Location.CPU)
    with pytest.raises(SwapIntegrityError, match="corrupt"):
        m.access(0, Location.CPU)
    assert m.chunk(0).location is Location.NVME and m.chunk(0).payload is None
    assert m.used_bytes(Location.CPU) == cpu_before  # the read buffer went back
    assert torch.equal(m.access(1, Location.CPU)[0], tensors[1])  # the rest is unaffected
    m.close()


def test_truncated_swap_file_is_refused(tmp_path):
    m = _manager(tmp_path)
    m.register("param", _tensors(1), capacity=256, location=Location.NVME)
    [name] = os.listdir(m.store.path)
    os.truncate(os.path.join(m.store.path, name), 512)
    with pytest.raises(SwapIntegrityError, match="truncated"):
        m.access(0, Location.CPU)
    assert m.chunk(0).location is Location.NVME
    m.close()


def test_full_disk_during_eviction_keeps_the_victim_on_the_cpu_with_its_data(tmp_path, monkeypatch):
    m = _manager(tmp_path, cpu=2 * KIB)
    tensors = _tensors(3)
    m.register("param", tensors[:2], capacity=256)

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    with pytest.raises(SwapWriteError, match="the disk is full"):
        m.register("param", tensors[2:], capacity=256)  # needs room: evicting chunk 0 to NVMe fails
    assert _locations(m, 2) == ["cpu", "cpu"]
    assert m.chunks_of("param") == [0, 1] and m.used_bytes(Location.CPU) <= 2 * KIB  # nothing half-registered
    with pytest.raises(KeyError, match="chunks 0..1"):
        m.chunk(2)
    monkeypatch.undo()
    for i in range(2):
        assert torch.equal(m.access(i, Location.CPU)[0], tensors[i])  # nothing was lost
        m.release(i)
    m.close()


def test_full_disk_on_a_real_small_filesystem(tmp_path):
    from tests.nvme_helpers import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "small", "size=48k") as small:
        m = ChunkManager("cpu", nvme=NvmeSettings(small, block_size=4096), prefetch_depth=0)
        tensors = _tensors(3, numel=8 * KIB)  # 32 KiB each: the second swap-out fills the filesystem
        m.register("param", tensors, capacity=8 * KIB)
        m.move(0, Location.NVME)
        with pytest.raises(SwapWriteError, match="the disk is full"):
            m.move(1, Location.NVME)
        assert m.chunk(1).location is Location.CPU
        for i in range(3):
            assert torch.equal(m.access(i, Location.CPU)[0], tensors[i])
            m.release(i)
        m.close()


def test_stats_count_resident_bytes_and_moves(tmp_path):
    m = _manager(tmp_path)
    m.register("param", _tensors(2), capacity=256)
    m.move(0, Location.NVME)
    m.move(1, Location.DEVICE)
    stats = m.stats
    assert stats.resident_bytes == {"device": KIB, "cpu": 0 + m.pool.free_bytes, "nvme": KIB}
    assert stats.moved_bytes == {"cpu->nvme": KIB, "cpu->device": KIB}
    scalars = stats.as_scalars()
    assert scalars["Offload/moved_bytes/cpu->nvme"] == KIB and "Offload/evictions" in scalars
    m.close()


def test_close_removes_the_swap_files(tmp_path):
    m = _manager(tmp_path)
    m.register("param", _tensors(2), capacity=256, location=Location.NVME)
    assert os.listdir(tmp_path)
    m.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(OffloadError, match="closed"):
        m.access(0)


def test_offload_stands_alone_without_engine():
    import subprocess
    import sys

    code = ("import sys, offload, offload.manager, offload.nvme, offload.tracer, offload.policy; "
            "assert not [m for m in sys.modules if m == 'engine' or m.startswith('engine.')], 'engine imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_a_chunk_only_read_since_its_swap_in_is_dropped_not_rewritten(tmp_path):
    m = _manager(tmp_path, cpu=KIB)  # room for one chunk: each access evicts the other
    tensors = _tensors(2)
    m.register("param", tensors, capacity=256, location=Location.NVME)
    writes = m.store.stats.writes
    for _ in range(3):
        for c in (0, 1):
            assert torch.equal(m.access(c, Location.CPU, writes=False)[0], tensors[c])
            m.release(c)
    assert m.store.stats.writes == writes and m.stats.clean_drops >= 5  # read back 6 times, never rewritten
    m.access(0, Location.CPU)[0].fill_(5.0)  # may write (the default): the next eviction writes it
    m.release(0)
    m.access(1, Location.CPU, writes=False)
    m.release(1)
    assert m.store.stats.writes == writes + 1
    assert torch.equal(m.access(0, Location.CPU)[0], torch.full((256,), 5.0))
    m.close()


def test_a_free_chunk_accessed_to_be_overwritten_is_not_zero_filled_first():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar)
            return func(*args, **(kwargs or {}))

    m = _manager()
    m.register("grad", [torch.zeros(()).expand(64)], capacity=64, zeros=True)
    for overwrites, fills in ((False, 1), (True, 0)):
        m.free(0)
        with Fills() as seen:
            (view,) = m.access(0, Location.CPU, overwrites=overwrites)
        assert seen.count == fills
        view.copy_(torch.arange(64.0))
        m.release(0)
        assert torch.equal(m.access(0, Location.CPU, writes=False)[0], torch.arange(64.0))
        m.release(0)
