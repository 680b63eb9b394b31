"""Sequence and context parallelism (issue 23, in progress): attention over a sequence split across ranks."""

from engine.sequence_parallel.ring_attention import ring_attention, zigzag_positions

__all__ = ["ring_attention", "zigzag_positions"]
