"""GaLore's AdamW (`galore-torch`, Zhao et al. 2024) with its projection kept where a checkpoint and the
memory tracker can see it.

Why a subclass: galore-torch keeps each projected parameter's orthogonal matrix inside a Python object
(`state["projector"]`, a `GaLoreProjector`). Such an object is neither counted as optimizer-state bytes
(the tracker and `measured_state_bytes` read the tensors in `optimizer.state`) nor loadable from a
checkpoint read with `weights_only=True`. Here the matrix is also stored as the tensor
`state["ortho_matrix"]` after every step (in storage of its own size: `_compact`), `state_dict` leaves the
projector objects out, and the projectors are rebuilt from their matrices before the next step: a resumed
run projects with the matrix the uninterrupted one had, so its losses are the same bit for bit.

Which parameters are projected: every parameter of two dimensions (the linears, the embedding and the
head) goes to a group with `rank`, the others (norms, biases) to plain AdamW; galore-torch's default
`proj_type` (std: the smaller side is projected). Imported only when `optimizer.name: galore` is built
(`pip install 'memtrain[galore]'`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from galore_torch import GaLoreAdamW
from galore_torch.galore_projector import GaLoreProjector
from torch import nn

PROJECTOR_OPTIONS = ("update_proj_gap", "scale", "proj_type")


def galore_groups(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], rank: int, gap: int, scale: float
) -> list[dict[str, Any]]:
    """Parameter groups: the 2-D parameters projected at `rank` (re-projected every `gap` steps, the
    update scaled by `scale`), the rest plain AdamW. Groups given (zero1 rebuilds from its groups) pass."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return items  # type: ignore[return-value]
    tensors: list[nn.Parameter] = items  # type: ignore[assignment]
    projected = [p for p in tensors if p.dim() == 2]
    plain = [p for p in tensors if p.dim() != 2]
    groups: list[dict[str, Any]] = []
    if plain:
        groups.append({"params": plain})
    if projected:
        groups.append(
            {"params": projected, "rank": rank, "update_proj_gap": gap, "scale": scale, "proj_type": "std"}
        )
    return groups


class TrackedGaLoreAdamW(GaLoreAdamW):  # type: ignore[misc]
    """galore-torch's AdamW whose projection matrices are optimizer-state tensors (module doc); its moments
    have the projected shape (`factored_states`, for a resume's shape check)."""

    factored_states: ClassVar[bool] = True

    def __init__(self, params: Any, **defaults: Any) -> None:
        super().__init__(params, no_deprecation_warning=True, **defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self._restore_projectors()
        loss = super().step(closure)
        for state in self.state.values():
            projector = state.get("projector")
            if projector is not None:
                state["ortho_matrix"] = projector.ortho_matrix = _compact(projector.ortho_matrix)
        return loss  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, Any]:
        full = super().state_dict()
        states = full["state"].items()
        full["state"] = {k: {n: v for n, v in s.items() if n != "projector"} for k, s in states}
        return full  # type: ignore[no-any-return]

    def _restore_projectors(self) -> None:
        for group in self.param_groups:
            if "rank" not in group:
                continue
            for param in group["params"]:
                state = self.state.get(param)
                if not state or "ortho_matrix" not in state or "projector" in state:
                    continue
                projector = GaLoreProjector(group["rank"], **{k: group[k] for k in PROJECTOR_OPTIONS})
                projector.ortho_matrix = state["ortho_matrix"]
                state["projector"] = projector


def _compact(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` in storage of its own size. On fp32 gradients galore-torch keeps `Vh[:rank]` (or
    `U[:, :rank]`), a view that holds the whole min(m, n)-square factor of the SVD alive: the copy keeps
    rank x side elements instead (measured: 64 x 64 -> 8 x 64 at rank 8)."""
    if matrix.untyped_storage().nbytes() > matrix.numel() * matrix.element_size():
        return matrix.clone()
    return matrix
