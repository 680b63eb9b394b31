"""Expert parallelism composed with the other parallelisms (Note [expert parallelism]) equals one plain PyTorch
process: 1D tensor parallelism (attention split over tp, experts whole on every tp rank and split over ep),
Ulysses sequence parallelism (experts split over the ranks of a sequence) and a pipeline (1F1B and zero
bubble), at ZeRO stages 0-3; a checkpoint saved under tp × ep reads back whole in one process and loads under
another layout. Every case runs in one spawned 4-rank group."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine import initialize
from engine.checkpoint.reader import Checkpoint, PieceReader
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.moe_models import SEQ, VOCAB, MoEGPT
from tests.reference import assert_close_relative, assert_params_close, micro_batches, param_snapshot
from tests.test_data_parallel import ADAMW, adamw

AUX, Z, WORLD, STEPS, BATCH = 0.01, 0.001, 4, 3, 8
TP_RTOL = 1e-4  # tensor parallelism sums the split attention's products in another order
TP = {"size": 2, "plan": {"blocks.*.qkv": "colwise_qkv", "blocks.*.proj": "rowwise", "head": "colwise_gather"}}
LAYOUTS = {"tp": {"tensor_parallel": TP}, "sp": {"sequence_parallel": {"size": 2, "mode": "ulysses"}},
           "pp": {"pipeline": {"stages": 2, "schedule": "1f1b"}, "train_micro_batch_size_per_gpu": 2},
           "pp_zb": {"pipeline": {"stages": 2, "schedule": "zero_bubble"}, "train_micro_batch_size_per_gpu": 2},
           "dp": {}}


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def config(stage: int, **moe) -> dict:
    return {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": ADAMW}, "gradient_clipping": 1.0,
            "steps_per_print": 10**6, "moe": {"expert_parallel_size": 2, **moe},
            "zero_optimization": {"stage": stage, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0}}


def _labels(x: torch.Tensor) -> torch.Tensor:
    return (x + 1) % VOCAB  # already shifted: the model does not shift them


def _config(layout: str, stage: int, router_losses: bool = True) -> dict:
    """router_losses: the config's aux and z-loss, taken over each rank's tokens (which differ between layouts)."""
    moe = {"aux_loss_coef": AUX, "z_loss_coef": Z} if router_losses else {}
    return {**config(stage, **moe), **LAYOUTS[layout]}


def _router_losses(x: torch.Tensor, gate_weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """AUX · GShard's l_aux + Z · the router z-loss of the tokens `x` [.., hidden]."""
    logits = F.linear(x.reshape(-1, x.shape[-1]), gate_weight)
    probs = F.softmax(logits, dim=-1)
    first = F.one_hot(probs.argmax(-1), num_experts).float()
    l_aux = (probs.mean(0) * first.mean(0)).sum() * num_experts
    return AUX * l_aux + Z * torch.logsumexp(logits, dim=-1).square().mean()


@functools.lru_cache(maxsize=None)  # one per token split, shared by the ZeRO stages
def reference_run(parts: int, sequence_parts: int) -> tuple[list[float], list[float], dict[str, torch.Tensor],
                                                             list[dict[str, list[int]]]]:
    """Plain PyTorch on the whole batch: the model's loss, plus each MoE layer's router losses taken over each
    rank's tokens (rows over `parts` samples groups, each sequence over `sequence_parts`) and averaged, as every
    rank computes them over the tokens it routes. Returns (losses, gradient norms before clipping, parameters,
    each step's {MoE layer: tokens each expert received})."""
    model = MoEGPT()
    seen = {}
    for i, block in enumerate(model.blocks):
        block.moe.register_forward_pre_hook(lambda m, args, i=i: seen.update({i: args[0]}))
    opt = adamw(list(model.parameters()))
    losses, norms, counts = [], [], []
    for x in batches():
        loss = model(x, _labels(x))
        router = []
        for i, block in enumerate(model.blocks):
            for rows in seen[i].chunk(parts, dim=0):
                for tokens in rows.chunk(sequence_parts, dim=1):
                    router.append(_router_losses(tokens, block.moe.gate.wg.weight, block.moe.num_experts))
        (loss + sum(router) / (parts * sequence_parts)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        counts.append({f"blocks.{i}.moe": block.moe.traffic.tokens_per_expert.tolist()
                       for i, block in enumerate(model.blocks)})
        for block in model.blocks:
            block.moe.traffic.reset()
    return losses, norms, param_snapshot(model), counts


def _train(engine, steps: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """(this rank's losses, the global gradient norms); under a pipeline, train_batch over 2 micro-batches."""
    topo, losses, norms = engine.topology, [], []
    for x in steps:
        if topo.pp_size > 1:
            micros = micro_batches(x, topo.data_parallel_rank, topo.data_parallel_size, 2)
            losses.append(engine.train_batch(iter([{"input_ids": m, "labels": _labels(m)} for m in micros])))
        else:
            (micro,) = micro_batches(x, topo.data_parallel_rank, topo.data_parallel_size, 1)
            loss = engine(micro, _labels(micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _train_worker(rank, world, layout, stage, directory):
    cfg = _config(layout, stage)
    if (layout, stage) in LOGGED:  # the expert metrics, written by rank 0
        cfg["tensorboard"] = {"enabled": True, "output_path": directory, "job_name": f"metrics_{layout}"}
    engine = initialize(MoEGPT(), cfg)
    losses, norms = _train(engine, batches())
    full = engine.full_state_dict()
    engine.close()
    return losses, norms, full


CASES_MATCHED = [("tp", 0), ("tp", 3), ("sp", 1), ("sp", 3), ("pp", 1), ("pp", 3), ("pp_zb", 1)]
LOGGED = [("sp", 1), ("pp", 1)]
# (row groups, sequence parts): the tokens each rank routes in one forward
ROUTED_TOKENS = {"tp": (2, 1), "sp": (2, 2), "pp": (4, 1), "pp_zb": (4, 1)}


@pytest.mark.parametrize("layout, stage", CASES_MATCHED)
def test_expert_parallel_composition_matches_plain_pytorch(four_ranks, layout, stage):
    """tp: 2 tp × 2 dp, experts over ep 2 = the dp ranks of each tp rank (every tp rank routes the same tokens and
    holds the same experts; expert gradients reduced over edp 1). sp: 2 dp × 2 sequence ranks, experts over ep 2 =
    the ranks of each sequence (each routes its part of the sequence; expert gradients reduced over edp = dp).
    pp: 2 stages (one MoE block each) × 2 dp, experts over ep 2 = the dp ranks of each stage, 1F1B over 2
    micro-batches, the router losses of each stage's MoE layer carried into its backward; pp_zb: the same under
    the zero-bubble schedule (backward split into input and weight passes)."""
    parts, sequence_parts = ROUTED_TOKENS[layout]
    ref_losses, ref_norms, ref_params, _ = reference_run(parts, sequence_parts)
    results = four_ranks[("train", layout, stage)]
    rtol = 1e-5 if layout == "sp" else TP_RTOL  # (pp: gradients summed over micro-batches, in another order)
    assert_close_relative([sum(r[0][i] for r in results) / WORLD for i in range(len(ref_losses))], ref_losses, rtol)
    for _, norms, full in results:  # the norm clipping scales by: every gradient counted once
        assert_close_relative(norms, ref_norms, rtol)
        assert_params_close({k: v for k, v in full.items() if k in ref_params}, ref_params, rtol)


@pytest.mark.parametrize("layout, stage", LOGGED)
def test_expert_metrics_count_the_whole_batch_as_one_process(four_ranks, four_ranks_dir, layout, stage):
    """The tokens each expert received, as rank 0 logs them each step, are one process's counts over the whole
    batch: sp sums the sequence parts and the dp ranks; pp also the stages, each of which routes only its own MoE
    layer (rank 0, on stage 0, logs stage 1's layer too)."""
    counts = reference_run(*ROUTED_TOKENS[layout])[3]
    events = EventAccumulator(str(four_ranks_dir / f"metrics_{layout}"))
    events.Reload()
    for layer, experts in counts[0].items():
        logged = [[p.value for p in events.Scalars(f"MoE/{layer}/tokens_expert_{e}")] for e in range(len(experts))]
        assert [list(step) for step in zip(*logged)] == [step[layer] for step in counts], layer


def _checkpoint_worker(rank, world, directory):
    """tp × ep saves after two steps and takes the third; sp × ep, dp 4 × ep 2 and pp × ep load it and take the
    third step from there (pp × ep saves it again first). No router losses: each layout would take them over other
    tokens, a different objective."""
    engine = initialize(MoEGPT(), _config("tp", 1, router_losses=False))
    _train(engine, batches()[:2])
    saved = engine.full_state_dict()
    engine.save_checkpoint(directory, "saved")
    _train(engine, batches()[2:])
    uninterrupted = engine.full_state_dict()
    engine.close()
    resumed = {}
    for layout in ("sp", "dp", "pp"):
        engine = initialize(MoEGPT(seed=1), _config(layout, 3, router_losses=False))
        engine.load_checkpoint(directory, "saved")
        if layout == "pp":
            engine.save_checkpoint(directory, "resaved_pp")
        _train(engine, batches()[2:])
        resumed[layout] = engine.full_state_dict()
        engine.close()
    engine = initialize(MoEGPT(seed=1), _config("sp", 3, router_losses=False))  # pp × ep's checkpoint, at sp × ep
    engine.load_checkpoint(directory, "resaved_pp")
    resumed["resaved_pp_at_sp"] = engine.full_state_dict()
    engine.close()
    return saved, uninterrupted, resumed


def test_checkpoint_of_tensor_and_expert_parallel_run(four_ranks, four_ranks_dir):
    """Saved under tp 2 × ep 2 (and saved again under pp 2 × ep 2): read whole in this one process it is the run's
    full_state_dict at the save, and under sp 2 × ep 2, dp 4 × ep 2 and pp 2 × ep 2 (ZeRO-3) the third step goes
    on as the uninterrupted run's; pp 2 × ep 2's loads under sp 2 × ep 2 as it was saved."""
    saved, uninterrupted, resumed = four_ranks[("checkpoint",)][0]
    loaded = resumed.pop("resaved_pp_at_sp")  # pp 2 × ep 2's checkpoint loaded under sp 2 × ep 2
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    for tag in ("saved", "resaved_pp"):
        checkpoint = Checkpoint(f"{four_ranks_dir}/{tag}")
        reader = PieceReader(checkpoint)
        assert set(checkpoint.param_names()) == set(saved)
        for name, value in saved.items():
            torch.testing.assert_close(reader.whole(name, "param"), value, rtol=0, atol=0, msg=f"{tag}: {name}")
    for layout, full in resumed.items():  # one Adam step in another layout: a near-zero moment moves a weight
        assert full.keys() == uninterrupted.keys()  # by up to ~1% of a step (lr 1e-3) more or less
        for name, value in uninterrupted.items():
            torch.testing.assert_close(full[name], value, rtol=TP_RTOL, atol=5e-5,
                                       msg=lambda m, layout=layout, name=name: f"{layout}: {name}: {m}")


def _refusals_worker(rank, world):
    errors = []
    cases = [{"tensor_parallel": {**TP, "plan": {**TP["plan"], "blocks.*.moe.experts.*.fc1": "colwise"}}},
             {"tensor_parallel": {**TP, "sequence_parallel": True}},
             {"tensor_parallel": {"size": 4, "mode": "2d"}}]
    for extra in cases:
        with pytest.raises(ValueError) as e:
            initialize(MoEGPT(), {**config(1), **extra})
        errors.append(str(e.value))
    return errors


def test_refusals_name_what_is_missing(four_ranks):
    errors = four_ranks[("refusals",)][0]
    expected = ["blocks.0.moe", "tensor_parallel.sequence_parallel", "2D tensor parallelism"]
    for error, text in zip(errors, expected):
        assert text in error and "moe.expert_parallel_size" in error, error


def test_a_hugging_face_router_loss_inside_a_pipeline_is_refused():
    """Only the hidden state crosses a stage boundary, so a Hugging Face model's own aux loss (from every layer's
    router logits, gathered by its forward) would see the last stage's layers only: refused, naming the fix."""
    pytest.importorskip("transformers")
    from engine.comm import CommCounter
    from engine.config import load_config
    from engine.mesh import Mesh
    from engine.moe.plan import apply_expert_parallel
    from tests.moe_models import mixtral

    cfg = load_config({**config(1), "moe": {"capacity_factor": 4.0}})  # routed by Tiers at ep 1 too
    with pytest.raises(ValueError, match="output_router_logits=False"):
        apply_expert_parallel(mixtral(output_router_logits=True), cfg.moe, Mesh.single("cpu"), CommCounter(),
                              pipelined=True)
    assert apply_expert_parallel(mixtral(), cfg.moe, Mesh.single("cpu"), CommCounter(), pipelined=True) is not None


# --- every case above in one spawned group: start-up, not the cases, dominates their time -----------------------

FOUR_RANK_CASES = [*(("train", *case) for case in CASES_MATCHED), ("checkpoint",), ("refusals",)]


def _four_rank_cases_worker(rank, world, directory):
    workers = {"train": lambda r, w, layout, stage: _train_worker(r, w, layout, stage, directory),
               "refusals": _refusals_worker,
               "checkpoint": lambda r, w: _checkpoint_worker(r, w, directory)}
    return run_cases(rank, FOUR_RANK_CASES, lambda kind, *args: workers[kind](rank, world, *args))


@pytest.fixture(scope="module")
def four_ranks_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_composition")


@pytest.fixture(scope="module")
def four_ranks(four_ranks_dir) -> dict[tuple, list]:
    """Each case's results in rank order, keyed by the case."""
    return results_by_case(run_distributed(_four_rank_cases_worker, WORLD, args=(str(four_ranks_dir),),
                                           timeout_s=600))


def test_a_hugging_face_router_loss_is_refused_by_the_pipeline_split_without_a_moe_section():
    """Without a `moe` section Tiers does not route the model's experts, and the split refuses the loss itself."""
    pytest.importorskip("transformers")
    from engine.config_sections import PipelineConfig
    from engine.pipeline.model_split import plan_stages, split_model
    from tests.moe_models import mixtral

    model = mixtral(output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=False"):
        split_model(model, plan_stages(model, PipelineConfig(stages=2, partition="uniform")), 0)
    plain = mixtral()
    assert split_model(plain, plan_stages(plain, PipelineConfig(stages=2, partition="uniform")), 0) is not None
