"""The errors of checkpoint saving, loading and checking (shared by the format readers and the CLI)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, damaged, or does not fit the model."""


class CheckpointPathError(CheckpointError):
    """A tag (from `latest` or an argument) does not name a folder directly inside the directory."""


class ManifestError(CheckpointError):
    """A manifest's fields have the wrong types or values (the manifest is corrupt)."""


class CheckpointArrivalError(CheckpointError):
    """A checkpoint collective was entered by only some ranks within the arrival timeout."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint file failed (a full disk, a read-only folder); names the file."""


class CheckpointTagMismatchError(CheckpointError, AssertionError):
    """Ranks passed different tags under checkpoint.tag_validation "Fail" (an AssertionError,
    as DeepSpeed's tag check raises)."""
