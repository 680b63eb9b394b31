"""deepspeed.moe.layer.MoE: engine.moe.MoE (the same arguments and outputs, Note [expert parallelism]), whose
expert parameters carry DeepSpeed's marks (`allreduce = False`, `group_name`), which
deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer reads."""

from engine.moe.layer import MoE as TiersMoE


class MoE(TiersMoE):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.experts.parameters():
            p.allreduce = False  # DeepSpeed's mark of an expert parameter (reduced over its expert group)
            p.group_name = f"ep_size_{self.ep_size}"
