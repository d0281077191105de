"""Every stop signal is a checkpoint (issue #28, signals): SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGQUIT
at each moment a run passes through (before planning, during it, mid-step, during a checkpoint write)
exit with the documented code (130 for Ctrl-C, 0 for the others), one line and no traceback, keep the
step in flight, and `--resume auto` is bit-identical to an uninterrupted run; `train.stop_signals`
chooses the set.

The holes, before the fix: only SIGTERM and SIGINT were handled, and only inside the training loop.
SIGHUP, SIGUSR1 and SIGQUIT ended the process at once (SIGQUIT with a core dump), without the step in
flight; a SIGTERM before step 1 ended it with -15; a Ctrl-C in the planner raised KeyboardInterrupt
inside its traces (once swallowed by a fallback, the run trained on and exited 0; once SIGABRT from C++
code). In this process those signals would have killed the test session itself. There was no
`train.stop_signals` key.

The matrix is `fault_kit.launcher_faults.signal_matrix` (the fault suite's row), here in this process:
the run sends itself the signal at the drawn moment (the fault kit's `signal` fault), no sleeping.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from memtrain import cli
from memtrain.errors import RecipeError
from memtrain.run import checkpoints as ckpt
from memtrain.run.lineage import all_free_keys

from fault_kit import launcher_faults
from fault_kit.scenarios import Outcome, in_process, recipe_dict, write_recipe
from helpers import tiny_recipe

SEED = 0
SENDS_ITSELF = """
import os
import signal

from memtrain.causal_lm.trainer import CausalLMTrainer


class SendsItself(CausalLMTrainer):
    def train_step(self, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().train_step(step)
"""


def assert_recovered(outcome: Outcome) -> None:
    assert outcome.ok, f"{outcome.name}: {outcome.passed}/{outcome.trials} passed\n" + "\n".join(
        outcome.failures
    )


def test_each_signal_at_each_moment_exits_as_documented_and_resumes_bit_exact(tmp_path: Path) -> None:
    """Five trials: each signal once, the four moments all met (the seed's cycle), each resumed."""
    outcome = launcher_faults.signal_matrix(tmp_path, 5, SEED, in_process=True)
    assert_recovered(outcome)
    moments = {key.split()[1] for key in outcome.figures if " " in key and key.startswith("SIG")}
    assert moments == set(launcher_faults.MOMENTS), outcome.figures
    assert outcome.figures["bit-exact resumes"] == 5


def test_a_configured_stop_signal_checkpoints_and_the_handlers_are_restored(tmp_path: Path) -> None:
    """`train.stop_signals: [SIGUSR2]`: SIGUSR2 mid-step 2 stops after step 2 with a checkpoint, exit 0
    (before: no such key, and SIGUSR2 ended the process)."""
    raw = recipe_dict(tmp_path / "run", train={"steps": 5, "stop_signals": ["SIGUSR2"]})
    recipe = write_recipe(tmp_path / "recipe.yaml", raw)
    trainer = tmp_path / "sends_itself.py"
    trainer.write_text(SENDS_ITSELF)
    argv = ["train", str(recipe), "--no-progress", "--trainer", f"{trainer}:SendsItself"]
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    rc, out, err = in_process(cli.main, argv)
    assert rc == 0, err
    assert "[memtrain] SIGUSR2: stopped after step 2 with a checkpoint" in out
    assert "Traceback" not in err
    assert ckpt.find_checkpoint(tmp_path / "run/checkpoints").step == 2
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("value", [["SIGINT"], ["SIGKILL"], ["SIGSEGV"], ["TERM"]])
def test_stop_signals_refuses_what_cannot_ask_a_run_to_stop(tmp_path: Path, value: list[str]) -> None:
    """SIGINT is Ctrl-C already, SIGKILL cannot be caught, SIGSEGV reports a crash: one error naming
    the key (before: the key did not exist, so every value was an unknown key)."""
    with pytest.raises(RecipeError, match=r"train\.stop_signals"):
        tiny_recipe(tmp_path, train={"stop_signals": value})
    assert tiny_recipe(tmp_path).train.stop_signals == ["SIGTERM", "SIGHUP", "SIGUSR1", "SIGQUIT"]


def test_stop_signals_is_a_free_resume_key() -> None:
    """Which signals stop a run does not change its trajectory: a resume may change it freely."""
    assert "train.stop_signals" in all_free_keys()


@pytest.mark.slow  # three launches: the reference, the signalled run, the resume
def test_sigquit_to_a_process_leaves_no_core_and_resumes_bit_exact(tmp_path: Path) -> None:
    """In a process of its own (its default action would dump core): exit 0, no core file."""
    outcome = launcher_faults.signal_matrix(tmp_path, 1, SEED + 2, signals=("SIGQUIT",))
    assert_recovered(outcome)
