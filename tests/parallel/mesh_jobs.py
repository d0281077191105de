"""Training jobs on a mesh, run in sequence inside one process group (one torchrun launch for many jobs).

`torchrun --nproc_per_node=N tests/parallel/mesh_jobs.py SPEC.json OUT.json`: each job of SPEC trains the
tiny recipe of tests/helpers.py with its own sections (a `strategies.mesh`, a resume) and rank 0 writes, per
job, the losses, the whole fp32 weights (gathered from every shard), each rank's bytes of parameters
and optimizer states as its shards hold them, the sample ids each rank read per step (a
`RecordingTrainer` job), and the plan each rank ended with and the re-plans it made. A job's `resume` (a run directory or checkpoint) continues another job's run. `trainer` names a class in tests/parallel/mesh_trainers.py (or
the job's `trainer_module` there, e.g. moe_trainers.py) instead of the built-in causal-LM one; `ring_standin` runs context parallelism on CPU (ring_standin.py).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memtrain.causal_lm.recipe import CausalLMRecipe  # noqa: E402
from memtrain.causal_lm.trainer import CausalLMTrainer  # noqa: E402
from memtrain.strategies import expert_parallel  # noqa: E402
from memtrain.training.trainer import Trainer  # noqa: E402

from helpers import REPO, subprocess_env, tiny_recipe_dict  # noqa: E402


def whole_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every weight whole and fp32 (DTensor shards gathered, and each pipeline stage's: collectives)."""
    module = trainer.sharding.unwrap(trainer.model)  # type: ignore[union-attr,arg-type]
    out = {}
    for name, p in module.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = value.detach().float().cpu().clone()
    if trainer.env.shape.pp > 1:  # each stage holds its own parameters, under their whole-model names
        stages: list[Any] = [None] * trainer.env.world_size
        dist.all_gather_object(stages, out)
        out = {name: value for stage in stages for name, value in stage.items()}
    return out


def local_bytes(trainer: Trainer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer states as the shards hold them."""
    module = trainer.sharding.unwrap(trainer.model)  # type: ignore[union-attr,arg-type]

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = {n: local(p) for n, p in module.named_parameters()}
    states = trainer.optimizer.state.values()  # type: ignore[union-attr]
    moments = [local(v) for s in states for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "optimizer_storage": _storage_bytes(moments),
        "param_storage": _storage_bytes(list(params.values())),
        **{f"param:{n}": t.numel() * t.element_size() for n, t in params.items()},
        "optimizer": sum(
            local(v).numel() * local(v).element_size()
            for s in states
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a padded shard would show here)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    if job.get("ring_standin"):  # a cp job on CPU: torch's ring runs on CUDA only (ring_standin.py)
        import ring_standin

        ring_standin.install()
    raw = tiny_recipe_dict(Path(job["run_dir"]), **job.get("sections", {}))
    if job.get("trainer"):
        trainers = importlib.import_module(job.get("trainer_module", "mesh_trainers"))
        trainer_class: type[Trainer] = getattr(trainers, job["trainer"])
        own = issubclass(trainer_class, CausalLMTrainer)  # a causal-LM subclass keeps the model and data
        recipe = trainer_class.recipe_class.from_dict(
            raw if own else {k: v for k, v in raw.items() if k not in ("model", "data")}
        )
    else:
        trainer_class, recipe = CausalLMTrainer, CausalLMRecipe.from_dict(raw)
    trainer = trainer_class(recipe)
    result = trainer.fit(resume=job.get("resume"))
    weights = whole_weights(trainer)
    reports = trainer.monitor.memory_reports
    mine = {
        "bytes": local_bytes(trainer),
        "coordinates": trainer.env.shape.coordinates(trainer.env.rank),
        "mesh": trainer.env.shape.to_dict(),
        "tracked": dict(reports[-1].at_peak) if reports else None,  # under memory.track
        "sample_ids": getattr(trainer, "seen_ids", None),  # RecordingTrainer's, per step
        "plan": trainer.plan.summary(),  # the plan this rank ended with
        "replans": [{"step": r["step"], "to": r["to"]} for r in trainer.monitor.replans],
        "routing_calls": expert_parallel.LAST_STEP[0].calls if expert_parallel.LAST_STEP else None,
        "ring": sorted(sys.modules["ring_standin"].SEEN) if job.get("ring_standin") else None,
    }
    everyone: list[Any] = [None] * trainer.env.world_size
    dist.all_gather_object(everyone, mine)
    if trainer.env.is_main and job.get("weights_out"):
        torch.save(weights, job["weights_out"])
    trainer.model, trainer.optimizer = None, None
    metrics = trainer.run.layout.metrics_file
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if trainer.env.is_main else []
    return {"losses": result.losses, "ranks": everyone, "rows": rows}


def launch(tmp: Path, ranks: int, jobs: list[dict[str, Any]], name: str = "") -> list[dict[str, Any]]:
    """Run `jobs` in one torchrun launch of `ranks` processes; each job's result, in order."""
    spec, out = tmp / f"spec{name}{ranks}.json", tmp / f"out{name}{ranks}.json"
    spec.write_text(json.dumps(jobs))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(REPO / "tests/parallel/mesh_jobs.py"), str(spec), str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return list(json.loads(out.read_text()))


def main() -> None:
    spec, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results = [run_job(job) for job in json.loads(spec.read_text())]
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
