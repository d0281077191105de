"""Token-budget micro-batching: pack a step batch's rows into micro-batches of at most N padded tokens.

With variable-length data a fixed number of sequences per micro-batch wastes memory on short rows and
runs out of it on long ones. A token budget bounds what a micro-batch costs (rows x longest row, since
rows are padded to the longest). Rows are taken longest first, so each micro-batch holds rows of similar
length and little padding. Any partition is exact: the loss is normalised by the global token count.
"""

from __future__ import annotations


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, each within `max_tokens` padded tokens (a single row longer than
    the budget gets a micro-batch of its own). Deterministic: ties keep the original order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for row in order:
        if groups:
            current = groups[-1]
            longest = lengths[current[0]]  # sorted: the first row is the longest
            if (len(current) + 1) * max(longest, 1) <= max_tokens:
                current.append(row)
                continue
        groups.append([row])
    return groups
