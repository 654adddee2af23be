"""`llamem serve`'s API and HTTP layer, and the `--html` reports (no browser here: see test_web_browser.py).

The API must answer what the command line prints with `--json`; requests must not reach the file
system; hostile requests get JSON errors and the server keeps answering."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import threading

import pytest

from llamem.cli import main
from llamem.presets import PRESETS
from llamem.web.routes import route_answer
from llamem.web.server import MAX_BODY_BYTES, make_server

DEBUG_CONFIG = PRESETS["debug"][2]


def cli_json(argv: list[str]) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*argv, "--json"])
    return code, json.loads(out.getvalue())


SAME = [
    ("estimate", {"model": "debug", "batch": "2", "seq": "128"}, ["debug", "--batch", "2", "--seq", "128"]),
    ("estimate", {"model": "debug", "task": "lora", "lora-rank": "16", "ac": "full",
                  "override": ["num_hidden_layers=3"]},
     ["debug", "--task", "lora", "--lora-rank", "16", "--ac", "full", "--override", "num_hidden_layers=3"]),
    ("estimate", {"model": "debug", "gpus": "2", "sharding": "zero3"}, ["debug", "--gpus", "2", "--sharding", "zero3"]),
    ("estimate", {"model": "debug", "batch": "-1"}, ["debug", "--batch", "-1"]),
    ("estimate", {"model": "llama-3.1-8b", "task": "qlora", "batch": "999999"},
     ["llama-3.1-8b", "--task", "qlora", "--batch", "999999"]),
    ("plan", {"model": "debug", "budget": "2GiB", "batch": "4", "seq": "256"},
     ["debug", "--budget", "2GiB", "--batch", "4", "--seq", "256"]),
    ("plan", {"model": "debug", "budget": "1MiB", "no-truncation": "true"},
     ["debug", "--budget", "1MiB", "--no-truncation"]),
    ("plan", {"model": "debug", "gpu": "no-such-card"}, ["debug", "--gpu", "no-such-card"]),
]


@pytest.mark.parametrize("route, query, argv", SAME)
def test_the_api_answers_what_the_cli_prints_with_json(route, query, argv):
    code, data = cli_json([route, *argv])
    status, answer, answer_code = route_answer(route, query, None)
    assert answer == data
    assert answer_code == code
    assert status == (200 if "error" not in data else 400)


def test_an_uploaded_config_answers_what_config_json_prints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(DEBUG_CONFIG))
    code, data = cli_json(["estimate", "--config", "config.json", "--task", "lora",
                           "--override", "num_hidden_layers=3"])
    status, answer, _ = route_answer("estimate", {"task": "lora", "override": ["num_hidden_layers=3"]}, DEBUG_CONFIG)
    assert (status, code) == (200, 0)
    assert answer == data
    assert answer["model"]["name"] == "config.json (num_hidden_layers=3)"


def test_a_bad_upload_gets_llamems_own_config_message():
    status, answer, code = route_answer("estimate", {}, {**DEBUG_CONFIG, "hidden_size": -5})
    assert (status, code, answer["error"]["type"]) == (400, 1, "ConfigError")
    assert "hidden_size" in answer["error"]["message"]
    status, answer, code = route_answer("estimate", {}, ["not", "an", "object"])
    assert answer["error"]["message"].startswith("config.json: holds list, not a JSON object")


@pytest.mark.parametrize("key", ["config", "emit", "html", "save-trace", "verify", "json", "code"])
def test_options_that_name_files_are_refused(key):
    status, answer, code = route_answer("plan", {"model": "debug", "budget": "1GiB", key: "/tmp/x"}, None)
    assert (status, code, answer["error"]["type"]) == (400, 2, "UsageError")
    assert answer["error"]["message"].startswith(f"{key}: not taken by the server")


@pytest.mark.parametrize("name", ["cfg", "./cfg", "cfg/config.json", "../cfg", "/etc/passwd", "~root", "a\0b",
                                  "-h", "x" * 5000])
def test_a_model_name_never_reads_a_local_path(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(DEBUG_CONFIG))
    assert cli_json(["estimate", "cfg"])[0] == 0  # the command line reads the folder ...
    for field in ("model", "teacher"):  # ... the server does not
        status, answer, code = route_answer("estimate", {"model": "debug", "task": "distill", field: name}, None)
        assert status == 400 and answer["error"]["type"] in ("UnknownModel", "UsageError")


def test_fits_on_one_card_is_the_estimates_device_figure():
    _status, estimate, _code = route_answer("estimate", {"model": "debug", "batch": "8"}, None)
    _status, fits, _code = route_answer("fits", {"model": "debug", "batch": "8"}, None)
    assert fits["counts"][0] == {"num_gpus": 1, "layout": "1 GPU", "device_bytes": estimate["device_bytes"]}
    assert all(row["num_gpus"] == 1 for row in fits["gpus"])
    _status, fits, _code = route_answer("fits", {"model": "llama-3.1-70b", "task": "train", "ac": "full",
                                                 "precision": "bf16-mixed", "optimizer": "adamw"}, None)
    by_name = {row["name"]: row for row in fits["gpus"]}
    assert by_name["h100-80gb"]["num_gpus"] > 1 and by_name["h100-80gb"]["layout"].startswith("zero3")
    sizes = [c["device_bytes"] for c in fits["counts"]]
    assert sizes == sorted(sizes, reverse=True)


def test_the_bundle_in_memory_is_what_emit_writes(tmp_path):
    from llamem.bundle.emit import bundle_runs, emit_bundle
    from llamem.cli import plan_result
    from llamem.web import api

    query = {"model": "debug", "budget": "2GiB", "batch": "4", "seq": "256", "gpus": "2"}
    status, answer, code = route_answer("emit", query, None)
    assert (status, code) == (200, 0)
    with api.parsed("plan", query) as ctx:
        params = {k: v for k, v in ctx.params.items() if k not in api.OUTPUT_PARAMS}
        plan = plan_result(**params, runnable=bundle_runs("any"))
    bundle = emit_bundle(plan, tmp_path / "b")
    written = {name: (tmp_path / "b" / name).read_text() for name in bundle.files}
    assert answer["files"] == written
    assert (answer["strategy"], answer["launcher"]) == (bundle.strategy, bundle.launcher)
    assert answer["command"] == plan.command
    _status, answer, _code = route_answer("emit", {"model": "debug", "budget": "1MiB", "no-truncation": "1"}, None)
    assert answer["message"] == "no bundle: the plan does not fit"


@pytest.fixture(scope="module")
def server():
    srv = make_server("127.0.0.1", 0, log=io.StringIO())
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    sent = {"Host": f"127.0.0.1:{port}", **(headers or {})}
    if body is not None and "Content-Length" not in sent:
        sent["Content-Length"] = str(len(body))
    for key, value in sent.items():
        conn.putheader(key, value)
    conn.endheaders()
    if body is not None:
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading the rest
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), data


def api_error(data: bytes) -> dict:
    return json.loads(data)["error"]


def test_the_page_and_its_files_are_served_with_a_strict_policy(server):
    status, headers, data = request(server, "GET", "/")
    assert status == 200 and b'<script src="app.js">' in data
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for name in ("/app.js", "/charts.js", "/style.css"):
        assert request(server, "GET", name)[0] == 200


@pytest.mark.parametrize("path", ["/../../etc/passwd", "/static/../server.py", "/%2e%2e/%2e%2e/etc/passwd",
                                  "//etc/passwd", "/etc/passwd", "/app.js%00.py", "/app.js\\..\\server.py",
                                  "/index.html/..", "/api/../../etc/passwd", "/api/%00"])
def test_no_request_path_reaches_the_file_system(server, path):
    status, _headers, data = request(server, "GET", path)
    assert status == 404
    assert b"root:" not in data and b"import" not in data
    assert api_error(data)["type"] == "UsageError"


def test_hostile_requests_get_json_errors_and_the_server_keeps_answering(server):
    huge = b"{" + b" " * (MAX_BODY_BYTES + 10) + b"}"
    status, _headers, data = request(server, "POST", "/api/estimate", huge)
    assert status == 413 and "at most 1,048,576" in api_error(data)["message"]
    status, _h, data = request(server, "POST", "/api/estimate", b"", {"Content-Length": str(2**40)})
    assert status == 413
    assert request(server, "POST", "/api/estimate", b"{not json")[0] == 400
    assert request(server, "POST", "/api/estimate", b"[1, 2]")[0] == 400
    assert request(server, "POST", "/api/estimate", b"\xff\xfe")[0] == 400
    deep = b"[" * 200_000 + b"]" * 200_000
    assert request(server, "POST", "/api/estimate", deep[:MAX_BODY_BYTES])[0] in (400, 413)
    status, _h, data = request(server, "POST", "/api/estimate", b"{}", {"Content-Length": "abc"})
    assert status == 411
    body = json.dumps({"model": "debug", "config": "x" * 100}).encode()
    status, _h, data = request(server, "POST", "/api/estimate", body)
    assert status == 400 and api_error(data)["type"] == "ConfigError"
    assert request(server, "GET", "/api/estimate?" + "batch=1&" * 500)[0] == 400
    assert request(server, "GET", "/api/estimate?model=debug&batch=%ff")[0] == 400
    assert request(server, "GET", "/api/estimate?model=" + "x" * 70_000)[0] == 414
    assert request(server, "GET", "/api/nothing")[0] == 404
    assert request(server, "DELETE", "/api/estimate")[0] == 501
    status, _h, data = request(server, "GET", "/api/estimate?model=debug", headers={"Host": "evil.example"})
    assert status == 421
    status, headers, data = request(server, "GET", "/api/estimate?model=debug&batch=2")
    assert status == 200 and headers["X-Llamem-Exit-Code"] == "0"
    assert json.loads(data) == cli_json(["estimate", "debug", "--batch", "2"])[1]


def test_an_upload_over_http_and_an_error_with_its_exit_code(server):
    body = json.dumps({"task": "lora", "config": DEBUG_CONFIG}).encode()
    status, _h, data = request(server, "POST", "/api/estimate", body, {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["model"]["name"] == "config.json"
    status, headers, data = request(server, "GET", "/api/plan?model=debug&budget=1MiB&no-truncation=1")
    assert status == 200 and headers["X-Llamem-Exit-Code"] == "3" and json.loads(data)["fits"] is False
    status, headers, data = request(server, "GET", "/api/estimate?model=debug&batch=-1")
    assert status == 400 and "--batch must be an integer from 1" in api_error(data)["message"]


def test_html_reports_are_self_contained(tmp_path):
    estimate_page, plan_page = tmp_path / "estimate.html", tmp_path / "plan.html"
    assert main(["estimate", "debug", "--task", "lora", "--html", str(estimate_page)]) == 0
    assert main(["plan", "debug", "--budget", "2GiB", "--batch", "4", "--html", str(plan_page)]) == 0
    for page in (estimate_page, plan_page):
        text = page.read_text()
        assert text.startswith("<!DOCTYPE html>") and "window.LlamemCharts" in text
        assert not re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
        assert "<link" not in text and "@import" not in text
        data = json.loads(re.search(r'<script type="application/json" id="llamem-data">(.*?)</script>', text, re.S)[1])
        assert data
    assert json.loads(re.search(r'id="llamem-data">(.*?)</script>', plan_page.read_text(), re.S)[1])["plan"] == \
        cli_json(["plan", "debug", "--budget", "2GiB", "--batch", "4"])[1]
    assert main(["estimate", "debug", "--html", str(tmp_path)]) == 1  # a folder: the error names --html


def test_report_and_serve_are_commands():
    from llamem.cli import app

    assert "--html" in [opt for p in app.commands["report"].params for opt in p.opts]
    assert {"--host", "--port"} <= {opt for p in app.commands["serve"].params for opt in p.opts}


def test_llamem_serve_listens_on_localhost_and_answers():
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "llamem", "serve", "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("llamem serve: http://127.0.0.1:")
        port = int(re.search(r":(\d+)/", line)[1])
        status, _headers, data = request(port, "GET", "/api/options")
        assert status == 200 and "estimate" in json.loads(data)
    finally:
        process.terminate()
        process.wait(timeout=30)
