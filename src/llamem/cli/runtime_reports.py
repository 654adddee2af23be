"""`llamem explain-oom DIR` and `llamem report LOG.jsonl`: a run explained from what it left behind."""

from __future__ import annotations

import json

import click


@click.command("explain-oom")
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def explain_oom(directory, as_json):
    """Why a run ran out of memory, from the folder that oom_guard or the memory monitor wrote:
    what was live by category, fragmentation or a true shortage, and a plan that fits the card."""
    from llamem.cli import default_host_memory_bytes
    from llamem.reporters.runtime_report import render_explanation
    from llamem.runtime.explain import explain_oom as explain
    from llamem.runtime.explain import explanation_to_dict

    explanation = explain(directory, host_budget_bytes=default_host_memory_bytes())
    click.echo(json.dumps(explanation_to_dict(explanation), indent=2) if as_json else render_explanation(explanation))
    return 0


@click.command("report")
@click.argument("log")
@click.option("--png", "png_path", help="Also draw the per-phase timeline and the breakdown at the peak (PNG).")
@click.option("--html", "html_path", help="Also write one self-contained HTML page: the figure and the tables.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def report(log, png_path, html_path, as_json):
    """Summarize the memory monitor's JSONL log: peak per phase measured against llamem's
    prediction, leaks, out-of-memory errors, and the command that reproduces the estimate."""
    from llamem.files import check_writable
    from llamem.reporters.runtime_report import render_summary, require_matplotlib, summary_html, summary_png
    from llamem.runtime.runlog import read_log, summarize_log, summary_to_dict

    for path, flag in ((png_path, "--png"), (html_path, "--html")):
        if path:
            check_writable(path, flag)
            require_matplotlib()
    summary = summarize_log(read_log(log))
    png = summary_png(summary) if png_path or html_path else b""
    if png_path:
        _write(png_path, "--png", png)
    if html_path:
        _write(html_path, "--html", summary_html(summary, png).encode("utf-8"))
    click.echo(json.dumps(summary_to_dict(summary), indent=2) if as_json else render_summary(summary))
    return 0


def _write(path: str, flag: str, data: bytes) -> None:
    from llamem.errors import LlamemError

    try:
        with open(path, "wb") as handle:
            handle.write(data)
    except OSError as err:
        raise LlamemError(f"{flag} {path}: cannot be written ({err.strerror or err})") from None
