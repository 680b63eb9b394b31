"""Sequence and context parallelism: attention over a sequence split across ranks (ring_attention, ulysses), and an
unmodified model's forward run on this rank's part of each sequence (runtime)."""

from engine.sequence_parallel.attending import Attending
from engine.sequence_parallel.ring_attention import ring_attention, zigzag_positions
from engine.sequence_parallel.ulysses import ulysses_attention

__all__ = ["Attending", "ring_attention", "ulysses_attention", "zigzag_positions"]
