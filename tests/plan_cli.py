"""What the plan tests share (test_plan_engine.py, test_bundle_plan.py): the host budget they plan with
and the command line run in-process."""

from __future__ import annotations

import contextlib
import io

from llamem.cli import main

HOST_BYTES = 256 * 2**30
"""Host memory the plans may offload into."""


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `llamem ARGV`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()
