"""The llamem exception tree.

Library code raises these; only `llamem.cli.main` turns them into exit codes.
Every message says what to change, not only what is wrong.
"""

from __future__ import annotations


class LlamemError(Exception):
    """Base class of every error llamem raises on purpose."""

    exit_code = 1


class UnknownModel(LlamemError):
    """A model name that is neither a preset nor a Hugging Face id we know."""

    def __init__(self, name: str, near: list[str]):
        self.name = name
        self.near = near
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        super().__init__(
            f"unknown model {name!r}.{hint} Run `llamem models` for the full list, "
            "or pass `--config path/to/config.json`."
        )


class ConfigError(LlamemError):
    """A config.json or an --override that llamem cannot use."""


class InvalidWorkload(LlamemError):
    """One or more settings that cannot work together; all problems are listed at once."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid workload:\n" + "\n".join(f"  - {p}" for p in problems))


class MissingDependency(LlamemError):
    """An optional dependency (torch, transformers, peft, ...) is not installed."""


class DoesNotFit(LlamemError):
    """No configuration fits the budget; carries the best plan and the shortfall."""

    exit_code = 2

    def __init__(self, message: str, best_plan=None, shortfall_bytes: int = 0):
        self.best_plan = best_plan
        self.shortfall_bytes = shortfall_bytes
        super().__init__(message)
