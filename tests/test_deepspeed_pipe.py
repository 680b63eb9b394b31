"""deepspeed.pipe on Tiers' pipeline (Note [a PipelineModule on Tiers' pipeline]): a script shaped like
DeepSpeedExamples' training/pipeline_parallelism/train.py (join_layers, PipelineModule(num_stages=2),
deepspeed.initialize(training_data=...), engine.train_batch() in a loop) and a TiedLayerSpec model whose embedding
and output head sit on different stages, both on 2 ranks equal to plain PyTorch; and the refusals, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from engine.compat import deepspeed
from engine.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from engine.compat.deepspeed.unsupported import NotInTiers
from tests.distributed import run_distributed
from tests.reference import assert_close_relative, assert_params_close

MICRO, GAS, STEPS, SAMPLES, LR = 4, 2, 4, 24, 0.1  # 3 steps per pass over the data: train_batch() repeats it
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
          "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 10**6}
VOCAB, WIDTH, SEQ = 16, 8, 6


class TinyAlexNet(nn.Module):
    """AlexNet's shape (features, avgpool, classifier), small and without dropout."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, num_classes))


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def image_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 3, 8, 8, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


def head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def tied_specs() -> list:
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH), LayerSpec(Block), LayerSpec(Block),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=head)]


def token_data() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g),
                         torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))


# ---- plain PyTorch, one process ------------------------------------------------------------------------------------
def reference_batches(dataset):
    """DeepSpeed's loader order: a DistributedSampler over one data-parallel rank, the next epoch on each pass."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from DataLoader(dataset, batch_size=MICRO, sampler=sampler)
        epoch += 1


def eval_batches(dataset) -> list:
    return [dataset[i * MICRO:(i + 1) * MICRO] for i in range(GAS)]


def train_reference(forward, params: dict, loss_fn, dataset, batches=None):
    optimizer = torch.optim.SGD(list(params.values()), lr=LR)
    batches, losses = batches or reference_batches(dataset), []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(GAS):
            x, y = next(batches)
            loss = loss_fn(forward(x), y)
            (loss / GAS).backward()
            total += loss.item() / GAS
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    if dataset is None:
        return losses
    with torch.no_grad():
        evaluated = sum(loss_fn(forward(x), y).item() for x, y in eval_batches(dataset)) / GAS
    return losses, {n: p.detach().clone() for n, p in params.items()}, evaluated


def run_layers(layers):
    def forward(x):
        for layer in layers:
            x = layer(x)
        return x
    return forward


def reference_alexnet():
    torch.manual_seed(0)
    layers = copy.deepcopy(join_layers(TinyAlexNet()))
    params = {f"layers.{i}.layer.{n}": p for i, layer in enumerate(layers) if isinstance(layer, nn.Module)
              for n, p in layer.named_parameters()}
    return train_reference(run_layers(layers), params, nn.CrossEntropyLoss(), image_data())


def reference_tied():
    torch.manual_seed(0)  # built in the order LayerSpecs build: the embedding, then the blocks
    embed, first, second = nn.Embedding(VOCAB, WIDTH), Block(), Block()
    layers = [embed, first, second, lambda x: head(embed, x)]
    params = {"layers.0.layer.weight": embed.weight, **{f"layers.{i}.layer.{n}": p for i, b in ((1, first),
              (2, second)) for n, p in b.named_parameters()}}
    return train_reference(run_layers(layers), params, token_loss, token_data())


# ---- the script, on 2 ranks ----------------------------------------------------------------------------------------
def _train_pipe(args_partition: str, checkpoint_interval: int = 0):
    """DeepSpeedExamples' train_pipe(), with a tiny AlexNet on fake data."""
    torch.manual_seed(0)
    net = TinyAlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=2,
                         partition_method=args_partition, activation_checkpoint_interval=checkpoint_interval)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=image_data(), config=CONFIG)
    return engine


def _train_tied():
    torch.manual_seed(0)
    net = PipelineModule(layers=tied_specs(), loss_fn=token_loss, num_stages=2, partition_method="type:block")
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), training_data=token_data(),
                                           config=CONFIG)
    return engine


def _run(engine):
    losses = [engine.train_batch().item() for _ in range(STEPS)]
    evaluated = engine.eval_batch(iter(eval_batches(engine.training_dataloader.dataset))).item()
    return losses, engine.full_state_dict(), evaluated


def _loss_in_layers_worker():
    """loss_fn=None: the last layer's output is the loss, and the micro-batch's first element the only input."""
    torch.manual_seed(0)
    net = PipelineModule([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1), lambda y: y.pow(2).mean()], num_stages=2)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=CONFIG)
    data = iter(unlabelled_data())  # given once, kept for the calls without one (DeepSpeed's set_dataiterator)
    return [engine.train_batch(data if step == 0 else None).item() for step in range(STEPS)]


def unlabelled_data() -> list:
    """(inputs, labels) micro-batches whose labels no loss reads."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(MICRO, 4, generator=g), torch.zeros(MICRO)) for _ in range(STEPS * GAS)]


def reference_loss_in_layers():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1), lambda y: y.pow(2).mean()]
    params = dict(enumerate(p for layer in layers[:3] for p in layer.parameters()))
    return train_reference(run_layers(layers), params, lambda out, _: out, None, iter(unlabelled_data()))


def _pipe_worker(rank, world):
    out = {"alexnet": _run(_train_pipe("parameters")), "loss_in_layers": _loss_in_layers_worker()}
    checkpointed = _train_pipe("uniform", checkpoint_interval=2)
    out["checkpointed"] = _run(checkpointed)
    out["wrapped"] = checkpointed.engine.activation_checkpointing.wrapped
    engine = _train_tied()
    out["tied"] = _run(engine)
    engine.training_dataloader, engine._data_iterator = None, None
    try:
        engine.train_batch()
    except ValueError as e:
        out["no_data"] = str(e)
    out["parts"] = engine.module.partitions()
    return out


def test_deepspeed_pipeline_scripts_train_as_one_process():
    ranks = run_distributed(_pipe_worker, 2, timeout_s=120)
    alexnet = reference_alexnet()
    for name, reference in (("alexnet", alexnet), ("checkpointed", alexnet), ("tied", reference_tied())):
        ref_losses, ref_params, ref_eval = reference
        for losses, params, evaluated in (r[name] for r in ranks):
            assert_close_relative(losses, ref_losses)
            assert_params_close({n: params[n] for n in ref_params}, ref_params)
            assert_close_relative([evaluated], [ref_eval])
    ref_losses = reference_loss_in_layers()
    for r in ranks:
        assert_close_relative(r["loss_in_layers"], ref_losses)
    assert ranks[0]["parts"] == [0, 2, 4]
    assert ranks[0]["wrapped"] == [f"layers.{i}" for i in range(11)], "activation_checkpoint_interval > 0 checkpoints"  # type:block puts one Block on each stage, the tied uses apart
    assert all("training_data" in r["no_data"] for r in ranks)


# ---- one process: the cut and the refusals -------------------------------------------------------------------------
def test_partition_methods_cut_as_deepspeed():
    layers = lambda: [nn.Linear(4, 4) for _ in range(5)] + [nn.Linear(4, 40)]  # noqa: E731
    assert PipelineModule(layers(), num_stages=2, partition_method="uniform").partitions() == [0, 3, 6]
    assert PipelineModule(layers(), num_stages=2, partition_method="parameters").partitions() == [0, 5, 6]
    typed = [nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU()]
    assert PipelineModule(typed, num_stages=2, partition_method="type:linear").partitions() == [0, 2, 5]
    with pytest.raises(RuntimeError, match="found no valid layers"):
        PipelineModule(typed, num_stages=2, partition_method="type:conv")
    with pytest.raises(NotImplementedError, match="profile"):
        PipelineModule(typed, num_stages=2, partition_method="profile")
    with pytest.raises(ValueError, match="3 stages need at least 3 layers"):
        PipelineModule(typed[:2], num_stages=3)


def test_refused_options_name_the_fix():
    with pytest.raises(NotInTiers, match="num_stages=N"):
        PipelineModule([nn.Linear(2, 2)] * 2, topology=object())
    with pytest.raises(RuntimeError, match="LayerSpec only supports"):
        LayerSpec(int)
    tied = lambda: TiedLayerSpec("t", nn.Linear, 2, 2)  # noqa: E731
    untied = [tied(), nn.Linear(2, 2), nn.Linear(2, 2), tied()]
    with pytest.raises(NotInTiers, match=r"TiedLayerSpec 't' on stages \[0, 1\] with parameters \['bias'\]"):
        PipelineModule(untied, num_stages=2, partition_method="uniform")
    PipelineModule(untied[:1] + untied[3:] + untied[1:3], num_stages=2, partition_method="uniform")  # one stage: fine


def test_config_and_module_must_agree():
    net = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, loss_fn=F.mse_loss)
    for pipeline, match in (({"stages": 4}, "pipeline.stages is 4"),
                            ({"partition": "uniform"}, "partition_method only"),
                            ({"virtual_stages": 2}, "virtual_stages")):
        with pytest.raises(ValueError, match=match):
            deepspeed.initialize(model=net, config={**CONFIG, "pipeline": pipeline})
    made = deepspeed.pipe.pipeline_config({**CONFIG, "pipeline": {"stages": "auto", "partition": "best",
                                                                  "seed_layers": False}}, net)
    assert made["pipeline"] == {"stages": 2, "partition": ["layers.0", "layers.1"], "seed_layers": False}
    assert "activation_checkpointing" not in made
    made = deepspeed.pipe.pipeline_config({**CONFIG, "pipeline": {"activation_checkpoint_interval": 1}}, net)
    assert made["activation_checkpointing"] == {"enabled": True}  # the config's interval wins, as in DeepSpeed
    with pytest.raises(ValueError, match="num_stages=1"):
        deepspeed.pipe.pipeline_config(CONFIG, PipelineModule([nn.Linear(2, 2)], num_stages=1))


def test_a_stage_boundary_sends_one_tensor():
    pair = lambda x: (x, x)  # noqa: E731
    net = PipelineModule([nn.Linear(2, 2), pair, lambda t: t[0] + t[1]], num_stages=2, partition_method="uniform")
    assert net.partitions() == [0, 2, 3]
    with pytest.raises(ValueError, match="layer 1 ends a pipeline stage and returned tuple"):
        net(torch.zeros(1, 2))


def test_seed_layers_builds_each_layer_from_its_own_seed():
    net = PipelineModule([LayerSpec(nn.Linear, 3, 3), LayerSpec(nn.Linear, 3, 3)], num_stages=2, seed_layers=True,
                         base_seed=7)
    torch.manual_seed(8)
    assert torch.equal(net.layers[1].layer.weight, nn.Linear(3, 3).weight)


def test_seed_layers_reseeds_each_layer_per_forward():
    """DeepSpeed's seed before layer i of the k-th forward: base_seed × (k + 1) + i."""
    net = PipelineModule([nn.Identity(), nn.Dropout(0.5)], num_stages=2, seed_layers=True, base_seed=3)
    x = torch.ones(64)
    for k in (1, 2):
        out = net(x)
        torch.manual_seed(3 * (k + 1) + 1)
        assert torch.equal(out, F.dropout(x, 0.5))
