"""Pretrained weights read from safetensors files by byte range, for models built under zero_init.

Note [streamed weights]
A model built under zero_init gets pretrained weights without any rank holding them whole:
- `with zero_init(): AutoModelForCausalLM.from_pretrained(path)`: transformers reads safetensors through a memory
  map and hands the module each loaded tensor as a zero-copy view of the mapped file (when it keeps the file's
  dtype: `dtype="auto"`, transformers 5's default). zero_init's registration hook swaps it for a meta parameter and
  records where its bytes lie in the file (`mapped_file_range`, from the process's memory map), touching none of
  them; a view with a page written since the file was mapped (its own copy now: pagemap says so) is not trusted
  to be the file's bytes. A tensor that is no such view (transformers converted its dtype or fused it) is kept
  whole as its initial value, with a warning, as any value a module is built with.
- `initialize(model, cfg, weights=path)`: the safetensors headers (one file, or a directory holding
  model.safetensors or model.safetensors.index.json and its shards) give each tensor's byte range. The model's
  state-dict keys (a tied parameter: any one of its names) must be the files' keys exactly, with their shapes
  (floating dtypes convert at load); otherwise an error names the missing, unexpected and mis-shaped keys before
  anything is read.
- initialize then reads, per parameter, only the elements this rank keeps (its shard under stage 3, the whole
  parameter at stages 0-2 and for persistent ones) with pread, straight into the shard where it is a CPU tensor of
  the file's dtype (in memory or in the chunk manager's buffer of its CPU or NVMe home), else through a buffer of
  that part's size: no rank reads another rank's bytes, and what was read sits in the page cache, not the process.
- Ranks do not compare the values they read (none reads all of them). Each parameter's file layout (file size,
  offset, dtype, shape) enters zero_init's recipe instead, so a rank whose files lay out differently from rank 0's
  gets rank 0's values, broadcast; ranks whose layouts agree are trusted to read the same checkpoint, as
  torch.distributed.checkpoint trusts its files.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from offload.direct_io import as_buffer

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class FileRange:
    """Where one tensor's bytes lie in a file: contiguous, row-major, `dtype` elements of `shape` from `offset`."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def identity(self) -> tuple:
        """What ranks compare (Note [streamed weights]): the layout, not the path (each node has its own)."""
        return self.file_size, self.offset, str(self.dtype), self.shape

    def read(self, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements [first, first + count) of the flattened tensor (default: all of it), as a new 1-D CPU tensor."""
        count = self.numel - first if count is None else count
        out = torch.empty(count, dtype=self.dtype)
        self._read_into(out, first)
        return out

    def read_into(self, target: torch.Tensor, first: int) -> None:
        """Elements [first, first + target.numel()) into `target` (any device, dtype and contiguous shape): straight
        into its memory where it is a contiguous CPU tensor of this dtype, else through a buffer."""
        if target.device.type == "cpu" and target.dtype == self.dtype and target.is_contiguous():
            self._read_into(target, first)
        else:
            target.copy_(self.read(first, target.numel()).view(target.shape))

    def _read_into(self, out: torch.Tensor, first: int) -> None:
        if first < 0 or first + out.numel() > self.numel:
            raise IndexError(f"elements [{first}, {first + out.numel()}) of a {self.numel}-element tensor")
        view = as_buffer(out.reshape(-1).view(torch.uint8))
        position, done = self.offset + first * self.dtype.itemsize, 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < len(view):
                n = os.preadv(fd, [view[done:]], position + done)
                if n == 0:
                    raise ValueError(f"{self.path} ends at byte {position + done}, inside a tensor that needs "
                                     f"{len(view) - done} more bytes: the file is truncated or was rewritten")
                done += n
        finally:
            os.close(fd)


def mapped_file_range(t: torch.Tensor) -> FileRange | None:
    """Where `t`'s bytes lie in a file it is an unwritten memory-mapped view of (safetensors' zero-copy load); None
    when it is no such view (memory torch allocated, not contiguous, not on the CPU, a page written since it was
    mapped) or the system shows no memory map."""
    if t.device.type != "cpu" or t.is_meta or not t.is_contiguous() or t.numel() == 0:
        return None
    if t.untyped_storage().resizable():  # memory of torch's own allocator: no file behind it
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    start = t.data_ptr()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if not low <= start < high:
            continue
        path = fields[5]
        if path.endswith(" (deleted)") or not os.path.isfile(path):
            return None
        offset, size = int(fields[2], 16) + start - low, os.path.getsize(path)
        if start + t.nbytes > high or offset + t.nbytes > size or not _unwritten(start, t.nbytes):
            return None
        return FileRange(path, offset, t.dtype, tuple(t.shape), size)
    return None


def _unwritten(address: int, nbytes: int) -> bool:
    """Whether no page of [address, address + nbytes) was written since it was mapped: a written page of a private
    file mapping is a copy of its own (anonymous, or swapped out), which /proc/self/pagemap tells per page. False
    where pagemap cannot be read (the bytes are then taken from memory, not from the file)."""
    first, last = address // mmap.PAGESIZE, (address + nbytes - 1) // mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return False
    if len(entries) != last - first + 1:
        return False
    present, swapped, file_page = ((entries >> np.uint64(b)) & np.uint64(1) for b in (63, 62, 61))
    return not bool(np.any((present & (1 - file_page)) | swapped))


def safetensors_ranges(path: str | os.PathLike) -> dict[str, FileRange]:
    """Each tensor's FileRange in one safetensors file (its header; no data is read)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if 8 + length > size:
            raise ValueError(f"{path} is not a safetensors file (its header length {length} exceeds the file)")
        header = json.loads(f.read(length))
    ranges = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which Tiers does not read")
        begin, end = entry["data_offsets"]
        ranges[key] = FileRange(path, 8 + length + begin, _DTYPES[entry["dtype"]], tuple(entry["shape"]), size)
        if ranges[key].nbytes != end - begin or 8 + length + end > size:
            raise ValueError(f"{path}: tensor {key!r}'s byte range [{begin}, {end}) does not hold its shape "
                             f"{tuple(entry['shape'])} {entry['dtype']} inside the file: the file is damaged")
    return ranges


def checkpoint_ranges(path: str | os.PathLike) -> dict[str, FileRange]:
    """Every tensor's FileRange in a safetensors checkpoint: a file, an index (model.safetensors.index.json), or a
    directory holding either."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            path = path / INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            path = path / SINGLE_NAME
        else:
            raise FileNotFoundError(f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}: weights= reads safetensors "
                                    "checkpoints (save one with save_pretrained(..., safe_serialization=True) or "
                                    "safetensors.torch.save_file)")
    if not path.is_file():
        raise FileNotFoundError(f"weights: {path} does not exist")
    if path.suffix != ".json":
        return safetensors_ranges(path)
    weight_map = json.loads(path.read_text())["weight_map"]
    ranges: dict[str, FileRange] = {}
    for name in sorted(set(weight_map.values())):
        in_file = safetensors_ranges(path.parent / name)
        for key in [k for k, f in weight_map.items() if f == name]:
            if key not in in_file:
                raise ValueError(f"{path} maps tensor {key!r} to {name}, which does not hold it")
            ranges[key] = in_file[key]
    return ranges


def assign_weight_files(model: nn.Module, path: str | os.PathLike, recording) -> None:
    """Note [streamed weights]: `model`'s parameters and persistent buffers take their values from the checkpoint
    at `path`: a meta parameter zero_init recorded (`recording`, an InitRecording or None) is read at initialize,
    shard by shard; a real tensor is read now. Raises, naming them, for missing, unexpected or mis-shaped keys
    before it reads or changes anything."""
    ranges = checkpoint_ranges(path)
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():  # a tied parameter under each of its names
        names_of.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    missing, mismatched, chosen = [], [], {}
    for tid, names in names_of.items():
        name = next((n for n in names if n in ranges), None)
        if name is None:
            missing.append(names[0])
            continue
        t, source = tensors[tid], ranges[name]
        recorded = recording is not None and recording.knows(t)
        shape = tuple(recording.shape(t) if recorded else t.shape)
        floats = t.dtype.is_floating_point and source.dtype.is_floating_point
        if shape != source.shape or (t.dtype != source.dtype and not floats):
            mismatched.append(f"{name} ({source.shape} {source.dtype} in the files, {shape} {t.dtype} in the model)")
        elif t.is_meta and not recorded:
            raise ValueError(f"{name} is on the meta device but was not built inside engine.zero_init(): build the "
                             "model inside `with zero_init():` to load weights= into it")
        else:
            chosen[tid] = (source, recorded)
    unexpected = sorted(set(ranges) - {n for names in names_of.values() for n in names})
    if missing or unexpected or mismatched:
        raise ValueError(_mismatch_message(path, missing, unexpected, mismatched))
    with torch.no_grad():
        for tid, (source, recorded) in chosen.items():
            if recorded:
                recording.assign_file(tensors[tid], source)
            else:
                source.read_into(tensors[tid].data, 0)


def _mismatch_message(path, missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    def listed(what: str, keys: list[str]) -> str:
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        return f"{what} ({len(keys)}): {shown}" if keys else ""

    parts = [listed("missing from the files", missing), listed("in the files but not in the model", unexpected),
             listed("of another shape or kind", mismatched)]
    return (f"weights={os.fspath(path)!r} does not match the model: " + "; ".join(p for p in parts if p) +
            ". The files' keys must be the model's state_dict() keys with their shapes; a Hugging Face checkpoint "
            "whose names differ loads with from_pretrained under zero_init, which maps them")
