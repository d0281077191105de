"""The built-in causal-LM trainer's own recipe part: how its model is built (`model.config`,
`model.config_path`, `model.pretrained`, `model.attn_implementation`) and what it trains on (`data:`).

Why here and not in `memtrain.recipe`: those keys mean something only to this trainer. A `Trainer`
subclass with a model of its own reads neither, and its recipe refuses them as unknown keys; it declares
its own sections the same way (`Trainer.recipe_class`, see examples/own_model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from memtrain.recipe import ModelSection, Recipe, RecipeSection, strategy_keys_section


class CausalLMModelSection(ModelSection):
    """`model:` — a transformers causal LM, from a config or a pretrained directory, plus the base
    quantisation every trainer has (generated into `CausalLMModelConfig`)."""

    config: dict[str, Any] | None = Field(
        default=None, description="Inline transformers config: model_type plus fields (built from config)."
    )
    config_path: str | None = Field(default=None, description="Path to a transformers config.json.")
    pretrained: str | None = Field(
        default=None,
        description="A Hugging Face model directory (config.json + safetensors weights, single or sharded) or "
        "a hub id already in the local cache: fine-tune its weights. plan and validate also take a hub id "
        "memtrain has a shape card for (its shapes, no download).",
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"


if TYPE_CHECKING:
    CausalLMModelConfig = CausalLMModelSection
else:
    CausalLMModelConfig = strategy_keys_section("CausalLMModelConfig", CausalLMModelSection, "model")


class SyntheticData(RecipeSection):
    num_samples: int = Field(default=4096, gt=0)
    min_len: int = Field(default=0, ge=0, description="0 means every sample is seq_len+1 tokens.")
    vocab_size: int | None = Field(default=None, gt=1, description="Default: the model's vocab_size.")


class EvalData(RecipeSection):
    """`data.eval`: a validation set of its own, read like the training data (its data.source, kind, fields,
    tokenizer, seq_len and packing). Unset (neither key), the last data.eval_fraction is held out instead."""

    path: str | None = Field(
        default=None,
        description="A file or glob of eval records in data.source's format (default: data.path, with "
        "data.eval.split).",
    )
    split: str | None = Field(
        default=None,
        description="A datasets split to evaluate on, e.g. validation (data.source: dataset; default: "
        "data.split).",
    )

    @property
    def given(self) -> bool:
        """Whether a separate eval set is named (else the held-out data.eval_fraction)."""
        return self.path is not None or self.split is not None


class MixtureSource(RecipeSection):
    """One entry of `data.mixture`: a file (or dataset) of its own kind, and its share of the samples. A key
    left out reads as the `data:` key of the same name (`source`, while that is synthetic: from the path)."""

    path: str = Field(description="The source's file, glob, directory or hub id (as data.path).")
    weight: float = Field(
        default=1.0, gt=0, description="Its share of the training samples (weights are normalised)."
    )
    source: str | None = Field(
        default=None,
        description="text | jsonl | dataset; default: data.source, or when that is synthetic (its default), "
        "jsonl for .jsonl, text for .txt, else dataset.",
    )
    kind: Literal["text", "chat", "prompt_completion"] | None = None
    fields: dict[str, str] | None = None
    jsonl_field: str | None = None
    split: str | None = None


class DataConfig(RecipeSection):
    source: str = Field(
        default="synthetic",
        description="A data source of the built-in trainer (memtrain.causal_lm.sources): synthetic | text | "
        "jsonl | dataset. dataset: through the `datasets` library (data.path: a json/jsonl/parquet/arrow/csv "
        "file, a directory or glob of them, or a hub id in the local cache).",
    )
    path: str | None = None
    jsonl_field: str = "text"
    kind: Literal["text", "chat", "prompt_completion", "preference"] = Field(
        default="text",
        description="text: loss on every token; chat: a messages list rendered with the tokenizer's chat "
        "template, loss on assistant turns; prompt_completion: loss on the completion only; preference: "
        "prompt / chosen / rejected pairs (strings or messages lists), trained with DPO (`preference:`).",
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Column names when they differ from text / messages / prompt / completion, "
        "e.g. {text: body}.",
    )
    split: str = Field(default="train", description="The datasets split to read (source: dataset).")
    streaming: bool = Field(
        default=False, description="Stream the dataset instead of loading it (larger than RAM)."
    )
    tokenizer: str = Field(
        default="byte",
        description='"byte", a tokenizers JSON file, or a Hugging Face tokenizer directory (with its chat template).',
    )
    seq_len: int = Field(default=128, gt=0)
    packing: bool = Field(
        default=True, description="Fixed-length packing; false = one padded document per row."
    )
    pack_mode: Literal["auto", "split", "whole"] = Field(
        default="auto",
        description="How data.packing fills rows. whole: every document (conversation) whole in one row, "
        "rows filled best-fit decreasing; split: documents joined and cut every seq_len tokens (pretraining); "
        "auto: whole for kind chat / prompt_completion, split for text.",
    )
    overlong: Literal["truncate", "drop"] = Field(
        default="truncate",
        description="A document longer than data.seq_len (whole packing, or packing: false): cut to seq_len "
        "tokens, or left out. The count is printed when the data is built.",
    )
    eval_fraction: float = Field(
        default=0.05, ge=0.0, lt=1.0, description="Held out for evaluation when data.eval is unset."
    )
    eval: EvalData = Field(
        default_factory=EvalData,
        description="A separate eval set: {path: FILE_OR_GLOB} and/or {split: NAME}, or just the path; "
        "then no training data is held out.",
    )
    mixture: list[MixtureSource] | None = Field(
        default=None,
        min_length=1,
        description="Several sources mixed by weight, each tokenized by its own kind and fields (instead of "
        "data.path), e.g. [{path: chats.jsonl, weight: 0.7, kind: chat}, {path: notes.txt, weight: 0.3}].",
    )
    synthetic: SyntheticData = SyntheticData()

    @field_validator("eval", mode="before")
    @classmethod
    def _eval_path_alone(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value


class PreferenceConfig(RecipeSection):
    """`preference:` — DPO on `data.kind: preference` pairs (`memtrain.causal_lm.preference`)."""

    beta: float = Field(
        default=0.1, gt=0.0, description="DPO's beta: how far the policy may leave the reference."
    )
    loss_type: Literal["sigmoid"] = Field(default="sigmoid", description="sigmoid: the DPO paper's loss.")
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="cDPO: the share of pairs assumed mislabelled."
    )
    reference: Literal["auto", "copy", "precomputed", "adapter_free"] = Field(
        default="auto",
        description="The frozen reference model: copy (the initial policy in the compute dtype), precomputed "
        "(its log-probabilities of every pair, computed before step 1), adapter_free (LoRA: the base without "
        "the adapters); auto: adapter_free with adapters, else precomputed.",
    )


class CausalLMRecipe(Recipe):
    """A recipe of the built-in causal-LM trainer: every trainer's sections, `model:` widened with how
    the model is built, and `data:`."""

    path_keys: ClassVar[tuple[str, ...]] = (
        *Recipe.path_keys,
        "model.config_path",
        "model.pretrained",
        "data.path",
        "data.eval.path",
        "data.tokenizer",
    )
    sequence_length_key: ClassVar[str | None] = "data.seq_len"

    model: CausalLMModelConfig = CausalLMModelConfig()
    data: DataConfig = DataConfig()
    preference: PreferenceConfig = PreferenceConfig()

    def path_values(self) -> dict[str, Any]:
        """Every trainer's path keys, and the path of each `data.mixture` entry."""
        entries = enumerate(self.data.mixture or [])
        return {**super().path_values(), **{f"data.mixture[{i}].path": e.path for i, e in entries}}

    def cross_checks(self) -> list[str]:
        """Every trainer's checks, and one model source at most (the model config itself is checked in
        `memtrain.causal_lm.trainer.model_problems`)."""
        problems = super().cross_checks()
        if self.model.config is not None and self.model.config_path is not None:
            problems.insert(0, "model: give only one of model.config and model.config_path")
        if self.train.early_stopping is not None and not (self.data.eval.given or self.data.eval_fraction):
            problems.append("train.early_stopping: no eval set; set data.eval or data.eval_fraction above 0")
        return problems + self._preference_problems()

    def _preference_problems(self) -> list[str]:
        """What DPO cannot run: pairs streamed, a loss that never holds the logits, a reference that
        contradicts the adapters (pairs are never packed: data.packing is not read for them)."""
        if self.data.kind != "preference":
            # Values, not the keys given: a saved recipe (recipe.json, a checkpoint's) holds every key.
            defaults = PreferenceConfig()
            changed = [
                k
                for k in PreferenceConfig.model_fields
                if getattr(self.preference, k) != getattr(defaults, k)
            ]
            return (
                [f"preference: set data.kind: preference to train on pairs (or drop preference.{changed[0]})"]
                if changed
                else []
            )
        problems = []
        if self.data.streaming:
            problems.append("data.streaming: preference pairs are read whole; set it to false")
        if self.strategies.loss not in ("auto", "standard"):
            problems.append(
                f"strategies.loss: {self.strategies.loss} never holds the logits DPO reads; use standard"
            )
        lora, reference = self.adapters.kind != "none", self.preference.reference
        if reference == "adapter_free" and not lora:
            problems.append("preference.reference: adapter_free needs adapters (adapters.kind: lora)")
        if reference != "auto" and reference != "adapter_free" and lora:
            problems.append(
                f"preference.reference: {reference} with adapters; the adapter-free base is the reference (use adapter_free or auto)"
            )
        return problems
