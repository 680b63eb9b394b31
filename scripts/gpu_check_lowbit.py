"""gpu_check's `lowbit` section: the fused 8-bit update (Note [fused 8-bit update]) on the device against torchao's
compiled `single_param_adam` on the same tile: bit equality and the time of each (skipped where torchao is absent)."""

from __future__ import annotations

import time

import torch

TILE = 1 << 20
STEPS = 3


def section_lowbit(simulate: bool) -> dict:
    try:
        from torchao.optim.adam import single_param_adam
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return {"skipped": "torchao is not installed"}
    from engine.optimizers.lowbit_kernel import adam8bit, tables

    device = torch.device("cpu") if simulate else torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(TILE, generator=g)
    states = [torch.randint(0, 256, (TILE,), generator=g, dtype=torch.uint8), torch.rand(TILE // 256, generator=g),
              torch.randint(0, 256, (TILE,), generator=g, dtype=torch.uint8), torch.rand(TILE // 256, generator=g)]
    grads = [torch.randn(TILE, generator=g).to(device) / 100 for _ in range(STEPS)]
    maps, lr = tables(device), torch.tensor(1e-3, device=device)
    ours = [t.to(device) for t in (weights, *states)]
    theirs = [t.to(device) for t in (weights, *states)]
    torchaos = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    seconds = {"ours": [], "torchao": []}
    for step in range(1, STEPS + 1):
        count = torch.tensor(float(step), device=device)
        began = time.perf_counter()
        adam8bit(ours[0], grads[step - 1], count, tuple(ours[1:]), maps, lr, 0.9, 0.999, 0.01, 1e-8, True)
        _sync(device)
        seconds["ours"].append(time.perf_counter() - began)
        moments = (OptimState8bit(theirs[1], theirs[2], maps.signed, True),
                   OptimState8bit(theirs[3], theirs[4], maps.unsigned, False))
        began = time.perf_counter()
        torchaos(theirs[0], grads[step - 1], count, *moments, None, lr, 0.9, 0.999, 0.01, 1e-8, True, False)
        _sync(device)
        seconds["torchao"].append(time.perf_counter() - began)
    equal = [bool(torch.equal(a, b)) for a, b in zip(ours, theirs)]
    # the first step compiles; the last is the steady one
    return {"device": str(device), "bit_equal_weights_codes_scales": equal,
            "ns_per_element": {k: round(v[-1] / TILE * 1e9, 3) for k, v in seconds.items()},
            "first_step_s": {k: round(v[0], 1) for k, v in seconds.items()},
            **({} if all(equal) else {"error": "the fused 8-bit update differs from torchao's compiled update"})}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
