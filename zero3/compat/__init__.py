"""DeepSpeed's API where it needs more than a re-export.

- `compat/engine_surface.py`: the engine's DeepSpeed face (a mixin of `Engine`): module
  pass-through, whole-model state dicts, config and optimizer queries;
- `compat/param_status.py`: `param.ds_status` / `ds_shape` / `ds_numel` and `ZeroParamStatus`;
- `compat/param_access.py`: DeepSpeed's tensor-fragment API (`safe_get_full_*`, `safe_set_*`).

DeepSpeed's own module paths (`zero3.utils`, `zero3.runtime`, `zero3.ops`, `zero3.zero`,
`zero3.comm`, `zero3.accelerator`) are thin re-exports of these and of the core.

May import: anything below the engine (core, engine_parts, checkpoint). Must not import
the engine, hf or the command line.
"""
