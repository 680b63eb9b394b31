"""The estimate as a table for people: one row per strategy, bytes per rank, what fits."""

from __future__ import annotations

import functools
from typing import Sequence

from engine.estimate.estimator import Estimate
from offload.units import fmt_bytes

# bytes in the estimate's tables: powers of 1000 (as budgets are given: "8GB") with two decimals, e.g. '0.86 GB'
human_bytes = functools.partial(fmt_bytes, si=True, digits=2)


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are str()-ed, columns padded for reading in a terminal."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def format_estimate(est: Estimate) -> str:
    """A markdown table of every strategy's per-rank bytes, then which strategies fit and the largest model."""
    device = "device (CPU)" if est.compute_on_cpu else "device"
    headers = ["strategy", "param", "grad", "optim", f"{device} states", "cpu states", "nvme", "activations",
               f"{device} peak", "host peak", "fits", "largest model"]
    rows = []
    for r in est.rows:
        largest = est.largest_params(r)
        rows.append([r.strategy.name, human_bytes(r.states.param), human_bytes(r.states.grad),
                     human_bytes(r.states.optim), human_bytes(r.states.tiers.device), human_bytes(r.states.tiers.cpu),
                     human_bytes(r.nvme), human_bytes(r.activations), human_bytes(r.device_peak),
                     human_bytes(r.host_peak), "yes" if r.fits else "no: " + "; ".join(r.misfits),
                     "—" if largest is None else human_count(largest)])
    budget = ", ".join(f"{tier} {human_bytes(v)}" for tier, v in
                       (("device", est.budgets.device), ("cpu", est.budgets.cpu), ("nvme", est.budgets.nvme))
                       if v is not None) or "none given"
    head = (f"Model: {human_count(est.params)} parameters ({est.params:,}); world {est.world}; micro batch "
            f"{est.micro_batch} x {est.seq_len} tokens; bytes per rank; budgets per rank: {budget}.")
    notes = [f"host peak = the runtime ({human_bytes(est.rows[0].runtime) if est.rows else '?'}, measured) + CPU "
             "states" + (" + the device peak (the compute device is the CPU)" if est.compute_on_cpu else "") + "."]
    fitting = est.fitting()
    if est.budgets != type(est.budgets)():
        if fitting:
            notes.append(f"Fits: {', '.join(r.strategy.name for r in fitting)}.")
            scaled = [r for r in fitting if r.largest_factor is not None]
            if scaled:
                best = max(scaled, key=lambda r: r.largest_factor)
                notes.append(f"Largest model that fits: ~{human_count(est.largest_params(best))} parameters with "
                             f"{best.strategy.name} (model states scaled with the parameter count, activations and "
                             "runtime held at this model's).")
        else:
            notes.append("Nothing fits the budgets: raise them, add ranks or NVMe, or shrink the micro batch.")
    return "\n".join([head, "", markdown_table(headers, rows), "", *notes])
