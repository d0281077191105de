"""A `Trainer` subclass with its own mixture-of-experts model and its own expert-parallel plan
(`expert_parallel_plan`), for the expert-parallel tests: plain PyTorch, no transformers. Each block routes
its tokens top-2 over 4 experts (a linear router, softmax, the two best renormalised); the experts module
holds its weights stacked over the experts and runs a subset of them grouped by its own code (`run_local`).
`BIAS` biases the routers (`SkewedMoETrainer`: towards expert 0, a deliberately unbalanced routing;
`StarvedMoETrainer`: half the experts get nothing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memtrain import Trainer
from memtrain.strategies.expert_parallel import ExpertLayer

VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, DEPTH, IGNORE = 64, 32, 16, 4, 2, 4, -100


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.1)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(EXPERTS):
            token, slot = torch.where(index == expert)
            rows = F.gelu(hidden[token] @ self.w_in[expert]) @ self.w_out[expert]
            out = out.index_add(0, token, rows * weights[token, slot, None])
        return out


def run_local(module: nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This rank's experts (`module.w_in` holds only them here) on their rows, one expert's slice at a time."""
    pieces = rows.split(counts)
    w_in, w_out = module.w_in, module.w_out
    return torch.cat([F.gelu(p @ w_in[e]) @ w_out[e] for e, p in enumerate(pieces)])


class MoEBlock(nn.Module):
    def __init__(self, bias: tuple[float, ...]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        with torch.no_grad():
            self.router.bias.copy_(torch.tensor(bias))
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).flatten(0, 1)
        probs = self.router(h).softmax(dim=-1)
        weights, index = probs.topk(TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(h, index, weights).view_as(x)


class MoELM(nn.Module):
    def __init__(self, bias: tuple[float, ...] = (0.0,) * EXPERTS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(bias) for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MoETrainer(Trainer):
    """Rows of a step are a function of the step alone; each data-parallel rank reads its own rows."""

    BIAS = (0.0, 0.0, 0.0, 0.0)  # each router's bias per expert

    def build_model(self) -> nn.Module:
        return MoELM(self.BIAS)

    def expert_parallel_plan(self, model: nn.Module) -> list[ExpertLayer]:
        return [ExpertLayer(block.experts, EXPERTS, run_local) for block in model.blocks]  # type: ignore[union-attr]

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        size, share = self.recipe.batch.global_size, self.per_rank_batch_size
        tokens = torch.randint(0, VOCAB, (size, 17), generator=torch.Generator().manual_seed(step))
        mine = tokens[self.env.dp_rank * share : (self.env.dp_rank + 1) * share]
        return {"ids": mine[:, :-1], "labels": mine[:, 1:]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["ids"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return loss_sum, (batch["labels"] != IGNORE).sum()


class SkewedMoETrainer(MoETrainer):
    """Every router biased towards expert 0: most tokens' first choice."""

    BIAS = (4.0, 0.0, 0.0, 0.0)


class StarvedMoETrainer(MoETrainer):
    """Every router biased so far towards experts 0 and 1 that experts 2 and 3 get no token: under EP 2 the
    second ep rank's experts run on no rows (and must still take part in FSDP2's gradient reduction)."""

    BIAS = (30.0, 30.0, 0.0, 0.0)


class NoExpertPlanTrainer(MoETrainer):
    """The same job without an expert-parallel plan: ep > 1 is refused."""

    expert_parallel_plan = Trainer.expert_parallel_plan  # type: ignore[assignment]
