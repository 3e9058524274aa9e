"""Where each piece of training state lives: the GPU (the compute device) or the host.

- `plan.py`: the planner. From each fetch unit's sizes, the config's offload sections and a
  byte budget, it decides per unit whether the parameter shards and the optimizer side
  (gradient shards, masters, optimizer state) live on the device or on the host; the plan
  is plain data, printed at initialize and by `zero3 estimate`.
- `budget.py`: the budget itself: the user's number, or the card's free memory less the
  activations (stated, or measured over the first accumulation window) and a margin.

The planner owns no tensors: the fetcher (parameter shards), the gradient sink (gradient
shards) and the sharded optimizer (masters and state) each ask the plan where their piece
of a parameter lives. It imports nothing of the engine: it works on sizes and names.

May import: `zero3.config`. Sits in the foundation layer, beside the config.
"""
