"""`llamem allocator ...`: the CUDA caching allocator, simulated."""

from __future__ import annotations

import dataclasses
import json

import click

from llamem.errors import EXIT_DOES_NOT_FIT, LlamemError


def _allocations_count(_ctx, _param, value: str | None) -> int | None:
    """--empty-cache-every: a whole number of allocations, 1 or more (a usage error otherwise: exit 2)."""
    if value is None:
        return None
    text = value.strip()
    if not text.lstrip("+-").isdigit():
        raise click.BadParameter(f"{value!r} is not a whole number: give how many allocations pass between two "
                                 "torch.cuda.empty_cache() calls, for example --empty-cache-every 100")
    if int(text) < 1:
        raise click.BadParameter(f"{value} allocations: empty the cache after 1 or more allocations, for example "
                                 "--empty-cache-every 100 (leave the option out to replay without emptying it)")
    return int(text)


@click.group()
def allocator():
    """The CUDA caching allocator, simulated: reserved memory, fragmentation, OOMs."""


@allocator.command()
@click.argument("trace_file")
@click.option("--config", "alloc_conf", default="", help="PYTORCH_CUDA_ALLOC_CONF to simulate, "
              "e.g. expandable_segments:True")
@click.option("--capacity", help="Memory cudaMalloc can get (e.g. 24GiB); an OOM is reported where it runs out.  "
              "[default: inferred when the snapshot ends with an out-of-memory error]")
@click.option("--device-total", help="The card's total memory, for the OOM message.  [default: --capacity]")
@click.option("--summary", is_flag=True, help="Print a torch.cuda.memory_summary()-like table.")
@click.option("--snapshot-out", help="Write the final state as a torch snapshot (pickle) "
              "for torch.cuda._memory_viz or pytorch.org/memory_viz.")
@click.option("--advise/--no-advise", default=True, show_default=True,
              help="Replay with other settings and say which would help.")
@click.option("--empty-cache-every", metavar="N", callback=_allocations_count,
              help="Also replay with torch.cuda.empty_cache() after every N allocations (and the frees after "
              "them); compare peak reserved memory and cudaMalloc calls with and without.")
@click.option("--json", "as_json", is_flag=True)
def replay(trace_file, alloc_conf, capacity, device_total, summary, snapshot_out, advise, empty_cache_every, as_json):
    """Replay an allocation trace: a torch snapshot (JSON or pickle) or `llamem trace --save-trace` output.

    Exits with 3 when the replay runs out of memory."""
    from llamem.allocator import parse_alloc_conf
    from llamem.allocator.replay import load_trace, replay_trace
    from llamem.allocator.simulator import check_simulated

    config = parse_alloc_conf(alloc_conf)
    check_simulated(config)
    capacity_bytes, total_bytes = _sizes(capacity, device_total)
    if snapshot_out:
        from llamem.files import check_writable

        check_writable(snapshot_out, "--snapshot-out")
    trace = load_trace(trace_file)
    result = replay_trace(trace, config, capacity_bytes=capacity_bytes, device_total_bytes=total_bytes,
                          record_trace=bool(snapshot_out))
    data = result.to_dict()
    data.update(_advice(trace, result, total_bytes) if advise and not alloc_conf else
                {"advice": [], "advice_summary": None})
    if empty_cache_every:
        from llamem.allocator.replay import empty_cache_comparison

        emptied = replay_trace(trace, config, capacity_bytes=capacity_bytes, device_total_bytes=total_bytes,
                               empty_cache_every=empty_cache_every)
        data["empty_cache"] = empty_cache_comparison(result, emptied)
    if snapshot_out:
        _write_snapshot(result.sim, snapshot_out)
    _emit(data, result.sim if summary else None, as_json)
    if not result.completes:
        return EXIT_DOES_NOT_FIT
    return 0


def _sizes(capacity: str | None, device_total: str | None) -> tuple[int | None, int | None]:
    from llamem.units import format_bytes, parse_size

    capacity_bytes = parse_size(capacity, flag="--capacity") if capacity else None
    total_bytes = parse_size(device_total, flag="--device-total") if device_total else None
    if capacity_bytes is not None and total_bytes is not None and capacity_bytes > total_bytes:
        raise LlamemError(f"--capacity {capacity} ({format_bytes(capacity_bytes)}) is more than --device-total "
                          f"{device_total} ({format_bytes(total_bytes)}): the capacity is what cudaMalloc can get "
                          "of the card's memory; lower --capacity or raise --device-total")
    return capacity_bytes, total_bytes


def _advice(trace, result, total_bytes: int | None) -> dict:
    from llamem.allocator.advice import advise, summarize

    found = advise(trace.replay_events(with_failed_alloc=result.capacity_bytes is not None),
                   result.peak_reserved_bytes, capacity_bytes=result.capacity_bytes,
                   baseline_completes=result.completes, start=result.start, device_total_bytes=total_bytes)
    return {"advice": [dataclasses.asdict(a) for a in found],
            "advice_summary": summarize(found, capacity_bytes=result.capacity_bytes,
                                        baseline_completes=result.completes)}


def _write_snapshot(sim, path: str) -> None:
    import pickle

    from llamem.allocator.snapshot import snapshot

    try:
        with open(path, "wb") as handle:
            pickle.dump(snapshot(sim), handle)
    except OSError as err:
        raise LlamemError(f"--snapshot-out {path}: cannot be written ({err.strerror or err})") from None


def _emit(data: dict, summary_sim, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    from llamem.allocator.snapshot import memory_summary
    from llamem.reporters.allocator import render_replay

    click.echo(render_replay(data))
    if summary_sim is not None:
        click.echo(memory_summary(summary_sim))
