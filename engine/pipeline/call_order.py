"""Where a model calls the modules beside its block list: before its blocks or after them.

Registration order usually says it (embeddings are registered before the layers, the final norm after), but not
always: OPT registers its decoder's final_layer_norm before its layers and calls it after them. One forward on a
fake copy of the model (no memory, no compute: engine/tensor_parallel/derive/trace.py) shows where each is first
called; a module called among the blocks, or on both sides of them, cannot be held by one stage and is refused
at initialize, naming it (Note [pipeline stages of an unmodified model]).
"""

from __future__ import annotations

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.pipeline.stage_modules import Place
from engine.tensor_parallel.derive.trace import TraceFailed, example_input, fake_copy, trace


def traced_places(model: nn.Module, list_name: str, names: list[str], what: str) -> dict[str, Place] | None:
    """name -> where the forward calls that module (before or after the blocks), for each of `names`; None when the
    model's forward does not run on fake tensors (the caller keeps registration order). `what` names the option
    in errors."""
    mode = FakeTensorMode()
    try:
        copy = fake_copy(model, mode)
        args, kwargs, _ = example_input(copy, mode)
    except (ValueError, RuntimeError, TypeError, NotImplementedError):
        return None
    blocks = list(copy.get_submodule(list_name))
    phase, seen = [Place.BEFORE], {name: [] for name in names}
    handles = [blocks[0].register_forward_pre_hook(lambda *_: phase.__setitem__(0, Place.BLOCK)),
               blocks[-1].register_forward_hook(lambda *_: phase.__setitem__(0, Place.AFTER))]
    for name in names:
        handles.append(copy.get_submodule(name).register_forward_pre_hook(
            lambda *_, name=name: seen[name].append(phase[0])))
    try:
        trace(copy, args, kwargs, mode, kind=lambda _module: None)
    except TraceFailed:
        return None
    finally:
        for handle in handles:
            handle.remove()
    places = {}
    for name, calls in seen.items():
        if Place.BLOCK in calls or len(set(calls)) > 1:
            raise ValueError(f"{what}: {name} is called {_where(calls)}, and only the modules called before the block "
                             "list or after it can run on one stage; name the stages' first blocks in "
                             "pipeline.partition so that it stays with the blocks that call it, or use "
                             "pipeline.stages 1")
        if calls:
            places[name] = calls[0]
    return places


def _where(calls: list[Place]) -> str:
    return " and ".join(sorted({place.value for place in calls}))
