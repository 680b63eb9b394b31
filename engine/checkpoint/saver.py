"""engine.save_checkpoint: every rank writes its own file; rank 0 writes the manifest and commits the directory.

Note [checkpoint commit]
A save is collective, and a checkpoint is either complete or invisible:
1. every rank arrives (a monitored barrier on the control group, Mesh.control_group, with the
   config's checkpoint.timeout_s): a rank that calls save_checkpoint alone — under
   `if rank == 0:` — gets an error naming the ranks that did not come, not a hang; the ranks agree
   on rank 0's tag (checkpoint.tag_validation says whether a different one warns or fails);
2. rank 0 creates `<dir>/.<tag>.partial/` (removing one a crashed save left);
3. every rank writes `rank<r>.safetensors` into it, fsynced, and reports its size and SHA-256, or
   its error (a full disk on one rank fails the save on every rank, with that rank's message);
4. rank 0 writes manifest.json into the partial directory, fsyncs it, renames it to `<dir>/<tag>`
   (a rename within one directory is atomic; an existing tag is replaced), and only then rewrites
   `<dir>/latest` (a temporary file renamed over it). A save interrupted anywhere before that
   rename leaves `latest` and every earlier checkpoint as they were.
A failed save removes its partial directory and raises on every rank.

Note [asynchronous save]
With checkpoint.async_save the call returns once this rank's tensors are copied to CPU memory
(the snapshot: steps 1-2 and the copy); steps 3-4 run on a background thread, whose collectives go
over the control group, never the groups training uses. The next save, a load, `engine.close()` or
`engine.wait_for_checkpoint()` wait for it and raise its error, if any; so does the end of the script
(the thread is not a daemon: a save still running at exit commits, or prints its error; a peer that
died first holds the exit until the control group's collective times out).
"""

from __future__ import annotations

import datetime
import glob
import os
import shutil
import sys
import threading
import time
import warnings

import torch.distributed as dist

from engine.checkpoint.encoding import encode_client_state, json_state
from engine.checkpoint.files import (
    CheckpointError,
    CheckpointWriteError,
    FileRecord,
    fsync_path,
    write_error,
    write_json,
    write_tensors,
    write_text,
)
from engine.checkpoint.reader import FORMAT, LATEST, MANIFEST, TAG, VERSION, rank_file
from engine.checkpoint.snapshot import RankSnapshot, take_snapshot
from engine.checkpoint.training_state import TrainingState
from engine.config_sections import CheckpointConfig


class Control:
    """Agreement between ranks over the control group (one process: trivially)."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def arrive(self, timeout_s: float, what: str) -> None:
        if self.world == 1:
            return
        try:
            dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            raise CheckpointError(
                f"{what} is collective: every rank must call it, and not every rank did within {timeout_s:g} s "
                f"({e}). Call it on every rank (not under `if rank == 0:`); raise checkpoint.timeout_s if ranks "
                "reach it far apart") from None

    def gather(self, value) -> list:
        if self.world == 1:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out


class Saver:
    """Saves checkpoints of one run's TrainingState; holds the background save in flight (Note [asynchronous save])."""

    def __init__(self, state: TrainingState, config: CheckpointConfig):
        self.state = state
        mesh = state.mesh
        self.control = Control(mesh.control_group, mesh.world.rank, mesh.world.size)
        self.config = config
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._committed: str | None = None

    # ---- public ----------------------------------------------------------------------------
    def save(self, save_dir: str, tag: str | None, client_state: dict | None, save_latest: bool,
             exclude_frozen: bool = False) -> str:
        self.wait()
        state, progress = self.state, self.state.progress
        if progress.micro_step % progress.gradient_accumulation_steps:
            raise CheckpointError(
                f"save_checkpoint in the middle of a gradient accumulation cycle (micro-step {progress.micro_step}, "
                f"{progress.gradient_accumulation_steps} per update) would lose the accumulated gradients; call it "
                "after the engine.step() that updates the model")
        self.control.arrive(self.config.timeout_s, "engine.save_checkpoint")
        tag = self._agreed_tag(str(tag) if tag is not None else f"global_step{progress.global_step}")
        save_dir = os.path.abspath(save_dir)
        partial = os.path.join(save_dir, f".{tag}.partial")
        self._agree(self._prepare(save_dir, partial) if self.control.rank == 0 else None)
        asynchronous = self.config.async_save
        error, snapshot, common = None, None, None
        try:
            snapshot = take_snapshot(state, state.placements(), copy=asynchronous, exclude_frozen=exclude_frozen)
            common = self._common_state(snapshot, tag, client_state) if self.control.rank == 0 else None
        except Exception as e:  # e.g. a client_state that is not JSON (rank 0), an NVMe read error (any rank)
            error = f"rank {self.control.rank}: {type(e).__name__}: {e}"
        try:
            self._agree(error, CheckpointError)
        except CheckpointError:
            if self.control.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        job = (save_dir, partial, tag, snapshot, common, save_latest)
        if not asynchronous:
            return self._write_and_commit(*job)
        # not a daemon: Python waits for it at exit, so a script that ends right after its last save still commits it
        self._thread = threading.Thread(target=self._run_in_background, args=job, name="tiers-checkpoint")
        self._thread.start()
        return os.path.join(save_dir, tag)

    def wait(self) -> str | None:
        """Waits for a background save; raises its error. Returns the last committed checkpoint's path."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._committed

    # ---- steps -----------------------------------------------------------------------------
    def _agreed_tag(self, tag: str) -> str:
        tags = self.control.gather(tag)
        if any(t != tags[0] for t in tags):
            shown = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
            mode = self.config.tag_validation.lower()
            if mode == "fail":
                raise CheckpointError(f"save_checkpoint: the ranks passed different tags ({shown}); pass the same tag "
                                      "on every rank (checkpoint.tag_validation is Fail)")
            if mode == "warn":
                warnings.warn(f"save_checkpoint: the ranks passed different tags ({shown}); saving as rank 0's "
                              f"{tags[0]!r}", stacklevel=4)
        tag = tags[0]
        if not TAG.fullmatch(tag) or tag in (LATEST, MANIFEST):
            raise CheckpointError(f"save_checkpoint: tag {tag!r} is not a valid directory name; use letters, digits, "
                                  "'_', '-' and '.', not starting with '.' or '-'")
        return tag

    def _agree(self, error: str | None, kind: type[CheckpointError] = CheckpointWriteError) -> None:
        errors = [e for e in self.control.gather(error) if e]
        if errors:
            raise kind(errors[0])

    @staticmethod
    def _prepare(save_dir: str, partial: str) -> str | None:
        """Rank 0: a fresh partial directory (a crashed save's leftovers removed). Returns an error message or None."""
        try:
            os.makedirs(save_dir, exist_ok=True)
            for stale in glob.glob(os.path.join(save_dir, ".*.partial")):
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(partial)
        except OSError as e:
            return str(write_error(partial, e))
        return None

    def _common_state(self, snapshot: RankSnapshot, tag: str, client_state: dict | None) -> dict:
        """Rank 0: what every rank shares (counters, schedules, options, client state), for the manifest."""
        state, progress = self.state, self.state.progress
        client = encode_client_state(client_state or {}, snapshot.tensors)
        return {
            "tag": tag,
            "engine": {"global_step": progress.global_step, "micro_step": progress.micro_step,
                       "skipped_steps": progress.skipped_steps},
            "loss_scaler": json_state("loss_scaler", state.loss_scaler.state_dict()),
            "client_state": client,
        }

    def _run_in_background(self, *job) -> None:
        try:
            self._write_and_commit(*job)
        except BaseException as e:
            if threading.main_thread().is_alive():
                self._error = e  # raised by wait()
            else:  # the script has ended: said here, once (engine.close() at exit then closes the rest)
                print(f"tiers: the checkpoint save still running at exit failed: {type(e).__name__}: {e}",
                      file=sys.stderr)

    def _write_and_commit(self, save_dir: str, partial: str, tag: str, snapshot: RankSnapshot, common: dict | None,
                          save_latest: bool) -> str:
        control = self.control
        name, error, record = rank_file(control.rank), None, None
        try:
            record = write_tensors(partial, name, snapshot.tensors)
        except CheckpointError as e:
            error = f"rank {control.rank}: {e}"
        snapshot.tensors.clear()  # the copies of an asynchronous save are no longer needed
        reports = control.gather((error, record and record.__dict__, snapshot.record))
        errors = [e for e, _, _ in reports if e]
        outcome = None
        if control.rank == 0:
            outcome = errors[0] if errors else self._commit(save_dir, partial, tag, common, reports, save_latest)
            if outcome is not None:
                shutil.rmtree(partial, ignore_errors=True)
        outcome = control.gather(outcome)[0]
        if outcome is not None:
            raise CheckpointWriteError(outcome)
        final = os.path.join(save_dir, tag)
        self._committed = final
        return final

    def _commit(self, save_dir: str, partial: str, tag: str, common: dict, reports: list,
                save_latest: bool) -> str | None:
        """Rank 0: manifest, rename, `latest`. Returns an error message or None."""
        files = []
        for rank, (_, record, _info) in enumerate(reports):
            record = FileRecord(**record)
            if not os.path.isfile(os.path.join(partial, record.name)):
                return (f"rank {rank} wrote {record.name}, but rank 0 does not see it in {partial}: every rank must "
                        "save into one directory on a filesystem they all share")
            files.append({"name": record.name, "rank": rank, "bytes": record.nbytes, "sha256": record.sha256})
        infos = [info for _, _, info in reports]
        states = next((info["optimizer_states"] for info in infos if info["optimizer_states"]["tensor_states"]
                       or info["optimizer_states"]["scalar_states"]), infos[0]["optimizer_states"])
        state, mesh = self.state, self.state.mesh
        heads = [info for info in infos if "part" in info]  # the ranks that saved extras and options
        manifest = {
            "format": FORMAT, "version": VERSION, "tag": tag,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "layout": {"world_size": mesh.world.size, "sizes": mesh.sizes(), **state.features.layout(),
                       "cut_size": max(info["cut_size"] for info in infos), "stage": state.stage,
                       "device": mesh.device.type, "compute_dtype": str(state.compute_dtype).removeprefix("torch."),
                       "optimizer": _optimizer_name(state.optimizer)},
            **{k: v for k, v in common.items() if k != "tag"},
            "parts": _parts([info["part"] for info in heads]),
            "optimizer": states,
            "chunks": _saved_chunks(infos, [f["name"] for f in files]),
            "extras": [{"file": files[info["rank"]]["name"], "entries": info["extras"]} for info in heads],
            "excluded_frozen": sorted({k for info in heads for k in info["excluded_frozen"]}),
            # the whole model's: every part's aliases, the unsplit model's keys (Note [checkpoint layout])
            "aliases": {k: v for info in heads for k, v in info["aliases"].items()},
            "state_dict_keys": _every_key([info["keys"] for info in infos]),
            "tp_specs": {k: v for info in heads for k, v in info["tp_specs"].items()},  # every part's cuts
            "ranks": [{"rank": r, "rng": info["rng"]} for r, info in enumerate(infos)],
            "files": files,
        }
        final = os.path.join(save_dir, tag)
        old = os.path.join(save_dir, f".{tag}.replaced")
        try:
            write_json(os.path.join(partial, MANIFEST), manifest)
            fsync_path(partial)
            if os.path.exists(final):
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(partial, final)
            fsync_path(save_dir)
            shutil.rmtree(old, ignore_errors=True)
            if save_latest:
                write_text(os.path.join(save_dir, LATEST), tag)
        except CheckpointError as e:
            return str(e)
        except OSError as e:
            return str(write_error(final, e))
        return None


def _saved_chunks(infos: list[dict], file_of_rank: list[str]) -> list[dict]:
    """Every saved chunk once, with the files of its shards in order (Note [checkpoint layout]): the ranks' records
    of one chunk share its home (the rank holding shard 0) and its index in their chunk lists."""
    chunks: dict[tuple[int, int], dict] = {}
    for info in infos:
        for c in info["chunks"]:
            entry = chunks.setdefault((c["home"], c["index"]), {"key": f"chunk.{c['index']}", "numel": c["numel"],
                                                                "files": {}})
            entry["files"][c["shard"]] = file_of_rank[info["rank"]]
            if "members" in c:  # (recorded by shard 0's rank)
                entry.update(cut_rank=c["cut_rank"], members=c["members"])
    return [dict(c, files=[c["files"][d] for d in sorted(c["files"])]) for c in chunks.values()]


def _parts(saved: list[dict]) -> list[dict]:
    """The param groups' options and the scheduler's state of each part of the model (Feature.stage), by part."""
    parts: dict[int, dict] = {}
    for part in saved:
        parts.setdefault(part["index"], {"param_groups": part["param_groups"], "lr_scheduler": part["lr_scheduler"]})
    return [parts[i] for i in sorted(parts)]


def _every_key(key_lists: list[list[str]]) -> list[str]:
    """The state-dict keys of every rank's model (each may hold other parts of it), in order of first appearance."""
    return list(dict.fromkeys(k for keys in key_lists for k in keys))


def _optimizer_name(optimizer) -> str:
    inner = getattr(optimizer, "inner_type", None)  # an offloaded optimizer steps torch optimizers of this type
    return inner.__name__ if inner is not None else type(optimizer).__name__
