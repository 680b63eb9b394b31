"""The fused 8-bit update (Note [fused 8-bit update]): its prefix tables give torchao's codes, and compiled it
gives what torchao's compiled `single_param_adam` gives on the same tiles, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.optimizers.lowbit_kernel import PREFIXES, Maps, matches_torchao, prefix_table, quantize_by_table, tables

pytest.importorskip("torchao.optim")
from torchao.optim.adam import single_param_adam  # noqa: E402
from torchao.optim.quant_utils import quantize_8bit_with_qmap  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned  # noqa: E402

MAPS = {"signed": get_qmap_signed, "unsigned": get_qmap_unsigned}


@pytest.mark.parametrize("signed", MAPS)
def test_the_table_gives_torchaos_codes(signed):
    """Every fp32 pattern of each prefix where the code changes, and 2^22 random patterns (every class of value:
    normalized moments, zeros, subnormals, beyond 1, infinities, NaNs), quantize as torchao quantizes them."""
    qmap = MAPS[signed]()
    values, table = torch.tensor(qmap), prefix_table(qmap)
    assert table is not None and table.shape == (PREFIXES,)
    changing = torch.nonzero((table & 0xFFFF) != 0).flatten()
    assert 200 <= changing.numel() <= 255  # about one prefix per change of code
    low = torch.arange(PREFIXES, dtype=torch.int64)
    patterns = ((changing.long() << 16)[:, None] | low[None, :]).flatten()
    random = torch.randint(0, 1 << 32, (1 << 22,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    for sample in (patterns, random):
        x = (sample - (sample >= 1 << 31).long() * (1 << 32)).to(torch.int32).view(torch.float32)
        assert torch.equal(quantize_by_table(x, table), quantize_8bit_with_qmap(x, values))


def test_no_table_where_a_prefix_holds_two_changes():
    """A map whose neighbours lie within one prefix cannot be tabled: torchao's compiled function steps then."""
    crowded = tuple(sorted([*get_qmap_signed()[:-2], 0.5 + 2 ** -20, 0.5 + 2 ** -19]))
    assert prefix_table(crowded) is None


@pytest.mark.parametrize("dtype,decoupled", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)])
def test_compiled_it_is_torchaos_compiled_update_bit_for_bit(dtype, decoupled):
    """Three steps on one 4096-element tile with non-zero starting states, fp32 or bf16 weights and gradients
    (the bf16 ones widened first, as TiledAdam widens them), AdamW or Adam's L2 decay: the same fp32 weights (before
    any rounding to bf16), codes and scales as torchao's single_param_adam compiled as torchao compiles it, over
    OptimState8bit."""
    from engine.optimizers.lowbit_kernel import adam8bit

    n, block = 4096, 256
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(n, generator=g).to(dtype)
    states = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8), torch.rand(n // block, generator=g) / 10,
              torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8), torch.rand(n // block, generator=g) / 1e3]
    ours, theirs = [weights.clone(), *(s.clone() for s in states)], [weights.clone(), *(s.clone() for s in states)]
    torchaos = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    lr, maps = torch.tensor(2e-3), tables(torch.device("cpu"))
    for step in range(1, 4):
        grad = (torch.randn(n, generator=g) / 100).to(dtype)
        wide = ours[0].float()
        adam8bit(wide, grad.float(), torch.tensor(float(step)), tuple(ours[1:]), maps, lr, 0.9, 0.999, 0.01, 1e-8,
                 decoupled)
        moments = (OptimState8bit(theirs[1], theirs[2], maps.signed, True),
                   OptimState8bit(theirs[3], theirs[4], maps.unsigned, False))
        their_wide = theirs[0].float()
        torchaos(their_wide, grad, torch.tensor(float(step)), *moments, None, lr, 0.9, 0.999, 0.01, 1e-8, decoupled,
                 False)
        assert torch.equal(wide, their_wide), step
        ours[0].copy_(wide)
        theirs[0].copy_(their_wide)
    assert ours[0].ne(weights).any()
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)


def test_tiled_adam_steps_by_it_as_by_torchaos_compiled_update():
    """TiledAdam with `compiled`: the fused path and torchao's compiled function on the same optimizer (10 blocks in
    tiles of 4, 4 and 2 + 2 padding blocks, the scales read through their byte tensors) give the same weights and
    state bytes after three steps."""
    from engine.optimizers.blockwise_states import BlockwiseStates
    from engine.optimizers.tiled_adam import Arithmetic, TiledAdam, TiledLayout

    start = torch.randn(10 * 256, generator=torch.Generator().manual_seed(0))
    runs = []
    for fused in (True, False):
        weights = start.clone().requires_grad_()
        layout = TiledLayout(Arithmetic.TORCHAO, torch.float32, blockwise=BlockwiseStates(8, 256),
                             quantized=frozenset({id(weights)}))
        optimizer = TiledAdam([weights], layout, lr=2e-3, weight_decay=0.01, tile=1024, compiled=True)
        assert optimizer._fused  # this torchao's maps table and its arithmetic matches
        optimizer._fused = fused
        for step in range(3):
            weights.grad = torch.randn(start.shape, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        runs.append([weights.detach(), *(optimizer.state[weights][n] for n in layout.blockwise.names())])
    assert runs[0][0].ne(start).any()
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)


def test_the_self_check_finds_an_update_that_is_not_torchaos():
    """matches_torchao (run when the tables are made) tells torchao's arithmetic from another: the same update with
    the two maps exchanged is refused, so its tables would not be used."""
    maps = tables(torch.device("cpu"))
    assert matches_torchao(maps)
    assert not matches_torchao(Maps(maps.unsigned, maps.signed, maps.unsigned_table, maps.signed_table))


def test_gpu_checks_lowbit_section_runs_on_the_cpu_seam(tmp_path):
    """scripts/gpu_check.py's `lowbit` section (--simulate): it runs to the end and finds the two updates equal."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--simulate", "--only", "lowbit"], cwd=root,
                          env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    section = json.loads((tmp_path / "gpu_check.json").read_text())["lowbit"]
    assert section["bit_equal_weights_codes_scales"] == [True] * 5 and section["ns_per_element"]["ours"] > 0
