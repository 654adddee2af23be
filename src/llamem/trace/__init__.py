"""Trace engine: runs the real transformers model code on fake tensors and counts every storage.

Imports torch; the core never imports this package.
"""

from llamem.trace.run import trace

__all__ = ["trace"]
