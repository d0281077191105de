"""A run directory: its layout, lock, checkpoint lifecycle, lineage and files (`RunDirectory`)."""

from memtrain.run.directory import Resume, RunDirectory
from memtrain.run.layout import CheckpointFiles, RunLayout

__all__ = ["CheckpointFiles", "Resume", "RunDirectory", "RunLayout"]
