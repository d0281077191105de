"""A toy checkpointing strategy with an option of its own, written as a user would add one: this file and
one registry line.

`every-nth` recomputes blocks 0, n, 2n, ... in backward. Its option `stride` is declared once, on the field:
the recipe reads it from `strategies.checkpointing_stride` (validated, with its bounds), a resume may change
it freely (it moves bytes, not arithmetic), and docs and schema list it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.registry import option


@dataclass(frozen=True)
class EveryNthBlock(Checkpointing):
    name: ClassVar[str] = "every-nth"
    recompute: ClassVar[str] = "forward"
    stride: int = option(
        2, doc="every-nth: recompute one block in this many.", changes_trajectory=False, gt=0
    )

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        return tuple(i % self.stride == 0 for i in range(num_blocks))
