"""Every benchmark, one after another, and docs/benchmarks.md from their results.

    .venv/bin/python scripts/bench_all.py                      # the full set (about 40 minutes on 2 cores)
    .venv/bin/python scripts/bench_all.py --quick              # tiny models, 1 round: a check that all run (minutes)
    .venv/bin/python scripts/bench_all.py --only zero1,tp --world 2,4
    .venv/bin/python scripts/bench_all.py --list               # what would run, and for how long

Each benchmark script runs as its own process with this interpreter, never two at once (they time things), with
--out and --json into a results directory (kept: its path is printed). Then the report is written (--out, default
docs/benchmarks.md): the machine, the command and date; a summary of every ratio against its torch peer with its
target; throughput and per-rank memory plots (matplotlib, optional) next to it (docs/benchmarks/*.png); then each
benchmark's report as its script printed it, between the hand-written notes of docs/benchmark_notes/<run>.md
(bench_report.py says how notes are laid out). After writing notes for a run, `--render-only --results DIR`
rewrites the report from that run's results without running anything.

A quick run (--quick) writes to a file in the temp directory unless --out is given, and labels itself as such
everywhere: its figures are not measurements.

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import command_line, machine_line, read_results, write_text  # noqa: E402
from bench_report import Run, render  # noqa: E402
from readme_benchmarks import SUMMARY  # noqa: E402
from readme_benchmarks import main as write_readme_benchmarks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_TRAINING = ("--model", "tiny", "--micro-batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
                  "--rounds", "1")


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    title: str
    args: tuple[str, ...] = ()          # the documented full run
    quick: tuple[str, ...] = ()         # the smallest run that still exercises everything
    worlds: tuple[int, ...] | None = None  # default world sizes where the script takes --world; None: it does not
    seconds: dict[int | None, float] = field(default_factory=dict)  # documented duration of a full run, by world
    takes_dir: bool = False             # a disk benchmark: --dir is passed on
    heads: int | None = None            # attention heads of the model, where they must divide by the world size
    quick_heads: int | None = None


BENCHMARKS = (
    Benchmark("dp", "bench_dp.py", "Data parallelism (stage 0) vs torch DDP", quick=QUICK_TRAINING, worlds=(2,),
              seconds={2: 389}),
    Benchmark("offload", "bench_offload.py", "NVMe tier (offload/) vs the raw bandwidth of the same disk",
              quick=("--chunk-mb", "8", "--total-gb", "0.0625", "--rounds", "1"), seconds={None: 106}, takes_dir=True),
    *(Benchmark(f"zero{s}", "bench_zero.py", f"ZeRO stage {s} vs {peer}", args=("--stage", str(s)),
                quick=("--stage", str(s), *QUICK_TRAINING), worlds=(2,), seconds={2: t})
      for s, peer, t in ((1, "torch ZeroRedundancyOptimizer + DDP", 339), (2, "torch DDP", 353),
                         (3, "torch FSDP2", 344))),
    Benchmark("host_step", "bench_host_step.py",
              "The offloaded host step vs torch's fused AdamW over as many fp32 elements, one process",
              quick=("--layers", "2", "--width", "256", "--steps", "2", "--warmup", "1"), seconds={None: 170}),
    Benchmark("update", "bench_update.py",
              "The optimizer update of each state layout vs torchao's and torch's optimizers, in memory, one process",
              quick=("--elements", "1048576", "--steps", "1"), seconds={None: 48}),
    Benchmark("zero_nvme", "bench_zero_nvme.py", "ZeRO stage 3 through NVMe",
              quick=("--model", "small", "--seq", "32", "--steps", "2", "--warmup", "1", "--raw-bytes", "67108864",
                     "--cpu-budget", "4MB"), seconds={None: 32}, takes_dir=True),
    Benchmark("scale", "bench_scale.py", "Scale: the largest GPT through NVMe in one process, its step vs its floor",
              quick=("--layers", "2", "--embd", "256", "--heads", "4", "--steps", "3", "--raw-bytes", "67108864"),
              seconds={None: 1500}, takes_dir=True),
    # world 8: 1D, 2D (2×2 × dp 2), 2.5D and 3D; its duration scaled from a shorter run (241 s at seq 128, 4 + 1
    # steps, 2 rounds), not yet measured in full
    Benchmark("tp", "bench_tp.py", "Tensor parallelism (1D, 2D, 2.5D, 3D) vs torch DTensor tensor parallel",
              quick=QUICK_TRAINING, worlds=(2, 4, 8), seconds={2: 198, 4: 147, 8: 1700}, heads=10, quick_heads=2),
    Benchmark("pipeline", "bench_pipeline.py", "Pipeline parallelism vs torch.distributed.pipelining",
              quick=("--model", "tiny", "--layers", "4", "--seq", "32", "--steps", "2", "--warmup", "1",
                     "--rounds", "1"), worlds=(2,), seconds={2: 420}),
    Benchmark("sequence_parallel", "bench_sequence_parallel.py",
              "Sequence parallelism (Ulysses, ring) vs one process and DDP on the same tokens", quick=("--quick",),
              seconds={None: 600}),
    Benchmark("moe", "bench_moe.py", "Mixture of experts: expert parallelism (ep 2) vs the model replicated under DDP",
              quick=("--quick",), seconds={None: 120}),
    Benchmark("checkpointing", "bench_checkpointing.py", "Activation checkpointing vs torch.utils.checkpoint by hand",
              quick=("--model", "tiny", "--micro-batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
                     "--rounds", "1", "--threads", "1"), seconds={None: 261}),
    Benchmark("checkpoint", "bench_checkpoint.py", "Checkpoints vs the raw disk and torch.distributed.checkpoint",
              args=("--rounds", "5"), quick=("--model", "tiny", "--rounds", "1"), seconds={None: 60}, takes_dir=True),
    Benchmark("launch", "bench_launch.py", "Launcher: `tiers launch` vs torchrun started by hand",
              args=("--rounds", "5"), quick=("--rounds", "1"), seconds={None: 113}),
    Benchmark("onebit", "bench_onebit.py",
              "Compressed-communication optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) vs fp32 all-reduce",
              quick=("--quick",), seconds={None: 240}),
    Benchmark("streamed_load", "bench_streamed_load.py",
              "Streamed pretrained weights: peak RSS per rank of a 1.1 B Llama loaded under zero_init, 2 ranks",
              quick=("--preset", "tiny"), seconds={None: 120}, takes_dir=True),
    Benchmark("finetune", "bench_finetune.py", "LoRA on a 7 B Llama in one process, the frozen base on NVMe",
              quick=("--preset", "tiny", "--compute-layers", "1", "--raw-bytes", "67108864", "--cpu-budget-mb", "16"),
              seconds={None: 2410}, takes_dir=True),
    Benchmark("lowbit_accuracy", "bench_lowbit_accuracy.py",
              "Low-precision layouts (bf16 masters, stochastic rounding, 8/4-bit states): the example job's final eval "
              "loss", quick=("--steps", "5"), seconds={None: 1100}),
    Benchmark("layer_major", "bench_layer_major.py",
              "Layer-major accumulation vs micro-batch by micro-batch: parameter reads per step, ZeRO-3 on NVMe",
              quick=("--layers", "2", "--embd", "128", "--heads", "4", "--steps", "2"), seconds={None: 95},
              takes_dir=True),
    Benchmark("finetune_int8", "bench_finetune.py",
              "LoRA on a 7 B Llama in one process, the frozen base on NVMe as int8", args=("--base", "int8"),
              quick=("--base", "int8", "--preset", "tiny", "--compute-layers", "1", "--raw-bytes", "67108864",
                     "--cpu-budget-mb", "16"),
              seconds={None: 2700}, takes_dir=True),
)
NAMES = [b.name for b in BENCHMARKS]


@dataclass(frozen=True)
class Planned:
    bench: Benchmark
    world: int | None
    args: tuple[str, ...]

    @property
    def id(self) -> str:
        return self.bench.name if self.world is None else f"{self.bench.name}-w{self.world}"

    def command(self) -> str:
        return command_line_of([os.path.join("scripts", self.bench.script), *self.args])

    def estimate_s(self) -> float | None:
        return self.bench.seconds.get(self.world)


def command_line_of(argv: list[str]) -> str:
    exe = sys.executable
    rel = os.path.relpath(exe, REPO)
    return " ".join([exe if rel.startswith("..") else rel, *argv])


def heads_for(world: int, heads: int) -> tuple[str, ...]:
    """--n-head when the model's heads do not split over `world` ranks: the most heads <= `heads` that do."""
    if heads % world == 0:
        return ()
    return ("--n-head", str(max(world, heads // world * world)))


def plan(only: list[str] | None, worlds: list[int] | None, quick: bool, disk_dir: str | None) -> list[Planned]:
    """The runs, in the order of docs/benchmarks.md; `worlds` replaces every --world benchmark's default sizes."""
    out = []
    for b in BENCHMARKS:
        if only and b.name not in only:
            continue
        base = b.quick if quick else b.args
        if disk_dir and b.takes_dir:
            base = (*base, "--dir", disk_dir)
        if b.worlds is None:
            out.append(Planned(b, None, base))
            continue
        for w in worlds or b.worlds:
            extra = ("--world", str(w))
            heads = b.quick_heads if quick else b.heads
            if heads:
                extra += heads_for(w, heads)
            if w > (os.cpu_count() or 1) and not quick:
                extra += ("--rounds", "1")  # oversubscribed: one round, as the documented 4-rank tp run
            out.append(Planned(b, w, (*base, *extra)))
    return out


def run_one(p: Planned, results: str) -> Run:
    """Runs one benchmark script to completion (its output goes to ours) and reads back what it wrote."""
    md, js = os.path.join(results, f"{p.id}.md"), os.path.join(results, f"{p.id}.json")
    for path in (md, js):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))  # this checkout's engine
    argv = [sys.executable, os.path.join("scripts", p.bench.script), *p.args, "--out", md, "--json", js]  # cwd: REPO
    print(f"\n=== bench_all: {p.id}: {p.command()}", flush=True)
    start = time.perf_counter()
    code = subprocess.run(argv, cwd=REPO, env=env).returncode
    return load_run(p, results, time.perf_counter() - start, code)


def load_run(p: Planned, results: str, seconds: float, code: int) -> Run:
    md, js = os.path.join(results, f"{p.id}.md"), os.path.join(results, f"{p.id}.json")
    run = Run(p.id, p.bench.title, p.world, p.command(), seconds, code)
    if code == 0 and os.path.exists(md) and os.path.exists(js):
        with open(md) as f:
            run.report = f.read()
        run.records = read_results(js)
    elif code == 0:
        run.returncode = -1  # exited 0 without its files: count it as failed
    return run


def parse_list(text: str, kind, what: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: give a comma-separated list, e.g. 2,4") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="each script's smallest options: checks that all run, "
                    "in a few minutes; the report says these are not measurements")
    ap.add_argument("--only", type=lambda t: parse_list(t, str, "--only"), default=None,
                    help=f"comma-separated benchmarks to run, of: {', '.join(NAMES)}")
    ap.add_argument("--world", type=lambda t: parse_list(t, int, "--world"), default=None,
                    help="comma-separated world sizes for the benchmarks that take --world (dp, zero1-3, tp, "
                         "pipeline); default: dp, zero and pipeline at 2, tp at 2 and 4. Above the core count a run "
                         "gets --rounds 1")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure, for offload, zero_nvme and "
                    "checkpoint (default: each script's own)")
    ap.add_argument("--out", default=None, help="the report (default docs/benchmarks.md; with --quick, "
                    "tiers-benchmarks-quick.md in the temp directory); plots go to a directory named after it")
    ap.add_argument("--notes", default=os.path.join(REPO, "docs", "benchmark_notes"),
                    help="directory of the hand-written notes (default docs/benchmark_notes)")
    ap.add_argument("--results", default=None, help="directory for each script's markdown and JSON (default: a "
                    "new temp directory, kept)")
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: rewrite the report from the run recorded in --results")
    ap.add_argument("--list", action="store_true", help="print the runs and their documented durations; run nothing")
    args = ap.parse_args(argv)
    if args.only:
        unknown = [n for n in args.only if n not in NAMES]
        if unknown:
            hints = [f"{n!r} (did you mean {difflib.get_close_matches(n, NAMES, 1)[0]!r}?)"
                     if difflib.get_close_matches(n, NAMES, 1) else repr(n) for n in unknown]
            ap.error(f"--only: unknown benchmark(s) {', '.join(hints)}; choose from {', '.join(NAMES)}")
    if args.world and min(args.world) < 2:
        ap.error(f"--world {args.world}: these benchmarks need at least 2 ranks")
    if args.render_only and not args.results:
        ap.error("--render-only needs --results DIR: the directory a previous run printed")
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "tiers-benchmarks-quick.md") if args.quick
                    else os.path.join(REPO, "docs", "benchmarks.md"))
    return args


def print_plan(runs: list[Planned], quick: bool) -> None:
    total, unknown = 0.0, []
    for p in runs:
        est = None if quick else p.estimate_s()
        total += est or 0.0
        if est is None:
            unknown.append(p.id)
        print(f"{p.id:14} {'?' if est is None else f'{est / 60:4.1f} min':>8}  {p.command()}")
    if quick:
        print("quick run: about 10-25 s per run here (process start-up dominates)")
    else:
        print(f"documented full-run durations add up to {total / 60:.0f} minutes"
              + (f" (no figure for {', '.join(unknown)})" if unknown else ""))


def write_report(runs: list[Run], meta: dict, out: str, notes: str) -> None:
    records = [r for run in runs for r in run.records]
    stem = os.path.splitext(os.path.basename(out))[0]
    plots_dir = os.path.join(os.path.dirname(os.path.abspath(out)), stem)
    plots, skipped = [], None
    try:
        from bench_plots import write_plots
        paths = write_plots(records, plots_dir, quick=meta["quick"], machine=meta["machine"])
        titles = {"throughput.png": "throughput by strategy and world size",
                  "memory.png": "per-rank peak memory by strategy and world size"}
        plots = [(titles[os.path.basename(p)], f"{stem}/{os.path.basename(p)}") for p in paths]
    except ImportError:
        skipped = ("Plots skipped: matplotlib is not installed (`pip install matplotlib`, or "
                   "`pip install -e '.[plots]'`), then `scripts/bench_all.py --render-only --results DIR`.")
        print(skipped)
    text = render(runs, this_run=meta["run"], command=meta["command"], machine=meta["machine"], quick=meta["quick"],
                  plots=plots, plots_skipped=skipped, notes_dir=notes, total_s=meta["total_s"])
    write_text(out, text)
    print(f"bench_all: report written to {out}" + (f", plots to {plots_dir}" if plots else ""))
    if os.path.abspath(out) == str(SUMMARY):  # the README's table follows the summary
        write_readme_benchmarks(["--write", os.path.join(REPO, "README.md")])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render_only:
        with open(os.path.join(args.results, "run.json")) as f:
            meta = json.load(f)
        by_id = {p.id: p for p in plan(None, meta["worlds"], meta["quick"], meta["dir"])}
        runs = [load_run(by_id[r["id"]], args.results, r["seconds"], r["returncode"]) for r in meta["runs"]]
        write_report(runs, meta, args.out, args.notes)
        return 0 if all(r.ok for r in runs) else 1
    planned = plan(args.only, args.world, args.quick, args.dir)
    if args.list:
        print_plan(planned, args.quick)
        return 0
    results = args.results or tempfile.mkdtemp(prefix="tiers-bench-")
    os.makedirs(results, exist_ok=True)
    started, wall0 = datetime.now(timezone.utc), time.perf_counter()
    meta = {"run": started.strftime("%Y-%m-%d %H:%M UTC") + (" (quick)" if args.quick else ""),
            "command": command_line(), "machine": machine_line(), "quick": args.quick, "worlds": args.world,
            "dir": args.dir, "runs": [], "total_s": 0.0}
    print(f"bench_all: {len(planned)} runs, one after another; results in {results}", flush=True)
    runs = []
    for p in planned:
        run = run_one(p, results)
        runs.append(run)
        meta["runs"].append({"id": run.id, "seconds": run.seconds, "returncode": run.returncode})
        meta["total_s"] = time.perf_counter() - wall0
        write_text(os.path.join(results, "run.json"), json.dumps(meta, indent=1))
        print(f"=== bench_all: {run.id} {'done' if run.ok else f'FAILED (exit {run.returncode})'} in "
              f"{run.seconds:.0f} s", flush=True)
    write_report(runs, meta, args.out, args.notes)
    print(f"bench_all: {len(runs)} runs in {meta['total_s'] / 60:.1f} minutes; results kept in {results}")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
