"""SFT documents: a tokenizer directory through AutoTokenizer, labels exactly on the assistant turns of a
rendered chat (by prefix rendering and by `{% generation %}` marks alike), on the completion of a prompt,
on every token of a text; and the shipped tiny SFT recipe trains end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import sft, sources
from memtrain.causal_lm.packing import document_sample
from memtrain.causal_lm.recipe import CausalLMRecipe, DataConfig
from memtrain.causal_lm.tokenizer import ByteTokenizer, PretrainedTokenizer, load_tokenizer
from memtrain.causal_lm.trainer import CausalLMTrainer, check_model_recipe
from memtrain.errors import RecipeError

from helpers import REPO, TINY_LLAMA, tiny_recipe

TOKENIZER = REPO / "data/tiny-sft-tokenizer"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What color is the sun?"},
    {"role": "assistant", "content": "The sun is yellow."},
    {"role": "user", "content": "And 4 plus 7?"},
    {"role": "assistant", "content": "11."},
]
MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer_dir(tmp_path: Path, template: str | None) -> Path:
    """The shipped tokenizer directory with another chat template (None: without one)."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, directory)
    (directory / "chat_template.jinja").unlink()
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return directory


def _target_runs(doc: sft.Document) -> list[list[int]]:
    """The maximal runs of consecutive target tokens."""
    assert doc.labels is not None
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(doc.tokens, doc.labels, strict=True):
        if label != sft.IGNORE_INDEX:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = label != sft.IGNORE_INDEX
    return runs


def test_tokenizer_directory_loads_through_auto_tokenizer() -> None:
    tokenizer = load_tokenizer(str(TOKENIZER))
    assert isinstance(tokenizer, PretrainedTokenizer)
    assert tokenizer.vocab_size == 320 and tokenizer.chat_template is not None
    assert tokenizer.eos == [tokenizer.hf.convert_tokens_to_ids("<|endoftext|>")]
    assert tokenizer.hf.decode(tokenizer.encode("What is 3 plus 4?")) == "What is 3 plus 4?"


def test_tokenizers_json_file_finds_its_bos_and_eos(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (loaded.bos, loaded.eos, loaded.encode("hello hello")) == ([0], [1], [2, 2])
    assert sft.text_document(loaded, "hello").tokens == [0, 2, 1]


@pytest.mark.parametrize("template", [None, MARKED], ids=["prefix-rendering", "generation-marks"])
def test_chat_labels_only_the_assistant_turns(tmp_path: Path, template: str | None) -> None:
    directory = _tokenizer_dir(tmp_path, template) if template else TOKENIZER
    tokenizer = load_tokenizer(str(directory))
    doc = sft.chat_document(tokenizer, CHAT)
    decode = tokenizer.hf.decode  # type: ignore[attr-defined]
    rendered = tokenizer.hf.apply_chat_template(CHAT, tokenize=False)  # type: ignore[attr-defined]
    assert decode(doc.tokens) == rendered + "<|endoftext|>"  # the separator EOS, as context
    # Exactly two runs of targets, each an assistant turn with its end-of-turn token, nothing else.
    assert [decode(run) for run in _target_runs(doc)] == [
        "The sun is yellow.<|im_end|>\n",
        "11.<|im_end|>\n",
    ]
    # Its row: inputs are the rendered tokens, each label the next token where that token is a target.
    sample = document_sample(doc, seq_len=len(doc.tokens))
    assert sample is not None
    assert doc.labels is not None
    assert sample.labels.tolist() == doc.labels[1:]


def test_both_chat_label_methods_agree(tmp_path: Path) -> None:
    prefix = sft.chat_document(load_tokenizer(str(TOKENIZER)), CHAT)
    marked = sft.chat_document(load_tokenizer(str(_tokenizer_dir(tmp_path, MARKED))), CHAT)
    assert prefix == marked


def test_template_that_rewrites_earlier_turns_is_a_named_error(tmp_path: Path) -> None:
    # Earlier assistant turns rendered shorter once a later turn follows (as templates that strip thinking do).
    template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' and not loop.last %}{{ message['content'][:3] }}"
        "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    cfg = DataConfig(
        source="jsonl", path="x.jsonl", kind="chat", tokenizer=str(_tokenizer_dir(tmp_path, template))
    )
    encode = sft.RecordEncoder(cfg, load_tokenizer(cfg.tokenizer))
    with pytest.raises(RecipeError, match=r"data\.kind: chat row 1: .*generation"):
        encode({"messages": CHAT}, "row 1")


def test_prompt_completion_labels_the_completion_and_its_eos() -> None:
    doc = sft.prompt_completion_document(ByteTokenizer(), "Q: 2+2? A:", " 4")
    assert bytes(doc.tokens).decode() == "Q: 2+2? A: 4\n\n"
    assert doc.labels is not None
    targets = [t for t in doc.labels if t != sft.IGNORE_INDEX]
    assert bytes(targets).decode() == " 4\n\n"
    assert doc.labels[: len("Q: 2+2? A:")] == [sft.IGNORE_INDEX] * len("Q: 2+2? A:")

    tokenizer = load_tokenizer(str(TOKENIZER))
    doc = sft.prompt_completion_document(tokenizer, "What is 3 plus 4?", " 7.")
    assert doc.labels is not None
    targets = [t for t in doc.labels if t != sft.IGNORE_INDEX]
    assert targets[-1] == tokenizer.eos[0]
    assert tokenizer.hf.decode(targets) == " 7.<|endoftext|>"  # type: ignore[attr-defined]


def test_text_documents_carry_loss_on_every_token(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "abc"}) + "\n" + json.dumps({"body": "de"}) + "\n")
    cfg = DataConfig(source="jsonl", path=str(path), fields={"text": "body"}, packing=False, seq_len=16)
    docs = sources.source_of(cfg).documents(cfg, ByteTokenizer(), None)
    assert [d.tokens for d in docs] == [list(b"abc\n\n"), list(b"de\n\n")]
    batch = data_lib.collate(sources.samples_of(docs, cfg, ByteTokenizer()), [0, 1])
    assert batch["labels"].tolist() == [list(b"bc\n\n"), [*b"e\n\n", -100]]
    assert "position_ids" not in batch  # one document per row: no packing


def test_prompt_completion_rows_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"q": "2+2=", "completion": "4"}) + "\n")
    cfg = DataConfig(
        source="jsonl", path=str(path), kind="prompt_completion", fields={"prompt": "q"}, packing=False
    )
    docs = sources.source_of(cfg).documents(cfg, ByteTokenizer(), None)
    (sample,) = sources.samples_of(docs, cfg, ByteTokenizer())
    assert bytes(sample.input_ids.tolist()).decode() == "2+2=4\n"
    assert [t for t in sample.labels.tolist() if t != -100] == list(b"4\n\n")


def test_vocabulary_check_reads_the_tokenizer_directory(tmp_path: Path) -> None:
    data = {"source": "jsonl", "path": str(REPO / "data/tiny_chat.jsonl"), "kind": "chat"}
    small = tiny_recipe(tmp_path, data={**data, "tokenizer": str(TOKENIZER)})  # TINY_LLAMA: 64 ids
    with pytest.raises(
        RecipeError, match=r"model\.config\.vocab_size: 64 is smaller than the tokenizer's 320"
    ):
        check_model_recipe(small)
    check_model_recipe(
        tiny_recipe(
            tmp_path,
            model={"config": {**TINY_LLAMA, "vocab_size": 320}},
            data={**data, "tokenizer": str(TOKENIZER)},
        )
    )


def test_tiny_sft_recipe_trains_and_loss_falls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    recipe = CausalLMRecipe.load(
        REPO / "recipes/tests/tiny-sft.yaml", [f"run.output_dir={tmp_path / 'run'}", "train.steps=30"]
    )
    trainer = CausalLMTrainer(recipe)
    result = trainer.fit()
    assert all("position_ids" in trainer.step_batch(s) for s in range(2))  # packed conversations
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < 0.6 * first, result.losses
    assert result.eval_losses and list(result.eval_losses.values())[-1] < first
