"""NVMe tier: asynchronous swap files round-trip exact bytes, stay private, never outlive the store,
and every failure (bad directory, damaged file, full disk) is a clear error that destroys nothing."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from offload.direct_io import PAGE, aligned_empty
from offload.errors import OffloadError, SwapDirectoryError, SwapIntegrityError, SwapUsageError, SwapWriteError
from offload.nvme import NvmeStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _odd_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=dtype)


def _swap_files(store: NvmeStore) -> list[str]:
    return sorted(os.listdir(store.path))


@contextlib.contextmanager
def _tmpfs(path, options: str, readonly: bool = False):
    """A real tmpfs mounted on `path` for the block (needs CAP_SYS_ADMIN: skips on EPERM)."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.makedirs(path, exist_ok=True)
    target = os.fsencode(str(path))
    if libc.mount(b"tmpfs", target, b"tmpfs", 1 if readonly else 0, options.encode()) != 0:  # 1: MS_RDONLY
        err = ctypes.get_errno()
        if err == errno.EPERM:
            pytest.skip("cannot mount a tmpfs here (EPERM: not root / no CAP_SYS_ADMIN)")
        raise OSError(err, f"mount -t tmpfs -o {options} tmpfs {path}: {os.strerror(err)}")
    try:
        yield str(path)
    finally:
        if libc.umount2(target, 2) != 0:  # 2: MNT_DETACH
            raise OSError(ctypes.get_errno(), f"umount {path}")


# ---- round trips


@pytest.mark.parametrize("block_size", [4096, 1 << 20])
def test_round_trip_exact_bytes_with_many_writes_in_flight(tmp_path, block_size):
    cases = [(torch.float32, 1_000_003), (torch.bfloat16, 12_345), (torch.float16, 777), (torch.int64, 65_539),
             (torch.float32, 1), (torch.bfloat16, 0)]
    tensors = {f"chunk.{i}/{d}": _odd_tensor(d, n, i) for i, (d, n) in enumerate(cases)}
    with NvmeStore(str(tmp_path), block_size=block_size, queue_depth=3, threads=2) as store:
        handles = [store.write(k, t) for k, t in tensors.items()]  # all issued before any wait
        assert all(isinstance(h.done(), bool) for h in handles)
        for h in handles:
            h.wait()
        outs = {k: torch.full_like(t, 3) for k, t in tensors.items()}
        handles = [store.read(k, outs[k]) for k in tensors]
        for h in handles:
            h.wait()
        for k, t in tensors.items():
            assert outs[k].dtype == t.dtype and _bytes(outs[k]) == _bytes(t), k
        for name in _swap_files(store):  # padded to the block size
            assert os.path.getsize(os.path.join(store.path, name)) % block_size == 0
        stats = store.stats
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert (stats.writes, stats.reads) == (len(cases), len(cases))
        assert stats.bytes_written == stats.bytes_read == total
        assert stats.wait_seconds >= 0 and stats.throttled_seconds >= 0


def test_operations_on_one_key_run_in_issue_order(tmp_path):
    with NvmeStore(str(tmp_path), block_size=4096, queue_depth=2, threads=3) as store:
        first, second = torch.arange(5000.0), -torch.arange(5000.0)
        out_first, out_second = torch.zeros(5000), torch.zeros(5000)
        handles = [store.write("k", first), store.read("k", out_first),
                   store.write("k", second), store.read("k", out_second)]  # nothing waited in between
        for h in handles:
            h.wait()
        assert torch.equal(out_first, first) and torch.equal(out_second, second)
        assert store.stats.throttled_seconds >= 0 and store.keys() == ["k"]


def test_remove_deletes_the_file_and_forgets_the_key(tmp_path):
    with NvmeStore(str(tmp_path), block_size=4096) as store:
        store.write("a", torch.ones(10)).wait()
        store.write("b", torch.ones(10)).wait()
        store.remove("a")
        assert len(_swap_files(store)) == 1 and store.keys() == ["b"]
        with pytest.raises(SwapUsageError, match="'a'.*write it first"):
            store.read("a", torch.empty(10))
        with pytest.raises(SwapUsageError, match="never written"):
            store.remove("a")


def test_wrong_destination_or_source_is_a_clear_error(tmp_path):
    with NvmeStore(str(tmp_path), block_size=4096) as store:
        store.write("w", torch.ones(100)).wait()
        with pytest.raises(SwapUsageError, match=r"100 x torch.float32.*pass a tensor of that numel and dtype"):
            store.read("w", torch.empty(99))
        with pytest.raises(SwapUsageError, match="written as 100 x torch.float32"):
            store.read("w", torch.empty(100, dtype=torch.float16))
        with pytest.raises(SwapUsageError, match=r"contiguous.*pass .contiguous\(\)"):
            store.write("x", torch.ones(4, 4).t())
        with pytest.raises(SwapUsageError, match="non-empty strings"):
            store.write("", torch.ones(1))
    with pytest.raises(SwapUsageError, match="closed; create a new NvmeStore"):
        store.write("w", torch.ones(100))
    with pytest.raises(SwapUsageError, match="multiple of the page size"):
        NvmeStore(str(tmp_path), block_size=1000)


def test_falls_back_to_buffered_io_when_o_direct_is_refused(tmp_path, monkeypatch):
    """Seam: the kernel here accepts O_DIRECT on ext4 and tmpfs, so EINVAL on open is injected."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with NvmeStore(str(tmp_path), block_size=4096) as store:
        src, out = torch.randn(3001), torch.zeros(3001)
        with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
            store.write("k", src).wait()
        store.read("k", out).wait()
        assert torch.equal(src, out) and store.direct_io is False


def test_einval_during_a_transfer_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    """Seam: O_DIRECT opens fine but the transfer fails with EINVAL (e.g. a misaligned buffer): that must
    surface as an error, not silently switch the store to buffered I/O."""
    def einval(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    with NvmeStore(str(tmp_path), block_size=4096) as store:
        direct = store.direct_io
        monkeypatch.setattr(os, "pwrite", einval)
        with pytest.raises(SwapWriteError, match="errno 22"):
            store.write("k", torch.randn(100)).wait()
        assert store.direct_io == direct


def test_transfers_are_profiler_ranges(tmp_path):
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # worker threads too
    with NvmeStore(str(tmp_path), block_size=4096) as store:
        store.write("warm", torch.ones(1)).wait()  # the worker thread exists before profiling starts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=config) as prof:
            store.write("k", torch.ones(1 << 16)).wait()
            store.read("k", torch.empty(1 << 16)).wait()
    names = {e.name for e in prof.events()}
    assert {"tiers.nvme.write", "tiers.nvme.read"} <= names


# ---- aligned tensors: written in place, read through staging (Note [nvme direct io])


def _padding_of(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """The bytes of t's storage past its end, up to its padded size: not part of the tensor."""
    nbytes = t.numel() * t.element_size()
    start = t.storage_offset() * t.element_size() + nbytes
    size = -(-nbytes // block_size) * block_size - nbytes
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), start, (size,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_aligned_empty_is_page_aligned_padded_and_round_trips_without_staging_its_write(tmp_path, dtype):
    numel, block = 12_345, 1 << 16
    t = aligned_empty(numel, dtype, block)
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    assert (t.dtype, tuple(t.shape), t.is_contiguous(), t.device.type) == (dtype, (numel,), True, "cpu")
    assert t.data_ptr() % PAGE == 0 and room >= -(-numel * dtype.itemsize // block) * block
    src = torch.randint(0, 256, (numel,), dtype=torch.uint8) if dtype == torch.uint8 else _odd_tensor(dtype, numel, 5)
    t.copy_(src)
    with NvmeStore(str(tmp_path), block_size=block) as store:
        store.write("k", t).wait()
        assert store.stats.staged_transfers == 0  # written straight from its memory
        out = aligned_empty(numel, dtype, block)
        store.read("k", out).wait()
    assert _bytes(out) == _bytes(src) and aligned_empty(0, dtype).numel() == 0


def test_aligned_write_stages_nothing_and_reads_stage_without_touching_the_padding(tmp_path):
    """Reads stage even into an aligned tensor: the destination is written only after the CRC check."""
    block, n = 1 << 20, 300_000  # 1.2 MB: padded to 2 MiB
    src = aligned_empty(n, torch.float32, block).copy_(torch.randn(n))
    _padding_of(src, block).fill_(0xCD)  # not payload: goes to the file's padding, never checked
    out = aligned_empty(n, torch.float32, block).fill_(3.0)
    _padding_of(out, block).fill_(0xAB)  # e.g. a neighbouring view of the same storage
    with NvmeStore(str(tmp_path), block_size=block) as store:
        store.write("k", src).wait()
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (0, 0)
        store.read("k", out).wait()
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (1, 2 << 20)
    assert torch.equal(out, src) and bool((_padding_of(out, block) == 0xAB).all())


def test_unaligned_tensors_stage_whole_and_aligned_ones_without_room_only_their_tail(tmp_path):
    block, n = 1 << 20, 400_000  # 1.6 MB: padded to 2 MiB
    shifted = aligned_empty(n + 1, torch.float32, block)[1:].copy_(torch.randn(n))  # 4 bytes past a page
    plain = torch.randn(n)
    buffer = mmap.mmap(-1, n * 4)  # on a page, and its storage ends with the payload
    tight = torch.frombuffer(buffer, dtype=torch.float32).copy_(torch.randn(n))
    with NvmeStore(str(tmp_path), block_size=block) as store:
        store.write("shifted", shifted).wait()
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (1, 2 << 20)
        store.write("tight", tight).wait()  # its whole pages in place, the rest staged
        in_place = n * 4 // PAGE * PAGE
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (2, (4 << 20) - in_place)
        store.write("plain", plain).wait()
        assert store.stats.staged_transfers == 3
        for key, src in [("shifted", shifted), ("tight", tight), ("plain", plain)]:
            out = torch.empty(n)
            store.read(key, out).wait()
            assert torch.equal(out, src), key


def test_aligned_empty_memory_is_freed_with_the_tensor():
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc to read the resident set size")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    gc.collect()
    before = resident()
    t = aligned_empty(256 << 20, torch.uint8).fill_(1)
    assert resident() - before > 250 << 20
    del t
    gc.collect()
    assert resident() - before < 64 << 20  # freed (other threads of earlier tests may still move a few MB)


def test_aligned_empty_rejects_bad_arguments():
    with pytest.raises(ValueError, match=f"multiple of the page size {PAGE}, got 1000"):
        aligned_empty(10, torch.float32, 1000)
    with pytest.raises(ValueError, match="non-negative int numel, got -1"):
        aligned_empty(-1, torch.float32)
    with pytest.raises(TypeError, match="needs a torch.dtype, got 'float32'"):
        aligned_empty(10, "float32")


# ---- privacy and cleanup


def test_private_directory_and_files_are_owner_only(tmp_path):
    with NvmeStore(str(tmp_path), block_size=4096) as store:
        assert os.path.dirname(store.path) == str(tmp_path)
        assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
        store.write("a", torch.ones(10)).wait()
        store.write("a", torch.zeros(10)).wait()  # the replaced copy too
        store.write("b", torch.ones(10)).wait()
        files = _swap_files(store)
        assert len(files) == 2
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(store.path, name)).st_mode) == 0o600


def test_close_removes_every_file_and_the_directory(tmp_path):
    store = NvmeStore(str(tmp_path), block_size=4096)
    handles = [store.write(f"k{i}", torch.randn(10_000)) for i in range(5)]  # close waits for these
    store.close()
    assert all(h.done() for h in handles)
    assert os.listdir(tmp_path) == []
    store.close()  # idempotent


def test_store_collected_without_close_leaves_nothing(tmp_path):
    store = NvmeStore(str(tmp_path), block_size=4096)
    handle = store.write("k", torch.randn(10_000))
    handle.wait()
    assert os.listdir(tmp_path) != []
    del store, handle
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_interpreter_exit_without_close_leaves_nothing(tmp_path):
    program = textwrap.dedent(f"""
        import torch
        from offload.nvme import NvmeStore
        store = NvmeStore({str(tmp_path)!r}, block_size=4096)
        store.write("done", torch.randn(100_000)).wait()
        pending = store.write("pending", torch.randn(1_000_000))  # still in flight at exit, never waited
        print(store.path)
    """)
    result = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path))
    assert os.listdir(tmp_path) == []


# ---- unusable directories


def test_missing_directory_says_create_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SwapDirectoryError, match=f"{missing}.*does not exist: create it"):
        NvmeStore(str(missing))


def test_a_file_is_not_a_directory(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(SwapDirectoryError, match=f"{path}.*not a directory.*choose a writable directory"):
        NvmeStore(str(path))


def test_read_only_directory_says_choose_a_writable_one(tmp_path, monkeypatch):
    """As root, chmod 0o500 does not stop writes, so a real read-only tmpfs is mounted instead. Without
    root (no mount), chmod 0o500 is real. Only as root where mounting fails too is PermissionError
    injected through the seam tempfile.mkdtemp."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o500)
        try:
            with pytest.raises(SwapDirectoryError, match=f"{target}.*not writable.*choose a writable directory"):
                NvmeStore(str(target))
        finally:
            target.chmod(0o700)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", os.fsencode(str(target)), b"tmpfs", 1, b"size=1m") == 0:  # 1: MS_RDONLY
        try:
            assert not os.access(target, os.W_OK)  # EROFS: the kernel itself refuses writes
            with pytest.raises(SwapDirectoryError, match=f"{target}.*not writable.*choose a writable directory"):
                NvmeStore(str(target))
        finally:
            libc.umount2(os.fsencode(str(target)), 2)
        return
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(SwapDirectoryError, match=f"{target}.*not writable.*choose a writable directory"):
        NvmeStore(str(target))


# ---- damaged files


@pytest.fixture(params=["staged", "in_place"])
def aligned(request) -> bool:
    """Both write paths (Note [nvme direct io]): a plain tensor is staged, an aligned_empty one is not."""
    return request.param == "in_place"


def _host_tensor(aligned: bool, values: torch.Tensor) -> torch.Tensor:
    return aligned_empty(values.numel(), values.dtype, 4096).copy_(values) if aligned else values.clone()


def _damaged_store(tmp_path, aligned):
    store = NvmeStore(str(tmp_path), block_size=4096)
    store.write("victim", _host_tensor(aligned, torch.randn(3000))).wait()
    assert store.stats.staged_transfers == (0 if aligned else 1)
    [name] = _swap_files(store)
    return store, os.path.join(store.path, name)


def _assert_read_refused(store, path, match, aligned):
    out = _host_tensor(aligned, torch.full((3000,), 42.0))
    handle = store.read("victim", out)
    with pytest.raises(SwapIntegrityError, match=match) as info:
        handle.wait()
    assert path in str(info.value) and "destination was left unchanged" in str(info.value)
    assert torch.equal(out, torch.full((3000,), 42.0))  # no garbage in the destination


def test_truncated_file_is_refused_and_destination_kept(tmp_path, aligned):
    store, path = _damaged_store(tmp_path, aligned)
    os.truncate(path, 4096 // 2)
    _assert_read_refused(store, path, "is truncated: 2048 bytes, written as 12288", aligned)
    store.close()


def test_flipped_byte_is_refused_and_destination_kept(tmp_path, aligned):
    store, path = _damaged_store(tmp_path, aligned)
    with open(path, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x10]))
    _assert_read_refused(store, path, "is corrupt: CRC-32", aligned)
    store.close()


def test_deleted_file_is_refused_and_destination_kept(tmp_path, aligned):
    store, path = _damaged_store(tmp_path, aligned)
    os.unlink(path)
    _assert_read_refused(store, path, r"is missing \(deleted\)", aligned)
    store.close()


# ---- full disk


def _assert_full_disk_error(store, directory, info, needed):
    message = str(info.value)
    free = shutil.disk_usage(store.path).free
    assert f"NVMe directory {directory!r}" in message and "the disk is full" in message
    assert f"needs {needed} bytes and {free} bytes are free" in message
    assert isinstance(info.value, OffloadError) and isinstance(info.value.__cause__, OSError)
    assert not [n for n in _swap_files(store) if ".tmp" in n]  # the partial file is gone


def _assert_stale_read_refused_until_rewritten(store, key, old):
    """After a failed write the older file is kept on disk but never read back as current."""
    assert [n for n in _swap_files(store) if ".tmp" not in n]  # the previous file was not destroyed
    out = torch.full_like(old, 7)
    with pytest.raises(SwapIntegrityError, match=f"key '{key}' cannot be read: its last write failed"):
        store.read(key, out).wait()
    assert torch.equal(out, torch.full_like(old, 7))  # destination untouched
    store.write(key, old).wait()  # a successful write makes the key readable again
    store.read(key, out).wait()
    assert torch.equal(out, old)


def test_full_disk_on_a_real_small_filesystem(tmp_path):
    with _tmpfs(tmp_path / "small", "size=2m") as small:
        store = NvmeStore(small, block_size=4096)
        try:
            old = torch.randn(64 * 1024)  # 256 KiB
            store.write("a", old).wait()
            handle = store.write("a", torch.randn(1024 * 1024))  # 4 MiB: more than the whole filesystem
            with pytest.raises(SwapWriteError) as info:
                handle.wait()
            _assert_full_disk_error(store, small, info, 4 << 20)
            _assert_stale_read_refused_until_rewritten(store, "a", old)
            assert store.stats.writes == 2
        finally:
            store.close()
        assert os.listdir(small) == []


def test_full_disk_injected_enospc_after_a_partial_write(tmp_path, monkeypatch):
    """Seam: os.pwrite writes half of the first request, then fails with ENOSPC (any filesystem)."""
    store = NvmeStore(str(tmp_path), block_size=4096)
    old = torch.arange(2048, dtype=torch.int64)
    store.write("a", old).wait()
    real_pwrite = os.pwrite

    def half_then_enospc(fd, data, offset):
        if offset == 0 and len(data) > 4096:
            return real_pwrite(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", half_then_enospc)
    handle = store.write("a", torch.zeros(10_000, dtype=torch.int64))
    with pytest.raises(SwapWriteError) as info:
        handle.wait()
    _assert_full_disk_error(store, str(tmp_path), info, 81920)
    with pytest.raises(SwapWriteError):  # wait() re-raises every time
        handle.wait()
    monkeypatch.undo()
    _assert_stale_read_refused_until_rewritten(store, "a", old)
    store.close()
    assert os.listdir(tmp_path) == []


def test_forked_child_exiting_does_not_delete_the_parents_files(tmp_path):
    """A child forked from a process with a store runs the store's exit-time cleanup when it exits normally;
    the files belong to the parent, which must still read them afterwards."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        from offload.nvme import NvmeStore
        store = NvmeStore({str(tmp_path)!r}, block_size=4096)
        data = torch.arange(1000, dtype=torch.float32)
        store.write("k", data).wait()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit handlers, weakref finalizers run
        os.waitpid(pid, 0)
        out = torch.zeros(1000)
        store.read("k", out).wait()
        assert torch.equal(out, data)
        store.close()
        print("parent ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and "parent ok" in result.stdout, result.stderr
    assert os.listdir(tmp_path) == []


def _o_direct_supported(directory) -> bool:
    probe = os.path.join(directory, "probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return hasattr(os, "O_DIRECT")


def test_direct_io_is_used_where_the_filesystem_allows_it(tmp_path):
    store = NvmeStore(str(tmp_path), block_size=4096)
    data = torch.randn(3000)
    store.write("k", data).wait()
    out = torch.empty(3000)
    store.read("k", out).wait()
    assert torch.equal(out, data)
    assert store.direct_io == _o_direct_supported(str(tmp_path))
    store.close()


def test_at_most_queue_depth_requests_are_in_flight(tmp_path, monkeypatch):
    """With the workers held at a gate, write number queue_depth + 1 blocks its caller until one finishes."""
    import threading

    gate = threading.Event()
    real_pwrite = os.pwrite

    def gated_pwrite(*args):
        gate.wait(timeout=30)
        return real_pwrite(*args)

    monkeypatch.setattr(os, "pwrite", gated_pwrite)
    store = NvmeStore(str(tmp_path), block_size=4096, queue_depth=2, threads=1)
    handles = [store.write(f"k{i}", torch.randn(100)) for i in range(2)]  # fills the queue
    issued = threading.Event()
    extra = []
    caller = threading.Thread(target=lambda: (extra.append(store.write("k2", torch.randn(100))), issued.set()))
    caller.start()
    assert not issued.wait(timeout=0.3), "a third request was accepted while two were in flight"
    gate.set()
    caller.join(timeout=30)
    assert issued.is_set()
    for h in handles + extra:
        h.wait()
    assert store.stats.throttled_seconds > 0.2
    store.close()


def test_scratch_read_into_an_aligned_tensor_is_in_place_and_still_checked(tmp_path):
    from offload.direct_io import aligned_empty

    store = NvmeStore(str(tmp_path), block_size=4096)
    source = aligned_empty(3000, torch.float32, 4096).copy_(torch.randn(3000))
    store.write("k", source).wait()
    out = aligned_empty(3000, torch.float32, 4096)
    store.read("k", out, scratch=True).wait()
    assert _bytes(out) == _bytes(source) and store.stats.staged_transfers == 0  # no copy either way
    [name] = _swap_files(store)
    with open(os.path.join(store.path, name), "r+b") as f:
        f.seek(10)
        f.write(b"\x01\x02")
    with pytest.raises(SwapIntegrityError, match="corrupt.*scratch destination holds undefined bytes"):
        store.read("k", out, scratch=True).wait()
    plain = torch.zeros(3000)  # not aligned: scratch or not, it is staged
    with pytest.raises(SwapIntegrityError, match="destination was left unchanged"):
        store.read("k", plain, scratch=True).wait()
    assert torch.equal(plain, torch.zeros(3000))
    store.close()


def test_overwrite_in_place_reuses_the_file_and_a_failure_refuses_the_key(tmp_path, monkeypatch):
    store = NvmeStore(str(tmp_path), block_size=4096)
    big, small = torch.randn(5000), torch.randn(1000)
    store.write("k", big, keep_previous=False).wait()
    [name] = _swap_files(store)
    inode = os.stat(os.path.join(store.path, name)).st_ino
    store.write("k", small, keep_previous=False).wait()  # shorter: the file is cut to its padded size
    assert _swap_files(store) == [name] and os.stat(os.path.join(store.path, name)).st_ino == inode
    assert os.path.getsize(os.path.join(store.path, name)) == 4096
    out = torch.empty(1000)
    store.read("k", out).wait()
    assert torch.equal(out, small)

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    with pytest.raises(SwapWriteError, match="disk is full.*written in place. was removed.*reads refuse the key"):
        store.write("k", big, keep_previous=False).wait()
    monkeypatch.undo()
    with pytest.raises(SwapIntegrityError, match="its last write failed"):
        store.read("k", torch.empty(1000)).wait()  # refused
    assert _swap_files(store) == []  # the partial file went, with the space it took
    store.write("k", big, keep_previous=False).wait()
    out = torch.empty(5000)
    store.read("k", out).wait()
    assert torch.equal(out, big)
    store.close()
