"""Output files: checked before any work, so a bad path fails in a second, not after a long run."""

from __future__ import annotations

import os
from pathlib import Path

from llamem.errors import LlamemError


def check_writable(path: str | os.PathLike, flag: str) -> Path:
    """The path, if a file can be written there; else an error naming the flag and the fix."""
    if "\0" in str(path):
        raise LlamemError(f"{flag} {str(path)!r}: a path cannot hold a NUL character")
    try:
        return _check_writable(Path(path), flag)
    except OSError as err:  # a name too long for the file system, a loop of links, ...
        raise LlamemError(f"{flag} {path}: {err.strerror or err}; choose another path") from None


def _check_writable(target: Path, flag: str) -> Path:
    path = target
    if target.is_dir():
        raise LlamemError(f"{flag} {path}: is a folder; give a file name in it")
    parent = target.parent if str(target.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise LlamemError(f"{flag} {path}: {parent} is not a folder; choose another path")
    if not parent.is_dir():
        raise LlamemError(f"{flag} {path}: the folder {parent} does not exist; create it first")
    if target.exists() and not os.access(target, os.W_OK):
        raise LlamemError(f"{flag} {path}: exists and cannot be written by this user; choose another file")
    if not target.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise LlamemError(f"{flag} {path}: cannot create files in {parent} as this user; choose another folder")
    return target


def read_limited(path: Path, limit_bytes: int, what: str, error: type[LlamemError] = LlamemError) -> bytes:
    """A regular file's bytes, at most `limit_bytes` of them: a device like /dev/zero never ends, a
    folder or a pipe is not a file, and an unreadable one says why."""
    try:
        if "\0" in str(path):
            raise error(f"{path!r}: a path cannot hold a NUL character")
        if not path.exists():
            raise error(f"{path}: no such file")
        if not path.is_file():
            raise error(f"{path}: cannot be read as a file (a folder or a device); give the path of a file")
        with path.open("rb") as handle:
            raw = handle.read(limit_bytes + 1)
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(raw) > limit_bytes:
        raise error(f"{path}: larger than {limit_bytes} bytes, too large for a {what}")
    return raw
