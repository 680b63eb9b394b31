"""What the manifest holds besides layouts, as JSON: tensor-parallel specs, client state, optimizer options.

JSON, never pickle: a manifest is read without running code. Tensors inside `client_state` (a data
loader's generator state, say) go to rank 0's tensor file and the JSON keeps a reference to them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from engine.checkpoint.files import CheckpointError
from engine.tensor_parallel.shards import BlockSpec2D, BlockSpec3D, PieceSpec2D, PieceSpec3D, ShardSpec, Spec

_SPECS = {cls.__name__: cls for cls in (ShardSpec, BlockSpec2D, PieceSpec2D, BlockSpec3D, PieceSpec3D)}
TENSOR_REF = "__tensor__"


def encode_spec(spec: Spec) -> dict:
    return {"type": type(spec).__name__, **dataclasses.asdict(spec)}


def decode_spec(value: dict) -> Spec:
    fields = dict(value)
    kind = fields.pop("type")
    if kind not in _SPECS:
        raise CheckpointError(f"the manifest names an unknown tensor-parallel cut {kind!r}; it was written by a newer "
                              "Tiers: load it with that version")
    return _SPECS[kind](**fields)


def encode_client_state(value, tensors: dict[str, torch.Tensor], path: str = "client_state"):
    """`value` as JSON, its tensors moved into `tensors` (keys "client.<n>") and referenced."""
    if torch.is_tensor(value):
        key = f"client.{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {TENSOR_REF: key}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{path}: key {bad[0]!r} is not a string; "
                            "a checkpoint's client_state is JSON with tensors, so dict keys must be strings")
        if TENSOR_REF in value:
            raise TypeError(f"{path}: the key {TENSOR_REF!r} is reserved for tensor references; rename it")
        return {k: encode_client_state(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_client_state(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{path}: {value} cannot be stored in JSON; store it as a tensor (torch.tensor({value}))")
        return value
    raise TypeError(f"{path}: a {type(value).__name__} cannot be stored: a checkpoint's client_state holds JSON values "
                    "(dict with string keys, list, str, int, float, bool, None) and tensors, never pickles; convert it "
                    "(e.g. a data loader's state_dict())")


def decode_client_state(value, tensor_of):
    """The inverse of encode_client_state; `tensor_of(key)` reads a referenced tensor (lists come back as lists)."""
    if isinstance(value, dict):
        if set(value) == {TENSOR_REF}:
            return tensor_of(value[TENSOR_REF])
        return {k: decode_client_state(v, tensor_of) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, tensor_of) for v in value]
    return value


def json_options(group: dict) -> dict:
    """An optimizer param group's options without its parameters, as JSON values (tensors as numbers)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if torch.is_tensor(value):
            value = value.tolist()
        elif isinstance(value, tuple):
            value = [v.item() if torch.is_tensor(v) else v for v in value]
        if not (value is None or isinstance(value, (bool, int, float, str, list))):
            continue  # e.g. a callable: not an option a checkpoint can carry
        out[key] = value
    return out


def restore_options(group: dict, saved: dict) -> None:
    """The saved options back into a live param group (same types as the live ones: tuples, tensors)."""
    for key, value in saved.items():
        if key not in group or key == "params":
            continue
        live = group[key]
        if torch.is_tensor(live):
            live.fill_(value)
        elif isinstance(live, tuple):
            group[key] = tuple(value)
        else:
            group[key] = value


def json_state(owner: str, state: dict) -> dict:
    """A scheduler's or scaler's state_dict checked to be JSON (a checkpoint never pickles)."""
    import json

    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{owner}.state_dict() is not JSON ({e}); a checkpoint stores JSON, never pickles: give it a "
                        "state_dict of numbers, strings and lists") from None
    return state
