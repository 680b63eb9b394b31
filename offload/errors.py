"""Errors raised by the offload layer. Each message names what was wrong, with the value, and the fix."""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error the offload layer raises on purpose."""


class SwapDirectoryError(OffloadError):
    """The NVMe swap directory is missing, not a directory, or not writable."""


class SwapUsageError(OffloadError, ValueError):
    """A swap call was given something it cannot use: an unknown key, a tensor of the wrong size,
    dtype or device, or a closed store."""


class SwapWriteError(OffloadError):
    """Writing a swap file failed (typically the disk is full); the partial file was removed and any
    previous complete copy of the key is still readable."""


class SwapIntegrityError(OffloadError):
    """A swap file is missing, truncated or altered; the destination tensor was left untouched."""
