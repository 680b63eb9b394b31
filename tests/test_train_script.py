"""The example job, scripts/train.py, run as a user runs it: a subprocess on a tiny model."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train.py"


def _run(args, cwd, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)  # one process, even when pytest itself runs under torchrun
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_trains_tiny_model_and_reports(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 300)
    config = json.loads((REPO / "configs" / "dp.json").read_text())
    config["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "test"}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))

    result = _run(["--config", str(config_path), "--model", "tiny", "--data", str(data),
                   "--steps", "6", "--eval-every", "3", "--eval-batches", "2"], cwd=tmp_path)

    out = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{out}\nstderr:\n{result.stderr}"
    assert re.search(r"step\s+3/6 \| eval loss \d+\.\d+", out), out
    assert re.search(r"step\s+6/6 \| loss .* tok/s .* eta", out), out
    summary = re.search(r"final train loss (\S+) \| final eval loss (\S+)", out)
    assert summary, out
    train_loss, eval_loss = (float(v) for v in summary.groups())
    assert math.isfinite(train_loss) and math.isfinite(eval_loss), summary.group(0)
    log_dir = tmp_path / "tb" / "test"
    assert str(log_dir) in out
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())


def test_missing_data_file_is_named(tmp_path):
    missing = tmp_path / "no_such_corpus.txt"
    result = _run(["--model", "tiny", "--data", str(missing), "--steps", "1"], cwd=tmp_path)
    assert result.returncode != 0
    assert str(missing) in result.stderr, result.stderr


def _torchrun(tmp_path, args, restarts=0):
    data = tmp_path / "corpus.txt"
    data.write_text("def f(x):\n    return x * 2\n" * 400)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    if restarts:  # torch's fix for restarts (engine/topology.py refuses them without it)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), str(SCRIPT), "--model", "tiny", "--data", str(data), *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(process, timeout=180):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"exit {process.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return out


CHECKPOINTED = ["--steps", "100", "--eval-every", "50", "--eval-batches", "1", "--save-every", "5", "--resume", "auto"]


def test_a_rank_killed_under_torchrun_restarts_from_the_last_checkpoint_and_ends_the_same(tmp_path):
    """The README's main command with checkpoints: uninterrupted, then with one rank killed (SIGKILL) once the
    first checkpoint is committed; torchrun --max-restarts starts both ranks again, they resume from the latest
    checkpoint, and the run ends with the uninterrupted run's losses."""
    (tmp_path / "a").mkdir()
    out = _finished(_torchrun(tmp_path / "a", CHECKPOINTED))
    assert "2 dp rank(s)" in out, out
    assert out.count("final train loss") == 1, out  # only rank 0 reports
    expected = re.search(r"final eval loss \S+ \| last step loss \S+", out).group(0)

    (tmp_path / "b").mkdir()
    job = _torchrun(tmp_path / "b", CHECKPOINTED, restarts=1)
    latest = tmp_path / "b" / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists():
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    workers = [p for p in psutil.Process(job.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
    assert len(workers) == 2, workers
    workers[1].send_signal(signal.SIGKILL)
    out = _finished(job)
    resumed = re.search(r"resumed from \S+global_step(\d+)", out)
    assert resumed and int(resumed.group(1)) < 100, out  # the restart continued from a checkpoint taken mid-run
    assert re.search(rf"done: {100 - int(resumed.group(1))} steps", out), out
    assert expected in out, f"expected '{expected}' as the uninterrupted run ended:\n{out}"


@pytest.mark.parametrize("config, processes", [("tp.json", 2), ("tp2d.json", 4), ("pipeline.json", 2)])
def test_the_tensor_parallel_and_pipeline_configs_train_under_torchrun(tmp_path, config, processes):
    """configs/tp.json (1D over 2 ranks), configs/tp2d.json (2D on a 2×2 mesh) and configs/pipeline.json (2
    pipeline stages: a train_batch per step) as the README runs them."""
    data = tmp_path / "corpus.txt"
    data.write_text("def f(x):\n    return x * 2\n" * 400)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           str(SCRIPT), "--config", str(REPO / "configs" / config), "--model", "tiny", "--data", str(data),
           "--steps", "3", "--eval-every", "3", "--eval-batches", "1"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{out}\nstderr:\n{result.stderr}"
    assert "1 dp rank(s)" in out, out
    assert out.count("final train loss") == 1, out


def test_restarts_with_a_shared_rendezvous_store_are_refused_with_the_fix(monkeypatch):
    """What torchrun --max-restarts gives its workers by default: refused before init_process_group could hang."""
    import torch

    from engine.topology import init_distributed
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_MAX_RESTARTS": "1",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        init_distributed(torch.device("cpu"))
