"""The pieces of scripts/bench_pipeline.py that both sides share or that are torch's: the example GPT cut into
stage modules, clocks around compute actions (tiers' runner and torch's PipelineStage), torch's schedules over
those stages, and a try of torch's own splitter.

This is part of a benchmark script: it measures and never asserts on time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from engine.pipeline import Action, PipelineRunner

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble"}


# ---- the model, cut into stages -------------------------------------------------------------------------
class GPTStage(nn.Module):
    """Blocks [start, stop) of the example GPT, behind its embeddings on the first stage and before ln_f and
    lm_head on the last: the whole model's own modules, so the stages together compute GPT.forward's logits."""

    def __init__(self, model, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.ModuleDict({"wte": model.wte, "wpe": model.wpe}) if first else None
        self.blocks = nn.ModuleList(model.blocks[start:stop])
        self.head = nn.ModuleDict({"ln_f": model.ln_f, "lm_head": model.lm_head}) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed["wte"](x) + self.embed["wpe"](torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head["lm_head"](self.head["ln_f"](x))
        return x


def stage_modules(model, stages: int) -> list[GPTStage]:
    per = len(model.blocks) // stages
    return [GPTStage(model, s * per, (s + 1) * per, s == 0, s == stages - 1) for s in range(stages)]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))



# ---- clocks around compute actions ------------------------------------------------------------------------
class ComputeClock:
    """Seconds spent per kind of compute action (F, B, I, W), the sends and receives inside them taken out, and the
    actions run since the last `new_step()` (F0.3: forward of stage 0, micro-batch 3)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.log: list[str] = []
        self._kind: str | None = None

    def new_step(self) -> None:
        self.log = []

    @contextmanager
    def action(self, kind: str, stage: int, microbatch: int):
        self.log.append(f"{kind}{stage}.{microbatch}")
        outer, self._kind = self._kind, kind
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - start
            self.counts[kind] += 1
            self._kind = outer

    @contextmanager
    def communicating(self):
        """A send or receive inside an action: its time is not compute."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._kind is not None:
                self.seconds[self._kind] -= time.perf_counter() - start

    def around(self, action: Action):
        """The runner's `around` hook: clocks the action it wraps."""
        return self.action(action.kind.value, action.stage, action.microbatch)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def clocked_runner(schedule, rank: int, modules: dict[int, nn.Module], loss_fn, clock: ComputeClock) -> PipelineRunner:
    """tiers' runner over stage modules (micro-batches are (ids, labels) pairs: stage 0 takes the ids, the last
    stage's output and the labels go into loss_fn), each compute action clocked by kind and logged through the
    runner's own `around` hook: sends and receives lie outside it, as torch's lie outside its stage's compute
    methods."""
    last = schedule.stages - 1

    def stage_function(s: int, module: nn.Module):
        def run(received, microbatch):
            out = module(microbatch[0] if received is None else received)
            return loss_fn(out, microbatch[1]) if s == last else out
        return run

    return PipelineRunner(schedule, rank, {s: stage_function(s, m) for s, m in modules.items()},
                          {s: list(m.parameters()) for s, m in modules.items()}, around=clock.around)


def clocked_stage_class():
    """torch's PipelineStage with its compute methods clocked (torch waits for receives outside them)."""
    from torch.distributed.pipelining import PipelineStage

    class ClockedStage(PipelineStage):
        def __init__(self, *args, clock: ComputeClock, **kwargs):
            super().__init__(*args, **kwargs)
            self.clock = clock

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self.clock.action("F", self.stage_index, fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, full_backward: bool = True, **kwargs):
            with self.clock.action("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with self.clock.action("W", self.stage_index, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return ClockedStage


def torch_pipeline(stages: dict[int, nn.Module], count: int, schedule_name: str, m: int, clock: ComputeClock):
    """torch's schedule of the same name over this rank's stages (PipelineStage built by hand, CPU, the default
    group): a function (whole batch of ids, labels) -> the last stage's per-micro-batch losses (others: [])."""
    import torch.distributed.pipelining as pp

    stage_class = clocked_stage_class()
    torch_stages = [stage_class(module, s, count, torch.device("cpu"), clock=clock) for s, module in stages.items()]

    def loss_fn(logits, labels):  # divided by m here, as tiers does (scale_grads off: no pass over the gradients)
        start = time.perf_counter()
        loss = lm_loss(logits, labels) / m
        clock.add("F", time.perf_counter() - start)
        return loss

    kind = getattr(pp, TORCH_SCHEDULES[schedule_name])
    single = schedule_name in ("gpipe", "1f1b")  # torch's single-stage schedules take one stage, not a list
    schedule = kind(torch_stages[0] if single else torch_stages, m, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in stages, count - 1 in stages

    def step(x, y) -> list[float]:
        losses: list = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        return [loss.item() * m for loss in losses]

    return step


# ---- torch's own splitter ------------------------------------------------------------------------------------
def split_attempts() -> list[tuple[str, str]]:
    """Tries torch.distributed.pipelining.pipeline() (torch.export underneath) on the example GPT and on a small
    Hugging Face GPT-2, into 2 stages at the middle block; (what was split, the outcome) for each try."""
    from torch.distributed.pipelining import SplitPoint

    from engine.models import gpt_from_preset

    x = torch.randint(0, 256, (2, 32))
    gpt = gpt_from_preset("tiny", n_layer=4, tie_weights=False)
    tries = [("example GPT, logits", gpt, "blocks.2", {}),
             ("example GPT, loss (labels= in forward)", gpt, "blocks.2", {"labels": x})]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return [(what, split_outcome(model, x, at, SplitPoint, kwargs)) for what, model, at, kwargs in tries] + [
            ("Hugging Face GPT2LMHeadModel", "not tried: transformers is not installed")]
    for use_cache in (True, False):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                        use_cache=use_cache))
        tries.append((f"HF GPT2LMHeadModel, use_cache={use_cache}", hf, "transformer.h.2", {}))
    tries.append(("HF GPT2LMHeadModel, use_cache=False, loss (labels=)", hf, "transformer.h.2", {"labels": x}))
    return [(what, split_outcome(model, x, at, SplitPoint, kwargs)) for what, model, at, kwargs in tries]


def split_outcome(model, x, at: str, split_point, kwargs: dict) -> str:
    from torch.distributed.pipelining import pipeline

    try:
        pipe = pipeline(model, mb_args=(x,), mb_kwargs=kwargs or None, split_spec={at: split_point.BEGINNING})
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        return f"fails: `{first_line(e)}`" + (f"; cause: `{first_line(root_cause(e))}`" if root_cause(e) is not e
                                             else "")
    sizes = [sum(p.numel() for p in pipe.get_stage_module(i).parameters()) for i in range(pipe.num_stages)]
    return f"splits into {pipe.num_stages} stages of {' + '.join(f'{n:,}' for n in sizes)} parameters"


def root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"
