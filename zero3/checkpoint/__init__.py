"""Checkpoints: zero3's own format, the engine's save and load, exports, DeepSpeed's format.

The format, read and written without an engine (what the command line uses):
`errors.py`, `paths.py` (tags and `latest`), `manifest.py` (the manifest's schema),
`files.py` (durable safetensors writes), `checkpoint/folder_swap.py` (a tag's folder replaced whole),
`tag_contents.py` (what a tag's folder holds and what a save may replace),
`format.py` (manifest reading, verification, the shard reader), `checkpoint/offline_export.py`
(a consolidated state dict from shard files). `deepspeed/` reads DeepSpeed's ZeRO-3
checkpoints and converts them.

With an engine: `checkpoint/arrival.py` (every rank checks in before a save or load),
`save_load.py` (the commit protocol, resharding on load, DeepSpeed checkpoints resumed),
`checkpoint/export.py` (consolidated state dicts, streamed one parameter at a time).

May import: the core, `zero3.engine_parts` (views and counters; only the engine-side
modules above), `zero3.config`. The format modules import nothing of the engine, its
parts or the optimizer. Nothing here imports compat, hf, the engine or the command line.
"""

from zero3.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
