"""Every pinned output still matches (`tests/golden_cases.py`; `make golden` regenerates them)."""

import os

import pytest

from golden_cases import CASES, HERE, render

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The cases run in one folder, in order: the trace case writes the file the replay cases read."""
    path = tmp_path_factory.mktemp("golden")
    previous = os.getcwd()
    os.chdir(path)
    with pytest.MonkeyPatch.context() as patch:
        import llamem.sizing

        patch.setattr(llamem.sizing, "trace_report", _traced_once(llamem.sizing.trace_report))
        render(CASES["trace_debug_saved.txt"])
        yield path
    os.chdir(previous)


def _traced_once(trace_report):
    """`llamem trace ARGS` and `llamem trace ARGS --json` render one report: the trace of a workload
    runs once here and both cases render it (a trace starts from a collected heap, so what ran
    before it does not count). A trace that writes its events (--save-trace) always runs."""
    reports = {}

    def traced(spec, w, teacher=None, save_trace=None):
        key = (spec, w, teacher)
        if save_trace or key not in reports:
            reports[key] = trace_report(spec, w, teacher, save_trace=save_trace)
        return reports[key]

    return traced


@pytest.mark.parametrize("name", list(CASES))
def test_output_is_unchanged(name, workdir):
    expected = (HERE / name).read_text()
    assert render(CASES[name]) == expected, f"{name} changed: run `make golden` if the change is intended"


def test_every_command_has_its_help_pinned():
    import click

    from golden_cases import HELP
    from llamem.cli import _register_groups, app

    _register_groups()

    def paths(command, prefix):
        yield prefix
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from paths(sub, [*prefix, name])

    assert sorted(paths(app, [])) == sorted(HELP)
