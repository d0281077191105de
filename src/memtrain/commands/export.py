"""`memtrain export RUN_DIR [--step N] [--adapters-only] --out DIR`: a checkpoint as a Hugging Face model
directory (a LoRA run's adapters merged into it), or a LoRA run's adapters alone in peft's format.

Why a command of its own: a run's checkpoints are for resuming, in whichever layout its sharding
wrote (replicated, DCP, DeepSpeed); this turns one of them, after the run and in one process, into a
directory `transformers.AutoModelForCausalLM.from_pretrained` loads. The conversion itself lives in
`memtrain.causal_lm.export` so that Python callers and `output.export: hf` use the same code.
"""

from __future__ import annotations

from pathlib import Path

from memtrain.errors import MemtrainError


def run(run_dir: str | Path, out: str | Path, step: int | None = None, *, adapters_only: bool = False) -> int:
    """Export and print where the model went; `MemtrainError`s name the flag to change."""
    if step is not None and step < 1:
        raise MemtrainError(f"--step: must be a positive checkpoint step (got {step})")
    from memtrain.causal_lm.export import export_hf
    from memtrain.run import RunDirectory

    chosen = RunDirectory(Path(run_dir)).checkpoint_at(step)
    written = export_hf(run_dir, out, chosen.step, adapters_only=adapters_only)
    what = "adapters, peft format" if adapters_only else "Hugging Face format"
    print(f"[memtrain] exported step {chosen.step} of {run_dir} to {written} ({what})", flush=True)
    return 0
