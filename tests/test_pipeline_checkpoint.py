"""Checkpoints across pipeline sizes (Note [checkpoint layout], [reading a checkpoint anywhere]).

A run trained SAVED steps under one layout, saved, loaded under another and trained to STEPS must follow the
uninterrupted single-process reference (fp32 1e-5): its losses, final parameters and Adam moments, the lr schedule
going on where it stopped. Legs: pp 2 -> pp 1 and pp 4, pp 1 -> pp 2 (1F1B, interleaved), dp 2 x pp 2 -> pp 4
(ZeRO-1) and -> pp 1 (ZeRO-3), pp 2 x tp 2 -> pp 1; the same layout resumes bit for bit (dropout on);
full_state_dict, save_16bit_model and `tiers convert` give the unsplit model's state dict.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from engine import initialize
from engine.checkpoint import CheckpointError
from engine.checkpoint.live_states import LiveStates
from engine.cli import main
from engine.lr_schedules import build_lr_scheduler
from tests.distributed import run_distributed
from tests.reference import assert_close_relative, assert_params_close, micro_batches, tiny_gpt, token_batches
from tests.test_data_parallel import ADAMW, adamw

STEPS, SAVED, GLOBAL_BATCH, ACCUMULATION, LAYERS = 4, 2, 8, 4, 4
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                            "warmup_type": "linear"}}
CLIENT = {"data": {"position": SAVED * GLOBAL_BATCH}, "generator": torch.arange(4)}
MOMENTS = ("exp_avg", "exp_avg_sq")


def model(dropout: float = 0.0, tied: bool = True):
    return tiny_gpt(0, n_layer=LAYERS, dropout=dropout, tie_weights=tied)


def config(pp: int = 1, dp: int = 1, tp: int = 1, stage: int = 0, virtual: int = 1) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp // ACCUMULATION,
           "gradient_accumulation_steps": ACCUMULATION, "optimizer": {"type": "AdamW", "params": ADAMW},
           "scheduler": SCHEDULER, "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # 0: every one sharded
    if pp > 1:
        cfg["pipeline"] = {"stages": pp, "schedule": "1f1b" if virtual == 1 else "interleaved",
                           "virtual_stages": virtual}
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp}
    return cfg


def param_groups(net) -> list[dict]:
    """Two groups with different options: the blocks' parameters, and the others (embeddings, final norm)."""
    blocks = {id(p) for p in net.blocks.parameters()}
    return [{"params": [p for p in net.parameters() if id(p) in blocks]},
            {"params": [p for p in net.parameters() if id(p) not in blocks], "weight_decay": 0.0}]


def train(engine, batches: list[torch.Tensor]) -> list[float]:
    """The step losses over global batches: train_batch under a pipeline, else forward, backward and step."""
    losses = []
    for batch in batches:
        mbs = micro_batches(batch, engine.dp_rank, engine.dp_world_size, ACCUMULATION)
        if engine.pipeline is not None:
            losses.append(engine.train_batch(iter([{"input_ids": x, "labels": x} for x in mbs])))
            continue
        step = []
        for x in mbs:
            loss = engine(input_ids=x, labels=x)
            engine.backward(loss)
            engine.step()
            step.append(loss.item())
        losses.append(sum(step) / len(step))
    return losses


def moments(engine) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's Adam moments by parameter name (whole: one data-parallel rank, no tensor parallelism)."""
    states, out = LiveStates(engine.chunked, engine.optimizer), {}
    for i in range(len(states)):
        with states.optimizer_state(i, writes=False) as state:
            for m in states.members(i):
                out[m.name] = {k: state[k][m.offset:m.offset + m.numel].view(m.shape).clone() for k in MOMENTS}
    return out


def resume(engine, path: str, batches: list[torch.Tensor]) -> dict:
    """Loads `path` into `engine` and trains on to STEPS; what the leg's checks need."""
    _, client = engine.load_checkpoint(path)
    out = {"global_step": engine.global_step, "lr": engine.get_lr(), "client": client,
           "scheduler": engine.lr_scheduler.state_dict(), "loaded": engine.full_state_dict()}
    out["losses"] = train(engine, batches[SAVED:])
    out["params"], out["moments"] = engine.full_state_dict(), moments(engine)
    engine.close()
    return out


def _two_rank_worker(rank, world, root):
    batches, out = token_batches(STEPS, GLOBAL_BATCH), {}
    engine = initialize(model(), config(pp=2))  # pp 2: saved at SAVED, then on to STEPS uninterrupted
    out["losses"] = train(engine, batches[:SAVED])
    engine.save_checkpoint(os.path.join(root, "pp2"), client_state=CLIENT)
    out["saved"] = engine.full_state_dict()
    out["losses"] += train(engine, batches[SAVED:])
    out["full"], out["rank0_only"] = engine.full_state_dict(), engine.full_state_dict(rank0_only=True)
    out["exported"] = engine.save_16bit_model(os.path.join(root, "export"))
    engine.close()
    out["pp1_to_pp2"] = resume(initialize(model(), config(pp=2)), os.path.join(root, "pp1"), batches)
    # interleaved: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3
    out["pp1_to_interleaved"] = resume(initialize(model(), config(pp=2, virtual=2)), os.path.join(root, "pp1"),
                                       batches)

    engine = initialize(model(tied=False), config(pp=2))  # another model: lm_head.weight is a parameter of its own
    try:
        engine.load_checkpoint(os.path.join(root, "pp2"))
    except CheckpointError as e:
        out["untied_error"] = str(e)
    engine.close()

    engine = initialize(model(dropout=0.1), config(pp=2))  # the same layout, dropout on: bit for bit
    train(engine, batches[:SAVED])
    engine.save_checkpoint(os.path.join(root, "pp2_dropout"))
    on, full, moms = train(engine, batches[SAVED:]), engine.full_state_dict(), moments(engine)
    engine.close()
    engine = initialize(model(dropout=0.1), config(pp=2))
    engine.load_checkpoint(os.path.join(root, "pp2_dropout"))
    resumed = train(engine, batches[SAVED:])
    out["bitwise"] = (on == resumed and all(torch.equal(v, full[k]) for k, v in engine.full_state_dict().items())
                      and all(torch.equal(v[k], moms[n][k]) for n, v in moments(engine).items() for k in MOMENTS))
    engine.close()
    return out


def _four_rank_worker(rank, world, root):
    batches, out = token_batches(STEPS, GLOBAL_BATCH), {}
    engine = initialize(model(), config(pp=2, dp=2, stage=1))
    train(engine, batches[:SAVED])
    engine.save_checkpoint(os.path.join(root, "dp2_pp2"), client_state=CLIENT)
    out["saved_dp2_pp2"] = engine.full_state_dict()
    engine.close()
    engine = initialize(model(), config(pp=2, dp=2, stage=3))
    train(engine, batches[:SAVED])
    engine.save_checkpoint(os.path.join(root, "dp2_pp2_zero3"), client_state=CLIENT)
    out["saved_dp2_pp2_zero3"] = engine.full_state_dict()
    engine.close()
    engine = initialize(model(), config(pp=2, tp=2))
    train(engine, batches[:SAVED])
    engine.save_checkpoint(os.path.join(root, "pp2_tp2"), client_state=CLIENT)
    out["saved_pp2_tp2"] = engine.full_state_dict()
    engine.close()
    net = model()
    engine = initialize(net, config(pp=4), model_parameters=param_groups(net))
    try:  # stage 1 (block 1 alone) has one of the two param groups: which options are its own is unknown
        engine.load_checkpoint(os.path.join(root, "pp1_groups"))
    except CheckpointError as e:
        out["groups_error"] = str(e)
    engine.close()
    out["pp2_to_pp4"] = resume(initialize(model(), config(pp=4)), os.path.join(root, "pp2"), batches)
    out["dp2_pp2_to_pp4"] = resume(initialize(model(), config(pp=4)), os.path.join(root, "dp2_pp2"), batches)
    return out


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run in one process, plain PyTorch: losses, final state dict, Adam moments, lr per step."""
    net = model()
    opt = adamw(list(net.parameters()))
    scheduler = build_lr_scheduler(opt, SCHEDULER["type"], SCHEDULER["params"])
    losses, lrs = [], []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        lrs.append(opt.param_groups[0]["lr"])
        loss = net(input_ids=x, labels=x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    moms = {n: {k: opt.state[p][k].clone() for k in MOMENTS} for n, p in net.named_parameters()}
    return losses, state, moms, lrs


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp_ckpt"))
    engine = initialize(model(), config())  # pp 1, saved for pp 1 -> pp 2
    train(engine, token_batches(STEPS, GLOBAL_BATCH)[:SAVED])
    engine.save_checkpoint(os.path.join(root, "pp1"), client_state=CLIENT)
    engine.close()
    net = model()
    engine = initialize(net, config(), model_parameters=param_groups(net))
    engine.save_checkpoint(os.path.join(root, "pp1_groups"))
    engine.close()
    two = run_distributed(_two_rank_worker, 2, (root,), timeout_s=180)
    four = run_distributed(_four_rank_worker, 4, (root,), timeout_s=240)
    return root, two, four


def check_leg(leg: dict, reference, saved: dict | None = None) -> None:
    ref_losses, ref_state, ref_moments, ref_lrs = reference
    assert leg["global_step"] == SAVED and leg["lr"] == [ref_lrs[SAVED]]
    assert leg["scheduler"] == {"last_batch_iteration": SAVED - 1}
    assert leg["client"]["data"] == CLIENT["data"] and torch.equal(leg["client"]["generator"], CLIENT["generator"])
    if saved is not None:
        assert leg["loaded"].keys() == saved.keys()
        assert all(torch.equal(leg["loaded"][k], saved[k]) for k in saved), "the loaded weights differ from the saved"
    assert_close_relative(leg["losses"], ref_losses[SAVED:])
    assert list(leg["params"]) == list(ref_state)  # the unsplit model's keys, in its order
    assert_params_close(leg["params"], ref_state)
    for name, values in leg["moments"].items():
        for kind in MOMENTS:
            expected = ref_moments[name][kind]
            torch.testing.assert_close(values[kind], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item(),
                                       msg=lambda m, n=name, k=kind: f"{n} {k}: {m}")


def check_stages(results: list[dict], key: str, reference, saved: dict | None = None) -> None:
    """Every rank of a pipelined leg: the whole model's weights; together, every parameter's moments."""
    held = {}
    for out in results:
        check_leg(out[key], reference, saved)
        held.update(out[key]["moments"])
    assert held.keys() == reference[2].keys()


def test_pp2_matches_one_process_and_gives_the_whole_state_dict(legs, reference):
    root, two, _ = legs
    for rank, out in enumerate(two):
        assert_close_relative(out["losses"], reference[0])
        assert out["full"].keys() == reference[1].keys()  # lm_head.weight (tied, on the last stage) included
        assert_params_close(out["full"], reference[1])
        assert (out["rank0_only"] is None) == (rank != 0) and (out["exported"] is None) == (rank != 0)
    assert all(torch.equal(two[0]["rank0_only"][k], v) for k, v in two[0]["full"].items())
    exported = load_file(two[0]["exported"])
    assert exported.keys() == reference[1].keys()
    assert all(torch.equal(exported[k], v) for k, v in two[0]["full"].items())
    manifest = json.load(open(os.path.join(root, "pp2", f"global_step{SAVED}", "manifest.json")))
    assert manifest["layout"]["sizes"]["pp"] == 2 and manifest["version"] == 3  # one version for every layout
    assert len(manifest["parts"]) == 2  # each stage's optimizer options
    assert manifest["aliases"] == {"lm_head.weight": "wte.weight"}


def test_pp2_loads_at_pp1(legs, reference):
    root, two, _ = legs
    out = resume(initialize(model(), config()), os.path.join(root, "pp2"), token_batches(STEPS, GLOBAL_BATCH))
    check_leg(out, reference, two[0]["saved"])


def test_pp2_loads_at_pp4(legs, reference):
    _, two, four = legs
    check_stages(four, "pp2_to_pp4", reference, two[0]["saved"])


def test_pp1_loads_at_pp2(legs, reference):
    _, two, _ = legs
    check_stages(two, "pp1_to_pp2", reference)


def test_pp1_loads_at_interleaved_pp2(legs, reference):
    _, two, _ = legs
    check_stages(two, "pp1_to_interleaved", reference)


def test_dp2_by_pp2_under_zero1_loads_at_pp4(legs, reference):
    _, _, four = legs
    check_stages(four, "dp2_pp2_to_pp4", reference, four[0]["saved_dp2_pp2"])


def test_dp2_by_pp2_under_zero3_loads_at_pp1(legs, reference):
    root, _, four = legs
    out = resume(initialize(model(), config()), os.path.join(root, "dp2_pp2_zero3"), token_batches(STEPS, GLOBAL_BATCH))
    check_leg(out, reference, four[0]["saved_dp2_pp2_zero3"])


def test_pp2_by_tp2_loads_at_pp1(legs, reference):
    root, _, four = legs
    out = resume(initialize(model(), config()), os.path.join(root, "pp2_tp2"), token_batches(STEPS, GLOBAL_BATCH))
    check_leg(out, reference, four[0]["saved_pp2_tp2"])


def test_same_layout_resumes_bit_for_bit(legs):
    _, two, _ = legs
    assert all(out["bitwise"] for out in two)


def test_another_model_is_refused_by_name(legs):
    _, two, _ = legs
    assert "lm_head.weight" in two[1]["untied_error"] and "does not fit this model" in two[1]["untied_error"]


def test_convert_writes_the_unsplit_model(legs, tmp_path):
    root, two, _ = legs
    assert main(["convert", os.path.join(root, "pp2"), str(tmp_path)]) == 0
    converted, saved = load_file(str(tmp_path / "model.safetensors")), two[0]["saved"]
    assert converted.keys() == saved.keys() and all(torch.equal(converted[k], v) for k, v in saved.items())


def test_param_groups_a_stage_lacks_are_refused(legs):
    _, _, four = legs
    for out in four:
        assert "param groups" in out["groups_error"] and "load_optimizer_states=False" in out["groups_error"]
