"""What initialize resolves once from the config over the mesh, for the engine and its parts to read instead of
deriving it again from the config."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config_sections import BatchSizes, Config
from engine.mesh import Mesh
from engine.precision import PrecisionPolicy


@dataclass(frozen=True)
class RunPlan:
    """The run's batch sizes over the ranks that see different samples, and its precision policy."""

    batch: BatchSizes
    precision: PrecisionPolicy

    @classmethod
    def of(cls, cfg: Config, mesh: Mesh) -> "RunPlan":
        return cls(cfg.batch_sizes(mesh.dp.size), PrecisionPolicy.from_config(cfg))
