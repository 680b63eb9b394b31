"""What DeepSpeed has and Tiers does not: an error naming the call and what to use instead, never a no-op."""

from __future__ import annotations


class NotInTiers(AttributeError, NotImplementedError):
    """A DeepSpeed call Tiers does not provide (an AttributeError, so hasattr() answers False)."""


def refuse(call: str, instead: str) -> None:
    raise NotInTiers(f"{call} is DeepSpeed's and has no Tiers counterpart; use {instead} instead "
                     "(docs/migrating-from-deepspeed.md)")
