"""Long sequences: Ulysses sequence parallelism and DeepSpeed ALST's tiled compute.

- `all_to_all.py`: the differentiable all-to-all that trades sequence slices for heads;
- `ulysses.py`: `UlyssesSPAttentionHF` and `register_with_transformers` (HF attention);
- `loader.py`: `UlyssesSPDataLoaderAdapter` (batches cut along the sequence);
- `loss.py`: the loss of the whole sequence from the slices' losses, weighted by tokens;
- `tiled.py`: `TiledMLP`, `SequenceTiledCompute`, `TiledFusedLogitsLoss`, each giving the
  engine one whole gradient per parameter after the last tile;
- `host_checkpoint.py`: decoder layers checkpointed with their input in pinned host memory;
- `long_context.py`: the config's `long_sequence` section applied to an HF causal LM.

The sequence-parallel groups are platform/sequence_groups.py's; DeepSpeed's import paths
are zero3/runtime/sequence_parallel/.
"""
