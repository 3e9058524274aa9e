"""`deepspeed.runtime.sequence_parallel`: ALST's Ulysses sequence parallelism and tiled
compute (ulysses_sp), and the sequence-parallel groups' `mpu` (parallel_state_sp). The
code lives in zero3/sequence/ and zero3/platform/sequence_groups.py."""
