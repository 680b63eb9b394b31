"""What initialize resolves once from the config over the mesh, for the engine and its parts to read instead of
deriving it again from the config: the batch sizes, the precision policy, and how parameters are packed into chunks
and sharded (ChunkLayout)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config_checks import OFFLOADED
from engine.config_sections import BatchSizes, Config
from engine.mesh import Mesh
from engine.optim import state_blocks
from engine.precision import PrecisionPolicy
from engine.zero.chunk_layout import ChunkLayout
from engine.zero.policy import ChunkKind, ShardingPolicy
from offload.chunk import DEFAULT_CHUNK_CAPACITY

# reduce_bucket_size defaults to 5e8 elements (DeepSpeed); a chunk that large would leave nothing
# to overlap with backward, so the default chunk is capped (16 MiB of fp32, DDP's bucket scale).
# The first-registered parameters (embeddings) get their gradients last in backward, so the first
# chunk's all-reduce cannot overlap with compute: it is kept at 1/8 of the others.
FIRST_CHUNK_FRACTION = 8


@dataclass(frozen=True)
class RunPlan:
    """The run's batch sizes over the ranks that see different samples, its precision policy, and its chunk layout
    (the parameters' shards on this rank; page_params as the config says, before the model's int8 frozen weights
    are known: Note [int8 frozen chunks])."""

    batch: BatchSizes
    precision: PrecisionPolicy
    chunks: ChunkLayout

    @classmethod
    def of(cls, cfg: Config, mesh: Mesh) -> RunPlan:
        return cls(cfg.batch_sizes(mesh.dp.size), PrecisionPolicy.from_config(cfg), chunk_layout_of(cfg, mesh))


def chunk_layout_of(cfg: Config, mesh: Mesh) -> ChunkLayout:
    """How parameters are packed into chunks and sharded over this rank's ZeRO shard group by the stage's
    ShardingPolicy (Note [sharding policy])."""
    zero, policy = cfg.zero_optimization, ShardingPolicy(cfg.zero_optimization.stage)
    shards = mesh.shard.size if policy.shards(ChunkKind.OPTIM) else 1
    capacity, first_capacity = chunk_layout(cfg, shards)
    return ChunkLayout(capacity, first_capacity, shard_count=shards, shard_rank=mesh.shard.rank if shards > 1 else 0,
                       shard_grads=policy.shards(ChunkKind.GRAD), shard_params=policy.shards(ChunkKind.PARAM),
                       persistence_threshold=persistence_threshold(cfg),
                       compute_dtype=PrecisionPolicy.from_config(cfg).compute_dtype,
                       page_params=zero.offload_param.device in OFFLOADED, page_grads=pages_grads(cfg),
                       offloaded=offloaded_kinds(cfg), fp32_masters=not cfg.bf16.bf16_master_weights_and_grads,
                       state_blocks=state_blocks(cfg.optimizer))


def chunk_layout(config: Config, shards: int = 1) -> tuple[int, int | None]:
    """(capacity, first chunk's capacity): `zero_optimization.chunk_size` for every chunk when given;
    else a small first chunk and the default cap. Both are rounded up to a multiple of `shards`
    (Note [sharding policy]); chunks are trimmed to what they hold (Note [chunk packing])."""
    zero = config.zero_optimization
    if zero.chunk_size is not None:
        return _round_up(zero.chunk_size, shards), None
    target = DEFAULT_CHUNK_CAPACITY
    if zero.reduce_bucket_size != "auto":
        target = min(zero.reduce_bucket_size, target)
    first = _round_up(max(target // FIRST_CHUNK_FRACTION, 1), shards)
    return _round_up(target, shards), first


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def persistence_threshold(cfg: Config) -> int:
    """Stage 3: parameters with fewer elements stay gathered (`auto`: 100,000, DeepSpeed's default)."""
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    return 100_000 if threshold == "auto" else threshold


def offloaded_kinds(cfg: Config) -> frozenset[str]:
    """The chunk kinds a chunk manager will hold (Note [offload policy]): their shards start as placeholders."""
    zero = cfg.zero_optimization
    kinds = {"optim", "grad"} if zero.offload_optimizer.device in OFFLOADED else set()
    return frozenset(kinds | ({"param"} if zero.offload_param.device in OFFLOADED else set()))


def pages_grads(cfg: Config) -> bool:
    """Note [device tier]: offloaded optimizer states at stage 2-3 keep gradient shards with one rank too, so that
    the gradients go to the host with them (Note [paging in one process])."""
    zero = cfg.zero_optimization
    return zero.offload_optimizer.device in OFFLOADED and zero.stage >= 2
