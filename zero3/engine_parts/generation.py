"""Generation with the weights gathered once, then back to sharded training.

    with zero3.gathered_for_generation(engine) as model:
        tokens = model.generate(**prompt)          # no collective per token
    engine(batch) ...                               # training goes on, sharded

Sharded generation (`engine.module.generate(..., synced_gpus=True)`) gathers every layer
for every new token and needs every rank to run the same number of steps. Inside this
context every parameter is gathered once, unit by unit (so the gather itself needs no
buffer of the whole model), and held: the module's forward then issues no collective at
all, so ranks may generate different numbers of tokens and stop at their own
end-of-sequence.

Entering and leaving are collectives (every rank must enter). Memory: the whole model in
the compute dtype on each rank's device for the duration of the context; the shards,
gradient shards and optimizer state are untouched, so a gradient-accumulation window may
be open across it. The values must not be changed inside (they would be lost on exit);
edit parameters with `GatheredParameters(params, modifier_rank=...)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

from torch import nn

from zero3.engine_parts.views import ShardedModel
from zero3.params.fetch import Fetcher
from zero3.params.fetch_unit import FetchUnit
from zero3.params.released import refuse_released


class GenerationError(RuntimeError):
    """gathered_for_generation was entered at a time it cannot be."""


class GenerationSource(Protocol):
    """What `gathered_for_generation` reads of the engine it is given."""

    @property
    def sharded_model(self) -> ShardedModel: ...

    @property
    def fetcher(self) -> Fetcher: ...

    @property
    def units(self) -> Sequence[FetchUnit]: ...


@contextlib.contextmanager
def gathered_for_generation(engine: GenerationSource, eval_mode: bool = True) -> Iterator[nn.Module]:
    """The engine's module with every parameter gathered and held, in eval mode by default."""
    with gathered_model(engine.sharded_model, engine.fetcher, engine.units, eval_mode) as module:
        yield module


@contextlib.contextmanager
def gathered_model(model: ShardedModel, fetcher: Fetcher, units: Sequence[FetchUnit],
                   eval_mode: bool = True) -> Iterator[nn.Module]:
    """`model.module` with the parameters of every unit of `units` gathered through
    `fetcher` and held until exit; in eval mode by default (its mode restored on exit).
    The holds are the context's own: each is dropped on exit, whatever happened inside.
    A collective on entry and exit."""
    if fetcher.model_running():
        raise GenerationError("gathered_for_generation was entered inside the model's forward or "
                              "backward; enter it between training steps")
    fetcher.drop_spares()  # no prefetched or reused gathers left: each unit is gathered once below
    held = []
    for unit in units:
        fetcher.acquire(unit.params)
        held.append(unit.params)
    for sp in model.table.values():
        refuse_released(sp.param, "gathered_for_generation", sp.name,
                        fix="something outside zero3 freed or replaced its storage; leave a managed "
                        "parameter's storage and `.data` to zero3")
    module = model.module
    was_training = module.training
    module.train(not eval_mode and was_training)
    fetcher.tracking = False
    try:
        yield module
    finally:
        fetcher.tracking = True
        module.train(was_training)
        for params in held:
            fetcher.drop(params)
