"""What the trace engine runs in reasonable time, checked before torch is even imported."""

from __future__ import annotations

from llamem.errors import InvalidWorkload
from llamem.workload import Workload

MAX_TRACED_NEW_TOKENS = 4096
"""The trace decodes token by token, a forward each (about 0.1 s for a small model on a CPU)."""


def check_traceable(w: Workload) -> None:
    if w.task == "infer" and w.new_tokens > MAX_TRACED_NEW_TOKENS:
        raise InvalidWorkload([f"--new-tokens {w.new_tokens}: llamem trace runs every decoding step, at most "
                               f"{MAX_TRACED_NEW_TOKENS}; `llamem estimate` sizes any number (the cache of the last "
                               "step is the largest)"])
    if w.teacher_placement == "sharded":
        raise InvalidWorkload(["--teacher-placement sharded: llamem trace runs one GPU, where the teacher is whole; "
                               "size the sharded teacher with `llamem estimate ... --gpus N`, or drop the flag"])
