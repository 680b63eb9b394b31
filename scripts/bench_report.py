"""docs/benchmarks.md from the runs of scripts/bench_all.py: a header, the summary of every ratio against its torch
peer, the plots, then each benchmark's report as its script printed it, with its notes.

Pure functions over what the benchmark scripts wrote (their --out markdown and --json records, read back with
bench_common.read_results); nothing here runs a benchmark or times anything.

Notes (docs/benchmark_notes/<run id>.md, e.g. dp-w2.md, tp-w4.md, offload.md) are written by hand after looking at
a run. A note's first line names the run whose figures it quotes, `<!-- run: 2026-11-21, ... -->`; text above a line
`<!-- report -->` (what the benchmark does: run-independent) goes before the report, the rest after it. A note
naming another run than the one being written is labelled as such, so that its figures are not taken for this
run's.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from engine.estimate.report import markdown_table

REPORT_MARKER = "<!-- report -->"
RUN_LINE = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->\s*$")


@dataclass
class Run:
    """One benchmark script's run: what bench_all started and what the script wrote."""
    id: str                      # "zero1-w2": the benchmark's name, and its world size where it takes --world
    title: str                   # the section heading
    world: int | None            # --world given to the script (None: the script's fixed layout)
    command: str                 # as one would type it (without bench_all's --out/--json)
    seconds: float               # wall time of the script
    returncode: int
    report: str | None = None    # its --out markdown
    records: list[dict] = field(default_factory=list)  # its --json records

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.report is not None


@dataclass
class Note:
    run: str | None   # the run whose figures the note quotes (its `<!-- run: ... -->` line), None when not given
    before: str       # placed before the report
    after: str        # placed after it


def parse_note(text: str) -> Note:
    lines = text.strip("\n").split("\n")
    run = None
    if lines and RUN_LINE.match(lines[0]):
        run = RUN_LINE.match(lines[0]).group(1)
        lines = lines[1:]
    body = "\n".join(lines)
    if REPORT_MARKER in body:
        before, after = body.split(REPORT_MARKER, 1)
    else:
        before, after = "", body
    return Note(run, before.strip("\n"), after.strip("\n"))


def read_note(notes_dir: str | None, run_id: str) -> Note | None:
    path = os.path.join(notes_dir, f"{run_id}.md") if notes_dir else None
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        return parse_note(f.read())


# ---- the summary ------------------------------------------------------------------------------------
def met(record: dict) -> bool | None:
    """Whether a compared record meets its target (None: no ratio, no target, or a ratio that is not a number)."""
    ratio, target = record.get("ratio"), record.get("target")
    if ratio is None or target is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return None
    return ratio >= target if record.get("better") == "higher" else ratio <= target


def target_text(record: dict) -> str:
    if record.get("target") is None:
        return "—"
    value = f"{record['target']:g}"
    return f"{'≥' if record.get('better') == 'higher' else '≤'} {value if '.' in value else value + '.0'}"


def ratio_text(ratio) -> str:
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return "n/a"
    return f"{ratio:.3f}"


MET_TEXT = {True: "yes", False: "**no**", None: "—"}


def summary_rows(runs: list[Run]) -> list[list[str]]:
    """One row per compared system (role "ours" with a ratio), in run order."""
    rows = []
    for run in runs:
        for r in run.records:
            if r.get("role") == "ours" and r.get("ratio") is not None:
                rows.append([run.id, r["system"], r.get("peer") or "—", str(r["world"]), r.get("metric", ""),
                             ratio_text(r["ratio"]), target_text(r), MET_TEXT[met(r)]])
    return rows


def summary(runs: list[Run]) -> str:
    rows = summary_rows(runs)
    text = markdown_table(["run", "system", "peer", "world", "metric", "ratio", "target", "met?"], rows) if rows else \
        "No ratios: no benchmark finished."
    failed = [f"{r.id} (exit {r.returncode})" for r in runs if not r.ok]
    if failed:
        text += "\n\nFailed, no figures: " + ", ".join(failed) + " (their output is in the log of the run)."
    return text


# ---- the document -----------------------------------------------------------------------------------
INTRO = ("Each capability is timed against torch's own implementation in the same run. Ratios are ours ÷ torch's "
         "on the metric named (target ≤ 1.0 unless stated; for bandwidths and hiding, ≥). Benchmarks are scripts, "
         "never timed assertions in tests. This file is written by `scripts/bench_all.py`; the notes after each "
         "report are kept in `docs/benchmark_notes/<run>.md` and written by hand.")

QUICK_BANNER = ("> **Quick run** (`--quick`): tiny models, one round, a few steps. These figures only show that every "
                "benchmark runs end to end; they are **not measurements** and say nothing about the targets.")


def section(run: Run, note: Note | None, this_run: str) -> str:
    heading = f"## {run.title}" + (f" ({run.world} ranks)" if run.world else "")
    parts = [heading, f"Run `{run.id}`: `{run.command}` ({run.seconds:.0f} s)."]
    if note and note.before:
        parts.append(note.before)
    if run.ok:
        parts.append(run.report.strip("\n"))
    else:
        parts.append(f"**Failed** (exit {run.returncode}): no report. Run the command above alone to see why.")
    if note and note.after:
        if note.run != this_run:
            written = f"an earlier run ({note.run})" if note.run else "an earlier run (not named)"
            parts.append(f"*Notes written for {written}: the figures they quote are that run's, not the tables "
                         "above.*")
        parts.append(note.after)
    return "\n\n".join(parts)


def render(runs: list[Run], *, this_run: str, command: str, machine: str, quick: bool, plots: list[tuple[str, str]],
           plots_skipped: str | None, notes_dir: str | None, total_s: float) -> str:
    """The whole markdown document. `this_run`: the run's name (its start time), matched against the notes' run lines;
    `plots`: (title, path relative to the document) of each image; `plots_skipped`: why there are none."""
    head = ["# Benchmarks" + (" (quick run: not measurements)" if quick else ""), INTRO]
    if quick:
        head.append(QUICK_BANNER)
    head.append(f"Machine: {machine}\n\nRun: {this_run}, `{command}` ({total_s / 60:.1f} minutes in all; "
                "each benchmark alone, one after another).")
    body = ["## Summary" + (" (quick run)" if quick else "")]
    if quick:
        body.append("Quick figures: the ratios and the met? column only show that the report is written.")
    body.append(summary(runs))
    body.append("## Plots" + (" (quick run)" if quick else ""))
    if plots:
        body.append("Each benchmark has its own model and batch shape (see its report): compare tiers with its peer "
                    "within a group, not groups with each other.")
        body += [f"![{title}]({path})" for title, path in plots]
    else:
        body.append(plots_skipped or "No plots: no training benchmark finished.")
    sections = [section(r, read_note(notes_dir, r.id), this_run) for r in runs]
    return "\n\n".join(head + body + sections) + "\n"
