"""The HTTP layer of `llamem serve`, on the standard library's `ThreadingHTTPServer`.

Why the standard library: the page needs a few JSON routes and four static files; an ASGI stack
would be a new dependency for every user of a torch-free, offline tool, for no gain at this size.

What a request can reach: the static files are read once, at start, from the package into memory
and served from a fixed table (no request path is joined to a folder); the API turns fields into a
command line (`llamem.web.api`), whose options that name files are refused; bodies are at most
MAX_BODY_BYTES and parsed as JSON data only. Every error is answered as the JSON `--json` prints.
"""

from __future__ import annotations

import json
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from llamem.errors import EXIT_INVALID_INPUT, EXIT_USAGE
from llamem.web import api

MAX_BODY_BYTES = 2**20
"""A config.json is a few KiB; a body above 1 MiB is refused (413) unread."""
MAX_FIELDS = 200
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8"),
          "/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8")}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_PAGE_POLICY = ("default-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
                "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def static_files() -> dict[str, bytes]:
    """The page's files, read once from the installed package."""
    folder = resources.files("llamem.web") / "static"
    return {name: (folder / name).read_bytes() for name, _type in set(STATIC.values())}


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, *, local_only: bool, log=None):
        self.files = static_files()
        self.local_only = local_only
        self.log = log if log is not None else sys.stderr  # kept: sys.stderr is swapped while a command runs
        super().__init__(address, Handler)

    def handle_error(self, request, client_address) -> None:
        """A client that left before its answer is no error; anything else is logged, and the
        server goes on answering."""
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        import traceback

        self.log.write(f"error answering {client_address[0]}:\n{traceback.format_exc()}")


def make_server(host: str = "127.0.0.1", port: int = 8000, log=None) -> Server:
    from llamem.errors import LlamemError

    try:
        return Server((host, port), local_only=host in ("127.0.0.1", "localhost", "::1"), log=log)
    except OSError as err:
        raise LlamemError(f"cannot listen on {host}:{port} ({err.strerror or err}): choose another --port") from None


class Handler(BaseHTTPRequestHandler):
    server: Server
    server_version = "llamem"
    sys_version = ""
    timeout = 30  # a client that stops sending mid-request is dropped
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        self.server.log.write(f"{self.address_string()} {format % args}\n")

    def do_GET(self) -> None:
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        if url.path in STATIC:
            name, content_type = STATIC[url.path]
            self._send(HTTPStatus.OK, self.server.files[name], content_type, {"Content-Security-Policy": _PAGE_POLICY})
        elif url.path.startswith("/api/"):
            query = self._query(url.query)
            if query is not None:
                self._api(url.path[len("/api/"):], query, None)
        else:
            self._error(HTTPStatus.NOT_FOUND, "UsageError", f"no such page {url.path[:200]!r}: open / for the page")

    def do_POST(self) -> None:
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        body = self._body()
        if body is None:
            return
        if not url.path.startswith("/api/"):
            self._error(HTTPStatus.NOT_FOUND, "UsageError", "POST goes to /api/estimate, /api/plan, /api/fits or "
                        "/api/emit")
            return
        config = body.pop("config", None)
        self._api(url.path[len("/api/"):], body, config)

    def _api(self, route: str, query: dict[str, Any], config: Any) -> None:
        from llamem.web.routes import route_answer

        status, data, code = route_answer(route, query, config)
        self._send(status, json.dumps(data, indent=2).encode("utf-8"), "application/json",
                   {"X-Llamem-Exit-Code": str(code), "Cache-Control": "no-store"})

    def _query(self, text: str) -> dict[str, Any] | None:
        try:
            fields = parse_qs(text, keep_blank_values=True, strict_parsing=False, errors="strict",
                              max_num_fields=MAX_FIELDS)
        except (ValueError, UnicodeDecodeError) as err:
            self._error(HTTPStatus.BAD_REQUEST, "UsageError", f"unreadable query string ({err})")
            return None
        return {key: values if len(values) > 1 or key == "override" else values[0] for key, values in fields.items()}

    def _body(self) -> dict[str, Any] | None:
        """The JSON object of a POST body, or None once an error has been answered."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._error(HTTPStatus.LENGTH_REQUIRED, "UsageError", "send a Content-Length header with the body")
            return None
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the body is left unread: the connection cannot be reused
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "UsageError",
                        f"the body is {int(length):,} bytes; at most {MAX_BODY_BYTES:,} (a config.json is a few KiB)")
            return None
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            self._error(HTTPStatus.BAD_REQUEST, "ConfigError", f"the body is not JSON ({str(err)[:200]})")
            return None
        if not isinstance(body, dict):
            self._error(HTTPStatus.BAD_REQUEST, "UsageError", "the body is one JSON object of options")
            return None
        return body

    def _host_ok(self) -> bool:
        """A server on 127.0.0.1 answers only requests addressed to it by a local name: a page of another
        site that makes a browser resolve its name to 127.0.0.1 (DNS rebinding) is refused."""
        header = self.headers.get("Host") or ""
        host = header.partition("]")[0] + "]" if header.startswith("[") else header.partition(":")[0]
        if not self.server.local_only or host in LOCAL_HOSTS:
            return True
        self._error(HTTPStatus.MISDIRECTED_REQUEST, "UsageError",
                    "this server answers requests to 127.0.0.1 or localhost only (start it with --host to open it)")
        return False

    def _error(self, status: HTTPStatus, kind: str, message: str) -> None:
        code = EXIT_USAGE if kind == "UsageError" else EXIT_INVALID_INPUT
        data = api.error_body(kind, message, code)
        self._send(status, json.dumps(data, indent=2).encode("utf-8"), "application/json",
                   {"X-Llamem-Exit-Code": str(code)})

    def _send(self, status: HTTPStatus, data: bytes, content_type: str, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for key, value in headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

