"""What ColossalAI has and Tiers does not: an error naming the call or argument and what to use, never a no-op."""

from __future__ import annotations


class NotInTiers(NotImplementedError):
    """A ColossalAI call or argument value Tiers does not provide."""


def refuse(call: str, instead: str) -> None:
    raise NotInTiers(f"{call} is not built in Tiers; {instead} (docs/migrating-from-colossalai.md)")
