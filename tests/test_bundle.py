"""Launch bundles (`llamem plan --emit`): the configs they write are accepted by DeepSpeed's and
accelerate's own loaders, launch.sh parses (and refuses what it cannot run), train.py loads the
model as the snippet does, and the README carries the plan's figures."""

from __future__ import annotations

import ast
import json
import runpy
import subprocess
import sys
import warnings

import pytest

from llamem.bundle import emit_bundle, layout_plan
from llamem.bundle.emit import choose, train_settings
from llamem.cli import main
from llamem.errors import LlamemError
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.parallel import make_layout
from llamem.units import format_gib
from llamem.workload import build_workload

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
DS_LAYOUTS = [("zero1", "none"), ("zero1", "optimizer"), ("zero2", "none"), ("zero2", "optimizer"),
              ("zero3", "none"), ("zero3", "optimizer"), ("zero3", "optimizer+params")]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def _plan(config_path, sharding="ddp", offload="none", gpus=2, tp=1, **workload):
    spec = load_model(None, config_path=str(config_path))
    task = workload.pop("task", "train")
    # The settings these bundles were written against (before the defaults followed the Trainer's).
    old = {"precision": "bf16-mixed", "optimizer": "adamw"} if task in ("train", "distill") else {"optimizer": "adamw"}
    w = build_workload(task, **{"batch": 2, "seq": 16, **old, **workload})
    layout = make_layout(spec, w, gpus=gpus, tp=tp, sharding=sharding, offload=offload)
    return layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))


def _emit(plan, folder, engine="any"):
    bundle = emit_bundle(plan, folder, engine=engine)
    return bundle, {name: (folder / name).read_text() for name in bundle.files}


# Which engine runs which layout -------------------------------------------------------------------
def test_each_layout_gets_the_engine_that_runs_it_as_sized(config_path):
    layouts = {s: _plan(config_path, s).final.layout for s in ("ddp", "zero1", "zero2", "zero3")}
    offloaded = _plan(config_path, "zero3", "optimizer").final.layout
    assert choose(layouts["ddp"], "any") == ("ddp", "torchrun")
    assert choose(layouts["zero3"], "any") == ("fsdp2", "torchrun")
    assert choose(layouts["zero2"], "any") == ("deepspeed", "deepspeed")
    assert choose(offloaded, "any") == ("deepspeed", "deepspeed")
    assert choose(layouts["zero3"], "deepspeed") == ("deepspeed", "deepspeed")
    assert choose(layouts["zero1"], "accelerate") == ("deepspeed", "accelerate")
    assert choose(layouts["zero3"], "accelerate") == ("fsdp2", "accelerate")
    with pytest.raises(LlamemError, match="runs with DeepSpeed.*engine 'deepspeed' or 'accelerate'"):
        choose(layouts["zero2"], "torchrun")
    with pytest.raises(LlamemError, match="no ZeRO stage.*engine 'torchrun'"):
        choose(layouts["ddp"], "deepspeed")


def test_a_bad_engine_or_folder_is_refused_with_the_fix(config_path, tmp_path):
    plan = _plan(config_path)
    with pytest.raises(LlamemError, match="engine 'horovod' is not one of: any, torchrun, deepspeed, accelerate"):
        emit_bundle(plan, tmp_path / "b", engine="horovod")
    (tmp_path / "file").write_text("")
    with pytest.raises(LlamemError, match="is a file; give a folder"):
        emit_bundle(plan, tmp_path / "file")


# DeepSpeed's and accelerate's own loaders ---------------------------------------------------------
@pytest.mark.parametrize("sharding,offload", DS_LAYOUTS)
def test_deepspeed_config_class_accepts_every_ds_config(config_path, tmp_path, sharding, offload):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = _plan(config_path, sharding, offload, grad_accum=3, batch=1)
    bundle, files = _emit(plan, tmp_path, engine="deepspeed")  # ZeRO-3 alone would run FSDP2 under "any"
    assert bundle.strategy == "deepspeed" and "ds_config.json" in files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DeepSpeedConfig(json.loads(files["ds_config.json"]))  # no process group: world size 1
    zero = config.zero_config
    assert zero.stage == int(sharding[-1])
    assert (zero.offload_optimizer.device if zero.offload_optimizer else "none") == (
        "cpu" if offload != "none" else "none")
    assert (zero.offload_param.device if zero.offload_param else "none") == (
        "cpu" if offload == "optimizer+params" else "none")
    assert zero.reduce_bucket_size == 64 * 64  # hidden_size squared, not DeepSpeed's 5e8-element default
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps, config.train_batch_size) == (
        1, 3, 3)
    assert config.gradient_clipping == 1.0 and config.bfloat16_config.enabled and not config.float16_config.enabled
    # Named in the config, so DeepSpeed builds it: its CPU Adam when offloading (a torch optimizer is refused).
    assert config.optimizer_name == "adamw" and config.optimizer_params["weight_decay"] == 0.01


def test_deepspeed_config_for_fp16_and_sgd(config_path, tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = _plan(config_path, "zero2", precision="fp16-mixed", optimizer="sgd")
    _bundle, files = _emit(plan, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DeepSpeedConfig(json.loads(files["ds_config.json"]))
    assert config.float16_config.enabled and not config.bfloat16_config.enabled
    assert config.optimizer_name == "SGD" and config.zero_allow_untested_optimizer


@pytest.mark.parametrize("sharding,offload,kind", [("none", "none", "NO"), ("ddp", "none", "MULTI_GPU"),
                                                   ("zero3", "none", "FSDP"), ("zero2", "optimizer", "DEEPSPEED"),
                                                   ("zero3", "optimizer+params", "DEEPSPEED")])
def test_accelerate_loads_and_validates_every_yaml(config_path, tmp_path, monkeypatch, sharding, offload, kind):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    gpus = 1 if sharding == "none" else 2
    plan = _plan(config_path, sharding, offload, gpus=gpus)
    bundle, files = _emit(plan, tmp_path, engine="accelerate")
    assert bundle.launcher == "accelerate" and "accelerate.yaml" in files
    config = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert (config.distributed_type.value, config.num_processes, config.num_machines) == (kind, gpus, 1)
    monkeypatch.chdir(tmp_path)  # launch.sh runs accelerate from the bundle's folder
    args, _defaults, _mixed = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", "accelerate.yaml", "train.py"]))
    assert (args.use_fsdp, args.use_deepspeed, args.multi_gpu) == (kind == "FSDP", kind == "DEEPSPEED",
                                                                   kind == "MULTI_GPU")
    if kind == "FSDP":
        assert (args.fsdp_version, args.fsdp_transformer_layer_cls_to_wrap, args.mixed_precision) == (
            2, "LlamaDecoderLayer", "bf16")
    if kind == "DEEPSPEED":
        assert args.deepspeed_config_file == "ds_config.json" and args.mixed_precision == "no"


def test_accelerate_takes_the_deepspeed_file_without_conflicting_settings(config_path, tmp_path, monkeypatch):
    """accelerate refuses a config that sets precision, accumulation, clipping, stage or offload beside a
    DeepSpeed config file; DeepSpeedPlugin runs that check from the launcher's environment."""
    pytest.importorskip("deepspeed")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    _emit(_plan(config_path, "zero2", "optimizer"), tmp_path, engine="accelerate")
    monkeypatch.chdir(tmp_path)
    args, defaults, from_config = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", "accelerate.yaml", "train.py"]))
    args.deepspeed_fields_from_accelerate_config = ",".join(
        [*defaults.deepspeed_config, *(["mixed_precision"] if from_config else [])])  # as launch_command does
    _cmd, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 2
    assert plugin.hf_ds_config.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu",
                                                                                    "pin_memory": True}


# launch.sh ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding,offload,engine", [("ddp", "none", "any"), ("zero3", "none", "any"),
                                                     ("zero2", "optimizer", "any"), ("zero3", "none", "accelerate")])
def test_launch_sh_parses_and_starts_one_process_per_gpu(config_path, tmp_path, sharding, offload, engine):
    _bundle, files = _emit(_plan(config_path, sharding, offload), tmp_path, engine)
    assert subprocess.run(["bash", "-n", str(tmp_path / "launch.sh")]).returncode == 0
    script = files["launch.sh"]
    assert ('--nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:"${MASTER_PORT:-29500}" '
            'train.py "$@"') in script  # --cpu: the planned processes on this machine
    launcher = {"any": {"ddp": "torchrun", "zero3": "torchrun", "zero2": "deepspeed"}[sharding]}.get(engine, engine)
    expected = {"torchrun": ('--nnodes "$NNODES" --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint '
                             '"${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" train.py "$@"'),
                "deepspeed": 'exec deepspeed --num_gpus 2 --master_port "${MASTER_PORT:-29500}" train.py "$@"',
                "accelerate": "exec accelerate launch --config_file accelerate.yaml"}[launcher]
    assert expected in script


def test_tensor_parallel_with_data_parallel_bundle_says_why_and_exits_1(config_path, tmp_path):
    bundle, files = _emit(_plan(config_path, "ddp", gpus=4, tp=2), tmp_path)
    why = ("tensor parallel bundles run one replica, without data parallel, ZeRO or offload: choose --gpus so the "
           "plan uses data parallel / ZeRO")
    assert bundle.unsupported == why
    assert f"**This bundle does not run the plan: {why}.**" in files["README.md"]
    run = subprocess.run(["bash", str(tmp_path / "launch.sh"), "--cpu"], capture_output=True, text=True)
    assert (run.returncode, run.stdout, run.stderr) == (1, "", f"error: {why}\n")


# train.py ----------------------------------------------------------------------------------------
def _plan_literal(text: str) -> dict:
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "PLAN")
    return ast.literal_eval(node.value)


def test_train_py_carries_the_plan_settings(config_path, tmp_path):
    plan = _plan(config_path, "zero3", ac_every=1, grad_accum=2, batch=1, loss="chunked")
    _bundle, files = _emit(plan, tmp_path)
    settings = _plan_literal(files["train.py"])
    assert settings == train_settings(plan, "fsdp2", "torchrun", None, None)
    assert {k: settings[k] for k in ("micro_batch", "grad_accum", "seq", "ac_every", "loss", "precision")} == {
        "micro_batch": 1, "grad_accum": 2, "seq": 16, "ac_every": 1, "loss": "chunked", "precision": "bf16-mixed"}
    assert settings["peak_allocated_bytes"] == plan.final.allocated_bytes
    assert json.loads(files["config.json"]) == TINY


def test_train_py_loads_the_model_with_the_snippets_lines(config_path, tmp_path):
    """The LoRA plan's load_model runs the peft lines `llamem plan --code` prints, on a random init."""
    pytest.importorskip("peft")
    plan = _plan(config_path, "ddp", task="lora", lora_rank=4)
    _bundle, files = _emit(plan, tmp_path)
    assert ('model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], '
            'task_type="CAUSAL_LM"))') in files["train.py"]
    namespace = runpy.run_path(str(tmp_path / "train.py"), run_name="bundle")
    model = namespace["load_model"](True, None)
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    assert len(adapters) == 2 * 2 * 2  # A and B on q_proj and v_proj of 2 layers
    base = next(p for name, p in model.named_parameters() if name.endswith("q_proj.base_layer.weight"))
    assert str(base.dtype) == "torch.bfloat16" and not base.requires_grad


def test_train_py_steps_under_accelerate(config_path, tmp_path):
    """The accelerate path of train.py: accumulate, backward, clip and step through an Accelerator (here one
    CPU process, where accelerate wraps nothing; on GPUs its config adds DDP, FSDP2 or DeepSpeed)."""
    pytest.importorskip("accelerate")
    import torch

    _emit(_plan(config_path, "none", gpus=1, grad_accum=2, batch=1), tmp_path, engine="accelerate")
    namespace = runpy.run_path(str(tmp_path / "train.py"), run_name="bundle")
    plan = namespace["PLAN"]
    args = namespace["parse_args"](plan, ["--random-init"])
    module = namespace["build_model"](plan, namespace["load_model"], args)
    before = module.model.lm_head.weight.detach().clone()
    run = namespace["wrap_accelerate"](plan, module, torch.device("cpu"))
    loss = namespace["train_step"](run, plan, torch.Generator().manual_seed(0))
    assert type(run).__name__ == "AccelerateRun" and 5 < loss < 8  # about ln(512) for random weights
    assert not torch.equal(before, module.model.lm_head.weight)  # one optimizer step after 2 micro-batches
    assert all(p.grad is None for p in module.parameters())


def test_train_py_refuses_what_it_cannot_run(config_path, tmp_path):
    """A plan of a config file names no checkpoint: train.py asks for --model or --random-init."""
    _emit(_plan(config_path, "ddp"), tmp_path)
    run = subprocess.run([sys.executable, str(tmp_path / "train.py"), "--cpu"], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.endswith("error: the plan names no checkpoint (its model came from a config file): pass "
                               "--model ID_OR_PATH, or --random-init to build it from config.json\n")


# README ------------------------------------------------------------------------------------------
def test_readme_has_the_plans_figures_and_how_to_launch(config_path, tmp_path):
    from llamem.reporters.plan_report import render_plan

    plan = _plan(config_path, "ddp")
    _bundle, files = _emit(plan, tmp_path)
    readme, final = files["README.md"], plan.final
    assert readme.startswith(f"# {plan.model.name}: ddp x2 on 2 x h100-80gb\n")
    assert render_plan(plan) in readme
    assert (f"Per GPU: **{format_gib(final.device_bytes)}** of device memory ({final.device_bytes:,} bytes; "
            f"{final.allocated_bytes:,} bytes allocated by PyTorch at the peak)") in readme
    assert f"    {plan.command}\n" in readme
    assert "NNODES=2 NODE_RANK=0 MASTER_ADDR=<node 0's address> MASTER_PORT=29500 bash launch.sh" in readme
    assert "    bash launch.sh --cpu --random-init --max-steps 2" in readme
    assert f"compare with `peak_allocated_bytes` of `{plan.command} --json` ({final.allocated_bytes:,})" in readme


# The command line --------------------------------------------------------------------------------
def test_plan_emit_writes_the_bundle_of_the_planned_configuration(config_path, tmp_path, capsys):
    code = main(["plan", "--config", str(config_path), "--budget", "8GiB", "--batch", "2", "--seq", "16",
                 "--emit", str(tmp_path / "one")])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[-1] == (f"bundle: {tmp_path / 'one'}/ (README.md, config.json, launch.sh, slurm.sbatch, train.py); "
                                    f"bash {tmp_path / 'one'}/launch.sh (--cpu --random-init --max-steps 2 rehearses "
                                    "it on CPU)")
    assert _plan_literal((tmp_path / "one" / "train.py").read_text())["strategy"] == "single"


def test_plan_emit_with_json_keeps_stdout_one_document(config_path, tmp_path, capsys):
    """The planner spreads this tiny model over a pipeline, which the bundle runs: the JSON on stdout says
    where the bundle is, the line that says so goes to stderr."""
    code = main(["plan", "--config", str(config_path), "--budget", "8GiB", "--gpus", "2", "--batch", "4",
                 "--seq", "64", "--precision", "bf16-mixed", "--optimizer", "adamw", "--json",
                 "--emit", str(tmp_path / "two")])
    captured = capsys.readouterr()
    assert code == 0
    data = json.loads(captured.out)
    assert data["final"]["config"]["layout"]["pp"] == 2
    assert data["bundle"]["directory"] == str(tmp_path / "two") and data["bundle"]["strategy"] == "pp"
    assert captured.err.strip() == (f"bundle: {tmp_path / 'two'}/ (README.md, config.json, launch.sh, slurm.sbatch, "
                                    f"train.py); bash {tmp_path / 'two'}/launch.sh (--cpu --random-init --max-steps 2 "
                                    "rehearses it on CPU)")


def test_writing_a_bundle_needs_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, llamem.bundle; print('torch' in sys.modules)"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_emit_refuses_folders_it_did_not_write(tmp_path):
    """--emit never overwrites files it did not write: a folder holding others is refused (`/` too),
    an empty one or one an earlier --emit wrote is used; an empty name is a usage error."""
    from llamem.bundle.emit import MARKER, _folder, shown_path
    from llamem.errors import LlamemError, UsageError

    other = tmp_path / "other"
    other.mkdir()
    (other / "train.py").write_text("keep")
    for folder in (other, tmp_path.anchor):
        with pytest.raises(LlamemError, match="holds files llamem did not write"):
            _folder(folder)
    assert (other / "train.py").read_text() == "keep"
    assert _folder(tmp_path / "new") == tmp_path / "new" and (tmp_path / "new" / MARKER).exists()
    (tmp_path / "new" / "README.md").write_text("an earlier bundle")
    assert _folder(tmp_path / "new") == tmp_path / "new"
    with pytest.raises(UsageError, match="--emit needs a folder name"):
        _folder("")
    with pytest.raises(LlamemError, match="name too long; choose another folder"):
        _folder(tmp_path / ("a" * 300))
    assert shown_path("odd dir $(x)") == "'odd dir $(x)'"
    assert shown_path("ctl\x1b[31m") == "'ctl\\x1b[31m'"
