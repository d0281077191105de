"""A new strategy is one file plus one registry line: the toy `every-other` checkpointing mode
(toy_every_other.py) is registered, then validated by the recipe schema, planned and applied by the
trainer, with no other file edited."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError
from memtrain.recipe import Recipe
from memtrain.strategies.catalog import free_keys
from memtrain.strategies.checkpointing import CHECKPOINTING

from helpers import tiny_recipe
from toy_every_nth import EveryNthBlock
from toy_every_other import EveryOtherBlock

pytestmark = pytest.mark.usefixtures("shared_traces")  # tests/conftest.py: they plan alike jobs

MODEL = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


@pytest.fixture
def registered() -> Iterator[None]:
    CHECKPOINTING.register(EveryOtherBlock)  # the one registry line
    yield
    CHECKPOINTING.unregister(EveryOtherBlock.name)


def _recipe(tmp_path: Path, checkpointing: str, **options: object):  # type: ignore[no-untyped-def]
    return tiny_recipe(
        tmp_path / checkpointing,
        model={"config": MODEL},
        memory={"track": True},
        data={"seq_len": 32, "synthetic": {"num_samples": 64, "min_len": 0}},
        batch={"global_size": 8, "micro_size": "auto"},
        train={"steps": 3},
        strategies={"checkpointing": checkpointing, **options},
    )


def test_unregistered_name_is_a_recipe_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="strategies.checkpointing: 'every-other' is not one of"):
        _recipe(tmp_path, "every-other")


@pytest.mark.usefixtures("registered")
def test_toy_strategy_is_planned_and_applied(tmp_path: Path) -> None:
    assert (
        "every-other"
        in CausalLMRecipe.editor_schema()["$defs"]["StrategiesConfig"]["properties"]["checkpointing"][
            "anyOf"
        ][0]["enum"]
    )
    trainer = CausalLMTrainer(_recipe(tmp_path, "every-other"))
    result = trainer.choose_plan()
    assert isinstance(result.plan.checkpointing, EveryOtherBlock)
    assert result.predicted is not None
    trainer.setup()
    wrapped = [getattr(block, "_memtrain_checkpointing", None) for block in trainer.blocks(trainer.model)]
    assert wrapped == ["every-other", None, "every-other", None], "the trainer applied it to blocks 0 and 2"
    fitted = trainer.fit()
    measured = trainer.monitor.memory_reports[-1].peak_bytes
    assert abs(result.predicted.peak - measured) / measured < 0.02, (result.predicted.peak, measured)

    plain = CausalLMTrainer(_recipe(tmp_path, "none"))
    reference = plain.fit()
    assert fitted.losses == reference.losses, "recompute is exact: the same losses as without checkpointing"
    saved = plain.monitor.memory_reports[-1].at_peak["activations"]
    assert trainer.monitor.memory_reports[-1].at_peak["activations"] < saved, "it keeps fewer activations"


@pytest.mark.usefixtures("registered")
def test_auto_offers_the_toy_strategy(tmp_path: Path) -> None:
    trainer = CausalLMTrainer(_recipe(tmp_path, "auto"))
    result = trainer.choose_plan()
    offered = {s.plan.checkpointing.name for s in (*result.ranked, *result.infeasible)}
    assert "every-other" in offered and "none" in offered


def test_a_new_strategy_option_is_a_recipe_key_declared_once(tmp_path: Path) -> None:
    """The option's one declaration (toy_every_nth.py) makes the recipe key, its bounds, its schema entry
    and its place among the keys a resume may change; removing the strategy removes the key."""
    CHECKPOINTING.register(EveryNthBlock)  # the one registry line
    try:
        for recipe_class in (Recipe, CausalLMRecipe):  # every trainer's recipe, and a recipe part
            strategies = recipe_class.editor_schema()["$defs"]["StrategiesConfig"]["properties"]
            assert strategies["checkpointing_stride"]["default"] == 2
        assert "strategies.checkpointing_stride" in free_keys()
        with pytest.raises(RecipeError, match="strategies.checkpointing_stride"):
            _recipe(tmp_path, "every-nth", checkpointing_stride=0)
        trainer = CausalLMTrainer(_recipe(tmp_path, "every-nth", checkpointing_stride=3))
        trainer.setup()
        assert trainer.plan.checkpointing == EveryNthBlock(stride=3)
        wrapped = [getattr(block, "_memtrain_checkpointing", None) for block in trainer.blocks(trainer.model)]
        assert wrapped == ["every-nth", None, None, "every-nth"], "blocks 0 and 3 recompute"
        trainer.close()
    finally:
        CHECKPOINTING.unregister(EveryNthBlock.name)
    with pytest.raises(RecipeError, match="strategies.checkpointing_stride: unknown key"):
        _recipe(tmp_path, "none", checkpointing_stride=3)
