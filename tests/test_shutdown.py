"""A clean shutdown under torchrun leaves no gloo threads to die at interpreter exit.

torch binds the world group as a default argument of torch.distributed.nn.functional when it first imports it,
lazily, from inside torch.optim.Optimizer. Had the engine started the process group before that import, the world
group would outlive destroy_process_group, and its worker threads would be torn down during interpreter shutdown,
where they can abort the process (CI once saw rank 0 of scripts/train.py exit with SIGABRT after training:
"terminate called without an active exception")."""

import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port

REPO = Path(__file__).resolve().parent.parent

JOB = """
import gc, os, torch, torch.distributed as dist
from engine import initialize
from engine.models import gpt_from_preset

torch.manual_seed(0)
model = gpt_from_preset("tiny")
engine = initialize(model, {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                            "zero_optimization": {"stage": 2}})
ids = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
engine.backward(engine(ids, ids))
engine.step()
engine.close()
del engine, model
gc.collect()
dist.destroy_process_group()
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
os.write(1, f"threads after shutdown: {threads}\\n".encode())  # one write: the two ranks' lines never interleave
"""


def thread_reports(tmp_path, job: str) -> list[str]:
    """`job` under torchrun on 2 ranks; each rank's line naming the threads left after its shutdown."""
    (tmp_path / "job.py").write_text(job)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "job.py"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [line for line in done.stdout.splitlines() if line.startswith("threads after shutdown:")]
    assert len(reports) == 2, done.stdout
    return reports


def test_engine_started_groups_leave_no_gloo_threads_after_destroy_process_group(tmp_path):
    for report in thread_reports(tmp_path, JOB):
        assert "gloo" not in report, f"gloo threads outlived destroy_process_group: {report}"


DEEPSPEED_STYLE_JOB = """
import atexit, os, torch
from torch import nn


def report():  # registered first, so it runs after the handlers registered later (atexit runs last-in, first-out)
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    os.write(1, f"threads after shutdown: {threads}\\n".encode())


atexit.register(report)
from engine.compat import deepspeed


def main():  # the engine is a local, as in DeepSpeed's examples: it is dropped when main returns
    deepspeed.init_distributed()
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
        "train_batch_size": 4, "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()


main()
"""


def test_deepspeed_style_scripts_leave_no_gloo_threads_at_exit(tmp_path):
    """A DeepSpeed script never destroys its process group: the one deepspeed.init_distributed started is destroyed
    at exit, before the interpreter tears gloo's threads down. Its engine, dropped when main() returned, must be
    collectable for that (Note [weak parameter hooks]): a parameter hook holding it kept every group alive."""
    for report in thread_reports(tmp_path, DEEPSPEED_STYLE_JOB):
        assert "gloo" not in report, f"gloo threads outlived the script: {report}"


NATIVE_JOB = """
import atexit, os, torch
from torch import nn


def report():  # registered first, so it runs after the handlers registered later (atexit runs last-in, first-out)
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    os.write(1, f"threads after shutdown: {threads}\\n".encode())


atexit.register(report)
from engine import initialize



def main():
    engine = initialize(nn.Linear(4, 2), {"train_batch_size": 4, "optimizer": {"type": "Adam"},
                                          "zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()


main()
"""


def test_scripts_that_never_destroy_the_group_initialize_started_leave_no_gloo_threads_at_exit(tmp_path):
    """The group initialize() started from torchrun's environment is destroyed at exit (Note [shutting down at
    exit])."""
    for report in thread_reports(tmp_path, NATIVE_JOB):
        assert "gloo" not in report, f"gloo threads outlived the script: {report}"
