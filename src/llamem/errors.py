"""The llamem exception tree.

Library code raises these; only `llamem.cli.main` turns them into exit codes:

| exit code | meaning | classes |
|---|---|---|
| 0 | ok | |
| 1 | invalid input: a model, config, workload, size, file or setting llamem cannot use | `LlamemError` and most subclasses |
| 2 | usage error: a command line that does not parse, or options that exclude each other | `UsageError` (and click's own usage errors) |
| 3 | the workload does not fit, or a replay ran out of memory | `DoesNotFit`, `SimulatedOOM` |

Every message says what to change, not only what is wrong.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID_INPUT = 1
EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3


class LlamemError(Exception):
    """Base class of every error llamem raises on purpose: invalid input unless a subclass says otherwise."""

    exit_code = EXIT_INVALID_INPUT


class UsageError(LlamemError):
    """A command line that cannot be run as written: a missing or conflicting option."""

    exit_code = EXIT_USAGE


class UnknownModel(LlamemError):
    """A model name that is neither a preset nor a Hugging Face id we know."""

    def __init__(self, name: str, near: list[str], looked: str = ""):
        self.name = name
        self.near = near
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        where = f" Looked in: {looked}." if looked else ""
        super().__init__(
            f"unknown model {name!r}.{hint}{where} Run `llamem models` for the full list, "
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

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, message: str, best_plan=None, shortfall_bytes: int = 0):
        self.best_plan = best_plan
        self.shortfall_bytes = shortfall_bytes
        super().__init__(message)
