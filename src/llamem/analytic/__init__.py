"""The analytic engine: closed-form bytes per category and per phase, no torch, microseconds.

Each phase's breakdown is the memory at that phase's worst moment; the report's peak is the
worst phase. The formulas and their derivation are in docs/memory-model.md; each module here
says what it covers and what it leaves out.
"""

from __future__ import annotations

from llamem.analytic.engine import estimate

__all__ = ["estimate"]
