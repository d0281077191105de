"""`strategies.compile` through the real Trainer (CPU, Inductor): compiled runs train as eager ones, resume
exactly, compile a Trainer subclass's blocks and two transformers families, and re-compile what a re-plan
re-wraps. A compile here takes 10-60 s, so every trained variant is trained once per module
(`trained`) and the rows have one length (no recompile for a new sequence length).

Tolerances, from the reordering Inductor does (fused kernels, reductions split and summed in another
order; no change of the maths):
- fp32: a reordered fp32 sum differs by a few ulps (eps 1.2e-7) per reduction; a step's loss goes through a
  few dozen of them and AdamW's first steps divide by sqrt(v) ~ |g|, which turns a relative gradient
  difference into the same relative update difference, so 3 steps stay within ~1e-6 relative: rtol 1e-5
  (measured: 6e-8).
- bf16-mixed: the autocast ops' outputs are bf16 (eps 7.8e-3). Inductor keeps a fused chain of pointwise
  ops in fp32 registers and rounds once where eager rounds after every op, so each differs by up to one
  bf16 rounding: step 1's loss within 1e-2 relative, the next steps' too (lr 1e-2 steps move the loss by
  ~3%, so a tolerance of 1e-2 still tells a step that trained from one that did not).
Parameters are not compared element by element: AdamW's first updates are lr * g / |g|, so an element
whose gradient is at the reordering's noise level (~1e-9) moves by +-lr either way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.strategies.compile import compiled_modules, is_compiled
from memtrain.training.trainer import Trainer

from helpers import TINY_LLAMA, tiny_recipe

pytestmark = pytest.mark.slow

TINY_QWEN2 = {**TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": False}
FAMILIES = {"llama": TINY_LLAMA, "qwen2": TINY_QWEN2}
RTOL = {"fp32": 1e-5, "bf16-mixed": 1e-2}


class Trained:
    """One run's losses, final parameters and which modules its model has compiled."""

    def __init__(self, trainer: Trainer, losses: list[float], run_dir: Path | None = None) -> None:
        self.losses = losses
        self.run_dir = run_dir
        self.params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}  # type: ignore[union-attr]
        self.compiled = compiled_modules(trainer.model)  # type: ignore[arg-type]


def _recipe(
    root: Path, family: str, precision: str, mode: str, compile_: str, **train: Any
) -> CausalLMRecipe:
    return tiny_recipe(
        root / f"{family}-{precision}-{mode}-{compile_}",
        model={"config": dict(FAMILIES[family])},
        data={"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 256, "min_len": 0}},
        train={"steps": 3, **train},
        checkpoint={"every": 2, "keep": 3, "at_end": True},
        strategies={"precision": precision, "checkpointing": mode, "compile": compile_, "sharding": "none"},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Trained]:
    """Train (family, precision, checkpointing, compile) once per module, on first request."""
    root = tmp_path_factory.mktemp("compile")
    done: dict[tuple[str, ...], Trained] = {}

    def train(family: str, precision: str, mode: str, compile_: str) -> Trained:
        key = (family, precision, mode, compile_)
        if key not in done:
            trainer = CausalLMTrainer(_recipe(root, *key))
            result = trainer.fit()
            done[key] = Trained(trainer, result.losses, result.run_dir)
        return done[key]

    return train


VARIANTS = [
    ("llama", "fp32", "none", "blocks"),
    ("llama", "bf16-mixed", "selective", "blocks"),
    ("llama", "fp32", "full", "model"),
    ("qwen2", "fp32", "full", "blocks"),
]


@pytest.mark.parametrize("family,precision,mode,compile_", VARIANTS)
def test_compiled_losses_are_eager_losses(
    trained: Callable[..., Trained], family: str, precision: str, mode: str, compile_: str
) -> None:
    eager = trained(family, precision, mode, "none")
    compiled = trained(family, precision, mode, compile_)
    assert eager.compiled == []  # `none` leaves no trace
    expected = ["model.layers.0", "model.layers.1"] if compile_ == "blocks" else [""]
    assert compiled.compiled == expected
    assert len(compiled.losses) == 3
    assert compiled.losses == pytest.approx(eager.losses, rel=RTOL[precision])
    assert compiled.losses[2] < compiled.losses[0]  # it trains
    assert compiled.params.keys() == eager.params.keys()  # in place: the same names and state_dict keys


def test_resume_of_a_compiled_run_is_exact(trained: Callable[..., Trained], tmp_path: Path) -> None:
    """The uninterrupted compiled run's checkpoint at step 2, resumed compiled (a fork in another run
    directory): step 3 and the final weights are the uninterrupted run's, bit for bit."""
    key = ("llama", "fp32", "none", "blocks")
    whole = trained(*key)
    assert whole.run_dir is not None
    resumed = CausalLMTrainer(_recipe(tmp_path, *key))
    result = resumed.fit(resume=whole.run_dir / "checkpoints" / "step_00000002")
    assert compiled_modules(resumed.model) == ["model.layers.0", "model.layers.1"]  # type: ignore[arg-type]
    assert result.losses == [whole.losses[2]]
    for name, value in resumed.model.named_parameters():  # type: ignore[union-attr]
        assert torch.equal(value, whole.params[name]), name


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MlpTrainer(Trainer):
    """A hand-written model of three equal blocks: `Trainer`'s block discovery finds the ModuleList."""

    def build_model(self) -> nn.Module:
        return Mlp()

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 32, (self.per_rank_batch_size, 9), generator=generator)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        logits = model(batch["ids"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return loss_sum, batch["labels"].numel()


def _subclass_run(tmp_path: Path, compile_: str) -> Trained:
    recipe = CausalLMRecipe.from_dict(
        {
            "run": {"name": "mlp", "output_dir": str(tmp_path / compile_), "seed": 0},
            "batch": {"global_size": 4, "micro_size": 4},
            "train": {"steps": 3, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "strategies": {
                "precision": "fp32",
                "checkpointing": "full",
                "compile": compile_,
                "sharding": "none",
            },
        }
    )
    trainer = MlpTrainer(recipe)
    return Trained(trainer, trainer.fit().losses)


def test_a_trainer_subclass_model_compiles_its_blocks(tmp_path: Path) -> None:
    eager, compiled = _subclass_run(tmp_path, "none"), _subclass_run(tmp_path, "blocks")
    assert compiled.compiled == ["blocks.0", "blocks.1", "blocks.2"] and eager.compiled == []
    assert compiled.losses == pytest.approx(eager.losses, rel=RTOL["fp32"])


def test_a_graph_break_is_named_with_its_block(tmp_path: Path) -> None:
    """A block whose forward prints (Dynamo cannot trace `print`) warns once, naming the block; the
    run goes on (the printing part eager)."""
    from memtrain.strategies.compile import CompileBlocks

    model = Mlp()
    blocks = list(model.blocks)
    loud = blocks[1]
    loud.forward = lambda x: (print("hi"), Block.forward(loud, x))[1]  # type: ignore[method-assign]
    CompileBlocks().apply(model, blocks)
    assert all(is_compiled(b) for b in blocks) and not is_compiled(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randint(0, 32, (2, 8))).sum().backward()
    breaks = [str(w.message) for w in caught if "graph break" in str(w.message)]
    assert breaks and all("blocks.1 (Block)" in line for line in breaks), breaks


class InjectedOOM(CausalLMTrainer):
    """Raises an out-of-memory error in the run's `loss` at step `at` (its first call), once."""

    def __init__(self, *args: Any, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at, self.step_now, self.raised = at, -1, False

    def train_step(self, step: int) -> dict[str, Any]:
        self.step_now = step
        return super().train_step(step)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if model is self.model and self.step_now == self.at and not self.raised:
            self.raised = True
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().loss(model, batch)


@pytest.mark.usefixtures("shared_traces")
def test_a_replan_to_checkpointing_recompiles_the_rewrapped_blocks(tmp_path: Path) -> None:
    """An out-of-memory error at step 2 under `none` re-plans to `full` (the budget holds `none`'s
    predicted peak only just): the blocks are re-wrapped and compiled anew, the monitor tracks every step,
    and the losses are an eager run's with the same re-plan."""
    choice = {"checkpointing": ["none", "full"], "loss": "standard", "optimizer_states": "fp32"}
    batch = {"global_size": 4, "micro_size": 1}

    def recipe(where: str, compile_: str, budget: int | None = None) -> CausalLMRecipe:
        return tiny_recipe(
            tmp_path / where,
            data={"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 256, "min_len": 0}},
            memory={"budget": budget, "track": True},
            strategies={**choice, "compile": compile_},
            batch=batch,
            train={"steps": 3},
        )

    probe = CausalLMTrainer(recipe("probe", "none")).choose_plan()
    assert probe.chosen is not None and probe.plan.checkpointing.name == "none"
    budget = int(probe.chosen.prediction.peak / 0.98) + 256

    runs = {}
    for compile_ in ("none", "blocks"):
        trainer = InjectedOOM(recipe(compile_, compile_, budget), at=1)
        trainer.setup()
        before = [b._compiled_call_impl for b in trainer._blocks]
        losses = trainer.fit().losses
        assert trainer.plan.checkpointing.name == "full" and trainer.plan.compile.name == compile_
        assert len(trainer.monitor.memory_reports) >= 3
        assert all("forward" in vars(b) for b in trainer._blocks)  # re-wrapped
        after = [b._compiled_call_impl for b in trainer._blocks]
        if compile_ == "none":
            assert before == after == [None, None]
        else:  # compiled at setup, compiled anew (another compiled call) by the re-plan
            assert all(
                a is not None and b is not None and a is not b for a, b in zip(after, before, strict=True)
            )
        runs[compile_] = losses
    assert runs["blocks"] == pytest.approx(runs["none"], rel=RTOL["fp32"])


FSDP2_RUN = """
import json, sys, tempfile, warnings
from pathlib import Path
sys.path.insert(0, "tests")
from helpers import tiny_recipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.strategies.compile import compiled_modules
root, out = Path(tempfile.mkdtemp()), {}
for compile_ in ("none", "blocks"):
    trainer = CausalLMTrainer(tiny_recipe(
        root / compile_,
        data={"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 256, "min_len": 0}},
        train={"steps": 3},
        strategies={"precision": "fp32", "checkpointing": "full", "compile": compile_, "sharding": "zero3",
                    "sharding_backend": "fsdp2"},
    ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = trainer.fit().losses
    inner = trainer._sharding.unwrap(trainer.model)
    out[compile_] = {"losses": losses, "compiled": compiled_modules(inner),
                     "block": type(inner.model.layers[0]).__name__}
print(json.dumps(out))
"""


def test_fsdp2_shards_the_compiled_blocks(tmp_path: Path) -> None:
    """zero3 on FSDP2 (one rank, a process of its own for the process group): `fully_shard` wraps the blocks
    compiled before it (their class becomes FSDP's, their compiled call stays), and the losses are eager's."""
    import json
    import subprocess
    import sys

    from helpers import REPO, subprocess_env

    done = subprocess.run(
        [sys.executable, "-c", FSDP2_RUN],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["none"]["compiled"] == [] and out["blocks"]["compiled"] == ["model.layers.0", "model.layers.1"]
    assert out["blocks"]["block"].startswith("FSDP")
    assert out["blocks"]["losses"] == pytest.approx(out["none"]["losses"], rel=RTOL["fp32"])
