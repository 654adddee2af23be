"""`llamem estimate|plan ... --html FILE`: one self-contained page with the charts of `llamem serve`.

The page inlines the page's own stylesheet and chart code (`llamem/web/static/`) and the report's
`--json` data: no external reference, so it opens offline and can be mailed as one file."""

from __future__ import annotations

import html
import json
from importlib import resources

_BOOT = {
    "estimate": """
const D = JSON.parse(document.getElementById("llamem-data").textContent), C = window.LlamemCharts;
function draw() {
  C.summary(document.getElementById("summary"), D.estimate, null, null);
  C.phaseBars(document.getElementById("phases"), D.estimate, null);
  C.fitsTable(document.getElementById("fits"), D.fits, null);
}
draw(); window.addEventListener("resize", draw);
""",
    "plan": """
const D = JSON.parse(document.getElementById("llamem-data").textContent), C = window.LlamemCharts;
function draw() { C.waterfall(document.getElementById("plan"), D.plan); }
draw(); window.addEventListener("resize", draw);
""",
}


def _static(name: str) -> str:
    return (resources.files("llamem.web") / "static" / name).read_text(encoding="utf-8")


def _script_json(data) -> str:
    """JSON safe inside <script>: no '</' can close the element early."""
    return json.dumps(data).replace("</", "<\\/").replace("<!--", "<\\!--")


def _page(title: str, body: list[str], data: dict, kind: str) -> str:
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>", f"<style>{_static('style.css')}</style></head>",
        '<body class="report">', f'<header class="top"><h1>llamem</h1><span class="tagline">{html.escape(title)}'
        "</span></header>", "<main>", *body, "</main>",
        f'<script type="application/json" id="llamem-data">{_script_json(data)}</script>',
        f"<script>{_static('charts.js')}</script>", f"<script>{_BOOT[kind]}</script>", "</body></html>"])


def _panel(title: str, inner: str) -> str:
    return f'<div class="panel"><h2>{html.escape(title)}</h2>{inner}</div>'


def _code(title: str, text: str) -> str:
    return (f'<div class="code-title">{html.escape(title)}</div><div class="code-block"><pre>'
            f"{html.escape(text)}</pre></div>")


def _notes(notes) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>" if notes else ""


def estimate_html(estimate: dict, fits: dict) -> str:
    """The page of an estimate: headline, breakdown per phase, the cards it fits on, notes."""
    w = estimate["workload"]
    title = (f"{estimate['model']['name']}: {w['task']}, batch {w['batch']} x {w['seq']} tokens, "
             f"{w['precision']}, {estimate['layout']}")
    body = ['<div id="summary" class="tiles"></div>',
            _panel("Breakdown at the peak of each phase", '<div id="phases"></div>'),
            _panel("Fits on (fewest cards of each kind, workload as given)",
                   '<div id="fits" class="table-wrap"></div>'),
            _panel("Notes", _notes(estimate["notes"]))]
    return _page(title, body, {"estimate": estimate, "fits": fits}, "estimate")


def plan_html(plan: dict) -> str:
    """The page of a plan: the ladder as a waterfall, the command and the code that apply it."""
    card = f"{plan['num_gpus']} x {plan['gpu']['name']}"
    verdict = "fits" if plan["fits"] else "does not fit"
    title = f"{plan['model']['name']} on {card}: {verdict}"
    inner = _code("The configuration the plan ends on" if plan["fits"] else "The closest configuration",
                  plan["final"]["command"])
    if plan["final"].get("code"):
        inner += _code("Code that applies it (--code)", plan["final"]["code"])
    body = [_panel("The plan" if plan["fits"] else "Does not fit: the closest plan", '<div id="plan"></div>'),
            _panel("Commands and code", inner), _panel("Notes", _notes(plan["notes"]))]
    return _page(title, body, {"plan": plan}, "plan")


def write_estimate_html(path: str, report, spec, workload, teacher) -> None:
    from llamem.reporters.json_report import report_to_dict
    from llamem.web.fits import fits_on

    _write(path, estimate_html(report_to_dict(report), fits_on(spec, workload, teacher)))


def write_plan_html(path: str, plan) -> None:
    from llamem.reporters.plan_report import plan_to_dict

    _write(path, plan_html(plan_to_dict(plan)))


def _write(path: str, text: str) -> None:
    from llamem.errors import LlamemError
    from llamem.files import check_writable

    check_writable(path, "--html")
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise LlamemError(f"--html {path}: cannot be written ({err.strerror or err})") from None
