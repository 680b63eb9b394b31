"""Peak-RSS measurements of a rank building a large model with zero_init (tests of stage 3)."""

from __future__ import annotations

import resource

import torch

from engine import zero_init
from engine.models import gpt_from_preset
from tests.test_zero import zero_config

# glibc's mmap threshold adapts upward and then keeps freed blocks: fixed, a freed chunk goes back to
# the OS and RSS counts memory in use (set it in the parent: each spawned rank reads it at start-up)
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", str(1 << 20))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def build_after_warm_up(**gpt) -> tuple[torch.nn.Module, int]:
    """(a GPT built with zero_init under seed 0, the peak RSS before it). A tiny build first pays torch's
    one-time costs of a first construction (~75 MB), which are not the model's."""
    with zero_init():
        gpt_from_preset("tiny")
    before = peak_rss_bytes()
    torch.manual_seed(0)
    with zero_init():
        model = gpt_from_preset("small", **gpt)
    return model, before


def stage3_config(chunk_elements: int) -> dict:
    """Stage 3, micro batch 1, AdamW, the given chunk size and twice that gathered ahead at most."""
    cfg = zero_config(3, 1, 1, chunk_size=chunk_elements, stage3_prefetch_bucket_size=2 * chunk_elements)
    cfg["optimizer"]["params"] = {"lr": 1e-4}
    return cfg
