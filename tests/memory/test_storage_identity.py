"""Counting by storage and by current identity: shared storages once, lazy state, module attribution."""

from __future__ import annotations

import torch
from torch import nn

from memtrain.memory import MemoryTracker

from helpers import tracked_step


class _Shared(nn.Module):
    """Two parameters over one storage (a transposed view): 320 bytes, not 640."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.zeros(10, 8)
        self.a = nn.Parameter(base)
        self.b = nn.Parameter(base.t())


def test_parameters_sharing_a_storage_count_once() -> None:
    model = _Shared()
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()
    with MemoryTracker(model) as tracker:
        assert tracker.snapshot()["weights"] == 10 * 8 * 4


def test_tied_embedding_counts_once() -> None:
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    with MemoryTracker(model) as tracker:
        assert tracker.snapshot()["weights"] == 100 * 16 * 4


def test_views_of_an_activation_count_once() -> None:
    w = nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8)
    tracker = MemoryTracker(w)
    with tracker:
        tracker.begin_step(1)
        with tracker.phase("forward"):
            h = w(x.view(4, 8))  # x pre-exists: its view is not an activation; h is one new 4x8 storage
            kept = [h.t(), h[1:], h.view(-1), h.unsqueeze(0).expand(3, 4, 8)]
        assert tracker.snapshot()["activations"] == 4 * 8 * 4
        assert tracker.snapshot()["other"] == x.nbytes
        del h, kept
        assert tracker.snapshot()["activations"] == 0
        tracker.end_step()


def test_pre_existing_state_is_counted_on_entry() -> None:
    model = nn.Linear(32, 16)
    optimizer = torch.optim.SGD(model.parameters(), momentum=0.9)
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()  # momentum buffers now exist, before any tracking
    with MemoryTracker(model, optimizer) as tracker:
        snap = tracker.snapshot()
    n = (32 * 16 + 16) * 4
    assert snap["weights"] == snap["gradients"] == snap["optimizer_states"] == n


def _wide(batch: int = 256) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1))
    return model, torch.optim.Adam(model.parameters()), torch.randn(batch, 64)


def _train_step(
    tracker: MemoryTracker, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> None:
    tracked_step(tracker, model, optimizer, x)


def test_optimizer_state_appears_in_step_one_and_stays() -> None:
    model, optimizer, x = _wide()
    states = sum(2 * p.numel() * 4 + 4 for p in model.parameters())  # exp_avg, exp_avg_sq, fp32 step
    tracker = MemoryTracker(model)
    tracker.attach_optimizer(optimizer)  # built after the model, attached later
    with tracker:
        for step in (1, 2, 3):
            tracker.begin_step(step)
            _train_step(tracker, model, optimizer, x)
            tracker.end_step()
    first, second, third = tracker.reports
    assert first.phase_growth["optimizer"]["optimizer_states"] == states
    assert second.phase_growth["optimizer"]["optimizer_states"] == 0
    assert first.peak_phase == second.peak_phase == "backward"  # activations of the wide layer dominate
    assert first.at_peak["optimizer_states"] == 0
    # the peak: ReLU's backward ("1") allocates grad_h while grad_r lives; by then the last Linear's weight and
    # bias gradients have been accumulated (post-accumulate-grad hooks classify them at once)
    assert first.peak_module == "1"
    assert first.at_peak["gradients"] == (1024 + 1) * 4
    assert second.at_peak["optimizer_states"] == third.at_peak["optimizer_states"] == states
    assert second.peak_bytes - first.peak_bytes == states

    explained = tracker.first_step_report()
    assert explained["created_lazily"]["optimizer_states"] == {"phase": "optimizer", "bytes": states}
    assert explained["component_deltas"]["optimizer_states"] == -states
    assert explained["delta_bytes"] == -states
    assert any("optimizer_states" in line and "lazy" in line for line in explained["explanation"])
    # the allocator's view, e.g. cheap.StepPeak on CUDA: step 1 paid 1 MiB of warm-up the tensors do not show
    device_peaks = [r.peak_bytes + 2**20 * (2 if i == 0 else 1) for i, r in enumerate(tracker.reports)]
    with_device = tracker.first_step_report(device_peaks)["explanation"]
    assert with_device[-1].endswith("differs by 1.00 MiB")
    assert len(explained["explanation"]) == len(with_device) - 1

    # the timeline shows the state as such from its creation inside step 1's optimizer phase
    step1 = [s for s in tracker.timeline.samples if s.step == 1]
    in_forward = [s for s in step1 if s.phase == "forward"]
    assert all(s.bytes[2] == 0 for s in in_forward)
    assert step1[-1].bytes[2] == states
    in_optimizer = [s for s in step1 if s.phase == "optimizer"]
    assert max(in_optimizer, key=lambda s: s.total).bytes[2] == states


def test_first_step_report_needs_two_steps() -> None:
    model, optimizer, x = _wide(8)
    tracker = MemoryTracker(model, optimizer)
    with tracker:
        tracker.begin_step(1)
        _train_step(tracker, model, optimizer, x)
        tracker.end_step()
    try:
        tracker.first_step_report()
    except ValueError as e:
        assert "at least 2" in str(e)
    else:
        raise AssertionError("expected ValueError")


class _MLP(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), _MLP(d, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Net(nn.Module):
    """Block 1's MLP is 32x wider than block 0's: memory peaks there, in forward and in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(32, 64), _Block(32, 2048)])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_peak_module_in_forward_and_backward() -> None:
    model, x = _Net(), torch.randn(64, 32)
    tracker = MemoryTracker(model)
    with tracker:
        tracker.begin_step(1)
        with tracker.phase("forward"):
            loss = model(x).sum()
        forward_only = tracker.end_step()
        tracker.begin_step(2)
        with tracker.phase("backward"):
            loss.backward()
        del loss
        backward_only = tracker.end_step()
    # relu(up(x)) runs in the MLP's own forward: up's output and relu's output (64x2048 each) live together
    assert forward_only.peak_module == "layers.1.mlp"
    assert forward_only.peak_phase == "forward"
    assert backward_only.peak_phase == "backward"
    assert backward_only.peak_module.startswith("layers.1.mlp")
