"""How queries attend to keys, as one record the split attentions (ring, Ulysses) and their blocks take."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Attending:
    """The mask and scaling of an attention: causal or not, a key `window` or more positions before its query hidden
    (None: no window), the logits capped at ±softcap (softcap·tanh(s/softcap), before the mask, as Hugging Face's
    eager attention does; None: uncapped), the scores scaled by `scale` (None: 1/sqrt of the head size)."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    causal: bool = True

    def scaled_for(self, head_size: int) -> Attending:
        """This record with its scale set: the default 1/sqrt(head_size) where none was given."""
        return self if self.scale is not None else dataclasses.replace(self, scale=1.0 / math.sqrt(head_size))
