"""The CI subset of the fault-injection suite (scripts/fault_suite.py): a few faults of each kind, run by
the same scenario code (`fault_kit.scenarios`), so that a regression in any recovery path fails
CI, and the suite's figures in docs/RELIABILITY.md cannot drift from what is tested.

Each test fails with the scenario's own report: the fault (as the JSON `fault_kit.faults` takes)
and what went wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_kit import planted_pickles, run_dir_faults, scenarios
from fault_kit.faults import Fault
from fault_kit.recipe_fuzz import recipe_fuzz
from fault_kit.scenarios import Outcome

SEED = 0


def assert_recovered(outcome: Outcome) -> None:
    assert outcome.ok, f"{outcome.name}: {outcome.passed}/{outcome.trials} recovered\n" + "\n".join(
        outcome.failures
    )


def test_kill9_mid_step_and_mid_checkpoint_resume_bit_exact(tmp_path: Path) -> None:
    points = (
        Fault("kill", step=5, micro=2, phase="backward"),
        Fault("kill", step=6, phase="save", file="optimizer.pt", fraction=0.4),
    )
    outcome = scenarios.kill9(tmp_path, 0, SEED, jobs=2, points=points)
    assert_recovered(outcome)
    assert outcome.figures["torn staging dirs ignored"] >= 1


def test_oom_one_rank_loses_and_repeats_no_sample(tmp_path: Path) -> None:
    outcome = scenarios.oom_one_rank(tmp_path, 6, SEED)
    assert_recovered(outcome)
    assert outcome.figures["OOM events recovered"] == 6
    assert outcome.figures["samples lost"] == outcome.figures["samples seen twice"] == 0


@pytest.mark.distributed
def test_oom_two_ranks_agree_and_lose_nothing(tmp_path: Path) -> None:
    outcome = scenarios.oom_two_ranks(tmp_path, 4, SEED)
    assert_recovered(outcome)
    assert outcome.figures["steps the ranks disagreed on"] == 0


@pytest.mark.distributed
def test_oom_in_the_last_micro_step_of_two_ranks_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    assert_recovered(scenarios.oom_last_micro_step(tmp_path, 1, SEED))


def test_nonfinite_steps_are_skipped_and_k_in_a_row_stop(tmp_path: Path) -> None:
    outcome = scenarios.nonfinite(tmp_path, 3, SEED)
    assert_recovered(outcome)
    assert outcome.figures["stops after K in a row"] == 1


def test_sigterm_checkpoints_and_resumes_bit_exact(tmp_path: Path) -> None:
    assert_recovered(scenarios.sigterm(tmp_path, 1, SEED))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the pickle planted in model.pt
def test_corrupt_checkpoints_name_the_file_and_fall_back(tmp_path: Path) -> None:
    outcome = scenarios.corrupt(tmp_path, SEED)
    assert_recovered(outcome)
    assert outcome.figures["torch.load without weights_only=True in memtrain"] == 0


@pytest.mark.distributed
def test_dead_rank_restarts_from_the_last_checkpoint(tmp_path: Path) -> None:
    assert_recovered(scenarios.dead_rank(tmp_path, 1, SEED))


def test_recipe_fuzz_gives_clear_errors_and_never_runs_yaml(tmp_path: Path) -> None:
    outcome = recipe_fuzz(tmp_path, 60, SEED)
    assert_recovered(outcome)
    assert (
        outcome.figures["tracebacks"] == 0 and outcome.figures["YAML loaders other than yaml.safe_load"] == 0
    )


@pytest.mark.filterwarnings("ignore:strategies.sharding. zero3 on one rank")
def test_planted_pickles_never_run(tmp_path: Path) -> None:
    outcome = planted_pickles.planted_pickles(tmp_path, SEED)
    assert_recovered(outcome)
    assert outcome.figures["resume refused"] >= 5 and outcome.figures["export refused"] >= 4


def test_a_run_directory_cannot_make_memtrain_write_outside_it_or_crash(tmp_path: Path) -> None:
    """Eight of the suite's file x damage pairs, drawn from the seed (test_damaged_files.py runs them all),
    and every planted symlink."""
    outcome = run_dir_faults.run_dir_faults(tmp_path, SEED, damages=8)
    assert_recovered(outcome)
    assert outcome.figures["tracebacks"] == 0
    assert outcome.trials == 8 + len(run_dir_faults.PLANTED) + len(run_dir_faults.PLANTS)
