"""Test helpers: tiny recipes that train in seconds on the CPU, and the environment for child processes."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from memtrain.causal_lm.recipe import CausalLMRecipe

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


def tiny_recipe(tmp_path: Path, **sections: dict[str, Any]) -> CausalLMRecipe:
    return CausalLMRecipe.from_dict(tiny_recipe_dict(tmp_path, **sections))


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


def clipped_optimizer_step(model: Any, optimizer: Any) -> None:
    """The trainer's optimizer phase: the master weights' gradient hand-over (bf16-master), clipping at 1.0,
    the step, the gradients set to None."""
    from memtrain.strategies.master_weights import MasterWeightOptimizer

    params = (
        optimizer.gradients_to_master()
        if isinstance(optimizer, MasterWeightOptimizer)
        else list(model.parameters())
    )
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def one_device_levels(shape: Any, precision: Any, optimizer_states: Any, dim0: Any = None) -> Any:
    """The planner's state levels of `shape` on one device, nothing sharded (`planner.states.state_levels`)."""
    from memtrain.planner.states import state_levels
    from memtrain.strategies.sharding import make_sharding

    return state_levels(
        shape,
        precision=precision,
        optimizer_states=optimizer_states,
        backend=make_sharding("none"),
        replicated=True,
        world_size=1,
        dim0=dim0 or {},
        fixed_bytes=0,
        foreach=False,
    )


def probe_of(recipe: CausalLMRecipe) -> Any:
    """The planner's view of the built-in causal-LM trainer's job for `recipe`."""
    from memtrain.causal_lm.trainer import CausalLMTrainer
    from memtrain.planner.model_probe import ModelProbe

    return ModelProbe(CausalLMTrainer(recipe).model_spec())


class Killed(BaseException):
    """Stands for SIGKILL in this process (nothing in memtrain catches a BaseException that is not an
    Exception), to stop a run at an exact point without a child process."""


def initial_weights(recipe: CausalLMRecipe, trainer_class: Any = None) -> dict[str, Any]:
    """The weights a run of `recipe` starts training from (its seed, model and adapters), set up here by
    `trainer_class` (the built-in causal-LM trainer by default)."""
    from memtrain.causal_lm.trainer import CausalLMTrainer

    trainer = (trainer_class or CausalLMTrainer)(recipe)
    trainer.setup()
    assert trainer.model is not None
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


REDUCTION_ORDER = 1e-2
"""How far two trainings of one job may end apart when only the order of the gradient sums differs (two
ranks: each sums its half of the micro-batches, the all-reduce adds the halves; one process: a running
sum), as a fraction of how far the training moved the weights. Why a distance over the model and not a
per-element tolerance: each gradient element differs by ~2^-24 of the sum of its micro-batches'
magnitudes, a relative change of 2^-24 times how much the micro-batches cancel in that element, which is
unbounded; and AdamW steps each element by lr * m/(sqrt(v) + eps), independent of the gradient's scale,
so an element whose micro-batches nearly cancel can move by up to lr per step more or less (a sign
flip). Which elements those are depends on the machine's roundings: a fresh clone had 1 of 256 LoRA
elements off by 1.3e-5 (1.3e-3 lr) where this machine's worst was 3.7e-7. A simulation of the LoRA test
(64 adapters, 16384 elements, 3 AdamW steps, lr 1e-2) over 200 seeds, each seed another draw of the
roundings, gave: worst element / lr median 3.4e-4, p99 1.7e-2 (no per-element tolerance below ~lr
holds), distance / movement median 2.2e-6, p99 8.0e-5, worst 9.3e-5 (the full tiny llama of
recipes/tests/tiny-ddp.yaml, 6 steps, 100 seeds: worst 2.6e-5). The bound is 100x the worst draw; a
missed all-reduce (a rank steps with its own half of the gradient) ends at ~1.0, one unreduced tensor
of the 64 at 0.08-0.17."""


def assert_trained_alike(
    got: dict[str, Any], expected: dict[str, Any], initial: dict[str, Any], rel: float = REDUCTION_ORDER
) -> None:
    """`got` and `expected`: final weights of one job trained from `initial` with its gradients summed in
    another order. Weights the job did not train are bit-identical; the trained ones end within
    `rel` of the distance `expected` moved from `initial`, over all of them (`REDUCTION_ORDER`)."""

    assert got.keys() == expected.keys()
    moved = {name: expected[name].float() - initial[name].float() for name in expected}
    trained = [name for name, step in moved.items() if step.any()]
    assert trained, "the job trained nothing"
    for name in expected.keys() - set(trained):
        assert torch.equal(got[name], expected[name]), f"{name}: not trained, yet it differs"
    distance = float(torch.cat([(got[n].float() - expected[n].float()).flatten() for n in trained]).norm())
    movement = float(torch.cat([moved[n].flatten() for n in trained]).norm())
    worst = max(trained, key=lambda n: float((got[n].float() - expected[n].float()).abs().max()))
    assert distance <= rel * movement, (
        f"weights {distance:.3g} apart after moving {movement:.3g} ({distance / movement:.2e} > {rel}); "
        f"largest difference in {worst}"
    )


def inflate_last_report(trainer: Any, over: float = 1.01) -> None:
    """The trainer's last tracked report shows more activations than its step really had: `over` times the
    usable budget (a prediction that was low, seen by the step's calibration, not an out-of-memory error)."""
    assert trainer.plan_result is not None and trainer.plan_result.budget is not None
    report = trainer.monitor.memory_reports[-1]
    extra = int(trainer.plan_result.budget.usable * over) - report.peak_bytes
    at_peak = {**report.at_peak, "activations": report.at_peak["activations"] + extra}
    trainer.monitor.memory_reports[-1] = dataclasses.replace(
        report, peak_bytes=report.peak_bytes + extra, at_peak=at_peak
    )


# The user's documents: README.md and the guides, whose commands run in tests (tests/test_readme.py).
GUIDES = sorted((REPO / "docs/guides").glob("*.md"))


def shell_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of a markdown text, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def plan_commands(docs: list[Path], besides: tuple[Path, ...] = ()) -> list[str]:
    """Each `memtrain plan` command of `docs`, once, but those `besides` holds too."""
    shown = {c for doc in besides for c in shell_commands(doc.read_text(encoding="utf-8"))}
    commands = [c for doc in docs for c in shell_commands(doc.read_text(encoding="utf-8"))]
    return list(dict.fromkeys(c for c in commands if c.startswith("memtrain plan ") and c not in shown))


def command_id(command: str) -> str:
    """A test id without spaces (tests/slow.txt lists node ids one a line)."""
    return re.sub(r"[^\w.=-]+", "_", command.removeprefix("memtrain plan ").replace("recipes/", ""))
