"""Golden outputs: the text and JSON that users read, pinned. `make golden` (or
`.venv/bin/python tests/golden_cases.py --regen`) rewrites them on purpose; `tests/test_golden.py`
fails on any difference, so a changed figure shows up in the diff of `tests/golden/`."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "golden"
TRACE_FILE = "debug-lora-trace.json"
"""Written by the `trace_debug_saved` case, read by the replay cases (relative to the working folder)."""

DEBUG_LORA = ["debug", "--task", "lora", "--batch", "2", "--seq", "256"]
LLAMA_LORA = ["llama-3.1-8b", "--task", "lora", "--batch", "2", "--seq", "4096"]
CASES: dict[str, list[str]] = {
    "estimate_debug.txt": ["estimate", *DEBUG_LORA],
    "estimate_debug.json": ["estimate", *DEBUG_LORA, "--json"],
    "estimate_8b.txt": ["estimate", *LLAMA_LORA],
    "estimate_8b.json": ["estimate", *LLAMA_LORA, "--json"],
    "estimate_8b_zero3.txt": ["estimate", "llama-3.1-8b", "--task", "train", "--gpus", "8", "--sharding", "zero3"],
    "plan_debug.txt": ["plan", "debug", "--budget", "480MiB", "--task", "train", "--batch", "8", "--seq", "1024",
                       "--host-memory", "64GiB"],
    "plan_debug.json": ["plan", "debug", "--budget", "480MiB", "--task", "train", "--batch", "8", "--seq", "1024",
                        "--host-memory", "64GiB", "--json"],
    "plan_8b.txt": ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "lora", "--batch", "4", "--seq", "2048"],
    "plan_8b.json": ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "lora", "--batch", "4", "--seq", "2048",
                     "--json"],
    "plan_70b_does_not_fit.txt": ["plan", "llama-3.1-70b", "--gpu", "rtx-4090", "--task", "train", "--host-memory",
                                  "64GiB"],
    "trace_debug_saved.txt": ["trace", *DEBUG_LORA, "--save-trace", TRACE_FILE],
    "trace_debug.json": ["trace", *DEBUG_LORA, "--json"],
    "trace_8b.txt": ["trace", "llama-3.1-8b", "--task", "lora", "--batch", "1", "--seq", "512"],
    "trace_8b.json": ["trace", "llama-3.1-8b", "--task", "lora", "--batch", "1", "--seq", "512", "--json"],
    "replay_debug_summary.txt": ["allocator", "replay", TRACE_FILE, "--summary"],
    "replay_debug.json": ["allocator", "replay", TRACE_FILE, "--json"],
    "replay_debug_oom.txt": ["allocator", "replay", TRACE_FILE, "--capacity", "20MiB"],
    "error_unknown_model.txt": ["estimate", "llama-3.1-8"],
    "error_json.txt": ["estimate", "llama-2-7b", "--batch", "0", "--json"],
}
HELP = [[], ["estimate"], ["trace"], ["plan"], ["gpus"], ["models"], ["allocator"], ["allocator", "replay"], ["doctor"],
        ["explain-oom"], ["monitor"], ["report"], ["serve"]]
"""Every command's --help (tests/test_golden.py checks that none is missing)."""
CASES.update({"help_" + ("_".join(args) or "llamem") + ".txt": [*args, "--help"] for args in HELP})


def render(argv: list[str]) -> str:
    """What a user sees: the exit code, stdout and stderr of `llamem ARGV`."""
    from llamem.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _no_hub_cache():
        code = main(list(argv))
    text = f"$ llamem {' '.join(argv)}\nexit code: {code}\n{out.getvalue()}"
    return text + (f"--- stderr\n{err.getvalue()}" if err.getvalue() else "")


@contextlib.contextmanager
def _no_hub_cache():
    """The same Hugging Face cache folder on every machine (one that does not exist): an unknown
    model's message names where it looked."""
    import os

    saved = {key: os.environ.pop(key, None) for key in ("HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE")}
    os.environ["HF_HUB_CACHE"] = "/nonexistent/huggingface/hub"
    try:
        yield
    finally:
        del os.environ["HF_HUB_CACHE"]
        os.environ.update({key: value for key, value in saved.items() if value is not None})


def regenerate() -> None:
    import os
    import tempfile

    previous = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:  # the trace file the replay cases read goes here
        os.chdir(folder)
        try:
            for name, argv in CASES.items():
                (HERE / name).write_text(render(argv))
                print(f"wrote tests/golden/{name}")
        finally:
            os.chdir(previous)


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/golden_cases.py --regen   (rewrites tests/golden/ from the current code)")
    regenerate()
