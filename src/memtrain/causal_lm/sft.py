"""Supervised fine-tuning documents: what each record of the data becomes, and which tokens carry loss.

A `Document` is the token ids of one record and, per token, whether the model is trained to predict it.
`data.kind` decides:

- `text`: every token (a pretraining document), then the document's end (EOS);
- `prompt_completion`: the completion and its EOS only: the prompt is context;
- `chat`: a `messages` list rendered with the tokenizer's chat template; only the assistant turns' tokens
  (the template's end-of-turn token included) carry loss.

Why labels are found the way they are: a template that marks assistant turns with `{% generation %}`
says exactly which tokens are the assistant's (`return_assistant_tokens_mask`). Other templates are
rendered prefix by prefix: the text before an assistant turn (rendered with the generation prompt, so the
turn's header is context) and the text up to its end give the turn's characters, and the rendered
conversation is tokenized once with character offsets, so a merge across a boundary cannot shift a label.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.tokenizer import PretrainedTokenizer, Tokenizer
from memtrain.errors import RecipeError, shortened

IGNORE_INDEX = -100
MAX_CHAT_MESSAGES = 8192  # a chat row's messages: chat templates label them in time growing with the square
MAX_PREFIX_MESSAGES = 512  # messages of a conversation labelled by rendering prefixes (about 1 s on a CPU)
ROLES = {
    "text": ("text",),
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
}


@dataclass(frozen=True)
class Document:
    """One record's tokens; `labels[k]` is `tokens[k]` where token k is a loss target, else -100
    (None: every token but the first is a target). A document's first token is never a target."""

    tokens: list[int]
    labels: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def column(cfg: DataConfig, role: str) -> tuple[str, str]:
    """The column holding `role` (text, messages, prompt, completion) and the recipe key naming it."""
    if role in cfg.fields:
        return cfg.fields[role], f"data.fields.{role}"
    if role == "text":
        return cfg.jsonl_field, "data.jsonl_field"
    return role, f"data.fields.{role}"


def text_document(tokenizer: Tokenizer, text: str) -> Document:
    return Document(tokenizer.bos + tokenizer.encode(text) + tokenizer.eos)


def prompt_completion_document(tokenizer: Tokenizer, prompt: str, completion: str) -> Document:
    context = tokenizer.bos + tokenizer.encode(prompt)
    target = tokenizer.encode(completion) + tokenizer.eos
    return Document(context + target, [IGNORE_INDEX] * len(context) + target)


class ChatError(ValueError):
    """A conversation the chat template cannot render or label (the message says why)."""


def chat_document(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> Document:
    """The conversation rendered by the chat template; assistant turns carry loss. A trailing EOS is added
    (as context) when the rendering does not end with one, so that packed documents stay separated."""
    if not isinstance(tokenizer, PretrainedTokenizer) or tokenizer.chat_template is None:
        raise ChatError("the tokenizer has no chat template")
    if _has_generation_block(tokenizer.chat_template):
        tokens, mask = _marked_turns(tokenizer, messages)
    else:
        tokens, mask = _rendered_prefixes(tokenizer, messages)
    labels = [t if m else IGNORE_INDEX for t, m in zip(tokens, mask, strict=True)]
    if tokens[-len(tokenizer.eos) :] != tokenizer.eos:
        tokens, labels = tokens + tokenizer.eos, labels + [IGNORE_INDEX] * len(tokenizer.eos)
    if labels:
        labels[0] = IGNORE_INDEX
    return Document(tokens, labels)


def chat_completion_document(
    tokenizer: Tokenizer, prompt: list[dict[str, Any]], completion: list[dict[str, Any]]
) -> Document:
    """The conversation `prompt + completion` rendered by the chat template; only the completion's tokens
    (after the prompt rendered with the generation prompt) carry loss, found by character offsets."""
    if not isinstance(tokenizer, PretrainedTokenizer) or tokenizer.chat_template is None:
        raise ChatError("the tokenizer has no chat template")
    before = _render(tokenizer, prompt, prompt=True)
    full = _render(tokenizer, prompt + completion, prompt=False)
    if not full.startswith(before):
        raise ChatError("the chat template renders the prompt differently once the completion follows")
    encoded = tokenizer.hf(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(encoded["input_ids"])
    labels = [
        t if start >= len(before) else IGNORE_INDEX
        for t, (start, _) in zip(tokens, encoded["offset_mapping"], strict=True)
    ]
    if tokens[-len(tokenizer.eos) :] != tokenizer.eos:
        tokens, labels = tokens + tokenizer.eos, labels + [IGNORE_INDEX] * len(tokenizer.eos)
    if labels:
        labels[0] = IGNORE_INDEX
    return Document(tokens, labels)


def _has_generation_block(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _marked_turns(
    tokenizer: PretrainedTokenizer, messages: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    try:
        out = tokenizer.hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as exc:  # jinja's TemplateError (raise_exception in the template), ValueError
        raise ChatError(f"the chat template rejects it ({exc})") from None
    return list(out["input_ids"]), list(out["assistant_masks"])


def _render(tokenizer: PretrainedTokenizer, messages: list[dict[str, Any]], prompt: bool) -> str:
    try:
        text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    except Exception as exc:  # jinja's TemplateError (raise_exception in the template), ValueError
        raise ChatError(f"the chat template rejects it ({exc})") from None
    return str(text)


def _rendered_prefixes(
    tokenizer: PretrainedTokenizer, messages: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    if len(messages) > MAX_PREFIX_MESSAGES:
        raise ChatError(
            f"{len(messages):,} messages, over the {MAX_PREFIX_MESSAGES} whose assistant turns are found by "
            "rendering each prefix (the time grows with the square of the turns: 100k took hours); split the "
            "conversation into rows, or mark assistant turns with {% generation %} in the chat template"
        )
    full = _render(tokenizer, messages, prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], prompt=True) if index else ""
        through = _render(tokenizer, messages[: index + 1], prompt=False)
        if not (full.startswith(before) and full.startswith(through)) or len(through) < len(before):
            raise ChatError(
                "the chat template renders earlier turns differently once later ones follow, so assistant "
                "tokens cannot be found by prefix (mark them with {% generation %} in the template)"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer.hf(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), _inside(spans, [start for start, _ in encoded["offset_mapping"]])


def _inside(spans: list[tuple[int, int]], starts: list[int]) -> list[int]:
    """1 for each (ascending) character offset inside one of the ascending, disjoint `spans`, else 0: one
    pass over both."""
    mask, index = [], 0
    for start in starts:
        while index < len(spans) and spans[index][1] <= start:
            index += 1
        mask.append(int(index < len(spans) and spans[index][0] <= start))
    return mask


class RecordEncoder:
    """Records (mappings of columns) to documents for `data.kind`; a bad record is a `RecipeError` that names
    the key to change and where the record is."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer) -> None:
        self.kind = cfg.kind
        self.tokenizer = tokenizer
        self.columns = {role: column(cfg, role) for role in ROLES[cfg.kind]}

    def check(self, record: Mapping[str, Any], where: str) -> None:
        """The checks of `__call__` without tokenizing: the fields `data.kind` reads, as valid Unicode."""
        if self.kind == "chat":
            self._messages(record, where)
            return
        if self.kind == "preference":
            self._pair_fields(record, where)
            return
        for role in ROLES[self.kind]:
            self._string(record, role, where)

    def pair(self, record: Mapping[str, Any], where: str) -> tuple[Document, Document]:
        """A preference record's chosen and rejected documents (loss on each completion only): three strings
        (prompt-completion) or three messages lists (the chat template; TRL's conversational format)."""
        prompt, chosen, rejected = self._pair_fields(record, where)
        if isinstance(prompt, str):
            assert isinstance(chosen, str) and isinstance(rejected, str)
            return (
                prompt_completion_document(self.tokenizer, prompt, chosen),
                prompt_completion_document(self.tokenizer, prompt, rejected),
            )
        assert isinstance(chosen, list) and isinstance(rejected, list)
        try:
            return (
                chat_completion_document(self.tokenizer, prompt, chosen),
                chat_completion_document(self.tokenizer, prompt, rejected),
            )
        except ChatError as exc:
            raise RecipeError([f"data.kind: preference {where}: {exc}"]) from None

    def _pair_fields(
        self, record: Mapping[str, Any], where: str
    ) -> tuple[str | list[dict[str, Any]], str | list[dict[str, Any]], str | list[dict[str, Any]]]:
        """The prompt, chosen and rejected fields: all strings, or all messages lists."""
        if all(isinstance(record.get(self.columns[r][0]), str) for r in ROLES["preference"]):
            prompt, chosen, rejected = (self._string(record, r, where) for r in ROLES["preference"])
            return prompt, chosen, rejected
        lists = []
        for role in ROLES["preference"]:
            name, key = self.columns[role]
            problem = message_problem(record.get(name))
            if problem is not None:
                raise RecipeError(
                    [
                        f"{key}: {where}: {problem} in field {name!r} (prompt, chosen and rejected are all "
                        "strings or all messages lists of {role, content})"
                    ]
                )
            lists.append(record[name])
        return lists[0], lists[1], lists[2]

    def __call__(self, record: Mapping[str, Any], where: str) -> Document:
        if self.kind == "preference":
            raise RecipeError([f"data.kind: preference {where}: pairs are read with RecordEncoder.pair"])
        if self.kind == "text":
            return text_document(self.tokenizer, self._string(record, "text", where))
        if self.kind == "prompt_completion":
            prompt = self._string(record, "prompt", where)
            return prompt_completion_document(
                self.tokenizer, prompt, self._string(record, "completion", where)
            )
        messages = self._messages(record, where)
        try:
            return chat_document(self.tokenizer, messages)
        except ChatError as exc:
            raise RecipeError([f"data.kind: chat {where}: {exc}"]) from None

    def _string(self, record: Mapping[str, Any], role: str, where: str) -> str:
        name, key = self.columns[role]
        value = record.get(name)
        if not isinstance(value, str):
            raise RecipeError([f"{key}: {where} has no string field {shortened(name)}"])
        _check_unicode(value, f"{where}: field {shortened(name)}")
        return value

    def _messages(self, record: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
        name, _ = self.columns["messages"]
        messages = record.get(name)
        problem = message_problem(messages)
        if problem is not None:
            raise RecipeError(
                [
                    f"data.kind: chat {where}: {problem} in field {name!r} (a list of {{role, content}}; "
                    "another column is mapped with data.fields.messages)"
                ]
            )
        assert isinstance(messages, list)
        for number, message in enumerate(messages, start=1):
            for part in ("role", "content"):
                _check_unicode(message[part], f"{where}: field {shortened(name)}, message {number}'s {part}")
        return messages


def _check_unicode(text: str, what: str) -> None:
    """`RecipeError` naming data.path when `text` cannot be encoded (a lone surrogate such as "\\ud800",
    which JSON allows and every tokenizer refuses)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RecipeError(
            [f"data.path: {what} is not valid Unicode ({exc.reason} at character {exc.start})"]
        ) from None


def message_problem(messages: Any) -> str | None:
    """Why `messages` is not a conversation, or None."""
    if not isinstance(messages, list) or not messages:
        return "no messages"
    if len(messages) > MAX_CHAT_MESSAGES:
        return f"{len(messages):,} messages, over the {MAX_CHAT_MESSAGES:,} a row may hold (split the conversation)"
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return f"message {number} has no role"
        if not isinstance(message.get("content"), str):
            return f"message {number} has no string content"
    return None
