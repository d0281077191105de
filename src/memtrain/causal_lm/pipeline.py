"""The causal-LM trainer's pipeline split: which part of a transformers causal LM one stage keeps.

Why in place, and why these names: stage s of p keeps the decoder layers s * L/p .. (s + 1) * L/p - 1, the
first stage also the embedding, the last the final norm and the output head (where the loss is). The model
object stays the transformers model, with the other parts removed, so its parameters keep their whole-model
names (`model.layers.3.mlp.up_proj.weight` on the stage that holds layer 3): each stage saves its own under
those names in the run's DCP checkpoint, and a pipeline run resumes on one process, or the reverse. The
kept layers stay in a `ModuleList` under their own indices, which transformers' decoder loop iterates as it
iterates the whole list; a middle stage's norm and head are identities, a later stage's embedding is gone.

The stage's forward is the model's own forward: a hook feeds a later stage's input (the previous stage's
hidden states) in as `inputs_embeds`, and another hands on the output's `logits` (on a stage before the
last: the hidden states, the head being an identity), the one tensor torch's `PipelineStage` passes on.
Its shape past the micro-batch's rows and columns is the embedding's width, which the split returns: the
stage is built with that shape (`memtrain.strategies.pipeline`), not told it by its neighbour.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STRUCTURE = "model.embed_tokens, model.layers, model.norm and lm_head"


def pipeline_problems(config: Any, stages: int, recipe: Any) -> list[str]:
    """What keeps a recipe's model from splitting into `stages` stages (one line each, naming the key)."""
    if stages == 1:
        return []
    problems = []
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers % stages:
        problems.append(
            f"strategies.mesh.pp: {stages} stages do not divide the model's num_hidden_layers ({layers}); "
            "each stage takes an equal share of the decoder layers"
        )
    if getattr(config, "tie_word_embeddings", False):
        problems.append(
            "strategies.mesh.pp: the model ties its input and output embeddings (tie_word_embeddings), which "
            "the first and the last stage hold apart; set it false or strategies.mesh.pp: 1"
        )
    sharding = recipe.strategies.sharding
    if isinstance(sharding, str) and sharding not in ("zero2", "zero3", "auto"):
        problems.append(
            f"strategies.sharding: {sharding} with pipeline stages (strategies.mesh.pp={stages}): each stage "
            "holds other parameters, which only FSDP2's sharded checkpoints keep; set strategies.sharding="
            "zero3 or zero2"
        )
    if isinstance(recipe.strategies.loss, str) and recipe.strategies.loss not in ("standard", "auto"):
        problems.append(
            f"strategies.loss: {recipe.strategies.loss} with pipeline stages: the last stage computes the "
            "standard loss; set strategies.loss=standard"
        )
    if recipe.data.kind == "preference":
        problems.append(
            "strategies.mesh.pp: preference training reads log-probabilities the last stage alone holds; "
            "set strategies.mesh.pp: 1"
        )
    if recipe.train.eval_every:
        problems.append(
            "train.eval_every: evaluation through pipeline stages is not run by this version; set it to 0"
        )
    return problems


def split_causal_lm(model: nn.Module, stage: int, stages: int) -> tuple[int, ...] | None:
    """Keep stage `stage`'s part of a transformers causal LM (of `STRUCTURE`) in place; the hidden states'
    width, what one stage hands the next past its rows and columns. None for a model of another structure."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    embedding = getattr(inner, "embed_tokens", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(embedding, nn.Embedding):
        return None
    if not hasattr(inner, "norm") or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    assert inner is not None
    share = len(layers) // stages
    kept = nn.ModuleList()
    for index in range(stage * share, (stage + 1) * share):
        kept.add_module(str(index), layers[index])  # its own index: the whole model's parameter names
    inner.layers = kept
    if stage > 0:
        inner.embed_tokens = None
    if stage < stages - 1:
        inner.norm = nn.Identity()
        model.lm_head = nn.Identity()
    # prepended: hooks registered at the build (the planner's all-ones mask) read the named inputs
    model.register_forward_pre_hook(
        _stage_inputs if stage > 0 else _first_inputs, with_kwargs=True, prepend=True
    )
    model.register_forward_hook(_logits_only)
    return (embedding.embedding_dim,)


def _first_inputs(_model: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The first stage reads token ids."""
    return (), {**kwargs, "input_ids": args[0], "use_cache": False}


def _stage_inputs(_model: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A later stage reads the previous stage's hidden states."""
    return (), {**kwargs, "inputs_embeds": args[0], "use_cache": False}


def _logits_only(_model: nn.Module, _args: Any, output: Any) -> torch.Tensor:
    return output.logits
