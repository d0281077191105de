"""Mixture-of-experts grouped matmuls in the fake-tensor trace (planner/grouped_mm_trace.py).

Why: torch's meta kernel of `aten._grouped_mm` refuses fp32, so without the shim an fp32 MoE model's fake
trace fails and the planner falls back to a bounded real-tensor trace. These pin that the shim keeps
exactly what the real CPU kernel keeps (output, saved tensors, gradients: the same tracker bytes), that
MoE families then plan through the fake trace within the goal, and that bf16 still runs the meta kernel.
"""

from __future__ import annotations

import contextlib
import importlib.util
from types import ModuleType

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from memtrain.memory import MemoryTracker, fake_tensors
from memtrain.planner.grouped_mm_trace import output_shape, traced_grouped_mm
from memtrain.strategies.checkpointing import SelectiveCheckpointing

from helpers import REPO

MAX_ERROR = 0.005
TOKENS, HIDDEN, OUT, EXPERTS = 24, 16, 32, 4
OFFSETS = [5, 11, 20, 24]  # where each expert's rows end


def _sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("family_sweep", REPO / "scripts" / "family_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fp32_moe_family_plans_through_the_fake_trace(one_thread: None, family: str) -> None:
    sweep = _sweep()
    outcome = sweep.run_family(family, sweep.QUICK_PLANS)  # fp32, no checkpointing: planned and measured
    assert outcome["skipped"] is None and outcome["failures"] == [], outcome
    assert outcome["rows"], outcome
    for row in outcome["rows"]:
        assert row["real_trace"] is False, row  # no "traced with real tensors" progress line
        assert -MAX_ERROR <= row["error"] <= MAX_ERROR, row


def _experts_step(fake: bool) -> tuple[int, int, str, list[tuple[torch.Size, tuple[int, ...], torch.dtype]]]:
    """One fp32 experts matmul (`torch._grouped_mm(x, w.transpose(-2, -1), offs)`, as transformers calls it)
    with its backward, inside `traced_grouped_mm`, counted by the memory tracker: activation bytes kept
    after the forward, the step's peak, the output's backward node and the gradients' shapes, strides and
    dtypes. x is made in the forward and held only by autograd."""
    with fake_tensors() if fake else contextlib.nullcontext():
        leaf = torch.randn(TOKENS, HIDDEN, requires_grad=True)
        weight = torch.randn(EXPERTS, OUT, HIDDEN, requires_grad=True)
        offs = torch.tensor(OFFSETS, dtype=torch.int32)
        tracker = MemoryTracker(None, device="meta" if fake else "cpu")
        with tracker, traced_grouped_mm():
            tracker.begin_step(0)
            with tracker.phase("forward"):
                x = leaf * 1.0
                out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
                del x
            kept = tracker.snapshot()["activations"]
            node = type(out.grad_fn).__name__
            with tracker.phase("backward"):
                out.backward(torch.ones_like(out))
            peak = tracker.end_step().peak_bytes
        assert leaf.grad is not None and weight.grad is not None
        grads = [(g.shape, g.stride(), g.dtype) for g in (leaf.grad, weight.grad)]
    return kept, peak, node, grads


def test_shim_keeps_what_the_real_kernel_keeps() -> None:
    real_kept, real_peak, real_node, real_grads = _experts_step(fake=False)
    kept, peak, node, grads = _experts_step(fake=True)
    assert real_node == "GroupedMmBackward0" and node == "_GroupedMmBackward"  # the shim ran on fakes only
    # Saved: x (24 x 16) and the output while it lives; the weight and offs are not activations.
    assert real_kept == (TOKENS * HIDDEN + TOKENS * OUT) * 4
    assert kept == real_kept
    assert peak == real_peak
    assert grads == real_grads


def _selective_forward_kept(fake: bool, autocast: bool) -> int:
    """Activation bytes an fp32 experts matmul followed by SiLU keeps after its forward under selective
    recompute (the mode's own policy), optionally inside bf16 autocast (bf16-mixed: autocast leaves
    `_grouped_mm` alone, so the real kernel runs fp32)."""

    def experts(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs))

    with fake_tensors() if fake else contextlib.nullcontext():
        leaf = torch.randn(TOKENS, HIDDEN, requires_grad=True)
        weight = torch.randn(EXPERTS, OUT, HIDDEN, requires_grad=True)
        offs = torch.tensor(OFFSETS, dtype=torch.int32)
        tracker = MemoryTracker(None, device="meta" if fake else "cpu")
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
        with tracker, traced_grouped_mm(), cast:
            tracker.begin_step(0)
            with tracker.phase("forward"):
                x = leaf * 1.0
                out = checkpoint(
                    experts,
                    x,
                    weight,
                    offs,
                    use_reentrant=False,
                    context_fn=SelectiveCheckpointing().context_fn(),
                )
                del x
            kept: int = tracker.snapshot()["activations"]
            del out
            tracker.end_step()
    return kept


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_selective_recompute_keeps_the_shims_output_as_a_matmuls(autocast: bool) -> None:
    # The hole: the shim's output was a `new_empty`, which the selective policy recomputes rather than
    # keeps, and a matmul under autocast would have made it bf16: the trace kept the SiLU's input only.
    real = _selective_forward_kept(fake=False, autocast=autocast)
    assert real == (TOKENS * HIDDEN + 2 * TOKENS * OUT) * 4  # x, the matmul's output, the SiLU's output
    assert _selective_forward_kept(fake=True, autocast=autocast) == real


def test_without_the_shim_the_meta_kernel_refuses_fp32() -> None:
    # Why the shim exists; when this fails, torch's meta kernel accepts fp32 and the shim can go.
    with fake_tensors():
        x = torch.empty(TOKENS, HIDDEN)
        weight = torch.empty(EXPERTS, HIDDEN, OUT)
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(x, weight, offs=torch.tensor(OFFSETS, dtype=torch.int32))


def test_bf16_runs_the_meta_kernel_itself() -> None:
    with fake_tensors(), traced_grouped_mm():
        x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(EXPERTS, HIDDEN, OUT, dtype=torch.bfloat16, requires_grad=True)
        out = torch._grouped_mm(x, weight, offs=torch.tensor(OFFSETS, dtype=torch.int32))
    assert type(out.grad_fn).__name__ == "GroupedMmBackward0"
    assert out.shape == (TOKENS, OUT) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("a", "b", "groups"),
    [
        ((TOKENS, HIDDEN), (EXPERTS, HIDDEN, OUT), True),  # the experts' forward
        ((HIDDEN, TOKENS), (TOKENS, OUT), True),  # the weights' gradient
        ((EXPERTS, TOKENS, HIDDEN), (HIDDEN, OUT * EXPERTS), True),
        ((EXPERTS, TOKENS, HIDDEN), (EXPERTS, HIDDEN, OUT), False),  # a plain batched matmul
    ],
)
def test_output_shape_is_the_meta_kernels(a: tuple[int, ...], b: tuple[int, ...], groups: bool) -> None:
    mat_a = torch.empty(a, dtype=torch.bfloat16, device="meta")
    mat_b = torch.empty(b, dtype=torch.bfloat16, device="meta")
    offs = torch.tensor(OFFSETS, dtype=torch.int32, device="meta") if groups else None
    expected = torch.ops.aten._grouped_mm(mat_a, mat_b, offs).shape
    assert output_shape(mat_a, mat_b, offs) == tuple(expected)
