"""The pipeline-parallel launch bundle runs two stages on CPU (gloo) with `torch.distributed.pipelining`:
each stage holds exactly its layers (the first the embedding, the last the final norm and the head), and
its peak stays below `llamem estimate --pp 2`, which sizes the busiest stage as holding both the
embedding and the head (here half of the model)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import H, NORM_BYTES, ROPE_BUFFERS_BYTES, V, _layer_shapes, _plan, _run, config_path  # noqa: E402

from llamem.trace.tracer import rounded  # noqa: E402

__all__ = ["config_path"]  # the fixture


def test_pipeline_bundle_runs_two_stages(config_path, tmp_path):
    plan = _plan(config_path, pp=2, grad_accum=2)
    assert plan.final.layout.microbatches == 2
    ranks = _run(plan, tmp_path / "pp")
    layer = sum(rounded(o * i * 4) for o, i in _layer_shapes()) + 2 * NORM_BYTES
    embedding = head = rounded(V * H * 4)
    stage_bytes = 512  # the stage's own small tensor (PipelineStage's)
    assert ranks[0]["wrapped"] == embedding + layer + ROPE_BUFFERS_BYTES + stage_bytes
    assert ranks[1]["wrapped"] == layer + NORM_BYTES + head + ROPE_BUFFERS_BYTES + stage_bytes
    estimate = plan.final.allocated_bytes
    # The estimate puts the embedding and the head on the busiest stage: measured 1,421,824 and
    # 1,491,456 against 2,230,784.
    assert max(ranks[0]["peak"], ranks[1]["peak"]) < estimate
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the last stage's loss, broadcast
