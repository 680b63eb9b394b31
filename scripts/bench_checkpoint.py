"""Checkpoint save and load throughput against the raw disk and torch.distributed.checkpoint, and training stall.

    .venv/bin/python scripts/bench_checkpoint.py                  # bench30m, 2 ranks, ZeRO-3 vs FSDP2 + DCP

Two ranks (gloo, CPU) hold the same model trained one step: Tiers ZeRO-3 (AdamW fp32) and, as torch's peer,
FSDP2 (`fully_shard` per block) with `torch.distributed.checkpoint` (DCP) over its sharded state dict
(`get_state_dict`): the same parameters and Adam states, sharded the same way. Per round, in turn:
- a synchronous save of each (the time until every rank returns), then its load into the same model after the
  checkpoint's files are dropped from the page cache (so the load reads the disk);
- an asynchronous save of each (Tiers' checkpoint.async_save, DCP's async_save): the time the call blocks
  training, and the time until the files are committed.
Throughput is the checkpoint's bytes (all its files) over the time; the raw disk is dd with O_DIRECT in
8 MiB blocks over the same number of bytes, measured before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
    DiskCounter,
    add_json_option,
    fmt_bytes,
    free_port,
    init_gloo,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)
from disk_baseline import dd_bandwidth  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go (the disk measured)")
    ap.add_argument("--model", default="bench30m", help="engine.models preset (default bench30m)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported (default 3)")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    return ap.parse_args(argv)


def drop_cached(directory: str) -> None:
    """Evicts a checkpoint's (fsynced, clean) files from the page cache, so that reading them reads the disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def one_step(model_call, backward, step, batch) -> None:
    x, y = batch
    loss = model_call(x, y)
    backward(loss)
    step()


class Tiers:
    def __init__(self, args, root: str, asynchronous: bool):
        from engine import initialize
        from engine.models import gpt_from_preset
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
                  "checkpoint": {"async_save": asynchronous}}
        self.engine = initialize(gpt_from_preset(args.model), config)
        self.root = root

    def step(self, batch) -> None:
        one_step(lambda x, y: self.engine(x, labels=y), self.engine.backward, self.engine.step, batch)

    def save(self, tag: str) -> None:
        self.engine.save_checkpoint(self.root, tag=tag)

    def wait(self) -> None:
        self.engine.wait_for_checkpoint()

    def load(self, tag: str) -> None:
        self.engine.load_checkpoint(self.root, tag=tag)

    def path(self, tag: str) -> str:
        return os.path.join(self.root, tag)


class DCP:
    """torch's peer: FSDP2 and torch.distributed.checkpoint over get_state_dict(model, optimizer)."""

    def __init__(self, args, root: str, asynchronous: bool):
        from torch.distributed.fsdp import fully_shard

        from engine.models import gpt_from_preset
        torch.manual_seed(0)
        self.model = gpt_from_preset(args.model)
        for block in self.model.blocks:
            fully_shard(block)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0)
        self.root, self.asynchronous, self.future = root, asynchronous, None
        # its background collectives need a group of their own (training's run meanwhile), as Tiers' control group
        self.group = dist.new_group(backend="gloo") if asynchronous else None

    def step(self, batch) -> None:
        def update():
            self.optimizer.step()
            self.optimizer.zero_grad()
        one_step(lambda x, y: self.model(x, labels=y), lambda loss: loss.backward(), update, batch)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def save(self, tag: str) -> None:
        import torch.distributed.checkpoint as dcp
        if self.asynchronous:
            self.future = dcp.async_save(self._state(), checkpoint_id=self.path(tag), process_group=self.group)
        else:
            dcp.save(self._state(), checkpoint_id=self.path(tag))

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def load(self, tag: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = self._state()
        dcp.load(state, checkpoint_id=self.path(tag))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def path(self, tag: str) -> str:
        return os.path.join(self.root, tag)


SYSTEMS = {"tiers": Tiers, "dcp": DCP}
NAMES = {"tiers": "Tiers save_checkpoint (ZeRO-3)", "dcp": "torch.distributed.checkpoint (FSDP2)"}


def rank_main(rank: int, world: int, port: int, args, root: str, results) -> None:
    init_gloo(rank, world, port)
    from engine.models import preset_config
    block = preset_config(args.model).block_size
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randint(0, 256, (1, block), generator=g), torch.randint(0, 256, (1, block), generator=g))
    systems = {(name, mode): cls(args, os.path.join(root, f"{name}_{mode}"), mode == "async")
               for name, cls in SYSTEMS.items() for mode in ("sync", "async")}
    for system in systems.values():
        system.step(batch)  # optimizer states exist
    baseline = []
    out = {key: {"save": [], "load": [], "bytes": [], "blocked": [], "committed": [], "step_during": []}
           for key in systems}
    for r in range(args.rounds):
        for (name, mode), system in systems.items():
            tag = f"round{r}"
            rec = out[(name, mode)]
            if mode == "sync":
                rec["save"].append(timed(lambda system=system, tag=tag: system.save(tag)))
                if rank == 0:
                    rec["bytes"].append(dir_bytes(system.path(tag)))
                    drop_cached(system.path(tag))
                rec["load"].append(timed(lambda system=system, tag=tag: system.load(tag)))
            else:
                dist.barrier()
                start = time.perf_counter()
                system.save(tag)
                rec["blocked"].append(time.perf_counter() - start)
                step_start = time.perf_counter()
                system.step(batch)  # training goes on while the files are written
                rec["step_during"].append(time.perf_counter() - step_start)
                system.wait()
                dist.barrier()
                rec["committed"].append(time.perf_counter() - start)
            if rank == 0:
                shutil.rmtree(system.path(tag), ignore_errors=True)
        baseline.append(timed(lambda: systems[("tiers", "sync")].step(batch)))
    dist.barrier()
    if rank == 0:
        results.put({"runs": out, "baseline_step": statistics.median(baseline)})
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    from engine.models import gpt_from_preset
    psi = gpt_from_preset(args.model).num_parameters()
    disk = DiskCounter(args.dir)
    root = tempfile.mkdtemp(prefix="tiers-bench-ckpt-", dir=args.dir)
    try:
        before = dd_bandwidth(args.dir, 12 * psi, disk)
        (result,) = spawn_ranks(rank_main, 2, args=(free_port(), args, root), env=KEEP_FREED_MEMORY_ENV)
        after = dd_bandwidth(args.dir, 12 * psi, disk)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_bw, read_bw = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    runs, med = result["runs"], statistics.median
    rows = []
    for name in SYSTEMS:
        sync, asyn = runs[(name, "sync")], runs[(name, "async")]
        nbytes = med(sync["bytes"])
        save_s, load_s = med(sync["save"]), med(sync["load"])
        rows.append([NAMES[name], fmt_bytes(nbytes), f"{save_s:.3f}", f"{nbytes / save_s / 1e9:.2f}",
                     f"{nbytes / save_s / write_bw:.2f}", f"{load_s:.3f}", f"{nbytes / load_s / 1e9:.2f}",
                     f"{nbytes / load_s / read_bw:.2f}", f"{med(asyn['blocked']):.3f}",
                     f"{med(asyn['committed']):.3f}", f"{med(asyn['step_during']):.3f}"])
    ours, peer = runs[("tiers", "sync")], runs[("dcp", "sync")]
    ratios = (f"Tiers ÷ DCP (time; ≤ 1.0 is faster): save {med(ours['save']) / med(peer['save']):.2f}, load "
              f"{med(ours['load']) / med(peer['load']):.2f}, async blocking "
              f"{med(runs[('tiers', 'async')]['blocked']) / med(runs[('dcp', 'async')]['blocked']):.2f}")
    text = "\n".join([
        "### Checkpoints: save and load vs the raw disk and torch.distributed.checkpoint (2 ranks, gloo, CPU)",
        "",
        f"Model `{args.model}` (Ψ = {psi:,}), AdamW fp32 after one step: parameters and both Adam states, sharded "
        f"over 2 ranks. Raw disk (dd, O_DIRECT, 8 MiB blocks, {fmt_bytes(12 * psi)}; mean of before/after): write "
        f"{write_bw / 1e9:.2f} GB/s ({before[0] / 1e9:.2f} / {after[0] / 1e9:.2f}), read {read_bw / 1e9:.2f} GB/s "
        f"({before[1] / 1e9:.2f} / {after[1] / 1e9:.2f}). Loads read files dropped from the page cache. Median of "
        f"{args.rounds} alternating rounds; a training step alone takes {result['baseline_step']:.3f} s.",
        "",
        markdown_table(["system", "checkpoint", "save (s)", "save GB/s", "÷ raw write", "load (s)", "load GB/s",
                        "÷ raw read", "async: blocks (s)", "async: committed after (s)",
                        "async: step during the write (s)"], rows),
        "",
        ratios,
    ])
    publish_report(text, started, args.out)
    write_results(args.json, records(runs))


def records(runs: dict) -> list[dict]:
    """The figures of the report as result_record dicts (--json): one per system and timed operation; MB/s =
    the checkpoint's bytes over the time."""
    med, out = statistics.median, []
    for metric, mode, key in (("save time", "sync", "save"), ("load time", "sync", "load"),
                              ("async save: time blocked", "async", "blocked")):
        ours, peer = med(runs[("tiers", mode)][key]), med(runs[("dcp", mode)][key])
        for name, seconds in (("tiers", ours), ("dcp", peer)):
            nbytes = med(runs[(name, "sync")]["bytes"])
            is_ours = name == "tiers"
            out.append(result_record("checkpoint", NAMES[name], world=2, role="ours" if is_ours else "peer",
                                     peer=NAMES["dcp"] if is_ours else None, strategy="checkpoint", metric=metric,
                                     ratio=ours / peer if is_ours else None, target=1.0 if is_ours else None,
                                     seconds=seconds, checkpoint_bytes=nbytes,
                                     throughput=nbytes / seconds / 1e6 if mode == "sync" else None,
                                     unit="MB/s" if mode == "sync" else None))
    return out


if __name__ == "__main__":
    main()
