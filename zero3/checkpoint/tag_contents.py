"""What a tag's folder holds before a save writes it, and what the save may replace.

A save of tag T replaces whatever checkpoint `save_dir/T` holds, as DeepSpeed and the
Hugging Face Trainer do: a checkpoint of the same name is the previous state of that
name. The common case is a rollback: a run resumed from `checkpoint-3` reaches step 6
again and saves `checkpoint-6/global_step6` over the checkpoint of the abandoned
trajectory, which may have been written by zero3 or by DeepSpeed. The new save is
written beside the folder and then put in its place whole (checkpoint/folder_swap.py),
so the previous checkpoint stays loadable until the new one is committed.

What a save refuses (nothing changed, on every rank): entries that are not checkpoint
files: a file of another name, a folder, a link. zero3 cannot tell that those are stale
(notes, an evaluation's output, a converted universal checkpoint someone still reads);
deleting them could lose data that is still in use, so the user moves them or picks
another tag. A checkpoint that `latest` names is not protected: the rollback above
overwrites exactly that (`checkpoint-6/latest` names `global_step6`), and the swap keeps
it loadable until its replacement is complete.

Checkpoint files are zero3's own (format.OWN_FILE) and DeepSpeed's per-rank state files
(`*model_states.pt`, `*optim_states.pt`, every ZeRO stage and parallel layout). Only
rank 0 calls these functions; they read names only, never file contents.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from zero3.checkpoint.errors import CheckpointError
from zero3.checkpoint.format import MANIFEST, OWN_FILE

DEEPSPEED_STATE_FILE = re.compile(r"^[A-Za-z0-9_.-]*(model|optim)_states\.pt$")
_NAMED_AT_MOST = 6


@dataclass(frozen=True)
class TagContents:
    """The entries of one tag folder by kind (names, sorted)."""

    own: list[str] = field(default_factory=list)
    deepspeed: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        """A complete zero3 checkpoint is there (its manifest, the commit marker)."""
        return MANIFEST in self.own

    @property
    def replaced_whole(self) -> bool:
        """The save must leave the folder loadable until it commits: write beside it, then swap."""
        return self.committed or bool(self.deepspeed)


def tag_contents(folder: Path) -> TagContents:
    """Classify the entries of `folder` (empty contents when it does not exist)."""
    if not folder.is_dir():
        return TagContents()
    own, deepspeed, unknown = [], [], []
    for path in sorted(folder.iterdir()):
        plain_file = path.is_file() and not path.is_symlink()
        if plain_file and OWN_FILE.match(path.name):
            own.append(path.name)
        elif plain_file and DEEPSPEED_STATE_FILE.match(path.name):
            deepspeed.append(path.name)
        else:
            unknown.append(path.name)
    return TagContents(own, deepspeed, unknown)


def refuse_unknown_entries(folder: Path, contents: TagContents) -> None:
    """CheckpointError naming the entries of `folder` that are no checkpoint's files."""
    if contents.unknown:
        raise CheckpointError(
            f"checkpoint folder {folder} holds entries zero3 did not write and that are no checkpoint's files: "
            f"{contents.unknown}; a save replaces a previous checkpoint of its tag (zero3's or DeepSpeed's) but "
            "never deletes other data: move them away or save under another tag (nothing was changed)")


def replacement_warning(folder: Path, contents: TagContents) -> str | None:
    """The one warning a save that overwrites another writer's checkpoint gives; None for
    zero3's own previous save of the tag (a rolling tag, replaced silently)."""
    if not contents.deepspeed:
        return None
    named = ", ".join(contents.deepspeed[:_NAMED_AT_MOST])
    more = f" and {len(contents.deepspeed) - _NAMED_AT_MOST} more" if len(contents.deepspeed) > _NAMED_AT_MOST else ""
    mixed = f", beside zero3 files {contents.own}" if contents.own else ""
    return (f"zero3: checkpoint folder {folder} held a DeepSpeed checkpoint of the same tag ({len(contents.deepspeed)} "
            f"files: {named}{more}{mixed}); this save replaces it whole, as DeepSpeed and the Trainer overwrite a "
            "checkpoint of the same name (e.g. after resuming from an older checkpoint). The previous files stay "
            "until the new checkpoint is committed, then are deleted")
