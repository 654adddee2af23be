"""Output files: checked before any work, so a bad path fails in a second, not after a long run."""

from __future__ import annotations

import os
from pathlib import Path

from llamem.errors import LlamemError


def check_writable(path: str | os.PathLike, flag: str) -> Path:
    """The path, if a file can be written there; else an error naming the flag and the fix."""
    target = Path(path)
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
