"""The raw sequential bandwidth of a disk, measured the way bench_offload.py compares the NVMe store
with it: dd with direct I/O, and a Python loop of O_DIRECT pwrite / preadv over page-aligned buffers;
each timed pass records its CPU time and the disk traffic and cores that were not its own."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

import psutil
import torch
from bench_common import CpuMeter, DiskCounter

MiB = 1 << 20


# ---- buffers -------------------------------------------------------------------------------------
def page_aligned(nbytes: int) -> torch.Tensor:
    """uint8 tensor over an anonymous mmap (page-aligned: what O_DIRECT asks of the raw loops)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def stamp(buf: torch.Tensor, offset: int) -> None:
    """Makes each MiB of the raw loops' buffer distinct per file offset (no block written twice the same)."""
    buf.view(torch.int64).view(-1, MiB // 8)[:, 0] = torch.arange(buf.numel() // MiB) + offset // MiB


def raw_buffers(src: list[torch.Tensor], dst: list[torch.Tensor], raw_bs: int, base: torch.Tensor):
    """(pieces to write, pieces to read into, what they are) for the raw Python loop: the store's own
    chunks cut in raw_bs pieces when O_DIRECT can use them (page-aligned), so raw and store move the
    same bytes from the same memory (a reused buffer measured faster here); else one page-aligned
    buffer, stamped per MiB before each write."""
    def pieces(chunks):
        return [c.view(torch.uint8)[j:j + raw_bs]
                for c in chunks for j in range(0, c.numel() * c.element_size(), raw_bs)]

    nbytes = src[0].numel() * src[0].element_size()
    if nbytes % raw_bs == 0 and all(c.data_ptr() % mmap.PAGESIZE == 0 for c in src + dst):
        return pieces(src), pieces(dst), "the store's own chunk buffers (the same bytes)"
    buf = page_aligned(raw_bs)
    buf.view(base.dtype).copy_(base.repeat(raw_bs // MiB))
    return [buf], [buf], "one page-aligned buffer, stamped per MiB (the chunks are not page-aligned)"


# ---- measuring one phase -------------------------------------------------------------------------
@dataclass
class Phase:
    """One timed transfer of a whole pass: seconds, CPU seconds of the process(es) doing it, and what
    else ran meanwhile: other processes' busy cores, disk traffic that was not ours (fraction of ours)."""

    seconds: float
    cpu_s: float
    other_cores: float
    other_disk: float


class Meter:
    """`with Meter(disk) as m: <transfer>` then `m.phase(expected_bytes)`."""

    def __init__(self, disk: DiskCounter):
        self.disk = disk
        self._cpu = CpuMeter()

    def __enter__(self) -> Meter:
        self._disk0 = self.disk.read()
        self._cpu.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self._cpu.stop()
        self._disk1 = self.disk.read()

    def phase(self, expected: int, seconds: float | None = None, extra_cpu: float = 0.0) -> Phase:
        """`seconds` replaces the wall time (dd's own figure); `extra_cpu`: CPU seconds of child processes."""
        own = self._cpu.own_s + extra_cpu
        other = (self._disk1 - self._disk0 - expected) / expected if self.disk.available else float("nan")
        return Phase(self.seconds if seconds is None else seconds, own, self._cpu.foreign_cores(own), max(other, 0.0))


# ---- raw disk bandwidth --------------------------------------------------------------------------
def dd_pass(path: str, bs: int, total: int, write: bool, disk: DiskCounter) -> Phase:
    """One dd run; its time as dd reports it (the wall time around it when it does not say)."""
    count = total // bs
    cmd = (["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct", "conv=fsync"] if write
           else ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"])
    t0 = os.times()
    with Meter(disk) as m:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    t1 = os.times()
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    found = re.search(r"copied, ([0-9.e+-]+) s", done.stderr)
    child_cpu = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    return m.phase(total, float(found.group(1)) if found else None, extra_cpu=child_cpu)


def python_pass(path: str, bufs: list[torch.Tensor], total: int, write: bool, disk: DiskCounter) -> tuple[Phase, float]:
    """The pwrite / preadv loop over one O_DIRECT file, through `bufs` in turn; (its phase, the fsync
    seconds after it, untimed). A single buffer is stamped before each write."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as e:
        raise SystemExit(f"{path!r}: O_DIRECT open failed ({e.strerror}); this benchmark measures the disk without "
                         f"the page cache: choose --dir on a disk filesystem (ext4, xfs), not tmpfs") from e
    views = [memoryview(b.numpy()) for b in bufs]
    try:
        with Meter(disk) as m:
            for k, offset in enumerate(range(0, total, len(views[0]))):
                view = views[k % len(views)]
                if write and len(bufs) == 1:
                    stamp(bufs[0], offset)
                done = 0
                while done < len(view):
                    n = (os.pwrite(fd, view[done:], offset + done) if write
                         else os.preadv(fd, [view[done:]], offset + done))
                    if n <= 0:
                        raise OSError(f"{'pwrite' if write else 'preadv'} of {path!r} at {offset + done} moved {n} B")
                    done += n
        t0 = time.perf_counter()
        if write:
            os.fsync(fd)
        return m.phase(total), time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_round(work: str, args, raw: tuple, use_dd: bool, disk: DiskCounter) -> dict:
    out = {}
    if use_dd:
        path = os.path.join(work, "raw-dd.bin")
        try:
            out["dd_w"] = dd_pass(path, args.raw_bs, args.total_bytes, True, disk)
            out["dd_r"] = dd_pass(path, args.raw_bs, args.total_bytes, False, disk)
        finally:
            unlink_quietly(path)
    path = os.path.join(work, "raw-py.bin")
    try:
        out["py_w"], out["py_fsync"] = python_pass(path, raw[0], args.total_bytes, True, disk)
        out["py_r"], _ = python_pass(path, raw[1], args.total_bytes, False, disk)
    finally:
        unlink_quietly(path)
    return out


# ---- the machine ---------------------------------------------------------------------------------
def filesystem_line(path: str, disk: DiskCounter) -> str:
    """Filesystem type, device and mount point holding `path` (from /proc/mounts), and its free space."""
    real, best = os.path.realpath(path), None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, options = line.split()[:4]
                mnt = mnt.replace("\\040", " ")
                if ((real == mnt or real.startswith(mnt.rstrip("/") + "/"))
                        and (best is None or len(mnt) >= len(best[1]))):
                    best = (dev, mnt, fstype, options)
    except OSError:
        pass
    free = shutil.disk_usage(path).free / 1e9
    where = f"{best[2]} on {best[0]} (mounted at {best[1]}, {best[3]})" if best else "unknown filesystem"
    counted = (f"traffic counted on block device {disk.device}" if disk.available
               else "no block device found: traffic not counted")
    return f"{where}, {free:.0f} GB free; {counted}"


def dd_bandwidth(directory: str, nbytes: int, disk: DiskCounter) -> tuple[float, float]:
    """(write, read) bytes/s of dd with O_DIRECT in 8 MiB blocks over `nbytes` (rounded to whole blocks) of a
    scratch file in `directory`, removed afterwards."""
    path = os.path.join(directory, "tiers-raw-dd.bin")
    nbytes = max(nbytes // (8 << 20), 1) * (8 << 20)
    try:
        w = dd_pass(path, 8 << 20, nbytes, True, disk)
        r = dd_pass(path, 8 << 20, nbytes, False, disk)
    finally:
        unlink_quietly(path)
    return nbytes / w.seconds, nbytes / r.seconds


def page_cache_bytes() -> int:
    return getattr(psutil.virtual_memory(), "cached", 0)


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
