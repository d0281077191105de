"""Ranks agree: two gloo processes that see different free memory plan the same, from the smaller."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memtrain.memory.headroom import SAFETY_FRACTION

from helpers import REPO, run_two_ranks
from planner_cases import cpu_target, plan_on, planner_recipe

FREE = (12_000_000, 5_000_000)  # rank 0 sees more than rank 1


@pytest.mark.distributed
def test_two_ranks_with_different_headroom_pick_the_same_plan(tmp_path: Path) -> None:
    recipe = planner_recipe(tmp_path, memory={"budget": 64_000_000}, strategies={"sharding": "auto"})
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict()))
    run_two_ranks(
        str(REPO / "tests/planner/rank_job.py"), str(recipe_file), str(tmp_path), *map(str, FREE), timeout=300
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    usable = int(min(FREE) * (1 - SAFETY_FRACTION["cpu"]))
    assert ranks[0]["usable"] == ranks[1]["usable"] == usable  # the minimum over ranks
    alone = plan_on(recipe, cpu_target(usable, world_size=2))  # what one process decides for that budget
    assert ranks[0]["plan"] == alone.plan.to_dict()
    assert ranks[0]["plan"]["world_size"] == 2
