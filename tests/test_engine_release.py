"""A dropped engine frees its memory at once, without waiting for Python's cyclic garbage collector.

Found on an H200 (scripts/gpu_check.py): a closed engine still held 20 GB of device memory after `del engine`
until `gc.collect()` ran, because the engine was part of a reference cycle. The collector runs when object
counts grow, not bytes, so a notebook or a hyper-parameter search that makes one engine after another could
run out of device memory. These tests keep the collector off and check that nothing of ours forms a cycle.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from engine import initialize
from engine.models.gpt import GPT, preset_config

CASES = {
    "stage 0": ({"stage": 0}, {}),
    "stage 1": ({"stage": 1}, {}),
    "stage 2 bf16, optimizer offloaded": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"bf16": True}),
    "stage 3 bf16, everything on nvme": ({"stage": 3, "offload_optimizer": {"device": "nvme"},
                                          "offload_param": {"device": "nvme"}}, {"bf16": True}),
    "stage 3, activation checkpointing, tensorboard": ({"stage": 3}, {"checkpointing": True, "tensorboard": True}),
}


def _config(zero: dict, options: dict, tmp_path) -> dict:
    zero = copy.deepcopy(zero)
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key, {}).get("device") == "nvme":
            zero[key]["nvme_path"] = str(tmp_path)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": zero, "steps_per_print": 10**9, "bf16": {"enabled": options.get("bf16", False)}}
    if options.get("checkpointing"):
        cfg["activation_checkpointing"] = {"enabled": True}
    if options.get("tensorboard"):
        cfg["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "release"}
    return cfg


def _ours(obj) -> bool:
    return (getattr(type(obj), "__module__", "") or "").startswith(("engine.", "offload."))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_a_dropped_engine_is_freed_without_the_cyclic_collector(name, close, tmp_path):
    zero, options = CASES[name]
    torch.manual_seed(0)
    model = GPT(preset_config("tiny", n_layer=2, n_embd=32, n_head=4, block_size=16))
    engine = initialize(model, _config(zero, options, tmp_path))
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))  # engine.backward, then a loss.backward() (Note [tensor backward])
    engine.step()
    loss = engine(x, x)
    loss.backward()
    engine.step()
    if close:
        engine.close()
    freed = [weakref.ref(engine), weakref.ref(engine.runtime), weakref.ref(engine.optimizer),
             weakref.ref(engine.runtime.chunked.states[0].param_chunk.payload),
             weakref.ref(next(model.blocks[0].parameters()))]  # a view of a chunk: it keeps the chunk's storage
    del model, loss
    gc.collect()
    gc.disable()
    try:
        del engine
        alive = [ref() for ref in freed if ref() is not None]
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = sorted({type(o).__qualname__ for o in gc.garbage if _ours(o)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not alive, f"still alive after del without gc: {[type(a).__qualname__ for a in alive]}"
    assert not cyclic, f"objects of ours in reference cycles: {cyclic}"
