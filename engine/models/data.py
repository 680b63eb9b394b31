"""Byte-level training data that every machine has without a download.

* :func:`default_corpus_bytes` - the Python standard library's ``.py`` sources,
  concatenated in sorted path order (deterministic for a given Python build).
* :func:`load_corpus` - a file's bytes, or the default corpus, as an int64 tensor.
* :class:`TokenBatches` - random ``block_size`` windows, sharded over
  data-parallel ranks so that ``world_size`` ranks with ``micro_batch_size`` rows
  each see exactly the rows one process with ``micro_batch_size * world_size``
  rows would see.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from typing import Iterator

import torch

__all__ = ["DEFAULT_MAX_BYTES", "default_corpus_bytes", "load_corpus", "TokenBatches"]

DEFAULT_MAX_BYTES = 8_000_000

# Directory names never descended into while walking the standard library.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


@functools.lru_cache(maxsize=8)
def default_corpus_bytes(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The stdlib's ``.py`` files, concatenated in sorted order, cut at ``max_bytes``.

    Site-packages, test directories and unreadable files are skipped.  Files are
    separated by a newline.  The result is cached (bytes are immutable).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    stdlib = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # Sort in place so os.walk visits sub-directories deterministically.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, filename), "rb") as f:
                    text = f.read()
            except OSError:
                continue
            if not text:
                continue
            parts.append(text)
            parts.append(b"\n")
            total += len(text) + 1
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    corpus = b"".join(parts)
    if not corpus:
        raise RuntimeError(f"no .py sources found under the Python standard library {stdlib!r}")
    return corpus


def _bytes_to_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Byte tokens (a 1-D int64 tensor with values 0..255).

    From ``path`` if given (read whole, then cut at ``max_bytes`` unless it is
    None), else from :func:`default_corpus_bytes`.
    """
    if path is None:
        return _bytes_to_tokens(default_corpus_bytes(max_bytes or DEFAULT_MAX_BYTES))
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file not found: {path!r}")
    with open(path, "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes)
    if not data:
        raise ValueError(f"corpus file is empty: {path!r}")
    return _bytes_to_tokens(data)


class TokenBatches:
    """Random next-token-prediction batches from a 1-D token tensor.

    Each micro-step, a ``torch.Generator`` seeded with ``seed`` draws a *global*
    batch of ``micro_batch_size * world_size`` start offsets; rank ``r`` takes
    rows ``[r*B, (r+1)*B)``.  Every rank draws the same global offsets, so the
    ranks together see exactly what one process with ``B * world_size`` rows sees.

    The last ``val_fraction`` (5%) of the tokens form the "val" split, the rest
    the "train" split; a window never crosses from one split into the other.

    Batches are ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}``
    on the CPU, with ``labels`` the inputs shifted left by one token.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        micro_batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
        val_fraction: float = 0.05,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if block_size <= 0 or micro_batch_size <= 0:
            raise ValueError("block_size and micro_batch_size must be positive")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")

        n = tokens.numel()
        n_val = int(n * val_fraction)
        data = tokens[: n - n_val] if split == "train" else tokens[n - n_val :]
        if data.numel() < block_size + 1:
            raise ValueError(
                f"{split} split has {data.numel()} tokens; need at least block_size+1 = {block_size + 1}"
            )
        self.data = data.detach().to("cpu", torch.int64).contiguous()
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.split = split
        self.step = 0
        self._window = torch.arange(block_size + 1)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    @property
    def global_batch_size(self) -> int:
        """Rows per micro-step over all ranks."""
        return self.micro_batch_size * self.world_size

    def next_batch(self) -> dict[str, torch.Tensor]:
        high = self.data.numel() - self.block_size  # last valid offset is high-1
        offsets = torch.randint(0, high, (self.global_batch_size,), generator=self.generator)
        B = self.micro_batch_size
        mine = offsets[self.rank * B : (self.rank + 1) * B]
        rows = self.data[mine[:, None] + self._window]  # [B, T+1]
        self.step += 1
        return {
            "input_ids": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    # Resumable: checkpoint the position in the random stream.
    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "rng_state": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.step = state["step"]
        self.generator.set_state(state["rng_state"])

    def reset(self) -> None:
        """Back to the first batch."""
        self.step = 0
        self.generator.manual_seed(self.seed)
