"""The code `llamem plan --code` prints runs: executed against a tiny randomly initialised Llama
saved to a temporary folder (no download), with a word-level tokenizer built in memory."""

import dataclasses
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from llamem import build_workload, load_model  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import budget_gpu  # noqa: E402
from llamem.plan import make_plan  # noqa: E402
from llamem.snippet import plan_code  # noqa: E402
from llamem.trace.build import hf_config  # noqa: E402

GiB = 2**30


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    spec = load_model("debug")
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(spec, build_workload(task="train"))).save_pretrained(folder)
    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(64)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(folder)
    return str(folder)


def _run(code: str, model_dir: str, **extra) -> dict:
    namespace: dict = {}
    code = code.replace("prompts = [...]", 'prompts = ["w1 w2 w3"] * BATCH')
    # The code targets a GPU; the Trainer refuses bf16 on a CPU unless told it is one.
    code = code.replace("TrainingArguments(", "TrainingArguments(use_cpu=True, ")
    exec(compile(code, "plan_code", "exec"), {"BATCH": extra.get("batch", 1)}, namespace)  # noqa: S102
    return namespace


def _plan(options: dict, budget_gib: float):
    return make_plan(load_model("debug"), build_workload(**options), budget_gpu(int(budget_gib * GiB)),
                     host_budget_bytes=0)


def test_lora_code_builds_the_planned_model_and_arguments(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan(dict(task="lora", batch=8, seq=4096), 0.55)
    w = plan.final.workload
    assert plan.fits and w.ac_every == 1  # the budget needs full checkpointing (0.6 GiB: selective every 2)
    code = plan_code(plan, model_id=tiny_model)
    done = _run(code, tiny_model)
    from peft import PeftModel

    assert isinstance(done["model"], PeftModel)
    assert done["model"].peft_config["default"].r == w.lora_rank
    args = done["args"]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (w.batch, w.grad_accum)
    assert args.activation_checkpointing


def test_every_k_checkpointing_is_a_trainer_option(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan(dict(task="lora", batch=8, seq=4096), 0.6)
    plan = dataclasses.replace(plan, final=dataclasses.replace(
        plan.final, workload=dataclasses.replace(plan.final.workload, ac_every=2)))
    done = _run(plan_code(plan, model_id=tiny_model), tiny_model)
    assert done["args"].activation_checkpointing_kwargs["every_n_layers"] == 2


def test_full_training_code_keeps_mixed_precision(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan(dict(task="train", precision="bf16-mixed", optimizer="adamw", batch=2, seq=256), 4)
    assert plan.fits and plan.final.workload.precision == "bf16-mixed"
    done = _run(plan_code(plan, model_id=tiny_model), tiny_model)
    import torch

    assert done["model"].dtype == torch.float32 and done["args"].bf16
    assert done["args"].optim.value == "adamw_torch"


def test_generation_code_runs_chunked_prefill(tiny_model):
    plan = _plan(dict(task="infer", batch=2, seq=2048, new_tokens=3), 0.44)
    w = plan.final.workload
    assert plan.fits and 0 < w.prefill_chunk < w.seq and w.quant == "none" and w.kv_dtype == "bf16"
    code = plan_code(plan, model_id=tiny_model)
    assert f"prefill_chunk_size={w.prefill_chunk}" in code
    done = _run(code, tiny_model, batch=w.batch)
    assert done["outputs"].shape[0] == w.batch


def test_plan_json_carries_the_code(capsys):
    # 131072 tokens fit no configuration of a 24 GB card, so the plan splits each sequence (65536 fit whole,
    # with Liger's kernels, checkpointing and offloading)
    assert main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "qlora", "--seq", "131072", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    code = data["final"]["code"]
    assert 'bnb_4bit_quant_type="nf4"' in code and "prepare_model_for_kbit_training" in code
    assert f"MAX_LENGTH = {data['final']['config']['workload']['seq']}" in code
    compile(code, "plan_code", "exec")


def test_zero3_code_configures_deepspeed_before_loading(capsys):
    assert main(["plan", "llama-2-70b", "--gpu", "a100-80gb", "--gpus", "8", "--task", "train", "--batch", "8",
                 "--seq", "4096", "--host-memory", "2TiB", "--engine", "deepspeed", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    code, layout = data["final"]["code"], data["final"]["config"]["layout"]
    assert layout["sharding"] == "zero3"
    assert '"stage": 3' in code and code.index("args = TrainingArguments(") < code.index("AutoModelForCausalLM.from_pretrained(")
    assert "torchrun --nnodes 1 --nproc_per_node 8" in code


def test_tensor_parallel_code_says_what_runs_it(capsys):
    """A tensor-parallel plan: the Trainer code says it does not run that layout and where the bundle is, not DDP."""
    assert main(["plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--gpus", "2", "--task", "train", "--batch", "8",
                 "--seq", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    code, layout = data["final"]["code"], data["final"]["config"]["layout"]
    assert layout["tp"] == 2 and layout["pp"] == 1
    assert "DDP" not in code and "pipeline parallel" not in code
    assert "# Tensor parallel x2: this Trainer code does not run the layout as sized" in code
    assert "# Add --emit DIR to this plan command: it writes a torchrun bundle that runs it" in code
    compile(code, "plan_code", "exec")


def test_no_code_for_a_plan_that_does_not_fit(capsys):
    assert main(["plan", "llama-2-70b", "--gpu", "rtx-4090", "--task", "train", "--code"]) == 3
    assert "from_pretrained" not in capsys.readouterr().out
