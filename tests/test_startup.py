"""`memtrain plan --help`, `validate --help` and `validate` import only what they use: the strategy catalog
no longer pulls torch.distributed.optim (-> FSDP -> dynamo, seconds) for one isinstance check, nor
torch.distributed.tensor, .checkpoint or the ZeRO backends, which only a sharded plan needs.

Why: every command paid 10-30 s of imports before its first line on a loaded 2-core machine
(docs/BENCHMARKS.md, "Startup"). One child process runs the commands in turn and reports what each added
to `sys.modules` (a fresh interpreter: this process has imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO, subprocess_env

HEAVY = ("transformers", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")
HEAVY += ("torch.distributed.optim", "torchao", "deepspeed", "peft", "bitsandbytes", "datasets")
CHILD = f"""
import contextlib, io, json, sys
from memtrain.cli import main

def run(*args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(list(args))
    return sorted(name for name in {HEAVY!r} if name in sys.modules)

seen = {{"help": [run("plan", "--help"), run("validate", "--help")][-1]}}
trainer = "examples/own_model/trainer.py:TinyTrainer"
seen["own"] = run("validate", "examples/own_model/recipe.yaml", "--trainer", trainer)
seen["default"] = run("validate", "recipes/default.yaml")
print(json.dumps(seen))
"""


def test_help_and_validate_import_only_what_they_use() -> None:
    """The hole: `plan --help` imported torch.distributed.optim, .fsdp, .tensor and .checkpoint through the
    strategy catalog; validating any recipe imported them too."""
    env = {**subprocess_env(), "MEMTRAIN_CACHE_DIR": "off"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["help"] == [], "plan --help and validate --help"
    # validate of a trainer that uses none of them: building its model on the meta device runs torch's
    # decomposition of `nn.init.normal_`, which imports dynamo, which imports FSDP and DTensor (torch's own)
    assert set(seen["own"]) <= {"torch.distributed.fsdp", "torch.distributed.tensor"}, seen["own"]
    # the default recipe's model is a transformers config: transformers itself imports FSDP, DTensor, DCP
    # and torchao when its modeling code loads; what no default recipe uses stays out
    unused = {"torch.distributed.optim", "deepspeed", "peft", "bitsandbytes", "datasets"}
    assert "transformers" in seen["default"] and not unused & set(seen["default"]), seen["default"]
