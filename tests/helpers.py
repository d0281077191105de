"""Test helpers: tiny recipes that train in seconds on the CPU, and the environment for child processes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from memtrain.recipe import Recipe, recipe_from_dict

REPO = Path(__file__).resolve().parent.parent

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}

TINY_GEMMA2 = {  # soft-capped logits, no SDPA attention in transformers
    "model_type": "gemma2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}


def tiny_recipe_dict(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A tiny llama on variable-length synthetic data; `sections` are merged over the defaults."""
    raw: dict[str, Any] = {
        "run": {"name": "tiny", "output_dir": str(tmp_path / "run"), "seed": 3},
        "model": {"config": copy.deepcopy(TINY_LLAMA)},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 256, "min_len": 4}},
        "batch": {"global_size": 8, "micro_size": 8},
        "train": {"steps": 4, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0},
        "checkpoint": {"every": 0, "keep": 3, "at_end": False},
        "output": {"progress": "off"},
        "strategies": {"precision": "fp32", "sharding": "none"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def tiny_recipe(tmp_path: Path, **sections: dict[str, Any]) -> Recipe:
    return recipe_from_dict(tiny_recipe_dict(tmp_path, **sections))


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the repo's sources first, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_two_ranks(
    *args: str, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=2 ARGS` from the repository root (a script and its
    arguments, or `-m memtrain ...`); the test fails with the tails of both outputs unless it exits 0.
    DeepSpeed's compiled ops are cached under .cache/torch_extensions unless `env` says otherwise."""
    env = dict(env) if env is not None else subprocess_env()
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def tracked_step(tracker: Any, model: Any, optimizer: Any, x: Any) -> None:
    """One toy-regression step (mean squared output), each part in its memory-tracker phase."""
    with tracker.phase("forward"):
        loss = model(x).square().mean()
    with tracker.phase("backward"):
        loss.backward()
    del loss
    with tracker.phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad()


def probe_of(recipe: Recipe) -> Any:
    """The planner's view of the built-in causal-LM trainer's job for `recipe`."""
    from memtrain.causal_lm.trainer import CausalLMTrainer
    from memtrain.planner.model_probe import ModelProbe

    return ModelProbe(CausalLMTrainer(recipe).model_spec())


class Killed(BaseException):
    """Stands for SIGKILL in this process (nothing in memtrain catches a BaseException that is not an
    Exception), to stop a run at an exact point without a child process."""
