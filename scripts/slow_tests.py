"""Which tests are slow, by measurement: writes tests/slow.txt from the durations of a full run.

    .venv/bin/python -m pytest -q --durations=0 > durations.txt     # the whole suite, on the 2-core machine
    .venv/bin/python scripts/slow_tests.py durations.txt > tests/slow.txt

A test is slow when it takes more than `--over` seconds (3 by default) alone: its setup, call and teardown
as the run measured them, plus the setup of each wider-scoped fixture (module, class, package, session) it
needs that an earlier test paid for, since run alone it pays that itself (a module fixture that trains
eight jobs makes every test of the module slow, not only the first). tests/conftest.py marks the listed
tests `slow`, so `bash scripts/test.sh -m "not slow"` leaves them out.

Why 3 s: the fast tier must run in under 4 minutes on the 2-core machine, lint and types included
(about 40 s with setup and collection); the tests of at most 3 s summed to about 140 s in the measured run.

The file also holds each test file's measured seconds (a line with a path and no `::`): scripts/test.sh
runs the suite on several workers (pytest-xdist, whole files per worker), and tests/conftest.py hands out the
longest files first, so the last file to finish is a short one.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(.+?)\s*$")
HEADER = """\
# Tests marked `slow` (tests/conftest.py): more than {over:g} s alone, measured in a full run on the 2-core
# machine, then each test file's seconds in that run (the longest files run first); written by
# scripts/slow_tests.py (its docstring: the rule, and how to regenerate this file).
"""


def durations(text: str) -> dict[str, dict[str, float]]:
    """Per test id, its measured setup, call and teardown seconds (pytest's `--durations=0` lines)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            out[match.group(3)][match.group(2)] += float(match.group(1))
    return out


class _Fixtures:
    """Collects, per test, the wider-scoped fixture instances it uses (one instance per module for a
    module-scoped fixture, per class for a class-scoped one)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.used: dict[str, set[tuple[str, ...]]] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            info: Any = getattr(item, "_fixtureinfo", None)
            instances: set[tuple[str, ...]] = set()
            for name, defs in info.name2fixturedefs.items() if info is not None else []:
                scope = str(defs[-1].scope)
                where = {
                    "module": item.nodeid.split("::")[0],
                    "class": item.nodeid.rsplit("::", 1)[0],
                }.get(scope, "")
                if scope != "function" and defs[-1].baseid:  # pytest's own (tmp_path_factory) cost nothing
                    instances.add((name, defs[-1].baseid, where))
            self.ids.append(item.nodeid)
            self.used[item.nodeid] = instances


def collect(args: list[str]) -> _Fixtures:
    fixtures = _Fixtures()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[fixtures])
    if code != 0:
        sys.exit(f"slow_tests: collecting the tests failed (pytest exit {code})")
    return fixtures


def alone(measured: dict[str, dict[str, float]], fixtures: _Fixtures) -> dict[str, float]:
    """Each collected test's seconds alone (module docstring)."""
    users: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for test, instances in fixtures.used.items():
        for instance in instances:
            users[instance].append(test)
    payer = {instance: tests[0] for instance, tests in users.items()}  # the first to run sets it up
    # A payer's setup holds every instance it set up (a module's autouse `one_thread` with its expensive
    # fixture): a fixture costs what its cheapest instance's payer took to set up.
    cost: dict[tuple[str, ...], float] = {}
    for instance, test in payer.items():
        seconds = measured.get(test, {}).get("setup", 0.0)
        cost[instance[:2]] = min(cost.get(instance[:2], seconds), seconds)
    out = {}
    for test in fixtures.ids:
        own = sum(measured.get(test, {}).values())
        out[test] = own + sum(cost[i[:2]] for i in fixtures.used[test] if payer[i] != test)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("durations", type=Path, help="output of a full `pytest -q --durations=0` run")
    parser.add_argument("--over", type=float, default=3.0, help="seconds alone above which a test is slow")
    args = parser.parse_args(argv)
    measured = durations(args.durations.read_text())
    if not measured:
        sys.exit(f"slow_tests: {args.durations} has no --durations=0 lines")
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        fixtures = collect([str(REPO / "tests")])
    seconds = alone(measured, fixtures)
    unmeasured = [t for t in fixtures.ids if t not in measured]
    slow = sorted(t for t, s in seconds.items() if s > args.over)
    print(HEADER.format(over=args.over), end="")
    for test in slow:
        print(f"{test} {seconds[test]:.1f}")
    by_file: dict[str, float] = defaultdict(float)
    for test in fixtures.ids:
        by_file[test.split("::")[0]] += sum(measured.get(test, {}).values())
    for path, total in sorted(by_file.items(), key=lambda item: -item[1]):
        print(f"{path} {total:.1f}")
    fast = sum(sum(measured.get(t, {}).values()) for t in fixtures.ids if t not in slow)
    print(
        f"slow_tests: {len(slow)} of {len(fixtures.ids)} tests slow; the others took {fast:.0f} s in the "
        f"measured run; {len(unmeasured)} collected tests have no measurement (new, skipped or under 5 ms)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
