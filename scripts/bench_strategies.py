"""Each memory strategy against the baseline, side by side in one run: peak bytes per component (memory
tracker) and step time, for a GPT-2-like and a Llama-like model built from configs, on the CPU.

    .venv/bin/python scripts/bench_strategies.py [--steps 4] [--json results/strategies.json]

Every row trains the same model on the same batches for `--steps` steps with one strategy changed from
the baseline (fp32, no checkpointing, fp32 AdamW). Step time is the median of the steps after the first,
measured in a separate untracked run because the tracker slows steps down. Ratios are relative to the
baseline row of the same model. The output is a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.memory import COMPONENTS

MODELS: dict[str, dict[str, Any]] = {
    "gpt2-like (12 x 256, 13M)": {
        "model_type": "gpt2",
        "n_embd": 256,
        "n_layer": 12,
        "n_head": 8,
        "n_positions": 512,
        "vocab_size": 8192,
        "attn_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    },
    "llama-like (12 x 256, 12M)": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "max_position_embeddings": 512,
    },
}

STRATEGIES: dict[str, dict[str, Any]] = {
    "baseline (fp32)": {},
    "checkpointing: full": {"checkpointing": "full"},
    "checkpointing: fraction 0.5": {"checkpointing": "fraction", "checkpointing_fraction": 0.5},
    "checkpointing: selective": {"checkpointing": "selective"},
    "precision: bf16-mixed": {"precision": "bf16-mixed"},
    "precision: bf16-master": {"precision": "bf16-master"},
    "optimizer states: bf16": {"optimizer_states": "bf16"},
    "optimizer states: 8bit": {"optimizer_states": "8bit"},
}


def recipe(model: dict[str, Any], strategies: dict[str, Any], steps: int, out: Path, track: bool) -> Any:
    return CausalLMRecipe.from_dict(
        {
            "run": {"name": "bench", "output_dir": str(out), "seed": 0},
            "model": {"config": model},
            "data": {"source": "synthetic", "seq_len": 256, "synthetic": {"num_samples": 256}},
            "batch": {"global_size": 4, "micro_size": 4},
            "train": {"steps": steps, "lr": 1e-3, "eval_every": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "memory": {"track": track},
            "strategies": {"precision": "fp32", "sharding": "none", **strategies},
        }
    )


def measure(model: dict[str, Any], strategies: dict[str, Any], steps: int, tmp: Path) -> dict[str, Any]:
    tracked = CausalLMTrainer(recipe(model, strategies, 2, tmp / "tracked", track=True))
    tracked.fit()
    report = tracked.monitor.memory_reports[-1]
    timed = CausalLMTrainer(recipe(model, strategies, steps, tmp / "timed", track=False))
    timed.setup()
    times = [timed.train_step(step)["step_time_s"] for step in range(steps)]
    return {
        "peak_bytes": report.peak_bytes,
        "at_peak": dict(report.at_peak),
        "component_peaks": dict(report.component_peaks),
        "step_time_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    lines = [
        "| model | strategy | peak MiB | weights | gradients | optimizer states | activations (max) | other | "
        "peak vs base | activations vs base | step time vs base |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, model in MODELS.items():
            results[model_name] = {}
            for index, (name, strategies) in enumerate(STRATEGIES.items()):
                row = measure(model, strategies, args.steps, Path(tmp) / f"{model_name[:5]}{index}")
                results[model_name][name] = row
                base = results[model_name]["baseline (fp32)"]
                peaks = row["component_peaks"]
                lines.append(
                    f"| {model_name} | {name} | {mib(row['peak_bytes'])} | "
                    + " | ".join(mib(peaks[c]) for c in COMPONENTS)
                    + f" | {row['peak_bytes'] / base['peak_bytes']:.2f} | "
                    f"{peaks['activations'] / base['component_peaks']['activations']:.2f} | "
                    f"{row['step_time_s'] / base['step_time_s']:.2f} |"
                )
                print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
