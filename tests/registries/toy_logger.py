"""A toy experiment logger, written as a user would add one: this file and one registry line
(`LOGGERS.register(LoggerEntry("toy", ToyLogger))`).

`ToyLogger` keeps every row it is given in memory, under the run's name, and notes the runs it closed, so
a test can read both back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from memtrain.loggers import LoggerContext


class ToyLogger:
    received: ClassVar[dict[str, list[dict[str, Any]]]] = {}
    closed: ClassVar[set[str]] = set()

    def __init__(self, context: LoggerContext) -> None:
        self.run_name = context.run_name
        self.rows = ToyLogger.received.setdefault(context.run_name, [])

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))

    def close(self) -> None:
        ToyLogger.closed.add(self.run_name)
