"""The NVMe tier: NvmeStore swap-out / swap-in throughput against the raw bandwidth of the same disk.

    .venv/bin/python scripts/bench_offload.py                  # 32 chunks of 128 MiB, 3 rounds
    .venv/bin/python scripts/bench_offload.py --threads 1 --out /tmp/offload.md

Each round first measures the raw sequential bandwidth of the disk under --dir, then the store on
the same directory (rounds alternate, so drift of the disk hits both alike; medians are reported):
- raw dd: `dd if=/dev/zero of=FILE bs=B count=N oflag=direct conv=fsync`, then
  `dd if=FILE of=/dev/null bs=B iflag=direct` (skipped when there is no dd);
- raw Python: the same file size written and read by a loop of os.pwrite / os.preadv of B bytes
  from a page-aligned buffer, file opened with O_DIRECT (the fsync after the writes is timed
  apart and not counted: the store does not fsync either);
- the store: a fresh NvmeStore (after an untimed warm-up transfer that creates its staging
  buffers); every chunk's write issued, then all waited; then every chunk read back into
  preallocated buffers, issued then waited, as the ChunkManager reads (`scratch=True`: a fresh
  page-aligned destination is read in place and then checked). A few chunks are compared
  exactly, outside the clock.
B defaults to the chunk size: the store moves each chunk with one pwrite / preadv of the padded
payload (its block_size is only the padding granularity). The ratio targets (>= 0.80) divide the
store's figure by the better of the two raw figures. Everything bypasses the page cache
(O_DIRECT); the page cache's growth over the run is printed as evidence. Each timed phase also
records the disk traffic that was not its own (/proc/diskstats) and the cores other processes
kept busy: a shared disk or CPU shows there instead of silently skewing the figures.

The prefetch part runs the ChunkManager itself: a training loop that needs chunk i at step i
(`access(i, CPU, writes=False)`, compute, `release(i)`), every chunk registered on NVMe, the CPU
budget holding depth + 1 chunks, with a "compute" per step as long as one chunk's on-demand
access (measured by a first pass without compute; time.sleep: a busy loop would take one of the
few cores from the store's workers). On demand: a manager with prefetch_depth=0. With
prefetch: prefetch_depth=depth, after one untimed warm-up iteration that records the trace;
the manager then reads ahead on its own. Hiding = 1 - (prefetch loop time - its compute time) /
(on-demand loop time - its compute time).

This is a benchmark script: it prints what it measured and never asserts on time (exit code 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import (  # noqa: E402
    DiskCounter,
    add_json_option,
    command_line,
    machine_line,
    median,
    result_record,
    write_results,
    write_text,
)
from disk_baseline import Meter, Phase, filesystem_line, page_aligned, page_cache_bytes, raw_buffers, raw_round  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402
from offload import Budgets, ChunkManager, Location, NvmeSettings  # noqa: E402
from offload.direct_io import aligned_empty  # noqa: E402
from offload.nvme import NvmeStore, checksum  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
TARGET = 0.80
DTYPE = torch.int32


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None,
                    help="directory on the disk to measure (default ./.bench-offload, removed at the end); "
                         "the script works in a fresh subdirectory and removes it")
    ap.add_argument("--chunk-mb", type=int, default=128, help="chunk size in MiB (default 128)")
    ap.add_argument("--total-gb", type=float, default=4.0, help="bytes per pass in GiB (default 4)")
    ap.add_argument("--threads", type=int, default=2, help="NvmeStore worker threads (default 2, as the store)")
    ap.add_argument("--queue-depth", type=int, default=8, help="NvmeStore queue_depth (default 8)")
    ap.add_argument("--block-size-kb", type=int, default=1024, help="NvmeStore block_size in KiB (default 1024)")
    ap.add_argument("--raw-bs-mb", type=int, default=None,
                    help="transfer size of the raw dd / Python loops in MiB (default: the chunk size)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of (raw, store) (default 3)")
    ap.add_argument("--prefetch-depth", type=int, default=2, help="chunks read ahead in the prefetch loop (default 2)")
    ap.add_argument("--skip-prefetch", action="store_true", help="skip the prefetch-hiding measurement")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    args.chunk_bytes = args.chunk_mb * MiB
    args.total_bytes = int(round(args.total_gb * GiB))
    args.raw_bs = (args.raw_bs_mb or args.chunk_mb) * MiB
    args.block_size = args.block_size_kb * 1024
    if args.chunk_mb < 1 or args.total_bytes % args.chunk_bytes:
        ap.error(f"--total-gb {args.total_gb} is not a whole number of --chunk-mb {args.chunk_mb} chunks; "
                 f"pick sizes where {args.total_bytes} bytes divide by {args.chunk_bytes}")
    args.n_chunks = args.total_bytes // args.chunk_bytes
    if args.n_chunks < 2:
        ap.error(f"--total-gb {args.total_gb} holds {args.n_chunks} chunk(s) of {args.chunk_mb} MiB; give at least 2")
    if args.total_bytes % args.raw_bs:
        ap.error(f"--raw-bs-mb {args.raw_bs // MiB} does not divide the {args.total_bytes} bytes of a pass")
    if args.rounds < 1 or args.prefetch_depth < 1:
        ap.error(f"--rounds ({args.rounds}) and --prefetch-depth ({args.prefetch_depth}) must be >= 1")
    return args


# ---- buffers and chunk contents ------------------------------------------------------------------
def chunk_allocator(block_size: int):
    """(allocate(numel) -> tensor, what it is): the host buffers the ChunkManager swaps (page-aligned, padded)."""
    return (lambda numel: aligned_empty(numel, DTYPE, block_size)), "offload.direct_io.aligned_empty"


def fill_chunk(chunk: torch.Tensor, index: int, base: torch.Tensor) -> None:
    """Every MiB of every chunk distinct: a random MiB plus the global MiB number (cheap, exact in int32)."""
    rows = chunk.view(-1, base.numel())
    first = index * rows.shape[0]
    torch.add(base, torch.arange(first, first + rows.shape[0], dtype=DTYPE)[:, None], out=rows)


# ---- the store -----------------------------------------------------------------------------------
def open_store(work: str, args) -> NvmeStore:
    return NvmeStore(work, block_size=args.block_size, queue_depth=args.queue_depth, threads=args.threads)


def warm_up(store: NvmeStore, src: list[torch.Tensor], dst: list[torch.Tensor], threads: int) -> None:
    """`threads` concurrent writes and reads, untimed: the store's staging buffers exist afterwards."""
    keys = [f"warm-up-{j}" for j in range(min(threads, len(src)))]
    for h in [store.write(k, src[j]) for j, k in enumerate(keys)]:
        h.wait()
    for h in [store.read(k, dst[j], scratch=True) for j, k in enumerate(keys)]:
        h.wait()
    for k in keys:
        store.remove(k)


def timed_all(issue, n: int, total: int, disk: DiskCounter) -> Phase:
    """Issues n transfers (issue(i) -> handle), then waits for them all."""
    with Meter(disk) as m:
        handles = [issue(i) for i in range(n)]
        for h in handles:
            h.wait()
    return m.phase(total)


def store_round(work: str, args, src: list[torch.Tensor], dst: list[torch.Tensor], check: list[int],
                disk: DiskCounter) -> dict:
    total = args.total_bytes
    with open_store(work, args) as store:
        warm_up(store, src, dst, args.threads)
        for i in check:
            dst[i].fill_(-1)  # so a read that never lands cannot pass the check
        s0 = store.stats
        w = timed_all(lambda i: store.write(f"chunk-{i}", src[i]), len(src), total, disk)
        s1 = store.stats
        r = timed_all(lambda i: store.read(f"chunk-{i}", dst[i], scratch=True), len(src), total, disk)
        s2 = store.stats
        for i in check:
            if not torch.equal(dst[i], src[i]):
                bad = (dst[i] != src[i]).nonzero()[0].item()
                raise RuntimeError(f"chunk {i} read back from the store differs from what was written "
                                   f"(first at element {bad}): the benchmark's figures would be meaningless")

    def staged(a, b) -> float:  # share of the payload copied through staging (stores without the counter: all)
        return (b.staged_bytes - a.staged_bytes) / total if hasattr(b, "staged_bytes") else 1.0

    return {"w": w, "r": r, "direct_io": store.direct_io, "w_staged": staged(s0, s1), "r_staged": staged(s1, s2),
            "w_throttled": s1.throttled_seconds - s0.throttled_seconds,
            "r_throttled": s2.throttled_seconds - s1.throttled_seconds}


# ---- prefetch hiding -----------------------------------------------------------------------------
class ManagerPager:
    """Chunk i of the simulated training loop, served by a ChunkManager whose chunks start on NVMe.

    The CPU tier holds `resident` chunks; the manager evicts (a clean drop: the chunks are only
    read) and, with prefetch_depth > 0 and a recorded trace, reads ahead on its own.
    """

    def __init__(self, work: str, args, src: list[torch.Tensor], prefetch_depth: int, resident: int):
        self.location = Location.CPU
        probe = ChunkManager("cpu", nvme=NvmeSettings(work, block_size=args.block_size))
        footprint = probe.pool.footprint(src[0].numel(), src[0].dtype)
        probe.close()
        self.manager = ChunkManager("cpu", Budgets(cpu=resident * footprint),
                                    nvme=NvmeSettings(work, block_size=args.block_size, threads=args.threads,
                                                      queue_depth=args.queue_depth),
                                    prefetch_depth=prefetch_depth)
        self.refs = [self.manager.register("chunk", [t], capacity=t.numel(), location=Location.NVME)[0] for t in src]
        self.steps = len(src)

    def acquire(self, i: int) -> torch.Tensor:
        return self.manager.access(self.refs[i].chunk, self.location, writes=False)[0]

    def release(self, i: int) -> None:
        self.manager.release(self.refs[i].chunk)

    def end_iteration(self) -> None:
        self.manager.end_iteration()

    def close(self) -> None:
        self.manager.close()


def simulate_compute(chunk: torch.Tensor, seconds: float) -> float:
    """Stands for the step's compute on `chunk`: sleeps (leaves the cores to the I/O threads); returns the time
    spent."""
    t0 = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    return time.perf_counter() - t0


def train_step(pager, i: int, compute_s: float) -> float:
    """One step of the simulated loop: chunk i (the manager may have read it ahead), compute; returns compute s."""
    chunk = pager.acquire(i)
    spent = simulate_compute(chunk, compute_s)
    pager.release(i)
    return spent


def run_loop(pager, compute_s: float, disk: DiskCounter, nbytes: int) -> tuple[float, float, Phase]:
    """(loop wall seconds, seconds of it spent computing, the loop's phase)."""
    computed = 0.0
    with Meter(disk) as m:
        for i in range(pager.steps):
            computed += train_step(pager, i, compute_s)
    pager.end_iteration()
    return m.seconds, computed, m.phase(nbytes)


def measure_prefetch(work: str, args, src: list[torch.Tensor], disk: DiskCounter) -> dict:
    """One on-demand pass without compute sets the compute per step (one chunk's access time); then
    alternating on-demand and prefetch loops over every chunk, args.rounds times each."""
    total, depth = args.total_bytes, args.prefetch_depth
    runs, phases = [], []
    on_demand = ManagerPager(work, args, src, prefetch_depth=0, resident=2)
    ahead = ManagerPager(work, args, src, prefetch_depth=depth, resident=depth + 1)
    try:
        run_loop(on_demand, 0.0, disk, total)  # warm-up: the pool's buffers exist afterwards
        calibration, _, p = run_loop(on_demand, 0.0, disk, total)
        compute_s = calibration / on_demand.steps
        phases.append(p)
        print(f"prefetch: one chunk accessed on demand takes {compute_s * 1e3:.1f} ms: the compute per step",
              flush=True)
        run_loop(ahead, compute_s, disk, total)  # the warm-up iteration: the manager records its trace
        for _ in range(args.rounds):
            od, od_c, p_od = run_loop(on_demand, compute_s, disk, total)
            pf, pf_c, p_pf = run_loop(ahead, compute_s, disk, total)
            phases += [p_od, p_pf]
            runs.append({"od": od, "od_c": od_c, "pf": pf, "pf_c": pf_c, "hiding": 1.0 - (pf - pf_c) / (od - od_c)})
            print(f"prefetch round {len(runs)}/{args.rounds}: on demand {od:.2f} s ({od - od_c:.2f} s reading), "
                  f"prefetch {pf:.2f} s ({pf - pf_c:.2f} s exposed), hiding {runs[-1]['hiding']:.1%}", flush=True)
        stats = ahead.manager.stats
    finally:
        on_demand.close()
        ahead.close()
    out = {k: median([r[k] for r in runs]) for k in runs[0]}
    return out | {"per_round": [r["hiding"] for r in runs], "compute_s": compute_s, "stats": stats,
                  "other_disk": max(p.other_disk for p in phases), "other_cores": max(p.other_cores for p in phases)}


# ---- what a chunk's transfer costs besides the disk --------------------------------------------------
def chunk_costs(src: torch.Tensor, staging: torch.Tensor) -> dict:
    """Least seconds of 3 runs of copying one chunk into a warm page-aligned buffer, and of its checksum."""
    dst = staging[:src.numel() * src.element_size()]
    flat = src.view(torch.uint8)
    copies, checksums = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(flat)
        t1 = time.perf_counter()
        checksum(memoryview(dst.numpy()))
        t2 = time.perf_counter()
        copies.append(t1 - t0)
        checksums.append(t2 - t1)
    return {"copy": min(copies), "checksum": min(checksums)}


# ---- report --------------------------------------------------------------------------------------
def report(args, raw: list[dict], store: list[dict], pf: dict | None, costs: dict, buffers: str, fs: str,
           cache_growth: int, elapsed: float) -> str:
    total = args.total_bytes

    def mbs(seconds: float) -> float:
        return total / seconds / 1e6

    def secs(runs, key) -> float:
        return median([r[key].seconds for r in runs])

    def row(label, runs, w, r):
        phases = [x[k] for x in runs for k in (w, r)]
        return [label, f"{mbs(secs(runs, w)):,.0f}", f"{mbs(secs(runs, r)):,.0f}",
                f"{median([x[w].cpu_s for x in runs]) / (total / 1e9):.2f}",
                f"{median([x[r].cpu_s for x in runs]) / (total / 1e9):.2f}",
                ", ".join(f"{mbs(x[w].seconds):,.0f}" for x in runs),
                ", ".join(f"{mbs(x[r].seconds):,.0f}" for x in runs),
                f"{max(p.other_disk for p in phases):.1%}", f"{max(p.other_cores for p in phases):.2f}"]

    has_dd = "dd_w" in raw[0]
    bs = f"{args.raw_bs // MiB} MiB"
    threads = f"{args.threads} thread{'s' * (args.threads > 1)}"
    rows = ([row(f"raw dd (bs={bs}, direct, conv=fsync)", raw, "dd_w", "dd_r")] if has_dd else []) + [
        row(f"raw Python (pwrite/preadv {bs}, O_DIRECT)", raw, "py_w", "py_r"),
        row(f"tiers NvmeStore ({threads}, queue depth {args.queue_depth})", store, "w", "r")]

    best, targets = {}, []
    for d, name in (("w", "swap-out (write)"), ("r", "swap-in (read)")):
        cands = {"Python": mbs(secs(raw, f"py_{d}"))} | ({"dd": mbs(secs(raw, f"dd_{d}"))} if has_dd else {})
        who = max(cands, key=cands.get)
        best[d] = cands[who]
        ratio = mbs(secs(store, d)) / best[d]
        rounds = [min(raw_r[k].seconds for k in (f"py_{d}", f"dd_{d}") if k in raw_r) / store_r[d].seconds
                  for raw_r, store_r in zip(raw, store)]
        targets.append([f"store {name} / best raw", f"{mbs(secs(store, d)):,.0f} / {best[d]:,.0f} MB/s ({who})",
                        f"{ratio:.2f}", ", ".join(f"{x:.2f}" for x in rounds), f"≥ {TARGET:.2f}",
                        "PASS" if ratio >= TARGET else "BELOW"])
    if pf is not None:
        targets.append(["prefetch hiding", f"{pf['od'] - pf['od_c']:.2f} s read on demand, "
                        f"{pf['pf'] - pf['pf_c']:.2f} s exposed with prefetch", f"{pf['hiding']:.1%}",
                        ", ".join(f"{h:.1%}" for h in pf["per_round"]), f"≥ {TARGET:.0%}",
                        "PASS" if pf["hiding"] >= TARGET else "BELOW"])

    st = {k: median([x[k] for x in store]) for k in ("w_throttled", "r_throttled", "w_staged", "r_staged")}
    io_w, io_r = args.chunk_bytes / (best["w"] * 1e6), args.chunk_bytes / (best["r"] * 1e6)
    serial_w = io_w / (io_w + st["w_staged"] * costs["copy"] + costs["checksum"])
    serial_r = io_r / (io_r + st["r_staged"] * costs["copy"] + costs["checksum"])
    lines = [
        "### NVMe tier: NvmeStore swap-out / swap-in vs raw sequential bandwidth of the same disk",
        "",
        f"{args.n_chunks} chunks × {args.chunk_mb} MiB = {total / GiB:g} GiB per pass; "
        f"NvmeStore(threads={args.threads}, "
        f"queue_depth={args.queue_depth}, block_size={args.block_size_kb} KiB); {buffers}. "
        f"Median over {args.rounds} alternating rounds (raw, then store); MB/s = 10^6 B/s; CPU s/GB: CPU seconds "
        f"of the process(es) doing the transfers per 10^9 B ({os.cpu_count()} cores); the last two columns: the most "
        f"disk traffic that was not ours (as a share of ours) and the most cores other processes kept busy, over "
        f"the rounds (both ≈ 0 for a clean measurement; kernel threads doing our I/O count as other cores).",
        "",
        markdown_table(["transfer", "write MB/s", "read MB/s", "CPU s/GB write", "CPU s/GB read", "per-round write",
                        "per-round read", "other disk traffic", "other cores"], rows),
        "",
        markdown_table(["target", "measured (medians)", "ratio", "per round (vs that round's best raw)", "goal",
                        "result"], targets),
        "",
    ]
    if pf is not None:
        lines += [
            f"Prefetch (ChunkManager, CPU budget of depth + 1 chunks, chunks on NVMe, read-only accesses): "
            f"{args.n_chunks} steps, compute per step {pf['compute_s'] * 1e3:.1f} ms (one chunk's on-demand access, "
            f"measured without compute; simulated with time.sleep), prefetch_depth {args.prefetch_depth}; the "
            f"prefetching manager over the whole run: {pf['stats'].prefetches} prefetches, {pf['stats'].prefetch_hits} "
            f"hits, {pf['stats'].prefetch_misses} misses, {pf['stats'].blocking_waits} blocking waits, "
            f"{pf['stats'].clean_drops} clean drops, "
            f"{pf['stats'].moved_bytes['cpu->nvme'] / 1e6:,.0f} MB written back. "
            f"Median on-demand loop {pf['od']:.2f} s ({pf['od_c']:.2f} s compute), prefetch loop {pf['pf']:.2f} s "
            f"({pf['pf_c']:.2f} s compute); other disk traffic at most {pf['other_disk']:.1%}, "
            f"other cores at most {pf['other_cores']:.2f}.",
            "",
        ]
    lines += [
        f"Per chunk of {args.chunk_mb} MiB: copy into a page-aligned buffer {costs['copy'] * 1e3:.1f} ms, XXH3-64 "
        f"{costs['checksum'] * 1e3:.1f} ms, raw write {io_w * 1e3:.1f} ms, raw read {io_r * 1e3:.1f} ms. "
        f"The store copied "
        f"{st['w_staged']:.0%} of the payload through staging when writing, {st['r_staged']:.0%} when reading: those "
        f"copies, the checksum and the I/O one after the other on one thread would reach {serial_w:.0%} of raw "
        f"write and {serial_r:.0%} of raw read.",
        f"Store callers throttled by queue_depth (medians): {st['w_throttled']:.2f} s writing, "
        f"{st['r_throttled']:.2f} s reading. Store direct I/O: "
        + ("yes" if all(x["direct_io"] for x in store) else "NO (page cache in use: these are not disk figures)")
        + f". Raw Python fsync after the writes (not counted): {median([x['py_fsync'] for x in raw]) * 1e3:.1f} ms. "
        f"Page cache grew by {cache_growth / 1e6:,.0f} MB over the run (O_DIRECT everywhere: expected ≈ 0)."
        + ("" if has_dd else " dd not found: raw baseline from the Python loop only."),
        f"Disk: {fs}",
        f"Machine: {machine_line()}",
        f"Command: `{command_line()}` (total {elapsed:.0f} s)",
    ]
    return "\n".join(lines)


def records(args, raw: list[dict], store: list[dict], pf: dict | None) -> list[dict]:
    """The figures of the report as result_record dicts (--json): the store's MB/s against the better raw figure of
    the same run (the targets), the raw figures as peers, and prefetch hiding."""
    def mbs(runs, key) -> float:
        return args.total_bytes / median([r[key].seconds for r in runs]) / 1e6

    out = []
    store_name = f"tiers NvmeStore ({args.threads} threads, queue depth {args.queue_depth})"
    for d, what in (("w", "write"), ("r", "read")):
        raws = {f"raw Python (pwrite/preadv, O_DIRECT) {what}": mbs(raw, f"py_{d}")}
        if "dd_w" in raw[0]:
            raws[f"raw dd (direct) {what}"] = mbs(raw, f"dd_{d}")
        best = max(raws, key=raws.get)
        ours = mbs(store, d)
        out.append(result_record("offload", f"{store_name} {what}", world=1, peer=best, strategy="NVMe store",
                                 metric=f"{what} MB/s ÷ best raw", ratio=ours / raws[best], target=TARGET,
                                 better="higher", throughput=ours, unit="MB/s"))
        out += [result_record("offload", name, world=1, role="peer", strategy="NVMe store", metric=f"{what} MB/s",
                              throughput=v, unit="MB/s") for name, v in raws.items()]
    if pf is not None:
        out.append(result_record("offload", f"ChunkManager prefetch (depth {args.prefetch_depth})", world=1,
                                 peer="reads on demand", strategy="prefetch", metric="read time hidden",
                                 ratio=pf["hiding"], target=TARGET, better="higher",
                                 exposed_s=pf["pf"] - pf["pf_c"], on_demand_read_s=pf["od"] - pf["od_c"]))
    return out


# ---- main ----------------------------------------------------------------------------------------
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def check_resources(args, where: str) -> None:
    need_disk = args.total_bytes + 2 * args.chunk_bytes
    free = shutil.disk_usage(where).free
    if free < need_disk:
        raise SystemExit(f"{where!r} has {free / 1e9:.1f} GB free; a pass needs {need_disk / 1e9:.1f} GB: "
                         f"lower --total-gb or choose another --dir")
    need_mem = 2 * args.total_bytes + (2 + 4 * args.threads) * args.chunk_bytes
    avail = psutil.virtual_memory().available
    if avail < need_mem:
        raise SystemExit(f"{avail / 1e9:.1f} GB of memory available; the chunks, read buffers and staging buffers need "
                         f"{need_mem / 1e9:.1f} GB: lower --total-gb")


def run(args, work: str) -> str:
    started = time.perf_counter()
    cache0 = page_cache_bytes()
    disk = DiskCounter(work)
    allocate, alloc_what = chunk_allocator(args.block_size)
    print(f"chunk buffers: {alloc_what}; disk traffic counted on: {disk.device}", flush=True)
    numel = args.chunk_bytes // DTYPE.itemsize
    base = torch.randint(-2**30, 2**30, (MiB // DTYPE.itemsize,), dtype=DTYPE,
                         generator=torch.Generator().manual_seed(0))
    src = [allocate(numel) for _ in range(args.n_chunks)]
    for i, c in enumerate(src):
        fill_chunk(c, i, base)
    dst = [allocate(numel).zero_() for _ in range(args.n_chunks)]  # touched now: no page faults while timed
    raw = raw_buffers(src, dst, args.raw_bs, base)
    use_dd = shutil.which("dd") is not None
    costs = chunk_costs(src[0], page_aligned(args.chunk_bytes))

    raw_runs, store_runs = [], []
    for r in range(args.rounds):
        raw_runs.append(raw_round(work, args, raw, use_dd, disk))
        check = sorted({0, args.n_chunks // 2, args.n_chunks - 1, (7 * r + 3) % args.n_chunks})
        store_runs.append(store_round(work, args, src, dst, check, disk))
        rr, sr = raw_runs[-1], store_runs[-1]

        def pair(w: Phase, rd: Phase) -> str:
            return f"{args.total_bytes / w.seconds / 1e6:,.0f}/{args.total_bytes / rd.seconds / 1e6:,.0f}"

        dd = f"dd {pair(rr['dd_w'], rr['dd_r'])}, " if use_dd else ""
        print(f"round {r + 1}/{args.rounds} write/read MB/s: {dd}Python {pair(rr['py_w'], rr['py_r'])}, "
              f"store {pair(sr['w'], sr['r'])} (chunks {check} verified)", flush=True)

    pf = None if args.skip_prefetch else measure_prefetch(work, args, src, disk)
    cache_growth = page_cache_bytes() - cache0
    buffers = f"chunk buffers from {alloc_what}; the raw Python loop moves {raw[2]}"
    text = report(args, raw_runs, store_runs, pf, costs, buffers, filesystem_line(work, disk), cache_growth,
                  time.perf_counter() - started)
    return text, records(args, raw_runs, store_runs, pf)


def main(argv=None) -> None:
    args = parse_args(argv)
    base = os.path.abspath(args.dir or os.path.join(os.getcwd(), ".bench-offload"))
    created_base = not os.path.exists(base)
    if created_base and args.dir is not None:
        raise SystemExit(f"--dir {args.dir!r} does not exist: create it (mkdir -p {args.dir}) or choose another")
    os.makedirs(base, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # so the files are removed on kill too
    work = tempfile.mkdtemp(prefix="bench-offload-", dir=base)
    try:
        check_resources(args, work)
        text, results = run(args, work)
    except KeyboardInterrupt as e:
        raise SystemExit(f"interrupted ({str(e) or 'Ctrl-C'}); removed {work}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created_base:
            try:
                os.rmdir(base)
            except OSError:
                pass  # another run is using it
    print("\n" + text, flush=True)
    if args.out:
        write_text(args.out, text)
    write_results(args.json, results)


if __name__ == "__main__":
    main()
