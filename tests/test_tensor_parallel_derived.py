"""Tensor-parallel plans derived from the model's forward (Note [derived tensor-parallel plans]): they agree with
the built-in plans, train models that have none exactly like single-process PyTorch (1e-4), and refuse what
they cannot split, by module."""

from __future__ import annotations

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import initialize
from engine.config import ConfigError, load_config
from engine.tensor_parallel import Mesh2D, TPGroup, apply_tensor_parallel
from engine.tensor_parallel.derive import derive_plan
from engine.tensor_parallel.derive.plan_2d import derive_plan_2d
from engine.tensor_parallel.plans import BUILT_IN, BUILT_IN_2D, resolve_plan
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    token_batches,
    train_reference,
)
from tests.test_data_parallel import adamw
from tests.test_tensor_parallel import GLOBAL_BATCH, STEPS, TP_RTOL, build, tp_config
from tests.tp_models import bert, mlp, user_gpt

# --- agreement with the built-in plans (no communication: the plans alone) ---------------------


def _built_in_style(plan, name: str) -> str:
    return next((s for glob, s in plan.styles.items() if fnmatch.fnmatchcase(name, glob)), "replicate")


@pytest.mark.parametrize("model,tp", [("gpt", 2), ("gpt", 4), ("gpt2", 2), ("gpt2", 4), ("llama", 2), ("llama8", 4)])
def test_the_derived_plan_equals_the_built_in_plan(model, tp):
    net = build(model)
    built_in = BUILT_IN[type(net).__name__]
    derived = derive_plan(net, tp)
    for name, _module in net.named_modules():
        assert derived.styles.get(name, "replicate") == _built_in_style(built_in, name), name
    # the derived adjustments are the built-in plan's, less those no forward reads (GPT-2's num_heads)
    expected = {(m, a, v) for m, a, v in built_in.adjust(net, tp)}
    got = {(net.get_submodule(name), attr, value) for name, attr, value in derived.adjustments}
    assert got <= expected and (got or not expected)


def test_the_derived_dropout_streams_equal_the_built_in_ones():
    import transformers
    net = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2,
                                                               n_head=4, attn_pdrop=0.1, resid_pdrop=0.1))
    derived = derive_plan(net.eval(), 2)  # from_pretrained gives an eval-mode model: traced as it will train
    assert set(derived.rng) == {f"transformer.h.{i}.attn{s}" for i in range(2) for s in ("", ".resid_dropout")}
    for name, stream in derived.rng.items():
        assert stream == next(s for glob, s in BUILT_IN["GPT2LMHeadModel"].rng.items()
                              if fnmatch.fnmatchcase(name, glob))


def test_models_without_a_built_in_plan_get_one():
    assert derive_plan(user_gpt(), 2).styles == {
        "tok": "vocab", "head": "colwise_gather",
        **{f"blocks.{i}.{layer}": style for i in range(2) for layer, style in (
            ("attn.qkv", "colwise_qkv"), ("attn.proj", "rowwise"), ("fc", "colwise"), ("out", "rowwise"))}}
    assert derive_plan(user_gpt(), 2).adjustments == [(f"blocks.{i}.attn", "n_embd", 32) for i in range(2)]
    assert derive_plan(mlp(), 2).styles == {"0": "colwise", "2": "rowwise", "4": "colwise_gather"}
    bert_styles = derive_plan(bert(), 2).styles
    # the MLM head holds its decoder's bias as its own parameter too: the decoder, and the word embeddings tied
    # to it, stay whole; a LayerNorm follows the head's dense layer: whole as well
    assert not {"cls.predictions.decoder", "bert.embeddings.word_embeddings",
                "cls.predictions.transform.dense"} & set(bert_styles)
    assert bert_styles["bert.encoder.layer.1.attention.self.query"] == "colwise"
    assert bert_styles["bert.encoder.layer.1.attention.output.dense"] == "rowwise"


# --- training (2 processes, tp 2) ------------------------------------------------------------


class DerivedGPT2:
    """Hugging Face GPT-2 under a class name no built-in plan has, so that its plan is derived."""

    @staticmethod
    def build(seed: int):
        import transformers

        class MyGPT2(transformers.GPT2LMHeadModel):
            pass
        torch.manual_seed(seed)
        return MyGPT2(transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _padding_mask(x: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(x)
    mask[::2, -5:] = 0
    return mask


MODELS = {  # name -> (build(seed), loss(module or engine, batch), batches)
    "user_gpt": (lambda seed: user_gpt(seed), lambda m, x: m(x, x), None),
    "bert": (bert, lambda m, x: m(input_ids=x, attention_mask=_padding_mask(x), labels=x).loss, None),
    "gpt2": (DerivedGPT2.build, lambda m, x: m(input_ids=x, labels=x, use_cache=False).loss, None),
    "mlp": (mlp, lambda m, xy: F.mse_loss(m(xy[0]), xy[1]), "regression"),
}


def _batches(kind):
    if kind is None:
        return token_batches(STEPS, GLOBAL_BATCH)
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g))
            for _ in range(STEPS)]


def _train(model, loss_fn, batches):
    return train_reference(model, batches, adamw, clip=1.0, loss_fn=loss_fn)[0]


def _derived_worker(rank, world):
    out = {}
    for name, (make, loss_fn, kind) in MODELS.items():
        cfg = tp_config(world, 1)
        if name == "user_gpt":  # DeepSpeed's spelling of the same thing
            cfg["tensor_parallel"] = {"autotp_size": world}
        engine = initialize(make(rank), cfg)  # ranks seeded differently: the engine makes them agree
        assert engine.tensor_parallel.specs, name
        losses = []
        for batch in _batches(kind):
            loss = loss_fn(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = (losses, engine.full_state_dict(), sum(p.numel() for p in engine.module.parameters()))
    return out


def test_derived_plans_train_like_single_process_pytorch():
    """A user GPT (fused qkv, heads by -1, tied head, loss in forward), HF BERT with a padding mask, HF GPT-2 under
    a derived plan, and an MLP, each at tp 2 against plain PyTorch on the same batches."""
    results = run_distributed(_derived_worker, 2, timeout_s=300)
    for name, (make, loss_fn, kind) in MODELS.items():
        reference = make(0)
        whole = sum(p.numel() for p in reference.parameters())
        ref_losses = _train(reference, loss_fn, _batches(kind))
        params = param_snapshot(reference)
        for per_rank in results:
            losses, full, local_numel = per_rank[name]
            assert_close_relative(losses, ref_losses, rtol=TP_RTOL)
            assert_params_close({k: full[k] for k in params}, params, rtol=TP_RTOL)
            assert local_numel < 0.7 * whole, (name, local_numel, whole)  # the split layers hold half


def _zero3_worker(rank, world):
    engine = initialize(user_gpt(seed=rank), tp_config(2, world // 2, stage=3))
    assert engine.dp_world_size == world // 2
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        loss = engine(*(micro_batches(x, engine.dp_rank, engine.dp_world_size, 1)[0],) * 2)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def test_a_derived_plan_under_zero_3_over_two_data_parallel_groups():
    """dp 2 × tp 2 (4 processes): ZeRO-3 shards the derived plan's per-rank layers again over the dp group."""
    results = run_distributed(_zero3_worker, 4, timeout_s=300)
    reference = user_gpt(0)
    ref_losses = _train(reference, lambda m, x: m(x, x), token_batches(STEPS, GLOBAL_BATCH))
    params = param_snapshot(reference)
    mean_losses = [sum(r[0][i] for r in results) / len(results) for i in range(STEPS)]  # each dp rank's half
    assert_close_relative(mean_losses, ref_losses, rtol=TP_RTOL)
    for _losses, full in results:
        assert_params_close({k: full[k] for k in params}, params, rtol=TP_RTOL)


# --- refusals ------------------------------------------------------------------------------------

TP2 = TPGroup(None, 2, 0)
MESH = Mesh2D(2, TPGroup(None, 2, 0), TPGroup(None, 2, 0), TPGroup(None, 4, 0))  # rank (0, 0) of a 2×2 mesh


def test_a_model_that_reshapes_with_a_whole_width_is_refused_by_module():
    model = user_gpt(merge_by_width=True)  # nanoGPT's view(B, T, C), C read from the unsplit input
    before = param_snapshot(model)
    with pytest.raises(ValueError, match=r"cannot split UserGPT safely: module 'blocks.0.attn': split over 2 ranks, "
                                         r"its forward fails: .*write -1 for the split dim"):
        apply_tensor_parallel(model, "auto", TP2)
    assert isinstance(model.blocks[0].attn.qkv, nn.Linear)  # nothing changed
    assert_params_close(param_snapshot(model), before, rtol=0)


def test_a_model_with_nothing_to_split_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"found no pair of linear layers to split in Sequential: the output of '1' "
                                         r"cannot stay split up to another linear layer: the model's output"):
        apply_tensor_parallel(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4)), "auto", TP2)
    norm_between = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"the output of '0' cannot stay split .*: layer_norm normalizes over the "
                                         r"split features \(in '1'\)"):
        apply_tensor_parallel(norm_between, "auto", TP2)


class _ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum().item() > 0:  # a branch on the data: no forward on fake tensors can take it
            return self.fc(x)
        return x


def test_a_forward_that_cannot_run_on_fake_tensors_is_refused_by_module():
    with pytest.raises(ValueError, match=r"_ReadsValues has no built-in plan, and deriving one runs its forward on "
                                         r"fake tensors with a tensor of shape \[2, 4\] in module '', which failed"):
        resolve_plan(_ReadsValues(), "auto", "1d", 2)


def test_autotp_size_is_tensor_parallel_size_with_a_derived_plan():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2,
                                                                                "tp_overlap_comm": False}})
    assert (cfg.tensor_parallel.size, cfg.tensor_parallel.plan) == (2, "auto")
    off = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 0}})
    assert off.tensor_parallel.size == 1
    with pytest.raises(ConfigError, match=r"autotp_size \(2\) and tensor_parallel.size \(4\) are the same setting"):
        load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2, "size": 4}})
    with pytest.raises(ConfigError, match=r"tensor_parallel.tp_overlap_comm: only false is supported"):
        load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2,
                                                                              "tp_overlap_comm": True}})
    with pytest.raises(ConfigError, match=r"autotp_size: -1 is not allowed"):
        load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": -1}})


def test_a_reshape_keeps_the_split_only_on_an_outer_dim():
    from engine.tensor_parallel.derive.rules import reshaped_dim
    assert reshaped_dim((2, 8, 64), (2, 8, 4, 16), 2, 2) == 2  # features -> heads (the heads split)
    assert reshaped_dim((2, 8, 4, 16), (2, 8, 64), 2, 2) == 2  # heads -> features
    assert reshaped_dim((2, 2, 2, 8, 16), (2, 4, 8, 16), 1, 2) == 1  # key/value heads repeated (GQA)
    assert reshaped_dim((2, 4, 8, 16), (8, 8, 16), 1, 2) is None  # batch × heads: the blocks interleave
    assert reshaped_dim((2, 8, 4, 16), (2, 32, 16), 2, 2) is None  # sequence × heads: the heads inner
    assert reshaped_dim((2, 8, 192), (2, 8, 3, 4, 16), 2, 2) is None  # q/k/v outermost: 3 does not split in 2


# --- what a derived plan leaves whole, or refuses, rather than split wrongly -------------------


class _Pair(nn.Module):
    """Two linear layers around a GELU, with hooks for the cases below."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.tok = nn.Embedding(16, 8) if variant != "scaled" else _ScaledEmbedding(16, 8)
        self.a, self.b, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16 if variant == "cat" else 8, 8)
        self.drop = nn.Dropout(0.1)
        self.adapt = nn.Linear(8, 8)

    def forward(self, ids):
        x = self.tok(ids)
        h = F.gelu(self.a(x))
        if self.variant == "cat":  # the fused parts side by side: rank r holds [a_r, b_r], not block r of [a, b]
            return x.sum() + self.out(torch.cat([h, self.b(x)], axis=-1)).sum()
        if self.variant == "width_scale":  # a value from a split width: per rank it would be sqrt(4)
            h = h / math.sqrt(h.shape[-1])
        if self.variant == "mixed_dropout":  # one module drops out a split and a whole activation
            return x + F.dropout(self.out(F.dropout(h, 0.1)), 0.1)
        if self.variant == "weight_fed":  # the embedding table through another layer, by hand
            return x + self.out(h) @ self.adapt(self.tok.weight).t() @ self.tok.weight
        return x + self.out(h)


class _ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_layer_subclasses_and_weights_used_by_hand_stay_whole():
    assert derive_plan(_Pair("plain"), 2).styles == {"tok": "vocab", "a": "colwise", "out": "rowwise"}
    assert "tok" not in derive_plan(_Pair("scaled"), 2).styles  # its forward is not nn.Embedding's
    assert "tok" not in derive_plan(_Pair("weight_fed"), 2).styles


def test_what_the_shapes_do_not_show_is_refused():
    with pytest.raises(ValueError, match=r"found no pair of linear layers to split in _Pair: the output of 'a' cannot "
                                         r"stay split up to another linear layer: cat along the split dim"):
        derive_plan(_Pair("cat"), 2)
    with pytest.raises(ValueError, match=r"module '': split over 2 ranks, div is passed 2.0 where the whole model "
                                         r"passes 2.8284"):
        derive_plan(_Pair("width_scale"), 2)
    with pytest.raises(ValueError, match=r"module '' applies dropout to split activations and to whole ones"):
        derive_plan(_Pair("mixed_dropout"), 2)


# --- 2D (Note [derived 2D plans]; trained against one process in test_tensor_parallel_2d.py) --------------


def test_the_derived_2d_plan_equals_the_built_in_2d_plan():
    for model in ("gpt2", "llama"):
        net = build(model)
        built_in = BUILT_IN_2D[type(net).__name__]
        derived = derive_plan_2d(net, 2)
        for name, _module in net.named_modules():
            assert derived.styles.get(name) == next((s for glob, s in built_in.styles.items()
                                                     if fnmatch.fnmatchcase(name, glob)), None), (model, name)
        expected = {(m, a, v) for m, a, v in built_in.adjust(net, 2)}
        got = {(net.get_submodule(name), attr, value) for name, attr, value in derived.adjustments}
        assert got <= expected and (got or not expected), model


class _ShiftedRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), which norm_2d does not compute."""

    def __init__(self, width: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(width)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class _TinyLM(nn.Module):
    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.tok, self.fc = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.norm = _ShiftedRMSNorm(8) if variant == "shifted_norm" else nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=variant == "head_bias")
        if variant == "raw_parameter":
            self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids):
        x = self.tok(ids)
        x = x + F.gelu(self.fc(self.norm(x)))
        if self.variant == "functional_norm":  # over the hidden dim, which 2D splits
            x = F.normalize(x, dim=-1)
        if self.variant == "raw_parameter":
            x = x * self.scale
        if self.variant == "batch_mean":  # each rank would hold its batch block only
            x = x - x.mean(0, keepdim=True)
        return self.head(x)


def test_a_derived_2d_plan_maps_every_layer_and_refuses_what_2d_cannot_split():
    assert derive_plan_2d(_TinyLM(), 2).styles == {"tok": "embedding_2d", "fc": "linear_2d", "norm": "norm_2d",
                                                    "head": "classifier_2d_gather"}
    for variant, message in (
            ("shifted_norm", r"module 'norm' \(_ShiftedRMSNorm\) does not compute the layer or RMS norm"),
            ("functional_norm", r"normalize reduces over the split dim \(in the model's own forward\)"),
            ("head_bias", r"the output layer 'head' has a bias"),
            ("raw_parameter", r"module '' \(_TinyLM\) holds parameters and is not an exact nn.Linear"),
            ("batch_mean", r"the forward mixes the samples of its batch, which 2D cuts into 2 blocks before it runs: "
                           r"mean reduces over the split dim \(in the model's own forward\)")):
        model = _TinyLM(variant)
        grids = r"plan \"auto\" \(mode \"2d\", \"2.5d\" or \"3d\"\)"
        with pytest.raises(ValueError, match=grids + r": cannot split _TinyLM: " + message):
            apply_tensor_parallel(model, "auto", MESH.whole, mesh=MESH)
        assert isinstance(model.fc, nn.Linear), variant  # nothing changed


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_a_plan_derives_for_hugging_face_experts_in_each_implementation(implementation):
    """grouped_mm's fake-tensor kernel takes bf16 only (the model runs it in fp32), and the eager loop counts the
    experts a batch routes to: the trace runs both as the model computes them. The experts stay whole; the model's
    own implementation is left as it was."""
    from tests.moe_models import mixtral

    model = mixtral()
    model.config._experts_implementation = implementation
    plan = derive_plan(model, 2)
    assert plan.styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan.styles["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert not any("experts" in name for name in plan.styles)
    assert model.config._experts_implementation == implementation


def test_whole_parameters_that_meet_split_heads_have_their_gradients_summed():
    """Qwen3's per-head q/k norms scale each rank's heads only (Note [partial gradients of whole parameters]); the
    layer norms on the residual stream see whole activations."""
    from tests import hf_zoo

    assert set(derive_plan(hf_zoo.build("qwen3"), 2).partial_gradients) == {
        f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(hf_zoo.LAYERS) for n in "qk"}
    assert derive_plan(hf_zoo.build("llama"), 2).partial_gradients == ()


class ScaledOnBothSides(nn.Module):
    """A scalar parameter that scales the split MLP activations and the whole residual stream."""

    def __init__(self, hidden: int = 16, vocab: int = 32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.down(torch.relu(self.up(x)) * self.alpha) + self.alpha * x
        return self.head(x)


class GatedByTheHiddenState(nn.Module):
    """A one-wide gate computed from the hidden state, broadcast over the split MLP activations."""

    def __init__(self, hidden: int = 16, vocab: int = 32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.gate = nn.Linear(hidden, 1)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        return self.head(x + self.down(torch.relu(self.up(x)) * torch.sigmoid(self.gate(x))))


@pytest.mark.parametrize("model,why", [
    (ScaledOnBothSides, "a parameter it meets is also used on whole activations"),
    (GatedByTheHiddenState, "mul combines a split tensor with a whole one a gradient flows through")])
def test_a_whole_tensor_whose_gradient_would_be_one_ranks_part_keeps_the_layers_whole(model, why):
    """Summing the scalar's gradient would also count its whole use tp times; the gate's gradient would flow on into
    the hidden state as one rank's part (Note [partial gradients of whole parameters])."""
    with pytest.raises(ValueError, match=f"found no pair of linear layers to split.*{why}"):
        derive_plan(model(), 2)
