"""Reading the files a run leaves behind (OOM dumps, monitor logs), every field checked: a bad
value is a DumpError naming the file, the field, what was expected and the fix."""

from __future__ import annotations

import json
from pathlib import Path

from llamem.errors import LlamemError
from llamem.units import MAX_SIZE_BYTES, MiB

MAX_RECORD_BYTES = 64 * MiB
MAX_COUNT = 2**62


class DumpError(LlamemError):
    """An OOM dump folder, or a monitor log, that cannot be read: says which file, field and fix."""


def kind_of(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def shown(value) -> str:
    text = repr(value)
    return f"{text[:40]}... ({kind_of(value)})" if len(text) > 40 else f"{text} ({kind_of(value)})"


def checked_int(value, where: str, *, maximum: int = MAX_SIZE_BYTES, optional: bool = False,
                what: str = "a byte count") -> int | None:
    if value is None and optional:
        return None
    # bool is an int subclass: true as a size is a mistake, not 1 byte.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise DumpError(f"{where} must be {what} from 0 to {maximum:,}, got {shown(value)}")
    return value


def checked_str(value, where: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise DumpError(f"{where} must be a string, got {shown(value)}")
    return value


def checked_dict(value, where: str, *, optional: bool = False) -> dict | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise DumpError(f"{where} must be an object, got {shown(value)}")
    return value


def read_json(path: Path, what: str) -> dict:
    from llamem.files import read_limited

    raw = read_limited(path, MAX_RECORD_BYTES, what, DumpError)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError too
        raise DumpError(f"{path}: not valid JSON ({err}); the file may be truncated: write the dump again") from None
    return checked_dict(data, f"{path}: the top level")
