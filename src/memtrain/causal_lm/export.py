"""A memtrain checkpoint as a Hugging Face model directory (`memtrain export`, `output.export: hf`).

Why: a run's checkpoints are written for resuming (model, optimizer, RNG, in one of three layouts), not
for serving or sharing. The export turns one of them into what `transformers` loads anywhere:
config.json, model.safetensors (sharded with an index when large), generation_config.json, and the
tokenizer files when the run used a tokenizer directory.

How: the model's state is read from whichever layout the checkpoint holds, without a process group
(an export runs in one process, possibly long after the run):

- `replicated` (none / ddp / zero1 on FSDP2): `model.pt`, a plain state dict loaded with
  `weights_only=True`;
- `dcp` (zero2 / zero3 on FSDP2): torch.distributed.checkpoint's files, read with DCP's own
  single-process loader for the `model` keys only (the optimizer states are never loaded);
- `deepspeed`: DeepSpeed's `zero_to_fp32`, which merges the fp32 master partitions of every rank
  (ZeRO-1/2/3).

Nothing in a checkpoint runs code: DCP's metadata and byte items and DeepSpeed's files (which both
libraries would unpickle whole) are read through `strategies.sharding.safe_readers`' allow-lists, and only
the format the checkpoint's manifest (meta.json) names is opened: a `deepspeed/` folder planted next to
a replicated or dcp checkpoint refuses the export unread. A checkpoint without a manifest (written before
it) is detected from its files, and read with the same safe readers.

The state is loaded into the model `AutoModelForCausalLM.from_config` builds from the run's recipe (or
the config.json of `model.pretrained`), so tied weights are tied as transformers ties them and
`save_pretrained` writes each tensor once. The directory is written into a staging directory the export
creates itself next to `OUT` (a new name: nothing already there is touched) and renamed into place only
when complete. `OUT` may not be a symlink nor lie inside a run's checkpoints/ or abandoned/ folder.

A run with adapters (`adapters: {kind: lora}`) checkpoints the adapted model: peft's layers injected in
place, so its state names the base linear `...q_proj.base_layer.weight` and the adapters
`...q_proj.lora_A.default.weight`. The export injects the same adapters (`adapters_of(recipe).apply`)
before loading, then writes one of two things:

- merged (the default, and `output.export: hf`): each adapted layer merged by peft
  (W + alpha/r B A, checked for NaNs) and replaced by its base layer, so the directory is a plain
  Hugging Face model that needs no peft to load;
- `adapters_only` (`memtrain export --adapters-only`): the adapters alone in peft's format
  (adapter_config.json + adapter_model.safetensors, keys `base_model.model.<name>.lora_A.weight`), with
  `base_model_name_or_path` = `model.pretrained` when the run had one; `peft.PeftModel.from_pretrained`
  loads it over the base model. The model is built on the meta device for this: only the adapters'
  names and shapes are needed, and their tensors come from the checkpoint as stored.
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import shutil
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrain import checkpoint as ckpt
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.tokenizer import DIRECTORY_FILES, directory_files
from memtrain.errors import MemtrainError
from memtrain.plan import adapters_of
from memtrain.recipe import Recipe
from memtrain.run import RunDirectory
from memtrain.run.confine import managed_folder_of
from memtrain.strategies.adapters import Adapters
from memtrain.strategies.registry import DeviceFacts
from memtrain.strategies.sharding import safe_readers
from memtrain.strategies.sharding.sharded_checkpoint import (
    DCP_DIR,
    DEEPSPEED_DIR,
    MANIFEST_KEY,
    detect_format,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEEPSPEED_TAG = "state"  # the tag memtrain's DeepSpeed backend saves under (deepspeed_backend.TAG)


def export_hf(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    *,
    overwrite: bool = False,
    adapters_only: bool = False,
) -> Path:
    """Write checkpoint `step` of `run_dir` (default: the newest) as a Hugging Face model directory `out`.

    A run with adapters is written merged into its base model, or, with `adapters_only`, as the adapters
    alone in peft's format. `out` must not exist or be empty, unless `overwrite` (the run's own
    `run_dir/hf`, rewritten when a resumed run exports again). Returns `out`.
    """
    run_dir, out = Path(run_dir), Path(out)
    run = RunDirectory(run_dir)
    recipe = run_recipe(run)
    adapters = adapters_of(recipe)
    if adapters_only and not has_adapters(adapters):
        raise MemtrainError(
            f"--adapters-only: the run in {run_dir} trained no adapters (its recipe's adapters.kind is "
            f"{recipe.adapters.kind}); export the whole model without --adapters-only"
        )
    adapters.check(DeviceFacts.of(torch.device("cpu")))  # peft is installed
    config = model_config(recipe)
    found = run.checkpoint_at(step)
    _check_out(out, overwrite)
    state = dequantised(load_model_state(found.path, found.meta.get(MANIFEST_KEY)))
    if adapters_only:
        write: Any = _adapter_writer(config, state, found.path, adapters, recipe.model.pretrained)
    else:
        model = _model_with_state(config, state, found.path, adapters)
        del state
        if has_adapters(adapters):
            _merge_adapters(model, found.path)
        write = model.save_pretrained
    staging = _new_staging(out)
    try:
        write(staging)
        if not adapters_only:
            _copy_generation_config(recipe, staging)
        _copy_tokenizer(run, recipe, staging)
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def has_adapters(adapters: Adapters) -> bool:
    """Whether the run trained adapters (any kind but `none`)."""
    return adapters.name != Adapters.name


# ------------------------------------------------------------------------------------- the run


MODEL_SOURCES = ("config", "config_path", "pretrained")
NOT_A_TRANSFORMERS_RUN = (
    "export needs a transformers model: this run's recipe has no model section (model.config, "
    "model.config_path or model.pretrained), so it was trained by a custom --trainer; save your "
    "model from your Trainer subclass instead"
)


def run_recipe(run: RunDirectory) -> CausalLMRecipe:
    """The run's resolved recipe (written by rank 0 when the run started), validated as the built-in
    trainer's; a clear error for a custom trainer's run, whose recipe has sections of its own."""
    raw = run.read_recipe()
    model = raw.get("model")
    if not isinstance(model, dict) or all(model.get(key) is None for key in MODEL_SOURCES):
        raise MemtrainError(NOT_A_TRANSFORMERS_RUN)
    return CausalLMRecipe.from_dict(raw, source=str(run.layout.recipe_file))


def model_config(recipe: Recipe) -> Any:
    """The transformers config the run's model was built from; a clear error for a custom trainer's run."""
    model = recipe.model
    if not isinstance(recipe, CausalLMRecipe) or all(getattr(model, key) is None for key in MODEL_SOURCES):
        raise MemtrainError(NOT_A_TRANSFORMERS_RUN)
    pretrained = model.pretrained
    if pretrained is not None:
        from transformers import AutoConfig

        from memtrain.causal_lm import pretrained as pretrained_lib

        directory = pretrained_lib.resolve(pretrained)  # a run's recipe.json is input too: no remote code
        pretrained_lib.refuse_remote_code(directory, "model.pretrained")
        try:
            return AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise MemtrainError(f"model.pretrained: cannot read the config of {pretrained} ({exc})") from None
    from memtrain.causal_lm.trainer import build_config

    return build_config(recipe)


def _check_out(out: Path, overwrite: bool) -> None:
    """`out` is a new or empty directory (or, with `overwrite`, the run's own export folder), not a symlink,
    and not inside a run's checkpoints or abandoned folder (it would read as a checkpoint there)."""
    if out.is_symlink():
        target = os.readlink(out)
        raise MemtrainError(f"--out: {out} is a symbolic link (to {target}); give the directory itself")
    if out.exists() and not out.is_dir():
        raise MemtrainError(f"--out: {out} exists and is not a directory")
    managed = managed_folder_of(out)
    if managed is not None:
        raise MemtrainError(
            f"--out: {out} is inside {managed}, which memtrain manages (a directory there would be taken "
            "for a checkpoint or set aside); choose a directory outside it"
        )
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise MemtrainError(f"--out: {out} exists and is not empty; choose a new directory or empty it")


def _new_staging(out: Path) -> Path:
    """A new directory next to `out` that this export creates itself (a random name, made exclusively, so
    nothing already there is ever deleted), into which the model is written before the rename."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            staging = out.with_name(f".{out.name}.{secrets.token_hex(6)}.tmp")
            with contextlib.suppress(FileExistsError):
                staging.mkdir()  # exclusive; the umask's permissions, as the export will have
                return staging
    except OSError as exc:
        raise MemtrainError(
            f"--out: cannot create a directory next to {out} ({exc.strerror or exc})"
        ) from None


# ------------------------------------------------------------------------------------- the state


def load_model_state(path: Path, declared: object = None) -> dict[str, torch.Tensor]:
    """The model's full state dict from checkpoint directory `path`, in the format its manifest `declared`
    (meta.json's), or for a checkpoint without one, any format memtrain writes."""
    found = detect_format(path, declared)
    if found == "replicated":
        state = ckpt.load_tensor_file(path / "model.pt")
    elif found == "dcp":
        state = _dcp_model_state(path / DCP_DIR)
    else:
        state = _deepspeed_model_state(path / DEEPSPEED_DIR)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ckpt.CheckpointError(f"{path}: its model state is not a mapping of names to tensors")
    return state


def _dcp_model_state(source: Path) -> dict[str, torch.Tensor]:
    """The `model` entries of a DCP checkpoint, whole, read in this process without a process group.

    DCP's single-process loader rebuilds each tensor from the saved metadata (global shapes), so the
    shards of every rank come together here; `no_dist` keeps it off any process group this process may
    still hold (an export at the end of a distributed run, on rank 0 only).
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    try:
        _load_state_dict(
            loaded,
            storage_reader=safe_readers.SafeFileSystemReader.checked(source),
            planner=safe_readers.SafeEmptyStateDictLoadPlanner(source, keys={"model"}),
            no_dist=True,
        )
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failure = safe_readers.dcp_failure(exc)
        if isinstance(failure, ckpt.CheckpointError):
            raise failure from None
        raise ckpt.CheckpointError(f"{source}: cannot be read ({ckpt.describe(failure)})") from None
    model = loaded.get("model")
    if not isinstance(model, dict) or not model:
        raise ckpt.CheckpointError(f"{source}: holds no model state")
    return dict(model)


def _deepspeed_model_state(source: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master weights, merged from every rank's partitions by its own `zero_to_fp32`, its
    files read by `safe_readers.load_deepspeed_file` (`zero_to_fp32_reads_safely`)."""
    try:
        import deepspeed.utils.zero_to_fp32  # noqa: F401
    except ImportError:
        raise MemtrainError(
            f"{source}: written by DeepSpeed; exporting it needs deepspeed: pip install 'memtrain[deepspeed]'"
        ) from None
    tag = DEEPSPEED_TAG if (source / DEEPSPEED_TAG).is_dir() else None
    safe_readers.only_regular_files(source, "DeepSpeed")
    try:
        with safe_readers.zero_to_fp32_reads_safely() as zero_to_fp32:
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(source), tag=tag)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, AssertionError) as exc:
        raise ckpt.CheckpointError(
            f"{source}: DeepSpeed cannot merge it ({type(exc).__name__}: {exc})"
        ) from None
    return dict(state)


# ------------------------------------------------------------------------------------- the model


def _model_with_state(
    config: Any, state: dict[str, torch.Tensor], path: Path, adapters: Adapters
) -> PreTrainedModel:
    """The transformers model of `config`, with the run's adapters injected, holding `state`, in the dtype
    the checkpoint stored (each adapter tensor in its own stored dtype)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    dtype = _stored_dtype(state)
    if dtype is not None and dtype != next(model.parameters()).dtype:
        model.to(dtype)
    adapters.apply(model)
    for name, parameter in model.named_parameters():
        stored = state.get(name)
        if adapters.owns(name) and stored is not None and stored.is_floating_point():
            parameter.data = parameter.data.to(stored.dtype)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape mismatch
        raise ckpt.CheckpointError(
            f"{path}: does not fit the run's {config.model_type} model ({exc}); export needs a run of the "
            "built-in causal-LM trainer"
        ) from None
    missing = _untied_missing(model, set(result.missing_keys))
    _check_fit(path, config, missing, list(result.unexpected_keys))
    model.eval()
    return model


QUANT_STATE_4BIT = (
    ".weight.quant_state.bitsandbytes__"  # the key a bitsandbytes 4-bit weight's state ends with
)


def dequantised(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every bitsandbytes-quantised base weight (a QLoRA run's) as a plain fp32 weight, so the
    adapters merge into a full-precision base and the export is an ordinary transformers model. 4-bit weights
    come back through bitsandbytes' own `dequantize_4bit` and their serialised `QuantState`; int8 ones as
    int8 x row scale / 127 (LLM.int8's `SCB`). A state without quantised weights is returned as it is."""
    layers4 = {k.split(QUANT_STATE_4BIT)[0] for k in state if QUANT_STATE_4BIT in k}
    layers8 = {
        k[: -len(".SCB")]
        for k in state
        if k.endswith(".SCB") and state[k[: -len("SCB")] + "weight"].dtype == torch.int8
    }
    if not layers4 and not layers8:
        return state
    import bitsandbytes.functional as bnbf

    out = dict(state)
    for layer in layers4:
        prefix = layer + ".weight."
        parts = {k[len(prefix) :]: out.pop(k) for k in list(out) if k.startswith(prefix)}
        quant_state = bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))
        out[layer + ".weight"] = bnbf.dequantize_4bit(out[layer + ".weight"], quant_state).float()
    for layer in layers8:
        scale = out.pop(layer + ".SCB").float()
        out.pop(layer + ".weight_format", None)
        out[layer + ".weight"] = out[layer + ".weight"].float() * scale[:, None] / 127.0
    return out


def _check_fit(path: Path, config: Any, missing: list[str], unexpected: list[str]) -> None:
    problems = []
    if missing:
        problems.append(f"missing {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected {_some(unexpected)}")
    if problems:
        raise ckpt.CheckpointError(
            f"{path}: does not fit the run's {config.model_type} model ({'; '.join(problems)}); export needs a "
            "run of the built-in causal-LM trainer"
        )


def _merge_adapters(model: nn.Module, path: Path) -> None:
    """Merge every adapted layer into its base layer (peft's own merge) and put the base layer back in
    its place, leaving the plain transformers model (what peft's `merge_and_unload` does)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    get_input = getattr(model, "get_input_embeddings", None)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and callable(get_input) and any(module is get_input() for _, module in layers):
        raise MemtrainError(
            "export: the run adapted the input embeddings of a model with tied word embeddings; merged, they "
            "would change the output head too. Export with --adapters-only"
        )
    for name, layer in layers:
        try:
            layer.merge(safe_merge=True)
        except ValueError as exc:  # peft: "NaNs detected in the merged weights"
            raise ckpt.CheckpointError(f"{path}: the adapters of {name} cannot be merged ({exc})") from None
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    left = [name for name in model.state_dict() if ".lora_" in name or ".base_layer." in name]
    if left:
        raise ckpt.CheckpointError(f"{path}: adapters left after merging: {_some(left)}")


def _adapter_writer(
    config: Any, state: dict[str, torch.Tensor], path: Path, adapters: Adapters, pretrained: str | None
) -> Any:
    """What writes the run's adapters in peft's format (`PeftModel.save_pretrained`'s files): the
    checkpoint's adapter tensors as stored, checked against the adapted model's names and shapes."""
    from peft import get_peft_model_state_dict
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # names and shapes only: no base weights are allocated
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    adapters.apply(model)
    owned = {name: p for name, p in model.named_parameters() if adapters.owns(name)}
    missing = [name for name in owned if name not in state]
    unexpected = [name for name in state if adapters.owns(name) and name not in owned]
    _check_fit(path, config, missing, unexpected)
    wrong = [name for name, p in owned.items() if tuple(state[name].shape) != tuple(p.shape)]
    if wrong:
        raise ckpt.CheckpointError(
            f"{path}: its adapters do not fit the run's adapters section (shapes of {_some(wrong)})"
        )
    peft_config = copy.deepcopy(model.peft_config["default"])
    peft_config.base_model_name_or_path = pretrained
    peft_config.inference_mode = True
    mine = {name: state[name] for name in owned}
    tensors = get_peft_model_state_dict(model, state_dict=mine, save_embedding_layers=False)
    prefixed = {f"base_model.model.{name}": t.detach().contiguous().clone() for name, t in tensors.items()}
    if not prefixed:
        raise ckpt.CheckpointError(f"{path}: holds no adapter tensors")

    def write(directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        peft_config.save_pretrained(str(directory))  # adapter_config.json
        save_file(prefixed, str(directory / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})

    return write


def _stored_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating dtype most of the checkpoint's elements have (bf16 when the run stored bf16 weights)."""
    counts: Counter[torch.dtype] = Counter()
    for value in state.values():
        if value.is_floating_point():
            counts[value.dtype] += value.numel()
    return counts.most_common(1)[0][0] if counts else None


def _untied_missing(model: nn.Module, missing: set[str]) -> list[str]:
    """Missing keys that are not a tied alias of a loaded tensor (a tied lm_head saved once is whole)."""
    names_by_tensor: dict[int, set[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names_by_tensor.setdefault(id(tensor), set()).add(name)
    untied = []
    for key in sorted(missing):
        aliases = next((names for names in names_by_tensor.values() if key in names), {key})
        if aliases <= missing:
            untied.append(key)
    return untied


def _some(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# ------------------------------------------------------------------------------------- the files


def _copy_generation_config(recipe: CausalLMRecipe, staging: Path) -> None:
    """A pretrained model's own generation_config.json (its sampling defaults) over the config's default."""
    pretrained = recipe.model.pretrained
    if pretrained is None:
        return
    from transformers import GenerationConfig

    try:
        own = GenerationConfig.from_pretrained(pretrained, local_files_only=True)
    except (OSError, ValueError):  # it has none: keep the one save_pretrained derived from the config
        return
    own.save_pretrained(staging)


def _copy_tokenizer(run: RunDirectory, recipe: CausalLMRecipe, staging: Path) -> None:
    """The tokenizer files the run kept in its own folder when it started (`RunDirectory.keep_tokenizer`),
    regular files inside the run only: never the `data.tokenizer` path its recipe.json names, which may
    point anywhere (an export copied files from outside the run into what a user then shares)."""
    try:
        kept = run.kept_tokenizer_files(DIRECTORY_FILES)
    except OSError as exc:
        raise MemtrainError(f"{run.layout.tokenizer_dir}: cannot be read ({exc})") from None
    if kept is None:
        if directory_files(recipe.data.tokenizer):
            warnings.warn(
                f"{run.path} holds no copy of its tokenizer (trained before memtrain kept one); the export has "
                f"none: copy the files of data.tokenizer ({recipe.data.tokenizer}) into it yourself",
                stacklevel=3,
            )
        return
    for name, data in kept.items():
        (staging / name).write_bytes(data)


def _replace(staging: Path, out: Path) -> None:
    """Rename the finished directory into place; an existing `out` (empty, or overwritten) goes first,
    renamed aside into a directory this export creates itself, and is deleted only after the rename."""
    if out.is_dir() and any(out.iterdir()):
        doomed = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, doomed)  # over the empty directory just made
        os.replace(staging, out)
        shutil.rmtree(doomed, ignore_errors=True)
        return
    os.replace(staging, out)  # replaces an empty directory
