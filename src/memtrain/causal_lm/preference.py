"""Preference training (DPO) for the built-in causal-LM trainer: `data.kind: preference` pairs and the
`preference:` section.

Why a trainer subclass: a preference step differs from an SFT step in its data (pairs, never split
between micro-batches), its loss (a sum over pairs, normalised by the pair count) and a frozen reference
model beside the policy; everything else (planning, strategies, checkpoints, export) is the built-in
trainer's. `CausalLMTrainer(recipe)` becomes a `PreferenceTrainer` when the data is preference pairs.

A batch holds each pair's chosen and rejected rows under their own keys, the pair along dim 0, so the
loop's micro-batching splits by pairs; the loss concatenates them along the batch (TRL's layout) for one
forward. The DPO loss per pair is `-logsigmoid(beta * ((pc - pr) - (rc - rr)))` (cDPO's label smoothing
optional), p and r the policy's and the reference's log-probabilities summed over the completion tokens.

The reference (`preference.reference`), a planned memory choice:
- `copy`: the initial policy (built again, whole on every rank), frozen, stored in the compute dtype; its
  weights are in the plan (`ModelSpec.frozen_bytes`) and the tracker counts them as weights.
- `precomputed`: the reference log-probabilities of every pair (two floats each), computed once by the
  initial model before step 1 (again, from the same initial weights, before a resume loads its checkpoint:
  exact); no weights, one forward pass over the data.
- `adapter_free`: with LoRA, the policy with its adapters disabled: no extra weights.
`auto`: adapter_free with adapters, else precomputed: it never holds more memory than a copy, and it takes
less time whenever the run reads each pair at least once (one forward per pair, against one per pair per
step it appears in).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm.packing import Sample, document_sample
from memtrain.causal_lm.recipe import CausalLMRecipe, DataConfig
from memtrain.causal_lm.sft import IGNORE_INDEX, RecordEncoder
from memtrain.causal_lm.sources import JsonlSource, source_of
from memtrain.causal_lm.tokenizer import load_tokenizer
from memtrain.causal_lm.trainer import CausalLMTrainer, _under_fake_tensors
from memtrain.errors import RecipeError
from memtrain.planner import ModelSpec
from memtrain.recipe import Recipe
from memtrain.strategies.apply import materialise_parameters
from memtrain.training.trainer import Batch, Trainer

SIDES = ("chosen", "rejected")
REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")


@dataclass(frozen=True)
class Pair:
    """One preference pair: the chosen and the rejected completion of the same prompt, one row each."""

    chosen: Sample
    rejected: Sample

    def tensors(self) -> list[torch.Tensor]:
        return self.chosen.tensors() + self.rejected.tensors()


@dataclass(frozen=True)
class PairSplits:
    train: list[Pair]
    eval: list[Pair]
    dropped: int  # pairs whose chosen or rejected completion left no target within data.seq_len


def reference_kind(recipe: CausalLMRecipe) -> str:
    """`preference.reference`, with `auto` resolved (module docstring)."""
    chosen = recipe.preference.reference
    if chosen != "auto":
        return chosen
    return "adapter_free" if recipe.adapters.kind != "none" else "precomputed"


def _records(cfg: DataConfig) -> Iterable[tuple[Mapping[str, Any], str]]:
    source = source_of(cfg)
    if isinstance(source, JsonlSource):
        return source.read_records(cfg)
    if source.streams:
        return source.records(cfg)()
    raise RecipeError([f"data.source: {cfg.source} gives no preference records (use jsonl or dataset)"])


def read_pairs(cfg: DataConfig, seed: int) -> PairSplits:
    """Every pair of the data (each side cut to `seq_len`), shuffled once by `seed`, the last
    `eval_fraction` held out; a pair with a side that keeps no completion token is dropped and counted."""
    encode = RecordEncoder(cfg, load_tokenizer(cfg.tokenizer))
    pairs, dropped = [], 0
    for record, where in _records(cfg):
        chosen, rejected = (document_sample(d, cfg.seq_len) for d in encode.pair(record, where))
        if chosen is None or rejected is None:
            dropped += 1
        else:
            pairs.append(Pair(chosen, rejected))
    if not pairs:
        raise RecipeError(
            [f"data.path: {cfg.path} yields no preference pair with both completions in data.seq_len"]
        )
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    shuffled = [pairs[i] for i in order]
    cut = len(shuffled) - int(len(shuffled) * cfg.eval_fraction)
    return PairSplits(shuffled[:cut], shuffled[cut:], dropped)


def collate_pairs(pairs: list[Pair], ids: list[int], reference: torch.Tensor | None = None) -> Batch:
    """Both sides right-padded to one length, a pair per index of dim 0; `reference` (pairs x 2, indexed by
    `ids`) adds the precomputed reference log-probabilities."""
    both = data_lib.collate(
        [p.chosen for p in pairs] + [p.rejected for p in pairs], list(range(2 * len(pairs)))
    )
    n = len(pairs)
    batch = {
        "chosen_input_ids": both["input_ids"][:n],
        "chosen_labels": both["labels"][:n],
        "rejected_input_ids": both["input_ids"][n:],
        "rejected_labels": both["labels"][n:],
        "sample_ids": torch.tensor(ids, dtype=torch.long),
    }
    if reference is not None:
        batch[REFERENCE_KEYS[0]], batch[REFERENCE_KEYS[1]] = reference[ids, 0], reference[ids, 1]
    return batch


def trim_pairs(batch: Batch) -> Batch:
    """Drop trailing columns that are padding in every row of both sides (exact, as `data.trim_padding`)."""
    real = ((batch["chosen_labels"] != IGNORE_INDEX) | (batch["rejected_labels"] != IGNORE_INDEX)).any(dim=0)
    found = real.nonzero()
    keep = int(found.max()) + 1 if len(found) else 1
    return {k: (v[:, :keep] if v.dim() == 2 else v) for k, v in batch.items()}


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its labels (positions labelled -100 excluded), in fp32 at least."""
    mask = labels != IGNORE_INDEX
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    picked = logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def dpo_losses(
    policy: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The sigmoid DPO loss of each pair from (chosen, rejected) summed log-probabilities."""
    margin = beta * ((policy[0] - policy[1]) - (reference[0] - reference[1]))
    return -F.logsigmoid(margin) * (1 - label_smoothing) - F.logsigmoid(-margin) * label_smoothing


def logps_of(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected rows' summed log-probabilities, from one forward of both (TRL's layout)."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    logps = sequence_logps(model(input_ids=ids, use_cache=False).logits, labels)
    n = batch["chosen_input_ids"].shape[0]
    return logps[:n], logps[n:]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model without its LoRA adapters (peft's layers skip them while `_disable_adapters` is set;
    `enable_adapters(False)` would also change which parameters train)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            layer._disable_adapters = value


def _standard_loss(recipe: Recipe) -> CausalLMRecipe:
    """The recipe with `strategies.loss: standard` (DPO reads the logits, which chunked and fused losses
    never hold; the recipe's checks refuse them when pinned)."""
    adopted = CausalLMRecipe.adopt(recipe)
    if adopted.strategies.loss == "standard":
        return adopted
    return adopted.model_copy(
        update={"strategies": adopted.strategies.model_copy(update={"loss": "standard"})}
    )


class PreferenceTrainer(CausalLMTrainer):
    """The built-in trainer on preference pairs with the DPO loss (module docstring)."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(_standard_loss(recipe))
        self.reference = reference_kind(self.recipe)
        self._pairs: PairSplits | None = None
        self._reference_model: nn.Module | None = None
        self._reference_logps: dict[str, torch.Tensor] = {}

    @property
    def pairs(self) -> PairSplits:
        """The train and eval pairs, read on first use."""
        if self._pairs is None:
            self._pairs = read_pairs(self.recipe.data, self.recipe.run.seed)
            size = self.recipe.batch.global_size
            if len(self._pairs.train) < size:
                raise RecipeError(
                    [f"batch.global_size: {size} exceeds the {len(self._pairs.train)} training pairs of data"]
                )
            if self._pairs.dropped and self.env.is_main:
                print(
                    f"[memtrain] {self._pairs.dropped} preference pairs dropped: a completion past data.seq_len"
                )
        return self._pairs

    @property
    def sampler(self) -> data_lib.Sampler:
        if self._sampler is None:
            batch = self.recipe.batch.global_size
            self._sampler = data_lib.StepSampler(len(self.pairs.train), batch, self.recipe.run.seed)
        return self._sampler

    def setup(self) -> None:
        _ = self.pairs
        Trainer.setup(self)
        self._build_reference()

    def _build_reference(self) -> None:
        """The reference from the model as setup left it (the initial weights, before any resume)."""
        if self.reference == "copy":
            self._reference_model = self._initial_copy()
            if self.monitor.tracker is not None:
                self.monitor.tracker.count_as_weights(self._reference_model)
        elif self.reference == "precomputed":
            self._reference_logps = {
                "train": self._precompute(self.pairs.train),
                "eval": self._precompute(self.pairs.eval),
            }

    def _initial_copy(self) -> nn.Module:
        """The initial policy, built again as setup built it (same seed, same pretrained weights) whole on
        this rank whatever the sharding, frozen, its parameters in the compute dtype (the RNG left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.recipe.run.seed)  # as `seed_everything` before setup's build
            model = self.build_model()
        if any(p.is_meta for p in model.parameters()):
            materialise_parameters(model, self.env.device)
            self.load_weights(model)
        model = model.to(self.env.device).eval().requires_grad_(False)
        precision = self.plan.precision
        dtype = precision.autocast_dtype or precision.stored_dtype
        with torch.no_grad():
            for (
                parameter
            ) in model.parameters():  # not the buffers: rotary tables stay as the model keeps them
                parameter.data = parameter.data.to(dtype)
        return model

    @torch.no_grad()
    def _precompute(self, pairs: list[Pair]) -> torch.Tensor:
        """The initial model's (chosen, rejected) log-probabilities of every pair, a micro-batch at a time."""
        assert self.model is not None
        model = self._sharding.unwrap(self.model)
        table = torch.zeros(len(pairs), 2)
        size, training = self.plan.micro_batch_size, model.training
        model.eval()
        for start in range(0, len(pairs), size):
            ids = list(range(start, min(start + size, len(pairs))))
            batch = self._to_device(trim_pairs(collate_pairs([pairs[i] for i in ids], ids)))
            with self.plan.precision.autocast(self.env.device):
                chosen, rejected = logps_of(model, batch)
            table[ids] = torch.stack([chosen, rejected], dim=1).float().cpu()
        model.train(training)
        return table

    def model_spec(self) -> ModelSpec:
        """The built-in hooks, with the reference's forward in every step (a copy or the adapter-free base:
        `reference_forwards`) and a copy's weights (`frozen_bytes`)."""
        spec = super().model_spec()
        if self.reference == "precomputed":
            return spec
        spec = dataclasses.replace(spec, reference_forwards=1)
        if self.reference != "copy":
            return spec
        with torch.device("meta"):
            numel = sum(p.numel() for p in self._from_config(self.model_config).parameters())
        return dataclasses.replace(spec, frozen_bytes=lambda dtype: numel * dtype.itemsize)

    def planning_batch(self, rows: int) -> Batch:
        """`rows` pairs of full-length chosen and rejected rows (with reference log-probabilities when they
        are precomputed: the step then runs no reference forward)."""
        vocab, seq_len = int(self.model_config.vocab_size), self.recipe.data.seq_len
        generator = torch.Generator().manual_seed(0)
        pairs = []
        for _ in range(rows):
            chosen, rejected = (torch.randint(0, vocab, (seq_len + 1,), generator=generator) for _ in SIDES)
            pairs.append(Pair(Sample(chosen[:-1], chosen[1:]), Sample(rejected[:-1], rejected[1:])))
        table = torch.zeros(rows, 2) if self.reference == "precomputed" else None
        return collate_pairs(pairs, list(range(rows)), table)

    def host_data_bytes(self) -> int:
        tensors = [t for p in self.pairs.train for t in p.tensors()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values()) + sum(t.nbytes for t in self._reference_logps.values())

    def tensor_parallel_plan(self, model: nn.Module) -> None:
        """None: the preference loss reads log-probabilities from whole logits, which tensor parallelism
        shards by vocabulary (tp > 1 is refused before step 1)."""
        return None

    def step_batch(self, step: int) -> Batch:
        share = self.per_rank_batch_size
        indices = self.sampler.indices(step)[self.env.dp_rank * share : (self.env.dp_rank + 1) * share]
        return collate_pairs(
            [self.pairs.train[i] for i in indices], indices, self._reference_logps.get("train")
        )

    def eval_batches(self) -> Iterable[Batch]:
        """This rank's share of the held-out pairs, `train.eval_batches` step batches at most."""
        pairs, size = self.pairs.eval, self.recipe.batch.global_size
        world, rank, share = self.env.dp_size, self.env.dp_rank, self.per_rank_batch_size
        for start in range(0, min(len(pairs), size * self.recipe.train.eval_batches), size):
            mine = list(range(start, min(start + size, len(pairs))))[rank::world][:share]
            if mine:
                yield collate_pairs([pairs[i] for i in mine], mine, self._reference_logps.get("eval"))

    def split_batch(self, batch: Batch, micro_size: int) -> list[Batch]:
        return [trim_pairs(mb) for mb in Trainer.split_batch(self, batch, micro_size)]

    def row_tokens(self, batch: Batch) -> list[int]:
        """A pair's tokens: both rows, up to the later of their last loss tokens."""
        sides = [Trainer.row_tokens(self, {"labels": batch[f"{side}_labels"]}) for side in SIDES]
        return [2 * max(c, r) for c, r in zip(*sides, strict=True)]

    def count_tokens(self, batch: Batch) -> int:
        """The pairs: the DPO loss is a mean over pairs."""
        return int(batch["chosen_labels"].shape[0])

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed DPO losses of the micro-batch's pairs, and the pair count."""
        reference = self._reference_logps_of(model, batch)  # first: its transient memory is gone by the
        policy = logps_of(model, batch)  # time the policy's forward keeps its activations
        settings = self.recipe.preference
        losses = dpo_losses(policy, reference, settings.beta, settings.label_smoothing)
        return losses.sum(), torch.tensor(losses.shape[0])

    @torch.no_grad()
    def _reference_logps_of(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Precomputed, or a forward of the copy or the adapter-free policy. Under the planner's fake tensors
        no forward runs: run before the policy's, its transient memory stays below the policy's forward and
        backward (the same model, without the activations kept for backward)."""
        if REFERENCE_KEYS[0] in batch:
            return batch[REFERENCE_KEYS[0]], batch[REFERENCE_KEYS[1]]
        if _under_fake_tensors():
            zeros = torch.zeros(batch["chosen_input_ids"].shape[0], device=batch["chosen_input_ids"].device)
            return zeros, zeros
        if self._reference_model is not None:
            return logps_of(self._reference_model, batch)
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        disabled = adapters_disabled(inner) if self.reference == "adapter_free" else contextlib.nullcontext()
        with disabled:
            return logps_of(inner, batch)


def trainer_for(recipe: CausalLMRecipe, trainer: type[CausalLMTrainer]) -> type[CausalLMTrainer]:
    """The class `recipe`'s data trains with: this module's for preference pairs, else `trainer` (the one the
    command resolved, which a harness may have replaced: not this module's import of it)."""
    return PreferenceTrainer if recipe.data.kind == "preference" else trainer
