"""A toy data source, written as a user would add one: this file and one registry line
(`DATA_SOURCES.register(RepeatedText())`).

`repeated-text` needs no file: it is `COPIES` copies of one sentence, each a document of the tokenizer's
(the trainer packs them, or makes one row of each).
"""

from __future__ import annotations

from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.sft import Document, text_document
from memtrain.causal_lm.sources import DataSource
from memtrain.causal_lm.tokenizer import Tokenizer
from memtrain.distributed import DistEnv

SENTENCE = "memtrain toy"
COPIES = 64


class RepeatedText(DataSource):
    name = "repeated-text"
    needs_path = False

    def documents(self, cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None) -> list[Document]:
        return [text_document(tokenizer, SENTENCE) for _ in range(COPIES)]
