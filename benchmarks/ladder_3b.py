"""The techniques ladder of docs/memory-model.md: Llama-3.2-3B full fine-tuning at batch 2 x 4096,
each row adding one technique to the row above, each row a `llamem estimate` command and its figures.

Usage: python benchmarks/ladder_3b.py   (prints the Markdown table the docs carry)

`--compile` comes after full checkpointing: it is not sized with selective checkpointing yet.
"""

from __future__ import annotations

import json
import subprocess
import sys

BASE = ["llama-3.2-3b", "--batch", "2", "--seq", "4096"]
START = ["--precision", "bf16-mixed", "--optimizer", "adamw"]
"""torchtune's and the docs' starting point (llamem's own default is what the Trainer gives: bf16, fused AdamW)."""

STEPS: list[tuple[str, list[str]]] = [
    ("full fine-tuning: bf16-mixed, AdamW, no checkpointing", START),
    ("+ chunked loss", ["--loss", "chunked"]),
    ("+ selective checkpointing (every layer)", ["--ac", "selective"]),
    ("+ full checkpointing (instead of selective)", ["--ac", "full"]),
    ("+ torch.compile", ["--compile"]),
    ("+ 8-bit AdamW", ["--optimizer", "adamw8bit"]),
    ("LoRA r=8 on q,v (bf16 frozen base) instead of full fine-tuning", ["--task", "lora", "--precision", "bf16"]),
    ("QLoRA (NF4 base)", ["--task", "qlora"]),
]


def llamem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamem", *args], capture_output=True, text=True)


def merge(args: list[str], step: list[str]) -> list[str]:
    """The arguments so far with the step's flags set (a flag given again replaces its value)."""
    out = list(args)
    i = 0
    while i < len(step):
        flag = step[i]
        value = step[i + 1] if i + 1 < len(step) and not step[i + 1].startswith("--") else None
        if flag in out:
            at = out.index(flag)
            del out[at:at + (2 if value is not None else 1)]
        out += [flag] + ([value] if value is not None else [])
        i += 2 if value is not None else 1
    return out


def ladder() -> list[tuple[str, str, dict]]:
    rows, args = [], []
    for title, step in STEPS:
        args = merge(args, step)
        command = ["estimate", *BASE, *args]
        done = llamem(*command, "--json")
        if done.returncode:
            raise SystemExit(f"llamem {' '.join(command)} failed:\n{done.stderr}")
        rows.append((title, "llamem " + " ".join(command), json.loads(done.stdout)))
    return rows


def main() -> int:
    print("| step | command | peak allocated (phase) | device |")
    print("|---|---|---:|---:|")
    for title, command, report in ladder():
        print(f"| {title} | `{command}` | {report['peak_allocated_bytes'] / 2**30:.2f} GiB ({report['peak_phase']}) "
              f"| {report['device_bytes'] / 2**30:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
