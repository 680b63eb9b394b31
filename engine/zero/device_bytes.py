"""The model state a rank holds on its compute device, by kind (Note [separate device memory])."""

from __future__ import annotations

import torch

from engine.zero.chunked_params import ChunkedParams
from offload.chunk import Location


def device_state_bytes(chunked: ChunkedParams, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state on the compute device, by kind ("param", frozen chunks included; "grad", "optim",
    "master"): the chunks, shards, masters and optimizer states held in memory (storage that is released counts
    nothing), plus what an offloaded optimizer's chunk manager holds on its device tier. Where the device is the
    host, that is host memory."""
    held = {"param": sum(p.untyped_storage().nbytes() for p in chunked.param_payloads()),
            "grad": sum(g.untyped_storage().nbytes() for g in chunked.grad_payloads()), "optim": 0, "master": 0}
    held["param"] += chunked.sharded_params.shard_bytes()  # 0 under the degenerate layout (Note [stage predicates])
    held["grad"] += chunked.sharded_grads.shard_bytes()
    held["optim"] = sum(v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)
    if chunked.has_masters:
        held["master"] = chunked.masters.nbytes()
        held["grad"] += sum(g.untyped_storage().nbytes() for g in chunked.masters.grads)
    manager = getattr(optimizer, "manager", None)
    if manager is not None:
        for kind, nbytes in manager.used_bytes_by_kind(Location.DEVICE).items():
            kind = "param" if kind == "frozen" else kind  # frozen shards are parameters (Note [frozen chunks])
            held[kind] = held.get(kind, 0) + nbytes
    return held
