"""Model config values transformers accepts but cannot build or run: one line naming the key, in `validate`.

Why: `AutoConfig.for_model` (and a downloaded config.json) takes any value for most fields. A misspelt
activation (`hidden_act: gelux`) or a negative MoE size fails only when the model is built, and more
experts per token than there are experts only in the first forward (`topk`): a traceback in `train` after
`validate` said the recipe was fine. Here the values are checked by name, then the model `train` builds is
built on the meta device (no memory), so `validate` and `train` refuse the same configs with the same line.
"""

from __future__ import annotations

from typing import Any

import torch

from memtrain.errors import did_you_mean, shortened

_ACTIVATIONS = ("hidden_act", "activation_function", "hidden_activation")
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Sizes that must be positive when set (None means "absent" in these configs, e.g. DeepSeek's q_lora_rank).
SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "num_experts_per_tok",
    *_EXPERT_COUNTS,
)


def field(key: str, name: str) -> str:
    """How a message names config field `name` of the recipe key `key` (a pretrained model's is a file)."""
    return f"model.pretrained (its config.json {name})" if key == "model.pretrained" else f"{key}.{name}"


def value_problems(config: Any, key: str) -> list[str]:
    """Activations transformers does not have, sizes that are not positive, and more experts per token than
    experts, each naming its field."""
    from transformers.activations import ACT2FN

    problems = []
    for name in _ACTIVATIONS:
        value = _read(config, name)
        if isinstance(value, str) and value not in ACT2FN:
            hint = did_you_mean(value, ACT2FN.keys())
            problems.append(f"{field(key, name)}: unknown activation {shortened(value)}{hint}")
    for name in SIZES:
        if name in ("max_position_embeddings", "n_positions"):  # XLNet's default is -1 (no limit)
            continue
        value = _read(config, name)
        if value is not None and not positive(value):
            problems.append(
                f"{field(key, name)}: must be a positive integer or a per-layer list of them "
                f"(got {shortened(value)})"
            )
    chosen = _read(config, "num_experts_per_tok")
    counts = [(n, _read(config, n)) for n in _EXPERT_COUNTS]
    experts = next(((n, v) for n, v in counts if isinstance(v, int) and v > 0), None)
    if isinstance(chosen, int) and chosen > 0 and experts is not None and chosen > experts[1]:
        problems.append(
            f"{field(key, 'num_experts_per_tok')}: {chosen} is more than the {experts[1]} experts "
            f"({field(key, experts[0])}); each token picks that many of them"
        )
    return problems


def _read(config: Any, name: str) -> Any:
    """`config.name`, or None when absent or per-layer in a heterogeneous config (Gemma-4), whose global read
    transformers refuses with a RuntimeError (AmbiguousGlobalPerLayerAttributeError)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        return None


def positive(value: Any) -> bool:
    """A positive integer, or a non-empty list of them (a per-layer size, e.g. Gemma-3n's intermediate_size)."""
    values = value if isinstance(value, list) and value else [value]
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def build_problem(config: Any, key: str, attn_implementation: str) -> str | None:
    """What building the model `train` builds (on the meta device) raises, as one line naming `key` (the
    field whose value the error quotes, when one does); None when it builds."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, dtype=torch.float32, trust_remote_code=False
            )
    except Exception as exc:  # KeyError, ValueError, RuntimeError (negative dimensions), ...
        text = " ".join(str(exc).split())[:300]
        quoted = [
            name for name, value in vars(config).items() if isinstance(value, str) and repr(value) in str(exc)
        ]
        where = field(key, quoted[0]) if len(quoted) == 1 else key
        return f"{where}: transformers cannot build the {config.model_type} model from these values ({text})"
    return None
