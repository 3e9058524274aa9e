"""The engine's parts above the core, built and wired by `build.py` for `zero3/engine.py`.

- `build.py`: construction, in order: device, shards, units, optimizer, reducer, fetcher;
- `engine_parts/views.py`: typed, read-only views of the engine's collaborators (`ShardedModel`,
  `OptimizerAccess`, `ShardedTraining`) that checkpoints, exports, gathering and
  generation take instead of the engine;
- `owner.py`: what a holder of one managed parameter reaches of its engine;
- `engine_parts/gathered.py`: `GatheredParameters` (it writes a modification back into the fp32
  masters, so it sits above the optimizer, not in params);
- `engine_parts/generation.py`: every parameter gathered once for `generate()`;
- `engine_parts/counters.py`, `engine_parts/timers.py`, `engine_parts/diagnostics.py`: progress counters, step timers, logging;
- `engine_parts/rank_agreement.py`: ranks whose config, optimizer or model differ are stopped at
  initialize.

May import: the core (`zero3.platform`, `params`, `grads`, `optim`), `zero3.config` and `zero3.placement`.
Must not import checkpoint, compat, hf, the engine or the command line.
"""
