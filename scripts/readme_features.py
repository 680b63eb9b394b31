"""The README's feature table ("What is supported"): each row's feature and status from ROWS below, and what it is
not yet built with from the registry of refusals (engine.refusals.REFUSALS), whose every claim a test shows the
config checks make. A refusal naming a row ROWS lacks fails the rendering.

    python scripts/readme_features.py                  # the table, to stdout
    python scripts/readme_features.py --write README.md  # rewrites it between the README's markers
    python scripts/readme_features.py --check README.md  # exits 1 when the README's differs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the engine package is the repo root's
    sys.path.insert(0, str(REPO))

from engine.refusals import REFUSALS, Refusal  # noqa: E402
from scripts.readme_markers import marked_main, replaced  # noqa: E402

MARKERS = ("<!-- feature table -->", "<!-- end feature table -->")


@dataclass(frozen=True)
class Row:
    id: str  # what a Refusal's row names
    feature: str
    status: str  # the refusals of the row follow it, "; " apart


ROWS = (
    Row("api", "`initialize(model, config)`, DeepSpeed-style engine API and config keys; `loss.backward()` then "
        "`step()`", "done"),
    Row("configs", "DeepSpeed configs as they are (0.19 keys, aliases, Hugging Face `\"auto\"`), strict validation "
        "(typos and unbuilt features are errors), `tiers config`",
        "done; [key table](docs/migrating-from-deepspeed.md#every-deepspeed-019-key)"),
    Row("optimizers", "optimizers: Adam, AdamW (`bias_correction`), SGD, Lamb; 1-bit Adam, 0/1 Adam, 1-bit LAMB "
        "(compressed communication); AdamW8bit / AdamW4bit (torchao's block-wise states, sharded, offloaded and "
        "checkpointed like any state)", "done"),
    Row("dp", "data parallelism over chunks (async chunk all-reduce during backward, `no_sync`, accumulation)", "done"),
    Row("precision", "fp16 (dynamic/static loss scaling), bf16; 16-bit chunks with fp32 master weights; DeepSpeed's "
        "bf16 master weights and optimizer states, bf16 stochastic rounding "
        "([configuration](docs/configuration.md#precision))", "done (with every offload)"),
    Row("schedules", "gradient clipping; WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle", "done"),
    Row("zero", "ZeRO stages 1, 2 and 3; `full_state_dict`, `gathered_parameters`; `zero_init`; hybrid sharding "
        "(HSDP, DeepSpeed's `mics_shard_size`)", "done (fp32, bf16, fp16)"),
    Row("chunks", "chunk memory manager with device / CPU / NVMe tiers (`offload/`, usable alone)", "done"),
    Row("offload_optimizer", "`offload_optimizer` cpu / nvme, stages 0–3 (fp32 masters offloaded too, stepped on the "
        "host), `ratio` (stage 3); `step_in_backward`", "done"),
    Row("offload_param", "`offload_param` cpu / nvme (stage 3), one process or many; `layer_major`: `train_batch` "
        "runs the micro-batches block by block, 2 parameter reads per step instead of 2 per micro-batch "
        "([offload](docs/offload.md#layer-major-accumulation))", "done"),
    Row("frozen", "frozen parameters (`requires_grad=False`) in chunks of their own: sharded under stage 3, "
        "offloadable with `offload_param`, never written after the start "
        "([offload](docs/offload.md#frozen-parameters-fine-tuning-a-frozen-base))", "done"),
    Row("hf_architectures", "Hugging Face architectures: 22, MoE included, every feature on, under every strategy "
        "([list and grid](docs/parallelism.md#hugging-face-architectures))",
        "171 of 180 cells equal one process, 9 refused by name"),
    Row("finetuning", "pretrained weights streamed into shards (`from_pretrained` under `zero_init`, "
        "`initialize(weights=...)`); LoRA through PEFT, adapter-only checkpoints, an int8 base (`quantize_frozen`) "
        "([fine-tuning](docs/finetuning.md))", "done"),
    Row("budgets", "`memory.cpu_budget`, `memory.device_budget`, `placement: \"auto\"`",
        "done (the device tier tested as RAM)"),
    Row("tp1d", "tensor parallelism 1D (built-in plans for the example GPT, HF GPT-2, HF Llama; plans derived from "
        "the forward for other models, DeepSpeed's `autotp_size`; dp × tp with ZeRO 0–3)", "done"),
    Row("tp2d", "tensor parallelism 2D (SUMMA on a q × q mesh; built-in plans for the same models, derived plans for "
        "others), with a padding `attention_mask`", "done"),
    Row("tp_grids", "tensor parallelism 2.5D (`depth` q × q grids, the batch split across them, gradients summed "
        "over them) and 3D (a q × q × q cube), ColossalAI's modes, on the 2D layers and plans, with ZeRO 0–3 "
        "([docs](docs/parallelism.md#25d-and-3d))", "done"),
    Row("checkpointing", "activation checkpointing (`model_engine.activation_checkpoint`, `partition_activations`)",
        "done"),
    Row("pipeline", "pipeline parallelism: GPipe, 1F1B, interleaved, zero bubble on unmodified models "
        "(`train_batch`)", "done ([docs](docs/parallelism.md#pipeline-parallelism)); compositions in the grid below"),
    Row("sequence", "sequence parallelism: Ulysses, ring (CPU too), Megatron SP inside 1D TP, on unmodified models",
        "done ([docs](docs/parallelism.md#sequence-parallelism)); compositions below"),
    Row("experts", "mixture of experts: expert parallelism for unmodified HF MoE models and `engine.moe.MoE`, dropless "
        "or capacity routing", "done ([docs](docs/parallelism.md#mixture-of-experts-expert-parallelism)); "
        "compositions below"),
    Row("checkpoints", "sharded checkpoints, resharding on load, `tiers convert`, `save_16bit_model`, async save",
        "done"),
    Row("hf_trainer", "Hugging Face Trainer: `TiersTrainer`, `TiersTrainerMixin` (TRL's trainers), `resolve_config` "
        "for `\"auto\"` values ([docs](docs/hf-trainer.md))", "done for data parallelism and ZeRO 0–3 with offload"),
    Row("lightning", "Lightning: `TiersStrategy` for the Trainer, `TiersFabricStrategy` for Fabric "
        "([docs](docs/lightning.md)); Ray Train workers ([docs](docs/ray.md))",
        "done for data parallelism and ZeRO 0–3"),
    Row("deepspeed_api", "DeepSpeed's Python API: `from engine.compat import deepspeed`, or scripts unchanged under "
        "`tiers launch --as-deepspeed`", "done ([migrating](docs/migrating-from-deepspeed.md)), `PipelineModule` on "
        "Tiers' pipeline included"),
    Row("colossalai_api", "ColossalAI's Booster API: `from engine.compat import colossalai`, or scripts unchanged "
        "under `tiers launch --as-colossalai` (`colossalai run`'s arguments)", "TorchDDP, LowLevelZero, Gemini, "
        "HybridParallel (tp, sp, pp), MoeHybrid and TorchFSDP plugins, sharded model and optimizer files "
        "([migrating](docs/migrating-from-colossalai.md)); pipelines through `execute_pipeline`"),
    Row("launcher", "multi-node launcher `tiers launch` (ssh, pdsh, slurm, local)",
        "done; ssh, pdsh, srun tested up to their command"),
    Row("tensorboard", "TensorBoard logging", "done"),
    Row("estimator", "memory estimator `tiers estimate`, strategy trials `tiers tune`", "done"),
)


class FeatureTableError(Exception):
    pass


def render(rows: tuple[Row, ...] = ROWS, refusals: tuple[Refusal, ...] = REFUSALS) -> str:
    ids = [r.id for r in rows]
    unknown = sorted({r.row for r in refusals} - set(ids))
    if unknown or len(set(ids)) != len(ids):
        raise FeatureTableError(f"refusals naming no row of ROWS: {unknown}; rows named twice: "
                                f"{sorted({i for i in ids if ids.count(i) > 1})}")
    out = ["| feature | status |", "|---|---|"]
    for row in rows:
        claims = "".join(f"; {r.claim}" for r in refusals if r.row == row.id)
        out.append(f"| {row.feature} | {row.status}{claims} |")
    return "\n".join(out)


def current(readme: Path) -> tuple[str, str]:
    """(the README as it is, the README with the table rendered now)."""
    text = readme.read_text(encoding="utf-8")
    return text, replaced(text, MARKERS, render(), readme)


def main(argv: list[str] | None = None) -> int:
    return marked_main(argv, __doc__.split("\n\n")[0], "scripts/readme_features.py", render, current,
                       (FeatureTableError,))


if __name__ == "__main__":
    sys.exit(main())
