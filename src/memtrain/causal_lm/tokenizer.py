"""Tokenizers of the built-in causal-LM trainer: UTF-8 bytes, a `tokenizers` JSON file, or a Hugging Face
tokenizer directory (with its chat template), behind one small interface.

Why an interface of our own: the data code needs only a vocabulary size, `encode` without special
tokens, the BOS a tokenizer puts in front of a text, the tokens that end a document, and (for chat data)
the chat template. Byte-level stays the default because it needs no files; a directory is loaded with
`transformers.AutoTokenizer` from local files only (nothing is fetched from a hub).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from memtrain.causal_lm.cards import card_directory
from memtrain.causal_lm.pretrained import refuse_remote_code, resolve
from memtrain.errors import RecipeError
from memtrain.jsonfile import mib

# Files of which a Hugging Face tokenizer directory holds at least one.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Files a Hugging Face tokenizer directory may hold (slow and fast tokenizers, chat templates): what a run
# keeps of its tokenizer directory, and what an export of the run copies from that copy.
DIRECTORY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
# End-of-document tokens looked up in a bare `tokenizers` JSON file, which names no EOS of its own.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
BLANK_LINE = "\n\n"  # the document separator of tokenizers without an end-of-document token
MAX_JSON_FILE_BYTES = 256 * 2**20  # a tokenizer's JSON file, read whole (the largest real ones: ~35 MB)


class Tokenizer(Protocol):
    vocab_size: int  # every id it produces is below this
    bos: list[int]  # what it puts in front of a text ([] when nothing)
    eos: list[int]  # what ends a document: its EOS token, or a blank line when it has none
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without special tokens."""
        ...


def id_space(ids: Iterable[int]) -> int:
    """The ids a tokenizer can produce span 0..max: its count of tokens is not enough, because a vocabulary
    may skip ids (a tokenizer.json edited by hand, tokens removed), and the model's embedding must hold the
    largest id, or training fails with an index error deep in the first step."""
    return max(ids, default=-1) + 1


class ByteTokenizer:
    """UTF-8 bytes as tokens: no files, no vocabulary to ship, 256 ids; documents end with a blank line."""

    vocab_size = 256
    bos: list[int] = []
    eos = list(BLANK_LINE.encode("utf-8"))
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class JsonTokenizer:
    """A `tokenizers` JSON file (e.g. a trained BPE), loaded from a local path; its post-processor's prefix
    (e.g. Llama's `<s>`) is its BOS."""

    chat_template: str | None = None

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tokenizer = HFTokenizer.from_file(str(path))
        self.vocab_size = id_space(self._tokenizer.get_vocab(with_added_tokens=True).values())
        plain, special = self.encode("a"), self._tokenizer.encode("a").ids
        prefix = len(special) - len(plain)
        self.bos: list[int] = (
            special[:prefix] if prefix > 0 and special[prefix:][: len(plain)] == plain else []
        )
        ids = [i for i in map(self._tokenizer.token_to_id, EOS_CANDIDATES) if i is not None]
        self.eos: list[int] = ids[:1] or self.encode(BLANK_LINE)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


class PretrainedTokenizer:
    """A Hugging Face tokenizer directory through `AutoTokenizer.from_pretrained` (local files only)."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self.directory = directory
        self.hf: Any = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
        # added special tokens included (`hf.vocab_size` leaves them out), and ids past the count
        self.vocab_size = max(len(self.hf), id_space(self.hf.get_vocab().values()))
        eos = self.hf.eos_token_id
        self.eos = [int(eos)] if eos is not None else self.encode(BLANK_LINE)
        probe = self.hf("a", add_special_tokens=True)["input_ids"]
        bos = self.hf.bos_token_id
        self.bos = [int(bos)] if bos is not None and probe[:1] == [bos] else []
        self.chat_template: str | None = getattr(self.hf, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])


def absent(spec: str) -> bool:
    """Whether `data.tokenizer` names a directory (or cached hub id) that holds no tokenizer files, such as
    a config-only model directory, or a hub id not downloaded that memtrain has a shape card for: a
    tokenizer not downloaded yet, not a wrong one."""
    if spec == "byte" or Path(spec).is_file():
        return False
    try:
        path = Path(spec) if Path(spec).is_dir() else resolve(spec, "data.tokenizer")
    except RecipeError:
        return card_directory(spec) is not None
    return not any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(spec: str) -> Tokenizer:
    """`data.tokenizer`: "byte", a tokenizers JSON file, a tokenizer directory, or a hub id in the local cache
    (e.g. the `model.pretrained` one); `RecipeError` otherwise.
    Loaded once per process and version of its files (validation, the vocabulary check and the data share it)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists() and spec.count("/") == 1 and not spec.startswith((".", "/")):
        path = resolve(spec, "data.tokenizer")  # a hub id in the local cache (e.g. the pretrained model's)
        spec = str(path)
    files = sorted(path.iterdir()) if path.is_dir() else [path] if path.is_file() else []
    stamp = tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file())
    for name, _, size in stamp:
        if name.endswith(".json") and size > MAX_JSON_FILE_BYTES:
            raise RecipeError(
                [f"data.tokenizer: {name} is {size:,} bytes, over the limit of {mib(MAX_JSON_FILE_BYTES)}"]
            )
    return _load(spec, stamp)


@functools.lru_cache(maxsize=8)
def _load(spec: str, stamp: tuple[tuple[str, int, int], ...]) -> Tokenizer:
    path = Path(spec)
    if path.is_dir():
        return _directory(path)
    if not path.is_file():
        raise RecipeError(
            [
                f'data.tokenizer: not found: {path} (use "byte", a tokenizers JSON file or a tokenizer directory)'
            ]
        )
    try:
        return JsonTokenizer(path)
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise RecipeError([f"data.tokenizer: {path} is not a tokenizers JSON file ({exc})"]) from None


def _directory(path: Path) -> PretrainedTokenizer:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise RecipeError(
            [
                f"data.tokenizer: the directory {path} holds no tokenizer (none of "
                f"{', '.join(TOKENIZER_FILES[:3])}, ...): save one there with tokenizer.save_pretrained()"
            ]
        )
    refuse_remote_code(path, "data.tokenizer")
    try:
        return PretrainedTokenizer(path)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a broken directory
        text = " ".join(str(exc).split())[:300]
        raise RecipeError(
            [f"data.tokenizer: transformers cannot load the tokenizer in {path} ({text})"]
        ) from None


def directory_files(spec: str) -> dict[str, Path]:
    """The files of `data.tokenizer` a run keeps (name -> path) when it names a directory; {} otherwise (a
    byte tokenizer, a tokenizers JSON file, a hub id: none is copied, as before)."""
    source = Path(spec)
    if spec == "byte" or not source.is_dir():
        return {}
    return {name: source / name for name in DIRECTORY_FILES if (source / name).is_file()}
