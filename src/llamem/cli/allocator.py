"""`llamem allocator ...`: the CUDA caching allocator, simulated."""

from __future__ import annotations

import json
import sys

import click


@click.group()
def allocator():
    """The CUDA caching allocator, simulated: reserved memory, fragmentation, OOMs."""


@allocator.command()
@click.argument("trace_file", type=click.Path())
@click.option("--config", "alloc_conf", default="", help="PYTORCH_CUDA_ALLOC_CONF to simulate, "
              "e.g. expandable_segments:True")
@click.option("--capacity", help="Memory cudaMalloc can get (e.g. 24GiB); an OOM is reported where it runs out.")
@click.option("--device-total", help="The card's total memory, for the OOM message.  [default: --capacity]")
@click.option("--summary", is_flag=True, help="Print a torch.cuda.memory_summary()-like table.")
@click.option("--snapshot-out", type=click.Path(), help="Write the final state as a torch snapshot (pickle) "
              "for torch.cuda._memory_viz or pytorch.org/memory_viz.")
@click.option("--advise/--no-advise", default=True, show_default=True,
              help="Replay with other settings and say which would help.")
@click.option("--json", "as_json", is_flag=True)
def replay(trace_file, alloc_conf, capacity, device_total, summary, snapshot_out, advise, as_json):
    """Replay an allocation trace: a torch snapshot (JSON or pickle) or `llamem trace --save-trace` output."""
    from llamem.allocator import parse_alloc_conf
    from llamem.allocator.advice import advise as find_advice
    from llamem.allocator.replay import load_events, replay as run_replay
    from llamem.allocator.snapshot import memory_summary, snapshot
    from llamem.units import parse_size

    config = parse_alloc_conf(alloc_conf)
    capacity_bytes = parse_size(capacity) if capacity else None
    total_bytes = parse_size(device_total) if device_total else None
    events = load_events(trace_file)
    result = run_replay(events, config, capacity_bytes=capacity_bytes, device_total_bytes=total_bytes,
                        record_trace=bool(snapshot_out))
    data = result.to_dict()
    advice = find_advice(events, result.peak_reserved_bytes, capacity_bytes=capacity_bytes) if (
        advise and not alloc_conf) else []
    data["advice"] = [a.__dict__ for a in advice]
    if snapshot_out:
        import pickle

        with open(snapshot_out, "wb") as handle:
            pickle.dump(snapshot(result.sim), handle)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        from llamem.reporters.allocator import render_replay

        click.echo(render_replay(data))
        if summary:
            click.echo(memory_summary(result.sim))
    if result.oom_event_index is not None:
        sys.exit(2)
