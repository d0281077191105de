"""What every tool of the CPU fit benchmark shares: the base models, the ladder of models metric (a)
climbs, the sequence lengths metric (c) climbs, the rows every tool trains on, and memtrain's recipe.

Why one module: each tool runs in its own process and rebuilds the same model from (setup, rung) and the
same rows from (setup, sequence length) with the same seed, so the tools compare on identical weights and
data without passing tensors between processes. A `CpuSetup` travels to every worker as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.sources import synthetic_samples

HEAD_DIM = 32
MAX_POSITIONS = 65536  # rotary: no table of this size is built, and every length metric (c) tries is below

# The base model of each size class: its width, depth and vocabulary, the sequence length and global
# batch of metrics (a)/(b), and the longest sequence metric (c) tries (what one probe may cost). `tiny`
# (the smoke test) searches one rung and one length: each new shape costs memtrain a set of traces.
BASES: dict[str, dict[str, int]] = {
    "llama-7m": {
        "hidden": 256,
        "layers": 4,
        "vocab": 8192,
        "seq_len": 512,
        "global_batch": 8,
        "max_seq": 8192,
    },
    "llama-1m": {
        "hidden": 128,
        "layers": 2,
        "vocab": 2048,
        "seq_len": 128,
        "global_batch": 16,
        "max_seq": 2048,
    },
    "tiny": {
        "hidden": 64,
        "layers": 2,
        "vocab": 256,
        "seq_len": 64,
        "global_batch": 2,
        "min_seq": 64,
        "max_seq": 64,
        "min_rung": 0,
        "max_rung": 0,
    },
}

# The tools, in the order they run. Each peer searches its own way (`auto_find_batch_size`,
# `find_executable_batch_size`); memtrain's own search is its planner (`strategies: auto`).
TOOLS: dict[str, str] = {
    "hf": "HF Trainer",
    "hf-ckpt": "HF Trainer + checkpointing",
    "hf-expert": "HF Trainer expert (ckpt + 8-bit AdamW + bf16)",
    "accelerate": "accelerate",
    "accelerate-ckpt": "accelerate + checkpointing",
    "memtrain": "memtrain auto",
    # the same job without gradient clipping (`train.grad_clip: null`): not run by default (every tool
    # clips at 1.0; memtrain's step in backward clips with two passes); `--tools` adds it
    "memtrain-noclip": "memtrain auto, no gradient clipping",
}
MEMTRAIN_TOOLS = ("memtrain", "memtrain-noclip")
DEFAULT_TOOLS = tuple(t for t in TOOLS if t != "memtrain-noclip")  # every tool clips
PEERS = tuple(t for t in TOOLS if t not in MEMTRAIN_TOOLS)
REFERENCE_TOOLS = ("hf", "accelerate")  # the unconstrained peak: the plain loops at the global batch


@dataclass(frozen=True)
class CpuSetup:
    """Everything a worker needs; budgets are percent of the reference (unconstrained) peak."""

    base: str = "llama-7m"
    seq_len: int = 512
    global_batch: int = 8
    min_seq: int = 0  # metric (c) tries lengths from this (0: a quarter of seq_len)
    max_seq: int = 8192  # ... up to this (a longer one would cost minutes a probe)
    budgets: tuple[int, ...] = (20, 40, 60, 80, 100)
    steps: int = 3  # timed steps per timed run
    warmup: int = 2  # untimed steps before them (memtrain checks its first two steps against its plan)
    probe_steps: int = 2  # steps per fit probe: the second runs with the optimizer states the first made
    min_rung: int = -8
    max_rung: int = 5  # the ladder's top: ~2^(3*5/4) = 13x the base's parameters
    lr: float = 1e-4
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CpuSetup:
        raw = json.loads(text)
        return cls(**{**raw, "budgets": tuple(raw["budgets"])})

    @property
    def vocab(self) -> int:
        return BASES[self.base]["vocab"]

    @property
    def num_samples(self) -> int:
        """Synthetic rows in every memtrain recipe: one number for all, so the planner's traces of a
        model and length are the same job whatever the budget or batch (cpu_tools caches them)."""
        return 2 * self.global_batch * (self.warmup + self.steps) + 16


# ------------------------------------------------------------------------------------------ the ladder


def shape(setup: CpuSetup, rung: int) -> tuple[int, int]:
    """(hidden, layers) of ladder rung `rung`: width and depth both x 2^(rung/4) from the base, so
    parameters grow ~1.7x a rung; rung 0 is the base."""
    base = BASES[setup.base]
    factor = 2 ** (rung / 4)
    hidden = HEAD_DIM * max(1, round(base["hidden"] * factor / HEAD_DIM))
    return hidden, max(1, round(base["layers"] * factor))


def model_config(setup: CpuSetup, rung: int = 0) -> dict[str, Any]:
    hidden, layers = shape(setup, rung)
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": HEAD_DIM * max(1, round(hidden * 8 / 3 / HEAD_DIM)),
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // HEAD_DIM,
        "num_key_value_heads": hidden // HEAD_DIM,
        "vocab_size": setup.vocab,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
    }


def parameters(config: dict[str, Any]) -> int:
    """The parameter count of a Llama `config` (embedding, head, blocks, norms), without building it."""
    h, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    block = 4 * h * h + 3 * h * inner + 2 * h
    return 2 * vocab * h + config["num_hidden_layers"] * block + h


def rungs(setup: CpuSetup, budget_bytes: int) -> list[int]:
    """The ladder metric (a) searches at one budget: one rung per distinct shape, up to the largest whose
    fp32 weights and gradients alone (8 bytes a parameter) stay under the budget or the ladder's top."""
    found: dict[tuple[int, int], int] = {}
    for rung in range(setup.min_rung, setup.max_rung + 1):
        if 8 * parameters(model_config(setup, rung)) <= budget_bytes:
            found.setdefault(shape(setup, rung), rung)
    return sorted(found.values())


def seq_lens(setup: CpuSetup) -> list[int]:
    """The lengths metric (c) searches: the base length x 2^(k/2) from `min_seq` (default a quarter of
    it) to `max_seq`, multiples of 16."""
    found = {16 * max(1, round(setup.seq_len * 2 ** (k / 2) / 16)) for k in range(-4, 40)}
    low = setup.min_seq or setup.seq_len // 4
    return sorted(n for n in found if low <= n <= setup.max_seq)


def micro_sizes(setup: CpuSetup) -> list[int]:
    """The micro-batch sizes metric (b) searches: the divisors of the global batch (accumulation reaches
    exactly the global batch with each)."""
    return [m for m in range(1, setup.global_batch + 1) if setup.global_batch % m == 0]


# ------------------------------------------------------------------------------------------ model and data


def build_model(setup: CpuSetup, rung: int, checkpointing: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(setup.seed)
    config = LlamaConfig(**{k: v for k, v in model_config(setup, rung).items() if k != "model_type"})
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """`count` rows of `seq_len` tokens (memtrain's synthetic sequences, the same seed); labels are the
    inputs, which the model shifts, as the transformers causal-LM examples do."""

    def __init__(self, setup: CpuSetup, seq_len: int, count: int) -> None:
        tokens = synthetic_samples(count, seq_len, setup.vocab, 0, setup.seed)
        self.inputs = torch.stack([t[:seq_len] for t in tokens])

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[index], "labels": self.inputs[index]}


def memtrain_recipe(
    setup: CpuSetup,
    out: Path,
    *,
    rung: int,
    seq_len: int,
    global_batch: int,
    micro: int | None,
    steps: int,
    budget_bytes: int,
    clip: bool = True,
) -> CausalLMRecipe:
    """A user's recipe: every strategy `auto`, the budget as `memory.budget`; `micro` None leaves the
    micro-batch to memtrain too, a number pins it (the common search of metric (b)); `clip` False:
    `train.grad_clip: null`."""
    return CausalLMRecipe.from_dict(
        {
            "run": {"name": "fit", "output_dir": str(out), "seed": setup.seed},
            "model": {"config": model_config(setup, rung)},
            "data": {
                "source": "synthetic",
                "seq_len": seq_len,
                "eval_fraction": 0.0,
                "synthetic": {"num_samples": setup.num_samples},
            },
            "batch": {"global_size": global_batch, "micro_size": "auto" if micro is None else micro},
            "train": {
                "steps": steps,
                "lr": setup.lr,
                "weight_decay": 0.0,
                "warmup_steps": 0,
                "min_lr_ratio": 1.0,
                "grad_clip": setup.grad_clip if clip else None,
                "eval_every": 0,
            },
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off", "log_every_s": 0},
            "memory": {"budget": budget_bytes},
            "strategies": {
                "precision": "auto",
                "checkpointing": "auto",
                "optimizer_states": "auto",
                "sharding": "auto",
                "loss": "auto",
                "optimizer_step": "auto",  # in_backward where exact (no accumulation); clipped: two passes
            },
        }
    )
