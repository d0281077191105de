"""Memory measurement: what occupies device memory during a training step, and why.

Self-contained on purpose (torch, numpy, matplotlib and the standard library only) so the planner, the
trainer and scripts can all use it without import cycles.
"""

from ._torch_private import HostValues, fake_tensors, fake_tensors_with_real_inputs, join_fake_process_group
from .budget import Budget, out_of_memory_error
from .cheap import StepPeak, process_peak_rss_bytes
from .tracker import MemoryTracker, SimulatedBudget
from .values import COMPONENTS, PHASES, StepMemory, format_bytes

__all__ = [
    "COMPONENTS",
    "PHASES",
    "Budget",
    "HostValues",
    "MemoryTracker",
    "SimulatedBudget",
    "StepMemory",
    "StepPeak",
    "fake_tensors",
    "fake_tensors_with_real_inputs",
    "join_fake_process_group",
    "format_bytes",
    "out_of_memory_error",
    "process_peak_rss_bytes",
]
