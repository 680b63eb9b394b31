"""The README's benchmark table, rendered from docs/benchmarks.md's summary (which scripts/bench_all.py writes), never
typed: one row per benchmark run, its ratios grouped by metric and target, and how many of them met their target.

    python scripts/readme_benchmarks.py                  # the table, to stdout
    python scripts/readme_benchmarks.py --write README.md  # rewrites it between the README's markers
    python scripts/readme_benchmarks.py --check README.md  # exits 1 when the README's differs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, or imported by bench_all: scripts/ is a package of the repo root
    sys.path.insert(0, str(REPO))

from scripts.readme_markers import marked_main, replaced  # noqa: E402

SUMMARY = REPO / "docs" / "benchmarks.md"
MARKERS = ("<!-- benchmark summary -->", "<!-- end benchmark summary -->")

# run -> (what it measures, against what); a run docs/benchmarks.md has and this lacks fails the rendering
RUNS = {
    "dp-w2": ("data parallel (stage 0), 2 ranks", "DistributedDataParallel"),
    "zero1-w2": ("ZeRO stage 1, 2 ranks", "ZeroRedundancyOptimizer + DDP"),
    "zero2-w2": ("ZeRO stage 2, 2 ranks", "DistributedDataParallel"),
    "zero3-w2": ("ZeRO stage 3, 2 ranks", "FSDP2 (`fully_shard` per block)"),
    "tp-w2": ("1D tensor parallel, tp 2: built-in / derived plan", "DTensor `parallelize_module`"),
    "tp-w4": ("tensor parallel, 4 ranks: 1D built-in / derived plan / 2D", "DTensor `parallelize_module` (1D)"),
    "pipeline-w2": ("pipeline, 2 stages, `train_batch`: GPipe / 1F1B / interleaved / zero bubble, m = 4 then 8; "
                    "zero bubble's bubble", "`torch.distributed.pipelining`, same schedule; 1F1B's bubble"),
    "sequence_parallel": ("sequence parallel, S = 2, same tokens: Ulysses / ring against DDP, then against one "
                          "process", "DDP; one process on the whole sequences"),
    "moe": ("MoE, HF Mixtral: ep 2 / ep 1", "DistributedDataParallel (experts replicated)"),
    "checkpointing": ("activation checkpointing, recompute overhead", "`torch.utils.checkpoint` by hand"),
    "checkpoint": ("checkpoints, 2 ranks, ZeRO-3: save / load / async save blocked", "`torch.distributed.checkpoint`"
                   " over FSDP2"),
    "launch": ("launcher, 1 node × 4 / 2 nodes × 2", "torchrun by hand"),
    "offload": ("NVMe swap-out / swap-in; ChunkManager prefetch", "raw O_DIRECT write / read; reads on demand"),
    "zero_nvme": ("ZeRO-3, everything on NVMe, 2 ranks: step after backward / `step_in_backward`",
                  "raw disk (dd), same run"),
    "scale": ("scale: 12.9 B GPT in one process (bf16 masters, AdamW8bit); 4.23 B, 1 process / 2 ranks",
              "its disk, matmul and update floors; raw disk (dd)"),
    "host_step": ("offloaded host step (R) / step over its floor not offloaded: ZeRO-2, ZeRO-3 × bf16, fp16, fp32",
                  "torch fused AdamW over as many elements"),
    "update": ("optimizer update in memory: AdamW8bit (fp32 / bf16 masters / rounded), AdamW4bit; bf16-master AdamW "
               "(/ rounded)", "torchao's AdamW8bit / 4bit (compiled); torch fused AdamW"),
    "onebit": ("1-bit Adam / 0/1 Adam / 1-bit LAMB, 2 ranks: bytes per step; loss", "the fp32 gradient all-reduce; "
               "the same optimizer on 1 rank"),
    "streamed_load": ("streamed `from_pretrained` under `zero_init` / `weights=`, 1.1 B Llama, 2 ranks: peak RSS "
                      "growth per rank", "the model's bf16 bytes"),
    "finetune": ("LoRA r = 16 on a 7 B Llama, base on NVMe", "compute with the base in memory; 4 GB"),
    "finetune_int8": ("LoRA r = 16 on a 7 B Llama, int8 base on NVMe", "compute with the base in memory; 4 GB"),
    "lowbit_accuracy": ("the example job, 1,000 steps, bf16 masters: DeepSpeed's with fp32 / bf16 moments, stochastic "
                        "rounding, + AdamW8bit, + AdamW4bit: final eval loss", "the fp32-master run"),
    "layer_major": ("layer-major accumulation, ZeRO-3 on NVMe, 8 micro-batches", "the same run micro-batch by "
                    "micro-batch"),
}


class SummaryError(Exception):
    pass


@dataclass(frozen=True)
class Row:
    run: str
    metric: str
    ratio: str
    target: str
    met: bool | None  # None: no target


def summary_rows(text: str) -> list[Row]:
    """The rows of the `## Summary` table of docs/benchmarks.md."""
    start = text.find("## Summary")
    if start < 0:
        raise SummaryError("docs/benchmarks.md has no ## Summary section")
    end = text.find("\n## ", start + 1)
    lines = [line for line in text[start:end if end > 0 else None].splitlines() if line.startswith("|")]
    rows = []
    for line in lines[2:]:  # the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8:
            raise SummaryError(f"a summary row without 8 cells: {line}")
        run, _, _, _, metric, ratio, target, met = cells
        rows.append(Row(run, metric, ratio, target, None if met == "—" else met == "yes"))
    return rows


def render(rows: list[Row]) -> str:
    unknown = sorted({r.run for r in rows} - set(RUNS))
    if unknown:
        raise SummaryError(f"runs without a README label: {unknown}; add them to RUNS in scripts/readme_benchmarks.py")
    judged = [r for r in rows if r.met is not None]
    out = [f"{sum(r.met for r in judged)} of {len(judged)} ratios met.", "",
           "| capability | peer | ratio ours ÷ peer: metric values (target) | met |", "|---|---|---|---|"]
    for run in dict.fromkeys(r.run for r in rows):
        mine = [r for r in rows if r.run == run]
        groups: dict[tuple[str, str], list[str]] = {}
        for r in mine:
            groups.setdefault((r.metric, r.target), []).append(r.ratio)
        ratios = "; ".join(f"{metric} {' / '.join(values)}" + (f" ({target})" if target != "—" else "")
                           for (metric, target), values in groups.items())
        scored = [r for r in mine if r.met is not None]
        met = f"{sum(r.met for r in scored)} of {len(scored)}" if scored else "—"
        label, peer = RUNS[run]
        out.append(f"| {label} | {peer} | {ratios} | {met} |")
    return "\n".join(out)


def current(readme: Path, summary: Path = SUMMARY) -> tuple[str, str]:
    """(the README as it is, the README with the table rendered from `summary` now)."""
    text = readme.read_text(encoding="utf-8")
    return text, replaced(text, MARKERS, render(summary_rows(summary.read_text(encoding="utf-8"))), readme)


def main(argv: list[str] | None = None) -> int:
    def table() -> str:
        return render(summary_rows(SUMMARY.read_text(encoding="utf-8")))
    return marked_main(argv, __doc__.split("\n\n")[0], "scripts/readme_benchmarks.py", table, current,
                       (SummaryError,))


if __name__ == "__main__":
    sys.exit(main())
