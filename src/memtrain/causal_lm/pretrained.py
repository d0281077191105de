"""Pretrained weights: a Hugging Face model directory (or a hub id in the local cache) into the plan's model.

Why not `from_pretrained`: it materialises the whole model on every rank, in the checkpoint's dtype,
before memtrain's strategies exist. Here the model is built with its parameters on the meta device
(buffers real, e.g. rotary tables), the plan's strategies are applied to it, and only then are the
weights read from the safetensors files (single file or sharded index) straight into what each rank
keeps: a replicated plan reads every tensor, a sharded one (FSDP2, HSDP, tensor parallel, or a mesh of
them) reads only this rank's block of each parameter (`safe_open(...).get_slice`, at the shape and offset
torch gives the DTensor's local tensor), so no rank ever holds more than its plan keeps. Each tensor is converted to
the parameter's dtype, which is the plan's (bf16 for bf16-master, and for frozen parameters under
bf16-mixed: `Precision.frozen_stored_dtype`; fp32 otherwise); a floating parameter
stored as integers is refused, since the conversion would silently turn it into other values. Only safetensors are
read: a `.bin` checkpoint is a pickle, and memtrain loads no pickles from paths a recipe names.

No code from a model or tokenizer directory is ever imported: a config.json or tokenizer_config.json with
`auto_map` (classes transformers would import from the directory's own .py files, after asking "Do you wish
to run the custom code?" on stdin) is refused by name (`refuse_remote_code`), and every transformers loader
memtrain calls gets `trust_remote_code=False`.

Planning needs shapes, not weights: a directory (or a cached hub id) with its config.json alone is a
`model.pretrained` for `memtrain plan` and `validate` (a what-if before a 16 GB download), and so is a hub
id memtrain has a shape card for (`causal_lm.cards`); `train` refuses either before anything is allocated
(`check_directory`, and `resolve` without cards).
"""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrain.causal_lm import cards, checkpoint_keys
from memtrain.errors import RecipeError
from memtrain.jsonfile import read_json_object

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HUB_TIMEOUT_S = 3.0  # one probe of the hub before a config.json is fetched: offline is answered at once


def resolve(value: str, key: str = "model.pretrained", *, fetch_config: bool = False) -> Path:
    """The directory `value` names: a local directory, or a hub id in the local Hugging Face cache (its
    config.json alone is enough for shapes). With `fetch_config` (reading the model's shapes: `plan`,
    `validate`), a hub id the cache lacks has its config.json alone fetched when the hub answers at once
    (one probe, `HUB_TIMEOUT_S`; none with HF_HUB_OFFLINE), else its shape card (`causal_lm.cards`), said
    in one line; nothing else is ever downloaded. `RecipeError` naming `key` otherwise."""
    path = Path(value)
    if path.is_dir():
        return path
    if path.exists() or value.startswith((".", "/")) or value.count("/") != 1:
        raise RecipeError([f"{key}: {value} is not a directory (nor a hub id like org/name)"])
    cached = _cached(value)
    if cached is not None:
        return cached
    card = cards.card_directory(value)
    if fetch_config:
        found = _fetch_config(value) or card
        if found is card and card is not None:
            cards.announce(value)
        if found is not None:
            return found
    shapes = (
        "memtrain's shape card is enough for memtrain plan and validate"
        if card is not None
        else "its config.json alone is enough for memtrain plan and validate"
    )
    raise RecipeError(
        [
            f"{key}: {value!r} is not a local directory and not in the Hugging Face cache; download it "
            f"first (huggingface-cli download {value}; {shapes}) or give its directory"
        ]
    )


def _cached(repo_id: str) -> Path | None:
    """`repo_id`'s snapshot directory in the local Hugging Face cache, or None."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, or an offline cache miss of another kind
        return None


def _fetch_config(repo_id: str) -> Path | None:
    """The snapshot directory holding `repo_id`'s config.json fetched alone, or None (offline, the hub not
    answering within `HUB_TIMEOUT_S`, no such repository, no access). One probe first: huggingface_hub
    retries a failed request five times with back-off (23 s per file with no network)."""
    if not hub_reachable():
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, CONFIG_FILE, etag_timeout=HUB_TIMEOUT_S)).parent
    except Exception:  # RepositoryNotFoundError, GatedRepoError, a network error, ...
        return None


def refuse_remote_code(directory: Path, key: str) -> None:
    """`RecipeError` naming `key` when `directory`'s config.json or tokenizer_config.json has `auto_map`:
    classes transformers would import from the directory's own Python files (code from a download)."""
    for name in (CONFIG_FILE, TOKENIZER_CONFIG_FILE):
        file = directory / name
        if file.is_file() and "auto_map" in read_json_object(str(file), key):
            raise RecipeError(
                [
                    f"{key}: {file} has auto_map (custom classes in the directory's own Python files); "
                    "memtrain never runs code from a model or tokenizer directory: use a model transformers "
                    "implements, with auto_map removed"
                ]
            )


def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers: False with HF_HUB_OFFLINE, else one HEAD request to its
    endpoint with a timeout of `HUB_TIMEOUT_S`, asked once per process."""
    from huggingface_hub import constants

    return not constants.HF_HUB_OFFLINE and _answers(constants.ENDPOINT)


@functools.cache
def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:  # it answered (with an error status): the hub is there
        return True
    except (OSError, ValueError):  # no route, no name resolution, refused, timed out
        return False
    return True


def check_config(directory: Path) -> None:
    """`RecipeError` naming model.pretrained unless `directory` has a config.json (all shapes need) without
    remote code, and whatever weights it holds (safetensors, or pickles it would refuse) are as `train`
    reads them: only a directory without weight files at all is a config alone."""
    refuse_remote_code(directory, "model.pretrained")
    if has_weights(directory) or any(directory.glob("*.bin")):
        check_directory(directory)
    elif not (directory / CONFIG_FILE).is_file():
        raise RecipeError([f"model.pretrained: {directory} has no {CONFIG_FILE}"])


def has_weights(directory: Path) -> bool:
    """Whether `directory` names safetensors weights (a single file or an index); False for a directory
    with its config.json alone, which plans and validates but does not train."""
    return (directory / INDEX_FILE).is_file() or (directory / SINGLE_FILE).is_file()


def check_directory(directory: Path) -> None:
    """`RecipeError` naming model.pretrained unless `directory` has a config (without remote code) and
    safetensors weights."""
    refuse_remote_code(directory, "model.pretrained")
    problems = []
    if not (directory / CONFIG_FILE).is_file():
        problems.append(f"model.pretrained: {directory} has no {CONFIG_FILE}")
    try:
        found = weight_files(directory)
    except RecipeError as exc:
        raise RecipeError([*problems, *exc.problems]) from None
    if not found:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        hint = (
            f" (found {', '.join(pickled)}: pickles are not loaded; convert to safetensors)"
            if pickled
            else "; its config.json alone is enough for memtrain plan and validate, training needs the weights"
        )
        problems.append(
            f"model.pretrained: {directory} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}){hint}"
        )
    if problems:
        raise RecipeError(problems)


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (empty when there are none). A single file's header
    is read here; the shards of an index are opened by `load_weights`."""
    index = directory / INDEX_FILE
    if index.is_file():
        mapping = read_json_object(str(index), "model.pretrained").get("weight_map")
        if not isinstance(mapping, dict) or not all(isinstance(f, str) for f in mapping.values()):
            raise RecipeError(
                [f"model.pretrained: {index} is not a safetensors index (no weight_map of file names)"]
            )
        return {str(name): directory / file for name, file in mapping.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        return {}
    return {name: single for name in _tensor_names(single)}


def _open(file: Path) -> Any:
    from safetensors import safe_open

    return safe_open(str(file), framework="pt", device="cpu")


def _tensor_names(file: Path) -> list[str]:
    """The tensors in a safetensors file's header; `RecipeError` naming model.pretrained otherwise."""
    try:
        with _open(file) as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own error type for a damaged header
        raise RecipeError(
            [
                f"model.pretrained: {file} is not a readable safetensors file ({' '.join(str(exc).split())[:200]})"
            ]
        ) from None


def load_weights(
    model: nn.Module, directory: Path, skip: Callable[[str], bool] = lambda _name: False
) -> None:
    """Fill `model`'s materialised (empty) parameters from the safetensors files of `directory`: whole
    tensors for plain parameters, this rank's block for DTensors on any mesh (FSDP2, HSDP, tensor parallel).
    Checkpoint names are mapped as transformers' `from_pretrained` maps them (`checkpoint_keys`: per-expert
    tensors into a fused parameter, renamed heads). Tied parameters (an output layer sharing the input
    embedding) are filled once; a parameter the files lack is an error."""
    files = weight_files(directory)
    params = dict(_parameters(model))
    found = checkpoint_keys.sources(model, params, files)
    filled: set[int] = set()
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(key: str) -> Any:
            file = files[key]
            if file not in handles:
                handles[file] = stack.enter_context(_open(file))
            return handles[file]

        for name, param in _parameters(model):
            source = found.get(name)
            if id(param) in filled or skip(name) or source is None or source.converter is not None:
                continue
            key = source.keys[0]
            with _reading(key, files[key]):
                _check_dtype(param, handle(key), key, files[key])
                _fill(param, handle(key), key, name)
            filled.add(id(param))
        for target, source in found.items():
            if source.converter is None:
                continue
            rows = _block_rows(params[target]) if source.stacks_experts(params[target].shape[0]) else None
            with _reading(target, files[source.keys[0]]):
                for key in source.keys:
                    _check_dtype(params[target], handle(key), key, files[key])
                built = (
                    source.convert(target, lambda key: handle(key).get_tensor(key), model, rows)
                    if rows is None or rows.stop > rows.start  # an uneven split left this rank no experts
                    else {}
                )
                for name, tensor in built.items():
                    target_param = params.get(name)
                    if target_param is not None and id(target_param) not in filled and not skip(name):
                        _fill_from(target_param, tensor, name, 0 if rows is None else rows.start)
            filled.update(id(params[name]) for name in [target, *built] if name in params)
    missing = [
        name
        for name, param in _parameters(model)
        if id(param) not in filled and not skip(name) and not _tied_to_filled(model, name, filled)
    ]
    if missing:
        raise RecipeError(
            [
                f"model.pretrained: {directory} has no weights for {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} (another model's checkpoint?)"
            ]
        )


@contextmanager
def _reading(name: str, file: Path) -> Iterator[None]:
    """A `RecipeError` naming `name` and `file` for what reading it raises (a missing shard, a file cut
    short, a damaged header, a converter that cannot build the parameter)."""
    try:
        yield
    except RecipeError:
        raise
    except Exception as exc:
        raise RecipeError(
            [f"model.pretrained: cannot read {name} from {file} ({' '.join(str(exc).split())[:200]})"]
        ) from None


def _parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter by every name it has (tied ones more than once), by its name in the base model's
    checkpoint: wrappers' prefixes removed (checkpoint wrappers, peft's `base_layer` of an adapted linear)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        yield name.replace("_checkpoint_wrapped_module.", "").replace(".base_layer.", "."), param


def _check_dtype(param: nn.Parameter, handle: Any, name: str, file: Path) -> None:
    """`RecipeError` naming the file and tensor when a floating parameter is stored as integers or booleans:
    copying converts the values (an F32 tensor relabelled I32 in the header trained to NaN, exit 0)."""
    stored = str(handle.get_slice(name).get_dtype())
    if param.is_floating_point() and not stored.startswith(("F", "BF")):
        raise RecipeError(
            [
                f"model.pretrained: {file}: tensor {name} is stored as {stored}, but the model's parameter is "
                f"floating point ({str(param.dtype).removeprefix('torch.')}); the file is damaged or not "
                "this model's weights"
            ]
        )


def _fill(param: nn.Parameter, handle: Any, key: str, name: str) -> None:
    """`param` (named `name` in the model) from checkpoint tensor `key`: this rank's block of it alone for
    a DTensor."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(param.data, DTensor):
            _fill_shard(param.data, handle.get_slice(key), name)
            return
        source = handle.get_tensor(key)
        _check_shape(name, tuple(source.shape), tuple(param.shape))
        param.data.copy_(source)


def _fill_from(param: nn.Parameter, tensor: torch.Tensor, name: str, first_row: int = 0) -> None:
    """`param` from a tensor a converter built (this rank's block of it for a DTensor), which holds the
    parameter's rows from `first_row` on (all of them, or this rank's experts alone)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(param.data, DTensor):
            _fill_shard(param.data, tensor, name, first_row)
            return
        _check_shape(name, tuple(tensor.shape), tuple(param.shape))
        param.data.copy_(tensor)


def _block_rows(param: nn.Parameter) -> slice | None:
    """The rows of dimension 0 this rank's block of a DTensor parameter holds (None for a plain one)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    data = param.data
    if not isinstance(data, DTensor) or data.dim() == 0:
        return None
    shape, offset = compute_local_shape_and_global_offset(data.shape, data.device_mesh, data.placements)
    return slice(offset[0], offset[0] + shape[0])


def _fill_shard(param: DTensor, source: Any, name: str, first_row: int | None = None) -> None:
    """This rank's block of DTensor `param` from safetensors slice `source` (or a tensor a converter built,
    holding the rows from `first_row` on), on any mesh and placements
    (FSDP's dim-0 shards, HSDP's replicas of them, tensor parallel's column or row shards, both at once):
    the block's shape and global offset are those torch itself gives the local tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    stored = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
    if first_row is None or stored[:1] == tuple(param.shape[:1]):
        first_row = 0
        _check_shape(name, stored, tuple(param.shape))
    else:  # this rank's rows alone
        _check_shape(name, stored[1:], tuple(param.shape[1:]))
    local = param.to_local()
    if local.numel() == 0:  # an uneven split left this rank nothing
        return
    if local.dim() == 0:
        local.copy_(source[...])
        return
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    starts = [offset[0] - first_row, *offset[1:]]
    local.copy_(source[tuple(slice(start, start + size) for start, size in zip(starts, shape, strict=True))])


def _check_shape(name: str, stored: tuple[int, ...], built: tuple[int, ...]) -> None:
    if stored != built:
        raise RecipeError(
            [
                f"model.pretrained: {name} has shape {stored} in the checkpoint, {built} in the model built "
                "from its config.json"
            ]
        )


def _tied_to_filled(model: nn.Module, name: str, filled: set[int]) -> bool:
    """Whether parameter `name` is the same tensor as one already filled (tied weights)."""
    target: Any = model
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            return False
    return id(target) in filled
