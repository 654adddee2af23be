"""A run explained, as text, PNG and HTML: an OOM dump (`render_explanation`) and a monitor log
(`render_summary`, `summary_png`, `summary_html`). The figures come from `llamem.runtime.explain`;
nothing here computes them.

The PNG is drawn with matplotlib's Agg canvas directly (no pyplot, so no global backend is
changed); the HTML embeds it as a base64 `data:` URI and loads nothing from anywhere.
"""

from __future__ import annotations

import base64
import html
import io
import textwrap

from llamem.errors import LlamemError
from llamem.units import display_unit, format_bytes, format_in

MESSAGE_CHARS = 240
"""An OOM message is printed up to here (torch's runs to several sentences)."""


def _bytes(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else format_bytes(num_bytes)


def _exact(num_bytes: int) -> str:
    return f"{format_bytes(num_bytes)} ({num_bytes:,} B)"


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS - 3] + "..."


# explain-oom ----------------------------------------------------------------------------------------
def render_explanation(e) -> str:
    lines = _error_lines(e) + [""] + _live_lines(e.live) + [""] + _verdict_lines(e.verdict, e.live, e.requested_bytes)
    lines += [""] + _workload_lines(e) + [""] + _plan_lines(e.plan)
    lines += [f"note: {note}" for note in e.notes]
    return "\n".join(lines)


def _error_lines(e) -> list[str]:
    r = e.record
    where = ", ".join(part for part in (f"step {r['step']}" if r["step"] is not None else "",
                                        f"phase {r['phase']}" if r["phase"] else "") if part)
    capacity = f" (capacity {_bytes(r['capacity_bytes'])})" if r["capacity_bytes"] is not None else ""
    request = "unknown" if e.requested_bytes is None else f"{_exact(e.requested_bytes)}, from {e.requested_from}"
    message = textwrap.wrap(" ".join(r["message"].split()), 100, initial_indent="  ", subsequent_indent="  ")
    return [f"out of memory{' at ' + where if where else ''} on {r['device_name'] or r['source']}{capacity}",
            *message, f"failed request: {request}"]


def _live_lines(live) -> list[str]:
    total = max(live.reserved_bytes, 1)
    lines = ["live at the error:", f"  {'category':<20} {'size':>11} {'bytes':>16} {'share':>7}"]
    rows = [(c.name, c.size_bytes, c.parts) for c in live.categories]
    rows.append(("cached but free", live.cached_free_bytes, {}))
    for name, size, parts in rows:
        detail = ", ".join(f"{label} {format_bytes(b)}" for label, b in parts.items())
        lines.append(f"  {name:<20} {format_bytes(size):>11} {size:>16,} {size / total:>7.1%}"
                     + (f"   ({detail})" if detail else ""))
    lines.append(f"  {'total held':<20} {format_bytes(live.reserved_bytes):>11} {live.reserved_bytes:>16,} "
                 f"{1 if live.reserved_bytes else 0:>7.1%}")
    lines += textwrap.wrap(f"categories: {live.how}", 100, initial_indent="  ", subsequent_indent="    ")
    if live.how.startswith("none"):
        lines.append("  (no split into categories is made without labels or stacks)")
    return lines


def _verdict_lines(v, live, request: int | None) -> list[str]:
    if v.kind == "unknown":
        return ["verdict: unknown", *[f"  {note}" for note in v.notes]]
    sums = (f"live {format_bytes(live.allocated_bytes)} + the request {format_bytes(request)} = "
            f"{format_bytes(v.needed_bytes)}")
    room = f"the {format_bytes(v.capacity_bytes)} the allocator could get ({v.capacity_source})"
    lines: list[str]
    if v.kind == "shortage":
        lines = [(f"verdict: a true shortage of {_exact(v.shortfall_bytes)}: {sums}, more than {room}; even a "
                  "perfectly packed card would not hold it")]
    else:
        lines = [(f"verdict: fragmentation: {sums} fits in {room}, but the "
                  f"{format_bytes(live.cached_free_bytes)} cached and free lies in blocks too small for the request")]
    lines = [wrapped for line in lines for wrapped in _wrap(line)]
    lines += _replay_lines(v)
    return lines + [wrapped for note in v.notes for wrapped in _wrap(note, "  ")]


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, 100, initial_indent=indent, subsequent_indent=indent + "  ")


def _replay_lines(v) -> list[str]:
    if v.replay is None:
        return []
    outcome = "completes" if v.replay["completes"] else "runs out of memory, as torch did"
    lines = _wrap(f"replayed through llamem's allocator simulator ({v.replay['events']} events, settings "
                  f"{v.replay['allocator_settings']}) at {format_bytes(v.capacity_bytes)}: {outcome}", "  ")
    if v.replay["completes"] and v.kind == "fragmentation":
        lines.append("  (the simulation does not reproduce the error: the advice below is a lower bound)")
    if v.advice_summary:
        lines += _wrap(f"allocator advice: {v.advice_summary}", "  ")
    for advice in v.advice:
        lines.append(f"    PYTORCH_CUDA_ALLOC_CONF={advice['setting']:<44} peak reserved "
                     f"{format_bytes(advice['peak_reserved_bytes'])}")
    return lines


def _workload_lines(e) -> list[str]:
    r = e.record
    if r["workload"] is None:
        return [f"workload: not known ({r['problem'] or 'the dump holds none'})"]
    lines = [f"workload read from the live objects: {', '.join(e.workload_labels)}"]
    if r["unknown"]:
        lines.append("  not readable from the objects (llamem's default used):")
        lines += [f"    - {item}" for item in r["unknown"]]
    if e.estimate_command:
        lines.append(f"  estimate: {e.estimate_command}")
    elif e.estimate_problem:
        lines.append(f"  estimate: omitted ({e.estimate_problem})")
    return lines


def _plan_lines(advice) -> list[str]:
    from llamem.reporters.plan_report import render_plan

    if advice.plan is None and not advice.command:
        return [f"plan: none ({advice.problem})"]
    lines = [f"llamem plan on this card (budget {_bytes(advice.budget_bytes)}: {advice.budget_note}):"]
    if advice.plan is None:
        lines.append(f"  no plan: {advice.problem}")
    else:
        lines += [f"  {line}" for line in render_plan(advice.plan).splitlines()]
    return lines + [f"copy: {advice.command}"]


# report: text ------------------------------------------------------------------------------------
def _unit(s):
    values = [s.peak_allocated_bytes or 0, s.peak_reserved_bytes or 0, *(s.breakdown or {}).values()]
    values += [p.predicted_bytes or 0 for r in s.runs for p in r.peaks]
    return display_unit(max(values, default=0))


def workload_label(record: dict | None) -> str:
    """'train, batch 8 x seq 128, ...' for a workload line (its raw fields when they do not build)."""
    if record is None:
        return "before any workload line"
    if record["workload"] is None:
        return f"workload not known ({record['problem'] or 'none given'})"
    from llamem.runtime.explain import dump_workload
    from llamem.techniques import workload_labels

    try:
        labels = workload_labels(dump_workload(record, "workload line"))
    except LlamemError as err:
        return f"workload not readable ({err})"
    model = f"{record['model']}: " if record["model"] else ""
    return model + ", ".join(labels)


def _run_title(run) -> str:
    if run.first_step is None:
        return f"no steps logged under: {workload_label(run.workload)}"
    steps = f"step {run.first_step}" if run.first_step == run.last_step else f"steps {run.first_step}-{run.last_step}"
    return f"{steps} ({run.num_steps} logged): {workload_label(run.workload)}"


def _peak_rows(run, unit) -> list[tuple[str, str, str, str, str]]:
    return [(p.phase, format_in(p.measured_bytes, unit), str(p.at_step),
             "-" if p.predicted_bytes is None else format_in(p.predicted_bytes, unit),
             "-" if p.ratio is None else f"{p.ratio:.2f}") for p in run.peaks]


PEAK_HEADER = ("phase", "measured peak", "at step", "predicted", "measured/predicted")


def _overview(s) -> list[tuple[str, str]]:
    header = s.log.header or {}
    run = header.get("source") or "unknown source"
    if header.get("device"):
        run += f" on {header['device']}"
    if header.get("capacity_bytes") is not None:
        run += f" (capacity {format_bytes(header['capacity_bytes'])})"
    rows = [("run", run + (f", started {header['started']}" if header.get("started") else "")),
            ("steps", f"{s.num_steps} logged in {s.duration_s:.1f} s")]
    if s.peak_allocated_bytes is not None:
        rows.append(("peak allocated", f"{_exact(s.peak_allocated_bytes)} at step {s.peak_step}"))
    for label, value in (("peak reserved", s.peak_reserved_bytes), ("NVML used", s.nvml_used_bytes),
                         ("outside PyTorch", s.non_torch_bytes)):
        if value is not None:
            rows.append((label, _exact(value)))
    rows += [("allocator retries", str(s.num_alloc_retries)), ("OOMs", str(s.num_ooms)),
             ("leaks reported", str(len(s.log.of_type("leak"))))]
    return rows


def _table(header, rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(row) -> str:
        cells = (str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  " + "  ".join(cells)

    return [line(header), *[line(r) for r in rows]]


def _leak_lines(leak) -> list[str]:
    lines = [(f"  step {leak['step']}, over {leak['steps']} steps: {format_bytes(leak['growth_bytes_per_step'])} "
              f"more per step (live {format_bytes(leak['live_growth_bytes'])} more)")]
    for source in leak["sources"][:5]:
        where = source["stack"][-1] if source["stack"] else "no stack recorded"
        lines.append(f"    {format_bytes(source['bytes'])} in {source['count']} allocations "
                     f"({source['category'] or 'uncategorized'}) at {where}")
    return lines


def render_summary(s) -> str:
    unit = _unit(s)
    lines = [f"{label}: {value}" for label, value in _overview(s)]
    for run in s.runs:
        lines += ["", _run_title(run)]
        lines += _table(PEAK_HEADER, _peak_rows(run, unit)) if run.peaks else ["  no phase figures logged"]
    if s.breakdown:
        lines += ["", f"breakdown at the peak, {s.breakdown_label}:"]
        lines += [f"  {k:<28} {format_in(v, unit):>12}" for k, v in s.breakdown.items()]
    else:
        lines += ["", s.breakdown_label]
    leaks, ooms = s.log.of_type("leak"), s.log.of_type("oom")
    if leaks:
        lines += ["", "leaks:"] + [line for leak in leaks for line in _leak_lines(leak)]
    if ooms:
        lines += ["", "out of memory:"]
        for oom in ooms:
            lines.append(f"  step {oom['step']}{', ' + oom['phase'] if oom['phase'] else ''}: {_short(oom['message'])}")
            if oom["dump_dir"]:
                lines.append(f"    explain it: llamem explain-oom {oom['dump_dir']}")
    if s.command:
        lines += ["", f"reproduce: {s.command}"]
    if s.log.problems:
        lines += ["", f"lines skipped ({len(s.log.problems)}):"] + [f"  {p}" for p in s.log.problems[:20]]
        if len(s.log.problems) > 20:
            lines.append(f"  ... and {len(s.log.problems) - 20} more")
    return "\n".join(lines)


# report: PNG ----------------------------------------------------------------------------------------
def require_matplotlib() -> None:
    """Checked before any work: the figure needs matplotlib, an optional dependency."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from llamem.errors import MissingDependency

        raise MissingDependency("--png and --html draw with matplotlib: pip install 'llamem[report]'") from None


def summary_png(s) -> bytes:
    """Left: each phase's peak allocated per step, its prediction dashed; right: the breakdown at the peak."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    unit = _unit(s)
    figure = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    timeline, breakdown = figure.subplots(1, 2, width_ratios=(3, 2))
    _draw_timeline(timeline, s, unit)
    _draw_breakdown(breakdown, s, unit)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _draw_timeline(ax, s, unit) -> None:
    colors: dict[str, str] = {}
    steps = s.log.of_type("step")
    for record in steps:
        for phase in record["phases"]:
            colors.setdefault(phase, f"C{len(colors) % 10}")
    for phase, color in colors.items():
        points = [(r["step"], r["phases"][phase]["peak_allocated_bytes"] / unit[1]) for r in steps
                  if phase in r["phases"] and r["phases"][phase]["peak_allocated_bytes"] is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], color=color, marker="o", markersize=3,
                label=f"{phase} peak")
    for run in s.runs:
        for peak in run.peaks:
            if peak.predicted_bytes is not None and run.first_step is not None:
                ax.hlines(peak.predicted_bytes / unit[1], run.first_step - 0.5, run.last_step + 0.5,
                          colors=colors.get(peak.phase, "grey"), linestyles="dashed", label=f"{peak.phase} predicted")
    capacity = (s.log.header or {}).get("capacity_bytes")
    if capacity is not None:
        ax.axhline(capacity / unit[1], color="black", linewidth=0.8, label="capacity")
    for n, oom in enumerate(s.log.of_type("oom")):
        ax.axvline(oom["step"], color="red", linestyle=":", label="out of memory" if n == 0 else None)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(f"peak allocated ({unit[0]})")
    ax.set_title("peak allocated per phase (dashed: llamem's prediction)")
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def _draw_breakdown(ax, s, unit) -> None:
    if not s.breakdown:
        ax.axis("off")
        ax.text(0.5, 0.5, s.breakdown_label, ha="center", va="center", wrap=True, fontsize="small")
        return
    names = list(s.breakdown)[::-1]
    values = [s.breakdown[name] / unit[1] for name in names]
    predicted = s.breakdown_label.startswith("predicted")
    bars = ax.barh(names, values, color="C7" if predicted else "C0", hatch="//" if predicted else None)
    ax.bar_label(bars, fmt="%.2f", fontsize="small", padding=2)
    ax.margins(x=0.15)  # room for the labels
    ax.set_xlabel(unit[0])
    ax.set_title(("predicted breakdown at the peak (not measured)" if predicted else
                  f"breakdown at the peak, {s.breakdown_label}"), fontsize="medium")
    ax.tick_params(axis="y", labelsize="small")


# report: HTML ---------------------------------------------------------------------------------------
_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:75em}table{border-collapse:collapse;margin:.5em 0 1.5em}"
          "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child,th:first-child"
          "{text-align:left}code{background:#f4f4f4;padding:.1em .3em}img{max-width:100%}")


def _html_table(header, rows) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header) if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def summary_html(s, png: bytes) -> str:
    """One self-contained page: the figure as a data: URI, the summary's tables; no external reference."""
    unit = _unit(s)
    escape = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>llamem report: {escape(s.log.path)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>Memory report: {escape(s.log.path)}</h1>", _html_table(None, _overview(s)),
             (f'<img alt="peak allocated per phase and the breakdown at the peak" '
              f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">')]
    for run in s.runs:
        parts += [f"<h2>{escape(_run_title(run))}</h2>", _html_table(PEAK_HEADER, _peak_rows(run, unit))]
    if s.breakdown:
        parts += [f"<h2>Breakdown at the peak, {escape(s.breakdown_label)}</h2>",
                  _html_table(("category", unit[0]), [(k, format_in(v, unit)) for k, v in s.breakdown.items()])]
    parts += _html_lists(s)
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_lists(s) -> list[str]:
    escape = html.escape
    parts = []
    leaks = [line.strip() for leak in s.log.of_type("leak") for line in _leak_lines(leak)]
    if leaks:
        parts += ["<h2>Leaks</h2><ul>", *[f"<li>{escape(line)}</li>" for line in leaks], "</ul>"]
    ooms = s.log.of_type("oom")
    if ooms:
        parts += ["<h2>Out of memory</h2><ul>"]
        for o in ooms:
            command = f"llamem explain-oom {o['dump_dir']}"
            explain = f"<br>explain it: <code>{escape(command)}</code>" if o["dump_dir"] else ""
            where = f"step {o['step']} {escape(o['phase'] or '')}"
            parts.append(f"<li>{where}: {escape(_short(o['message']))}{explain}</li>")
        parts.append("</ul>")
    if s.command:
        parts.append(f"<h2>Reproduce</h2><p><code>{escape(s.command)}</code></p>")
    if s.log.problems:
        parts += ["<h2>Lines skipped</h2><ul>", *[f"<li>{escape(p)}</li>" for p in s.log.problems], "</ul>"]
    return parts
