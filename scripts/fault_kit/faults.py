"""A `CausalLMTrainer` that breaks itself on purpose, and a launcher that runs `memtrain`'s command line
with it: `python -m fault_kit.faults [--fault JSON ...] train RECIPE [overrides] [--resume auto]`
(also as `torchrun ... -m fault_kit.faults ...`).

Why: the faults worth proving — kill -9 in the middle of a step or of a checkpoint file, an out-of-memory
error in a chosen micro-step's forward or backward, NaN/inf in the loss or a gradient, a rank that dies
or hangs — must happen inside the real loop, in real processes. Each `--fault` is a JSON `Fault`, so the
fault suite draws the points from its seed and any failure is reproduced by its command line.

The trainer also keeps a ledger per rank (`ledger_rank<r>.json` in the run directory, and `ledger`):
for every step, the sample ids of every attempt (an out-of-memory error makes the trainer redo the
step), the micro-batch size that completed it, and digests of the parameters and optimizer states
before and after. That is what shows no sample was lost or seen twice and a skipped step touched
nothing. Two harness options serve the out-of-memory scenarios: `--reset-micro` starts every step at
the recipe's micro-batch size (a run then absorbs an OOM at any step, not only until the micro-batch
reaches one sequence), and `--micro-schedule` replays the sizes a faulty run ended each step with, so
a fault-free reference run does the same arithmetic and the two can be compared bit for bit.

Kills and hangs fire only in the first launch of a torchrun job (`TORCHELASTIC_RESTART_COUNT` 0), so a
restarted group runs clean.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import torch
from torch import nn

from memtrain import checkpoint as tensor_files
from memtrain import cli
from memtrain.causal_lm import trainer as models
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.planner import PlanResult
from memtrain.run import checkpoints as ckpt
from memtrain.strategies.micro_batching import MicroBatching
from memtrain.training.trainer import Batch, FitResult

KINDS = ("kill", "oom", "nan", "inf", "inf_grad", "hang", "delay", "signal")
PHASES = ("forward", "backward", "save", "prune", "replace", "truncate", "plan", "planning")


@dataclass(frozen=True)
class Fault:
    """One fault. `step` is the 1-based step number, as in metrics.jsonl and checkpoint names.

    kill      SIGKILL this process: in micro-step `micro` of attempt `attempt` of `step` (`phase`
              forward: inside the model's forward, at its first block; backward: late in the backward,
              when the gradient reaches the first block, after the later blocks' gradients exist); or
              while checkpoint `step` is saved (`phase` save: after `fraction` of `file`'s bytes are on
              disk; `phase` prune: after the checkpoint is renamed into place, part of the way through
              deleting an older one; `phase` replace: when `step` is saved again, after the old checkpoint
              is renamed aside, before the new one is renamed in); or while a rollback truncates the run
              (`phase` truncate: after checkpoint `step` is moved to abandoned/).
    oom       raise torch.OutOfMemoryError at the same points as a mid-step kill.
    nan, inf  multiply every micro-step's loss of `step` by NaN or inf.
    inf_grad  set one gradient element to inf after the backward of `step`.
    hang      sleep `seconds` at the start of `step`.
    delay     sleep `seconds` in the first micro-step of every step (so a signal lands mid-step).
    signal    send this process `signal` (a name): `phase` plan, before planning; planning, when the
              planner first asks for a batch to trace; forward, as a kill mid-step; save, while
              checkpoint `step` writes `file` (the write goes on).
    Every fault fires once, on rank `rank` only (-1: on every rank).
    """

    kind: str
    step: int = 0
    micro: int = 1
    attempt: int = 1
    phase: str = "forward"
    file: str = ""
    fraction: float = 0.5
    rank: int = 0
    seconds: float = 0.0
    signal: str = "SIGTERM"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.phase not in PHASES:
            raise ValueError(f"fault phase {self.phase!r} is not one of {', '.join(PHASES)}")
        if self.phase == "save" and not self.file:
            raise ValueError("a kill in phase 'save' needs the file being written (e.g. model.pt)")
        if self.kind == "signal" and self.signal not in signal.Signals.__members__:
            raise ValueError(f"{self.signal!r} is not a signal name")

    @classmethod
    def parse(cls, text: str) -> Fault:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"bad --fault {text!r}: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Harness:
    """The faults of one run, and the micro-batch options of the out-of-memory scenarios."""

    faults: tuple[Fault, ...] = ()
    reset_micro: bool = False
    micro_schedule: dict[int, int] = field(default_factory=dict)

    def to_args(self) -> list[str]:
        """This harness as launcher arguments (they go before memtrain's own `train RECIPE ...`)."""
        args = [arg for fault in self.faults for arg in ("--fault", fault.to_json())]
        if self.reset_micro:
            args.append("--reset-micro")
        if self.micro_schedule:
            args += ["--micro-schedule", json.dumps(self.micro_schedule)]
        return args


@dataclass
class StepRecord:
    attempts: list[list[int]] = field(default_factory=list)  # sample ids per attempt, in order
    micro_batch_size: int = 0  # the size of the attempt that completed the step
    skipped: bool = False
    params_before: str = ""
    params_after: str = ""
    optimizer_before: str = ""
    optimizer_after: str = ""


def digest(tensors: Iterator[torch.Tensor]) -> str:
    """sha256 over the bytes of `tensors`, in order (bit-exact identity of a model or optimizer state)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


class FaultTrainer(CausalLMTrainer):
    """`CausalLMTrainer` plus the faults of `harness` and the per-step ledger."""

    cli_harness: ClassVar[Harness | None] = None  # the faults of a `memtrain train` under `main`

    def __init__(self, recipe: CausalLMRecipe, harness: Harness | None = None) -> None:
        super().__init__(recipe)
        self.harness = harness or self.cli_harness or Harness()
        self.first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.ledger: dict[int, StepRecord] = {}
        self.initial_micro: int | None = None  # the planned micro-batch size (set by choose_plan)
        self._fired: set[Fault] = set()
        self._step = 0  # the step number in flight, 0 outside train_step
        self._micro = 0
        self._forward_fault: Fault | None = None
        self._backward_fault: Fault | None = None

    def choose_plan(self, free_bytes: int | None = None) -> PlanResult:
        self._signal_at("plan")
        result = super().choose_plan(free_bytes)
        self.initial_micro = result.plan.micro_batch_size
        return result

    # ------------------------------------------------------------------------------ fault points

    def _pending(self, kind: str, phase: str) -> Fault | None:
        """The unfired fault of `kind` at this rank's current step, attempt, micro-step and `phase`."""
        record = self.ledger.get(self._step)
        for fault in self.harness.faults:
            if (
                fault.kind == kind
                and fault.phase == phase
                and fault.step == self._step
                and fault.rank in (self.env.rank, -1)
                and fault not in self._fired
                and record is not None
                and fault.attempt == len(record.attempts)
                and fault.micro == self._micro
                and (self.first_launch or kind not in ("kill", "hang"))
            ):
                return fault
        return None

    def _pending_at_step(self, kind: str) -> Fault | None:
        for fault in self.harness.faults:
            if (
                fault.kind == kind
                and fault.step in (self._step, 0)
                and fault.rank in (self.env.rank, -1)
                and fault not in self._fired
                and (self.first_launch or kind not in ("kill", "hang"))
            ):
                return fault
        return None

    def _fire(self, fault: Fault) -> None:
        if fault.kind != "delay":
            self._fired.add(fault)
        if fault.kind == "kill":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "oom":
            raise torch.OutOfMemoryError(
                f"injected by fault_kit.faults: out of memory at step {fault.step}, micro-step "
                f"{fault.micro} ({fault.phase}) on rank {self.env.rank}"
            )
        elif fault.kind in ("hang", "delay"):
            time.sleep(fault.seconds)
        elif fault.kind == "signal":
            os.kill(os.getpid(), signal.Signals[fault.signal])

    def _signal_at(self, phase: str) -> None:
        """Fire the unfired signal of `phase` (plan, planning: not tied to a step)."""
        for fault in self.harness.faults:
            if fault.kind == "signal" and fault.phase == phase and fault not in self._fired:
                self._fire(fault)

    # ------------------------------------------------------------------------------ hooks

    def planning_batch(self, rows: int) -> Batch:
        self._signal_at("planning")
        return super().planning_batch(rows)

    def setup(self) -> None:
        super().setup()
        assert self.model is not None
        first_block = self.blocks(self.sharding.unwrap(self.model))[0]
        first_block.register_forward_pre_hook(self._fire_forward_fault)
        first_block.register_forward_hook(self._arm_backward_fault)

    def _fire_forward_fault(self, module: nn.Module, inputs: Any) -> None:
        """Mid-forward, where a real OOM happens: after the embeddings, inside any wrapper's forward."""
        if self._forward_fault is not None:
            self._fire(self._forward_fault)

    def _arm_backward_fault(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Make the gradient of the first block's output fire the fault: the backward reaches it after
        every later block's parameters have their gradients."""
        fault = self._backward_fault
        if fault is not None and torch.is_grad_enabled():
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda grad: self._fire(fault))
            self._fired.add(fault)

    def train_step(self, step: int) -> dict[str, Any]:
        self._step = step + 1
        self._start_micro()
        record = self.ledger[self._step] = StepRecord(
            params_before=self._params_digest(), optimizer_before=self._optimizer_digest()
        )
        hang = self._pending_at_step("hang")
        if hang is not None:
            self._fire(hang)
        row = super().train_step(step)
        record.micro_batch_size = self.plan.micro_batch_size
        record.skipped = bool(row["skipped"])
        record.params_after, record.optimizer_after = self._params_digest(), self._optimizer_digest()
        self._step = 0
        return row

    def _start_micro(self) -> None:
        size = self.harness.micro_schedule.get(self._step)
        if size is None and self.harness.reset_micro:
            size = self.initial_micro
        if size is not None and size != self.plan.micro_batch_size:
            self.plan = self.plan.replace(
                micro_batching=MicroBatching(size, self.per_rank_batch_size // size)
            )

    def split_batch(self, batch: Batch, micro_size: int) -> list[Batch]:
        parts = super().split_batch(batch, micro_size)
        if self._step:  # a new attempt at the step in flight (not evaluation)
            self.ledger[self._step].attempts.append([])
            self._micro = 0
        return parts

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._step:
            return super().loss(model, batch)
        self._micro += 1
        delay = self._pending_at_step("delay")
        if delay is not None and self._micro == 1:
            self._fire(delay)
        self.ledger[self._step].attempts[-1].extend(batch["sample_ids"].tolist())
        self._forward_fault = (
            self._pending("kill", "forward")
            or self._pending("oom", "forward")
            or self._pending("signal", "forward")
        )
        self._backward_fault = self._pending("kill", "backward") or self._pending("oom", "backward")
        try:
            loss_sum, count = super().loss(model, batch)
        finally:
            self._forward_fault = self._backward_fault = None
        for kind, factor in (("nan", math.nan), ("inf", math.inf)):
            if self._pending_at_step(kind) is not None:
                loss_sum = loss_sum * factor
        return loss_sum, count

    def optimizer_step(self) -> tuple[float, bool]:
        fault = self._pending_at_step("inf_grad")
        if fault is not None:
            assert self.model is not None
            self._fired.add(fault)
            grad = next(p.grad for p in self.sharding.unwrap(self.model).parameters() if p.grad is not None)
            with torch.no_grad():
                grad[(0,) * grad.dim()] = math.inf
        return super().optimizer_step()

    def save_checkpoint(self, step: int) -> Path:
        for fault in self.harness.faults:
            if (
                fault.kind in ("kill", "signal")
                and fault.phase in ("save", "prune", "replace")
                and fault.step == step
                and fault.rank in (self.env.rank, -1)
                and self.first_launch
            ):
                with self._dying_in(fault):
                    return super().save_checkpoint(step)
        return super().save_checkpoint(step)

    @contextlib.contextmanager
    def _dying_in(self, fault: Fault) -> Iterator[None]:
        """Patch the checkpoint module so that this save dies at the fault's point."""
        if fault.kind == "signal":  # the signal lands as `file` is written, and the save goes on
            real = tensor_files.write_file

            def signalling_write(path: Path, write: Callable[[Any], None]) -> None:
                if path.name == fault.file and fault not in self._fired:
                    self._fire(fault)
                real(path, write)

            with mock.patch.object(tensor_files, "write_file", signalling_write):
                yield
        elif fault.phase == "save":
            real_write = tensor_files.write_file

            def torn_write(path: Path, write: Callable[[Any], None]) -> None:
                if path.name != fault.file:
                    real_write(path, write)
                    return
                buffer = io.BytesIO()
                write(buffer)
                data = buffer.getvalue()
                with open(path, "wb") as handle:
                    handle.write(data[: int(len(data) * fault.fraction)])
                    handle.flush()
                    os.fsync(handle.fileno())
                self._fire(fault)

            with mock.patch.object(tensor_files, "write_file", torn_write):
                yield
        elif fault.phase == "replace":
            trash = ckpt.trash_dir(self.run.layout.checkpoints, fault.step)
            with self._dying_after_move(fault, lambda target: target == trash):
                yield
        else:  # prune: the new checkpoint is in place; die part of the way through deleting an old one
            real_rmtree = shutil.rmtree
            final = self.run.layout.checkpoints / ckpt.step_dir_name(fault.step)

            def rmtree_then_die(path: str | Path, *args: Any, **kwargs: Any) -> None:
                if not final.is_dir():  # before the rename: e.g. stale staging directories being cleared
                    real_rmtree(path, *args, **kwargs)
                    return
                files = sorted(Path(path).iterdir())
                victim = next((f for f in files if f.name == "model.pt"), files[0] if files else None)
                if victim is not None:
                    victim.unlink()
                self._fire(fault)

            with mock.patch.object(ckpt.shutil, "rmtree", rmtree_then_die):
                yield

    @contextlib.contextmanager
    def _dying_after_move(self, fault: Fault, fatal: Callable[[Path], bool]) -> Iterator[None]:
        """Die right after a checkpoint directory is renamed to a target for which `fatal` is true."""
        real_move = ckpt.move_dir

        def move_then_die(source: Path, target: Path) -> None:
            real_move(source, target)
            if fatal(target):
                self._fire(fault)

        with mock.patch.object(ckpt, "move_dir", move_then_die):
            yield

    def _dying_in_truncation(self) -> contextlib.AbstractContextManager[None]:
        """A `truncate` kill: die once the rollback has moved checkpoint `step` to abandoned/."""
        kills = [f for f in self.harness.faults if f.kind == "kill" and f.phase == "truncate"]
        if not kills or not self.first_launch:
            return contextlib.nullcontext()
        name = ckpt.step_dir_name(kills[0].step)
        return self._dying_after_move(
            kills[0], lambda target: target.name == name and target.parent.parent == self.run.layout.abandoned
        )

    def fit(self, resume: str | Path | bool | None = None, allow_recipe_change: bool = False) -> FitResult:
        try:
            with self._dying_in_truncation():
                return super().fit(resume, allow_recipe_change)
        finally:
            self.write_ledger()

    # ------------------------------------------------------------------------------ ledger

    def _params_digest(self) -> str:
        assert self.model is not None
        return digest(p for _, p in sorted(self.sharding.unwrap(self.model).named_parameters()))

    def _optimizer_digest(self) -> str:
        assert self.optimizer is not None
        state = self.optimizer.state_dict()["state"]
        return digest(
            v for key in sorted(state) for _, v in sorted(state[key].items()) if isinstance(v, torch.Tensor)
        )

    def write_ledger(self) -> None:
        if not self.run_dir.is_dir():
            return
        data = {
            "rank": self.env.rank,
            "oom_events": self.monitor.oom_events,
            "steps": {str(s): dataclasses.asdict(r) for s, r in sorted(self.ledger.items())},
        }
        path = self.run_dir / f"ledger_rank{self.env.rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


def read_ledger(run_dir: Path, rank: int = 0) -> dict[int, StepRecord]:
    """The ledger a (finished or stopped) run wrote for `rank`."""
    data = json.loads((run_dir / f"ledger_rank{rank}.json").read_text())
    return {int(s): StepRecord(**r) for s, r in data["steps"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fault_kit.faults",
        description="memtrain's command line with a fault-injecting trainer (test only).",
    )
    parser.add_argument(
        "--fault",
        action="append",
        type=Fault.parse,
        default=[],
        metavar="JSON",
        help='a Fault as JSON, e.g. \'{"kind": "kill", "step": 3, "phase": "backward"}\'',
    )
    parser.add_argument(
        "--reset-micro", action="store_true", help="start every step at the recipe's micro-batch size"
    )
    parser.add_argument(
        "--micro-schedule",
        type=json.loads,
        default={},
        metavar="JSON",
        help="micro-batch size per step number, e.g. '{\"3\": 2}'",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="memtrain's arguments: train RECIPE ...")
    args = parser.parse_args(argv)
    harness = Harness(
        tuple(args.fault), args.reset_micro, {int(k): int(v) for k, v in args.micro_schedule.items()}
    )
    with (
        mock.patch.object(FaultTrainer, "cli_harness", harness),
        mock.patch.object(models, "CausalLMTrainer", FaultTrainer),
    ):
        return cli.main(args.command)


if __name__ == "__main__":
    sys.exit(main())
