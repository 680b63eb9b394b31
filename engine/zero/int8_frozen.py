"""Frozen weights kept as int8 with one scale per row, dequantized into the compute dtype when gathered.

Note [int8 frozen chunks]
With `zero_optimization.quantize_frozen: "int8"` (stage 3) the frozen weights of `nn.Linear` modules (a fine-tune's
base: PEFT's `base_layer`s, the frozen `lm_head`) live in frozen chunks of their own whose per-rank shards hold
int8 values, half the bytes of bf16 on every tier (device shards, CPU, NVMe), and one fp32 scale per output row
(per channel). The arithmetic is torchao's int8 weight-only recipe (`Int8Tensor.from_hp(w, PerRow())`: symmetric,
scale = max|row| / 127.5 with fp32 eps, round to nearest, clamp to [-128, 127]) through its own primitives
(`choose_qparams_affine`, `quantize_affine`, `dequantize_affine`), which run on CPU and CUDA; so the model trains
on `int8_image(w)`: the weights `Int8Tensor.from_hp(w, PerRow()).dequantize()` gives, in the compute dtype
(tests/test_int8_frozen.py compares against plain PEFT on `int8_image` of the base). Rows are quantized a block at
a time, and a gather dequantizes in place (torchao's arithmetic: the int8 value times its fp32 scale, rounded once),
so neither holds more than a block's temporaries.
- Rows are quantized whole, per parameter, before sharding: a shard boundary may split a row, so the scales are
  not sharded but kept whole on every rank, on the device (4 bytes per row: 5 MB for a 7 B Llama).
- The chunk's payload (the parameters' views) keeps the compute dtype and exists only while gathered, as any
  stage-3 payload. A gather all-gathers the int8 shards into an int8 buffer and, once waited for, dequantizes it
  into the payload and frees the buffer; a release frees the payload. So the quantized chunks are always gathered
  around their use: stage 3, and with one rank the paging layout (Note [paging in one process]) even without
  offload_param.
- Values arrive whole (the runtime's start, a `load` under zero_init, a checkpoint) and every rank quantizes them
  the same way; or, streamed from files (Note [streamed weights]), each rank reads the rows its elements touch,
  quantizes those rows, keeps its elements, and the ranks' scales are joined by an all-reduce (max) once loading
  ends.
- A checkpoint of an int8 run holds the dequantized weights, and loading them back gives the same weights: per row,
  a scale whose int8 image reproduces the row exactly is taken where one does — first the row's own scale (an engine
  built from the same pretrained weights: always), then torchao's, max|row| / 127 or / 128 (in fp32 these recover
  any int8 image; in bf16 not always) — otherwise torchao's, and the load warns how many rows changed. An edit
  inside `gathered_parameters(modifier_rank=...)` re-quantizes the chunk the same way, so rows it left alone stay.
Other frozen parameters (embeddings not tied to a linear weight, norms, biases) stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from offload.chunk import Slot

QMIN, QMAX = -128, 127
ROW_BLOCK_ELEMENTS = 1 << 22  # rows quantized together: bounds the fp32 temporaries of one step (~16 B / element)


def import_primitives():
    """torchao's affine quantization primitives, imported on first use (torchao is imported only by runs that
    quantize)."""
    try:
        from torchao.quantization.quant_primitives import (
            MappingType,
            choose_qparams_affine,
            dequantize_affine,
            quantize_affine,
        )
    except ImportError as error:
        raise ImportError("zero_optimization.quantize_frozen: \"int8\" uses torchao's quantization primitives; "
                          "install it (pip install 'tiers[hf]' or pip install torchao), or set quantize_frozen "
                          "to \"none\"") from error
    return MappingType, choose_qparams_affine, quantize_affine, dequantize_affine


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """torchao's per-row symmetric int8 scales of a 2-D tensor, fp32, shape (rows, 1)."""
    mapping, choose, _, _ = import_primitives()
    scale, _ = choose(rows, mapping.SYMMETRIC, (1, rows.shape[1]), torch.int8, QMIN, QMAX,
                      eps=torch.finfo(torch.float32).eps, scale_dtype=torch.float32, zero_point_dtype=torch.int8,
                      keepdim=True)
    return scale


def quantize_rows(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 values of a 2-D tensor at the given per-row scales."""
    _, _, quantize, _ = import_primitives()
    zero = torch.zeros_like(scales, dtype=torch.int8)
    return quantize(rows, (1, rows.shape[1]), scales, zero, torch.int8, QMIN, QMAX)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights int8 rows stand for, in `dtype`."""
    _, _, _, dequantize = import_primitives()
    return dequantize(q, (1, q.shape[1]), scales, None, torch.int8, output_dtype=dtype)


def int8_image(weight: torch.Tensor) -> torch.Tensor:
    """What a weight trains as in an int8 frozen chunk: its per-row int8 quantization, dequantized to its dtype."""
    rows = weight.detach().reshape(weight.shape[0], -1)
    scales = row_scales(rows)
    return dequantize_rows(quantize_rows(rows, scales), scales, weight.dtype).view(weight.shape)


def exact_scales(rows: torch.Tensor, held: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Per-row scales for `rows`: torchao's; with `held` (the scales the rows have: 0 where none), the first of
    held, torchao's, max|row| / 127 and max|row| / 128 whose int8 image reproduces a row exactly (the row is an int8
    image already), else torchao's. Returns them and how many rows that held a scale none reproduced."""
    recipe = row_scales(rows)
    if held is None:
        return recipe, 0
    peak = rows.float().abs().amax(dim=1, keepdim=True)
    held = held.to(recipe.device)
    chosen, settled = recipe.clone(), torch.zeros_like(peak, dtype=torch.bool)
    for scales in (held, recipe, peak / QMAX, peak / -QMIN):
        scales = torch.where(scales > 0, scales, recipe)
        exact = (dequantize_rows(quantize_rows(rows, scales), scales, rows.dtype) == rows).all(dim=1, keepdim=True)
        chosen = torch.where(exact & ~settled, scales, chosen)
        settled |= exact
    return chosen, int((~settled & (held > 0)).sum())


@dataclass(frozen=True)
class QuantizedMember:
    """One weight in an int8 chunk: where its elements start in the chunk, its rows and their first scale."""

    offset: int
    rows: int
    cols: int
    first_row: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def row_blocks(self, row_lo: int, row_hi: int):
        """Rows [row_lo, row_hi) as (first, end) blocks of about ROW_BLOCK_ELEMENTS: what bounds the temporaries."""
        step = max(1, ROW_BLOCK_ELEMENTS // self.cols)
        for r0 in range(row_lo, row_hi, step):
            yield r0, min(r0 + step, row_hi)


class Int8Rows:
    """An int8 frozen chunk's layout and scales (Note [int8 frozen chunks])."""

    def __init__(self, slots: list[Slot], device: torch.device, compute_dtype: torch.dtype, numel: int):
        self.members: list[QuantizedMember] = []
        first = 0
        for slot in slots:
            rows = slot.shape[0] if len(slot.shape) else 1
            self.members.append(QuantizedMember(slot.offset, rows, slot.numel // max(rows, 1), first))
            first += rows
        self.scales = torch.zeros(first, 1, dtype=torch.float32, device=device)  # whole on every rank
        self.compute_dtype, self.numel = compute_dtype, numel
        self.gathering: torch.Tensor | None = None  # the int8 buffer an all-gather in flight fills
        self.requantized_rows = 0  # rows that held values and were loaded again with values no scale reproduced

    @property
    def nbytes(self) -> int:
        """Bytes of the scales (the int8 shards are counted as shards)."""
        return self.scales.numel() * self.scales.element_size()

    def quantize_chunk(self, payload: torch.Tensor, keep_scales: bool) -> torch.Tensor:
        """The whole chunk's values (compute dtype, full payload, the same on every rank) as int8, every member
        quantized by rows, scales set (keep_scales: a row's own scale first, so that rows left as they were keep
        their values); padding 0."""
        q = torch.zeros(self.numel, dtype=torch.int8, device=payload.device)
        for m in self.members:
            values = payload.narrow(0, m.offset, m.numel)
            self._quantize(m, lambda lo, hi, v=values: v[lo:hi], 0, m.rows, q.narrow(0, m.offset, m.numel), 0,
                           keep_scales)
        return q

    def dequantize_chunk(self, q: torch.Tensor, payload: torch.Tensor) -> None:
        """The gathered int8 chunk into the compute-dtype payload (through its writer: Note [sharded parameters]), in
        place: torchao's dequantize_affine arithmetic (the int8 value times its fp32 scale, rounded once to the
        compute dtype) without its temporaries."""
        for m in self.members:
            for r0, r1 in m.row_blocks(0, m.rows):  # the mixed-dtype product's fp32 buffer: a block's
                view = payload.narrow(0, m.offset + r0 * m.cols, (r1 - r0) * m.cols).view(r1 - r0, m.cols)
                view.copy_(q.narrow(0, m.offset + r0 * m.cols, (r1 - r0) * m.cols).view(r1 - r0, m.cols))
                view.mul_(self.scales.narrow(0, m.first_row + r0, r1 - r0))
        used = max((m.offset + m.numel for m in self.members), default=0)
        payload.narrow(0, used, payload.numel() - used).zero_()

    def member_at(self, offset: int) -> QuantizedMember:
        return next(m for m in self.members if m.offset == offset)

    def fill(self, offset: int, values, target: torch.Tensor | None, first: int, whole: bool,
             keep_scales: bool) -> int:
        """Elements [first, first + target.numel()) of the member at chunk offset `offset`, quantized, into the int8
        `target` (None: this rank keeps none of them). values(lo, hi): elements [lo, hi) of the member's flattened
        values (compute dtype or wider). Reads the whole rows the target touches, or with `whole` every row, and
        sets those rows' scales (keep_scales: a row's own scale first, for values that were its int8 image);
        returns the elements read."""
        m = self.member_at(offset)
        n = 0 if target is None else target.numel()
        row_lo, row_hi = (0, m.rows) if whole else (first // m.cols, -(-(first + n) // m.cols))
        self._quantize(m, values, row_lo, row_hi, target, first, keep_scales)
        return (row_hi - row_lo) * m.cols

    def _quantize(self, m: QuantizedMember, values, row_lo: int, row_hi: int, into: torch.Tensor | None,
                  first: int, keep_scales: bool) -> None:
        """Rows [row_lo, row_hi) of member `m` quantized, a block of rows at a time (bounding the temporaries); their
        scales set; the int8 values of member elements [first, first + into.numel()) into `into`."""
        n = 0 if into is None else into.numel()
        for r0, r1 in m.row_blocks(row_lo, row_hi):
            rows = values(r0 * m.cols, r1 * m.cols).to(self.compute_dtype).view(r1 - r0, m.cols)
            held = self.scales.narrow(0, m.first_row + r0, r1 - r0)
            scales, requantized = exact_scales(rows, held if keep_scales else None)
            self.requantized_rows += requantized
            held.copy_(scales)
            lo, hi = max(r0 * m.cols, first), min(r1 * m.cols, first + n)
            if lo < hi:
                q = quantize_rows(rows, scales).view(-1)
                into.narrow(0, lo - first, hi - lo).copy_(q.narrow(0, lo - r0 * m.cols, hi - lo))

    def join_scales(self, group: dist.ProcessGroup | None) -> None:
        """After a streamed load: every rank set the scales of the rows it read (others are 0); all take them all."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(self.scales, op=dist.ReduceOp.MAX, group=group)
