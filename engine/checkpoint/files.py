"""Checkpoint files: safetensors written durably with a checksum, read back only after it matches.

Note [checkpoint integrity]
Every tensor file is a safetensors file (a JSON header and raw bytes: reading one never executes
code, unlike a pickle). Writing one:
- `safetensors.torch.save_file` writes it, `fsync` makes it durable;
- its SHA-256 is computed by reading the file back (what reached the file, not what was meant to):
  the manifest records it with the size.
Reading one: the size and SHA-256 are checked first, in 16 MiB reads (large reads are what this
disk's buffered path needs to reach its bandwidth), each hashed while the next is read; only then
is the file opened (memory-mapped), so a truncated, altered or missing file is an error naming it
before any of its bytes are used.
A failed write (ENOSPC, EIO, ...) removes its own partial file and raises `CheckpointWriteError`
with the errno's name, the path and the fix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

READ_BLOCK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and the fix."""


class CheckpointWriteError(CheckpointError):
    pass


class CheckpointIntegrityError(CheckpointError):
    pass


@dataclass(frozen=True)
class FileRecord:
    name: str  # relative to the checkpoint directory
    nbytes: int
    sha256: str


def write_tensors(directory: str, name: str, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> FileRecord:
    """Writes `tensors` to directory/name durably; returns its size and checksum."""
    path = os.path.join(directory, name)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
        fsync_path(path)
        return FileRecord(name, os.path.getsize(path), file_sha256(path))
    except OSError as e:
        _remove_quietly(path)
        raise write_error(path, e) from e
    except Exception as e:  # safetensors reports an I/O failure as its own exception type
        _remove_quietly(path)
        raise CheckpointWriteError(f"writing checkpoint file {path} failed: {e}") from e


def write_text(path: str, text: str) -> None:
    """`text` to `path` atomically: a temporary file, fsync, rename, and the directory fsynced."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(os.path.dirname(path) or ".")
    except OSError as e:
        _remove_quietly(tmp)
        raise write_error(path, e) from e


def write_json(path: str, value: dict) -> None:
    write_text(path, json.dumps(value, indent=1, sort_keys=False) + "\n")


def write_error(path: str, e: OSError) -> CheckpointWriteError:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    fix = ("free space on that disk or save to another directory" if e.errno in (errno.ENOSPC, errno.EDQUOT)
           else "check that the directory is writable and the disk healthy")
    return CheckpointWriteError(f"writing checkpoint file {path} failed: {name} ({e.strerror or e}); {fix}. "
                                "The checkpoint being written was discarded; earlier checkpoints are untouched")


def file_sha256(path: str) -> str:
    """SHA-256 of a file, the next block read (on a helper thread) while the current one is hashed."""
    digest = hashlib.sha256()
    buffers = [bytearray(READ_BLOCK), bytearray(READ_BLOCK)]
    free, filled = queue.SimpleQueue(), queue.SimpleQueue()  # buffer indices: to read into, to hash
    free.put(0)
    free.put(1)

    # a plain thread, not an executor: concurrent.futures refuses work once the script has ended, and a
    # background save (Note [asynchronous save]) may still be hashing its file then
    def read_ahead(f) -> None:
        try:
            while n := f.readinto(buffers[current := free.get()]):
                filled.put((current, n))
            filled.put((0, 0))
        except BaseException as e:
            filled.put((-1, e))

    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        reader = threading.Thread(target=read_ahead, args=(f,), name="tiers-checksum", daemon=True)
        reader.start()
        while (block := filled.get())[1]:
            if block[0] < 0:
                raise block[1]
            digest.update(memoryview(buffers[block[0]])[:block[1]])
            free.put(block[0])  # the reader may refill it only now
        reader.join()
    return digest.hexdigest()


def verify(directory: str, record: FileRecord) -> str:
    """Checks directory/record.name against its record; returns the path."""
    path = os.path.join(directory, record.name)
    if not os.path.isfile(path):
        raise CheckpointIntegrityError(f"checkpoint file {path} is missing (the manifest lists it); the checkpoint "
                                       "is incomplete: load another tag, or restore the file")
    size = os.path.getsize(path)
    if size != record.nbytes:
        raise CheckpointIntegrityError(f"checkpoint file {path} has {size:,} bytes, "
                                       f"the manifest says {record.nbytes:,} "
                                       "(truncated or replaced); load another tag, or restore the file")
    if file_sha256(path) != record.sha256:
        raise CheckpointIntegrityError(f"checkpoint file {path} does not match its SHA-256 in the manifest (altered "
                                       "or corrupted); load another tag, or restore the file")
    return path


def open_tensors(path: str):
    """A safetensors file opened for reading single tensors and slices (memory-mapped)."""
    return safe_open(path, framework="pt", device="cpu")


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory: its entries, i.e. renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
