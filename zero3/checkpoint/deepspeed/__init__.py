"""DeepSpeed 0.19's ZeRO-3 checkpoints, read without DeepSpeed and without running its pickles.

- `unpickle.py`: restricted loading (three DeepSpeed classes mapped to inert records,
  anything else refused by name);
- `layout.py`: the folder's layout, validated, and each parameter's fp32 master and
  optimizer state rebuilt from the flat partitions;
- `importer.py`: conversion into a zero3 checkpoint (`zero3 checkpoint import-deepspeed`);
- `exporter.py`: a zero3 checkpoint written in DeepSpeed's layout for N ranks
  (`zero3 checkpoint export-deepspeed`), `pickling.py` writing DeepSpeed's three objects
  by their class names without importing DeepSpeed;
- `trainer_folder.py`: a Hugging Face Trainer `checkpoint-N` exported whole (the Trainer's
  files carried beside DeepSpeed's), which the Trainer with `deepspeed=` resumes.

May import: the checkpoint format modules (errors, paths, manifest, files, format).
Must not import the engine, its parts, the core's runtime modules, compat, hf or the
command line.
"""
