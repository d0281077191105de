"""One rank of tests/planner/test_ranks.py (launched by torchrun): plan with this rank's injected
headroom and write what it got."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.distributed import barrier, init_distributed, shutdown
from memtrain.planner import make_plan


def main() -> None:
    recipe_path, out_dir, *free = sys.argv[1:]
    recipe = CausalLMRecipe.from_dict(yaml.safe_load(Path(recipe_path).read_text()))
    env = init_distributed()
    spec = CausalLMTrainer(recipe).model_spec()
    result = make_plan(recipe, env, spec, free_bytes=int(free[env.rank]))
    assert result.budget is not None
    (Path(out_dir) / f"rank{env.rank}.json").write_text(
        json.dumps(
            {"digest": result.plan.digest(), "plan": result.plan.to_dict(), "usable": result.budget.usable}
        )
    )
    barrier(env)  # neither rank tears the gloo group down while its peer still talks (an abort at exit)
    shutdown(env)


if __name__ == "__main__":
    main()
