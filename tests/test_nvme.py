"""NVMe tier: asynchronous swap files round-trip exact bytes, stay private, never outlive the store,
and every failure (bad directory, damaged file, full disk) is a clear error that destroys nothing."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from offload.direct_io import aligned_empty
from offload.errors import OffloadError, SwapDirectoryError, SwapIntegrityError, SwapUsageError, SwapWriteError
from offload.nvme import NvmeStore
from tests.nvme_helpers import mounted_tmpfs, odd_tensor, payload_bytes, swap_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- round trips


@pytest.mark.parametrize("block_size", [4096, 1 << 20])
def test_round_trip_exact_bytes_with_many_writes_in_flight(tmp_path, block_size):
    cases = [(torch.float32, 1_000_003), (torch.bfloat16, 12_345), (torch.float16, 777), (torch.int64, 65_539),
             (torch.float32, 1), (torch.bfloat16, 0)]
    tensors = {f"chunk.{i}/{d}": odd_tensor(d, n, i) for i, (d, n) in enumerate(cases)}
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
            assert outs[k].dtype == t.dtype and payload_bytes(outs[k]) == payload_bytes(t), k
        for name in swap_files(store):  # padded to the block size
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
        assert len(swap_files(store)) == 1 and store.keys() == ["b"]
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


# ---- privacy and cleanup


def test_private_directory_and_files_are_owner_only(tmp_path):
    with NvmeStore(str(tmp_path), block_size=4096) as store:
        assert os.path.dirname(store.path) == str(tmp_path)
        assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
        store.write("a", torch.ones(10)).wait()
        store.write("a", torch.zeros(10)).wait()  # the replaced copy too
        store.write("b", torch.ones(10)).wait()
        files = swap_files(store)
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
    [name] = swap_files(store)
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
    _assert_read_refused(store, path, "is corrupt: XXH3-64", aligned)
    store.close()


def test_another_keys_file_of_the_same_size_is_refused_and_destination_kept(tmp_path, aligned):
    store, path = _damaged_store(tmp_path, aligned)
    store.write("other", _host_tensor(aligned, torch.randn(3000))).wait()
    [other] = [os.path.join(store.path, name) for name in swap_files(store) if os.path.join(store.path, name) != path]
    os.replace(other, path)  # the victim's file now holds the other key's bytes
    _assert_read_refused(store, path, "is corrupt: XXH3-64", aligned)
    store.close()


def test_blocks_in_another_order_are_refused_and_destination_kept(tmp_path, aligned):
    store, path = _damaged_store(tmp_path, aligned)
    with open(path, "r+b") as f:  # the file's first two 4 KiB blocks exchanged: same bytes, other order
        first, second = f.read(4096), f.read(4096)
        f.seek(0)
        f.write(second + first)
    _assert_read_refused(store, path, "is corrupt: XXH3-64", aligned)
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
    assert not [n for n in swap_files(store) if ".tmp" in n]  # the partial file is gone


def _assert_stale_read_refused_until_rewritten(store, key, old):
    """After a failed write the older file is kept on disk but never read back as current."""
    assert [n for n in swap_files(store) if ".tmp" not in n]  # the previous file was not destroyed
    out = torch.full_like(old, 7)
    with pytest.raises(SwapIntegrityError, match=f"key '{key}' cannot be read: its last write failed"):
        store.read(key, out).wait()
    assert torch.equal(out, torch.full_like(old, 7))  # destination untouched
    store.write(key, old).wait()  # a successful write makes the key readable again
    store.read(key, out).wait()
    assert torch.equal(out, old)


def test_full_disk_on_a_real_small_filesystem(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "size=2m") as small:
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


def test_overwrite_in_place_reuses_the_file_and_a_failure_refuses_the_key(tmp_path, monkeypatch):
    store = NvmeStore(str(tmp_path), block_size=4096)
    big, small = torch.randn(5000), torch.randn(1000)
    store.write("k", big, keep_previous=False).wait()
    [name] = swap_files(store)
    inode = os.stat(os.path.join(store.path, name)).st_ino
    store.write("k", small, keep_previous=False).wait()  # shorter: the file is cut to its padded size
    assert swap_files(store) == [name] and os.stat(os.path.join(store.path, name)).st_ino == inode
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
    assert swap_files(store) == []  # the partial file went, with the space it took
    store.write("k", big, keep_previous=False).wait()
    out = torch.empty(5000)
    store.read("k", out).wait()
    assert torch.equal(out, big)
    store.close()
