"""Raw transfers of the NVMe tier: O_DIRECT files, page-aligned host memory, staging buffers.

Note [nvme direct io]
Swap files are opened with O_DIRECT: payloads bypass the page cache (which would evict the
memory the CPU tier is budgeted to use, and make timings measure RAM, not disk). O_DIRECT needs
host memory aligned to the device's logical block (at most a page) and transfer sizes and file
offsets that are multiples of it, so files are padded to `block_size` (a multiple of the page).
Which bytes move from where:
- A write whose tensor starts on a page moves straight from the tensor's memory, no copy: all
  of it when its storage reaches the padded size (`aligned_empty` makes such tensors), else its
  whole pages, and only the rest (under a block and a page) is copied to a staging buffer. The
  file's padding is then whatever the storage holds past the tensor: not payload, not checksummed.
- A read goes through a staging buffer, even into an aligned tensor: the destination is not
  touched until the file's size and checksum are verified (Note [nvme integrity]), and no byte past
  the destination tensor is written (it may be a neighbouring view of the storage). Only a
  caller that declares the destination scratch (`read(..., scratch=True)`: contents and storage
  padding its own) has an aligned destination read in place, padding included.
- A tensor not starting on a page is staged whole, both ways.
`NvmeStats.staged_transfers` and `staged_bytes` count what went through staging.
Staging buffers are page-aligned, from a pool: at most `threads` in use and `threads` kept free,
each at most the largest padded transfer it was made for (plus a page), so at most
2 x `threads` x the largest padded payload of host memory, outside the CPU tier's budget (the
manager must count it). Filesystems without O_DIRECT (tmpfs on older kernels) answer EINVAL at
open; the store then warns once and falls back for good to buffered I/O (`NvmeStore.direct_io`).
Only the open decides: EINVAL during a transfer (say, a misaligned buffer) is an error.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import warnings
from collections.abc import Sequence

import torch

__all__ = ["aligned_empty"]

PAGE = mmap.PAGESIZE
O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_empty(numel: int, dtype: torch.dtype, block_size: int = 1 << 20) -> torch.Tensor:
    """An uninitialized contiguous 1-D CPU tensor of `numel` x `dtype` that starts on a page and whose
    storage reaches its byte size rounded up to `block_size`: an `NvmeStore` with that block size writes
    it with O_DIRECT straight from its memory (Note [nvme direct io]). Freed like any tensor."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"aligned_empty needs a torch.dtype, got {dtype!r}; pass e.g. torch.float32")
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty needs a non-negative int numel, got {numel!r}")
    if not isinstance(block_size, int) or block_size < PAGE or block_size % PAGE:
        raise ValueError(f"aligned_empty: block_size must be a positive multiple of the page size {PAGE}, got "
                         f"{block_size!r}; pass the NvmeStore's block_size (default {1 << 20})")
    padded = padded_size(numel * dtype.itemsize, block_size)
    raw = torch.empty(padded + PAGE, dtype=torch.uint8)  # a page extra to slide the start onto a page
    start = -raw.data_ptr() % PAGE
    # start is a multiple of the allocator's alignment (>= 16), so .view(dtype) accepts the offset
    return raw[start:start + padded].view(dtype)[:numel]


def padded_size(nbytes: int, block_size: int) -> int:
    return -(-nbytes // block_size) * block_size


def in_place_span(tensor: torch.Tensor, padded: int) -> int:
    """How many leading bytes of a `padded`-byte write O_DIRECT can take from `tensor`'s own memory:
    all when it starts on a page and its storage reaches `padded` bytes, whole pages of the storage
    when it only starts on a page, none otherwise (Note [nvme direct io])."""
    if tensor.data_ptr() % PAGE:
        return 0
    room = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    return min(padded, room // PAGE * PAGE)


def storage_bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of `tensor`'s storage from its first element on, as uint8 (may reach past its end)."""
    offset = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage(), offset, (nbytes,))


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a uint8 tensor sharing its memory."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def as_buffer(buf: torch.Tensor) -> memoryview:
    """A uint8 CPU tensor as a memoryview, for os.pwrite/os.preadv and zlib (which release the GIL)."""
    return memoryview(buf.numpy()).cast("B")


class Truncated(Exception):
    """The file is not the size a read expected: `size` bytes (or fewer, when it shrank mid-read)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


class DirectFiles:
    """Whole-file transfers with O_DIRECT until the filesystem refuses it at open; then, for good,
    through the page cache after one RuntimeWarning (Note [nvme direct io])."""

    def __init__(self, directory: str):
        self.directory = directory
        self.enabled = bool(O_DIRECT)
        self._lock = threading.Lock()  # two workers refused at once warn once

    def transfer(self, path: str, pieces: Sequence[memoryview], *, write: bool) -> None:
        """Writes `pieces` back to back as the whole file, or fills them from the file, whose size must
        be their total (else `Truncated`). Raises OSError (FileNotFoundError for a missing file)."""
        fd = self._open(path, write)
        try:
            total = sum(len(p) for p in pieces)
            size = os.fstat(fd).st_size
            if not write and size != total:
                raise Truncated(size)
            offset = 0
            for view in pieces:
                _move_all(fd, view, offset, write)
                offset += len(view)
            if write and size > total:  # an existing file overwritten in place (no O_TRUNC: its blocks are reused)
                os.ftruncate(fd, total)
        finally:
            os.close(fd)

    def _open(self, path: str, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        direct = self.enabled
        try:
            return os.open(path, flags | (O_DIRECT if direct else 0), 0o600)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
        # only the open decides: an EINVAL during a transfer is an error, not a reason to fall back
        with self._lock:
            if self.enabled:
                self.enabled = False
                warnings.warn(f"NVMe directory {self.directory!r} refuses O_DIRECT; swapping through the page "
                              f"cache (mount it on a filesystem with O_DIRECT, e.g. ext4 or xfs, to avoid that)",
                              RuntimeWarning, stacklevel=3)
        return os.open(path, flags, 0o600)


def _move_all(fd: int, view: memoryview, offset: int, write: bool) -> None:
    moved = 0
    while moved < len(view):
        at = offset + moved
        n = os.pwrite(fd, view[moved:], at) if write else os.preadv(fd, [view[moved:]], at)
        if n == 0:
            if write:
                raise OSError(errno.EIO, f"a write made no progress at byte {at}")
            raise Truncated(at)  # the file shrank after the size check
        moved += n


class StagingPool:
    """Page-aligned host buffers for transfers O_DIRECT cannot do in place (Note [nvme direct io]),
    reused; at most `keep` kept free."""

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
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        return raw[start:start + nbytes]

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.pop(0)
