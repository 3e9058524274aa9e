"""The engine's parts above the core, built and wired by `build.py` for `zero3/engine.py`.

- `build.py`: construction (its error classes in `errors.py`), in order: device, shards, units, optimizer, reducer, fetcher;
- `engine_parts/views.py`: typed, read-only views of the engine's collaborators (`ShardedModel`,
  `OptimizerAccess`, `ShardedTraining`) that checkpoints, exports, gathering and
  generation take instead of the engine;
- `owner.py`: what a holder of one managed parameter reaches of its engine;
- `engine_parts/gathered.py`: `GatheredParameters` (it writes a modification back into the fp32
  masters, so it sits above the optimizer, not in params);
- `engine_parts/generation.py`: every parameter gathered once for `generate()`;
- `engine_parts/counters.py`, `engine_parts/timers.py`, `engine_parts/diagnostics.py`: progress counters, step timers, logging;
- `engine_parts/rank_agreement.py`: ranks whose config, optimizer or model differ are stopped at
  initialize;
- `engine_parts/deepspeed_adopt.py`: a model partitioned by DeepSpeed's own `zero.Init` taken
  over at initialize (gathered through DeepSpeed, sharded as zero3.Init's), or refused on
  every rank with what to change.

May import: the core (`zero3.platform`, `params`, `grads`, `optim`), `zero3.config` and `zero3.placement`.
Must not import checkpoint, compat, hf, the engine or the command line.
"""
