"""Block discovery: the repeated transformer blocks that activation checkpointing, fp8 and sharding wrap.

The classes named by a transformers model's `_no_split_modules` (the outermost of them: a block's own
sub-module named there too is not another block), else the largest `ModuleList` whose children all share
one type (what a hand-written transformer usually has). Users with other layouts override
`Trainer.blocks(model)`.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy

from memtrain.errors import Unsupported
from memtrain.memory.footprint import ModelShape, ParamInfo


def discover_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: `_no_split_modules` classes, else the largest uniform ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return _outermost(blocks)
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(child) for child in module}) == 1:
                best = list(module)
    return best


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """`blocks` without those inside another of them: some families name a block's own sub-module in
    `_no_split_modules` too (Mamba: MambaBlock and its MambaMixer), which would count each layer twice (the
    planner would scale the clone by twice the depth; checkpointing would wrap both)."""
    inner = {id(m) for block in blocks for m in block.modules() if m is not block}
    return [block for block in blocks if id(block) not in inner]


def model_shape(model: nn.Module, blocks: list[nn.Module]) -> ModelShape:
    """Every parameter tensor's size, block index and whether it trains (shared tensors, e.g. tied embeddings, once).
    Works on a meta-device model, so a 70B shape costs no memory. A lazy module (`nn.LazyLinear`) has no
    shape until a forward runs: nothing to plan, shard or optimise, so it is refused by name."""
    lazy = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    if lazy:
        raise Unsupported(
            f"the model has uninitialised (lazy) parameters or buffers ({', '.join(lazy[:3])}): memtrain "
            "plans, shards and optimises them before any forward; give each lazy module its input size "
            "(e.g. nn.Linear instead of nn.LazyLinear) in build_model()"
        )
    owner: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), index)
    params = tuple(
        ParamInfo(name, p.numel(), owner.get(id(p)), p.requires_grad, tuple(p.shape))
        for name, p in model.named_parameters()
    )
    return ModelShape(params=params, num_blocks=len(blocks))


def output_head(model: nn.Module) -> str | None:
    """The name of the output layer (a transformers model's `get_output_embeddings()`), which adapters and
    base quantisation leave as it is, as transformers and peft do; None for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((name for name, module in model.named_modules() if head is not None and module is head), None)
