"""The NVMe tier: tensor payloads swapped to files asynchronously, overlapped with compute.

Note [nvme swap files]
An `NvmeStore` owns a private directory (mode 0o700) inside the directory it is given; each
key's payload is one file in it (mode 0o600). `close()`, garbage collection or interpreter exit
(a `weakref.finalize`: runs at exit, does not keep the store alive) removes them all.
A write goes to a temporary name, renamed onto the key's file only once complete: a failed
write (a full disk) never destroys the previous file; reads of that key refuse it (it is out of
date) until a write succeeds, so stale data is never handed out. Files are zero-padded to a multiple of
`block_size`; the true length is kept in memory with the checksum.

Note [nvme direct io]
Files are opened with O_DIRECT: swapped payloads bypass the page cache (which would evict the
memory the CPU tier is budgeted to use, and make timings measure RAM, not disk).
O_DIRECT needs the host buffer aligned to the device's logical block (at most a page) and
transfer sizes that are multiples of it: every transfer goes through a page-aligned staging
buffer of the padded size, from a pool. At most `threads` buffers are in use and `threads` kept
free, each at most twice the payload it serves: up to 4 x `threads` x the largest padded
payload of host memory, outside the CPU tier's budget (the manager must count it). Filesystems without
O_DIRECT (tmpfs on older kernels) answer EINVAL at open; the store then warns once and falls
back for good to buffered I/O (`NvmeStore.direct_io` tells which is in use).

Note [nvme integrity]
Every write records the payload's length and its CRC-32, computed in the worker thread.
zlib.crc32 runs at ~5.8 GB/s here and releases the GIL; adler32 ran at ~3.5 GB/s, blake2b at
~1.2; a numpy uint64 sum at ~25 GB/s, but it is blind to reordered blocks. CRC-32 is still ~1/4
of one worker's time per transfer at disk speed: with `threads=2` it overlaps another's I/O.
A read brings the file into the staging buffer, checks its size
and CRC, and only then copies into the destination: a missing, truncated or altered file raises
`SwapIntegrityError` naming the file, and the destination keeps its previous contents.

Note [nvme concurrency]
Transfers run on a pool of `threads` worker threads (os.pwrite/os.preadv release the GIL, as do
the copy and the CRC), at most `queue_depth` requests in flight: a write or read beyond that
blocks the caller until one completes (counted in `NvmeStats.throttled_seconds`). Operations on
one key run in the order they were issued (a read issued after a write sees that write). The
caller must not touch a tensor given to `write` (must not modify it) or to `read` (must not use
it at all) until its handle's `done()` is True or `wait()` has returned.
Each transfer runs inside `record_function("tiers.nvme.write" / "tiers.nvme.read")` on its
worker thread; torch's profiler records other threads only with
`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`. The
caller's blocking in `wait()` is the range "tiers.nvme.wait" on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import itertools
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch.profiler import record_function

from offload.errors import SwapDirectoryError, SwapIntegrityError, SwapUsageError, SwapWriteError

__all__ = ["NvmeStore", "NvmeStats", "SwapHandle"]

_PAGE = mmap.PAGESIZE
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass
class NvmeStats:
    """Counters of one store: payload bytes (without padding) and completed transfers."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    wait_seconds: float = 0.0  # caller blocked in SwapHandle.wait()
    throttled_seconds: float = 0.0  # caller blocked in write()/read(): queue_depth requests in flight


@dataclass(frozen=True)
class _Record:
    """What a complete swap file holds (Note [nvme integrity])."""

    path: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    padded: int
    crc: int

    def check_matches(self, key: str, out: torch.Tensor) -> None:
        if out.dtype != self.dtype or out.numel() != self.numel:
            raise SwapUsageError(
                f"cannot read key {key!r} into a tensor of {out.numel()} x {out.dtype}: it was written as "
                f"{self.numel} x {self.dtype}; pass a tensor of that numel and dtype")


class SwapHandle:
    """One write or read in flight. Until `done()` is True or `wait()` returned, the tensor given to
    the call belongs to the store: do not modify it (write) or use it at all (read)."""

    def __init__(self, key: str, op: str, future: Future, on_wait):
        self.key, self.op = key, op
        self._future = future
        self._on_wait = on_wait

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        """Blocks until the transfer completed; re-raises its error (SwapWriteError, SwapIntegrityError, ...)."""
        if not self._future.done():
            start = time.perf_counter()
            with record_function("tiers.nvme.wait"):
                concurrent.futures.wait([self._future])
            self._on_wait(time.perf_counter() - start)
        self._future.result()


class _StagingPool:
    """Page-aligned host buffers for O_DIRECT (Note [nvme direct io]), reused; at most `keep` kept free."""

    def __init__(self, keep: int):
        self._keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` (at most twice as many when reused); slice it, release the whole."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _PAGE
        return raw[start:start + nbytes]

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.pop(0)


class NvmeStore:
    """Asynchronous swap of CPU tensors to files under `directory` (Note [nvme swap files]).

    `write(key, tensor)` and `read(key, out)` return a `SwapHandle` at once; see
    Note [nvme concurrency] for what the caller may do meanwhile. `close()` (or `with`) removes
    every file.
    """

    def __init__(self, directory: str, *, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 1):
        if block_size < _PAGE or block_size % _PAGE:
            raise SwapUsageError(f"block_size must be a positive multiple of the page size {_PAGE}, got {block_size}")
        if queue_depth < 1 or threads < 1:
            raise SwapUsageError(f"queue_depth and threads must be >= 1, got {queue_depth} and {threads}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.path = _make_private_dir(self.directory)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.direct_io = bool(_O_DIRECT)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tiers-nvme")
        # the pid: a forked child inherits the finalizer, and must not delete its parent's files at exit
        self._finalizer = weakref.finalize(self, _remove_files, self._executor, self.path, os.getpid())
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._pool = _StagingPool(keep=threads)  # a buffer is held only while a job runs
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # key -> its swap file (from the first write issued)
        self._records: dict[str, _Record] = {}  # key -> its last complete write
        self._pending: dict[str, Future] = {}  # key -> its last operation issued
        self._failed: dict[str, str] = {}  # key -> why its last write failed (reads refuse the older file)
        self._seq = itertools.count()
        self._stats = NvmeStats()
        self._closed = False

    # ---- public API

    def write(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Starts writing a contiguous CPU tensor's bytes as `key`; do not modify it until the handle is done."""
        self._check_open()
        _check_host_tensor(tensor, f"write of key {key!r}")
        with self._lock:
            path = self._names.setdefault(key, os.path.join(self.path, _file_name(key)))
        return self._submit(key, "write", self._write_job, key, path, tensor)

    def read(self, key: str, out: torch.Tensor) -> SwapHandle:
        """Starts reading `key` into `out` (same numel and dtype as written); do not use `out` until done."""
        self._check_open()
        _check_host_tensor(out, f"read of key {key!r}")
        with self._lock:
            if key not in self._names:
                raise SwapUsageError(f"no swap file for key {key!r}: write it first (known keys: {len(self._names)})")
            record, prev = self._records.get(key), self._pending.get(key)
        if record is not None and (prev is None or prev.done()):
            record.check_matches(key, out)  # early, on the caller's thread; checked again in the worker
        return self._submit(key, "read", self._read_job, key, out)

    def remove(self, key: str) -> None:
        """Waits for the key's operations in flight, then deletes its swap file."""
        self._check_open()
        if key not in self._names:
            raise SwapUsageError(f"cannot remove key {key!r}: it was never written to this store")
        concurrent.futures.wait([f for f in [self._pending.get(key)] if f is not None])
        with self._lock:
            self._records.pop(key, None)
            self._pending.pop(key, None)
            _unlink_quietly(self._names.pop(key))

    def keys(self) -> list[str]:
        """Keys with a complete swap file."""
        with self._lock:
            return list(self._records)

    @property
    def stats(self) -> NvmeStats:
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        """Lets the transfers in flight finish, then removes the private directory and every file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NvmeStore({self.path!r}, keys={len(self._records)}, direct_io={self.direct_io})"

    # ---- submission (caller's thread)

    def _submit(self, key: str, op: str, job, *args) -> SwapHandle:
        if not self._slots.acquire(blocking=False):
            start = time.perf_counter()
            self._slots.acquire()
            self._add("throttled_seconds", time.perf_counter() - start)
        try:
            with self._lock:  # issue order per key == execution order (Note [nvme concurrency])
                self._check_open()  # a close() may have won the race while this caller was throttled
                prev = self._pending.get(key)
                future = self._executor.submit(job, *args, prev)
                self._pending[key] = future
        except BaseException:
            self._slots.release()
            raise
        release = self._slots.release  # not `self`: a future must not keep its store alive
        future.add_done_callback(lambda _: release())
        return SwapHandle(key, op, future, lambda seconds: self._add("wait_seconds", seconds))

    def _add(self, field: str, value) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + value)

    def _check_open(self) -> None:
        if self._closed:
            raise SwapUsageError(f"the NVMe store at {self.path!r} is closed; create a new NvmeStore")

    # ---- transfers (worker threads)

    def _write_job(self, key: str, path: str, tensor: torch.Tensor, prev: Future | None) -> None:
        if prev is not None:
            concurrent.futures.wait([prev])
        with record_function("tiers.nvme.write"):
            nbytes = tensor.numel() * tensor.element_size()
            padded = -(-nbytes // self.block_size) * self.block_size
            whole = self._pool.acquire(padded)
            try:
                buf = whole[:padded]
                buf[:nbytes].copy_(_bytes_of(tensor))
                buf[nbytes:].zero_()
                crc = zlib.crc32(_view(buf[:nbytes]))
                tmp = f"{path}.tmp{next(self._seq)}"
                try:
                    self._transfer(tmp, buf, write=True)
                    os.replace(tmp, path)
                except OSError as e:
                    _unlink_quietly(tmp)
                    error = self._write_error(key, tmp, padded, e)
                    with self._lock:
                        self._failed[key] = str(error)
                    raise error from e
            finally:
                self._pool.release(whole)
        with self._lock:
            self._failed.pop(key, None)
            self._records[key] = _Record(path, tensor.dtype, tensor.numel(), nbytes, padded, crc)
            self._stats.bytes_written += nbytes
            self._stats.writes += 1

    def _read_job(self, key: str, out: torch.Tensor, prev: Future | None) -> None:
        if prev is not None:
            concurrent.futures.wait([prev])
        with record_function("tiers.nvme.read"):
            with self._lock:
                rec, failed = self._records.get(key), self._failed.get(key)
            if failed is not None:  # the file holds an older version: never hand it out as the current one
                raise SwapIntegrityError(f"key {key!r} cannot be read: its last write failed, so its swap file is "
                                         f"out of date; write it again. The write failed with: {failed}")
            if rec is None:
                raise SwapIntegrityError(
                    f"key {key!r} has no complete swap file: its writes failed or it was removed; write it again")
            rec.check_matches(key, out)
            whole = self._pool.acquire(rec.padded)
            try:
                buf = whole[:rec.padded]
                self._read_file(key, rec, buf)
                crc = zlib.crc32(_view(buf[:rec.nbytes]))
                if crc != rec.crc:
                    raise SwapIntegrityError(
                        f"swap file {rec.path!r} of key {key!r} is corrupt: CRC-32 {crc:#010x}, written as "
                        f"{rec.crc:#010x}; it was altered outside the store (or the disk is failing); "
                        f"the destination was left unchanged, write the key again from a good copy")
                _bytes_of(out).copy_(buf[:rec.nbytes])
            finally:
                self._pool.release(whole)
        with self._lock:
            self._stats.bytes_read += rec.nbytes
            self._stats.reads += 1

    def _read_file(self, key: str, rec: _Record, buf: torch.Tensor) -> None:
        def damaged(what: str) -> SwapIntegrityError:
            return SwapIntegrityError(
                f"swap file {rec.path!r} of key {key!r} {what}; it was changed outside the store (or the disk is "
                f"failing); the destination was left unchanged, write the key again from a good copy")
        try:
            self._transfer(rec.path, buf, write=False)
        except FileNotFoundError as e:
            raise damaged("is missing (deleted)") from e
        except _Truncated as e:
            what = "is truncated" if e.size < rec.padded else "has grown"
            raise damaged(f"{what}: {e.size} bytes, written as {rec.padded} ({rec.nbytes} of payload)") from e

    def _transfer(self, path: str, buf: torch.Tensor, *, write: bool) -> None:
        """Moves all of `buf` to (write) or from the file, with O_DIRECT while it works (Note [nvme direct io])."""
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        try:
            fd = os.open(path, flags | (_O_DIRECT if self.direct_io else 0), 0o600)
        except OSError as e:
            if not (self.direct_io and e.errno == errno.EINVAL):
                raise
            # only the open decides: an EINVAL during a transfer is an error, not a reason to fall back
            self.direct_io = False
            warnings.warn(f"NVMe directory {self.directory!r} refuses O_DIRECT; swapping through the page cache",
                          RuntimeWarning, stacklevel=2)
            fd = os.open(path, flags, 0o600)
        try:
            return _move_all(fd, _view(buf), write)
        finally:
            os.close(fd)

    def _write_error(self, key: str, tmp: str, needed: int, e: OSError) -> SwapWriteError:
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = -1
        what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else f"{e.strerror} (errno {e.errno})"
        return SwapWriteError(
            f"could not swap key {key!r} to NVMe directory {self.directory!r}: {what}; it needs {needed} bytes "
            f"and {free} bytes are free there. Free space on that filesystem, lower the NVMe offload budget, "
            f"or choose another directory. The partial file {os.path.basename(tmp)!r} was removed; the previous "
            f"file of the key, if any, is kept, but reads refuse it until the key is written again")


def _move_all(fd: int, view: memoryview, write: bool) -> None:
    if not write and (size := os.fstat(fd).st_size) != len(view):
        raise _Truncated(size)
    moved = 0
    while moved < len(view):
        n = os.pwrite(fd, view[moved:], moved) if write else os.preadv(fd, [view[moved:]], moved)
        if n == 0:
            raise _Truncated(moved) if not write else OSError(errno.EIO, "a write made no progress")
        moved += n


class _Truncated(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def _make_private_dir(directory: str) -> str:
    where = f"NVMe swap directory {directory!r}"
    if not os.path.exists(directory):
        raise SwapDirectoryError(f"{where} does not exist: create it (mkdir -p {directory}) or choose another")
    if not os.path.isdir(directory):
        raise SwapDirectoryError(f"{where} is not a directory (it is a file): choose a writable directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SwapDirectoryError(f"{where} is not writable by this process: choose a writable directory")
    try:
        return tempfile.mkdtemp(prefix="tiers-nvme-", dir=directory)  # mode 0o700
    except OSError as e:
        raise SwapDirectoryError(f"{where} is not writable ({e.strerror}): choose a writable directory") from e


def _remove_files(executor: ThreadPoolExecutor, path: str, owner_pid: int) -> None:
    """Finalizer of a store: holds no reference to it (Note [nvme swap files]); may run on a worker thread."""
    if os.getpid() != owner_pid:
        return  # a forked child exiting: the files are its parent's
    executor.shutdown(wait=False)
    shutil.rmtree(path, ignore_errors=True)


def _file_name(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise SwapUsageError(f"swap keys are non-empty strings, got {key!r}")
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', key)[:64]}-{digest}.swap"


def _check_host_tensor(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise SwapUsageError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise SwapUsageError(f"{what} needs a CPU tensor, got one on {tensor.device}; copy it to host memory")
    if not tensor.is_contiguous():
        raise SwapUsageError(f"{what} needs a contiguous tensor, got strides {tensor.stride()}; pass .contiguous()")


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _view(buf: torch.Tensor) -> memoryview:
    return memoryview(buf.numpy()).cast("B")


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
