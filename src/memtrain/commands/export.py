"""`memtrain export RUN_DIR [--step N] --out DIR`: a checkpoint as a Hugging Face model directory.

Why a command of its own: a run's checkpoints are for resuming, in whichever layout its sharding
wrote (replicated, DCP, DeepSpeed); this turns one of them, after the run and in one process, into a
directory `transformers.AutoModelForCausalLM.from_pretrained` loads. The conversion itself lives in
`memtrain.causal_lm.export` so that Python callers and `output.export: hf` use the same code.
"""

from __future__ import annotations

from pathlib import Path

from memtrain.errors import MemtrainError


def run(run_dir: str | Path, out: str | Path, step: int | None = None) -> int:
    """Export and print where the model went; `MemtrainError`s name the flag to change."""
    if step is not None and step < 1:
        raise MemtrainError(f"--step: must be a positive checkpoint step (got {step})")
    from memtrain.causal_lm.export import export_hf, pick_checkpoint

    chosen = pick_checkpoint(Path(run_dir), step)
    written = export_hf(run_dir, out, chosen.step)
    print(
        f"[memtrain] exported step {chosen.step} of {run_dir} to {written} (Hugging Face format)", flush=True
    )
    return 0
