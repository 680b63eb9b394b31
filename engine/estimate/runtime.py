"""The host memory a training process needs before any model: the interpreter, torch, the engine.

Measured, not assumed: a fresh interpreter (this one's executable and environment) trains the tiny
example GPT for two steps under the engine and reports its peak resident set, less the tiny model's
own states. That covers torch's libraries, one-time allocations of the first step (kernels, thread
pools, the fused optimizer) and the engine; it varies with the machine and torch build (~0.3 GB
for torch 2.13 on CPU), so it is measured where the estimate runs. The optional packages a config
trains with (torchao for the low-bit optimizers: ~85 MB here) are imported by the probe too, and where
the config compiles its optimizer's update the probe compiles a small function (~90 MB more here).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

_PROBE = """
import importlib, json, sys, torch
from engine import initialize
from engine.estimate.runtime import peak_rss_bytes, reset_peak_rss
from engine.models import gpt_tiny
reset_peak_rss()
for package in sys.argv[1:]:
    if package == "--compile":  # torch.compile's own libraries and one compiled graph
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(8))
    else:
        importlib.import_module(package)
torch.set_num_threads(1)
engine = initialize(gpt_tiny(), {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
for _ in range(2):
    ids = torch.zeros(1, 32, dtype=torch.long)
    engine.backward(engine(ids, ids))
    engine.step()
print(json.dumps({"peak": peak_rss_bytes(), "states": sum(engine.model_state_bytes().values())}))
"""


@functools.cache
def runtime_host_bytes(packages: tuple[str, ...] = (), compiles: bool = False) -> int:
    """Peak RSS of a process that imports `packages` (compiles a small function, with `compiles`) and trains a tiny
    model, less that model's states (Linux, macOS: ru_maxrss)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, *packages, *(["--compile"] if compiles else [])],
                              capture_output=True, text=True, timeout=300,
                              env=_probe_environment())
    except subprocess.TimeoutExpired as e:
        raise RuntimeError("measuring the runtime's memory (a tiny model trained in a fresh interpreter) took over "
                           "300 s; check that this machine is not overloaded and retry") from e
    if done.returncode != 0:
        raise RuntimeError(f"measuring the runtime's memory failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["peak"] - result["states"]


def reset_peak_rss() -> bool:
    """Linux: the peak RSS starts again from the current RSS. A child process started by fork inherits its
    parent's peak (ru_maxrss survives exec), so a large parent would otherwise count as the child's.
    False where it cannot be reset (not Linux, or not permitted: ru_maxrss stands)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM on Linux (resettable), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _probe_environment() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # one process on its own, never joining a job this one belongs to
    return env
