"""A `memtrain.Trainer` subclass with its own plain-PyTorch model, batches and loss (no transformers).

What it shows: memtrain plans the job the trainer really runs. The model has tied input/output weights and
a frozen module (learned-then-fixed positions), the batches are variable-length documents right-padded to
`data.seq_len` with label -100 on the padding, and the loss is this file's own. The recipe next to it has
no `model:` section; its `data:` section is this trainer's own recipe part (`TinyRecipe`), so a key the
trainer does not read is refused by name.

    memtrain plan    examples/own_model/recipe.yaml --trainer examples/own_model/trainer.py:TinyTrainer
    memtrain profile examples/own_model/recipe.yaml --trainer examples/own_model/trainer.py:TinyTrainer
    memtrain train   examples/own_model/recipe.yaml --trainer examples/own_model/trainer.py:TinyTrainer
    torchrun --nproc_per_node=2 -m memtrain train examples/own_model/recipe.yaml \\
        --trainer examples/own_model/trainer.py:TinyTrainer strategies.sharding=ddp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from memtrain import Recipe, RecipeSection, Trainer

VOCAB = 256
IGNORE = -100


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 4, heads: int = 4, max_len: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.positions.requires_grad_(False)  # frozen: no gradient, no optimizer state
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, counted once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TinyData(RecipeSection):
    """`data:` as this trainer reads it."""

    seq_len: int = Field(default=64, gt=0, description="The row length documents are padded to.")


class TinyRecipe(Recipe):
    """Every trainer's sections, and this one's `data:`."""

    sequence_length_key = "data.seq_len"  # the memory tips name it
    data: TinyData = TinyData()


class TinyTrainer(Trainer):
    recipe_class = TinyRecipe
    recipe: TinyRecipe

    def build_model(self) -> nn.Module:
        return TinyLM(max_len=self.recipe.data.seq_len)

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's rows of step `step`'s global batch: documents of 8..seq_len tokens, right-padded to
        seq_len. The global batch is a function of the step alone, so a resume continues at the exact
        sample and any number of ranks trains on the same rows."""
        length, size = self.recipe.data.seq_len, self.recipe.batch.global_size
        generator = torch.Generator().manual_seed(self.recipe.run.seed * 1_000_003 + step)
        tokens = torch.randint(0, VOCAB, (size, length + 1), generator=generator)
        lengths = torch.randint(8, length + 1, (size,), generator=generator)
        mine = slice(self.env.rank * self.per_rank_batch_size, (self.env.rank + 1) * self.per_rank_batch_size)
        tokens, lengths = tokens[mine], lengths[mine]
        real = torch.arange(length).expand(len(lengths), length) < lengths[:, None]
        ids = torch.where(real, tokens[:, :-1], 0)
        labels = torch.where(real, tokens[:, 1:], IGNORE)
        return {"ids": ids, "labels": labels}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["ids"])
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return loss_sum, (labels != IGNORE).sum()
