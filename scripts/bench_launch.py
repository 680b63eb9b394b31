"""Launch overhead: `tiers launch --launcher local` against torchrun started by hand, on the same job.

The job is the smallest real one: every process joins the gloo process group, all-reduces one tensor and
exits, so the wall time is start-up and shut-down (interpreters, torch import, rendezvous), which is what a
launcher adds to. Layouts: one node of 4 processes, and 2 "nodes" of 2; torchrun by hand is one torchrun per node
with --node_rank, as one would type them on each machine. Systems alternate round by round.

This is a benchmark script: it prints what it measured and never asserts on time.

    python scripts/bench_launch.py [--rounds 5] [--out docs/bench_launch.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from bench_common import add_json_option, free_port, median, publish_report, result_record, write_results

from engine.estimate.report import markdown_table

JOB = """import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""
LAYOUTS = [(1, 4), (2, 2)]  # (nodes, processes per node)


def torchrun_by_hand(job: str, nodes: int, per_node: int, port: int) -> list[list[str]]:
    """What one types without a launcher: a torchrun per node with fixed node ranks (as tiers launch runs them;
    `--standalone`'s c10d rendezvous measured about 1 s slower here)."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={per_node}"]
    return [run + [f"--nnodes={nodes}", f"--node_rank={r}", "--master_addr=127.0.0.1", f"--master_port={port}", job]
            for r in range(nodes)]


def tiers_launch(job: str, hostfile: str, port: int) -> list[list[str]]:
    return [[sys.executable, "-m", "engine.cli", "launch", "--launcher", "local", "--hostfile", hostfile,
             "--master_port", str(port), job]]


def wall_time(commands: list[list[str]], env: dict[str, str]) -> float:
    start = time.perf_counter()
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in commands]
    for p in processes:
        _, err = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args)} exited {p.returncode}:\n{err.decode()}")
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    add_json_option(ap)
    args = ap.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    start = time.perf_counter()
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "allreduce_once.py")
        with open(job, "w") as f:
            f.write(JOB)
        for nodes, per_node in LAYOUTS:
            hostfile = os.path.join(tmp, f"hostfile{nodes}")
            with open(hostfile, "w") as f:
                f.write("".join(f"node-{i} slots={per_node}\n" for i in range(nodes)))
            times: dict[str, list[float]] = {"torchrun": [], "tiers": []}
            for r in range(args.rounds):
                for system in times:
                    port = free_port()
                    commands = (torchrun_by_hand(job, nodes, per_node, port) if system == "torchrun"
                                else tiers_launch(job, hostfile, port))
                    times[system].append(wall_time(commands, env))
                print(f"{nodes} x {per_node} round {r + 1}/{args.rounds}: torchrun {times['torchrun'][-1]:.2f} s, "
                      f"tiers launch {times['tiers'][-1]:.2f} s", flush=True)
            ours, peer = median(times["tiers"]), median(times["torchrun"])
            rows.append([f"{nodes} node(s) × {per_node}", f"{peer:.2f}", f"{ours:.2f}", f"{ours / peer:.3f}",
                         ", ".join(f"{t:.2f}" for t in times["tiers"])])
            layout = f"{nodes} node(s) × {per_node}"
            records += [result_record("launch", f"tiers launch, {layout}", world=nodes * per_node,
                                      peer=f"torchrun by hand, {layout}", strategy="launch", metric="wall time",
                                      ratio=ours / peer, target=1.0, seconds=ours),
                        result_record("launch", f"torchrun by hand, {layout}", world=nodes * per_node, role="peer",
                                      strategy="launch", metric="wall time", seconds=peer)]
    header = (f"Wall time of a job whose {4} processes join a gloo group, all-reduce once and exit; median of "
              f"{args.rounds} alternating rounds. torchrun: started by hand, one per node with --node_rank "
              "and the same master address and port; "
              "tiers: `tiers launch --launcher local` with a hostfile of that many nodes.")
    table = markdown_table(["layout", "torchrun (s)", "tiers launch (s)", "ratio (target ≤ 1.0)",
                            "tiers per round (s)"], rows)
    publish_report("\n\n".join([header, table]), start, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
