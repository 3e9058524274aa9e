"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: DeepSpeed ALST's classes at DeepSpeed's
path (the code is zero3/sequence/)."""

from zero3.sequence.loader import UlyssesSPDataLoaderAdapter
from zero3.sequence.loss import sequence_parallel_loss
from zero3.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from zero3.sequence.ulysses import UlyssesSPAttentionHF, unregister_from_transformers

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "SequenceTiledCompute", "sequence_tiled_compute",
           "TiledMLP", "TiledFusedLogitsLoss", "sequence_parallel_loss", "unregister_from_transformers"]
