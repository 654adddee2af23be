"""Mixture-of-experts models in the analytic engine: refused, with the engine that sizes them.

The analytic formulas know a dense layer's tensors. A mixture of experts adds what
transformers allocates around its experts (router logits and their fp32 softmax, top-k
indices and weights, grouped_mm's token permutation and per-expert outputs, and each
expert's share of the tokens, which depends on the routing), none of which is modelled
yet. Rather than give a figure that leaves them out, the engine refuses and names the
trace engine, which runs the transformers model itself on fake tensors.
"""

from __future__ import annotations

from llamem.errors import InvalidWorkload
from llamem.model import ModelSpec


def refuse_moe(spec: ModelSpec, role: str = "model") -> None:
    """Raise for a mixture-of-experts model, naming `llamem trace` as the engine to use instead."""
    if not spec.is_moe:
        return
    raise InvalidWorkload([
        f"{spec.name} ({role}) is a mixture of experts ({spec.num_experts} experts, {spec.experts_per_token} per "
        "token): the analytic engine does not model expert routing and dispatch memory. Use the trace engine, "
        f"which runs the transformers model on fake tensors: `llamem trace {spec.hf_id or spec.name} ...` with the "
        "same options (MoE experts need --precision bf16)"])
