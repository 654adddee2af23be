"""The "fits on" table: for every card of the catalog, the fewest cards that hold the workload as
given (no plan changes), per-card memory as `llamem estimate --gpus N` sizes it.

More cards help training by sharding its states (ZeRO-3 across the cards) and generation by
tensor parallel (heads split across the cards, within one node); a count whose layout the model's
shape refuses is skipped."""

from __future__ import annotations

from llamem.errors import LlamemError

COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""Card counts tried; past 64 the question is a cluster plan (`llamem plan --min-gpus`)."""
MAX_TP = 8


def per_card_bytes(spec, w, teacher) -> list[dict]:
    """[{"num_gpus", "layout", "device_bytes"}] for each count in COUNTS whose layout is valid."""
    from llamem.parallel import make_layout
    from llamem.sizing import estimate_report

    rows = []
    for count in COUNTS:
        if not w.is_training and count > MAX_TP:
            break
        try:
            layout = make_layout(spec, w, gpus=count, tp=1 if w.is_training else count,
                                 sharding="zero3" if w.is_training and count > 1 else None)
            report = estimate_report(spec, w, layout, teacher, details=False)
        except LlamemError:
            continue
        rows.append({"num_gpus": count, "layout": report.layout, "device_bytes": report.device.device_bytes})
    return rows


def fits_on(spec, w, teacher) -> dict:
    """{"counts": per_card_bytes, "gpus": [{"name", "memory_bytes", "num_gpus", "device_bytes", "layout"}]}
    with num_gpus None where no count in COUNTS fits; smallest card first."""
    from llamem.gpus import CATALOG

    counts = per_card_bytes(spec, w, teacher)
    rows = []
    for gpu in sorted(CATALOG.values(), key=lambda g: (g.memory_bytes, g.name)):
        fit = next((c for c in counts if c["device_bytes"] <= gpu.memory_bytes), None)
        rows.append({"name": gpu.name, "memory_bytes": gpu.memory_bytes,
                     "num_gpus": fit["num_gpus"] if fit else None,
                     "device_bytes": fit["device_bytes"] if fit else None, "layout": fit["layout"] if fit else None})
    return {"counts": counts, "gpus": rows}
