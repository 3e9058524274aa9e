"""Tags and the `latest` pointer: a tag always names a folder directly inside its directory.

A tag comes from an argument (`tag=`, `--tag`) or from the text of a pointer file
(`latest`, DeepSpeed's `latest_universal`). Either way it must be a plain folder name:
not empty, not absolute, no path separator, not `.` or `..`, no NUL or newline. Anything
else is refused with `CheckpointPathError` naming where the value came from and the
value, so a damaged or hostile `latest` can never make a load read (or the CLI verify or
export) a checkpoint outside the directory. A pointer that exists but is not a regular
file (a directory) is an error too, never a silent "no checkpoint".
"""

from __future__ import annotations

from pathlib import Path

from zero3.checkpoint.errors import CheckpointPathError

_FORBIDDEN = ("/", "\\", "\x00", "\n", "\r")


def tag_problem(tag: str) -> str | None:
    """Why `tag` is not a plain folder name, or None if it is one."""
    if not tag:
        return "it is empty"
    if Path(tag).is_absolute() or tag.startswith(("/", "\\")):
        return "it is an absolute path"
    if any(c in tag for c in _FORBIDDEN):
        return "it holds a path separator or a control character"
    if tag in (".", ".."):
        return "it names the directory itself or its parent"
    return None


def checked_tag(tag: object, source: str) -> str:
    """`tag` as a folder name inside the directory; CheckpointPathError naming `source` otherwise."""
    text = str(tag)
    problem = tag_problem(text)
    if problem is not None:
        raise CheckpointPathError(
            f"{source} gives checkpoint tag {text!r}, which is not a folder directly inside the checkpoint "
            f"directory ({problem}); a tag must be a plain folder name such as 'global_step100'. Fix or "
            "remove it, or pass the tag of a checkpoint in the directory"
        )
    return text


def read_pointer(path: Path) -> str | None:
    """The checked tag a pointer file (`latest`) names; None if there is no such file."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():
        raise CheckpointPathError(
            f"{path} is not a regular file (a directory or a dangling link); it should hold the tag of the "
            "newest checkpoint. Remove it (and pass tag=) rather than start from scratch silently"
        )
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointPathError(f"{path} cannot be read as text ({exc}); fix or remove it") from exc
    return checked_tag(text, str(path))
