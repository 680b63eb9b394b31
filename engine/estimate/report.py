"""The estimate as a table for people: one row per strategy, bytes per rank, what fits."""

from __future__ import annotations

import functools
from typing import Sequence

from engine.estimate.estimator import Estimate, StrategyEstimate
from engine.estimate.pipeline_stages import PipelineEstimate
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


def bubble_cell(pipeline: PipelineEstimate | None) -> str:
    """The idle fraction of a pipelined step, flagged when there are fewer micro-batches than stages."""
    if pipeline is None:
        return "—"
    starved = f", only {pipeline.microbatches} < {pipeline.stages} stages!" if pipeline.starved else ""
    return f"{pipeline.bubble:.1%} (m={pipeline.microbatches}{starved})"


def pipeline_note(r: StrategyEstimate) -> str:
    """One line on a pipelined row (Note [estimating a pipeline]): the bubble, what is in flight, the step."""
    p = r.pipeline
    stages = ", ".join(human_count(n) for n in p.stage_params)
    line = (f"{r.strategy.name}: m = {p.microbatches} micro-batch(es) per step (gradient_accumulation_steps), bubble "
            f"{p.bubble:.1%}; the row is pipeline rank {p.rank}, which holds {p.in_flight[p.rank]} micro-batch "
            f"stage(s) of activations at once (ranks: {', '.join(map(str, p.in_flight))}); stage parameters "
            f"{stages}; a step's compute ≈ {p.compute_factor:.2f}x one unpipelined replica's, plus "
            f"{human_bytes(p.p2p_bytes)} point-to-point per rank.")
    return line + (" " + starved_advice(p) if p.starved else "")


def starved_advice(p: PipelineEstimate) -> str:
    """What a pipeline with fewer micro-batches than stages costs, and the gradient_accumulation_steps to set."""
    return (f"gradient_accumulation_steps gives {p.microbatches} micro-batch(es) per step for {p.stages} pipeline "
            f"stages, so {p.bubble:.0%} of the step idles; set it to {4 * p.stages} or more (1F1B's bubble is then "
            f"at most {(p.stages - 1) / (5 * p.stages - 1):.0%}).")


def format_estimate(est: Estimate) -> str:
    """A markdown table of every strategy's per-rank bytes, then which strategies fit and the largest model."""
    device = "device (CPU)" if est.compute_on_cpu else "device"
    pipelined = any(r.pipeline is not None for r in est.rows)
    headers = ["strategy", "param", "grad", "optim", f"{device} states", "cpu states", "disk peak", "activations",
               f"{device} peak", "host peak", "fits", "largest model"] + (["bubble"] if pipelined else [])
    rows = []
    for r in est.rows:
        largest = est.largest_params(r)
        rows.append([r.strategy.name, human_bytes(r.states.param), human_bytes(r.states.grad),
                     human_bytes(r.states.optim), human_bytes(r.states.tiers.device), human_bytes(r.states.tiers.cpu),
                     human_bytes(r.disk_peak), human_bytes(r.activations), human_bytes(r.device_peak),
                     human_bytes(r.host_peak), "yes" if r.fits else "no: " + "; ".join(r.misfits),
                     "—" if largest is None else human_count(largest)]
                    + ([bubble_cell(r.pipeline)] if pipelined else []))
    budget = ", ".join(f"{tier} {human_bytes(v)}" for tier, v in
                       (("device", est.budgets.device), ("cpu", est.budgets.cpu), ("nvme", est.budgets.nvme))
                       if v is not None) or "none given"
    head = (f"Model: {human_count(est.params)} parameters ({est.params:,}); world {est.world}; micro batch "
            f"{est.micro_batch} x {est.seq_len} tokens; bytes per rank; budgets per rank: {budget}.")
    notes = [f"host peak = the runtime ({human_bytes(est.rows[0].runtime) if est.rows else '?'}, measured) + CPU "
             "states" + (" + the device peak (the compute device is the CPU)" if est.compute_on_cpu else "") + "."]
    seen = set()
    for r in est.rows:  # one line per pipeline shape (the ZeRO stage and offload do not change it)
        if r.pipeline is not None and (r.strategy.tp, r.pipeline.stages, r.pipeline.schedule) not in seen:
            seen.add((r.strategy.tp, r.pipeline.stages, r.pipeline.schedule))
            notes.append(pipeline_note(r))
    frozen = [r for r in est.rows if r.states.frozen]
    if frozen:
        notes.append("param includes the frozen parameters (no gradient or optimizer state; sharded and offloaded as "
                     "parameters are): " + ", ".join(f"{r.strategy.name} {human_bytes(r.states.frozen)}"
                                                      for r in frozen[:3]) + (", ..." if len(frozen) > 3 else "") +
                     ". Pipelined rows count the trainable parameters only.")
    notes += [f"Not estimated: {reason}" for reason in est.skipped]
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
