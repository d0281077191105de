"""Family sweep: every causal-LM `model_type` transformers ships, built tiny, planned and measured on the CPU.

Why: the planner traces a three-block clone of the model under fake tensors; a family whose code the fake
trace cannot run (data-dependent shapes, kernels without a fake implementation) or whose clone is not a
faithful copy (hybrid layer patterns, mixture-of-experts routing) would be planned wrong or not at all,
and only running every family finds out. For each family in
`transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` this builds the family's config
shrunk to a tiny size (a generic shrinker over the common size fields plus a few family overrides), then,
per attention implementation (eager and sdpa where the family has both), predicts the step's peak the way
scripts/planner_accuracy.py does (`predict`) and measures it in a real CPU run with the tracker
(`measure`). A family that cannot be built tiny or cannot train a step on a CPU is skipped with the
reason (`UNTRAINABLE` names the families no causal-LM step can train on their own, and why). Each family runs in its own process with a timeout, so one hang or crash cannot stop the sweep.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/family_sweep.py [--quick | --modes none,full,selective,fraction]
        [--attentions eager] [--only llama,gpt2] [--json OUT]

Writes results/family_sweep.json (or --json) and prints the markdown summary: families planned / built,
median and max |error| of the peak, the worst under-prediction, a row per family and attention, and the
skipped families with reasons. Goal (issue 14): every family that trains also plans; median <= 1%,
max <= 3%, never under by more than 0.5%. --quick: one plan per family (else two). --modes: each recompute
mode named (`strategies.checkpointing`; fraction at 0.5) in fp32 and in bf16-mixed, micro-batch 4 of 8, with
a table per mode and precision (issue 26: a mode the default plans skip can be the one planned wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, TypeGuard

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

import planner_accuracy  # noqa: E402  (its recipe, prediction and measurement: the same numbers)

TIMEOUT_S = 300  # one family, every attention and plan
ATTENTIONS = ("eager", "sdpa")
QUICK_PLANS = [planner_accuracy.PLANS[0]]  # fp32, no checkpointing, one micro-step
PLANS = [planner_accuracy.PLANS[0], planner_accuracy.PLANS[2]]  # + bf16-mixed, full checkpointing, 2 micro
RECOMPUTE_MODES = ("none", "full", "selective", "fraction")  # strategies.checkpointing
PRECISIONS = ("fp32", "bf16-mixed")
FRACTION = 0.5  # strategies.checkpointing_fraction under `fraction`: 2 of the tiny model's 4 blocks


def mode_plans(modes: list[str]) -> list[tuple[str, str, float, str, int]]:
    """`--modes`: each recompute mode in fp32 and bf16-mixed, micro-batch 4 of 8 (two micro-steps)."""
    unknown = [mode for mode in modes if mode not in RECOMPUTE_MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; use some of {', '.join(RECOMPUTE_MODES)}")
    return [(precision, mode, FRACTION, "fp32", 4) for mode in modes for precision in PRECISIONS]


def plan_label(plan: tuple[str, str, float, str, int]) -> str:
    precision, mode, fraction, _, micro = plan
    return f"{precision}, {mode}{f' {fraction:g}' if mode == 'fraction' else ''}, micro {micro}"


# The common size fields of transformers configs and their tiny values; a field is set only when the
# family's default config has it as an integer (so None means "off" stays off).
TINY: dict[str, int] = {
    # width
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "embed_dim": 64,
    "emb_dim": 64,
    "word_embed_proj_dim": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 32,
    # depth
    "num_hidden_layers": 4,
    "n_layer": 4,
    "num_layers": 4,
    "n_layers": 4,
    "decoder_layers": 4,
    "encoder_layers": 2,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    # vocabulary and positions
    "vocab_size": 512,
    "vocab_size_per_layer_input": 512,  # Gemma-3n/4: a per-layer embedding of every token
    "hidden_size_per_layer_input": 16,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_seq_len": 128,
    "seq_length": 128,
    "sliding_window": 32,  # shorter than the sequence: the window matters
    # mixture of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # state-space and linear attention
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "time_step_rank": 8,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "mamba_n_heads": 8,  # x head size 16 = expand 2 x hidden 64
    "mamba_num_heads": 8,
    "n_mamba_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_d_ssm": 128,
    "mamba_ngroups": 1,
    "mamba_chunk_size": 32,  # shorter than the sequence: the chunked scan runs more than one chunk
    "chunk_size": 32,
    "num_expert_group": 1,
    "num_experts_per_token": 2,
}

# The depth fields, first found first: a per-layer list (layer_types, a per-layer size) is as long as it.
DEPTHS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")

# Per-family values over the generic ones: fields whose constraints tie them to others, and values a
# family's default config leaves unset although its model needs them (transformers' own defaults do not
# build these families; a real checkpoint's config.json sets them).
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # attention_types is run-length encoded ([[kinds, repeats]]) and must expand to num_layers
    "gpt_neo": {"attention_types": [[["global", "local"], 2]], "window_size": 32},
    # its attention config has no rope_theta field and no clip_qkv value, which the model reads
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # no expert counts by default, but every layer past first_k_dense_replace is a mixture of experts
    "dots1": {
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
    },
    # no layer_types by default: short-convolution and attention layers, dense then mixture of experts
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # its indexed-attention layers need the token indexer's sizes (unset by default)
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,  # of 64 tokens: the selection matters
        "indexer_compress_ratio": 4,
        "hc_lowrank": 16,
    },
    # the causal LM needs a decoder; axial positions factor the sequence length (64 = 8 x 8) and their
    # widths sum to hidden_size; chunks shorter than the sequence
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [8, 8],
        "axial_pos_embds_dim": [16, 48],
        "attention_head_size": 16,
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
        "num_buckets": 4,
    },
    # the last num_kv_shared_layers reuse the caches of earlier layers of each kind: both kinds come first
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
    },
    # its sliding layers' latent attention needs head_dim = qk_nope_head_dim + qk_rope_head_dim (layers 2
    # and 3 of the tiny layer_types); the indexer keeps 16 of 64 tokens
    "dots3_note_text": {
        "index_topk": 16,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "per_layer_config": {
            layer: {
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "q_lora_rank": 32,
                "kv_lora_rank": 32,
                "head_dim": 20,
                "qk_nope_head_dim": 12,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
            }
            for layer in (2, 3)
        },
    },
    # its hybrid layers share one transformer block, tied across them: the tie needs two hybrid layers
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # one language adapter per language: the input's language must be known; causal, not bidirectional
    "xmod": {"default_language": "en_XX", "is_decoder": True},
}


# Families no causal-LM step can train on its own, and why.
UNTRAINABLE: dict[str, str] = {
    "gemma4_assistant": (
        "a speculative-decoding draft model: its forward takes the target model's inputs_embeds and "
        "shared_kv_states, not token ids"
    ),
}


def tiny_config(model_type: str) -> dict[str, Any]:
    """The family's config fields shrunk to a tiny size (`model_type` plus every field changed).
    ValueError: the family cannot be built from a flat config (a composite with sub-models)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if getattr(default, "sub_configs", None) and not isinstance(
        getattr(default, "num_hidden_layers", None), int
    ):
        raise ValueError(
            f"composite config ({', '.join(default.sub_configs)}): no top-level depth to clone; its text "
            "family, where transformers has one, is swept on its own"
        )
    inputs = [name for name in getattr(default, "sub_configs", {}) if "vision" in name or "audio" in name]
    if inputs:
        raise ValueError(f"needs pixel or audio inputs ({', '.join(inputs)}): not a text-only causal LM")
    fields = default.to_dict()
    tiny: dict[str, Any] = {"model_type": model_type, **_shrunk(fields)}
    for name in getattr(default, "sub_configs", {}):  # a sub-config of sizes (dbrx's attn_config, ffn_config)
        if isinstance(fields.get(name), dict) and (sub := _shrunk(fields[name])):
            tiny[name] = sub
    experts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if any(name in tiny for name in experts) and "num_experts_per_tok" in fields:
        # a default of None would not route; a top-1 family (Llama-4, ZAYA) stays top-1
        tiny["num_experts_per_tok"] = min(fields["num_experts_per_tok"] or 2, TINY["num_experts_per_tok"])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # some configs insist on an id in range
        if isinstance(fields.get(name), int) and fields[name] >= tiny.get("vocab_size", fields[name] + 1):
            tiny[name] = 0
    if (
        fields.get("num_key_value_heads") == fields.get("num_attention_heads")
        and "num_key_value_heads" in tiny
    ):
        tiny["num_key_value_heads"] = tiny["num_attention_heads"]  # no grouped-query attention: keep none
    if "qk_rope_head_dim" in tiny and "head_dim" in tiny:  # latent attention: head_dim is the rope part
        tiny["head_dim"] = tiny["qk_rope_head_dim"]
    _fill_unset(fields, tiny)
    _cut_per_layer(fields, tiny)
    tiny.update(OVERRIDES.get(model_type, {}))
    return tiny


def _shrunk(fields: dict[str, Any]) -> dict[str, Any]:
    """The `TINY` fields of a config (or a sub-config) larger than their tiny value, set to it; a per-layer
    list of sizes (Gemma-3n's intermediate_size) shrinks entry by entry."""
    shrunk: dict[str, Any] = {}
    for name, value in TINY.items():
        current = fields.get(name)
        if _is_size(current) and current > value:
            shrunk[name] = value
        elif isinstance(current, list) and current and all(map(_is_size, current)):
            if any(entry > value for entry in current):
                shrunk[name] = [min(entry, value) for entry in current]
    return shrunk


def _is_size(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fill_unset(fields: dict[str, Any], tiny: dict[str, Any]) -> None:
    """Values a family's default leaves unset (None, {}) although its model reads them: a size to derive
    (Ministral's and Hunyuan's head_dim, Nemotron's num_key_value_heads) set to what it derives to, and
    empty rope parameters (Cohere Compass) set to the default rope, per layer kind where there are kinds."""
    heads = tiny.get("num_attention_heads", fields.get("num_attention_heads"))
    hidden = tiny.get("hidden_size", fields.get("hidden_size"))
    if "head_dim" in fields and fields["head_dim"] is None and _is_size(heads) and _is_size(hidden):
        tiny["head_dim"] = hidden // heads
    if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None and _is_size(heads):
        tiny["num_key_value_heads"] = heads
    if fields.get("rope_parameters") == {}:
        default_rope = {"rope_type": "default", "rope_theta": 10000.0}
        kinds = tiny.get("layer_types", fields.get("layer_types"))
        tiny["rope_parameters"] = (
            {kind: dict(default_rope) for kind in dict.fromkeys(kinds)} if kinds else default_rope
        )


def _cut_per_layer(fields: dict[str, Any], tiny: dict[str, Any]) -> None:
    """Per-layer lists (layer_types, mlp_layer_types, a per-layer size) cut to the tiny depth, every kind
    kept, and a heterogeneous config's per-layer overrides (`per_layer_config`, keyed by layer index)
    moved with their layers and shrunk in proportion, so the tiny model's layers still differ."""
    depth_name = next((name for name in DEPTHS if _is_size(fields.get(name))), None)
    depth, layers = fields.get(depth_name or ""), tiny.get(depth_name or "")
    if not (_is_size(depth) and _is_size(layers) and depth > layers):
        return
    for name, value in fields.items():
        value = tiny.get(name, value)
        if isinstance(value, list) and len(value) == depth:
            tiny[name] = [value[i] for i in _every_kind(value, layers)]
    per_layer = fields.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        by_index = {int(index): overrides for index, overrides in per_layer.items()}
        kinds = fields.get("layer_types")
        sources = _every_kind(kinds, layers) if isinstance(kinds, list) else range(layers)
        tiny["per_layer_config"] = {
            new: _scaled(by_index[old], fields, tiny) for new, old in enumerate(sources) if old in by_index
        }


def _scaled(overrides: dict[str, Any], fields: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """One layer's overrides of global sizes, scaled as the global size was (Gemma-4's full-attention
    head_dim 512 over a global 256 -> 32 over the tiny 16)."""
    scaled = {}
    for name, value in overrides.items():
        whole, small = fields.get(name), tiny.get(name, fields.get(name))
        if _is_size(value) and _is_size(whole) and _is_size(small) and whole > 0:
            value = max(1, round(value * small / whole))
        scaled[name] = value
    return scaled


def _every_kind(kinds: list[Any], length: int) -> list[int]:
    """The layers a per-layer list keeps: its first `length`, the last ones replaced by the first layer of
    each kind they miss (a hybrid's attention layer, a mixture-of-experts layer), so the tiny model has
    every kind of layer."""
    cut = list(range(min(length, len(kinds))))
    seen = {str(kinds[i]) for i in cut}
    firsts = {str(kind): i for i, kind in reversed(list(enumerate(kinds)))}
    missing = [firsts[kind] for kind in dict.fromkeys(map(str, kinds)) if kind not in seen]
    if missing:
        cut[length - len(missing[:length]) :] = missing[:length]
    return cut


def run_family(
    model_type: str, plans: list[tuple[str, str, float, str, int]], only: tuple[str, ...] = ATTENTIONS
) -> dict[str, Any]:
    """One family in this process: build it tiny; per attention (of `only` the family has), predict and
    measure each plan."""
    import torch

    from memtrain.commands.trainers import trainer_class
    from memtrain.errors import MemtrainError

    torch.set_num_threads(1)
    outcome: dict[str, Any] = {"family": model_type, "rows": [], "skipped": None, "failures": []}
    if model_type in UNTRAINABLE:
        outcome["skipped"] = f"cannot train a step on its own: {UNTRAINABLE[model_type]}"
        return outcome
    try:
        config = tiny_config(model_type)
    except Exception as exc:  # noqa: BLE001 - every reason a family is not swept is reported
        outcome["skipped"] = f"cannot build tiny: {_short(exc)}"
        return outcome
    outcome["config"] = config
    attentions = attentions_of(model_type)
    if attentions != ATTENTIONS:
        outcome["note"] = "eager only: transformers builds it without SDPA"
    attentions = tuple(a for a in attentions if a in only)
    trained = False
    for attention in attentions:
        probe = None
        progress: list[str] = []
        for plan in plans:
            with tempfile.TemporaryDirectory() as tmp:
                recipe = planner_accuracy.recipe_for(config, plan, Path(tmp))
                recipe = recipe.model_copy(
                    update={"model": recipe.model.model_copy(update={"attn_implementation": attention})}
                )
                try:
                    measured = planner_accuracy.measure(recipe, None)
                except Exception as exc:  # noqa: BLE001 - a plan it cannot train: the others still run
                    outcome["failures"].append(
                        {
                            "attention": attention,
                            "plan": plan_label(plan),
                            "stage": "train",
                            "error": _short(exc),
                        }
                    )
                    continue
                trained = True
                try:
                    from memtrain.planner.model_probe import ModelProbe

                    spec = trainer_class(None)(recipe).model_spec()
                    probe = probe or ModelProbe(spec, progress=progress.append)
                    prediction = planner_accuracy.predict(recipe, probe)
                except (MemtrainError, Exception) as exc:  # noqa: BLE001
                    outcome["failures"].append(
                        {
                            "attention": attention,
                            "plan": plan_label(plan),
                            "stage": "plan",
                            "error": _short(exc),
                            "trace": _tail(),
                        }
                    )
                    continue
            outcome["rows"].append(
                {
                    "family": model_type,
                    "attention": attention,
                    "plan": plan_label(plan),
                    "mode": plan[1],
                    "measured": measured.peak_bytes,
                    "predicted": prediction.peak,
                    "error": planner_accuracy.relative(prediction.peak, measured.peak_bytes),
                    "measured_where": f"{measured.peak_phase} {measured.peak_module}".strip(),
                    "predicted_where": prediction.where,
                    "real_trace": any("with real tensors" in line for line in progress),
                }
            )
    if not trained:
        reasons = "; ".join(f"{f['attention']}: {f['error']}" for f in outcome["failures"])
        outcome["skipped"] = f"cannot train a step on the CPU ({reasons})"
    return outcome


def attentions_of(model_type: str) -> tuple[str, ...]:
    """eager and sdpa, or eager alone for a family transformers builds without SDPA."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(AutoConfig.for_model(model_type)), None)
    return ATTENTIONS if getattr(model_class, "_supports_sdpa", True) else ("eager",)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _tail() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-6:])


def sweep_one(model_type: str, flags: list[str], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """`run_family` in a child process, so a hang or a crash costs this family only (`flags`: the plan
    choice, `--quick` or `--modes ...`, passed on)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", model_type, *flags]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {
            "family": model_type,
            "rows": [],
            "failures": [],
            "skipped": f"timed out after {timeout:.0f} s",
        }
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " ".join(done.stderr.split())[-300:]
        return {
            "family": model_type,
            "rows": [],
            "failures": [],
            "skipped": f"crashed (exit {done.returncode}): {tail}",
        }
    return dict(json.loads(lines[-1]))


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def summary(outcomes: list[dict[str, Any]]) -> str:
    """The markdown summary of a sweep."""
    rows = [r for o in outcomes for r in o["rows"]]
    built = [o for o in outcomes if o["skipped"] is None]
    planned = [o for o in built if o["rows"] and not o["failures"]]
    lines = [f"Families planned / built: {len(planned)} / {len(built)} (of {len(outcomes)} swept)", ""]
    if rows:
        errors = [abs(r["error"]) for r in rows]
        under = min(rows, key=lambda r: r["error"])
        lines += [
            f"Peak |error| over {len(rows)} runs: median {100 * statistics.median(errors):.2f}%, "
            f"max {100 * max(errors):.2f}%; worst under-prediction {100 * min(0.0, under['error']):+.2f}% "
            f"({under['family']}, {under['attention']}, {under['plan']})",
            "",
            *by_mode(rows),
            "| family | attention | plan | measured peak | predicted peak | error |",
            "|---|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| {r['family']} | {r['attention']} | {r['plan']} | {r['measured']:,} | {r['predicted']:,} "
            f"| {100 * r['error']:+.2f}% |"
            for r in rows
        ]
    failures = [(o["family"], f) for o in built for f in o["failures"]]
    if failures:
        lines += ["", "Failures of families that train:", ""]
        lines += [
            f"- {family} ({f['attention']}, {f.get('plan', '')}, {f['stage']}): {f['error']}"
            for family, f in failures
        ]
    skipped = [o for o in outcomes if o["skipped"] is not None]
    if skipped:
        lines += ["", "Skipped:", ""]
        lines += [f"- {o['family']}: {o['skipped']}" for o in skipped]
    return "\n".join(lines)


def by_mode(rows: list[dict[str, Any]]) -> list[str]:
    """A table per recompute mode and precision: runs, median and max |error|, the worst under-prediction
    and the runs under by more than 0.5% (the goal: none)."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        precision, mode = row["plan"].split(", ")[:2]
        groups.setdefault(f"{mode} | {precision}", []).append(row["error"])
    lines = [
        "| mode | precision | runs | median abs error | max abs error | most under | under by > 0.5% |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, errors in groups.items():
        size = [abs(e) for e in errors]
        lines.append(
            f"| {key} | {len(errors)} | {100 * statistics.median(size):.2f}% | {100 * max(size):.2f}% "
            f"| {100 * min(0.0, *errors):+.2f}% | {sum(e < -0.005 for e in errors)} |"
        )
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one plan per family (else two)")
    parser.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated recompute modes ({','.join(RECOMPUTE_MODES)}), each in "
        f"{' and '.join(PRECISIONS)}, instead of the default plans",
    )
    parser.add_argument("--only", default=None, help="comma-separated model types (default: every family)")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "family_sweep.json")
    parser.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        default=None,
        help="print the summary of saved sweeps (later wins)",
    )
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT_S, help=f"seconds per family (default {TIMEOUT_S:.0f})"
    )
    parser.add_argument(
        "--attentions",
        default=",".join(ATTENTIONS),
        help="comma-separated attention implementations to run where a family has them (default: both)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = args.modes.split(",") if args.modes else None
    plans = mode_plans(modes) if modes else QUICK_PLANS if args.quick else PLANS
    flags = ["--modes", args.modes] if modes else ["--quick"] if args.quick else []
    flags += ["--attentions", args.attentions]
    only = tuple(args.attentions.split(","))
    if args.summarize is not None:
        merged = {o["family"]: o for path in args.summarize for o in json.loads(path.read_text())}
        print(summary(list(merged.values())))
        return 0
    if args.child is not None:
        warnings.filterwarnings("ignore")
        print(json.dumps(run_family(args.child, plans, only)), flush=True)
        return 0
    chosen = args.only.split(",") if args.only else families()
    outcomes = []
    started = time.perf_counter()
    for index, family in enumerate(chosen, 1):
        began = time.perf_counter()
        outcome = sweep_one(family, flags, args.timeout)
        outcomes.append(outcome)
        errors = ", ".join(f"{r['attention']} {100 * r['error']:+.2f}%" for r in outcome["rows"])
        state = outcome["skipped"] or "; ".join(
            f"{f['stage']} failed: {f['error']}" for f in outcome["failures"]
        )
        print(
            f"[{index}/{len(chosen)}] {family}: {errors or '-'} {state or ''} ({time.perf_counter() - began:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(outcomes, indent=2))
    print(summary(outcomes))
    print(f"\n{len(chosen)} families, {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
