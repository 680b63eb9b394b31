"""Helpers of the NVMe store tests: exact bytes, odd tensors, the store's files, a real small tmpfs."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

import pytest
import torch

from offload.nvme import NvmeStore


def payload_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def odd_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=dtype)


def swap_files(store: NvmeStore) -> list[str]:
    return sorted(os.listdir(store.path))


@contextlib.contextmanager
def mounted_tmpfs(path, options: str, readonly: bool = False):
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
