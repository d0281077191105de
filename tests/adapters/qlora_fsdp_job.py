"""One QLoRA run on two gloo ranks for tests/adapters/test_qlora_fsdp.py:
`torchrun --nproc_per_node=2 tests/adapters/qlora_fsdp_job.py RECIPE.json OUT.json`.

Each rank plans (`choose_plan`: the planner's per-rank states and peak), trains, and measures what it holds:
the bytes of its shards of the quantised base (the packed uint8 storage FSDP2 allocated), every parameter's
local storage with the quantisation states beside them (what the plan's stored weights count), and the
tracker's peak. Rank 0 writes every rank's numbers, the losses, the trained adapters (whole, fp32) and the
plan (for the rank trace to trace it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def quant_state_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes 4-bit layer's quantisation state (kept on the module under FSDP2)."""
    state = getattr(module, "quant_state", None)
    if state is None:
        return []
    tensors = [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
    nested = getattr(state, "state2", None)
    return tensors + ([t for t in vars(nested).values() if isinstance(t, torch.Tensor)] if nested else [])


def held(model: torch.nn.Module) -> dict[str, int]:
    """This rank's bytes: `packed`, its shards of the quantised weights; `stored`, every parameter's local
    storage plus the quantisation states, each storage once."""
    seen: set[int] = set()
    packed = stored = 0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tensor = local(param)
            key = tensor.untyped_storage().data_ptr()
            if key in seen:
                continue
            seen.add(key)
            stored += tensor.untyped_storage().nbytes()
            if name == "weight" and tensor.dtype == torch.uint8:
                packed += tensor.untyped_storage().nbytes()
        for tensor in quant_state_tensors(module):
            if (key := tensor.untyped_storage().data_ptr()) not in seen:
                seen.add(key)
                stored += tensor.untyped_storage().nbytes()
    return {"packed": packed, "stored": stored}


def main() -> None:
    raw = json.loads(Path(sys.argv[1]).read_text())
    trainer = CausalLMTrainer(CausalLMRecipe.from_dict(raw))
    result = trainer.choose_plan()
    assert result.chosen is not None and result.predicted is not None
    fitted = trainer.fit()
    assert trainer.model is not None
    mine: dict[str, Any] = {
        **held(trainer.model),
        "predicted_stored": result.chosen.states.stored[0],
        "predicted_peak": result.predicted.peak,
        "measured_peak": trainer.monitor.memory_reports[-1].peak_bytes,
        "sharding": result.chosen.plan.sharding.name,
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    adapters = {
        n: local(p.full_tensor() if isinstance(p, DTensor) else p).detach().float().tolist()
        for n, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    if dist.get_rank() == 0:
        plan = result.chosen.plan.to_dict()
        out = {"ranks": ranks, "losses": fitted.losses, "adapters": adapters, "plan": plan}
        Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
