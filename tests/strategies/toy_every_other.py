"""A toy checkpointing strategy, written as a user would add one: this file and one registry line.

`every-other` recomputes blocks 0, 2, 4, ... in backward. It subclasses `Checkpointing` and says only which
blocks recompute; applying it (wrapping those blocks), its byte estimate, the planner's traces and walk,
and the step-time model all come from the base class's block-wise behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memtrain.strategies.checkpointing import Checkpointing


@dataclass(frozen=True)
class EveryOtherBlock(Checkpointing):
    name: ClassVar[str] = "every-other"
    recompute: ClassVar[str] = "forward"

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        return tuple(i % 2 == 0 for i in range(num_blocks))
