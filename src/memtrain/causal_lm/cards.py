"""Shape cards: the public `config.json` of models people fine-tune and pre-train, shipped with memtrain
(`shape_cards/<card>/config.json`, `shape_cards/index.json`: hub id -> card; an -Instruct id shares its
base model's shapes).

Why: a what-if ("does Llama-3.1-70B fit on my 8 GPUs?") needs shapes, not weights, and a hub id is often
not in the local cache, not reachable (no network), or gated behind a login and a licence. The planner
then reads the card as it would the cached config.json; `train` still needs the real weights (it resolves
`model.pretrained` without cards) and refuses by name before anything is allocated. Each card's
parameter count is checked against the published one (tests/pretrained/test_shape_cards.py).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

CARDS_DIR = Path(__file__).parent / "shape_cards"
_announced: set[str] = set()


@functools.cache
def _index() -> dict[str, str]:
    """Hub id (lower case) -> card directory name."""
    raw = json.loads((CARDS_DIR / "index.json").read_text(encoding="utf-8"))
    return {hub_id.lower(): card for hub_id, card in raw.items()}


def hub_ids() -> list[str]:
    """Every hub id a card answers for, as the hub spells it."""
    return list(json.loads((CARDS_DIR / "index.json").read_text(encoding="utf-8")))


def card_directory(hub_id: str) -> Path | None:
    """The card directory (its config.json alone) for `hub_id` (case-insensitive, as the hub), or None."""
    card = _index().get(hub_id.lower())
    return CARDS_DIR / card if card is not None else None


def announce(hub_id: str) -> None:
    """Say once per process, on stderr, that `hub_id`'s shapes come from its card."""
    if hub_id not in _announced:
        _announced.add(hub_id)
        print(
            f"[memtrain] shapes from memtrain's card for {hub_id}; download the model to train",
            file=sys.stderr,
        )
