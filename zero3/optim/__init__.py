"""The optimizer step over shards.

- `masters.py`: the fp32 master shards, global-norm clipping across ranks, sub-groups,
  and the client optimizer run over the shards;
- `optim/host_step.py`: the CPU update of an offloaded optimizer, run behind the next forward;
- `write_back.py`: updated masters into the parameter shards (host masters into device shards
  from the worker, through pinned staging on a side stream);
- `state_moves.py`: a master and its optimizer state moved between device and host when the
  placement changes;
- `state_probe.py`: the optimizer state a first step will create, foreseen before it (the
  asynchronous-save buffer is sized at initialize from it);
- `loss_scaler.py`: fp16 dynamic loss scaling, overflow agreed across ranks;
- `optim/optimizers.py` and `optim/lr_schedules.py`: the config's `optimizer` and `scheduler`
  sections (DeepSpeed's schedulers, curve for curve).

May import: `zero3.platform`, `zero3.params`, `zero3.grads`, `zero3.config`, `zero3.placement`. Must not
import engine_parts, checkpoint, compat, hf, the engine or the command line.
"""
