"""The manifest's schema: the type and range of every field load, verify and export read.

A manifest whose checksum matches can still be wrong (written by another tool, or edited
and resealed): `world_size: "2"` or `0`, an unknown dtype, a negative size, a file name
with a path in it. `manifest_problems` lists every such field by its path in the JSON,
with the value found and what is expected, so that `read_manifest` refuses the manifest
by name (ManifestError) before anything indexes into it.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from zero3.checkpoint.paths import tag_problem

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
OPTIMIZER_STATE_KINDS = ("elementwise", "whole")


def known_dtype(name: Any) -> bool:
    """Whether `name` is a torch dtype's name (e.g. "float32", "bfloat16")."""
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _show(value: Any) -> str:
    return f"{value!r} (a {type(value).__name__})"


class _Checker:
    """Collects problems as "<field path>: <value> (<type>), expected <what>"."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def expect(self, ok: bool, where: str, value: Any, what: str) -> bool:
        if not ok:
            self.problems.append(f"{where} is {_show(value)}, expected {what}")
        return ok

    def integer(self, obj: dict, key: str, where: str, minimum: int = 0) -> bool:
        return self.expect(_is_int(obj.get(key), minimum), f"{where}{key}", obj.get(key), f"an integer >= {minimum}")

    def boolean(self, obj: dict, key: str, where: str) -> None:
        self.expect(isinstance(obj.get(key), bool), f"{where}{key}", obj.get(key), "true or false")

    def dtype(self, obj: dict, key: str, where: str) -> None:
        self.expect(known_dtype(obj.get(key)), f"{where}{key}", obj.get(key), "a torch dtype name such as 'float32'")

    def shape(self, obj: dict, where: str) -> bool:
        value = obj.get("shape")
        return self.expect(isinstance(value, list) and all(_is_int(d) for d in value), f"{where}shape", value,
                           "a list of integers >= 0")

    def mapping(self, obj: dict, key: str, where: str = "") -> dict:
        value = obj.get(key)
        return value if self.expect(isinstance(value, dict), f"{where}{key}", value, "an object") else {}


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """Every field of `manifest` with a wrong type or value; [] when the schema holds."""
    check = _Checker()
    has_world = check.integer(manifest, "world_size", "", minimum=1)
    check.integer(manifest, "global_steps", "")
    if "micro_steps" in manifest:
        check.integer(manifest, "micro_steps", "")
    check.dtype(manifest, "compute_dtype", "")
    check.expect(isinstance(manifest.get("tag"), str), "tag", manifest.get("tag"), "a string")
    created = manifest.get("created_unix")
    check.expect(isinstance(created, (int, float)) and not isinstance(created, bool) and math.isfinite(created),
                 "created_unix", created, "a number")
    if "exclude_frozen_parameters" in manifest:
        check.boolean(manifest, "exclude_frozen_parameters", "")
    _check_files(check, check.mapping(manifest, "files"))
    world = manifest["world_size"] if has_world else None
    for name, entry in check.mapping(manifest, "params").items():
        _check_param(check, name, entry, world)
    for name, entry in check.mapping(manifest, "buffers").items():
        if check.expect(isinstance(entry, dict), f"buffers[{name!r}]", entry, "an object"):
            check.shape(entry, f"buffers[{name!r}].")
            check.dtype(entry, "dtype", f"buffers[{name!r}].")
    aliases = manifest.get("aliases", {})
    check.expect(isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values()), "aliases",
                 aliases, "an object of names")
    return check.problems


def _check_files(check: _Checker, files: dict) -> None:
    for name, entry in files.items():
        where = f"files[{name!r}]"
        check.expect(tag_problem(name) is None, where, name, "a plain file name inside the tag folder")
        if check.expect(isinstance(entry, dict), where, entry, "an object with size and sha256"):
            check.integer(entry, "size", where + ".")
            check.expect(isinstance(entry.get("sha256"), str) and bool(_SHA256.match(entry["sha256"])),
                         where + ".sha256", entry.get("sha256"), "64 lowercase hex digits")


def _check_param(check: _Checker, name: str, entry: Any, world: int | None) -> None:
    where = f"params[{name!r}]."
    if not check.expect(isinstance(entry, dict), where[:-1], entry, "an object"):
        return
    check.dtype(entry, "dtype", where)
    shape_ok = check.shape(entry, where)
    if check.integer(entry, "numel", where) and shape_ok:
        check.expect(entry["numel"] == math.prod(entry["shape"]), where + "numel", entry["numel"],
                     f"the product of its shape {entry['shape']}")
    if check.integer(entry, "shard_numel", where) and world is not None and _is_int(entry.get("numel")):
        wanted = math.ceil(entry["numel"] / world) if entry["numel"] else 0
        check.expect(entry["shard_numel"] == wanted, where + "shard_numel", entry["shard_numel"],
                     f"ceil(numel / world_size) = {wanted}")
    for flag in ("trainable", "persistent", "master"):
        check.boolean(entry, flag, where)
    if "grad" in entry:
        check.boolean(entry, "grad", where)
    optim = check.mapping(entry, "optim", where)
    for key, kind in optim.items():
        check.expect(kind in OPTIMIZER_STATE_KINDS, f"{where}optim[{key!r}]", kind, "'elementwise' or 'whole'")
