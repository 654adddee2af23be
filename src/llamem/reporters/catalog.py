"""`llamem gpus` and `llamem models`: the catalogs as tables and JSON."""

from __future__ import annotations

from llamem.units import GB, TB, format_count, to_gib


def gpu_rows(gpus) -> list[dict]:
    return [{**g.__dict__, "usable_bytes": g.usable_bytes} for g in gpus]


def render_gpus(gpus) -> str:
    lines = [f"{'name':<14} {'memory':>10} {'usable':>10} {'bf16':>5} {'fp8':>4} {'16-bit TFLOP/s':>15} "
             f"{'mem TB/s':>9} {'link GB/s':>10}"]
    for g in gpus:
        lines.append(f"{g.name:<14} {to_gib(g.memory_bytes):>6.1f} GiB {to_gib(g.usable_bytes):>6.1f} GiB "
                     f"{'yes' if g.bf16 else 'no':>5} {'yes' if g.fp8 else 'no':>4} {g.bf16_flops / TB:>15.0f} "
                     f"{g.memory_bandwidth / TB:>9.2f} {g.interconnect_bandwidth / GB:>10.0f}")
    return "\n".join(lines)


def model_rows(specs) -> list[dict]:
    return [{"name": s.name, "hf_id": s.hf_id, "num_params": s.num_params, "num_layers": s.num_layers,
             "hidden_size": s.hidden_size, "num_kv_heads": s.num_kv_heads, "vocab_size": s.vocab_size,
             "source": s.source} for s in specs]


def render_models(specs) -> str:
    specs = list(specs)
    width = max([len("name")] + [len(s.name) for s in specs])
    lines = [f"{'name':<{width}} {'params':>9}  {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'vocab':>7}  hf id"]
    for s in specs:
        lines.append(f"{s.name:<{width}} {format_count(s.num_params):>9}  {s.num_layers:>6} {s.hidden_size:>6} "
                     f"{s.num_heads:>5} {s.num_kv_heads:>3} {s.vocab_size:>7}  {s.hf_id}")
    return "\n".join(lines)
