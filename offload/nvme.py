"""The NVMe tier: tensor payloads swapped to files asynchronously, overlapped with compute.

Note [nvme swap files]
An `NvmeStore` owns a private directory (mode 0o700) inside the directory it is given; each
key's payload is one file in it (mode 0o600). `close()`, garbage collection or interpreter exit
(a `weakref.finalize`: runs at exit, does not keep the store alive) removes them all.
A write goes to a temporary name, renamed onto the key's file only once complete: a failed
write (a full disk) never destroys the previous file; reads of that key refuse it (it is out of
date) until a write succeeds, so stale data is never handed out. A caller that keeps its own
copy until the write succeeds (the chunk manager does) passes `keep_previous=False`: the key's
file is overwritten in place, which spares a new file's allocation and the old one's unlink
(with `discard`, ~20 ms per 128 MiB here); after a failure reads refuse the key just the same.
Files are padded to a multiple of `block_size` (zeros, or what lies past the tensor in its storage:
Note [nvme direct io] in offload/direct_io.py, which also says which transfers copy through
staging buffers); the true length is kept in memory with the checksum.

Note [bytes on disk]
`NvmeStats.disk_bytes` is the size of the store's files now: every key's file at its padded size, and
while a write with keep_previous runs, its temporary file beside the key's old one (the disk holds both
until the rename). It changes when a write starts (the file is created or grows), when a write ends
(renamed over the old file, or truncated to its size), when a failed write's file is removed, and on
remove/close; `peak_disk_bytes` is its maximum. It is what the filesystem is asked to hold, which a full
disk refuses: not the payload bytes a tier holds (the manager's "nvme" resident bytes count a chunk's
payload once, wherever its files are), nor the bytes moved.

Note [nvme integrity]
Every write records the payload's length and the XXH3-64 hash of the tensor's bytes (`checksum`, from
the xxhash library), computed in the worker thread. XXH3-64 ran at ~13.5 GB/s here (9 ms per 128 MiB)
against zlib.crc32's 2.1–5.8 GB/s (22–58 ms: as long as the chunk's raw read on a fast day), and like it
releases the GIL; it catches a flipped bit, a truncated file and blocks in another order (unlike a
numpy sum, ~25 GB/s but blind to reordering); another key's file fails its hash, its size or both.
A read brings the file into a staging buffer, checks its size and checksum, and only then copies into
the destination: a missing, truncated or altered file raises `SwapIntegrityError` naming the
file, and the destination keeps its previous contents. That is why reads stage even into
page-aligned tensors: reading in place would overwrite the destination before its checksum can be
checked, and restoring it on a mismatch needs a copy of the old contents, which costs what the
staging copy costs. Writes need no copy for integrity (the source is not changed).
A caller whose destination is scratch (a fresh buffer it will discard if the read fails, whose
storage padding belongs to no other tensor, as the chunk manager's swap-in buffers are) passes
`scratch=True`: an aligned destination is then read in place, padding included, checked, and on
failure holds undefined bytes; the error still names the file.

Note [nvme concurrency]
Transfers run on a pool of `threads` worker threads (os.pwrite/os.preadv release the GIL, as do
the copy and the checksum), at most `queue_depth` requests in flight: a write or read beyond that
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
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import xxhash
from torch.profiler import record_function

from offload.direct_io import (
    PAGE,
    DirectFiles,
    StagingPool,
    Truncated,
    as_buffer,
    bytes_of,
    in_place_span,
    padded_size,
    storage_bytes,
)
from offload.errors import SwapDirectoryError, SwapIntegrityError, SwapUsageError, SwapWriteError

__all__ = ["NvmeStore", "NvmeStats", "SwapHandle"]


def checksum(data) -> int:
    """XXH3-64 of a buffer's bytes (Note [nvme integrity]); releases the GIL while it hashes."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass
class NvmeStats:
    """Counters of one store: payload bytes (without padding) and completed transfers."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    wait_seconds: float = 0.0  # caller blocked in SwapHandle.wait()
    throttled_seconds: float = 0.0  # caller blocked in write()/read(): queue_depth requests in flight
    staged_transfers: int = 0  # transfers that copied through a staging buffer (Note [nvme direct io])
    staged_bytes: int = 0  # bytes those moved through staging (a whole read; an unaligned write's tail)
    disk_bytes: int = 0  # Note [bytes on disk]: the store's files as they are now, temporary ones included
    peak_disk_bytes: int = 0  # the most disk_bytes has been since the store opened


@dataclass(frozen=True)
class _Record:
    """What a complete swap file holds (Note [nvme integrity])."""

    path: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    padded: int
    checksum: int  # Note [nvme integrity]

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


@dataclass(frozen=True)
class NvmeSettings:
    """Where and how chunks swap to NVMe: the swap directory (a private one is made under it), the I/O threads, the
    requests in flight at most and the block size (Note [nvme concurrency])."""

    directory: str
    threads: int = 2
    queue_depth: int = 8
    block_size: int = 1 << 20

    def store(self) -> "NvmeStore":
        return NvmeStore(self.directory, block_size=self.block_size, queue_depth=self.queue_depth,
                         threads=self.threads)


class NvmeStore:
    """Asynchronous swap of CPU tensors to files under `directory` (Note [nvme swap files]).

    `write(key, tensor)` and `read(key, out)` return a `SwapHandle` at once; see
    Note [nvme concurrency] for what the caller may do meanwhile. `close()` (or `with`) removes
    every file.
    """

    def __init__(self, directory: str, *, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 2):
        if block_size < PAGE or block_size % PAGE:
            raise SwapUsageError(f"block_size must be a positive multiple of the page size {PAGE}, got {block_size}")
        if queue_depth < 1 or threads < 1:
            raise SwapUsageError(f"queue_depth and threads must be >= 1, got {queue_depth} and {threads}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.path = _make_private_dir(self.directory)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self._files = DirectFiles(self.directory)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tiers-nvme")
        # the pid: a forked child inherits the finalizer, and must not delete its parent's files at exit
        self._finalizer = weakref.finalize(self, _remove_files, self._executor, self.path, os.getpid())
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._pool = StagingPool(keep=threads)  # a buffer is held only while a job runs
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # key -> its swap file (from the first write issued)
        self._records: dict[str, _Record] = {}  # key -> its last complete write
        self._pending: dict[str, Future] = {}  # key -> its last operation issued
        self._failed: dict[str, str] = {}  # key -> why its last write failed (reads refuse the older file)
        self._file_sizes: dict[str, int] = {}  # Note [bytes on disk]: each file the store made -> its size
        self._seq = itertools.count()
        self._stats = NvmeStats()
        self._closed = False

    # ---- public API

    def write(self, key: str, tensor: torch.Tensor, *, keep_previous: bool = True) -> SwapHandle:
        """Starts writing a contiguous CPU tensor's bytes as `key`; do not modify it until the handle is done.

        keep_previous=False overwrites the key's file in place (Note [nvme swap files]): cheaper, but a
        failed write leaves no readable older version.
        """
        self._check_open()
        _check_host_tensor(tensor, f"write of key {key!r}")
        with self._lock:
            path = self._names.setdefault(key, os.path.join(self.path, _file_name(key)))
        return self._submit(key, "write", self._write_job, key, path, tensor, keep_previous)

    def read(self, key: str, out: torch.Tensor, *, scratch: bool = False) -> SwapHandle:
        """Starts reading `key` into `out` (same numel and dtype as written); do not use `out` until done.

        scratch=True: `out`'s contents need not survive a failed read, and its storage past its end up to
        the padded size (`aligned_empty`'s padding) is not shared with any other tensor, so an aligned `out`
        is read in place without a staging copy (Note [nvme integrity]).
        """
        self._check_open()
        _check_host_tensor(out, f"read of key {key!r}")
        with self._lock:
            if key not in self._names:
                raise SwapUsageError(f"no swap file for key {key!r}: write it first (known keys: {len(self._names)})")
            record, prev = self._records.get(key), self._pending.get(key)
        if record is not None and (prev is None or prev.done()):
            record.check_matches(key, out)  # early, on the caller's thread; checked again in the worker
        return self._submit(key, "read", self._read_job, key, out, scratch)

    def remove(self, key: str) -> None:
        """Waits for the key's operations in flight, then deletes its swap file."""
        self._check_open()
        if key not in self._names:
            raise SwapUsageError(f"cannot remove key {key!r}: it was never written to this store")
        concurrent.futures.wait([f for f in [self._pending.get(key)] if f is not None])
        with self._lock:
            self._records.pop(key, None)
            self._pending.pop(key, None)
            path = self._names.pop(key)
            _unlink_quietly(path)
            self._sized(path, None)

    def keys(self) -> list[str]:
        """Keys with a complete swap file."""
        with self._lock:
            return list(self._records)

    @property
    def direct_io(self) -> bool:
        """Whether transfers use O_DIRECT (False after the filesystem refused it: Note [nvme direct io])."""
        return self._files.enabled

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
        with self._lock:
            for path in list(self._file_sizes):
                self._sized(path, None)

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

    def _sized(self, path: str, size: int | None) -> None:
        """Note [bytes on disk]: `path` now holds `size` bytes (None: it is gone); under the lock."""
        stats = self._stats
        stats.disk_bytes += (size or 0) - self._file_sizes.pop(path, 0)
        if size is not None:
            self._file_sizes[path] = size
        stats.peak_disk_bytes = max(stats.peak_disk_bytes, stats.disk_bytes)

    def _check_open(self) -> None:
        if self._closed:
            raise SwapUsageError(f"the NVMe store at {self.path!r} is closed; create a new NvmeStore")

    # ---- transfers (worker threads)

    def _write_job(self, key: str, path: str, tensor: torch.Tensor, keep_previous: bool, prev: Future | None) -> None:
        if prev is not None:
            concurrent.futures.wait([prev])
        with record_function("tiers.nvme.write"):
            payload = bytes_of(tensor)
            nbytes = payload.numel()
            padded = padded_size(nbytes, self.block_size)
            direct = in_place_span(tensor, padded)  # the rest is staged (Note [nvme direct io])
            pieces = [as_buffer(storage_bytes(tensor, direct))] if direct else []
            whole = self._pool.acquire(padded - direct) if direct < padded else None
            try:
                if whole is not None:
                    tail, rest = whole[:padded - direct], max(nbytes - direct, 0)
                    tail[:rest].copy_(payload[direct:])
                    tail[rest:].zero_()
                    pieces.append(as_buffer(tail))
                digest = checksum(as_buffer(payload))
                target = f"{path}.tmp{next(self._seq)}" if keep_previous else path
                with self._lock:  # Note [bytes on disk]: an in-place write shrinks its file only at its end
                    self._sized(target, max(padded, self._file_sizes.get(target, 0)))
                try:
                    self._files.transfer(target, pieces, write=True)
                    if keep_previous:
                        os.replace(target, path)
                    with self._lock:
                        self._sized(target, None)
                        self._sized(path, padded)
                except OSError as e:
                    _unlink_quietly(target)  # a partial file: its space may be what the next write needs
                    with self._lock:
                        self._sized(target, None)
                    error = self._write_error(key, target if keep_previous else None, padded, e)
                    with self._lock:
                        self._failed[key] = str(error)
                        if not keep_previous:
                            self._records.pop(key, None)  # its file is gone
                    raise error from e
            finally:
                if whole is not None:
                    self._pool.release(whole)
        with self._lock:
            self._failed.pop(key, None)
            self._records[key] = _Record(path, tensor.dtype, tensor.numel(), nbytes, padded, digest)
            self._stats.bytes_written += nbytes
            self._stats.writes += 1
            if whole is not None:
                self._stats.staged_transfers += 1
                self._stats.staged_bytes += padded - direct

    def _read_job(self, key: str, out: torch.Tensor, scratch: bool, prev: Future | None) -> None:
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
            if scratch and in_place_span(out, rec.padded) == rec.padded:
                self._read_in_place(key, rec, out)
                return
            whole = self._pool.acquire(rec.padded)
            try:
                buf = whole[:rec.padded]
                self._read_file(key, rec, buf)
                digest = checksum(as_buffer(buf[:rec.nbytes]))
                if digest != rec.checksum:
                    raise SwapIntegrityError(
                        f"swap file {rec.path!r} of key {key!r} is corrupt: XXH3-64 {digest:#018x}, written as "
                        f"{rec.checksum:#018x}; it was altered outside the store (or the disk is failing); "
                        f"the destination was left unchanged, write the key again from a good copy")
                bytes_of(out).copy_(buf[:rec.nbytes])  # only now: Note [nvme integrity]
            finally:
                self._pool.release(whole)
        with self._lock:
            self._stats.bytes_read += rec.nbytes
            self._stats.reads += 1
            self._stats.staged_transfers += 1
            self._stats.staged_bytes += rec.padded

    def _read_in_place(self, key: str, rec: _Record, out: torch.Tensor) -> None:
        """A scratch destination that O_DIRECT can fill itself: read, then check (Note [nvme integrity])."""
        self._read_file(key, rec, storage_bytes(out, rec.padded), scratch=True)
        digest = checksum(as_buffer(bytes_of(out)))
        if digest != rec.checksum:
            raise SwapIntegrityError(
                f"swap file {rec.path!r} of key {key!r} is corrupt: XXH3-64 {digest:#018x}, written as "
                f"{rec.checksum:#018x}; "
                f"it was altered outside the store (or the disk is failing); the scratch destination holds "
                f"undefined bytes, write the key again from a good copy")
        with self._lock:
            self._stats.bytes_read += rec.nbytes
            self._stats.reads += 1

    def _read_file(self, key: str, rec: _Record, buf: torch.Tensor, scratch: bool = False) -> None:
        def damaged(what: str) -> SwapIntegrityError:
            return SwapIntegrityError(
                f"swap file {rec.path!r} of key {key!r} {what}; it was changed outside the store (or the disk is "
                f"failing); the "
                f"{'scratch destination holds undefined bytes' if scratch else 'destination was left unchanged'}"
                f", write the key again from a good copy")
        try:
            self._files.transfer(rec.path, [as_buffer(buf)], write=False)
        except FileNotFoundError as e:
            raise damaged("is missing (deleted)") from e
        except Truncated as e:
            what = "is truncated" if e.size < rec.padded else "has grown"
            raise damaged(f"{what}: {e.size} bytes, written as {rec.padded} ({rec.nbytes} of payload)") from e

    def _write_error(self, key: str, tmp: str | None, needed: int, e: OSError) -> SwapWriteError:
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = -1
        what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else f"{e.strerror} (errno {e.errno})"
        if tmp is not None:
            left = (f"The partial file {os.path.basename(tmp)!r} was removed; the previous file of the key, if any, "
                    f"is kept, but reads refuse it until the key is written again")
        else:
            left = ("The key's file (written in place) was removed with what it held: reads refuse the key until it "
                    "is written again")
        return SwapWriteError(
            f"could not swap key {key!r} to NVMe directory {self.directory!r}: {what}; it needs {needed} bytes "
            f"and {free} bytes are free there. Free space on that filesystem, lower the NVMe offload budget, "
            f"or choose another directory. {left}")


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


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
