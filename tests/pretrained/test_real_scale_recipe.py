"""What-ifs from shapes: every shipped recipe plans from its model's config.json alone (no weights, no
tokenizer files), as `memtrain plan` would before a 16 GB download; `validate` passes it and says what
`train` still needs; `train` refuses it before anything is allocated. The fine-tuning recipes name a hub
id, staged in a throw-away Hugging Face cache holding the real config.json alone (tests/hf_cache.py); the
others' inline `model.config` is written to a directory as its config.json. Only the offline path is
tested (HF_HUB_OFFLINE=1): online, a hub id the cache lacks has its config.json alone fetched.

The hole: `model.pretrained` demanded safetensors weights (or an index naming them) and a tokenizer for
`plan` and `validate`, which read neither."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtrain.cli import main
from memtrain.planner import model_probe

import hf_cache
from helpers import REPO, TINY_LLAMA, command_id, plan_commands, tiny_recipe_dict

RECIPES = sorted(str(p.relative_to(REPO / "recipes")) for p in (REPO / "recipes").rglob("*.yaml"))
TARGETS = {  # the what-if each recipe's comments plan it for (default: one H100)
    "gpt2-124m-24gb.yaml": ["--gpu", "rtx4090-24gb"],
    "llama-70b-64gpu.yaml": ["--gpu", "h100-80gb", "--world-size", "64"],
    "llama-405b.yaml": ["--gpu", "h100-80gb", "--nodes", "128"],
    "llama3-8b-8xh100.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama3-8b-chat-sft.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama3-8b-lora-8gpu.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama2-70b-lora-8xh100.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama3-8b-qlora-24gb.yaml": ["--gpu", "rtx4090-24gb"],
    "llama2-70b-qlora-fsdp-2gpu.yaml": ["--gpu", "h100-80gb", "--world-size", "2"],
    "tests/tiny-moe-ep.yaml": ["--gpu", "h100-80gb", "--world-size", "4"],
}
# Its `loss: auto` traces the chunked and fused losses chunk by chunk over 64k tokens (~25 s here), which
# has nothing to do with where the config comes from: this test plans it with the standard loss.
NARROWED = {"llama3-8b-8xh100.yaml": ["strategies.loss=standard"]}
Outcome = tuple[int, str, str]  # exit code, stdout, stderr
LLAMA_8B_LINEARS = [  # (out, in) of each block's linears: q, k, v, o, gate, up, down
    (4096, 4096),
    (1024, 4096),
    (1024, 4096),
    (4096, 4096),
    (14336, 4096),
    (14336, 4096),
    (4096, 14336),
]


LLAMA2_70B_LINEARS = [  # (out, in) of each block's linears: q, k, v, o, gate, up, down
    (8192, 8192),
    (1024, 8192),
    (1024, 8192),
    (8192, 8192),
    (28672, 8192),
    (28672, 8192),
    (8192, 28672),
]
PEFT_PUBLISHED = 35.6e9  # PEFT's guide, Llama-2-70B QLoRA + FSDP on 2 GPUs without CPU offload, per GPU


def _run(argv: list[str]) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def config_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, str], Outcome]]:
    """`memtrain <command> recipes/NAME` with the model's config.json alone (each plan run once)."""
    tmp = tmp_path_factory.mktemp("config-alone")
    done: dict[tuple[str, str], Outcome] = {}
    # One plan's traces serve another plan of the same job (the text and the --json of one recipe).
    with pytest.MonkeyPatch.context() as patch, model_probe.shared_traces():
        hf_cache.stage(tmp, patch, config_only=True)

        def run(command: str, name: str) -> Outcome:
            """`command` is plan (its --json), plan-text (as printed) or validate."""
            if (command, name) not in done:
                verb = command.removesuffix("-text")
                argv = [verb, str(REPO / "recipes" / name), *_config_overrides(name, tmp)]
                argv += NARROWED.get(name, [])
                extra = TARGETS.get(name, ["--gpu", "h100-80gb"]) if verb == "plan" else []
                done[command, name] = _run([*argv, *extra, *(["--json"] if command == "plan" else [])])
            return done[command, name]

        yield run


def _config_overrides(name: str, tmp: Path) -> list[str]:
    """A recipe with an inline `model.config`: that config as a directory's config.json alone."""
    raw = yaml.safe_load((REPO / "recipes" / name).read_text(encoding="utf-8"))
    config = raw["model"].get("config")
    if config is None:
        return []
    directory = tmp / name.removesuffix(".yaml").replace("/", "-")
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return ["model.config=null", f"model.pretrained={directory}"]


def _plan(config_alone: Callable[[str, str], Outcome], name: str) -> dict[str, Any]:
    rc, out, err = config_alone("plan", name)
    assert rc == 0, err[-3000:]
    doc: dict[str, Any] = json.loads(out)
    return doc


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_plans_from_its_config_alone(
    config_alone: Callable[[str, str], Outcome], name: str
) -> None:
    rc, out, err = config_alone("plan", name)
    assert "Traceback" not in err
    if rc == 2:  # a recipe that does not fit its target: the usual answer, not a missing file
        assert "no plan fits" in err and "model.pretrained" not in err, err[-3000:]
        return
    assert rc == 0, err[-3000:]
    doc = json.loads(out)
    if "meshes" in doc:  # a recipe that leaves mesh degrees open: the mesh search's document
        assert doc["chosen"]["fits"] and doc["chosen"]["predicted"]["peak"] <= doc["budget"]["usable"]
        return
    assert doc["predicted"]["peak"] <= doc["budget"]["usable"]


README_RECIPE_PLANS = [c for c in plan_commands([REPO / "README.md"]) if " --model " not in f" {c} "]
# The README's `plan --model` commands: tests/test_plan_model.py runs each (one of its tests checks they are its own).


@pytest.mark.parametrize("command", README_RECIPE_PLANS, ids=command_id)
def test_every_plan_command_of_the_readme_prints_a_plan(
    config_alone: Callable[[str, str], Outcome], command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a fresh machine without a network runs it, from the repository's root; after the recipes' own
    plans above, whose traces a command planning the same job reuses (`config_alone` shares them). The
    guides' other commands: tests/test_readme.py (another file, so another worker)."""
    monkeypatch.chdir(REPO)
    rc, out, err = _run(shlex.split(command)[1:])
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert out.startswith("{") or "chosen" in out, out[-3000:]


def test_validate_passes_and_says_what_train_needs(config_alone: Callable[[str, str], Outcome]) -> None:
    rc, out, err = config_alone("validate", "llama3-8b-chat-sft.yaml")
    assert rc == 0, err
    assert "config.json only, `train` needs its weights" in out and "data.tokenizer is not there" in out


def test_train_refuses_a_config_alone_before_allocating(tmp_path: Path) -> None:
    """One line naming model.pretrained and the missing weights; no run directory, no model built."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
    raw = tiny_recipe_dict(tmp_path, model={"config": None, "pretrained": str(tmp_path / "model")})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert _run(["validate", str(tmp_path / "r.yaml")])[0] == 0
    rc, _, err = _run(["train", str(tmp_path / "r.yaml")])
    assert rc == 2 and "Traceback" not in err
    assert "model.pretrained" in err and "has no safetensors weights" in err, err
    assert not (tmp_path / "run").exists()


def test_not_downloaded_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a hub id neither in the cache nor among memtrain's shape cards: one line saying how to
    download it (its config alone is enough to plan)."""
    hf_cache.use_cache(monkeypatch, tmp_path / "empty")
    recipe = str(REPO / "recipes/llama3-8b-chat-sft.yaml")
    other = "someone/not-a-card"
    models = [f"model.pretrained={other}", f"data.tokenizer={other}"]
    rc, _, err = _run(["validate", recipe, f"data.path={REPO / 'data/tiny_chat.jsonl'}", *models])
    assert rc == 2 and f"huggingface-cli download {other}" in err


def test_eight_h100_shard_the_weights(config_alone: Callable[[str, str], Outcome]) -> None:
    doc = _plan(config_alone, "llama3-8b-chat-sft.yaml")
    assert doc["plan"]["precision"]["name"] == "bf16-mixed"
    numel = 8_030_261_248  # Llama-3.1-8B's parameters
    assert doc["model_states"]["weights"] < 4 * numel, "the weights are sharded over the 8 ranks"


def test_qlora_on_one_24gb_gpu(config_alone: Callable[[str, str], Outcome]) -> None:
    """The 8B QLoRA what-if on a 24 GB GPU: weights are the 4-bit arithmetic (docs/STRATEGIES.md) with the
    frozen embeddings, head and norms in bf16, within 1% of QLoRA's published arithmetic (4.127 bits per
    base weight, ../shared/REFERENCE.md) plus the adapters, and a micro-batch and checkpointing that fit are
    chosen; the README's sample of this plan is what the command prints (the holes: nothing compared them,
    and the sample had drifted from the output; under bf16-mixed the frozen parameters were kept in fp32,
    7.42 GiB of weights instead of 5.47)."""
    from memtrain.strategies.quantization import QUANTIZATION

    doc = _plan(config_alone, "llama3-8b-qlora-24gb.yaml")
    hidden, layers, vocab = 4096, 32, 128256
    linears = [rows * cols for rows, cols in LLAMA_8B_LINEARS]
    lora = _lora_numel()
    four_bit = QUANTIZATION.create("nf4").weight_bytes(linears * layers)
    other = 2 * vocab * hidden + (2 * layers + 1) * hidden  # embeddings, head, norms: frozen, bf16
    weights = doc["model_states"]["weights"]
    assert weights == four_bit + 2 * other + 4 * layers * lora
    published = sum(linears) * layers * 4.127 / 8 + 2 * other + 4 * layers * lora  # QLoRA's, double quant
    assert abs(weights - published) / published < 0.01, (weights / 2**30, published / 2**30)
    assert doc["model_states"]["gradients"] == 4 * layers * lora, "only the adapters have gradients"
    assert doc["full_fine_tuning"]["weights"] > 4 * doc["model_states"]["weights"] / 2
    rc, out, err = config_alone("plan-text", "llama3-8b-qlora-24gb.yaml")  # the traces are shared: no retrace
    assert rc == 0, err[-3000:]
    printed = out.splitlines()
    sample = readme_sample("memtrain plan recipes/llama3-8b-qlora-24gb.yaml")
    assert sample[0].startswith("chosen: ") and len(sample) >= 5
    missing = [line for line in sample if line not in printed]
    # once, in a full run on three workers (not alone, not on two): the peak line differed; the printed
    # lines say how, next time
    assert missing == [], ("regenerate the README's sample", printed[: len(sample) + 2])


def _lora_numel() -> int:
    """A block's rank-16 LoRA parameters on every linear of Llama-3.1-8B."""
    return sum(16 * (rows + cols) for rows, cols in LLAMA_8B_LINEARS)


def readme_sample(command: str) -> list[str]:
    """The lines of the README's output block that follows the code block holding `command`."""
    found = re.search(
        re.escape(command) + r".*?\n```\n```\n(.*?)\n```", (REPO / "README.md").read_text(), re.S
    )
    assert found is not None, f"README.md has no output block after {command!r}"
    return found.group(1).splitlines()


def test_lora_on_eight_gpus(config_alone: Callable[[str, str], Outcome]) -> None:
    """Each DDP rank keeps the frozen base in bf16 (≈15 GiB, as HF + peft load it) and the adapters in fp32
    (the hole: a 30 GiB fp32 base per rank under bf16-mixed)."""
    doc = _plan(config_alone, "llama3-8b-lora-8gpu.yaml")
    full, kept = doc["full_fine_tuning"], doc["model_states"]
    assert sum(full.values()) > sum(kept.values()), "full fine-tuning would keep more than lora"
    numel = 8_030_261_248  # Llama-3.1-8B's parameters
    assert kept["weights"] == 2 * numel + 4 * 32 * _lora_numel()
    assert 14.9 < kept["weights"] / 2**30 < 15.2, "about 15 GiB of bf16 base per rank"


def test_llama2_70b_lora_zero3_on_eight_h100(config_alone: Callable[[str, str], Outcome]) -> None:
    """PEFT's DeepSpeed guide: Llama-2-70B LoRA on 8 H100s with ZeRO-3 ran at 64 GB per GPU. DeepSpeed ZeRO-3
    partitions the frozen base with the adapters, so each rank keeps an eighth of its bf16 weights (16.06 GiB)
    and the plan fits (the hole: the base counted whole on every rank, 128.7 GiB of weights, refused)."""
    doc = _plan(config_alone, "llama2-70b-lora-8xh100.yaml")
    numel = 68_976_648_192  # Llama-2-70b-hf's parameters
    assert abs(doc["model_states"]["weights"] / (2 * numel / 8) - 1) < 0.005, doc[
        "model_states"
    ]  # + adapters
    assert doc["predicted"]["peak"] <= doc["budget"]["usable"]
    assert doc["predicted"]["peak"] < 64e9, "under what the published run held (allocated < its nvidia-smi)"


def test_dpo_with_a_reference_copy_on_eight_h100(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recipes/llama3-8b-dpo-8xh100.yaml validates and plans from a staged config.json alone with chat preference
    pairs; with `preference.reference=copy` every rank keeps the whole initial model in bf16 beside its
    shard of the policy, and the plan's weights count it (before, DPO did not exist; a planner without the
    copy's `frozen_bytes` would predict the policy's shard alone, 4 bytes x numel / 8)."""
    hf_cache.stage(tmp_path, monkeypatch, config_only=True)
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
            "chosen": [{"role": "assistant", "content": f"{2 * i}."}],
            "rejected": [{"role": "assistant", "content": f"{2 * i + 1}."}],
        }
        for i in range(8)
    ]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = str(REPO / "recipes/llama3-8b-dpo-8xh100.yaml")
    data = [f"data.path={pairs}"]
    rc, out, err = _run(["validate", recipe, *data])
    assert rc == 0 and "llama3-8b-dpo-8xh100.yaml: ok" in out, err
    pinned = [
        "strategies.checkpointing=selective",
        "strategies.optimizer_states=8bit",
        "strategies.sharding=zero3",
    ]
    copy = [*data, *pinned, "preference.reference=copy"]
    rc, out, err = _run(["plan", recipe, *copy, "--gpu", "h100-80gb", "--world-size", "8", "--json"])
    assert rc == 0, err[-3000:]
    doc = json.loads(out)
    numel = 8_030_261_248  # Llama-3.1-8B's parameters
    policy_shard = doc["model_states"]["weights"] - 2 * numel
    assert 0 < policy_shard <= 1.01 * 4 * numel / 8
    assert doc["predicted"]["peak"] <= doc["budget"]["usable"]
    # Time: the copy runs a forward of the whole model per pair that precomputed log-probabilities do not
    # (2 FLOPs per parameter per token against the policy's 6: about a third more compute; the hole: the
    # step-time prediction ignored the reference forward).
    precomputed = [*data, *pinned, "preference.reference=precomputed"]
    rc, out, err = _run(["plan", recipe, *precomputed, "--gpu", "h100-80gb", "--world-size", "8", "--json"])
    assert rc == 0, err[-3000:]
    alone = json.loads(out)
    assert alone["model_states"]["weights"] < policy_shard + numel // 8
    chosen = doc["candidates"][0]
    shape = ("micro_batch_size", "accumulation_steps", "sharding", "checkpointing")
    same = [c for c in alone["candidates"] if all(c[k] == chosen[k] for k in shape)]
    assert 1.15 < chosen["predicted_step_seconds"] / same[0]["predicted_step_seconds"] < 1.5


def test_llama2_70b_fsdp_qlora_fits_two_80gb_gpus(config_alone: Callable[[str, str], Outcome]) -> None:
    """The what-if of PEFT's guide (recipes/llama2-70b-qlora-fsdp-2gpu.yaml) on 2 x 80 GB: each rank keeps
    half the packed 4-bit base with every weight's constants whole (docs/STRATEGIES.md's nf4 table: 1 per
    block of 64, the offset, 4 per 256 blocks, the 1024 + 64 B code tables), and its shard of the frozen
    embeddings, head and norms (fp32: the sharded layouts keep frozen weights at the stored dtype) and of
    the rank-8 adapters. The predicted reserved peak is under the 35.6 GB the guide measured and within 20%
    of it: what the plan does not hold of that run is the CUDA context, FSDP1's flat-parameter buffers and
    its allocator's cache (it measured 10% under when written: 31.9 GB)."""
    doc = _plan(config_alone, "llama2-70b-qlora-fsdp-2gpu.yaml")
    layers, hidden, vocab, ranks = 80, 8192, 32000, 2

    def constants(numel: int) -> int:
        blocks = math.ceil(numel / 64)
        return blocks + 4 + 4 * math.ceil(blocks / 256) + 1024 + 64

    linears = [rows * cols for rows, cols in LLAMA2_70B_LINEARS] * layers
    base = sum(n // 2 // ranks + constants(n) for n in linears)  # every packed size splits evenly here
    lora = layers * sum(8 * (rows + cols) for rows, cols in LLAMA2_70B_LINEARS)
    frozen = 2 * vocab * hidden + (2 * layers + 1) * hidden
    assert doc["model_states"]["weights"] == base + 4 * (frozen + lora) // ranks
    assert doc["model_states"]["gradients"] == 4 * lora // ranks, "only the adapters have gradients"
    reserved = doc["candidates"][0]["predicted_reserved"]
    assert 0.8 * PEFT_PUBLISHED < reserved < PEFT_PUBLISHED, reserved / 1e9
