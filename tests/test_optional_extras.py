"""The train-only set-up (`scripts/train.sh`: the core package, no extra): the default recipe needs none of
the optional packages, and a recipe that needs one is refused before anything is built, by its recipe key,
with the line that installs it. Run in a child process where every optional package is missing
(`sys.modules[name] = None` makes its import fail, as in a venv without it), as after `train.sh`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env

OPTIONAL = (
    "deepspeed",
    "bitsandbytes",
    "torchao",
    "galore_torch",
    "peft",
    "tensorboard",
    "wandb",
    "mlflow",
    "liger_kernel",
)

# recipe overrides -> (the recipe key the refusal names, the extra whose install line it gives)
NEEDS_AN_EXTRA = {
    "strategies.sharding=zero3 strategies.sharding_backend=deepspeed": (
        "strategies.sharding_backend",
        "deepspeed",
    ),
    "strategies.optimizer_states=8bit": ("strategies.optimizer_states", "bnb"),
    "strategies.optimizer_states=paged-8bit": ("strategies.optimizer_states", "bnb"),
    "strategies.optimizer_states=4bit": ("strategies.optimizer_states", "fp8"),
    "strategies.precision=fp8": ("strategies.precision", "fp8"),
    "optimizer.name=galore": ("optimizer.name", "galore"),
    "adapters.kind=lora": ("adapters.kind", "lora"),
    "model.quantization=nf4 adapters.kind=lora": ("adapters.kind", "lora"),
    "output.loggers=[tensorboard]": ("output.loggers", "tensorboard"),
    "output.loggers=[wandb]": ("output.loggers", "wandb"),
    "output.loggers=[mlflow]": ("output.loggers", "mlflow"),
}

CHILD = """
import contextlib, io, json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # `import name` raises ImportError; importlib.util.find_spec(name) is None
from memtrain.cli import main
results = {}
for overrides in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["validate", "recipes/default.yaml", *overrides.split()])
    results[overrides] = [code, err.getvalue()]
print(json.dumps(results))
"""


@pytest.mark.slow
def test_without_the_extras_the_default_validates_and_each_extra_is_asked_for_by_name() -> None:
    cases = ["", *NEEDS_AN_EXTRA]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(OPTIONAL), json.dumps(cases)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.splitlines()[-1])
    extras = re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text(), re.M)
    code, err = results.pop("")
    assert code == 0, f"the default recipe needs an optional package: {err}"
    for overrides, (key, extra) in NEEDS_AN_EXTRA.items():
        code, err = results[overrides]
        assert extra in extras, f"pyproject.toml has no extra {extra!r} for {overrides}"
        lines = [line for line in err.splitlines() if line.strip().startswith("- ")]
        assert code == 2 and "Traceback" not in err, (overrides, err)
        assert any(f"- {key}:" in line and f"pip install 'memtrain[{extra}]'" in line for line in lines), (
            overrides,
            err,
        )
