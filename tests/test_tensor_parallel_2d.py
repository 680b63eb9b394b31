"""2D tensor parallelism (Note [2D tensor parallelism]) piece by piece on a 2×2 mesh: each layer against the
whole torch module on the whole batch (outputs and parameter gradients), the batch-split loss, a user plan
with it, dropout streams, and the errors 2D plans give. The whole models are in test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import initialize
from engine.mesh import Mesh
from engine.tensor_parallel import Mesh2D, TPGroup, apply_tensor_parallel, cross_entropy_2d
from engine.tensor_parallel.layers_2d import Classifier2D, Embedding2D, Linear2D, Norm2D
from engine.topology import start_mesh
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
)
from tests.test_data_parallel import adamw
from tests.test_tensor_parallel import GLOBAL_BATCH, STEPS, TP_RTOL, tp_config
from tests.test_tensor_parallel_derived import DerivedGPT2
from tests.tp_models import user_gpt

Q = 2


def mesh_of(mesh: Mesh) -> Mesh2D:
    whole = TPGroup(mesh.tp.group, mesh.tp.size, mesh.tp.rank)
    return Mesh2D.of(whole, mesh.tp_row.group, mesh.tp_col.group)


def block(t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """Block [batch block r, ..., hidden block c] of an activation."""
    return t.chunk(Q, dim=0)[r].chunk(Q, dim=-1)[c]


class Conv1D(nn.Module):
    """Hugging Face's Conv1D layout (weight [in, out]); only its class name matters to the plans."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.2)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.2)

    def forward(self, x):
        return x @ self.weight + self.bias


def whole_layers() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    norm = nn.LayerNorm(8)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    rms = nn.RMSNorm(8, eps=1e-6)
    nn.init.normal_(rms.weight)
    return {"linear": nn.Linear(8, 12), "qkv": Conv1D(8, 24), "layernorm": norm, "rmsnorm": rms,
            "embedding": nn.Embedding(10, 8), "classifier": nn.Linear(8, 10, bias=False)}


def layer_2d(kind: str, whole: nn.Module, mesh: Mesh2D) -> nn.Module:
    if kind == "linear":
        return Linear2D.from_module(whole, mesh, kind, transposed=False)
    if kind == "qkv":
        return Linear2D.from_module(whole, mesh, kind, transposed=True, parts=3)
    if kind in ("layernorm", "rmsnorm"):
        return Norm2D.from_module(whole, mesh, kind)
    if kind == "embedding":
        return Embedding2D.from_module(whole, mesh, kind)
    return Classifier2D.from_module(whole, mesh, kind, transposed=False, gather_batch=False)


def inputs(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "embedding":
        return torch.randint(0, 10, (4, 3), generator=g)
    return torch.randn(4, 3, 8, generator=g)


def out_block(kind: str, t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """A rank's block of a layer's whole output: the classifier's is batch block r with every class; a fused
    q/k/v projection's hidden block c is block c of each of q, k and v."""
    rows = t.chunk(Q, dim=0)[r]
    if kind == "classifier":
        return rows
    if kind == "qkv":
        return torch.cat([part.chunk(Q, dim=-1)[c] for part in rows.chunk(3, dim=-1)], dim=-1)
    return rows.chunk(Q, dim=-1)[c]


def output_grad(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


def _mesh_cases_worker(rank, world):
    """Every multi-process case of this file in one 2×2 group: start-up, not the cases, dominates their time."""
    cases = {"layers": _layers_worker, "autocast": _autocast_worker, "attention_mask": _attention_mask_worker,
             "derived": _derived_worker, "cross_entropy": _cross_entropy_worker, "user_plan": _user_plan_worker,
             "dropout": _dropout_worker}
    results = {}
    for name, worker in cases.items():
        try:
            results[name] = worker(rank, world)
        except Exception as e:
            raise RuntimeError(f"case {name!r} failed on rank {rank}") from e
    return results


@pytest.fixture(scope="module")
def mesh_results() -> dict[str, list]:
    """Each case's results in rank order, from one spawned group shared by the tests below."""
    per_rank = run_distributed(_mesh_cases_worker, Q * Q, timeout_s=300)
    return {name: [rank_results[name] for rank_results in per_rank] for name in per_rank[0]}


def _layers_worker(rank, world):
    mesh = mesh_of(start_mesh(torch.device("cpu"), tp_size=world, tp_mode="2d"))
    out = {}
    for kind, whole in whole_layers().items():
        layer = layer_2d(kind, whole, mesh)
        x = inputs(kind)
        # token ids arrive cut to the batch block (Note [2D batch inputs])
        mine = x.chunk(Q, dim=0)[mesh.r] if kind == "embedding" else block(x, mesh.r, mesh.c).clone().requires_grad_()
        y = layer(mine)
        with torch.no_grad():
            grad_y = out_block(kind, output_grad(whole(x).shape), mesh.r, mesh.c)
        y.backward(grad_y)
        out[kind] = (y.detach(), None if kind == "embedding" else mine.grad,
                     {n: (p.grad, getattr(layer, f"{n}_spec")) for n, p in layer.named_parameters()})
    return out


def test_each_2d_layer_computes_the_whole_layer_and_its_gradients(mesh_results):
    results = mesh_results["layers"]
    for kind, whole in whole_layers().items():
        x = inputs(kind)
        if kind != "embedding":
            x.requires_grad_()
        y = whole(x)
        y.backward(output_grad(y.shape))
        for rank, result in enumerate(results):
            y_mine, grad_x_mine, _ = result[kind]
            r, c = divmod(rank, Q)
            torch.testing.assert_close(y_mine, out_block(kind, y.detach(), r, c), rtol=1e-5, atol=1e-6,
                                       msg=f"{kind} output at {(r, c)}")
            if grad_x_mine is not None:
                torch.testing.assert_close(grad_x_mine, block(x.grad, r, c), rtol=1e-5, atol=1e-6,
                                           msg=f"{kind} input gradient at {(r, c)}")
        for name, p in whole.named_parameters():
            spec = results[0][kind][2][name][1]
            joined = spec.join([result[kind][2][name][0] for result in results])
            torch.testing.assert_close(joined, p.grad, rtol=1e-5, atol=1e-6, msg=f"{kind}.{name} gradient")


def _autocast_worker(rank, world):
    """fp32 weights and inputs under bf16 autocast, as the engine runs bf16: SUMMA casts both as F.linear does."""
    mesh = mesh_of(start_mesh(torch.device("cpu"), tp_size=world, tp_mode="2d"))
    out = {}
    for kind in ("linear", "qkv"):
        whole = whole_layers()[kind]
        layer = layer_2d(kind, whole, mesh)
        mine = block(inputs(kind), mesh.r, mesh.c).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(mine)
        y.backward(torch.ones_like(y))
        out[kind] = (y.dtype, mine.grad.dtype, layer.weight.grad.dtype, y.detach().float())
    return out


def test_summa_under_bf16_autocast_computes_in_bf16_and_returns_fp32_gradients(mesh_results):
    results = mesh_results["autocast"]
    for kind in ("linear", "qkv"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = whole_layers()[kind](inputs(kind))
        for rank, result in enumerate(results):
            assert result[kind][:3] == (torch.bfloat16, torch.float32, torch.float32)
            r, c = divmod(rank, Q)
            torch.testing.assert_close(result[kind][3], out_block(kind, y.float(), r, c), rtol=2e-2, atol=2e-2)


def _padding_mask(x: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(x)
    mask[::2, -5:] = 0  # every batch block holds padded and unpadded samples
    return mask


MASKED = {  # model -> its loss with a padding mask; Llama also with per-sample positions [batch, seq] from it
    "gpt2": lambda m, x: m(input_ids=x, labels=x, attention_mask=_padding_mask(x), use_cache=False).loss,
    "llama": lambda m, x: m(input_ids=x, labels=x, attention_mask=_padding_mask(x), use_cache=False,
                            position_ids=(_padding_mask(x).cumsum(-1) - 1).clamp(min=0)).loss,
}


def _attention_mask_worker(rank, world):
    from tests.test_tensor_parallel import build
    out = {}
    for model, loss_fn in MASKED.items():
        engine = initialize(build(model, seed=rank), tp_config(world, 1, mode="2d"))
        x = token_batches(1, GLOBAL_BATCH)[0]
        refused = []
        for bad in ({"attention_mask": torch.ones(1, x.shape[1], dtype=torch.long)},
                    {"position_ids": torch.arange(x.shape[1]).expand(GLOBAL_BATCH // Q, -1)},
                    {"inputs_embeds": torch.zeros(GLOBAL_BATCH, x.shape[1], 64), "input_ids": None}):
            with pytest.raises(ValueError) as error:
                engine(**{"input_ids": x, "labels": x, **bad})
            refused.append(str(error.value))
        losses = _train_steps(engine, loss_fn)
        out[model] = (losses, engine.full_state_dict(), refused)
        engine.close()
    return out


@pytest.mark.parametrize("model", list(MASKED))
def test_2d_cuts_a_padding_mask_and_positions_to_the_batch_block_and_trains_like_one_process(mesh_results, model):
    """HF GPT-2 and Llama with a padding attention_mask (Llama also with position_ids [batch, seq]) on a 2×2 mesh
    against plain PyTorch with the same inputs; inputs that cannot be cut to the same samples are refused."""
    from tests.test_tensor_parallel import build
    reference = build(model)
    ref_losses, _ = train_reference(reference, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0,
                                    loss_fn=MASKED[model])
    params = param_snapshot(reference)
    for per_rank in mesh_results["attention_mask"]:
        losses, full, refused = per_rank[model]
        assert_close_relative(losses, ref_losses, rtol=TP_RTOL)
        assert_params_close({k: full[k] for k in params}, params, rtol=TP_RTOL)
        assert "attention_mask of shape [1, 32] does not have the batch of the token ids input_ids (8)" in refused[0]
        assert "position_ids of shape [4, 32] does not have the batch of the token ids input_ids (8)" in refused[1]
        assert "inputs_embeds is given: it cannot be split into the 2D blocks" in refused[2]


DERIVED_2D = {  # models no built-in plan knows: plan "auto" derives a 2D one (Note [derived 2D plans])
    "user_gpt": (user_gpt, lambda m, x: m(x, x)),
    "gpt2": (DerivedGPT2.build, MASKED["gpt2"]),  # with the padding mask
}


def _derived_worker(rank, world):
    out = {}
    for name, (make, loss_fn) in DERIVED_2D.items():
        engine = initialize(make(rank), tp_config(world, 1, mode="2d"))  # ranks seeded differently: made to agree
        assert engine.tensor_parallel.mesh is not None, name
        losses = _train_steps(engine, loss_fn)
        out[name] = (losses, engine.full_state_dict(), sum(p.numel() for p in engine.module.parameters()))
        engine.close()
    return out


@pytest.mark.parametrize("model", list(DERIVED_2D))
def test_a_derived_2d_plan_trains_a_model_without_a_built_in_plan_like_one_process(mesh_results, model):
    """A user GPT (fused qkv, tied head, loss in its forward) and HF GPT-2 under another class name (with a
    padding mask) at plan "auto" on a 2×2 mesh against plain PyTorch; every rank holds exactly a quarter."""
    make, loss_fn = DERIVED_2D[model]
    reference = make(0)
    whole = sum(p.numel() for p in reference.parameters())
    ref_losses, _ = train_reference(reference, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0, loss_fn=loss_fn)
    params = param_snapshot(reference)
    for per_rank in mesh_results["derived"]:
        losses, full, local_numel = per_rank[model]
        assert_close_relative(losses, ref_losses, rtol=TP_RTOL)
        assert_params_close({k: full[k] for k in params}, params, rtol=TP_RTOL)
        assert local_numel * Q * Q == whole


# --- the loss over the batch split ---------------------------------------------------------------


def _cross_entropy_worker(rank, world):
    mesh = mesh_of(start_mesh(torch.device("cpu"), tp_size=world, tp_mode="2d"))
    logits, target = ce_inputs()
    mine = logits.chunk(Q, dim=0)[mesh.r].clone().requires_grad_()  # whole vocabulary, batch block r
    loss = cross_entropy_2d(mine, target, mesh)
    loss.backward()
    return loss.item(), mine.grad


def ce_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 16, generator=g) * 3
    target = torch.randint(0, 16, (4, 5), generator=g)
    target[0, :4] = -100  # batch block 0 counts 6 targets, block 1 counts 10: a mean of block means would be wrong
    return logits, target


def test_the_2d_loss_is_the_mean_over_the_whole_batch_when_blocks_count_different_targets(mesh_results):
    logits, target = ce_inputs()
    logits.requires_grad_()
    expected = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), ignore_index=-100)
    expected.backward()
    for rank, (loss, grad) in enumerate(mesh_results["cross_entropy"]):
        assert abs(loss - expected.item()) <= 1e-6 * abs(expected.item())
        torch.testing.assert_close(grad, logits.grad.chunk(Q, dim=0)[rank // Q], rtol=1e-5, atol=1e-7)


GPT_2D_USER_PLAN = {"wte": "embedding_2d", "wpe": "position_embedding_2d", "*ln_*": "norm_2d",
                    "*.c_attn": "linear_2d_qkv", "*.c_*": "linear_2d", "lm_head": "classifier_2d"}


def labels_with_ignored(x: torch.Tensor) -> torch.Tensor:
    labels = x.clone()
    labels[: x.shape[0] // Q, ::3] = -100  # the first batch block ignores a third of its targets
    return labels


def _user_plan_worker(rank, world):
    cfg = tp_config(world, 1, mode="2d")
    cfg["tensor_parallel"]["plan"] = GPT_2D_USER_PLAN
    engine = initialize(tiny_gpt(seed=rank, n_head=4), cfg)  # a user plan adjusts no attributes:
    for block in engine.module.blocks:  # the example GPT reads its per-rank widths from these two
        block.attn.n_head, block.attn.n_embd = block.attn.n_head // Q, block.attn.n_embd // Q
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        logits = engine(x)  # batch block r, every class
        assert logits.shape == (GLOBAL_BATCH // Q, x.shape[1], 256)
        loss = engine.tensor_parallel.cross_entropy(logits, labels_with_ignored(x))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = engine.full_state_dict()
    engine.close()
    return losses, full


def test_a_user_2d_plan_with_the_batch_split_loss_trains_the_example_gpt(mesh_results):
    reference = tiny_gpt(n_head=4)
    ref_losses, _ = train_reference(reference, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0,
                                    loss_fn=lambda m, x: m(x, labels_with_ignored(x)))
    params = param_snapshot(reference)
    for losses, full in mesh_results["user_plan"]:
        assert_close_relative(losses, ref_losses, rtol=TP_RTOL)
        assert_params_close({k: full[k] for k in params}, params, rtol=TP_RTOL)


# --- dropout: every activation is split, so every rank draws its own masks ---------------------------


def _dropout_worker(rank, world):
    engine = initialize(tiny_gpt(seed=rank, n_head=4, dropout=0.5), tp_config(world, 1, mode="2d"))
    kept = []  # where the first block's residual dropout kept its input: this rank's mask
    engine.module.blocks[0].attn.resid_dropout.register_forward_hook(lambda m, a, out: kept.append(out != 0))
    x = token_batches(1, GLOBAL_BATCH)[0]
    engine.backward(engine(x, x))
    engine.step()
    after = torch.rand(4)  # the default stream after the step: the same on every rank
    engine.close()
    return kept[0], after


def test_2d_dropout_draws_a_different_mask_on_every_rank(mesh_results):
    results = mesh_results["dropout"]
    masks = [mask for mask, _ in results]
    assert all(0.3 < m.float().mean() < 0.7 for m in masks)
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)
    assert all(torch.equal(results[0][1], after) for _, after in results)


# --- plan errors (no communication needed: one process stands in for rank (0, 0) of a 2×2 mesh) ----

MESH = Mesh2D(Q, TPGroup(None, Q, 0), TPGroup(None, Q, 0), TPGroup(None, Q * Q, 0))


def test_2d_plans_refuse_a_layer_left_whole_and_1d_styles():
    model = tiny_gpt(n_head=4)
    before = {name: type(m) for name, m in model.named_modules()}
    plan = {k: v for k, v in GPT_2D_USER_PLAN.items() if k != "*ln_*"}
    with pytest.raises(ValueError, match=r"module 'blocks.0.ln_1' \(LayerNorm\) holds parameters but has no 2D style"):
        apply_tensor_parallel(model, plan, MESH.whole, mesh=MESH)
    assert {name: type(m) for name, m in model.named_modules()} == before  # nothing changed
    with pytest.raises(ValueError,
                       match=r"plan\['lm_head'\]: style 'colwise' is not a 2d style; choose from linear_2d"):
        apply_tensor_parallel(model, {**GPT_2D_USER_PLAN, "lm_head": "colwise"}, MESH.whole, mesh=MESH)
    with pytest.raises(ValueError,
                       match=r"\(mode \"2d\", \"2.5d\" or \"3d\"\): cannot split Sequential: '0' gets its input whole"):
        apply_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), "auto", MESH.whole, mesh=MESH)
    with pytest.raises(ValueError, match=r"style \"norm_2d\" is for nn.LayerNorm, nn.RMSNorm or a Hugging Face "
                                         r"\*RMSNorm, but 'wte' is a Embedding"):
        apply_tensor_parallel(model, {"wte": "norm_2d"}, MESH.whole, mesh=MESH)
    with pytest.raises(ValueError, match=r"lm_head: a classifier with a bias is not supported"):
        Classifier2D.from_module(nn.Linear(8, 4), MESH, "lm_head", transposed=False, gather_batch=True)
    with pytest.raises(ValueError, match=r"c_fc.weight: dimension 1 of size 7 does not split into 2 pieces for the "
                                         r"2×2 mesh"):
        Linear2D.from_module(nn.Linear(7, 8), MESH, "c_fc", transposed=False)


def test_2d_needs_the_head_counts_to_split_over_the_mesh_side():
    with pytest.raises(ValueError, match=r"blocks.0.attn.n_head = 3 does not split into 2 tensor-parallel parts"):
        apply_tensor_parallel(tiny_gpt(n_head=3, n_embd=48), "auto", MESH.whole, mesh=MESH)


def _train_steps(engine, loss_fn) -> list[float]:
    """STEPS steps of engine over the shared token batches; their losses."""
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        loss = loss_fn(engine, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class BatchSizedGPT(nn.Module):
    """A tiny model whose forward meets its per-sample activations with a tensor of the example batch's size first
    (7q) that is not per sample: `extra` "targets" (an input 2D passes whole) or "buffer"."""

    def __init__(self, extra: str):
        super().__init__()
        self.extra = extra
        self.wte, self.fc = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.ln, self.head = nn.LayerNorm(8), nn.Linear(8, 16, bias=False)
        self.register_buffer("row_scale", torch.ones(7 * Q, 1, 1))

    def forward(self, idx, targets):
        h = self.fc(self.wte(idx))
        h = h * ((targets >= 0).unsqueeze(-1).to(h.dtype) if self.extra == "targets" else self.row_scale)
        return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("extra", ["targets", "buffer"])
def test_a_derived_2d_plan_refuses_a_batch_sized_tensor_that_is_not_per_sample(extra):
    """Only the token ids, the inputs 2D cuts by name and what the forward makes are per sample (Note [derived 2D
    plans]); another input or a buffer of the batch's size is refused by the op meeting it, not cut."""
    with pytest.raises(ValueError, match=r"the forward mixes the samples of its batch.*mul combines a split tensor "
                                         r"with a whole one"):
        apply_tensor_parallel(BatchSizedGPT(extra), "auto", MESH.whole, mesh=MESH)
