"""The optimizer step over shards.

- `masters.py`: the fp32 master shards, global-norm clipping across ranks, sub-groups,
  and the client optimizer run over the shards;
- `optim/host_step.py`: the CPU update of an offloaded optimizer, run behind the next forward;
- `state_probe.py`: the optimizer state a first step will create, foreseen before it (the
  asynchronous-save buffer is sized at initialize from it);
- `loss_scaler.py`: fp16 dynamic loss scaling, overflow agreed across ranks;
- `optim/optimizers.py` and `optim/lr_schedules.py`: the config's `optimizer` and `scheduler`
  sections (DeepSpeed's schedulers, curve for curve).

May import: `zero3.platform`, `zero3.params`, `zero3.grads`, `zero3.config`. Must not
import engine_parts, checkpoint, compat, hf, the engine or the command line.
"""
