"""The tracker against numbers counted by hand on a model small enough to count.

Model: Linear(64, 128) -> ReLU -> Linear(128, 32), batch 16, fp32, Adam (on CPU torch picks its
single-tensor implementation). Loss = output.sum().
"""

from __future__ import annotations

import torch
from torch import nn

from memtrain.memory import MemoryTracker, fake_tensors

F32 = 4
# weights: W1 64x128 + b1 128 + W2 128x32 + b2 32 = 12,448 floats
WEIGHTS = (64 * 128 + 128 + 128 * 32 + 32) * F32  # 49,792 B
GRADIENTS = WEIGHTS  # one .grad per parameter, same shape and dtype
# Adam keeps, per parameter, exp_avg and exp_avg_sq (parameter-sized, fp32) and `step`, a 0-dim fp32 tensor on
# the CPU (torch.tensor(0.0); it would sit on the device only with capturable=True or fused=True).
OPTIMIZER_STATES = 2 * WEIGHTS + 4 * F32  # 99,600 B
INPUT = 16 * 64 * F32  # x, created before tracking: counted as `other` when first used
# Live activations at the end of forward: autograd saves x (pre-existing, not an activation) and W1.t() (a
# view of the weight: no new storage) for the first addmm; ReLU saves its *output* r (16x128); the second
# addmm saves r again (same storage) and W2.t(); sum() saves only a shape. The first addmm's output h (16x128)
# is saved by nobody and dies once ReLU has run; y (16x32) dies once sum() has run. Left: r and the scalar loss.
ACTIVATIONS_END_OF_FORWARD = 16 * 128 * F32 + F32  # 8,196 B
# Forward's own peak is the moment ReLU allocates r while h still lives: h + r on top of weights and x.
FORWARD_PEAK_STEP1 = WEIGHTS + INPUT + 2 * 16 * 128 * F32  # 70,272 B
# The step's peak is in the optimizer: all of weights, gradients and states exist (step 1 creates every state
# in _init_group before updating any parameter), and updating W1 (the largest, 64x128) computes
# denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): two W1-sized temporaries live at once.
OPTIMIZER_TEMPORARIES = 2 * 64 * 128 * F32  # 65,536 B
AT_PEAK = {
    "weights": WEIGHTS,
    "gradients": GRADIENTS,
    "optimizer_states": OPTIMIZER_STATES,
    "activations": 0,  # all freed by backward
    "other": INPUT + OPTIMIZER_TEMPORARIES,
}


def test_components_match_the_hand_count() -> None:
    _check_hand_count()


def test_same_count_under_fake_tensors() -> None:
    # What the planner relies on: the same step traced with no memory at all (storages on the meta device).
    with fake_tensors():
        tracker = _check_hand_count()
    assert tracker.device == torch.device("meta")


def _check_hand_count() -> MemoryTracker:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 64)
    tracker = MemoryTracker(model, optimizer)
    with tracker:
        for step in (1, 2):
            tracker.begin_step(step)
            with tracker.phase("forward"):
                loss = model(x).sum()
            at_forward_end = tracker.snapshot()
            with tracker.phase("backward"):
                loss.backward()
            del loss
            at_backward_end = tracker.snapshot()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            report = tracker.end_step()

            assert at_forward_end["activations"] == ACTIVATIONS_END_OF_FORWARD
            assert at_forward_end["weights"] == WEIGHTS
            assert at_backward_end["gradients"] == GRADIENTS
            assert at_backward_end["activations"] == 0
            assert report.at_peak == AT_PEAK, f"step {step}"
            assert report.peak_bytes == sum(AT_PEAK.values()) == 268_816
            assert report.peak_phase == "optimizer"
            assert report.peak_module == ""
            # after zero_grad(set_to_none=True): weights, states and the input remain
            assert report.live_bytes_end == WEIGHTS + OPTIMIZER_STATES + INPUT
        assert tracker.reports[0].phase_peaks["forward"] == FORWARD_PEAK_STEP1
        # step 2 starts with the optimizer state already there
        assert tracker.reports[1].phase_peaks["forward"] == FORWARD_PEAK_STEP1 + OPTIMIZER_STATES
    return tracker
