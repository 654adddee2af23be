"""Hostile command lines and input files, run through `llamem.cli.main` in-process.

Whatever the argv or the file, llamem answers with a report, a plan or one of its own errors:
exit code 0, 1, 2 or 3 (`llamem.errors`), no traceback, no "internal error" (what `main` prints
for an unexpected exception, i.e. a bug), and with `--json` one JSON document on stdout. Plans on
the `debug` preset reproduce their figures through the `llamem estimate` commands they print,
and device memory never shrinks when the batch or the sequence grows.

Shapes stay tiny (the `debug` preset, sequences of a few tokens for `trace`) so that the whole
file runs in about half a minute on two cores when every test passes. Commands run in a scratch folder.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from llamem.cli import main
from llamem.model import FIELDS

EXIT_CODES = {0, 1, 2, 3}
MiB = 2**20
HUGE = str(10**30)
TASKS = ["infer", "train", "lora", "qlora", "distill"]
DEBUG_CONFIG = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
}
"""The `debug` preset as a config.json (llamem/presets.py)."""


def fuzz(examples: int, shrink: bool = True):
    """Few examples, no deadline; tests whose examples take seconds report a failure as found, unshrunk
    (shrinking one can take minutes)."""
    phases = list(Phase) if shrink else [p for p in Phase if p is not Phase.shrink]
    return settings(max_examples=examples, deadline=None, database=None, phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Running the command line ---------------------------------------------------------------------------
@dataclass
class Run:
    argv: list[str]
    code: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"llamem {shlex.join(self.argv)!r} -> exit {self.code}\nstdout: {self.stdout[-1500:]}\n"
                f"stderr: {self.stderr[-1500:]}")


COMMAND_SECONDS = 30
"""Time one command may take: every one here runs in a few seconds on the debug preset; a command past
this limit is stuck, and the test fails instead of hanging. Not for `trace`: an exception raised by the
alarm inside torch's dispatch can abort the interpreter, so a trace that may hang runs in a child process."""
PLAN_SECONDS = 150
"""A hang guard for plans, not a speed limit: `plan --maximize` searches every technique at each
probe size (45 s for the slowest request seen on this machine's CPU, alone)."""


class TookTooLong(BaseException):
    """Raised by the alarm in the middle of a command; a BaseException, so that main cannot swallow it."""


def _alarm(signum, frame):
    raise TookTooLong


def run_cli(argv: list[str], seconds: float | None = COMMAND_SECONDS) -> Run:
    """`main(argv)` with stdout and stderr captured; main must return a code, never raise or exit, in time."""
    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.pop("LLAMEM_DEBUG", None)  # with it, main re-raises unexpected errors
    escaped = None
    timed = seconds is not None and hasattr(signal, "setitimer")
    previous = signal.signal(signal.SIGALRM, _alarm) if timed else None
    try:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, seconds)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except (Exception, SystemExit, TookTooLong) as exc:  # noqa: BLE001 - whatever escapes is the finding
                escaped, code = exc, None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if saved is not None:
            os.environ["LLAMEM_DEBUG"] = saved
    run = Run(list(argv), code, out.getvalue(), err.getvalue())
    if isinstance(escaped, TookTooLong):
        pytest.fail(f"still running after {seconds} s: stuck\n{run}")
    assert escaped is None, f"main raised {type(escaped).__name__}: {escaped}\n{run}"
    return run


def run_child(argv: list[str], seconds: float, memory_bytes: int | None = None) -> Run:
    """`python -m llamem argv` in a child process, killed after `seconds`; with `memory_bytes`, its address
    space is capped, so that reading without end fails with a MemoryError instead of exhausting the machine."""
    import subprocess
    import sys

    def cap_memory():
        if memory_bytes is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    env = {k: v for k, v in os.environ.items() if k != "LLAMEM_DEBUG"}
    try:
        done = subprocess.run([sys.executable, "-m", "llamem", *argv], capture_output=True, text=True, check=False,
                              timeout=seconds, preexec_fn=cap_memory, env=env)
    except subprocess.TimeoutExpired as stuck:
        pytest.fail(f"llamem {shlex.join(argv)!r} still running after {seconds} s: stuck\n"
                    f"stdout: {stuck.stdout!r:.1500}\nstderr: {stuck.stderr!r:.1500}")
    return Run(list(argv), done.returncode, done.stdout, done.stderr)


def check_answer(run: Run):
    """The contract every command line keeps; returns the JSON document when the argv holds --json
    (main prints its errors as JSON then), except for --help and --version, which print text."""
    json_mode = "--json" in run.argv and not (run.code == 0 and {"-h", "--help", "--version"} & set(run.argv))
    assert run.code in EXIT_CODES, f"exit code outside 0-3\n{run}"
    for text in (run.stdout, run.stderr):
        assert "Traceback" not in text, f"a traceback\n{run}"
        assert "internal error" not in text, f"an internal error (a bug)\n{run}"
    if not json_mode:
        if run.code in (1, 2):
            assert "error: " in run.stderr, f"an error without its message\n{run}"
        if run.code == 0:
            assert run.stdout.strip(), f"success with nothing printed\n{run}"
        return None
    try:
        doc = json.loads(run.stdout)
    except ValueError:
        pytest.fail(f"--json printed something that is not one JSON document\n{run}")
    if isinstance(doc, dict) and "error" in doc:
        error = doc["error"]
        assert isinstance(error, dict) and set(error) == {"type", "message", "exit_code"}, f"bad error object\n{run}"
        assert error["exit_code"] == run.code != 0, f"error object with the wrong exit code\n{run}"
        assert error["type"] != "InternalError" and error["message"], f"an internal error (a bug)\n{run}"
    elif run.code == 3:  # a plan that does not fit, or a replay that runs out of memory
        assert isinstance(doc, dict) and (doc.get("fits") is False or doc.get("oom")), f"exit 3 without cause\n{run}"
    else:
        assert run.code == 0, f"exit {run.code} with a result instead of an error object\n{run}"
    return doc


# Files the argv strategies name by placeholder --------------------------------------------------------
EVIL_MARKER = "evil-pickle-ran"


class _Evil:
    """Unpickling it would run `touch <marker>`: replay must refuse the global, not call it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(scope="module", autouse=True)
def scratch_folder(tmp_path_factory):
    """Commands run in a scratch folder: a random relative --save-trace or --snapshot-out name is written there."""
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(previous)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "empty-dir").mkdir()
    model = root / "debug model ü"  # a space and a non-ASCII letter: reproduce commands must quote it
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DEBUG_CONFIG))
    (root / "out").mkdir()
    (root / "empty.json").write_bytes(b"")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (root / "trace.json").write_text(json.dumps({"format": "llamem-trace-v1", "events": [
        {"action": "alloc", "addr": 0, "size": 3 * MiB}, {"action": "alloc", "addr": 4 * MiB, "size": 512},
        {"action": "free", "addr": 0, "size": 3 * MiB}]}))
    (root / "snapshot.json").write_text(json.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 0, "size": 1024, "stream": 0},
        {"action": "free_requested", "addr": 0, "size": 1024, "stream": 0},
        {"action": "free_completed", "addr": 0, "size": 1024, "stream": 0}]]}))
    (root / "evil.pickle").write_bytes(pickle.dumps(_Evil(root / EVIL_MARKER)))
    return {
        "@MISSING": str(root / "no" / "such" / "config.json"),
        "@DIR": str(root / "empty-dir"),
        "@CONFIGDIR": str(model),
        "@CONFIG": str(model / "config.json"),
        "@EMPTY": str(root / "empty.json"),
        "@BINARY": str(root / "binary.bin"),
        "@TRACE": str(root / "trace.json"),
        "@SNAPSHOT": str(root / "snapshot.json"),
        "@EVIL": str(root / "evil.pickle"),
        "@OUT": str(root / "out" / "written.out"),
        "@OUT_NO_DIR": str(root / "no" / "dir" / "written.out"),
        "@ROOT": str(root),
    }


def resolve(argv: list[str], files: dict[str, str]) -> list[str]:
    return [files.get(token, token) for token in argv]


# The vocabulary: options from `llamem <command> --help`, values a careless or hostile user types ------
BAD_INTS = ["-1", "0", HUGE, "-" + HUGE, str(2**63), "1.5", "1e3", "", " ", "abc", "٣", "0x10", "nan"]
SIZES = ["0.5GiB", "420MiB", "1GiB", "24GiB", "80GB", "1.5G", "2048MiB"]
BAD_SIZES = ["22", "0", "0GiB", "-1GiB", "1e3GiB", "9" * 400 + "GiB", HUGE + "GiB", "GiB", "22 GiB", "22XB", "٣GiB",
             "", "abc", "0.0000001B", "infGiB"]
TEXTS = ["", " ", "bogus", "-", "--", "None", "null", "∞", "模型", "😀", "a" * 300, "\x00", "\n", "{}", "[1]"]
BAD_PATHS = ["@MISSING", "@DIR", "@EMPTY", "@BINARY", "@TRACE", "@EVIL", "", ".", "~", "~nobody", "a\x00b", "x" * 5000,
             "/", "/proc/self/mem"]
OVERRIDES = ["num_hidden_layers=2", "num_hidden_layers=1", "tie_word_embeddings=true", "sliding_window=null",
             "max_position_embeddings=100", "vocab_size=32000", "rope_theta=500000.0"]
BAD_OVERRIDES = ["num_hidden_layers=0", "num_hidden_layers=-1", "num_hidden_layers=" + HUGE, "num_hidden_layers=1.5",
                 "num_hidden_layers=", "hidden_size=abc", "rope_theta=nan", "rope_theta=-1", "rms_norm_eps=inf",
                 "vocab_size=" + "9" * 30, "tie_word_embeddings=maybe", "head_dim=7", "num_key_value_heads=3",
                 "unknown_key=1", "=", "=1", "novalue", "model_type=gpt2", "", "😀=1"]


def ints(*valid: int, bad: list[str] = BAD_INTS) -> tuple[list[str], list[str]]:
    return [str(v) for v in valid], bad


def choice(*valid: str) -> tuple[list[str], list[str]]:
    return list(valid), ["bogus", "", "FULL", "😀", valid[0].upper(), valid[-1] + " "]


FLAG = None
"""An option that takes no value."""
WORKLOAD = {  # flag: (valid values, hostile values)
    "--config": (["@CONFIG", "@CONFIGDIR"], BAD_PATHS), "--override": (OVERRIDES, BAD_OVERRIDES),
    "--task": choice(*TASKS), "--batch": ints(1, 2, 4, 64), "--seq": ints(1, 16, 512, 2048, 4096, 5000),
    "--precision": choice("fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"), "--new-tokens": ints(0, 1, 16, 256),
    "--quant": choice("none", "int8", "nf4", "int4"), "--lora-rank": ints(1, 8, 64, 4096),
    "--lora-targets": (["all", "q_proj,v_proj", "gate_proj,up_proj,down_proj", "q_proj"],
                       ["q_proj,,v_proj", ",", "nope", "q_proj,q_proj", "lm_head", "ALL", ""]),
    "--kv-dtype": choice("bf16", "fp16", "fp32", "fp8", "int8", "int4"), "--prefill-chunk": ints(0, 1, 16, 512),
    "--ac": (["none", "full", "every-1", "every-2", "every-4"],
             ["every-0", "every--1", "every-x", "every-" + HUGE, "every-4096", "every-", "FULL", "bogus", ""]),
    "--loss": choice("full", "chunked"), "--optimizer": choice("adamw", "adamw8bit", "sgd", "adafactor"),
    "--grad-accum": ints(1, 2, 8), "--teacher": (["debug", "@CONFIG"], ["bogus", "", "@MISSING", "@DIR", "@BINARY"]),
    "--teacher-quant": choice("none", "int8", "nf4", "int4"), "--attn": choice("sdpa", "eager"),
}
LAYOUT = {"--gpus": ints(1, 2, 4, 8), "--tp": ints(1, 2, 4), "--pp": ints(1, 2, 4),
          "--sharding": choice("none", "ddp", "zero1", "zero2", "zero3"),
          "--offload": choice("none", "optimizer", "optimizer+params"), "--pp-schedule": choice("1f1b", "gpipe")}
CARDS = {"--gpu": (["rtx-4090", "h100-80gb", "t4"], ["RTX 4090", "bogus", "", "4090"]), "--budget": (SIZES, BAD_SIZES)}
PLAN = {"--gpus": ints(1, 2, 4, bad=["-1", "0", HUGE, str(2**63), "abc"]), "--min-gpus": FLAG,
        "--maximize": choice("batch", "seq"), "--host-memory": (SIZES, BAD_SIZES), "--verify": FLAG, "--exact": FLAG,
        "--no-truncation": FLAG, "--code": FLAG,
        # small shapes: a plan searches many configurations, and --verify traces the winner
        "--batch": ints(1, 2, 4, 16, bad=["-1", "0", HUGE, "abc"]), "--seq": ints(16, 256, 1024, bad=["-1", "0", HUGE]),
        "--new-tokens": ints(1, 16, bad=["-1", HUGE]), "--grad-accum": ints(1, 4, bad=["0", HUGE])}
# No huge --new-tokens here: trace then decodes without end (pinned, in a child process, below).
TRACE = {**WORKLOAD, "--batch": ints(1, 2, bad=["-1", "0", HUGE, "abc"]), "--seq": ints(4, 8, bad=["-1", "0", HUGE]),
         "--new-tokens": ints(1, 2, bad=["-1", "x"]), "--prefill-chunk": ints(0, 2, bad=["-1", HUGE]),
         "--lora-rank": ints(1, 4, bad=["0", "-1", HUGE]), "--grad-accum": ints(1, 2, bad=["0", HUGE]),
         "--teacher": (["debug"], ["bogus", "", "@MISSING", "@DIR"]),
         "--override": (["num_hidden_layers=1", "tie_word_embeddings=true"],
                        ["num_hidden_layers=0", "hidden_size=abc", "vocab_size=" + "9" * 30, "unknown_key=1", "=", ""]),
         "--save-trace": (["@OUT"], ["@OUT_NO_DIR", "@DIR", "", "a\x00b", "/proc/version"])}
REPLAY = {"--config": (["expandable_segments:True", "expandable_segments:False", "max_split_size_mb:20",
                        "garbage_collection_threshold:0.6,max_split_size_mb:64", "roundup_power2_divisions:4"],
                       ["", "bogus:1", "expandable_segments", ":", ",,", "max_split_size_mb:-1",
                        "max_split_size_mb:" + HUGE, "backend:cudaMallocAsync", "garbage_collection_threshold:2",
                        "😀"]),
          "--capacity": (["2MiB", "4MiB", "1GiB"], BAD_SIZES), "--device-total": (["4MiB", "24GiB"], BAD_SIZES),
          "--summary": FLAG, "--snapshot-out": (["@OUT"], ["@OUT_NO_DIR", "@DIR", "", "a\x00b"]), "--advise": FLAG,
          "--no-advise": FLAG}
MODELS = (["debug", "DEBUG", "llamem/debug", "@CONFIG", "@CONFIGDIR", "tinyllama"],
          ["@MISSING", "@DIR", "@EMPTY", "@BINARY", "@TRACE", "", "nope-7b", "llama-9b", "meta-llama/Nope", "模型",
           "../", "~", "a\x00b", "x" * 5000, "-"])
JUNK = ["--nope", "-x", "extra", "--", "-", "--json=1", "--task=train", "--batch=2", "--seq=", "-h"]


def pick(draw, pair: tuple[list[str], list[str]]) -> str:
    """A valid value four times in five (so that many command lines get past the parser), else a hostile one."""
    valid, hostile = pair
    if valid and draw(st.integers(0, 4)) > 0:
        return draw(st.sampled_from(valid))
    return draw(st.sampled_from(hostile) | st.sampled_from(TEXTS) | st.text(max_size=6))


@st.composite
def command_line(draw, prefix: list[str], options: dict, *, models: tuple | None, head: list[str] = (),
                 max_groups: int = 5) -> list[str]:
    """prefix, maybe a model, options in any order (repeats allowed), maybe --json, maybe junk, maybe a flag
    left without its value at the end."""
    groups = [list(head)] if head else []
    if models is not None and draw(st.integers(0, 9)) > 0:
        groups.append([pick(draw, models)])
    for flag in draw(st.lists(st.sampled_from(sorted(options)), max_size=max_groups)):
        groups.append([flag] if options[flag] is FLAG else [flag, pick(draw, options[flag])])
    if draw(st.integers(0, 7)) == 0:
        groups.append([draw(st.sampled_from(JUNK))])
    if draw(st.booleans()):  # its own group, so that no option takes it as a value
        groups.insert(draw(st.integers(0, len(groups))), ["--json"])
    groups = draw(st.permutations(groups)) if draw(st.booleans()) else groups
    argv = prefix + [token for group in groups for token in group]
    if draw(st.integers(0, 14)) == 0:
        argv.append(draw(st.sampled_from([f for f in options if options[f] is not FLAG])))  # its value is missing
    return argv


def assert_no_code_ran(files: dict[str, str]) -> None:
    assert not (Path(files["@ROOT"]) / EVIL_MARKER).exists(), "unpickling ran os.system"


# 1. Command lines -----------------------------------------------------------------------------------
def answer(argv: list[str], files: dict[str, str] | None = None):
    """Run a random command line (no alarm for trace, see COMMAND_SECONDS), count its exit code for
    `--hypothesis-show-statistics`, check it."""
    seconds = {"trace": None, "plan": PLAN_SECONDS}.get(argv[0] if argv else "", COMMAND_SECONDS)
    run = run_cli(resolve(argv, files or {}), seconds=seconds)
    event(f"exit {run.code}")
    doc = check_answer(run)
    if files:
        assert_no_code_ran(files)
    return run, doc


estimate_argv = command_line(["estimate"], {**WORKLOAD, **LAYOUT}, models=MODELS)
catalog_argv = st.tuples(st.sampled_from([["models"], ["gpus"]]),
                         st.lists(st.sampled_from(JUNK + ["--json"]), max_size=2)).map(lambda t: t[0] + t[1])
other_argv = st.lists(st.sampled_from(["allocator", "replay", "bogus", "estimate", "plan", "--version", "", "😀",
                                       "--json", "@TRACE", "--help"]), max_size=3)


@fuzz(150)
@given(argv=estimate_argv | catalog_argv | other_argv)
def test_estimate_and_other_command_lines(argv, files):
    answer(argv, files)


def last_value(argv: list[str], flag: str) -> str | None:
    """The value click uses for an option given several times: the last."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == flag]
    return values[-1] if values else None


@st.composite
def plan_argv(draw):
    """A card (--gpu or --budget) most of the time; now and then none, or both."""
    cards = draw(st.sampled_from([[], ["--budget"], ["--budget"], ["--budget"], ["--budget"], ["--gpu"], ["--gpu"],
                                  ["--gpu"], ["--gpu", "--budget"]]))
    head = ["--seq", "64"] + [token for flag in cards for token in (flag, pick(draw, CARDS[flag]))]
    models = (["debug", "@CONFIG", "@CONFIGDIR"], MODELS[1])
    argv = draw(command_line(["plan"], {**WORKLOAD, **PLAN}, models=models, head=head, max_groups=4))
    if "--verify" in argv and last_value(argv, "--task") == "infer":
        argv[1:1] = ["--new-tokens", "2"]  # --verify traces the plan: 256 decode steps take seconds
    return argv


@fuzz(50, shrink=False)
@given(argv=plan_argv())
def test_plan_command_lines(argv, files):
    answer(argv, files)


@st.composite
def trace_argv(draw):
    task = draw(st.sampled_from(TASKS))
    head = ["--task", task, "--batch", "1", "--seq", draw(st.sampled_from(["4", "16"]))]
    head += ["--teacher", "debug"] if task == "distill" else []
    models = (["debug", "@CONFIG", "@CONFIGDIR"], ["@MISSING", "@DIR", "", "a\x00b"])
    argv = draw(command_line(["trace"], TRACE, models=models, head=head, max_groups=3))
    if last_value(argv, "--task") == "infer":
        argv[1:1] = ["--new-tokens", "2"]  # not the default 256 decode steps: they take seconds
    return argv


@fuzz(15, shrink=False)
@given(argv=trace_argv())
def test_trace_command_lines(argv, files):
    answer(argv, files)


replay_argv = command_line(["allocator", "replay"], REPLAY, models=(
    ["@TRACE", "@SNAPSHOT"],
    ["@EVIL", "@EMPTY", "@BINARY", "@DIR", "@MISSING", "@CONFIG", "", "a\x00b", "/proc/version"]))


@fuzz(150)
@given(argv=replay_argv)
def test_replay_command_lines(argv, files):
    answer(argv, files)


LONG_NAME = "a" * 300
"""Longer than a file name may be (255 bytes on Linux file systems)."""


@pytest.mark.parametrize("argv", [
    pytest.param(["plan", "debug", "--budget", "9" * 400 + "GiB"], id="budget-overflows-float"),
    pytest.param(["plan", "debug", "--budget", "1GiB", "--host-memory", "9" * 400 + "GiB", "--json"],
                 id="host-memory-overflows-float"),
    pytest.param(["allocator", "replay", "@TRACE", "--capacity", "9" * 400 + "GiB"], id="capacity-overflows-float"),
    pytest.param(["estimate", "debug", "--batch", HUGE, "--json"], id="batch-10e30"),
    pytest.param(["estimate", "debug", "--seq", str(10**20)], id="seq-10e20"),
    pytest.param(["estimate", "debug", "--override", f"num_hidden_layers={2**62}"], id="layers-2e62"),
    pytest.param(["allocator", "replay", "a\x00b", "--json"], id="nul-in-replay-file"),
    pytest.param(["estimate", "--config", "a\x00b"], id="nul-in-config"),
    pytest.param(["trace", "debug", "--batch", "1", "--seq", "4", "--save-trace", "a\x00b"], id="nul-in-save-trace"),
    pytest.param(["allocator", "replay", "@TRACE", "--snapshot-out", "a\x00b"], id="nul-in-snapshot-out"),
    pytest.param(["trace", "debug", "--batch", "1", "--seq", "4", "--save-trace", LONG_NAME], id="long-save-trace"),
    pytest.param(["allocator", "replay", "@TRACE", "--snapshot-out", LONG_NAME, "--json"], id="long-snapshot-out"),
    pytest.param(["trace", "debug", "--batch", "1", "--seq", "4", "--save-trace", "/dev/full"],
                 id="save-trace-disk-full",
                 marks=pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")),
    pytest.param(["trace", "debug", "--task", "qlora", "--optimizer", "adafactor", "--batch", "1", "--seq", "4"],
                 id="trace-qlora-adafactor"),
    pytest.param(["plan", "debug", "--budget", "2048MiB", "--task", "train", "--batch", "2", "--seq", "16",
                  "--maximize", "seq", "--gpus", "2", "--json"], id="plan-maximize-seq-2-gpus"),
    pytest.param(["plan", "debug", "--budget", "1GiB", "--task", "train", "--seq", "64", "--batch", HUGE],
                 id="plan-train-batch-10e30"),
    pytest.param(["trace", "debug", "--seq", "4", "--batch", HUGE], id="trace-batch-10e30"),
    pytest.param(["trace", "debug", "--seq", "4", "--grad-accum", HUGE], id="trace-grad-accum-10e30"),
])
def test_known_hostile_command_lines(argv, files):
    """Command lines the random tests above found answered with an internal error or stuck, pinned."""
    check_answer(run_cli(resolve(argv, files), seconds=None if argv[0] == "trace" else 20))


def test_trace_refuses_endless_decoding():
    """A huge --new-tokens is refused, not decoded one token at a time for ever."""
    check_answer(run_child(["trace", "debug", "--task", "infer", "--seq", "4", "--new-tokens", HUGE], seconds=30))


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize("argv", [["estimate", "--config", "/dev/zero"], ["allocator", "replay", "/dev/zero"]],
                         ids=["config", "replay"])
def test_an_endless_file_is_refused(argv):
    """A file with no end (a device, a pipe) is refused, not read into memory until the machine runs out:
    the child's address space is capped at 2 GiB, so that reading it all is a MemoryError, not a dead machine."""
    check_answer(run_child(argv, seconds=120, memory_bytes=2 * 2**30))


# 2. config.json files ----------------------------------------------------------------------------------
junk = st.recursive(
    st.none() | st.booleans() | st.text(max_size=8) | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(10**30), 10**30)
    | st.sampled_from([0, -1, 1, 2, 4, 64, 2.0, 2048.7, "64", "false", 2**63, 2**63 - 1, 2**62, 10**30]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_keys = sorted(set(FIELDS) | set(DEBUG_CONFIG) | {"quantization_config", "architectures", "rope_scaling"})


def bounded_layers(config):
    """A valid layer count from 10**5 up takes minutes and gigabytes (per-layer lists): random ones stay at
    most 64, and the huge case is pinned in test_known_hostile_command_lines."""
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if isinstance(layers, int) and not isinstance(layers, bool) and 64 < layers < 2**62:
        config["num_hidden_layers"] = 64
    return config


@st.composite
def mutated_debug_config(draw) -> dict:
    """The debug config with some keys dropped and some values replaced by junk."""
    config = dict(DEBUG_CONFIG)
    for key in draw(st.lists(st.sampled_from(_keys), max_size=3)):
        if draw(st.booleans()):
            config.pop(key, None)
        else:
            config[key] = draw(junk)
    return config


config_payloads = st.one_of(
    mutated_debug_config().map(bounded_layers).map(lambda c: json.dumps(c).encode()),
    st.dictionaries(st.sampled_from(_keys), junk, max_size=6).map(bounded_layers).map(lambda c: json.dumps(c).encode()),
    junk.map(lambda j: json.dumps(j).encode()),
    st.binary(max_size=64),
    st.sampled_from([b"", b"   ", b"\xef\xbb\xbf{}", b"\x80\x04junk", b"\xff\xfe{\x00}", b"{", b"[]", b"null",
                     b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}", b"[" * 100000,
                     json.dumps({**DEBUG_CONFIG, "num_hidden_layers": 2**62}).encode(),
                     json.dumps({**DEBUG_CONFIG, "hidden_size": 2**62}).encode(),
                     json.dumps({**DEBUG_CONFIG, "vocab_size": 10**30}).encode()]),
)


@fuzz(60)
@given(payload=config_payloads, how=st.sampled_from(["--config", "file", "dir"]),
       command=st.sampled_from(["estimate", "plan"]), as_json=st.booleans())
def test_random_config_files(payload, how, command, as_json, tmp_path_factory):
    folder = tmp_path_factory.mktemp("config")
    path = folder / "config.json"
    path.write_bytes(payload)
    model = {"--config": ["--config", str(path)], "file": [str(path)], "dir": [str(folder)]}[how]
    argv = [command, *model, "--batch", "1", "--seq", "64"]
    argv += ["--budget", "1GiB"] if command == "plan" else []
    argv += ["--json"] if as_json else []
    answer(argv)


# 3. Replay input files ---------------------------------------------------------------------------------
sizes = st.integers(0, 64 * MiB)
ints_or_junk = sizes | junk | st.sampled_from([-1, -(2**70), 2**70, "1024", 1.5, True, None])
actions = st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                           "segment_map", "segment_unmap", "snapshot", "oom", "user_defined", "free", "bogus", "",
                           None, 1])


def entry(action, addr, size, stream, extra) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, **extra}


hostile_entries = st.builds(
    entry, actions, ints_or_junk, ints_or_junk, st.integers(-2, 2) | junk,
    st.dictionaries(st.sampled_from(["device_free", "frames", "compile_context"]), ints_or_junk, max_size=2),
).flatmap(lambda item: st.sets(st.sampled_from(sorted(item)), max_size=2).map(
    lambda dropped: {k: v for k, v in item.items() if k not in dropped}))
hostile_blocks = st.fixed_dictionaries({}, optional={"address": ints_or_junk, "size": ints_or_junk,
                                                     "requested_size": ints_or_junk,
                                                     "state": st.sampled_from(["active_allocated", "inactive",
                                                                               "active_pending_free", "bogus"]) | junk})
hostile_segments = st.fixed_dictionaries({}, optional={
    "device": st.integers(-1, 2) | junk, "address": ints_or_junk, "total_size": ints_or_junk,
    "stream": st.integers(0, 2) | junk, "segment_type": st.sampled_from(["small", "large", "huge"]) | junk,
    "is_expandable": st.booleans() | junk, "blocks": st.lists(hostile_blocks, max_size=3) | junk})
hostile_snapshot = st.fixed_dictionaries({}, optional={
    "segments": st.lists(hostile_segments, max_size=3) | junk,
    "device_traces": st.lists(st.lists(hostile_entries, max_size=6) | junk, max_size=3) | junk,
    "format": st.sampled_from(["llamem-trace-v1", "bogus"]) | junk})
hostile_llamem = st.fixed_dictionaries({"format": st.just("llamem-trace-v1")}, optional={
    "events": st.lists(st.fixed_dictionaries({}, optional={
        "action": st.sampled_from(["alloc", "free", "free_completed", "bogus"]) | junk, "addr": ints_or_junk,
        "size": ints_or_junk, "nbytes": ints_or_junk}), max_size=6) | junk})
hostile_data = hostile_snapshot | hostile_llamem | junk


@st.composite
def valid_events(draw) -> list[tuple[str, int, int]]:
    """(action, addr, size): allocations at distinct addresses, frees of live ones with their size."""
    live: dict[int, int] = {}
    events, next_addr = [], 0
    for _ in range(draw(st.integers(1, 12))):
        if live and draw(st.booleans()):
            addr = draw(st.sampled_from(sorted(live)))
            events.append(("free", addr, live.pop(addr)))
        else:
            size = draw(st.integers(1, 48 * MiB))
            live[next_addr] = size
            events.append(("alloc", next_addr, size))
            next_addr += 2**30
    return events


@st.composite
def valid_trace(draw):
    events = draw(valid_events())
    if draw(st.booleans()):
        return {"format": "llamem-trace-v1", "events": [{"action": a, "addr": x, "size": s} for a, x, s in events]}
    entries = []
    stray = draw(st.booleans())  # a free of a block allocated before the trace began (a wrapped ring buffer)
    if stray:
        entries.append({"action": "free_completed", "addr": 2**40, "size": 4 * MiB, "stream": 0})
    for action, addr, size in events:
        if action == "alloc":
            entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0})
        else:
            entries += [{"action": "free_requested", "addr": addr, "size": size, "stream": 0},
                        {"action": "free_completed", "addr": addr, "size": size, "stream": 0}]
    if draw(st.booleans()):
        entries.append({"action": "oom", "size": draw(st.integers(1, 64 * MiB)), "stream": 0,
                        "device_free": draw(st.integers(0, 8 * MiB))})
    snapshot = {"device_traces": [entries]}
    if draw(st.booleans()):
        snapshot["segments"] = []
    return snapshot


def write_replay_file(folder: Path, data, as_pickle: bool) -> Path:
    path = folder / ("snapshot.pickle" if as_pickle else "trace.json")
    if as_pickle:
        path.write_bytes(pickle.dumps(data))
    else:
        try:
            path.write_text(json.dumps(data))
        except ValueError:  # integers past json's digit limit: write them as pickles instead
            path.write_bytes(pickle.dumps(data))
    return path


replay_options = st.lists(st.sampled_from([["--capacity", "4MiB"], ["--capacity", "64MiB"], ["--capacity", "1GiB"],
                                           ["--config", "expandable_segments:True"], ["--no-advise"], ["--summary"],
                                           ["--capacity", "22"]]), max_size=2)


@fuzz(200)
@given(data=hostile_data, as_pickle=st.booleans(), options=replay_options, as_json=st.booleans())
def test_random_replay_files(data, as_pickle, options, as_json, tmp_path_factory, files):
    path = write_replay_file(tmp_path_factory.mktemp("replay"), data, as_pickle)
    argv = ["allocator", "replay", str(path), *[t for o in options for t in o]] + (["--json"] if as_json else [])
    answer(argv, files)


@fuzz(60)
@given(data=valid_trace(), as_pickle=st.booleans(), capacity=st.sampled_from([None, "8MiB", "64MiB", "1GiB"]),
       as_json=st.booleans())
def test_valid_replay_files_replay(data, as_pickle, capacity, as_json, tmp_path_factory):
    path = write_replay_file(tmp_path_factory.mktemp("replay"), data, as_pickle)
    argv = ["allocator", "replay", str(path)] + (["--capacity", capacity] if capacity else [])
    run, doc = answer(argv + (["--json"] if as_json else []))
    assert run.code in (0, 3), f"a valid trace refused\n{run}"
    if as_json:
        assert (run.code == 3) == (doc["oom"] is not None), f"exit code and 'oom' disagree\n{run}"


@fuzz(30)
@given(data=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
                         | st.binary(max_size=6),
                         lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                         | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8),
       protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_pickles_of_plain_data(data, protocol, tmp_path_factory):
    path = tmp_path_factory.mktemp("pickle") / "snapshot.pickle"
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    answer(["allocator", "replay", str(path), "--json"])


@pytest.mark.parametrize("data", [
    pytest.param({"format": "llamem-trace-v1", "events": [{"action": [], "addr": 0, "size": 1}]}, id="list-as-action"),
    pytest.param({"device_traces": [[]], "segments": [{"address": 0, "total_size": 2 * MiB,
                                                       "blocks": [{"state": {}, "address": 0, "size": 1}]}]},
                 id="object-as-block-state"),
])
def test_known_hostile_replay_files(data, tmp_path):
    """Files the random tests above found answered with an internal error, pinned."""
    path = write_replay_file(tmp_path, data, as_pickle=False)
    check_answer(run_cli(["allocator", "replay", str(path), "--json"]))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_pickle_asking_for_a_global_is_refused_unrun(protocol, wrapped, tmp_path):
    marker = tmp_path / EVIL_MARKER
    evil = _Evil(marker)
    data = {"segments": [], "device_traces": [[evil]]} if wrapped else evil
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    run = run_cli(["allocator", "replay", str(path), "--json"])
    doc = check_answer(run)
    assert run.code == 1 and "error" in doc, f"a pickle asking for os.system was not refused\n{run}"
    assert not marker.exists(), "unpickling ran os.system"


# 4. Plans reproduce their figures ------------------------------------------------------------------------
def run_json(argv: list[str]) -> tuple[Run, object]:
    run = run_cli(argv, seconds=PLAN_SECONDS if argv[0] == "plan" else COMMAND_SECONDS)
    return run, check_answer(run)


def reproduce(command: str, where: str) -> dict:
    words = shlex.split(command)
    assert words[0] == "llamem", where
    run, doc = run_json(words[1:] + ["--json"])
    assert run.code == 0, f"the plan's command does not run: {command}\n{run}\n{where}"
    return doc


def check_plan_reproduces(argv: list[str]) -> dict | None:
    run, plan = run_json(argv)
    assert run.code in (0, 3), f"a valid plan request refused\n{run}"
    if run.code == 3 and "error" in plan:  # no layout at all on these GPUs: no plan to check
        return None
    assert plan["fits"] is (run.code == 0), f"'fits' and the exit code disagree\n{run}"
    if not plan["fits"]:
        return None
    where = f"plan: llamem {shlex.join(argv)}"
    final = plan["final"]
    report = reproduce(final["command"], where)
    assert report["device_bytes"] == final["peak_device_bytes"], f"{final['command']}\n{where}"
    assert report["peak_allocated_bytes"] == final["peak_allocated_bytes"], f"{final['command']}\n{where}"
    for step in plan["steps"]:
        assert step.get("command"), f"step without a command: {step}\n{where}"
        assert reproduce(step["command"], where)["device_bytes"] == step["peak_device_bytes"], \
            f"step {step['technique']!r}: {step['command']}\n{where}"
    return plan


@st.composite
def plan_request(draw) -> list[str]:
    task = draw(st.sampled_from(TASKS))
    argv = ["--budget", f"{draw(st.integers(420, 2048))}MiB", "--task", task,
            "--batch", str(draw(st.integers(1, 8))), "--seq", str(draw(st.sampled_from([16, 64, 256, 512, 1024])))]
    argv += ["--teacher", "debug"] if task == "distill" else []
    argv += draw(st.sampled_from([[], [], ["--maximize", "batch"], ["--maximize", "seq"]]))
    argv += draw(st.sampled_from([[], [], ["--gpus", "2"], ["--gpus", "4"]]))
    return argv + ["--json"]


@fuzz(8, shrink=False)
@given(request=plan_request())
def test_random_plans_reproduce_their_figures(request):
    check_plan_reproduces(["plan", "debug", *request])


def check_carries_config(plan: dict | None, config: str) -> None:
    if plan is None:
        return
    for command in [plan["final"]["command"], *(s["command"] for s in plan["steps"])]:
        words = shlex.split(command)
        assert "--config" in words and words[words.index("--config") + 1] == config, command
        assert "--override" in words and words[words.index("--override") + 1] == "num_hidden_layers=2", command


@fuzz(4, shrink=False)
@given(request=plan_request())
def test_plans_from_a_config_file_carry_it(request, files):
    config = files["@CONFIG"]
    check_carries_config(check_plan_reproduces(["plan", "--config", config, "--override", "num_hidden_layers=2",
                                                *request]), config)


@pytest.mark.parametrize("from_config", [False, True], ids=["preset", "config-file"])
def test_a_plan_that_fits_was_checked(from_config, files):
    """The reproduction tests above check nothing on a plan that does not fit: these fit, with steps."""
    config = files["@CONFIG"]
    model = ["--config", config, "--override", "num_hidden_layers=2"] if from_config else ["debug"]
    plan = check_plan_reproduces(["plan", *model, "--budget", "480MiB", "--task", "train", "--batch", "4",
                                  "--seq", "512", "--json"])
    assert plan is not None and plan["steps"], "this plan fits after some steps"
    if from_config:
        check_carries_config(plan, config)


# 5. Device memory grows with the workload -----------------------------------------------------------------
def grid_axis(low: int, high: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(low, high), min_size=2, max_size=3, unique=True).map(sorted)


@fuzz(8, shrink=False)
@given(task=st.sampled_from(TASKS), batches=grid_axis(1, 8), seqs=grid_axis(16, 2000))
def test_device_bytes_monotone_on_a_grid(task, batches, seqs):
    teacher = ["--teacher", "debug"] if task == "distill" else []
    device = {}
    for b in batches:
        for s in seqs:
            argv = ["estimate", "debug", "--task", task, "--batch", str(b), "--seq", str(s), *teacher, "--json"]
            run, report = run_json(argv)
            assert run.code == 0, str(run)
            device[b, s] = report["device_bytes"]
    for (b, s), value in device.items():
        for (b2, s2), other in device.items():
            if (b2, s2) != (b, s) and b2 >= b and s2 >= s:
                assert other >= value, (f"{task}: batch {b2} x seq {s2} takes {other} B, less than batch {b} x "
                                        f"seq {s} ({value} B)")


@pytest.mark.parametrize("flags, named", [
    (["--compile"], "--compile"),
    (["--liger", "--padding-free", "--batch", "2"], "--padding-free"),
])
def test_plan_emit_refuses_a_technique_its_train_py_does_not_apply(flags, named, tmp_path):
    """Not exit 3 blaming the heads and layers: the fixed technique is named, and nothing is written."""
    run = run_cli(["plan", "debug", "--budget", "2GiB", "--seq", "16", "--precision", "bf16", "--optimizer", "adamw",
                   *flags, "--emit", str(tmp_path / "bundle")])
    assert run.code == 1 and named in run.stderr and "drop --emit" in run.stderr, run
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("flags, named", [
    (["--liger"], "--liger with a mixture of experts"),
    (["--ac", "selective"], "--ac selective with a mixture of experts"),
])
def test_plan_of_experts_names_the_technique_the_engine_does_not_size(flags, named, tmp_path):
    """As `estimate` does (exit 1, the flag named), not exit 3 blaming the heads and layers."""
    config = tmp_path / "moe.json"
    config.write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "num_local_experts": 6, "num_experts_per_tok": 2}))
    run = run_cli(["plan", "--config", str(config), "--budget", "2GiB", "--seq", "16", "--precision", "bf16",
                   "--optimizer", "adamw", *flags])
    assert run.code == 1 and named in run.stderr and "no layout" not in run.stderr, run


@pytest.mark.parametrize("argv, named", [
    (["--gpu", "t4", "--attn", "flash_attention_2"], "flash-attn 2 has kernels for Ampere or newer only, not t4"),
    (["--gpu", "h100-80gb", "--gpus", "2", "--batch", "2", "--optimizer-in-backward", "--max-grad-norm", "0"],
     "--optimizer-in-backward is sized on one GPU"),
])
def test_plan_names_a_setting_that_rules_out_the_cards(argv, named):
    """flash_attention_2 on a Turing card was planned as if it ran; --optimizer-in-backward on 2 GPUs was
    answered with exit 3 and the heads and layers blamed."""
    run = run_cli(["plan", "debug", "--seq", "16", "--precision", "bf16", "--optimizer", "adamw", *argv])
    assert run.code == 1 and named in run.stderr, run
