"""Launch bundles: a plan's final configuration as a folder that runs it.

`emit_bundle(plan, directory)` writes train.py, launch.sh (torchrun, the DeepSpeed launcher or
accelerate), ds_config.json or accelerate.yaml where the engine needs one, the model's
config.json and a README with the plan's figures. `bash launch.sh --cpu --random-init` runs the
planned processes on CPU, each rank's memory counted by llamem (`llamem.bundle.ranks`).

Writing a bundle needs no torch; only train.py and `llamem.bundle.ranks` import it.
"""

from __future__ import annotations

from llamem.bundle.emit import ENGINES, Bundle, emit_bundle, layout_plan

__all__ = ["ENGINES", "Bundle", "emit_bundle", "layout_plan"]
