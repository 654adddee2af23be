"""The technique registry: one record per setting, every field rendered once, every option documented."""

import dataclasses
import re
from pathlib import Path

from llamem import build_workload
from llamem.cli import app
from llamem.techniques import BY_NAME, LADDER_ORDER, RECORDS, RENDER_ORDER, workload_args, workload_labels
from llamem.workload import FIELD_TASKS, Workload

DOCS = Path(__file__).resolve().parent.parent / "docs" / "memory-model.md"


def test_every_workload_field_is_rendered_by_exactly_one_record():
    rendered = [f for name in RENDER_ORDER for f in BY_NAME[name].fields]
    fields = [f.name for f in dataclasses.fields(Workload) if not f.name.startswith("_")]
    assert sorted(rendered) == sorted(fields)
    assert set(FIELD_TASKS) == set(fields)


def test_the_ladder_names_techniques_in_the_documented_order():
    techniques = [r.name for r in RECORDS if r.is_technique]
    assert [name for name in LADDER_ORDER if name != "layout"] == techniques


def test_reproduce_arguments_rebuild_the_workload():
    w = build_workload(task="qlora", batch=3, seq=700, lora_rank=16, lora_targets=("q_proj", "o_proj"), ac_every=2,
                       loss="chunked", grad_accum=4, attn="eager", optimizer="adamw")
    args = workload_args(w)
    assert args == ["--task", "qlora", "--batch", "3", "--seq", "700", "--precision", "bf16", "--optimizer", "adamw",
                    "--ac", "every-2", "--grad-accum", "4", "--loss", "chunked", "--quant", "nf4", "--lora-rank", "16",
                    "--lora-targets", "q_proj,o_proj", "--attn", "eager"]
    assert workload_labels(w) == ["qlora", "batch 3 x seq 700", "bf16", "adamw", "ac every-2", "grad-accum 4",
                                  "chunked loss", "nf4", "LoRA r=16 on q_proj,o_proj", "eager"]


def test_every_estimate_option_is_in_the_docs_table():
    table = DOCS.read_text().split("## Flags, fields and formulas", 1)[1]
    documented = set(re.findall(r"`(--[a-z0-9-]+)`", table))
    options = {opt for param in app.commands["estimate"].params for opt in param.opts if opt.startswith("--")}
    assert options - {"--config", "--override", "--json", "--html", "--help"} <= documented
