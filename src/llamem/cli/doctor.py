"""`llamem doctor`: this environment, and what it changes for memory."""

from __future__ import annotations

import json

import click

FEATURE_NAMES = {"expandable_segments": "expandable segments", "flash_sdpa": "flash SDPA",
                 "mem_efficient_sdpa": "memory-efficient SDPA", "eight_bit_optimizers": "8-bit optimizers",
                 "quantized_kv_cache": "quantized KV cache"}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def doctor(as_json):
    """What this environment has, and what that changes for memory."""
    from llamem.runtime.doctor import diagnose

    data = diagnose()
    click.echo(json.dumps(data, indent=2) if as_json else render_doctor(data))


def render_doctor(data: dict) -> str:
    lines = [f"python {data['python']} on {data['platform']}, llamem {data['llamem']}", _torch_line(data["torch"]),
             _gpu_line(data["gpus"])]
    lines += [*(f"  {_device(d)}" for d in data["gpus"]["devices"]), "", "packages (installed, checked against)"]
    lines += _package_lines(data["versions"], data["checked_versions"])
    lines += ["", "memory features"]
    width = max(len(name) for name in FEATURE_NAMES.values())
    for key, name in FEATURE_NAMES.items():
        feature = data["features"][key]
        answer = {True: "yes", False: "no", None: "?"}[feature["available"]]
        lines.append(f"  {name:<{width}}  {answer:<3}  {feature['detail']}")
    lines += ["", *_settings_lines(data["allocator_settings"]), ""]
    if not data["version_mismatches"]:
        checked = ", ".join(f"{k} {v}" for k, v in data["checked_versions"].items())
        lines.append(f"versions: those installed are the ones llamem's analytic engine was checked against ({checked})")
    lines += [f"note: {note}" for note in data["notes"]]
    return "\n".join(lines)


def _torch_line(torch: dict) -> str:
    if not torch["importable"]:
        return f"torch: missing ({torch['error']})"
    build = f"CUDA {torch['cuda']}" if torch["cuda"] else f"ROCm/HIP {torch['hip']}" if torch["hip"] else "CPU only"
    devices = f"{torch['num_devices']} device{'' if torch['num_devices'] == 1 else 's'} visible" if \
        torch["cuda_available"] else "no GPU visible to torch"
    return f"torch {torch['version']} ({build}), {devices}"


def _gpu_line(gpus: dict) -> str:
    if gpus["driver_version"] is None:
        return f"GPUs: {gpus['detail']}"
    return f"GPUs: {gpus['detail']}, NVIDIA driver {gpus['driver_version']} (CUDA {gpus['cuda_driver_version']})"


def _device(device: dict) -> str:
    from llamem.units import format_gib

    return f"{device['index']}: {device['name']}, {format_gib(device['total_bytes'])}"


def _package_lines(versions: dict, checked: dict) -> list[str]:
    width = max(len(name) for name in versions)
    lines = []
    for name, version in versions.items():
        shown = version or "not installed"
        lines.append(f"  {name:<{width}}  {shown:<16}{checked.get(name, '')}".rstrip())
    return lines


def _settings_lines(facts: dict) -> list[str]:
    if facts["settings"] is None:
        head = "allocator settings: PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset"
    else:
        state = "valid" if facts["valid"] else f"INVALID: {facts['problem']}"
        head = f"allocator settings: {facts['read']}={facts['settings']} (what torch reads), {state}"
    return [head, *(f"  {note}" for note in facts["notes"])]
