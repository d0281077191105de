"""A transformers config's expert routing, for the planner (`ModelSpec.experts`).

Why here: the planner sees shapes, and the shapes say how many experts a layer holds but not how many each
token picks, which is what the routed load of an expert-parallel rank follows (planner/expert_parallel.py).
The families name these fields differently: the experts count (`num_local_experts` in Mixtral and gpt-oss,
`num_experts` in Qwen-MoE, `n_routed_experts` in DeepSeek), each expert's intermediate size
(`moe_intermediate_size`, else the dense `intermediate_size` a Mixtral expert has).
"""

from __future__ import annotations

from typing import Any

from memtrain.planner.expert_parallel import ExpertRouting

EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def expert_routing(config: Any) -> ExpertRouting | None:
    """The routing of `config`'s MoE layers; None for a dense model (no experts count, or one expert)."""
    experts = next(
        (v for v in (getattr(config, n, None) for n in EXPERT_COUNTS) if isinstance(v, int) and v > 1), None
    )
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts is None or not isinstance(top_k, int) or top_k < 1:
        return None
    intermediate = getattr(config, "moe_intermediate_size", None) or getattr(
        config, "intermediate_size", None
    )
    return ExpertRouting(
        experts=experts, top_k=top_k, hidden=int(config.hidden_size), intermediate=int(intermediate or 0)
    )
