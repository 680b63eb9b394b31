"""The host memory a training process needs before any model: the interpreter, torch, the engine.

Measured, not assumed: a fresh interpreter (this one's executable and environment) trains the tiny
example GPT for two steps under the engine and reports its peak resident set, less the tiny model's
own states. That covers torch's libraries, one-time allocations of the first step (kernels, thread
pools, the fused optimizer) and the engine; it varies with the machine and torch build (~0.3 GB
for torch 2.13 on CPU), so it is measured where the estimate runs.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

_PROBE = """
import json, resource, torch
from engine import initialize
from engine.models import gpt_tiny
torch.set_num_threads(1)
engine = initialize(gpt_tiny(), {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
for _ in range(2):
    ids = torch.zeros(1, 32, dtype=torch.long)
    engine.backward(engine(ids, ids))
    engine.step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak": peak, "states": sum(engine.model_state_bytes().values())}))
"""


@functools.cache
def runtime_host_bytes() -> int:
    """Peak RSS of a process training a tiny model, less that model's states (Linux, macOS: ru_maxrss)."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                          env=_probe_environment())
    if done.returncode != 0:
        raise RuntimeError(f"measuring the runtime's memory failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    scale = 1 if sys.platform != "darwin" else 1 / 1024  # macOS reports ru_maxrss in bytes
    return int(result["peak"] * scale) - result["states"]


def _probe_environment() -> dict[str, str]:
    import os
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # one process on its own, never joining a job this one belongs to
    return env
