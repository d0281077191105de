"""One rank of tests/pretrained/test_pretrained.py (launched by torchrun): set up a pretrained recipe under a
sharded plan, gather the full weights, and (rank 0) write whether they equal the checkpoint's (or, with a
fourth argument `from_pretrained`, transformers' own load of it: names mapped as transformers maps them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.distributed import barrier, shutdown


def full_weights(trainer: CausalLMTrainer) -> dict[str, torch.Tensor]:
    model = trainer.model
    assert model is not None
    if trainer.plan.sharding.backend == "deepspeed":
        import deepspeed

        module = model.module  # type: ignore[union-attr]
        params = dict(module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().clone().float() for name, p in params.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: t.float() for name, t in state.items()}


def main() -> None:
    recipe_path, out, directory = sys.argv[1:4]
    trainer = CausalLMTrainer(CausalLMRecipe.from_dict(yaml.safe_load(Path(recipe_path).read_text())))
    trainer.setup()
    weights = full_weights(trainer)
    if trainer.env.is_main:
        files = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            files.update(load_file(str(file)))
        if sys.argv[4:] == ["from_pretrained"]:
            from transformers import AutoModelForCausalLM

            files = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        compared = {name: bool(torch.equal(files[name].float(), weights[name])) for name in files}
        Path(out).write_text(json.dumps({"compared": compared, "gathered": sorted(weights)}))
    barrier(trainer.env)
    shutdown(trainer.env)


if __name__ == "__main__":
    main()
