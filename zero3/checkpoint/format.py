"""The zero3 checkpoint format, read-only: names, manifest, verification, tags, shard reader.

Shared by the engine's load (checkpoint/save_load.py), the `zero3 checkpoint` command (cli.py), the
offline export and the DeepSpeed import. Nothing here writes a file or needs a process
group; everything that reads a pickled part does so with `weights_only=True`.

A checkpoint tag folder holds, for a save on W ranks: `rank{r:05d}-of-{W:05d}.safetensors`
(each rank's parameter, master, gradient and optimizer-state shards), `rank...state.pt`
(its RNG state and scalar optimizer state), `common.pt` (what every rank shares: counters,
scheduler, loss scaler, client state), optionally `pytorch_model.safetensors` (the 16-bit
model), and `manifest.json`, written last: the commit marker, with every file's size and
sha256 and the layout of every tensor, sealed by a digest of its own body. `latest`
beside the tags names the newest committed tag.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zero3.checkpoint.errors import CheckpointError, ManifestError
from zero3.checkpoint.manifest import manifest_problems
from zero3.checkpoint.paths import checked_tag, read_pointer
from zero3.params.shard_layout import owned_range, shard_numel_for

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMON = "common.pt"
LATEST = "latest"
MODEL_16BIT = "pytorch_model.safetensors"
OWN_FILE = re.compile(
    r"^(rank\d{5}-of-\d{5}\.(safetensors|state\.pt)|" + re.escape(COMMON) + "|"
    + re.escape(MODEL_16BIT) + "|" + re.escape(MANIFEST) + r")(\.tmp)?$"
)


# ---------------------------------------------------------------------- names
def shard_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def state_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.state.pt"


def expected_files(world: int) -> list[str]:
    """The files every checkpoint of `world` ranks has (the 16-bit model is optional)."""
    names = [COMMON]
    for rank in range(world):
        names += [shard_file(rank, world), state_file(rank, world)]
    return names


def file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def unpickle_file(path: Path) -> Any:
    """torch.load with weights_only=True: tensors and plain containers, never code."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - named and re-raised
        raise CheckpointError(
            f"{path}: refused to load ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "only tensors and plain values are loaded (weights_only=True), never code"
        ) from exc


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with `checksum`: the sha256 of its canonical JSON without that key."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return {**body, "checksum": _body_digest(body)}


# ------------------------------------------------------------ reading a folder
def read_manifest(folder: Path) -> dict[str, Any]:
    """The verified manifest of `folder`; CheckpointError if absent, damaged or foreign."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {folder} is incomplete: it has no {MANIFEST} (the save did not finish, "
            "or was interrupted). Load an earlier tag, or save again"
        )
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "zero3":
        raise CheckpointError(f"{path} is not a zero3 manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {manifest.get('format_version')!r}; this zero3 reads version "
            f"{FORMAT_VERSION}"
        )
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    if manifest.get("checksum") != _body_digest(body):
        raise CheckpointError(f"{path}: its checksum does not match its contents (the manifest is corrupted)")
    problems = manifest_problems(manifest)
    if problems:
        raise ManifestError(f"{path} is corrupt ({len(problems)} field(s) of the wrong type or value); nothing "
                            "was read from the checkpoint:\n  " + "\n  ".join(problems))
    unlisted = [name for name in expected_files(manifest["world_size"]) if name not in manifest["files"]]
    if unlisted:
        raise CheckpointError(f"{path} does not list {unlisted}; the manifest is damaged")
    return manifest


def verify_files(folder: Path, manifest: dict[str, Any], share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems with the files of a checkpoint, each naming its file.

    `share` = (rank, world): presence and size of every file are checked by every rank,
    checksums and safetensors headers by this rank's share of the files only; rank 0
    also looks for extra entries. The union over ranks is the full check.
    """
    folder = Path(folder)
    rank, world = share
    problems: list[str] = []
    listed = manifest["files"]
    if rank == 0:
        present = {p.name for p in folder.iterdir()} - {MANIFEST}
        for extra in sorted(present - set(listed)):
            problems.append(f"{folder / extra}: extra file not listed in the manifest")
    for index, (name, expected) in enumerate(sorted(listed.items())):
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            problems.append(f"{path}: size {size} bytes, manifest says {expected['size']} (truncated or overwritten)")
            continue
        if index % world != rank:
            continue
        if file_digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (the file is corrupted)")
        elif name.endswith(".safetensors") and name != MODEL_16BIT:
            problems += _header_problems(path, manifest)
    return problems


def _header_problems(path: Path, manifest: dict[str, Any]) -> list[str]:
    """A shard file's tensors against the layout: names, lengths (the writer's invariants)."""
    match = re.match(r"rank(\d{5})-of-(\d{5})", path.name)
    if match is None:
        return [f"{path}: not a zero3 shard file name"]
    rank, world = int(match.group(1)), int(match.group(2))
    problems = []
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - named
        return [f"{path}: unreadable safetensors ({exc})"]
    for name, entry in manifest["params"].items():
        start, end = owned_range(entry["numel"], shard_numel_for(entry["numel"], world), rank)
        wanted = {f"param/{name}": (end - start,)}
        if entry.get("master"):
            wanted[f"master/{name}"] = (end - start,)
        if entry.get("grad"):
            wanted[f"grad/{name}"] = (end - start,)
        for key, kind in entry.get("optim", {}).items():
            if kind == "elementwise":
                wanted[f"optim/{name}/{key}"] = (end - start,)
            elif f"optim_whole/{name}/{key}" not in shapes:
                problems.append(f"{path}: no tensor optim_whole/{name}/{key}")
        for key, shape in wanted.items():
            if shapes.get(key) != shape:
                problems.append(f"{path}: tensor {key} has shape {shapes.get(key)}, layout says {shape}")
    if rank == 0:
        for name, entry in manifest.get("buffers", {}).items():
            if shapes.get(f"buffer/{name}") != tuple(entry["shape"]):
                problems.append(f"{path}: buffer {name} has shape {shapes.get(f'buffer/{name}')}, "
                                f"layout says {tuple(entry['shape'])}")
    return problems


def verify_checkpoint(folder: Path) -> list[str]:
    """Every problem of one tag folder (manifest, files, checksums, headers), one process."""
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return [str(exc)]
    problems = verify_files(folder, manifest)
    return problems or _pickle_problems(Path(folder), manifest)


def _pickle_problems(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """What load's unpickling would refuse: every listed `.pt` file is read as load reads
    it (weights_only: tensors and plain values, never code) and must hold a dict."""
    problems = []
    for name in sorted(n for n in manifest["files"] if n.endswith(".pt")):
        try:
            value = unpickle_file(folder / name)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if not isinstance(value, dict):
            problems.append(f"{folder / name}: holds a {type(value).__name__}, expected a dict of saved state")
    return problems


@dataclass
class TagInfo:
    """One tag folder of a save_dir, as `zero3 checkpoint inspect` shows it."""

    tag: str
    folder: Path
    complete: bool
    problem: str | None = None
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    size_bytes: int = 0
    files: int = 0


def looks_like_checkpoint(folder: Path) -> bool:
    return folder.is_dir() and any(OWN_FILE.match(p.name) for p in folder.iterdir())


def tag_info(folder: Path) -> TagInfo:
    """Committed (a readable, sealed manifest) or not, and why not; sizes on disk."""
    entries = [p for p in folder.iterdir() if p.is_file()]
    info = TagInfo(folder.name, folder, False, size_bytes=sum(p.stat().st_size for p in entries),
                   files=len(entries))
    try:
        info.manifest = read_manifest(folder)
        info.complete = True
    except CheckpointError as exc:
        info.problem = str(exc)
    return info


def list_tags(root: Path) -> list[TagInfo]:
    """Every checkpoint-looking folder under `root`, oldest first (committed ones by step)."""
    root = Path(root)
    infos = [tag_info(p) for p in sorted(root.iterdir())
             if not p.name.startswith(".") and looks_like_checkpoint(p)] if root.is_dir() else []
    return sorted(infos, key=_age)


def _age(info: TagInfo) -> tuple:
    if info.manifest is None:
        return (1, 0, 0.0, info.tag)
    return (0, info.manifest["global_steps"], info.manifest["created_unix"], info.tag)


def read_latest(root: Path) -> str | None:
    """The tag `root/latest` names (checked: a folder directly inside `root`), None if no file."""
    return read_pointer(Path(root) / LATEST)


def resolve_tag(root: Path, tag) -> tuple[str | None, str | None]:
    """(tag to load or None, warning or None), by the rules in the module docstring."""
    root = Path(root)
    if tag is not None:
        tag = checked_tag(tag, "the tag argument")
        if not (root / tag).is_dir():
            return None, f"zero3: checkpoint tag {str(tag)!r} not found in {root}; nothing was loaded"
        return str(tag), None
    named = read_latest(root)
    if named is None:
        return None, (f"zero3: no checkpoint to load in {root}: it has no '{LATEST}' file; pass tag= "
                      "to load a specific one. Nothing was loaded")
    folder = root / named
    if (folder / MANIFEST).is_file():
        return named, None
    committed = [info for info in list_tags(root) if info.complete]
    why = "has no folder" if not folder.is_dir() else f"has no {MANIFEST} (its save was interrupted)"
    why += _hidden_saves_note(root, named)
    if not committed:
        raise CheckpointError(
            f"{root / LATEST} names tag {named!r}, which {why}, and {root} holds no other complete "
            "checkpoint; refusing to start from scratch silently. Pass tag= or remove the directory"
        )
    chosen = committed[-1]
    return chosen.tag, (
        f"zero3: {root / LATEST} names tag {named!r}, which {why}; loading the newest complete "
        f"checkpoint instead: {chosen.tag!r} (global step {chosen.manifest['global_steps']})"
    )


def _hidden_saves_note(root: Path, tag: str) -> str:
    """Where complete saves of `tag` wait in hidden folders after a crash while one folder
    replaced the other (checkpoint/folder_swap.py, on file systems without an atomic exchange)."""
    hidden = [root / f".{tag}.{kind}" for kind in ("incoming", "replaced")]
    complete = [str(folder) for folder in hidden if (folder / MANIFEST).is_file()]
    if not complete:
        return ""
    return (f"; a save replacing it was interrupted between two renames, and {' and '.join(complete)} hold "
            f"complete saves of it (.incoming the newer): rename one to {tag!r} to load it")


# ----------------------------------------------------------------------- reader
class ShardReader:
    """Reads any element range of a saved tensor from the files of all source ranks.

    A context manager: the files are open (memory-mapped) only inside `with`.
    """

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.world = manifest["world_size"]
        self._stack = ExitStack()
        self.handles: list[Any] = []
        self.keys: list[set[str]] = []

    def __enter__(self) -> "ShardReader":
        try:
            for rank in range(self.world):
                handle = self._stack.enter_context(
                    safe_open(str(self.folder / shard_file(rank, self.world)), framework="pt"))
                self.handles.append(handle)
                self.keys.append(set(handle.keys()))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.handles.clear()
        self.keys.clear()
        self._stack.close()

    def read_range(self, key: str, numel: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `key` (numel elements in all)."""
        pieces = []
        for src in range(self.world):
            src_start, src_end = owned_range(numel, shard_numel_for(numel, self.world), src)
            lo, hi = max(start, src_start), min(end, src_end)
            if lo >= hi:
                continue
            pieces.append(self.handles[src].get_slice(key)[lo - src_start:hi - src_start])
        if not pieces:
            return self.handles[0].get_slice(key)[0:0]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def read_whole(self, key: str, rank: int = 0) -> torch.Tensor:
        """Tensor `key` as saved by source rank `rank` (not resharded)."""
        return self.handles[rank].get_tensor(key)

    def whole_shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor `key` in source rank 0's file, without reading it."""
        return tuple(self.handles[0].get_slice(key).get_shape())


# ------------------------------------------------------------ plain values
_PLAIN = (str, int, float, bool, type(None))


def plain_value_problem(value: Any, path: str = "client_state") -> str | None:
    """Where `value` holds something other than JSON-like values and tensors, or None.

    Allowed: None, bool, int, float, str, torch.Tensor, and list / tuple / dict of
    those (dict keys: str, int, float, bool or None) - what loads with weights_only=True.
    """
    if isinstance(value, torch.Tensor):
        return None if type(value) in (torch.Tensor, torch.nn.Parameter) else f"{path}: tensor subclass {type(value).__name__}"
    if type(value) in _PLAIN:
        return None
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            problem = plain_value_problem(item, f"{path}[{index}]")
            if problem:
                return problem
        return None
    if type(value) is dict:
        for key, item in value.items():
            if type(key) not in _PLAIN:
                return f"{path}: key {key!r} of type {type(key).__name__}"
            problem = plain_value_problem(item, f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    return f"{path}: {type(value).__module__}.{type(value).__qualname__}"
