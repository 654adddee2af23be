"""The API's routes: each answers (HTTP status, JSON, exit code of the command it stands for).

/api/estimate and /api/plan answer exactly what `llamem estimate|plan ... --json` prints;
/api/fits the "fits on" table (`llamem.web.fits`); /api/emit the files `plan --emit` would write;
/api/models, /api/gpus what `llamem models|gpus --json` print; /api/options the options each
command takes (the page draws its controls from them)."""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from http import HTTPStatus
from typing import Any

from llamem.errors import EXIT_DOES_NOT_FIT, EXIT_INVALID_INPUT, EXIT_USAGE
from llamem.web import api


def status_for(code: int, data: dict) -> HTTPStatus:
    """200 for an answer (a plan that does not fit is one: its JSON says so), 400 for bad input,
    422 for a workload that cannot run at all."""
    if "error" not in data:
        return HTTPStatus.OK
    if code in (EXIT_INVALID_INPUT, EXIT_USAGE):
        return HTTPStatus.BAD_REQUEST
    return HTTPStatus.UNPROCESSABLE_ENTITY if code == EXIT_DOES_NOT_FIT else HTTPStatus.INTERNAL_SERVER_ERROR


ANSWERS_KEPT = 256
"""Answers kept per server: each is a pure function of its request, and the page asks the same
ones again (back to a batch size tried before, another tab, the same link)."""
_ANSWERS: OrderedDict = OrderedDict()
_ANSWERS_LOCK = threading.Lock()


def route_answer(route: str, query: dict[str, Any], config: Any) -> tuple[HTTPStatus, dict | list, int]:
    handler = ROUTES.get(route)
    if handler is None:
        data = api.error_body("UsageError", f"no such API route {route[:100]!r}: one of {', '.join(ROUTES)}",
                              EXIT_USAGE)
        return HTTPStatus.NOT_FOUND, data, EXIT_USAGE
    key = _key(route, query, config)
    with _ANSWERS_LOCK:
        if key in _ANSWERS:
            _ANSWERS.move_to_end(key)
            return _ANSWERS[key]
    code, data = handler(query, config)
    answer = status_for(code, data) if isinstance(data, dict) else HTTPStatus.OK, data, code
    if key is not None and answer[0] != HTTPStatus.INTERNAL_SERVER_ERROR:
        with _ANSWERS_LOCK:
            _ANSWERS[key] = answer
            while len(_ANSWERS) > ANSWERS_KEPT:
                _ANSWERS.popitem(last=False)
    return answer


def _key(route: str, query: dict[str, Any], config: Any) -> tuple[str, str, str] | None:
    try:
        return route, json.dumps(query, sort_keys=True), json.dumps(config, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return None


def _fits(query, config):
    from llamem.cli import resolve
    from llamem.techniques import RECORDS
    from llamem.web.fits import fits_on

    fields = {"model", "config_path", "overrides", "task"} | {o.field for r in RECORDS for o in r.options}

    def compute():
        with api.LOCK, api.parsed("estimate", query, config) as ctx:
            spec, workload, teacher, _names = resolve(**{k: v for k, v in ctx.params.items() if k in fields})
            return 0, fits_on(spec, workload, teacher)

    return api.guarded(compute)


def _emit(query, config):
    from llamem.bundle.emit import bundle_runs
    from llamem.cli import plan_result
    from llamem.web.bundle import bundle_files

    def compute():  # as `llamem plan --emit`: the search keeps only configurations the bundle runs
        with api.LOCK, api.parsed("plan", query, config) as ctx:
            params = {k: v for k, v in ctx.params.items() if k not in api.OUTPUT_PARAMS}
            plan = plan_result(**params, runnable=bundle_runs(params["engine"]))
            return 0, {**bundle_files(plan, params["engine"]), "command": plan.command}

    return api.guarded(compute)


_LISTINGS: dict[str, tuple[int, Any]] = {}


def _listing(name: str) -> tuple[int, Any]:
    """`llamem models|gpus --json`, computed once (an error is not kept)."""
    if name not in _LISTINGS:
        code, data = api.run_cli([name])
        if code:
            return code, data
        _LISTINGS[name] = code, data
    return _LISTINGS[name]


def _options(query, config):
    return 0, {name: api.option_table(name) for name in api.COMMANDS}


ROUTES = {
    "estimate": functools.partial(api.answer, "estimate"),
    "plan": functools.partial(api.answer, "plan"),
    "fits": _fits,
    "emit": _emit,
    "models": lambda query, config: _listing("models"),
    "gpus": lambda query, config: _listing("gpus"),
    "options": _options,
}
