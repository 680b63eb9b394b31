"""`tiers launch --launcher local` running real jobs: 2 "nodes" of torchrun on this machine, gloo on 127.0.0.1.

The example GPT under ZeRO-2 over 2 nodes x 2 processes must follow the plain single-process PyTorch trajectory;
a failing node must stop the job and be named; Ctrl-C must leave no process behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from engine.checkpoint import consolidate, resolve
from engine.models import TokenBatches, gpt_from_preset, load_corpus
from tests.distributed import free_port
from tests.reference import assert_close_relative, assert_params_close
from tests.test_data_parallel import ADAMW, adamw

REPO = Path(__file__).resolve().parent.parent
STEPS = 4
ZERO2 = {"train_batch_size": 8, "gradient_accumulation_steps": 1, "seed": 0,
         "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": {"stage": 2}}


def _launch(tmp_path, hostfile: str, *args, **popen):
    (tmp_path / "hostfile").write_text(hostfile)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HOME=str(tmp_path))  # no .tiers_env but the test's own
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--hostfile", "hostfile", "--launcher", "local",
           "--master_port", str(free_port()), *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def _plain_pytorch(data: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """What scripts/train.py does with ZERO2, in one process without the engine: the same seed, model and
    global batches (TokenBatches draws the same rows for 1 x 8 as for 4 x 2), torch's AdamW."""
    torch.manual_seed(0)
    model = gpt_from_preset("tiny")
    batches = TokenBatches(load_corpus(data), block_size=model.config.block_size, micro_batch_size=8, seed=0)
    optimizer = adamw(model.parameters())
    losses = []
    for _ in range(STEPS):
        batch = batches.next_batch()
        loss = model(batch["input_ids"], batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_two_nodes_of_two_processes_train_zero2_as_one_process_does(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("".join(f"line {i}: the {i % 7} quick foxes jump over {i % 13} lazy dogs.\n" for i in range(400)))
    (tmp_path / "zero2.json").write_text(json.dumps(ZERO2))
    job = _launch(tmp_path, "node-a slots=2\nnode-b slots=2\n", str(REPO / "scripts" / "train.py"),
                  "--config", "zero2.json", "--model", "tiny", "--data", str(data), "--steps", str(STEPS),
                  "--eval-every", str(STEPS), "--eval-batches", "1", "--loss-log", "losses.jsonl",
                  "--save-dir", "ckpt", "--save-every", str(STEPS))
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, f"exit {job.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert "local: 2 node(s), 4 process(es)" in err and "4 dp rank(s)" in out, (out, err)

    expected_losses, expected_params = _plain_pytorch(data)
    losses = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in losses] == list(range(1, STEPS + 1))
    assert_close_relative([entry["loss"] for entry in losses], expected_losses)
    consolidate(resolve(str(tmp_path / "ckpt"), None), str(tmp_path / "final"), None)
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert_params_close({name: final[name] for name in expected_params}, expected_params)


def _job_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            pass
    return found


def _wait_for_workers(job, marker: str, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    def workers():
        return [p for p in _job_processes(marker) if not {"torch.distributed.run", "engine.cli"} & set(p.cmdline())]

    while len(workers()) < count:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)


def test_a_failing_node_stops_the_job_and_is_named(tmp_path):
    """node-b's worker exits with 3; node-a's would sleep for 10 minutes. The launcher stops node-a, names node-b
    and its agent's exit code, and exits non-zero; nothing of the job is left running."""
    script = tmp_path / "fail_on_node_b.py"
    script.write_text("import os, sys, time\nif os.environ['GROUP_RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n")
    start = time.monotonic()
    job = _launch(tmp_path, "node-a slots=1\nnode-b slots=1\n", str(script))
    out, err = job.communicate(timeout=120)
    assert job.returncode == 1, (out, err)  # torchrun's exit code when a worker fails
    assert ("tiers launch: node 'node-b' (node_rank 1) failed with exit code 1; "
            "stopping node 'node-a' (node_rank 0)") in err, err
    assert "exitcode  : 3" in err, err  # torchrun's own report of the worker, passed through
    assert time.monotonic() - start < 90
    assert not _job_processes(str(script))


def test_ctrl_c_stops_every_node(tmp_path):
    script = tmp_path / "sleep_forever.py"
    script.write_text("import time\ntime.sleep(600)\n")
    job = _launch(tmp_path, "node-a slots=1\nnode-b slots=1\n", str(script), start_new_session=True)
    _wait_for_workers(job, str(script), count=2)
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGINT, (out, err)
    assert "tiers launch: SIGINT: stopping 2 node command(s)" in err, err
    assert not _job_processes(str(script))
