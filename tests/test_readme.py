"""Every `llamem` command the README shows with its output prints that output today."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from llamem.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"


def shown_runs() -> list[tuple[str, str]]:
    """(command, the output printed under it) for each console block line `$ llamem ...` or
    `.venv/bin/llamem ...` that has output lines under it."""
    runs = []
    for block in re.findall(r"```console\n(.*?)```", README.read_text(), flags=re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            command = re.sub(r"^(\$ |\.venv/bin/)", "", line)
            if not command.startswith("llamem ") or "[" in command or "MODEL" in command:
                continue  # the usage lines: placeholders, not runs
            output = []
            for following in lines[i + 1:]:
                if following.startswith(("$ ", ".venv/bin/")):
                    break
                output.append(following)
            if output:
                runs.append((command, "\n".join(output)))
    return runs


def test_the_readme_shows_runs():
    assert len(shown_runs()) >= 3


@pytest.mark.parametrize("command,expected", shown_runs(), ids=[c for c, _ in shown_runs()])
def test_readme_output_is_current(command, expected):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(shlex.split(command)[1:])
    assert out.getvalue().rstrip("\n") == expected, f"README shows stale output for `{command}`"
