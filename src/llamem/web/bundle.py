"""`llamem plan --emit`'s files, built in memory: the page shows them and the server writes nothing.

The files are assembled exactly as `llamem.bundle.emit.emit_bundle` assembles them before writing
(a test holds the two equal, file by file)."""

from __future__ import annotations

import json

from llamem.errors import LlamemError


def bundle_files(plan, engine: str = "any") -> dict:
    """{"files": {name: text}, "strategy", "launcher", "unsupported"}, or {"message"} where `--emit`
    writes nothing (a plan that does not fit, Megatron-LM, a configuration without a bundle)."""
    from llamem.bundle import emit

    if not plan.fits:
        return {"message": "no bundle: the plan does not fit"}
    if engine == "megatron":
        return {"message": "no bundle: --engine megatron prints Megatron-LM arguments only"}
    bundle_engine = emit.PLAN_ENGINES[engine]
    w, layout = plan.final.workload, plan.final.layout
    try:
        strategy, launcher = emit.choose(layout, bundle_engine, adapters=w.uses_adapters)
    except LlamemError as err:
        return {"message": f"no bundle: {err}"}
    unsupported = emit.unsupported_reason(w, layout, strategy)
    if unsupported:
        return {"message": f"no bundle: the plan's configuration ({layout.describe()}) has none: {unsupported}"}
    return {"files": _files(plan, strategy, launcher), "strategy": strategy, "launcher": launcher}


def _files(plan, strategy: str, launcher: str) -> dict[str, str]:
    from llamem.bundle import emit

    w, layout = plan.final.workload, plan.final.layout
    processes = emit._processes(plan)
    settings = emit.train_settings(plan, strategy, launcher, None, None)
    title = f"{plan.model.name}: {layout.describe()} on {plan.num_gpus} x {plan.gpu.name}, planned by llamem"
    files = {"train.py": emit.train_script(w, settings, title),
             "launch.sh": emit.launch_script(launcher=launcher, processes=processes, title=title, unsupported=None),
             "slurm.sbatch": emit.slurm_script(launcher=launcher, processes=processes, title=title),
             "config.json": json.dumps(emit.hf_config_dict(plan.model), indent=2) + "\n"}
    if strategy == "deepspeed":
        files["ds_config.json"] = json.dumps(emit.ds_config(w, layout, plan.model.hidden_size), indent=2) + "\n"
    if launcher == "accelerate":
        files["accelerate.yaml"] = emit.to_yaml(emit.accelerate_config(w, layout, strategy, nodes=processes.nodes,
                                                                       model_type=plan.model.model_type))
    files["README.md"] = emit.readme(plan, strategy=strategy, launcher=launcher, processes=processes,
                                     unsupported=None, files=sorted(files))
    return dict(sorted(files.items()))
