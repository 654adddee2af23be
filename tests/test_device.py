"""The device figure: one definition for estimate, plan and trace, monotone in batch and sequence."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamem import build_workload, load_model
from llamem.cli import main
from llamem.device import MIN_PROBE_SEQ, device_memory, lattice, probe_shapes
from llamem.allocator.replay import runs_on_card, smallest_card
from llamem.analytic import estimate
from llamem.analytic.schedule import schedule
from llamem.overhead import non_torch_bytes
from llamem.sizing import estimate_report

DEBUG = load_model("debug")


def device_bytes(spec, **options) -> int:
    w = build_workload(**options)
    return device_memory(spec, w, estimate(spec, w).peak_allocated_bytes).device_bytes


def test_lattice_doubles_from_512():
    assert lattice(100) == [512]
    assert lattice(4096) == [512, 1024, 2048, 4096] and lattice(4095) == [512, 1024, 2048]
    # Growing the size only adds probes: the sets are nested.
    assert set(lattice(3000)) <= set(lattice(5000))


def test_probes_are_batch_one_rows_except_eager_attention():
    assert probe_shapes(build_workload(task="lora", batch=4, seq=1024)) == [(1, s) for s in lattice(4096)]
    eager = probe_shapes(build_workload(task="lora", batch=3, seq=1024, attn="eager"))
    assert {b for b, _ in eager} == {1, 2} and {s for _, s in eager} == set(lattice(1024))


def test_smallest_card_replays_and_one_step_less_does_not():
    events = schedule(DEBUG, build_workload(task="train", batch=2, seq=256))
    allocated, card = smallest_card(events)
    assert runs_on_card(events, card) is not None
    assert card >= allocated


def test_device_is_allocated_plus_fragmentation_plus_non_torch():
    w = build_workload(task="lora", batch=2, seq=300)
    report = estimate_report(DEBUG, w)
    device = report.device
    assert device.device_bytes == report.peak_allocated_bytes + device.fragmentation_bytes + non_torch_bytes(1)
    assert device.fragmentation_bytes >= 0
    # Under 512 tokens the 512-token probe stands for the shape: its schedule runs within the figure.
    probe = build_workload(task="lora", batch=1, seq=MIN_PROBE_SEQ)
    events = schedule(DEBUG, probe)
    from llamem.allocator.replay import peak_allocated_bytes

    assert runs_on_card(events, peak_allocated_bytes(events) + device.fragmentation_bytes) is not None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task=st.sampled_from(["train", "lora", "qlora", "infer"]),
       batches=st.lists(st.integers(1, 6), min_size=2, max_size=3, unique=True),
       seqs=st.lists(st.integers(1, 1200), min_size=2, max_size=3, unique=True),
       eager=st.booleans())
def test_device_bytes_are_monotone_on_random_grids(task, batches, seqs, eager):
    options = dict(task=task, attn="eager" if eager else "sdpa")
    grid = {(b, s): device_bytes(DEBUG, batch=b, seq=s, **options) for b in sorted(batches) for s in sorted(seqs)}
    for (b, s), value in grid.items():
        for (b2, s2), other in grid.items():
            if b2 >= b and s2 >= s:
                assert other >= value, (task, eager, (b, s), (b2, s2))


def test_an_8b_grid_is_monotone_where_exact_shapes_are_not():
    # Batch 3 of an 8B full fine-tune fragments more than batch 4 (its blocks line up worse): the
    # exact shapes' smallest cards go down, the device figure does not.
    spec = load_model("llama-3.1-8b")
    rows = {b: estimate_report(spec, build_workload(task="train", precision="bf16-mixed", optimizer="adamw", batch=b,
                                                    seq=1024)).device for b in (3, 4)}
    assert rows[3].exact_shape_device_bytes > rows[4].exact_shape_device_bytes
    assert rows[3].device_bytes <= rows[4].device_bytes


def test_estimate_and_plan_agree_byte_for_byte(capsys):
    assert main(["plan", "debug", "--budget", "1GiB", "--task", "lora", "--seq", "512", "--batch", "4",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main([*plan["final"]["command"].split()[1:], "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["device_bytes"] == plan["final"]["peak_device_bytes"]
