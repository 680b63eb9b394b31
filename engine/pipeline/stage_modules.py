"""The modules a pipeline split puts into an unmodified model: stand-ins for what another stage holds, and the
wrappers that start and end a stage at its first and last block (Note [pipeline stages of an unmodified model])."""

from __future__ import annotations

import enum
import inspect

import torch
from torch import nn

from engine.hf_model import transformers_model


class Place(enum.Enum):
    """Where a module outside the block list runs: before the blocks (embeddings) or after (norm, output)."""

    BEFORE = "before the blocks"
    AFTER = "after the blocks"
    BLOCK = "among the blocks"


class StageOutput(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """Raised by a stage's last block on a stage that is not the pipeline's last: carries what it sends on."""

    def __init__(self, value: torch.Tensor):
        super().__init__("pipeline stage output")
        self.value = value


class StageState:
    """What the running stage's forward shares with the modules the split put into the model."""

    def __init__(self):
        self.received: torch.Tensor | None = None  # what the previous stage sent (None on stage 0)
        self.blocks_started = False
        self.takes_use_cache: dict[int, bool] = {}  # id(view) -> its forward is run with use_cache False

    def begin(self, received: torch.Tensor | None) -> None:
        self.received, self.blocks_started = received, False

    def end(self) -> None:
        self.received, self.blocks_started = None, False


class VacantModule(nn.Module):
    """Stands in for a module another pipeline stage holds. Before the blocks, on a stage after the first, it
    gives zeros shaped like the hidden state received (its value is never used: the stage's first block takes
    the received hidden state instead; its shape, dtype and device are what the model's own mask and position
    code read); anywhere else it raises, naming the module."""

    def __init__(self, name: str, place: Place, held_by: str, state: StageState):
        super().__init__()
        self.name, self.place, self.held_by, self.state = name, place, held_by, state

    def forward(self, *args, **kwargs):
        state = self.state
        if self.place is Place.BEFORE and state.received is not None and not state.blocks_started:
            return torch.zeros_like(state.received)
        if state.received is None and not state.blocks_started and self.place is Place.BEFORE:
            where = "outside the pipeline"
        else:
            where = "at a point of the forward this stage does not run it"
        raise RuntimeError(
            f"{self.name} is held by {self.held_by} and was called {where}: a pipeline stage runs "
            f"the modules registered {self.place.value} of the block list only there; call the model through "
            "engine.train_batch / eval_batch, or, if the model calls it elsewhere, name the stages' first blocks "
            "in pipeline.partition so that it stays with the blocks that use it")

    def extra_repr(self) -> str:
        return f"{self.name}, held by {self.held_by}"


class StageBoundary(nn.Module):
    """Wraps a stage's first and/or last block: the first takes the hidden state the previous stage sent in
    place of its own first argument; the last, on a stage before the pipeline's last, ends the stage's forward
    by raising StageOutput with its output's hidden state."""

    def __init__(self, block: nn.Module, state: StageState, takes_input: bool, ends_stage: bool):
        super().__init__()
        self.block, self.state = block, state
        self.takes_input, self.ends_stage = takes_input, ends_stage

    def forward(self, *args, **kwargs):
        if self.takes_input:
            args, kwargs = _with_hidden_state(args, kwargs, self.state.received)
        self.state.blocks_started = True
        out = self.block(*args, **kwargs)
        if self.ends_stage:
            raise StageOutput(_hidden_state_of(out))
        return out


def run_stage_view(view: nn.Module, state: StageState, received: torch.Tensor | None, args: tuple, kwargs: dict,
                   around) -> tuple[object, bool]:
    """A stage's view run on one micro-batch's arguments, its first block taking `received`, inside `around()`:
    (the hidden state its last block sends on, False), or (the model's own output, True) when it ran to the end.
    A forward that takes `use_cache` runs with it False: a training step reads no key/value cache, and a cache
    sized by the whole model's config would not fit a stage's blocks (Note [pipeline stages of an unmodified
    model])."""
    takes = state.takes_use_cache.get(id(view))
    if takes is None:
        takes = state.takes_use_cache[id(view)] = _takes_use_cache(view)
    if takes:
        kwargs = {**kwargs, "use_cache": False}
    state.begin(received)
    try:
        with around():
            return view(*args, **kwargs), True
    except StageOutput as sent:
        return sent.value, False
    finally:
        state.end()


def _takes_use_cache(view: nn.Module) -> bool:
    """The forward names use_cache, or passes its keyword arguments on to a transformers model (a PEFT model)."""
    parameters = inspect.signature(view.forward).parameters
    if "use_cache" in parameters:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) and \
        transformers_model(view) is not None


def _with_hidden_state(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    """The block's call with its hidden state (its first argument, or keyword `hidden_states`) replaced."""
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    name = next((k for k, v in kwargs.items() if torch.is_tensor(v) and v.is_floating_point()), None)
    if name is None:
        raise RuntimeError("a pipeline stage's first block was called without a hidden-state argument (no "
                           "positional argument, no `hidden_states`, no floating-point tensor keyword)")
    return args, {**kwargs, name: hidden}


def _hidden_state_of(out) -> torch.Tensor:
    """A block's output hidden state: the output itself, or the first element of a tuple or ModelOutput."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    if isinstance(out, dict) and out and torch.is_tensor(next(iter(out.values()))):
        return next(iter(out.values()))
    raise RuntimeError(f"a pipeline stage's last block returned {type(out).__name__}, not a tensor or a tuple "
                       "starting with one; the pipeline sends a block's hidden state on to the next stage")
