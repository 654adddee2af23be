"""How a bundle names and places a layout: the description its files print, and a generation's device_map."""

from __future__ import annotations

from llamem.parallel import Layout


def describe(layout: Layout, strategy: str) -> str:
    """The layout as the bundle runs it: a generation's pipeline stages are a device_map."""
    if strategy == "device_map":
        return f"device_map over {layout.pp} GPUs (layers split, one GPU busy at a time)"
    return layout.describe()


def device_map(num_layers: int, gpus: int) -> dict[str, int]:
    """transformers' device_map of a layer split over `gpus` GPUs as llamem sizes it (`llamem.parallel`:
    ceil(L/p) layers per GPU): the embedding and RoPE on the first, the final norm and the head on the last."""
    per = -(-num_layers // gpus)
    layers = {f"model.layers.{index}": index // per for index in range(num_layers)}
    return {"model.embed_tokens": 0, "model.rotary_emb": 0, **layers, "model.norm": gpus - 1, "lm_head": gpus - 1}
