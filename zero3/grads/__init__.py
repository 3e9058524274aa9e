"""Gradients: from each parameter's full gradient to this rank's fp32 shard of it.

- `reduce.py`: gradients are bucketed as autograd produces them and reduce-scattered
  (averaged) into their shards; the full gradient is freed at once;
- `sink.py`: the shard gradients themselves, on the compute device or the host (offload);
- `usage.py`: which parameters no rank gave a gradient in a window, so the optimizer
  skips them as plain PyTorch skips a `.grad` of None.

May import: `zero3.platform`, `zero3.params`, `zero3.placement`. Must not import optim or anything above.
"""
