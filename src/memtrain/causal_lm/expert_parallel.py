"""The built-in causal-LM trainer's expert-parallel plan: the transformers MoE families' experts modules.

Why a plan of ours, not transformers' own `base_model_ep_plan` (`grouped_gemm` on the stacked weights,
`ep_dispatch_experts` on the module): that plan is applied by transformers' `DistributedConfig` path, which
shards the experts itself (`distribute_tensor` on its own EP mesh) and composes with its own FSDP, not with
the run's one `DeviceMesh` and FSDP2 groups that `apply_strategies` builds; and its all-to-all (`AllToAllEP`)
exchanges the counts inline, where the planner's rank trace, under torch's fake process group, must say how
many rows each rank receives (`memtrain.strategies.expert_parallel.counts_from`). What is read from
transformers is the same knowledge: which module holds the experts (its `gate_up_proj` and `down_proj`
stacked over `num_experts`, the modules `base_model_ep_plan` names) and how it is called (after the family's
router, with the top-k ids and weights), and each rank's experts are run by the family's own forward.
Shared experts (qwen2_moe's `shared_expert`) are ordinary weights: data parallel like any other.

The router's load-balancing loss (`router_loss`) is part of the training loss when the config asks for it
(`output_router_logits`), as transformers adds it: `router_aux_loss_coef` x the family's
`load_balancing_loss_func` over one forward's routing, so per micro-batch. The loop divides a micro-batch's
summed loss by the global step's tokens, so the loss hook adds it times the micro-batch's tokens: the step's
term is the token-weighted mean of the micro-batches' router losses, the same on one process and on any
mesh that runs the same micro-batches (the routing happens on each rank, before the dispatch), and the same
under accumulation. (Its product of two means over the routed tokens is not a sum over tokens, so no
split of a micro-batch's rows computes the same value: a micro-batch is its unit, as in transformers.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.strategies.expert_parallel import ExpertLayer, grouped_forward


def stacked_forward(module: nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`run_local` for the standard layout (`gate_up_proj` [gate; up] and `down_proj`, no bias): each local
    expert's rows through its projections, one slice per expert, as the family's eager forward computes
    them, with no value-dependent shape (the rank trace runs it on fake tensors)."""
    out = []
    for expert, piece in enumerate(rows.split(counts)):
        gate, up = F.linear(piece, module.gate_up_proj[expert]).chunk(2, dim=-1)  # type: ignore[index]
        out.append(F.linear(module.act_fn(gate) * up, module.down_proj[expert]))  # type: ignore[index,operator]
    return torch.cat(out)


def _standard(module: nn.Module) -> bool:
    """transformers' default experts layout (`use_experts_implementation`'s flags), with an `act_fn`."""
    flags = (getattr(module, f, d) for f, d in (("has_gate", True), ("is_concatenated", True)))
    plain = not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
    return all(flags) and plain and hasattr(module, "act_fn")


def family_layers(model: nn.Module, ep: int) -> list[ExpertLayer]:
    """The transformers MoE families' experts modules (`gate_up_proj` and `down_proj` stacked over
    `num_experts`, called with the family's top-k routing), each run by its own forward on local experts."""
    layers = []
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        count = getattr(module, "num_experts", None)
        if isinstance(count, int) and {"gate_up_proj", "down_proj"} <= set(params):
            if all(p.dim() == 3 and p.shape[0] == count for p in params.values()):
                layers.append(
                    ExpertLayer(module, count, stacked_forward if _standard(module) else grouped_forward)
                )
                if count % ep == 0:
                    module.num_experts = count // ep  # type: ignore[assignment]  # its forward's one-hot width
    return layers


def router_loss(output: Any, config: Any, tokens: torch.Tensor) -> torch.Tensor | float:
    """The forward's load-balancing loss (`aux_loss`, computed by the family when the config's
    `output_router_logits` is set) x `router_aux_loss_coef` x the micro-batch's loss tokens; 0 without one."""
    aux = getattr(output, "aux_loss", None)
    if not isinstance(aux, torch.Tensor):
        return 0.0
    return aux * float(getattr(config, "router_aux_loss_coef", 0.0)) * tokens
