"""The built-in causal-LM trainer over any `transformers` causal-LM config.

Models are always built from a config (inline in the recipe, or a local config.json), never from a
hub. Config mistakes are caught before anything is built: an unknown `model_type` or an unknown field
gets a did-you-mean (transformers itself would silently keep a misspelt field and build the default
size), and the sequence length is checked against the model's maximum.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Set
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtrain.causal_lm import config_values, data_checks, pretrained
from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import tokenizer as tokenizer_lib
from memtrain.causal_lm.expert_parallel import family_layers, router_loss
from memtrain.causal_lm.experts import expert_routing
from memtrain.causal_lm.pipeline import pipeline_problems, split_causal_lm
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.tensor_parallel import causal_lm_plan, tensor_parallel_problems
from memtrain.errors import RecipeError, Unsupported, did_you_mean, shortened
from memtrain.jsonfile import read_json_object
from memtrain.planner import ModelSpec
from memtrain.recipe import Recipe
from memtrain.strategies.expert_parallel import ExpertLayer
from memtrain.strategies.loss import bound_loss
from memtrain.training.trainer import Batch, Trainer


def config_dict(recipe: CausalLMRecipe) -> tuple[dict[str, Any], str]:
    """The raw config mapping and the recipe key it came from."""
    m = recipe.model
    given = [
        key
        for key, value in (
            ("model.config", m.config),
            ("model.config_path", m.config_path),
            ("model.pretrained", m.pretrained),
        )
        if value is not None
    ]
    if not given:
        raise RecipeError(
            [
                "model: give model.pretrained (a Hugging Face model directory or cached hub id), model.config "
                "(inline, with model_type) or model.config_path (or train your own Trainer subclass: memtrain "
                "train RECIPE --trainer FILE.py:Class)"
            ]
        )
    if len(given) > 1:
        raise RecipeError([f"model: give only one of {' and '.join(given)}"])
    if m.config is not None:
        return dict(m.config), "model.config"
    if m.pretrained is not None:
        directory = pretrained_directory(recipe)
        return read_json_object(str(directory / "config.json"), "model.pretrained"), "model.pretrained"
    assert m.config_path is not None
    return read_json_object(m.config_path, "model.config_path"), "model.config_path"


def pretrained_directory(recipe: CausalLMRecipe, weights: bool = False) -> Path:
    """The checked model directory of `model.pretrained`: its config.json (shapes: what planning and
    validation read, fetched alone for a hub id when it is not cached and the hub is reachable), and with
    `weights` its safetensors too (`RecipeError` naming the key otherwise)."""
    assert recipe.model.pretrained is not None
    directory = pretrained.resolve(recipe.model.pretrained, fetch_config=not weights)
    if weights:
        pretrained.check_directory(directory)
    else:
        pretrained.check_config(directory)
    return directory


def weights_note(recipe: CausalLMRecipe) -> str:
    """What `memtrain validate` adds to its line for a config-only `model.pretrained` ("" otherwise): it
    plans and validates, and `train` refuses it until the weights are there."""
    if not config_only(recipe):
        return ""
    unchecked = ", and data.tokenizer is not there: the data is not checked" if shapes_only(recipe) else ""
    return f"; model.pretrained: config.json only, `train` needs its weights{unchecked}"


def config_only(recipe: CausalLMRecipe) -> bool:
    """Whether `model.pretrained` names a config.json without weights (plan and validate only)."""
    if recipe.model.pretrained is None:
        return False
    try:
        return not pretrained.has_weights(pretrained_directory(recipe))
    except RecipeError:  # reported by `build_config`
        return False


def build_config(recipe: CausalLMRecipe) -> Any:
    """A `transformers.PretrainedConfig` for the recipe's model; `RecipeError` lists every problem."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw, key = config_dict(recipe)
    if recipe.model.pretrained is not None:  # a saved config: transformers reads it as it wrote it
        try:
            return AutoConfig.from_pretrained(
                str(pretrained_directory(recipe)), local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError, KeyError) as exc:
            raise RecipeError(
                [f"model.pretrained: its config.json is not a transformers config ({exc})"]
            ) from None
    if "auto_map" in raw:  # classes from a hub repository's own Python files
        raise RecipeError(
            [
                f"{key}.auto_map: memtrain never runs a model's own code; remove it (model_type picks the class)"
            ]
        )
    model_type = raw.pop("model_type", None)
    raw.pop("architectures", None)
    raw.pop("transformers_version", None)
    if not isinstance(model_type, str):
        raise RecipeError([f"{key}.model_type: required (e.g. llama, gpt2, mistral, qwen2)"])
    if model_type not in CONFIG_MAPPING:
        hint = did_you_mean(model_type, CONFIG_MAPPING.keys())
        raise RecipeError(
            [f"{key}.model_type: unknown transformers model type {shortened(model_type)}{hint}"]
        )
    bad = [
        f"{key}.{name}: must be a positive integer or a per-layer list of them (got {shortened(raw[name])})"
        for name in config_values.SIZES
        if raw.get(name) is not None and not config_values.positive(raw[name])
    ]
    # before transformers, whose own checks would not name the field (or would pass)
    bad = bad or _head_problems(raw, key)
    if bad:
        raise RecipeError(bad)
    vocab = raw.get("vocab_size")
    if isinstance(vocab, int):
        # Small-vocabulary configs inherit e.g. GPT-2's token id 50256; memtrain does not use these ids
        # (labels carry the targets), so out-of-range defaults are dropped rather than warned about.
        default_ids = AutoConfig.for_model(model_type)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(default_ids, name, None)
            if name not in raw and isinstance(value, int) and value >= vocab:
                raw[name] = None
    try:
        config = AutoConfig.for_model(model_type, **raw)
    except Exception as exc:  # ValueError, TypeError, or huggingface_hub's strict-dataclass validation errors
        text = " ".join(str(exc).split())
        field = re.match(r"Validation error for field '(\w+)'", text)
        where = f"{key}.{field.group(1)}" if field else key
        raise RecipeError([f"{where}: the {model_type} config rejects these values ({text[:300]})"]) from None
    # transformers keeps a field it does not know as a plain attribute (a misspelt num_hidden_layers
    # would silently build the default depth); legacy fields it understands (rope_theta) it consumes.
    default = AutoConfig.for_model(model_type)
    unknown = [
        f for f in raw if not _has_field(default, f) and _has_field(config, f) and f not in _ALWAYS_ACCEPTED
    ]
    if unknown:
        known = [a for a in dir(default) if not a.startswith("_")]
        raise RecipeError(
            [
                f"{key}.{f[:80]}: not a field of the {model_type} config{did_you_mean(f, known)}"
                for f in unknown
            ]
        )
    return config


def _has_field(config: Any, name: str) -> bool:
    """`hasattr`, where a per-layer field of a heterogeneous config (Gemma-4), whose global read transformers
    refuses with a RuntimeError (AmbiguousGlobalPerLayerAttributeError), is a field too."""
    try:
        return hasattr(config, name)
    except RuntimeError:
        return True


# Head counts that must divide: (the divided size, the count) under the names of the common configs. A
# config with its own head_dim may have hidden_size != heads x head_dim (e.g. Gemma, Qwen3).
_DIVISIONS = (
    ("hidden_size", "num_attention_heads"),
    ("n_embd", "n_head"),
    ("num_attention_heads", "num_key_value_heads"),
)


def _head_problems(raw: dict[str, Any], key: str) -> list[str]:
    """Head counts that do not divide: torch would fail in the first forward with a shape error."""
    problems = []
    for size, count in _DIVISIONS:
        total, heads = raw.get(size), raw.get(count)
        if size != "num_attention_heads" and raw.get("head_dim") is not None:
            continue
        if isinstance(total, int) and isinstance(heads, int) and total % heads:
            problems.append(
                f"{key}.{count}: {heads} does not divide {key}.{size} ({total}); each head needs an equal share"
            )
    return problems


# Fields every transformers config takes even when the default instance lacks the attribute.
_ALWAYS_ACCEPTED = {
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
}


def max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_model_recipe(recipe: CausalLMRecipe) -> None:
    """`RecipeError` listing every problem of `model_problems`."""
    problems = model_problems(recipe)
    if problems:
        raise RecipeError(problems)


def model_problems(recipe: CausalLMRecipe) -> list[str]:
    """Every problem of the model config, the data, and the two together (sequence length, vocabulary):
    the data is checked even when the model config is wrong, so one pass reports both."""
    try:
        config, problems = build_config(recipe), []
    except RecipeError as exc:
        config, problems = None, exc.problems
    with_tokenizer = not shapes_only(recipe)
    data_problems = data_checks.data_problems(recipe.data, tokenizer=with_tokenizer)
    problems += data_problems
    if config is None:
        return problems
    _, key = config_dict(recipe)
    built = config_values.value_problems(config, key) + _attention_problems(recipe, config)
    if not built:  # what `train` builds, on the meta device: a value transformers takes but cannot build
        problem = config_values.build_problem(config, key, recipe.model.attn_implementation)
        built = [problem] if problem is not None else []
    problems += built
    tp = recipe.strategies.mesh.tp
    problems += tensor_parallel_problems(config, tp) if isinstance(tp, int) else []
    pp = recipe.strategies.mesh.pp
    problems += pipeline_problems(config, pp, recipe) if isinstance(pp, int) else []
    problems += _context_parallel_problems(recipe)
    if recipe.data.kind == "preference" and tp != 1:
        problems.append(
            "strategies.mesh.tp: preference training reads log-probabilities from whole logits, which tensor "
            "parallelism shards by vocabulary; set strategies.mesh.tp: 1"
        )
    limit = max_positions(config)
    if limit is not None and recipe.data.seq_len > limit:
        problems.append(
            f"data.seq_len: {recipe.data.seq_len} exceeds the model's maximum of {limit} positions "
            "(lower data.seq_len or raise the model config's max_position_embeddings / n_positions)"
        )
    vocab = getattr(config, "vocab_size", None)
    data_ok = with_tokenizer and not any(
        p.startswith(("data.tokenizer", "data.source")) for p in data_problems
    )
    data_vocab = data_checks.vocabulary(recipe.data) if data_ok else None
    if isinstance(vocab, int) and data_vocab is not None and data_vocab.size > vocab:
        _, key = config_dict(recipe)
        field = "model.config.vocab_size" if key == "model.config" else f"{key} (its vocab_size)"
        problems.append(
            f"{field}: {vocab} is smaller than {data_vocab.described}; ids past the vocabulary "
            "would fail in the embedding"
        )
    return problems


def shapes_only(recipe: CausalLMRecipe) -> bool:
    """A config-only `model.pretrained` whose `data.tokenizer` is not there either (a hub id or directory
    with no tokenizer files, e.g. the same config-only one): `plan` and `validate` take the shapes from
    the config (its `vocab_size`) and check no data that needs the tokenizer; `train` refuses the missing
    weights first."""
    return config_only(recipe) and tokenizer_lib.absent(recipe.data.tokenizer)


def _attention_problems(recipe: CausalLMRecipe, config: Any) -> list[str]:
    """`model.attn_implementation: sdpa` on a family transformers builds without SDPA (Gemma-2's
    soft-capping, state-space models): transformers would refuse it when the model is built, a traceback
    in `train` and `plan` that `validate` did not see."""
    if recipe.model.attn_implementation != "sdpa":
        return []
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None or getattr(model_class, "_supports_sdpa", True):
        return []
    default = "" if "attn_implementation" in recipe.model.model_fields_set else " (the default)"
    return [
        f"model.attn_implementation: sdpa{default}, but transformers builds {model_class.__name__} "
        "without SDPA attention; set model.attn_implementation: eager"
    ]


def _context_parallel_problems(recipe: CausalLMRecipe) -> list[str]:
    """What the built-in trainer cannot split over context-parallel ranks (memtrain.strategies.
    context_parallel): the ring replaces SDPA alone, attends causally over whole rows, and each rank sums
    the loss of its own tokens."""
    cp = recipe.strategies.mesh.cp
    if not isinstance(cp, int) or cp == 1:  # auto: the mesh the planner picks is checked as it runs
        return []
    problems = []
    if recipe.model.attn_implementation != "sdpa":
        problems.append(
            f"model.attn_implementation: {recipe.model.attn_implementation} with strategies.mesh.cp={cp}: "
            "context parallelism runs torch's SDPA as a ring; set model.attn_implementation: sdpa"
        )
    if data_lib.carries_positions(recipe.data):
        problems.append(
            f"data.packing: packed rows mask attention per document, which context parallelism "
            f"(strategies.mesh.cp={cp}) cannot (its ring attends causally over the whole row); set "
            "data.packing: false or strategies.mesh.cp: 1"
        )
    if recipe.data.kind == "preference":
        problems.append(
            f"strategies.mesh.cp: preference training sums each completion's log-probabilities over its whole "
            f"row, which {cp} context-parallel ranks split; set strategies.mesh.cp: 1"
        )
    return problems


# Config fields of transformers families whose logits are not `head(hidden)`: (field, the value that
# means no post-processing). The chunked and fused losses apply the bare head, so they refuse these.
_LOGIT_POSTPROCESSING = (
    ("final_logit_softcapping", None),  # Gemma-2/3: tanh soft-capping
    ("logit_scale", 1.0),  # Cohere
    ("logits_scaling", 1.0),  # Granite: logits / scaling
    ("output_multiplier_scale", 1.0),  # Falcon-H1: logits * scale
)


def check_bare_head_loss(config: Any, loss: str) -> None:
    """`Unsupported` when the model post-processes its logits, which `strategies.loss=<loss>` (chunked or
    fused: the bare head applied to the hidden states) would not reproduce."""
    for field, plain in _LOGIT_POSTPROCESSING:
        value = getattr(config, field, plain)
        if value is not None and value != plain:
            raise Unsupported(
                f"strategies.loss: {loss} applies the bare output head, but this {config.model_type} model "
                f"post-processes its logits ({field}={value}); use strategies.loss=standard"
            )


class CausalLMTrainer(Trainer):
    """Trains a transformers causal LM built from the recipe's config on the recipe's data."""

    recipe_class = CausalLMRecipe
    recipe: CausalLMRecipe

    def __init__(self, recipe: Recipe) -> None:
        adopted = CausalLMRecipe.adopt(recipe)
        check_model_recipe(adopted)
        if adopted.data.kind == "preference" and type(self) is CausalLMTrainer:  # the commands pick it
            raise RecipeError(
                ["data.kind: preference trains with memtrain.causal_lm.preference.PreferenceTrainer"]
            )
        super().__init__(recipe)
        self.model_config = build_config(self.recipe)
        self._data: data_lib.Splits | None = None
        self._sampler: data_lib.Sampler | None = None
        self._per_block: int | None = None  # config layers per block (`_layers_per_block`)

    @classmethod
    def recipe_problems(cls, recipe: Recipe, skip: Set[str] = frozenset()) -> list[str]:
        """The model config, the data and the two together (`model_problems`), unless either section
        failed validation."""
        return [] if {"model", "data"} & skip else model_problems(CausalLMRecipe.adopt(recipe))

    @property
    def data(self) -> data_lib.Splits:
        """The tokenized train and eval samples, built on first use (planning a what-if needs none)."""
        if self._data is None:
            recipe = self.recipe
            self._data = data_lib.build_splits(
                recipe.data,
                int(self.model_config.vocab_size),
                recipe.run.seed,
                env=self.env,
                global_batch=recipe.batch.global_size,
                eval_rows=recipe.batch.global_size * recipe.train.eval_batches,
            )
            if self._data.stream is None and len(self._data.train) < recipe.batch.global_size:
                raise RecipeError(
                    [
                        f"batch.global_size: {recipe.batch.global_size} exceeds the {len(self._data.train)} "
                        "training samples of data (lower it, or use more data / a shorter data.seq_len)"
                    ]
                )
        return self._data

    def setup(self) -> None:
        if self.recipe.model.pretrained is not None:  # a config.json alone plans, but trains nothing
            pretrained_directory(self.recipe, weights=True)
        _ = self.data  # tokenize before the model and the tracker exist (what `host_data_bytes` counts)
        self.run.keep_tokenizer(tokenizer_lib.directory_files(self.recipe.data.tokenizer))  # for export
        if self._plan is None:
            self.choose_plan()
        if self.plan.loss.applies_bare_head:  # a pinned loss this model cannot use: before building it
            check_bare_head_loss(self.model_config, self.plan.loss.name)
        super().setup()

    @property
    def train_samples(self) -> list[data_lib.Sample]:
        return self.data.train

    @property
    def eval_samples(self) -> list[data_lib.Sample]:
        return self.data.eval

    @property
    def sampler(self) -> data_lib.Sampler:
        if self._sampler is None:
            self._sampler = data_lib.sampler_for(
                self.data, self.recipe.batch.global_size, self.recipe.run.seed
            )
        return self._sampler

    def build_model(self) -> nn.Module:
        """The model of the config; with `model.pretrained`, its parameters on the meta device (buffers real)
        until `load_weights` fills what this rank's plan keeps."""
        if self.recipe.model.pretrained is None:
            return self._from_config(self.model_config)
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = self._from_config(self.model_config)
        tie = getattr(model, "tie_weights", None)  # meta parameters are created untied; the checkpoint
        if callable(tie):  # stores a tied one once
            tie()
        return model

    def load_weights(self, model: nn.Module) -> None:
        if self.recipe.model.pretrained is not None:
            directory = pretrained_directory(self.recipe, weights=True)
            pretrained.load_weights(model, directory, skip=self.plan.adapters.owns)

    def build_model_clone(self, num_blocks: int) -> nn.Module:
        """The model with `num_blocks` blocks (per-layer lists cut to match), for the planner's traces."""
        return self._from_config(self._clone_config(num_blocks))

    def _clone_config(self, num_blocks: int) -> Any:
        """The config of a `num_blocks`-block model. Its per-layer lists (`layer_types`, `mlp_layer_types`,
        ...; not those a property derives from the depth) keep the model's first and last block and, between
        them, blocks of the commonest kind among the model's middle ones: a hybrid's clone is laid out like
        the model it stands for (a clone of its first layers could miss the attention layer entirely)."""
        clone = copy.deepcopy(self.model_config)
        field = _depth_field(clone)
        depth = int(getattr(clone, field))
        per_layer = {
            name: value
            for name, value in vars(clone).items()
            if isinstance(value, list) and len(value) == depth
        }
        per_block = self._layers_per_block()
        kinds = [
            tuple(
                str(values[i])
                for values in per_layer.values()
                for i in range(b * per_block, (b + 1) * per_block)
            )
            for b in range(depth // per_block)
        ]
        layers = [b * per_block + j for b in _clone_blocks(kinds, num_blocks) for j in range(per_block)]
        setattr(clone, field, len(layers))
        for name, value in per_layer.items():
            setattr(clone, name, [value[i] for i in layers])
        return clone

    def _layers_per_block(self) -> int:
        """Config layers per block: 1, except in a family whose block holds several (Dory: an attention and
        an MLP layer per block), where a clone of n blocks needs n times as many layers."""
        if self._per_block is None:
            with torch.device("meta"):
                blocks = len(self.blocks(self._from_config(self.model_config)))
            depth = int(getattr(self.model_config, _depth_field(self.model_config)))
            self._per_block = depth // blocks if blocks and depth % blocks == 0 else 1
        return self._per_block

    def _from_config(self, config: Any, attn_implementation: str | None = None) -> nn.Module:
        from transformers import AutoModelForCausalLM

        override = getattr(self, "_attention_override", None)  # `_traced_build`
        attention = attn_implementation or override or self.recipe.model.attn_implementation
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention, dtype=torch.float32, trust_remote_code=False
        )
        _freeze_cross_attention(model)
        return model

    def planning_batch(self, rows: int) -> Batch:
        """Rows of the full sequence length (the longest any step can feed), as `collate` lays them out:
        packed rows carry two documents each, so the batch has the real run's `position_ids`."""
        vocab, seq_len = int(self.model_config.vocab_size), self.recipe.data.seq_len
        generator = torch.Generator().manual_seed(0)
        starts = None
        if data_lib.carries_positions(self.recipe.data):
            starts = torch.zeros(seq_len, dtype=torch.bool)
            starts[seq_len // 2] = True
        samples = []
        for _ in range(rows):
            tokens = torch.randint(0, vocab, (seq_len + 1,), generator=generator)
            samples.append(data_lib.Sample(tokens[:-1], tokens[1:], starts))
        return data_lib.collate(samples, list(range(rows)))

    def host_data_bytes(self) -> int:
        """The token storage of the training samples (the storages behind them, each once), or of a
        stream's shuffle buffer."""
        if self.data.stream is not None:
            return self.data.stream.host_bytes()
        tensors = [t for s in self.train_samples for t in s.tensors()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def model_spec(self) -> ModelSpec:
        """The built-in hooks, with the traced model on `trace_sdpa()` when the recipe runs `sdpa` on rows of
        one sequence each (packed rows build the 4-D document mask, as the plain `sdpa` model does)."""
        spec = dataclasses.replace(
            super().model_spec(),
            name=str(self.model_config.model_type),
            trace_key=self._trace_key(),
            tensor_parallel_problems=lambda tp: tensor_parallel_problems(self.model_config, tp),
            experts=expert_routing(self.model_config),
        )
        self._layers_per_block()  # now, on the meta device: clones are built under the trace's fake tensors
        if self.recipe.model.attn_implementation != "sdpa" or data_lib.carries_positions(self.recipe.data):
            return spec
        name = trace_sdpa()

        def build(config: Any) -> nn.Module:
            # Real tensors (the planner's fallback when the fake trace fails, see planner/trace_fallback.py)
            # can be read: the model the run trains, whose masks some families need (Axk2's indexer).
            if not _under_fake_tensors():
                return self._from_config(config)
            try:
                model = self._from_config(config, name)
            except KeyError:  # a family with its own table of attention classes (Falcon): plain sdpa
                return self._from_config(config)
            model.register_forward_pre_hook(_all_ones_mask, with_kwargs=True)
            return model

        if _own_builds(type(self)):  # a subclass's model (compiled, wrapped) is the one the run trains
            return dataclasses.replace(
                spec,
                build_model=lambda: self._traced_build(self.build_model, name),
                build_clone=lambda depth: self._traced_build(lambda: self.build_model_clone(depth), name),
            )
        return dataclasses.replace(
            spec,
            build_model=lambda: build(self.model_config),
            build_clone=lambda depth: build(self._clone_config(depth)),
        )

    def _traced_build(self, make: Callable[[], nn.Module], attention: str) -> nn.Module:
        """A subclass's own `make` under the planner's fake tensors, its configs built with the traced
        `attention` (`trace_sdpa`, through `_from_config`) and fed the all-ones mask."""
        if not _under_fake_tensors():
            return make()
        self._attention_override: str | None = attention
        try:
            model = make()
        finally:
            self._attention_override = None
        if "attention_mask" in inspect.signature(model.forward).parameters:  # a transformers model
            model.register_forward_pre_hook(_all_ones_mask, with_kwargs=True)
        return model

    def _trace_key(self) -> Hashable | None:
        """`ModelSpec.trace_key`: what these hooks read (the model config, the recipe's `model` and `data`
        sections). None when a subclass or this instance replaces a method the trace calls: its own version
        may read anything."""
        if any(
            name in vars(self) or getattr(type(self), name) is not own
            for name, own in _TRACED_METHODS.items()
        ):
            return None
        try:
            config = self.model_config.to_json_string(use_diff=False)
        except Exception:  # a config JSON cannot write: no key, nothing shared (planning goes on)
            return None
        model, data = self.recipe.model.model_dump_json(), self.recipe.data.model_dump_json()
        return (type(self.model_config), config, model, data)

    def tensor_parallel_plan(self, model: nn.Module) -> dict[str, Any] | None:
        """transformers' plan for the family's blocks with memtrain's sequence, embedding and head parts."""
        problems = tensor_parallel_problems(self.model_config, self.env.shape.tp)
        if problems:
            raise Unsupported(problems[0])
        return causal_lm_plan(model, self.env.shape.sequence_parallel)

    def expert_parallel_plan(self, model: nn.Module) -> list[ExpertLayer] | None:
        """The family's experts modules (`memtrain.causal_lm.expert_parallel`: a plan of ours, and why)."""
        return family_layers(model, self.env.shape.ep) or None

    def pipeline_split(self, model: nn.Module, stage: int, stages: int) -> tuple[int, ...] | None:
        """Keep stage `stage`'s part of the model for `strategies.mesh.pp > 1` (`memtrain.causal_lm.pipeline`);
        the hidden states' width, what one stage hands the next."""
        return split_causal_lm(model, stage, stages)

    def step_batch(self, step: int) -> Batch:
        share = self.per_rank_batch_size
        mine = slice(self.env.dp_rank * share, (self.env.dp_rank + 1) * share)
        if self.data.stream is not None:
            samples, ids = self.data.stream.step_samples(step)
            return data_lib.collate(samples[mine], ids[mine])
        indices = self.sampler.indices(step)[mine]
        return data_lib.collate([self.train_samples[i] for i in indices], indices)

    def split_batch(self, batch: Batch, micro_size: int) -> list[Batch]:
        shape = self.env.shape  # sequence parallel splits every micro-batch's columns evenly over tp ranks,
        columns = shape.tp if shape.tp > 1 and shape.sequence_parallel else 1  # context parallel over cp
        columns *= shape.cp
        return [data_lib.trim_padding(mb, columns) for mb in super().split_batch(batch, micro_size)]

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # Packed rows: position ids that restart per document make transformers mask attention across them.
        """The summed token losses and the token count, computed by the plan's loss strategy (`chunked`,
        `fused`: the model returns its hidden states and the loss applies the head a chunk at a time)."""
        positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        binding = bound_loss(model)
        if binding.strategy.applies_bare_head:
            check_bare_head_loss(self.model_config, binding.strategy.name)
        with binding.deferring_head():
            output = model(input_ids=batch["input_ids"], use_cache=False, **positions)
        labels = batch["labels"]
        loss_sum = binding(output.logits, labels, data_lib.IGNORE_INDEX)
        tokens = (labels != data_lib.IGNORE_INDEX).sum()
        return loss_sum + router_loss(output, self.model_config, tokens), tokens

    def eval_batches(self) -> Iterable[Batch]:
        """This rank's share of the held-out samples, `train.eval_batches` step batches at most."""
        share = self.per_rank_batch_size
        world, rank = self.env.dp_size, self.env.dp_rank
        size = self.recipe.batch.global_size
        for start in range(0, min(len(self.eval_samples), size * self.recipe.train.eval_batches), size):
            rows = list(range(start, min(start + size, len(self.eval_samples))))
            mine = rows[rank::world][:share]
            if mine:
                yield data_lib.collate([self.eval_samples[i] for i in mine], mine)


_DECODER_DEPTH = ("num_decoder_layers", "decoder_layers")
# What a planner trace calls (through `model_spec`'s hooks), so what `_trace_key` stands for: this class's
# own functions, taken now (the fault kit replaces the module's `CausalLMTrainer` with a partial).
_TRACED_METHODS = {
    name: getattr(CausalLMTrainer, name)
    for name in (
        "model_spec",
        "build_model",
        "build_model_clone",
        "blocks",
        "planning_batch",
        "loss",
        "_from_config",
        "_clone_config",
        "_layers_per_block",
    )
}


def _depth_field(config: Any) -> str:
    """The config field that sets how many layers the causal LM builds: `num_hidden_layers`, except in an
    encoder-decoder family's config, whose `num_hidden_layers` is the encoder's (ProphetNet refuses to set
    it) while its causal LM is the decoder alone."""
    fields = vars(config)
    return next((f for f in _DECODER_DEPTH if isinstance(fields.get(f), int)), "num_hidden_layers")


def _clone_blocks(kinds: list[tuple[str, ...]], num_blocks: int) -> list[int]:
    """The model's blocks a `num_blocks`-block clone keeps: the first, the last, and middle blocks of the
    commonest kind (a block's kind: its layers' entries in every per-layer list)."""
    units = len(kinds)
    if num_blocks >= units or num_blocks < 2:
        return list(range(min(num_blocks, units)))
    middle = range(1, units - 1)
    count = Counter(kinds[i] for i in middle)
    chosen = sorted(middle, key=lambda i: (-count[kinds[i]], i))[: num_blocks - 2]
    return [0, *sorted(chosen), units - 1]


_CROSS_ATTENTION = ("encoder_attn", "encoder_attn_layer_norm", "crossattention")


def _freeze_cross_attention(model: nn.Module) -> None:
    """The decoder of an encoder-decoder family trained alone (BartForCausalLM, MarianForCausalLM, ...) keeps
    its cross-attention to an encoder it is never given: those parameters take no part in the loss, so they
    get no gradient and no optimizer state. Frozen, they are what they are in training anyway, and the
    planner (which gives every trainable parameter a gradient and states) counts them right."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _CROSS_ATTENTION:
            module.requires_grad_(False)


def _all_ones_mask(_model: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The traced `sdpa` model's inputs with an all-ones padding mask (what real tensors show: no padding),
    so transformers never guesses packed rows from unreadable position ids (`trace_sdpa`); its rows and
    columns from the token ids, or, on a later pipeline stage, the hidden states it reads instead (the
    rank trace of a pipeline, whose split's input hook runs first: `memtrain.causal_lm.pipeline`)."""
    inputs = kwargs.get("input_ids")
    if inputs is None:  # a later pipeline stage's hidden states (`memtrain.causal_lm.pipeline`)
        inputs = kwargs.get("inputs_embeds")
    if isinstance(inputs, torch.Tensor) and kwargs.get("attention_mask") is None:
        mask = torch.ones(inputs.shape[:2], dtype=torch.bool, device=inputs.device)
        kwargs = {**kwargs, "attention_mask": mask}
    return args, kwargs


def _under_fake_tensors() -> bool:
    """Whether the tensors made here now are the planner's fake (or meta) ones: no readable storage."""
    return torch.empty(0).untyped_storage().device.type == "meta"


TRACE_SDPA = "memtrain_trace_sdpa"


def trace_sdpa() -> str:
    """The attention implementation the planner's trace builds an `sdpa` model with (registered once).

    Without packing, this trainer passes neither position ids nor a padding mask, so on real tensors every
    row is one sequence and transformers' SDPA path relies on `is_causal` without building a mask. To find that out
    it reads the position ids (`masking_utils.find_packed_sequence_indices`); a fake tensor cannot be read,
    so under the planner's fake tensors it would assume packed sequences, build a B x 1 x s x s mask and
    select another attention kernel, which keeps other tensors for backward. The traced model is therefore
    given an all-ones padding mask (`_all_ones_mask`: where a mask is given, no packing is guessed) and
    uses a registered implementation (transformers' `AttentionInterface` / `AttentionMaskInterface`): the
    same SDPA forward, with a mask function that drops that all-ones mask (reading it would fail too), so
    whether the mask is skipped is the model's own choice, as on real tensors (Doge always builds it).
    Nothing of transformers is replaced; sliding-window layers still get their (same-sized) mask.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any) -> Any:
        kwargs["attention_mask"] = None  # all ones (`_all_ones_mask`, or one the model made: Bart's)
        return sdpa_mask(*args, **kwargs)

    if TRACE_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(TRACE_SDPA, sdpa_attention_forward)
        AttentionMaskInterface.register(TRACE_SDPA, mask)
    return TRACE_SDPA


def _own_builds(trainer: type[CausalLMTrainer]) -> bool:
    """Whether a subclass builds its own model or clones (`build_model`, `build_model_clone`)."""
    return any(
        getattr(trainer, name) is not getattr(CausalLMTrainer, name)
        for name in ("build_model", "build_model_clone")
    )
