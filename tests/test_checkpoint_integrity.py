"""A checkpoint is complete or invisible, and a damaged one is refused by name, with the engine untouched.

Real files throughout; the full disk is injected (a write that stops half-way with ENOSPC), and the
interrupted save is a real process killed with SIGKILL in the middle of writing its file.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import engine.checkpoint.files as checkpoint_files
from engine import initialize
from engine.checkpoint import CheckpointError, CheckpointIntegrityError, CheckpointWriteError
from tests.distributed import run_distributed
from tests.reference import tiny_gpt, token_batches

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6}


def _engine(config=CONFIG):
    return initialize(tiny_gpt(seed=0), config)


def _train(engine, steps: int) -> list[float]:
    losses = []
    for x in token_batches(steps, 4 // engine.dp_world_size, seed=engine.global_step + 5):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:
    return engine.full_state_dict()


def _full_disk_after_half(tensors, path, metadata=None):
    """safetensors' save_file on a disk that fills up half-way: half the bytes reach the file, then ENOSPC."""
    with open(path, "wb") as f:
        f.write(b"\0" * (sum(t.numel() * t.element_size() for t in tensors.values()) // 2))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.fixture
def saved(tmp_path):
    engine = _engine()
    _train(engine, 2)
    path = engine.save_checkpoint(str(tmp_path), client_state={"epoch": 1})
    return engine, tmp_path, path


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_file_is_refused_by_name_and_the_engine_is_untouched(saved, damage):
    engine, root, path = saved
    victim = os.path.join(path, "rank00000.safetensors")
    if damage == "flip":  # one byte in the middle of the tensor data
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) - 100)
    else:
        os.remove(victim)
    other = _engine()
    before = _weights(other)
    expected = {"flip": "does not match its SHA-256", "truncate": "bytes, the manifest says", "remove": "is missing"}
    with pytest.raises(CheckpointIntegrityError, match=expected[damage]) as caught:
        other.load_checkpoint(str(root))
    assert victim in str(caught.value)
    after = _weights(other)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the engine"


def test_a_directory_without_manifest_is_not_a_checkpoint(saved):
    engine, root, path = saved
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        _engine().load_checkpoint(str(root))


def test_a_full_disk_fails_the_save_and_leaves_the_previous_checkpoint_loadable(saved, monkeypatch):
    engine, root, first = saved
    _train(engine, 1)
    monkeypatch.setattr(checkpoint_files, "save_file", _full_disk_after_half)
    with pytest.raises(CheckpointWriteError, match=r"ENOSPC.*free space on that disk") as caught:
        engine.save_checkpoint(str(root))
    assert "global_step3" in str(caught.value)
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["global_step2", "latest"], "a failed save left files behind"
    assert open(os.path.join(root, "latest")).read() == "global_step2"
    fresh = _engine()
    path, client = fresh.load_checkpoint(str(root))
    assert path == first and client == {"epoch": 1} and fresh.global_step == 2
    assert _train(fresh, 1)  # and training goes on
    engine.save_checkpoint(str(root))  # the engine whose save failed saves again once the disk has room
    assert open(os.path.join(root, "latest")).read() == "global_step3"


def test_a_background_save_reports_its_failure_at_the_next_wait(tmp_path, monkeypatch):
    root = str(tmp_path)
    engine = _engine({**CONFIG, "checkpoint": {"async_save": True}})
    _train(engine, 1)
    engine.save_checkpoint(root)
    assert engine.wait_for_checkpoint().endswith("global_step1")
    _train(engine, 1)
    monkeypatch.setattr(checkpoint_files, "save_file", _full_disk_after_half)
    engine.save_checkpoint(root)  # returns once the snapshot is taken
    _train(engine, 1)
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):
        engine.wait_for_checkpoint()
    assert sorted(os.listdir(root)) == ["global_step1", "latest"]
    monkeypatch.undo()
    engine.save_checkpoint(root)
    engine.close()  # waits for the commit
    assert open(os.path.join(root, "latest")).read() == "global_step3"


ENDS_AFTER_ITS_SAVE = """
import sys, time
import engine.checkpoint.files as checkpoint_files
from engine import initialize
from tests.reference import tiny_gpt, token_batches

write = checkpoint_files.save_file
def slow_disk(tensors, path, metadata=None):  # the write is still running when the script ends
    time.sleep(1.0)
    if sys.argv[2] == "full":
        raise OSError(28, "No space left on device", path)
    return write(tensors, path, metadata=metadata)
checkpoint_files.save_file = slow_disk

engine = initialize(tiny_gpt(seed=0), {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                       "steps_per_print": 10**6, "checkpoint": {"async_save": True}})
x = next(iter(token_batches(1, 4, seed=5)))
engine.backward(engine(x, x))
engine.step()
engine.save_checkpoint(sys.argv[1])
"""


def _script_ending_during_its_save(root, disk: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-c", ENDS_AFTER_ITS_SAVE, str(root), disk], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_script_ending_during_a_background_save_still_commits_it(tmp_path):
    """No close(), no wait_for_checkpoint(): the script's last line is the save, as in most training scripts."""
    done = _script_ending_during_its_save(tmp_path, "slow")
    assert done.returncode == 0, done.stderr[-3000:]
    assert open(tmp_path / "latest").read() == "global_step1"
    assert sorted(os.listdir(tmp_path / "global_step1")) == ["manifest.json", "rank00000.safetensors"]


def test_a_background_save_failing_after_the_script_ended_says_so(tmp_path):
    done = _script_ending_during_its_save(tmp_path, "full")
    assert "the checkpoint save still running at exit failed" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("No space left on device") == 1, done.stderr[-3000:]  # said once, close() finished
    assert os.listdir(tmp_path) == []  # the partial directory removed, nothing committed


def _killed_in_the_middle_of_a_save(root: str) -> None:
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root)
    _train(engine, 1)

    def die_half_way(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_files.save_file = die_half_way  # this process only: it is about to be killed
    engine.save_checkpoint(root)


def test_a_save_killed_half_way_is_never_latest(tmp_path):
    root = str(tmp_path)
    process = multiprocessing.get_context("spawn").Process(target=_killed_in_the_middle_of_a_save, args=(root,))
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL
    assert sorted(os.listdir(root)) == [".global_step2.partial", "global_step1", "latest"]
    assert open(os.path.join(root, "latest")).read() == "global_step1"
    engine = _engine()
    path, _ = engine.load_checkpoint(root)
    assert path.endswith("global_step1") and engine.global_step == 1
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        engine.load_checkpoint(root, tag=".global_step2.partial")
    _train(engine, 1)
    engine.save_checkpoint(root)  # the next save clears the leftovers
    assert sorted(os.listdir(root)) == ["global_step1", "global_step2", "latest"]


def test_an_interrupted_manifest_and_a_missing_latest(saved):
    engine, root, path = saved
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write('{"format": "tiers-checkpoint", "vers')  # cut off
    with pytest.raises(CheckpointIntegrityError, match="cannot be read as JSON"):
        _engine().load_checkpoint(str(root))
    os.remove(os.path.join(root, "latest"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _engine().load_checkpoint(str(root)) == (None, None)
    assert any("no 'latest' file" in str(w.message) for w in caught)


def test_checkpoint_files_are_safetensors_and_json_only(saved):
    engine, root, path = saved
    assert sorted(os.listdir(path)) == ["manifest.json", "rank00000.safetensors"]
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert [f["name"] for f in manifest["files"]] == ["rank00000.safetensors"]
    assert len(manifest["files"][0]["sha256"]) == 64
    from safetensors.torch import load_file  # the library reads them as they are
    assert "chunk.0.param" in load_file(os.path.join(path, "rank00000.safetensors"))


def test_save_refuses_the_middle_of_an_accumulation_cycle(tmp_path):
    engine = initialize(tiny_gpt(seed=0), {**CONFIG, "gradient_accumulation_steps": 2})
    x = token_batches(1, 2)[0]
    engine.backward(engine(x, x))
    engine.step()
    with pytest.raises(CheckpointError, match="middle of a gradient accumulation cycle"):
        engine.save_checkpoint(str(tmp_path))


def test_client_state_must_be_json_and_tensors(tmp_path):
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"TypeError: client_state\['loader'\]: a object cannot be stored"):
        engine.save_checkpoint(str(tmp_path), client_state={"loader": object()})
    assert not os.path.exists(os.path.join(tmp_path, "latest"))


def _collective_worker(rank, world, root):
    out = {}
    config = {**CONFIG, "checkpoint": {"timeout_s": 3}}
    engine = _engine(config)
    _train(engine, 1)
    engine.save_checkpoint(root)
    if rank == 1:  # the disk of rank 1 fills up
        checkpoint_files.save_file = _full_disk_after_half
    try:
        engine.save_checkpoint(root, tag="full")
    except CheckpointWriteError as e:
        out["full_disk"] = str(e)
    out["after_full_disk"] = sorted(os.listdir(root))
    out["loaded"] = engine.load_checkpoint(root)[0]
    engine.close()

    engine = _engine({**CONFIG, "checkpoint": {"tag_validation": "Fail"}})
    try:
        engine.save_checkpoint(root, tag=f"mine{rank}")
    except CheckpointError as e:
        out["tags"] = str(e)
    engine.close()

    engine = _engine({**CONFIG, "zero_optimization": {"stage": 3}})
    try:  # DeepSpeed's key for gathering 16-bit weights under stage 3 is off
        engine.save_16bit_model(root)
    except RuntimeError as e:
        out["16bit"] = str(e)
    engine.close()

    engine = _engine(config)
    if rank == 0:  # the usual mistake: saving under `if rank == 0`
        try:
            engine.save_checkpoint(root, tag="alone")
        except CheckpointError as e:
            out["alone"] = str(e)
    return out


def test_save_is_collective_and_fails_on_every_rank_together(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_collective_worker, 2, (root,), timeout_s=120)
    for out in results:
        assert "rank 1:" in out["full_disk"] and "ENOSPC" in out["full_disk"], out
        assert out["after_full_disk"] == ["global_step1", "latest"]
        assert out["loaded"].endswith("global_step1")
        assert "different tags" in out["tags"] and "'mine1'" in out["tags"]
        assert "stage3_gather_16bit_weights_on_model_save to true" in out["16bit"]
    assert "every rank must call it" in results[0]["alone"] and "not under `if rank == 0:`" in results[0]["alone"]
    assert not os.path.exists(os.path.join(root, "alone"))
