"""Two commits' benchmarks in one run, alternating: each round runs every chosen benchmark on the old commit and on
the new one (the order flipped each round, so drift in the machine's speed falls on both), and the report gives,
per compared system, each side's median ratio to its torch peer over the rounds and new ÷ old.

    .venv/bin/python scripts/bench_ab.py --old 3b704d7 --new HEAD --only zero1,zero2,zero3,tp,pipeline,checkpoint \
        --rounds 3 --out /tmp/ab.md

--inner-rounds 1 runs each script once per side and round (one pair of ours and its peer), so that the median over
--rounds is of independent runs and a long set fits one sitting.

Each commit runs from a worktree of its own (git worktree, removed at the end) with this checkout's .venv, with
PYTHONPATH set to the worktree so that its engine is the one imported. Options the benchmarks take are bench_all's
(--world, --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_all import NAMES, Planned, parse_list, plan  # noqa: E402
from bench_common import read_results, write_text  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worktree(commit: str, root: str, label: str) -> str:
    path = os.path.join(root, label)
    subprocess.run(["git", "worktree", "add", "--detach", "-q", path, commit], cwd=REPO, check=True)
    return path


def run_side(p: Planned, tree: str, out_dir: str, label: str, round_: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """One benchmark on one commit's tree; its compared records (role "ours" with a ratio), or [] when it failed."""
    stem = os.path.join(out_dir, f"{p.id}.{label}.{round_}")
    env = dict(os.environ, PYTHONPATH=tree)
    argv = [sys.executable, os.path.join("scripts", p.bench.script), *p.args, *extra, "--out", f"{stem}.md",
            "--json", f"{stem}.json"]
    print(f"=== bench_ab: round {round_}, {label}: {p.id}", flush=True)
    code = subprocess.run(argv, cwd=tree, env=env).returncode
    if code != 0 or not os.path.exists(f"{stem}.json"):
        print(f"=== bench_ab: {p.id} on {label} failed (exit {code})", flush=True)
        return []
    return [r for r in read_results(f"{stem}.json") if r.get("role") == "ours" and r.get("ratio") is not None]


def inner_note(inner: int | None) -> str:
    return "" if inner is None else f" (each benchmark script run with --rounds {inner})"


def report(ratios: dict[tuple[str, str, str], dict[str, list[float]]], meta: dict, threshold: float) -> str:
    lines = [f"# Benchmarks, {meta['old']} (old) vs {meta['new']} (new), alternating", "",
             f"{meta['rounds']} rounds{inner_note(meta['inner'])}, {meta['minutes']:.0f} minutes; ratios are ours ÷ "
             "the torch peer in the same "
             f"run; new ÷ old > {1 + threshold:.2f} (lower is better) or < {1 - threshold:.2f} (higher is better) is "
             "flagged.", "",
             "| benchmark | system | metric | old (median) | new (median) | new ÷ old | rounds | worse? |",
             "|---|---|---|---|---|---|---|---|"]
    for (bench, system, metric), sides in ratios.items():
        old, new = sides.get("old", []), sides.get("new", [])
        if not old or not new:
            lines.append(f"| {bench} | {system} | {metric} | {len(old)} runs | {len(new)} runs | — | — | failed |")
            continue
        a, b = statistics.median(old), statistics.median(new)
        change = b / a if a else float("nan")
        worse = change > 1 + threshold if sides["better"] == "lower" else change < 1 - threshold
        lines.append(f"| {bench} | {system} | {metric} | {a:.3f} | {b:.3f} | {change:.3f} | {len(old)}/{len(new)} | "
                     f"{'**yes**' if worse else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the baseline commit")
    ap.add_argument("--new", default="HEAD", help="the commit compared with it (default HEAD)")
    ap.add_argument("--only", type=lambda t: parse_list(t, str, "--only"), required=True,
                    help=f"comma-separated benchmarks, of: {', '.join(NAMES)}")
    ap.add_argument("--world", type=lambda t: parse_list(t, int, "--world"), default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="each script's smallest options (checks that it runs)")
    ap.add_argument("--inner-rounds", type=int, default=None,
                    help="--rounds passed to each benchmark script (its own alternating rounds of ours and the peer); "
                         "default: the script's")
    ap.add_argument("--threshold", type=float, default=0.05, help="the change flagged as worse (default 0.05)")
    ap.add_argument("--out", default=None, help="the markdown report (default: printed)")
    args = ap.parse_args(argv)
    planned = plan(args.only, args.world, args.quick, None)
    extra = () if args.inner_rounds is None else ("--rounds", str(args.inner_rounds))
    started = time.perf_counter()
    ratios: dict[tuple[str, str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="tiers-ab-") as root:
        trees = {label: worktree(commit, root, label) for label, commit in (("old", args.old), ("new", args.new))}
        out_dir = os.path.join(root, "results")
        os.makedirs(out_dir)
        try:
            for round_ in range(args.rounds):
                order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
                for p in planned:
                    for label in order:
                        for r in run_side(p, trees[label], out_dir, label, round_, extra):
                            entry = ratios.setdefault((p.id, r["system"], r["metric"]), {"better": r["better"]})
                            entry.setdefault(label, []).append(r["ratio"])
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO)
    meta = {"old": args.old, "new": args.new, "rounds": args.rounds, "inner": args.inner_rounds,
            "minutes": (time.perf_counter() - started) / 60}
    text = report(ratios, meta, args.threshold)
    if args.out:
        write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
