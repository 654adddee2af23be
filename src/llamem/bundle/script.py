"""train.py (generate.py): the plan's settings and model-loading code, `common_body.py`'s text (what both
scripts share), then `train_body.py`'s (`generate_body.py`'s).

The model is loaded by the lines `llamem plan --code` prints (`llamem.techniques.workload_code`:
dtype, attention, quantization, LoRA), so the bundle and the snippet cannot disagree.
"""

from __future__ import annotations

import ast
from pathlib import Path

from llamem.teacher_placement import teacher_workload
from llamem.techniques import workload_code
from llamem.workload import Workload

BODY = Path(__file__).with_name("train_body.py")
GENERATE_BODY = Path(__file__).with_name("generate_body.py")
COMMON_BODY = Path(__file__).with_name("common_body.py")
COMMON_MODULE = "llamem.bundle.common_body"


def train_script(w: Workload, settings: dict, title: str) -> str:
    """train.py; a distillation's also loads its teacher (`load_teacher`)."""
    return _script("train.py", BODY, w, settings, title, extra="", teacher=w.task == "distill")


def generate_script(w: Workload, settings: dict, title: str) -> str:
    """generate.py: the same settings and model loading, and `generate`'s options as `llamem plan --code`
    prints them."""
    options = "GENERATE_OPTIONS = dict(" + ", ".join(workload_code(w).generate_options) + ")"
    return _script("generate.py", GENERATE_BODY, w, settings, title, extra=options)


def _script(name: str, body: Path, w: Workload, settings: dict, title: str, extra: str,
            teacher: bool = False) -> str:
    imports, code = _inlined(body)
    parts = [f'#!/usr/bin/env python\n"""{title}\n\nWritten by `llamem plan --emit`; launch it with launch.sh '
             f'(README.md). `python {name} --help` lists its options.\n"""\n\nfrom __future__ import annotations\n',
             imports, _model_imports(w, teacher), _plan_literal(settings), *([extra] if extra else []), "", "",
             _load_model(w), *([_load_teacher(w)] if teacher else []), code.rstrip("\n"), "", "",
             'if __name__ == "__main__":',
             "    main(PLAN, load_model" + (", load_teacher=load_teacher)" if teacher else ")")]
    return "\n".join(parts) + "\n"


def _inlined(body: Path) -> tuple[str, str]:
    """The body's imports with those `common_body.py` needs added to its first (standard library) block,
    and `common_body.py`'s code before the body's: one standalone script."""
    common_imports, common_code = _body_parts(COMMON_BODY.read_text())
    imports, code = _body_parts(_without_common_import(body.read_text()))
    blocks = [block.splitlines() for block in imports.strip("\n").split("\n\n")]
    missing = [line for line in common_imports.splitlines() if line and line not in blocks[0]]
    blocks[0] = sorted(blocks[0] + missing, key=lambda line: (line.startswith("from "), line.split()[1]))
    merged = "\n\n".join("\n".join(block) for block in blocks if block) + "\n"
    return merged, common_code.rstrip("\n") + "\n\n\n" + code


def _without_common_import(text: str) -> str:
    """The body without its import of `common_body`'s names (the script holds them itself)."""
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ImportFrom) and node.module == COMMON_MODULE:
            del lines[node.lineno - 1:node.end_lineno]
            break
    return "\n".join(lines) + "\n"


def _body_parts(text: str) -> tuple[str, str]:
    """(the body's imports, the rest), without its docstring and its `from __future__` line."""
    tree = ast.parse(text)
    lines = text.splitlines()
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               and getattr(n, "module", None) != "__future__"]
    start, end = imports[0].lineno - 1, imports[-1].end_lineno
    return "\n".join(lines[start:end]) + "\n", "\n".join(lines[end:]).lstrip("\n")


def _model_imports(w: Workload, teacher: bool = False) -> str:
    code = workload_code(w)
    teacher_imports = workload_code(teacher_workload(w)).imports if teacher else []
    names = ["AutoConfig", "AutoModelForCausalLM",
             *dict.fromkeys(i for i in [*code.imports, *teacher_imports] if i != "TrainingArguments")]
    lines = ["from transformers import " + ", ".join(names)]
    if w.uses_adapters:
        lines.append("from peft import LoraConfig, get_peft_model" +
                     (", prepare_model_for_kbit_training" if w.task == "qlora" else ""))
    return "\n".join(lines) + "\n"


def _load_model(w: Workload) -> str:
    code = workload_code(w)
    built = [o for o in code.load_options if not o.startswith("quantization_config")]
    body = [*code.before_load,
            "if random_init:",
            "    config = AutoConfig.from_pretrained(Path(__file__).resolve().parent)  # the bundle's config.json",
            f"    model = AutoModelForCausalLM.from_config(config, {', '.join(built)})",
            "else:",
            f"    model = AutoModelForCausalLM.from_pretrained(checkpoint, {', '.join(code.load_options)})",
            *code.after_load, "return model"]
    return "\n".join(['def load_model(random_init: bool, checkpoint: str | None):',
                      '    """The model as the plan loads it: the lines `llamem plan --code` prints."""',
                      *("    " + line for line in body)]) + "\n\n"


def _load_teacher(w: Workload) -> str:
    """load_teacher: the frozen teacher as `llamem` sizes it, bf16 or quantized by bitsandbytes while loading."""
    code = workload_code(teacher_workload(w))
    built = [o for o in code.load_options if not o.startswith("quantization_config")]
    body = [*code.before_load,
            "if random_init:",
            '    config = AutoConfig.from_pretrained(Path(__file__).resolve().parent / "teacher_config.json")',
            f"    return AutoModelForCausalLM.from_config(config, {', '.join(built)})",
            f"return AutoModelForCausalLM.from_pretrained(checkpoint, {', '.join(code.load_options)})"]
    return "\n".join(['def load_teacher(random_init: bool, checkpoint: str | None):',
                      '    """The distillation teacher as planned (frozen by train.py)."""',
                      *("    " + line for line in body)]) + "\n\n"


def _plan_literal(settings: dict) -> str:
    return "\n".join(["PLAN = {", *(f"    {key!r}: {value!r}," for key, value in settings.items()), "}"])
