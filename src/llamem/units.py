"""Byte units. llamem keeps integer bytes inside and converts only here and in reporters.

GiB (2**30) is what memory is printed in; GB (10**9) is only for a vendor's card size.
"""

from __future__ import annotations

import re
from decimal import Decimal

from llamem.errors import LlamemError

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12

_UNITS = {
    "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
}
MAX_SIZE_BYTES = 2**50
"""Sizes beyond 1 PiB are refused: no card or host has that much, and the arithmetic stays exact."""
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, flag: str = "size") -> int:
    """'22GiB' -> 23622320128. A unit is required: a bare number is refused, since '22' could mean
    bytes or gigabytes. Single letters K/M/G/T mean binary units, as PyTorch's allocator reads them."""
    match = _SIZE_RE.match(str(text))
    if match and not match.group(2):
        raise LlamemError(f"{flag} {text!r} has no unit: write {match.group(1)}GiB (2^30 bytes) or "
                          f"{match.group(1)}GB (10^9 bytes); B, KiB, MiB, TiB, KB, MB and TB work too")
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise LlamemError(
            f"cannot read {flag} {text!r}: write a number and a unit, for example 22GiB, 80GB or 512MiB"
        )
    num_bytes = int(Decimal(match.group(1)) * _UNITS[unit])
    if num_bytes <= 0:
        raise LlamemError(f"{flag} {text!r} must be larger than zero")
    if num_bytes > MAX_SIZE_BYTES:
        raise LlamemError(f"{flag} {text!r} is more than 1 PiB: give the memory of one card or host, such as 80GB")
    return num_bytes


def to_gib(num_bytes: int) -> float:
    return num_bytes / GiB


def to_gb(num_bytes: int) -> float:
    return num_bytes / GB


def format_gib(num_bytes: int, digits: int = 2) -> str:
    return f"{num_bytes / GiB:.{digits}f} GiB"


def display_unit(largest_bytes: int) -> tuple[str, int]:
    """The unit a report prints all its sizes in: GiB from 1 GiB up, MiB below (a tiny model's
    figures would all read 0.00 GiB)."""
    return ("GiB", GiB) if largest_bytes >= GiB else ("MiB", MiB)


def format_in(num_bytes: int, unit: tuple[str, int], digits: int = 2) -> str:
    return f"{num_bytes / unit[1]:.{digits}f} {unit[0]}"


def format_count(count: int) -> str:
    """1_235_814_400 -> '1.24 B'; 12_345_678 -> '12.35 M' (parameter counts, decimal as people say them)."""
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.2f} {suffix}"
    return str(count)


def format_bytes(num_bytes: int) -> str:
    """Human-readable size in binary units, for small quantities too."""
    size = abs(num_bytes)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"
