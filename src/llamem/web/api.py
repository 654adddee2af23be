"""A request is a command line: `{"batch": "4", "task": "lora"}` for `/api/estimate` is
`llamem estimate ... --batch=4 --task=lora --json`, run in-process by `llamem.cli.main`, so the
answer is the JSON document the command prints (errors included). Only the options that name no
file are taken: a config.json comes as uploaded data and stands for `--config config.json`.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
from typing import Any

import click

from llamem.errors import EXIT_INVALID_INPUT, EXIT_USAGE, ConfigError, LlamemError, UnknownModel, UsageError

COMMANDS = ("estimate", "plan")
REFUSED = {
    "config": "upload the config.json instead: the server reads no file a request names",
    "emit": "the launch bundle is answered by /api/emit; the server writes no file",
    "html": "the page draws the same charts; the server writes no file",
    "save-trace": "the server writes no file",
    "verify": "re-checking with the trace engine needs torch and minutes: run `llamem plan --verify` locally",
    "json": "answers are always JSON",
    "code": "the plan's JSON holds the code (final.code)",
}
"""Options a request may not give, and why (each names a file, or is implied)."""
MODEL_OPTIONS = ("model", "teacher")
"""Values that name a model: presets and aliases only, so no name is read as a local path."""
UPLOAD_NAME = "config.json"
MAX_VALUE_CHARS = 1000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._+-]{0,127})?")
OUTPUT_PARAMS = ("as_json", "html_path", "show_code", "emit_dir")
LOCK = threading.Lock()
"""One computation at a time: the command's output is captured by swapping sys.stdout, which is
process-wide. A long plan (seconds, for a 70B model on one card) makes the other requests wait."""


def command(name: str) -> click.Command:
    from llamem.cli import app

    return app.commands[name]


def options(name: str) -> dict[str, click.Option]:
    """The options a request may give to command `name`, by flag name without the dashes. A server
    launch (`--server` and its settings) is not one: the page draws a transformers workload's phases."""
    from llamem.cli.serving import SERVER_ONLY

    found = {}
    for param in command(name).params:
        if isinstance(param, click.Option) and param.name not in {"server", "concurrency", *SERVER_ONLY}:
            flag = max(param.opts, key=len).lstrip("-")
            if flag not in REFUSED:
                found[flag] = param
    return found


def option_table(name: str) -> list[dict[str, Any]]:
    """What the page needs to draw a control for each option."""
    rows = []
    for flag, param in options(name).items():
        kind = "flag" if param.is_flag else "choice" if isinstance(param.type, click.Choice) else (
            "int" if isinstance(param.type, click.types.IntParamType) else "text")
        rows.append({"name": flag, "kind": kind, "multiple": bool(param.multiple), "help": param.help or "",
                     "choices": list(param.type.choices) if kind == "choice" else None})
    return rows


def command_line(name: str, query: dict[str, Any], uploaded: bool = False) -> list[str]:
    """The argv of `llamem NAME` that a request's fields stand for (without `--json`)."""
    if name not in COMMANDS:
        raise UsageError(f"no such command {name!r}: the API answers {', '.join(COMMANDS)}")
    known = options(name)
    argv = [name]
    for key, raw in query.items():
        values = raw if isinstance(raw, list) else [raw]
        if key == "model":
            continue
        if key in REFUSED:
            raise UsageError(f"{key}: not taken by the server ({REFUSED[key]})")
        if key not in known:
            raise UsageError(f"no such option {key!r} for {name}; known: {', '.join(sorted(known))}")
        argv += _option_args(key, known[key], [_text(key, v) for v in values])
    model = query.get("model")
    if uploaded:
        argv.append(f"--config={UPLOAD_NAME}")
    elif model not in (None, "", []):
        name = _text("model", model[-1] if isinstance(model, list) else model)
        check_model_name(name, "the model")
        argv += ["--", name]
    return argv


def _option_args(key: str, param: click.Option, values: list[str]) -> list[str]:
    if param.is_flag:
        if values[-1].lower() in ("", "1", "true", "on", "yes"):
            return [f"--{key}"]
        if values[-1].lower() in ("0", "false", "off", "no"):
            return []
        raise UsageError(f"{key}: a switch takes true or false, not {values[-1]!r}")
    if key in MODEL_OPTIONS:
        check_model_name(values[-1], f"--{key}")
    # --key=value: a value that starts with '-' (a negative batch) stays a value
    return [f"--{key}={v}" for v in (values if param.multiple else values[-1:])]


def _text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise UsageError(f"{key}: give text or a number, not {type(value).__name__}")
    if len(value) > MAX_VALUE_CHARS or "\0" in value:
        raise UsageError(f"{key}: a value of at most {MAX_VALUE_CHARS} characters, without NUL")
    return value


def check_model_name(name: str, flag: str) -> None:
    """A built-in preset or alias, or an UnknownModel error: a request never names a local path."""
    from llamem.model import lookup_preset, near_matches

    if _NAME.fullmatch(name) and ".." not in name and not name.endswith(".json") and lookup_preset(name):
        return
    near = near_matches(name) if _NAME.fullmatch(name) else []
    raise UnknownModel(name, near, looked=f"the built-in presets and aliases ({flag} on this page names a preset; "
                       "for any other model upload its config.json)")


def upload_spec(config: Any, overrides: list[str]):
    """The ModelSpec of an uploaded config.json, through llamem's own config checks, as
    `--config config.json` would read it."""
    from llamem.model import parse_overrides, spec_from_config

    if not isinstance(config, dict):
        raise ConfigError(f"{UPLOAD_NAME}: holds {type(config).__name__}, not a JSON object: a config.json is one "
                          "{...} object of fields such as hidden_size")
    hf_id = config.get("_name_or_path")
    return spec_from_config(config, name=UPLOAD_NAME, source=UPLOAD_NAME, overrides=parse_overrides(overrides),
                            hf_id=hf_id if isinstance(hf_id, str) and hf_id else None)


def error_body(kind: str, message: str, code: int) -> dict:
    """The error document `llamem ... --json` prints."""
    return {"error": {"type": kind, "message": message, "exit_code": code}}


def guarded(compute) -> tuple[int, dict]:
    """(exit code, JSON) of `compute()`, each error as `llamem.cli.main` maps it."""
    try:
        return compute()
    except LlamemError as err:
        return err.exit_code, error_body(type(err).__name__, str(err), err.exit_code)
    except click.UsageError as err:
        return EXIT_USAGE, error_body("UsageError", err.format_message(), EXIT_USAGE)
    except click.ClickException as err:
        return EXIT_INVALID_INPUT, error_body(type(err).__name__, err.format_message(), EXIT_INVALID_INPUT)
    except RecursionError:
        return EXIT_INVALID_INPUT, error_body("ConfigError", "the request nests too deeply", EXIT_INVALID_INPUT)


def run_cli(argv: list[str], uploaded=None) -> tuple[int, dict]:
    """`llamem ARGV --json` in-process: its exit code and the JSON it prints."""
    from llamem.cli import main

    out, err = io.StringIO(), io.StringIO()
    with LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([argv[0], "--json", *argv[1:]], uploaded=uploaded)
    try:
        return code, json.loads(out.getvalue())
    except ValueError:  # something else wrote to stdout meanwhile: say so rather than drop the connection
        return EXIT_INVALID_INPUT, error_body("InternalError", f"the answer of `llamem {argv[0]}` was not one JSON "
                                              "document; please retry", EXIT_INVALID_INPUT)


def answer(name: str, query: dict[str, Any], config: Any = None) -> tuple[int, dict]:
    """(exit code, JSON) for `/api/estimate` and `/api/plan`."""
    def compute():
        uploaded = upload_spec(config, _overrides(query)) if config is not None else None
        return run_cli(command_line(name, query, uploaded is not None), uploaded)

    return guarded(compute)


def _overrides(query: dict[str, Any]) -> list[str]:
    raw = query.get("override", [])
    return [_text("override", v) for v in (raw if isinstance(raw, list) else [raw])]


def parsed(name: str, query: dict[str, Any], config: Any = None):
    """The click context of `llamem NAME` for a request; `resolve` and `plan_result` run inside it."""
    uploaded = upload_spec(config, _overrides(query)) if config is not None else None
    argv = command_line(name, query, uploaded is not None)
    return command(name).make_context(name, argv[1:], obj=uploaded)

